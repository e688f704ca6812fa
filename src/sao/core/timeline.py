"""Where a run's time goes: the step's phase timers, and the run's timeline in the Chrome trace event format.

    Phases      a step's stopwatch: phases nest, and every second is charged to the innermost phase open then
                (to "other" when none is), so a record's ``time_*`` fields add up to its ``time`` exactly
    phase()     what code below the trainer calls to name a part of the step running on its thread (the local
                sampler's draw; ``waiting_on_env`` for an environment call); a no-op on any other thread
    recorder    this process's spans and instants (``start``, ``recording``), from any thread: the trainer, the
                sampler, environment calls, vLLM requests as sao sees them; a Ray worker hands its own back with
                each draw. Tracks are named (process, thread); ``TraceFile`` numbers them
    TraceFile   OUT/timeline.json, which Perfetto and chrome://tracing open: closed after every write (one write
                call appends a step's events and the closing brackets), repaired when a killed run resumes, and
                bounded: a rolling window of the newest steps, at most ``MAX_EVENTS_PER_STEP`` detail events each

Timestamps are this host's wall clock (a Ray worker on another host brings its own). Deliberately left out:
sampling profilers and GPU kernel timelines (``torch.profiler``'s job), and aligning clocks across hosts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sao.core.io import atomic_write

# The phases of a step, in the order a step meets them; ``time_<phase>`` in every record (seconds, each phase's own
# time: a phase nested in another is not counted twice), and ``time_other`` the rest.
PHASES = (
    "wait",  # in the source's next_batch, not drawing here: waiting for workers, servers or a trace log
    "draw",  # drawing in this process (the local sampler; the vLLM sampler's requests)
    "env",  # of the draw, waiting on environment calls (building, init, steps, close)
    "score",  # the scorer's rewards
    "pass",  # the teacher-forced pass, the loss and its backward, micro-batch by micro-batch
    "checks",  # the hooks that read the pass before any update (the footing audit, the mismatch re-score)
    "update",  # gradients summed over ranks, clipped, AdamW
    "publish",  # the new adapter to the source and the hooks (written, put on Ray, loaded into vLLM)
    "eval",  # evaluations during the step (the gate's held-aside tasks, --eval-every)
    "critic",  # the critic's squared-error steps
    "stats",  # the step record's statistics
)
OTHER = "other"
TIMING_FIELDS = ("time", "time_sample", *(f"time_{p}" for p in PHASES), "time_other", "time_env_share")

TRAINER = "trainer rank {rank}"  # a trainer process's track; thread "step" holds its phases
LOCAL_SAMPLER = "local sampler"  # the local source's trajectories, a thread per row
REMOTE = "{engine} requests (as seen from sao)"  # a remote engine's (vLLM's) requests, a thread per sender
ENV = "environment calls"
MAX_EVENTS_PER_STEP = 4000  # detail events kept per step (trajectories, requests, calls); the rest are counted


def now() -> float:
    """Wall-clock seconds (what every event's timestamp is taken from)."""
    return time.time()


# --- the step's stopwatch ----------------------------------------------------------------------------------------

_local = threading.local()  # .phases: the Phases running on this thread; .env_waited: seconds waited on environments


class Phases:
    """One step's phase timers. ``with clock:`` makes it the stopwatch of this thread (``phase()`` reaches it);
    ``clock.phase(name)`` times a phase; ``fields()`` gives the record's ``time``, ``time_<phase>``, ``time_other``
    and ``time_env_share`` (the environment's share of the draw, None with no draw here) so far."""

    def __init__(self) -> None:
        self.epoch, self.origin = now(), time.perf_counter()
        self.mark = self.origin  # time up to here is charged
        self.open: list[str] = []
        self.seconds: dict[str, float] = {}
        self.intervals: list[tuple[str, float, float]] = []  # (phase, start, end) in perf_counter seconds
        self.last = self.origin
        self.env_share: float | None = None  # set by a source whose trajectories were drawn elsewhere
        self._outer: list[Phases | None] = []

    def __enter__(self) -> Phases:
        self._outer.append(getattr(_local, "phases", None))
        _local.phases = self
        return self

    def __exit__(self, *exc: object) -> None:
        _local.phases = self._outer.pop()

    def _charge(self, t: float) -> None:
        key = self.open[-1] if self.open else OTHER
        self.seconds[key] = self.seconds.get(key, 0.0) + (t - self.mark)
        self.mark = t

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        self._charge(start)
        self.open.append(name)
        try:
            yield
        finally:
            end = time.perf_counter()
            self._charge(end)
            self.open.pop()
            self.intervals.append((name, start, end))

    def fields(self) -> dict[str, Any]:
        self.last = time.perf_counter()
        self._charge(self.last)
        out: dict[str, Any] = {"time": self.last - self.origin}
        out.update({f"time_{p}": self.seconds.get(p, 0.0) for p in PHASES})
        out["time_other"] = self.seconds.get(OTHER, 0.0)
        drawn = out["time_draw"] + out["time_env"]
        here = out["time_env"] / drawn if drawn > 0 else None
        out["time_env_share"] = self.env_share if self.env_share is not None else here
        return out

    def at(self, t: float) -> float:
        """A perf_counter reading as wall-clock seconds."""
        return self.epoch + (t - self.origin)

    def emit(self, process: str, args: dict[str, Any]) -> None:
        """The step (up to the last ``fields()``) and its phases as spans on ``process``'s thread "step", if this
        process records."""
        recorder = _recorder
        if recorder is None:
            return
        step = args.get("step")
        for name, start, end in self.intervals:
            recorder.add(_span(name, "phase", process, "step", self.at(start), self.at(end), {"step": step}), True)
        label = f"step {step}" if step is not None else "step"
        recorder.add(_span(label, "step", process, "step", self.epoch, self.at(self.last), args), True)


def running() -> Phases | None:
    """The stopwatch of the step running on this thread, if one is."""
    return getattr(_local, "phases", None)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Phase ``name`` of the step running on this thread, if one is (else nothing)."""
    clock = getattr(_local, "phases", None)
    if clock is None:
        yield
        return
    with clock.phase(name):
        yield


@contextlib.contextmanager
def waiting_on_env() -> Iterator[None]:
    """This thread waits on an environment call: ``env_waited()`` grows, and inside the step's draw it is the "env"
    phase (an evaluation's episodes stay the evaluation's)."""
    start = time.perf_counter()
    clock = getattr(_local, "phases", None)
    try:
        if clock is not None and clock.open and clock.open[-1] == "draw":
            with clock.phase("env"):
                yield
        else:
            yield
    finally:
        _local.env_waited = getattr(_local, "env_waited", 0.0) + (time.perf_counter() - start)


def env_share(draws: list[tuple[float, float, float]]) -> None:
    """A source whose trajectories were drawn elsewhere (Ray workers, vLLM threads) gives the step on this thread the
    environment's share of them: the mean over ``draws`` (start, end, seconds on the environment) of each one's."""
    clock = getattr(_local, "phases", None)
    shares = [min(env / (end - start), 1.0) for start, end, env in draws if end > start]
    if clock is not None and shares:
        clock.env_share = sum(shares) / len(shares)


def env_waited() -> float:
    """Seconds this thread has waited on environment calls so far (differences time a draw's share)."""
    return getattr(_local, "env_waited", 0.0)


# --- the recorder ------------------------------------------------------------------------------------------------


def _finite(value: Any) -> Any:
    """A value an event's args may hold: non-finite floats as None, anything unusual as its text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    return str(value)


def _span(name: str, cat: str, process: str, thread: str, start: float, end: float, args: dict[str, Any]) -> dict:
    """A complete event ("X") from wall-clock seconds."""
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "ts": start * 1e6,
        "dur": max(end - start, 0.0) * 1e6,
        "pid": process,
        "tid": thread,
        "args": _finite(args),
    }


class Recorder:
    """Events of this process, from any thread, until ``drain``; past ``limit`` detail events between two drains
    the rest are counted in ``dropped`` (events added with ``keep``, a step's phases, always stay)."""

    def __init__(self, limit: int = MAX_EVENTS_PER_STEP):
        self.limit, self.dropped = limit, 0
        self.suffix = ""  # after the process names of this process's own tracks (a Ray worker's: " (ray worker w0)")
        self._events: list[dict[str, Any]] = []
        self._detail = 0
        self._lock = threading.Lock()
        self._threads: dict[tuple[str, int], str] = {}

    def add(self, event: dict[str, Any], keep: bool = False) -> None:
        with self._lock:
            if not keep:
                if self._detail >= self.limit:
                    self.dropped += 1
                    return
                self._detail += 1
            self._events.append(event)

    def extend(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            self.add(event)

    def drain(self) -> tuple[list[dict[str, Any]], int]:
        """(the events since the last drain, how many were dropped meanwhile)."""
        with self._lock:
            events, dropped = self._events, self.dropped
            self._events, self._detail, self.dropped = [], 0, 0
        return events, dropped

    def thread(self, kind: str) -> str:
        """A short stable name for the calling thread: "<kind> 1", "<kind> 2", ... in order of first use."""
        key = (kind, threading.get_ident())
        name = self._threads.get(key)
        if name is None:
            with self._lock:
                name = self._threads.setdefault(key, f"{kind} {sum(k == kind for k, _ in self._threads) + 1}")
        return name


_recorder: Recorder | None = None


def start(limit: int = MAX_EVENTS_PER_STEP) -> Recorder:
    """Record this process's events from now on (the recorder already recording, if any)."""
    global _recorder
    if _recorder is None:
        _recorder = Recorder(limit)
    return _recorder


def stop() -> None:
    global _recorder
    _recorder = None


def recording() -> Recorder | None:
    """This process's recorder, or None when it records nothing (every caller's cheap test)."""
    return _recorder


def thread(kind: str) -> str:
    """The calling thread's track name ("<kind> N"), or "" when this process records nothing."""
    recorder = _recorder
    return recorder.thread(kind) if recorder is not None else ""


def complete(name: str, cat: str, process: str, thread: str, start: float, end: float, **args: Any) -> None:
    """A span from ``start`` to ``end`` (wall-clock seconds), if this process records."""
    recorder = _recorder
    if recorder is not None:
        recorder.add(_span(name, cat, process, thread, start, end, args))


def instant(name: str, cat: str, process: str, thread: str, **args: Any) -> None:
    """A moment (a delivery check's verdict, a resume), if this process records."""
    recorder = _recorder
    if recorder is not None:
        recorder.add(
            {
                "name": name,
                "cat": cat,
                "ph": "i",
                "s": "t",
                "ts": now() * 1e6,
                "pid": process,
                "tid": thread,
                "args": _finite(args),
            },
            True,
        )


@contextlib.contextmanager
def span(name: str, cat: str, process: str, thread: str | None = None, **args: Any) -> Iterator[dict[str, Any]]:
    """A span around the block, if this process records; the block may add to the yielded args. ``thread`` None:
    the calling thread's own track ("thread N" of ``process``)."""
    recorder = _recorder
    if recorder is None:
        yield args
        return
    start_s = now()
    try:
        yield args
    finally:
        recorder.add(_span(name, cat, process, thread or recorder.thread("thread"), start_s, now(), args))


# --- timeline.json ------------------------------------------------------------------------------------------------

TAIL = b"\n]}\n"  # every write ends the file with it
KINDS = (("trainer", 0), ("local sampler", 1), ("ray worker", 2), ("requests", 3), ("environment", 4))


class TraceFile:
    """OUT/timeline.json in the trace event format's object form: a header line, then one event per line, then
    ``]}``. ``write`` appends a step's events in one write call that ends the file with its brackets again, so a
    kill leaves a complete file; ``open`` on resume reads it back (cutting a partial last line a crash left) and
    goes on. Rolling window: once the file holds ``2 × steps`` steps it is rewritten with the newest ``steps``."""

    def __init__(self, path: str | os.PathLike[str], steps: int, about: dict[str, Any]):
        self.path, self.window, self.about = Path(path), max(int(steps), 1), dict(about)
        self.origin = 0.0  # µs since the epoch of ts 0
        self.pids: dict[str, int] = {}
        self.tids: dict[tuple[str, str], int] = {}
        self.names: list[bytes] = []  # the metadata events (process and thread names)
        self.chunks: deque[bytes] = deque()  # each step's event lines, the newest ``2 × window``
        self.steps_in_file = 0
        self.empty = True
        self.repaired: str | None = None  # what ``open`` found wrong and mended, in words

    def open(self, resume: bool) -> TraceFile:
        """A new file, or (``resume``) the run's file continued: read, repaired if a kill cut it, rewritten whole."""
        old = self._read() if resume and self.path.exists() else None
        if old is None:
            self.origin = now() * 1e6
            self._rewrite()
            return self
        header, events = old
        self.origin = float((header.get("otherData") or {}).get("origin_unix_us", now() * 1e6))
        chunk: list[bytes] = []
        for event in events:
            if event.get("ph") == "M":
                self._learn_name(event)
                continue
            chunk.append(_line(event))
            if event.get("cat") == "step":
                self.chunks.append(b",\n".join(chunk))
                chunk = []
        if chunk:  # the killed step's events
            self.chunks.append(b",\n".join(chunk))
        while len(self.chunks) > self.window:
            self.chunks.popleft()
        self._rewrite()
        return self

    def _read(self) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(header, events) of the file on disk; a cut last line dropped. None when it is not a timeline at all."""
        raw = self.path.read_bytes()
        try:
            whole = json.loads(raw)
            if isinstance(whole, dict) and isinstance(whole.get("traceEvents"), list):
                return {k: v for k, v in whole.items() if k != "traceEvents"}, whole["traceEvents"]
        except (ValueError, UnicodeDecodeError):
            pass
        lines = raw.split(b"\n")
        try:
            header = json.loads(lines[0] + b"]}")
        except (ValueError, UnicodeDecodeError):
            self.repaired = f"{self.path} was not a timeline sao wrote: started a new one"
            return None
        events = []
        for line in lines[1:]:
            line = line.strip().rstrip(b",")
            if not line or line == b"]}":
                continue
            try:
                event = json.loads(line)
            except (ValueError, UnicodeDecodeError):
                break  # the line a kill cut: it and anything after it
            if isinstance(event, dict):
                events.append(event)
        self.repaired = f"{self.path} was cut short (a killed run): kept its {len(events)} complete events"
        return header, events

    def _learn_name(self, event: dict[str, Any]) -> None:
        """Rebuild the numbering from a metadata event read back."""
        name = (event.get("args") or {}).get("name")
        if event.get("name") == "process_name" and isinstance(name, str):
            self.pids[name] = int(event["pid"])
        elif event.get("name") == "thread_name" and isinstance(name, str):
            process = next((p for p, n in self.pids.items() if n == event["pid"]), None)
            if process is not None:
                self.tids[(process, name)] = int(event["tid"])
        self.names.append(_line(event))

    def _ids(self, process: str, thread: str, new: list[bytes]) -> tuple[int, int]:
        pid = self.pids.get(process)
        if pid is None:
            pid = self.pids[process] = len(self.pids) + 1
            order = next((rank for word, rank in KINDS if word in process), len(KINDS))
            for event in (
                {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}},
                {
                    "name": "process_sort_index",
                    "ph": "M",
                    "pid": pid,
                    "tid": 0,
                    "args": {"sort_index": order * 1000 + pid},
                },
            ):
                new.append(_line(event))
        tid = self.tids.get((process, thread))
        if tid is None:
            tid = self.tids[(process, thread)] = 1 + sum(p == process for p, _ in self.tids)
            last = thread.rsplit(" ", 1)[-1]
            order = int(last) if last.isdigit() else -1  # "step" first, then rows and threads by number
            new.append(_line({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread}}))
            new.append(
                _line({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": order}})
            )
        return pid, tid

    def write(self, events: list[dict[str, Any]]) -> None:
        """One step's events (ts and dur in µs since the epoch, pid and tid as names), appended and closed."""
        names: list[bytes] = []
        lines = []
        for event in events:
            out = dict(event)
            out["pid"], out["tid"] = self._ids(str(event["pid"]), str(event["tid"]), names)
            out["ts"] = round(event["ts"] - self.origin, 1)
            if "dur" in out:
                out["dur"] = round(out["dur"], 1)
            lines.append(_line(out))
        self.names += names
        chunk = b",\n".join(lines)
        self.chunks.append(chunk)
        self.steps_in_file += 1
        while len(self.chunks) > 2 * self.window:
            self.chunks.popleft()
        if self.steps_in_file > 2 * self.window:
            while len(self.chunks) > self.window:
                self.chunks.popleft()
            self._rewrite()
            return
        body = b",\n".join(part for part in (*names, chunk) if part)
        if not body:
            return
        with open(self.path, "r+b", buffering=0) as handle:
            handle.seek(-len(TAIL), os.SEEK_END)
            handle.write((b"" if self.empty else b",\n") + body + TAIL)  # one write: the file stays closed
        self.empty = False

    def _rewrite(self) -> None:
        about = {
            **self.about,
            "origin_unix_us": self.origin,
            "window_steps": self.window,
            "note": "ts in µs since origin_unix_us; open in Perfetto or chrome://tracing",
        }
        header = {"displayTimeUnit": "ms", "otherData": about}
        head = json.dumps(header)[:-1].encode() + b', "traceEvents": [\n'
        body = b",\n".join(part for part in (*self.names, *self.chunks) if part)
        atomic_write(self.path, head + body + TAIL, durable=False)
        self.steps_in_file, self.empty = len(self.chunks), not body


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event, separators=(",", ":"), allow_nan=False).encode()


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A timeline.json as its JSON object (what Perfetto reads); a file cut by a kill is read up to its cut."""
    found = TraceFile(path, 1, {})._read()
    if found is None:
        raise ValueError(f"{path} is not a timeline")
    header, events = found
    return {**header, "traceEvents": events}
