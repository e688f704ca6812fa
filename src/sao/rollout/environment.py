"""The environment seam: what an agent's trajectory talks to between its actions.

One interface, the ecosystem's (SkyRL-Gym's text environment), so that its environments plug in unchanged:

    init(prompt_messages) -> (messages, info)
    step(action_text)     -> {"observations": [messages], "reward": float, "done": bool, "metadata": {...}}
    close()

Observation segments are not actions (no log-probability, coefficient or critic loss); each step's reward lands on
the last action token of its turn. Read when present: ``stop_strings``, and ``tool_calls``/``tool_errors`` metadata.
``async def`` methods are accepted as they are (``check_env`` refuses a wrong mix); ``EnvCalls`` runs every call
(building, init, step, close) off the decoding thread, bounded, contained (what it raises or a ``sys.exit`` is an
``EnvFault``: one line naming the environment, the call and the task, as ``sao.core.plugins`` words it) and under
--env-timeout. Deliberately left out: tool registries and sandboxes,
killing a hung plain step (its thread is abandoned), anything that needs the network.
Design notes: docs/design/environment.md.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict

from sao.core import timeline
from sao.core.errors import ConfigError
from sao.core.plugins import PluginError, failure
from sao.core.reading import preview, reward_problem

Message = dict[str, str]  # {"role": ..., "content": ...}


class StepOutput(TypedDict, total=False):
    observations: list[Message]
    reward: float
    done: bool
    metadata: dict[str, Any]


class TextEnv(Protocol):
    """A text environment in SkyRL-Gym's shape."""

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]: ...

    def step(self, action: str) -> StepOutput: ...

    def close(self) -> None: ...


# Builds one environment for one task: (task id, the task's fields such as {"answer": "18"}) -> TextEnv.
EnvFactory = Callable[[str, dict[str, Any]], TextEnv]


STOP_TAIL = 16  # an action's last tokens decoded to look for one of the environment's stop strings
CHARS_PER_TOKEN = 32  # an observation longer than this many characters a token of room is judged on a prefix

SENTINEL = "\u0000sao-action\u0000"


def render_observation(tokenizer: Any, observations: list[Message], eos_text: str | None) -> str:
    """The text that follows an action in the chat template: the rest of the assistant turn's closing, the
    observation messages, and the next assistant header.

    Rendered as the difference of two template calls around a sentinel action, so that whatever the template
    adds (Qwen2.5 wraps a "tool" message in ``<tool_response>``, a model without tool support gets a plain
    role) comes out exactly as the model would see it in a whole conversation. ``eos_text``: the EOS token's
    text when the action already ended with it (then it is not repeated), None when the action ended at a
    stop string (then the template's own turn closing is kept, as observation text).
    """
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": SENTINEL}]
    full = tokenizer.apply_chat_template([*history, *observations], tokenize=False, add_generation_prompt=True)
    after = full[full.index(SENTINEL) + len(SENTINEL) :]
    if eos_text and after.startswith(eos_text):
        after = after[len(eos_text) :]
    return after


def reaches_stop(tokenizer: Any, action: list[int], stops: tuple[str, ...]) -> bool:
    """Whether an action's tokens so far end in one of the environment's ``stop_strings`` (its last ``STOP_TAIL``
    decoded): the action ends there, as at EOS."""
    return bool(stops) and tokenizer.decode(action[-STOP_TAIL:], skip_special_tokens=False).endswith(stops)


def encode_bounded(tokenizer, text: str, room: int) -> list[int] | None:
    """The observation's tokens, or None when it has at least ``room`` of them: a huge text is judged on a prefix of
    ``CHARS_PER_TOKEN`` characters a token of room, so a tool that answers with megabytes costs little."""
    limit = CHARS_PER_TOKEN * (room + 1)
    if len(text) > limit:
        head = tokenizer(text[:limit], add_special_tokens=False)["input_ids"]
        if len(head) >= room:
            return None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- calling environments off the decoding thread ------------------------------------------------------------------


def check_env(env: Any, where: str = "environment") -> bool:
    """Whether ``env`` (an environment or its class) steps asynchronously (``async def step``); a wrong mix of plain
    and ``async def`` methods is a one-line ConfigError. ``step`` decides: an async ``step`` may come with a plain or
    an async ``init``/``close``; a plain ``step`` with an async ``init`` or ``close`` is refused (whatever the
    coroutine set up belongs to an event loop the plain step never runs on), and so is an async generator."""
    kind = env if isinstance(env, type) else type(env)
    name = f"{where} {kind.__module__}.{kind.__qualname__}"
    methods = {m: getattr(env, m, None) for m in ("init", "step", "close")}
    generators = [m for m, f in methods.items() if inspect.isasyncgenfunction(f)]
    if generators:
        raise ConfigError(
            f"{name}: {', '.join(generators)} is an async generator (it yields); make it async def that "
            "returns, or a plain def"
        )
    is_async = {m: inspect.iscoroutinefunction(f) for m, f in methods.items()}
    if not is_async["step"] and (is_async["init"] or is_async["close"]):
        wrong = " and ".join(m for m in ("init", "close") if is_async[m])
        raise ConfigError(
            f"{name}: {wrong} is async def but step is not; make step async def too (sao awaits it on "
            "its own event loop) or make every method a plain def"
        )
    return is_async["step"]


# The environment contract, checked on what every call returns: a one-line PluginError naming the environment and
# the task for anything else.


def checked_init(result, name: str, task: str):
    """``env.init``'s (messages, info), or a one-line error naming the environment and the task."""
    if not (
        isinstance(result, tuple | list)
        and len(result) == 2
        and isinstance(result[0], list)
        and (result[1] is None or isinstance(result[1], dict))
    ):
        raise PluginError(f"{name} (init) returned {preview(result)} on {task}; init returns (messages, info)")
    return result


def checked_step(result, name: str, task: str) -> dict:
    """``env.step``'s output with its reward checked by the one rule for rewards (absent: 0), or a
    one-line error naming the environment and the task."""
    if not isinstance(result, dict):
        raise PluginError(
            f"{name} (step) returned {preview(result)} on {task}; step returns a dict with observations, reward, done"
        )
    reward = result.get("reward", 0.0)  # absent: a turn without a reward; None is refused as --reward refuses it
    problem = reward_problem(reward)
    if problem is not None:
        raise PluginError(f"{name} (step) on {task}: {problem}")
    observations = result.get("observations") or []
    if not isinstance(observations, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in observations
    ):
        raise PluginError(
            f"{name} (step) on {task}: observations must be a list of {{role, content}} messages, "
            f"got {preview(observations)}"
        )
    if result.get("metadata") is not None and not isinstance(result["metadata"], dict):
        raise PluginError(f"{name} (step) on {task}: metadata must be a dict, got {preview(result['metadata'])}")
    done = result.get("done", False)  # absent: the episode goes on
    if not (isinstance(done, bool) or type(done).__name__ == "bool_"):  # a string "false" is not false
        raise PluginError(f"{name} (step) on {task}: done must be true or false, got {preview(done)}")
    return {**result, "reward": float(reward), "observations": observations, "done": bool(done)}


ENV_METHODS = ("init", "step", "close")


def every_row_failed(name: str, rows: int, first: str | None) -> PluginError:
    """The one line for a batch in which the environment failed on every trajectory before the model could act
    (building it, ``init``, a hang past --env-timeout): nothing in it to train on or score, so the run stops."""
    what = f": {first}" if first else ""
    return PluginError(f"{name} failed on all {rows} trajectories of a batch before the model could act{what}")


def check_factory(factory: Any, where: str = "env_factory") -> None:
    """An environment factory passed in from Python: an environment class, or a callable ``(task_id, fields) ->
    environment``. An environment itself (an instance: each trajectory needs its own), or anything that cannot be
    called so, is a TypeError naming ``where``, before a run starts (None: no environment)."""
    if factory is None:
        return
    if not isinstance(factory, type) and all(callable(getattr(factory, m, None)) for m in ENV_METHODS):
        raise TypeError(
            f"{where} is an environment (a {type(factory).__qualname__}), not a factory: each trajectory "
            f"needs its own; pass its class, {type(factory).__qualname__}, or a function (task_id, fields) "
            "-> a new environment"
        )
    if not callable(factory):
        raise TypeError(
            f"{where} is {preview(factory)} ({type(factory).__name__}), not callable; pass an environment "
            "class or a function (task_id, fields) -> environment"
        )
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have no signature: trust them
        return
    try:
        signature.bind("task-id", {})
    except TypeError as error:
        raise TypeError(
            f"{where} {getattr(factory, '__qualname__', type(factory).__qualname__)} cannot be called as "
            f"(task_id, fields): {error}"
        ) from None


def checked_env(env: Any, name: str, task: str) -> Any:
    """What a factory built for ``task``: an environment (``init``, ``step`` and ``close``), or an ``EnvFault`` naming
    the environment and the task (a factory that returned None, a number, ...)."""
    if isinstance(env, type) or not all(callable(getattr(env, m, None)) for m in ENV_METHODS):
        raise EnvFault(
            f"{name} (building it) returned {preview(env)} on {task}; a factory returns an environment "
            "with init, step and close"
        )
    return env


def tool_count(meta: dict, key: str, name: str, task: str) -> int:
    """A step's ``metadata[key]`` count (tool_calls, tool_errors): a whole number >= 0, absent 0."""
    value = meta.get(key, 0) or 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1_000_000:
        raise PluginError(f"{name} (step) on {task}: metadata {key} must be a whole number >= 0, got {preview(value)}")
    return value


class EnvFault(Exception):
    """An environment call that did not answer usably: it raised, exited, ran past its deadline (``timed_out``) or
    answered what sao cannot use. ``str`` is one line naming the environment, the call and the task."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(eq=False)
class _Call:
    """One environment call in flight."""

    key: Any
    future: Future
    plugin: str  # "NAME (what)", as the one-line errors call it
    task: str
    what: str = "step"  # the call: step, init, close, building it
    started: float | None = None  # time.monotonic() when it began running (None: still queued)
    worker: _Worker | None = None  # the thread running a plain call
    cancel: Callable[[], Any] | None = None  # cancels an async call's task


@dataclass(eq=False)
class _Worker:
    abandoned: bool = False  # its call ran past the deadline: the thread ends when (if) the call returns
    index: int = 0  # its place in the pool (the timeline's "env thread N": a pool made per draw reuses the names)


@dataclass
class EnvCalls:
    """Environment methods called off the caller's thread: plain ones on ``workers`` daemon threads (a step that
    hangs past ``timeout`` seconds has its thread abandoned and replaced, so the pool keeps its size and the process
    can still exit), ``async def`` ones on one event loop in a daemon thread (cancelled past the deadline). The
    deadline counts from when a call starts running, not from when it was queued. ``timeout`` 0 (or None): no
    limit. ``name``: what the one-line faults call the environment (--env as given)."""

    workers: int = 1
    timeout: float | None = 0.0
    name: str = "the environment"
    _queue: queue.SimpleQueue = field(init=False, repr=False, default_factory=queue.SimpleQueue)
    _calls: dict[Any, _Call] = field(init=False, repr=False, default_factory=dict)  # key -> its call in flight
    _threads: int = field(init=False, default=0)
    _spawned: int = field(init=False, default=0)
    _loop: asyncio.AbstractEventLoop | None = field(init=False, repr=False, default=None)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)
    _slots: set[int] = field(init=False, repr=False, default_factory=set)  # the timeline's tracks of async calls

    def __post_init__(self) -> None:
        if self.timeout is not None and self.timeout <= 0:
            self.timeout = None  # no limit

    @property
    def in_flight(self) -> int:
        """Calls submitted and not yet collected."""
        return len(self._calls)

    def submit(self, key: Any, fn: Callable[..., Any], *args: Any, task: str = "its task", what: str = "step") -> None:
        """Start ``fn(*args)`` under ``key`` (one call per key at a time); ``collect`` hands back its outcome.
        ``task`` and ``what`` (the call: step, init, ...) name it in the one-line faults."""
        if key in self._calls:
            raise RuntimeError(f"an environment call under {key!r} is already in flight")
        self._calls[key] = self._start(key, fn, args, task, what)

    def _start(self, key: Any, fn: Callable[..., Any], args: tuple, task: str, what: str) -> _Call:
        plugin = f"{self.name} ({what})"
        if inspect.iscoroutinefunction(fn):
            loop = self._event_loop()
            call = _Call(key, Future(), plugin, task, started=time.monotonic(), what=what)
            coroutine = fn(*args) if timeline.recording() is None else self._timed(call, fn, args)
            task_future = asyncio.run_coroutine_threadsafe(coroutine, loop)
            call.cancel = task_future.cancel
            task_future.add_done_callback(lambda f, c=call: _copy_outcome(f, c.future))
            return call
        call = _Call(key, Future(), plugin, task, what=what)
        with self._lock:
            if self._threads < self.workers:
                self._spawn()
        self._queue.put((call, fn, args))
        return call

    def _spawn(self) -> None:
        """One more worker thread (under the lock)."""
        self._threads += 1
        self._spawned += 1
        threading.Thread(target=self._work, args=(_Worker(index=self._spawned),), daemon=True, name="sao-env").start()

    def _work(self, worker: _Worker) -> None:
        while not worker.abandoned:
            item = self._queue.get()
            if item is None:
                return
            call, fn, args = item
            call.worker, call.started = worker, time.monotonic()
            begun = timeline.now()
            try:
                value = fn(*args)
                if inspect.isawaitable(value):
                    _close_awaitable(value)
                    raise EnvFault(
                        f"{call.plugin} returned a coroutine without being async def on {call.task}; "
                        "declare it async def"
                    )
            except BaseException as error:  # a tool's failure is the trajectory's, not the run's
                _tell(call, begun, f"env thread {worker.index}", error=error)
                if not call.future.done():
                    call.future.set_exception(error)
            else:
                _tell(call, begun, f"env thread {worker.index}", value=value)
                if not call.future.done():
                    call.future.set_result(value)

    async def _timed(self, call: _Call, fn: Callable[..., Any], args: tuple) -> Any:
        """An async call, its span on a track of its own while it runs (async calls overlap on one thread)."""
        with self._lock:
            slot = min(set(range(len(self._slots) + 1)) - self._slots)
            self._slots.add(slot)
        begun = timeline.now()
        try:
            value = await fn(*args)
        except BaseException as error:
            _tell(call, begun, f"env async {slot + 1}", error=error)
            raise
        finally:
            with self._lock:
                self._slots.discard(slot)
        _tell(call, begun, f"env async {slot + 1}", value=value)
        return value

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, daemon=True, name="sao-env-loop").start()
                self._loop = loop
            return self._loop

    def collect(self, block: bool) -> list[tuple[Any, Any]]:
        """The calls that have ended, as (key, value or ``EnvFault``), sorted by key; with ``block``, waits until at
        least one has (a call past its deadline ends as an ``EnvFault``), unless none is in flight."""
        while True:
            done = self._take_done()
            if done or not block or not self._calls:
                return done
            with timeline.waiting_on_env():
                wait(
                    [c.future for c in self._calls.values()], timeout=self._next_deadline(), return_when=FIRST_COMPLETED
                )

    def call(self, fn: Callable[..., Any], *args: Any, task: str = "its task", what: str = "step") -> Any:
        """``fn(*args)`` off this thread under the deadline (an async one awaited); its value, or ``EnvFault``. Safe
        from several threads."""
        with timeline.waiting_on_env():
            call = self._start(object(), fn, args, task, what)
            while True:
                timeout = (
                    None
                    if self.timeout is None
                    else 0.05
                    if call.started is None
                    else max(0.0, call.started + self.timeout - time.monotonic())
                )
                wait([call.future], timeout=timeout)
                outcome = self._outcome(call)
                if outcome is not None:
                    break
        return _raise_fault(outcome[0])

    def _take_done(self) -> list[tuple[Any, Any]]:
        out = []
        for key in sorted(self._calls, key=_sort_key):
            outcome = self._outcome(self._calls[key])
            if outcome is not None:
                del self._calls[key]
                out.append((key, outcome[0]))
        return out

    def _outcome(self, call: _Call) -> tuple[Any] | None:
        """(value or EnvFault,) when the call has ended or run past its deadline, else None."""
        if call.future.done():
            error = call.future.exception()
            if error is None:
                return (call.future.result(),)
            if isinstance(error, EnvFault):
                return (error,)
            return (EnvFault(failure(error, call.plugin, call.task)),)
        if self.timeout is not None and call.started is not None and time.monotonic() - call.started > self.timeout:
            self._abandon(call)
            return (EnvFault(f"{call.plugin} did not return within {self.timeout:g} s on {call.task}", timed_out=True),)
        return None

    def _abandon(self, call: _Call) -> None:
        """A call past its deadline: an async one is cancelled; a plain one's thread is let go and replaced."""
        call.future.cancel()
        if call.cancel is not None:
            call.cancel()
        elif call.worker is not None and not call.worker.abandoned:
            call.worker.abandoned = True
            with self._lock:
                self._threads -= 1
                self._spawn()

    def _next_deadline(self) -> float | None:
        """Seconds until the next running call's deadline (short while some are still queued)."""
        if self.timeout is None:
            return None
        now = time.monotonic()
        waits = [c.started + self.timeout - now for c in self._calls.values() if c.started is not None]
        if any(c.started is None for c in self._calls.values()):
            waits.append(0.05)
        return max(0.0, min(waits)) if waits else 0.05

    def close(self) -> None:
        """Stop the idle threads and the event loop; calls still in flight are left to finish on their own."""
        with self._lock:
            for _ in range(self._threads):
                self._queue.put(None)
            self._threads = 0
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None


SPAN_NAMES = {"building it": "env.build", "init": "env.init", "step": "env.step", "close": "env.close"}


def _tell(call: _Call, begun: float, track: str, *, error: BaseException | None = None, value: Any = None) -> None:
    """The call's span on the timeline (``sao.core.timeline``), if this process records one: the task, how it
    ended, and for a step the tool calls and reward it reported."""
    recorder = timeline.recording()
    if recorder is None:
        return
    args: dict[str, Any] = {"task": call.task, "outcome": "ok" if error is None else type(error).__name__}
    if call.worker is not None and call.worker.abandoned:
        args["outcome"] = "returned past the timeout"
    if isinstance(value, dict):
        meta = value.get("metadata")
        for key in ("tool_calls", "tool_errors"):
            if isinstance(meta, dict) and isinstance(meta.get(key), int):
                args[key] = meta[key]
        if isinstance(value.get("reward"), int | float):
            args["reward"] = value["reward"]
    name = SPAN_NAMES.get(call.what, f"env.{call.what}")
    timeline.complete(name, "env", timeline.ENV + recorder.suffix, track, begun, timeline.now(), **args)


def _copy_outcome(source: Future, target: Future) -> None:
    if target.done():
        return
    if source.cancelled():
        target.set_exception(EnvFault("cancelled"))  # only ever after its deadline, when the fault is already told
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


def _close_awaitable(value: Any) -> None:
    close = getattr(value, "close", None)
    if callable(close):
        close()


def _raise_fault(outcome: Any) -> Any:
    if isinstance(outcome, EnvFault):
        raise outcome
    return outcome


def _sort_key(key: Any) -> tuple[int, Any]:
    return (0, key) if isinstance(key, int) else (1, id(key))
