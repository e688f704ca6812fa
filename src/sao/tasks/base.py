"""What every task source hands the layers above: ``Task`` (one prompt, its gold answer, the record's fields; it
owns its chat messages), ``TaskSet`` (a run's training prompts and held-out tasks, their instruction and their
reward) and ``Scorer`` (that reward, the one grader of training, eval and serving).

A reward is plain data in, a number out: ``reward(completion, row) -> float`` where ``row`` is a dict of the
task's fields (``id``, ``question``, ``answer`` and whatever the record held), or batched
``reward(completions, rows) -> list[float]`` (first parameter named ``completions``, or ``fn.batched = True``),
sync or ``async``. Every value it returns is checked by the one rule for rewards (``sao.core.reading``); what it
raises (``SystemExit`` too) is a one-line error naming the reward and the row, and a call past its timeout scores
its rows 0 as cut trajectories, counted (``sao.core.plugins``). A per-completion reward scores a batch's rows
concurrently (``concurrency`` calls at once, as environment steps run), so one that hangs costs its timeout once per
batch, not once per row.

Deliberately left out: loading (each source loads its own: ``gsm8k``, ``custom``, ``sao.tiny``) and drawing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sao.core import plugins
from sao.core.errors import ConfigError
from sao.core.plugins import PluginTimeout
from sao.core.reading import REWARD_LIMIT, preview, reward_problem
from sao.rollout.types import Rollout


@dataclass(frozen=True)
class Task:
    """One task: a prompt and its gold answer.

    ``id`` names the source and the row (GSM8K: ``gsm8k/test/17``); ``answer`` is the gold final answer
    (GSM8K: the text after the last ``####`` in its answer field, stripped: ``"18"``, ``"1,000"``).
    ``fields`` holds the record's raw fields, for a reward or an environment that needs more than the
    answer (GSM8K's loader leaves it empty); ``messages`` is the prompt as chat messages when the data gives
    one (``question`` is then its last user turn, the text decontamination and logs use). Both are left out
    of the hash (a dict and a list cannot be hashed) but not of equality; ``Task(id, question, answer)``
    leaves them empty.
    """

    id: str
    question: str
    answer: str
    fields: dict[str, Any] = field(default_factory=dict, hash=False)  # the record as read: {"answer": ..., ...}
    messages: list[dict[str, Any]] | None = field(default=None, hash=False)  # [{"role": ..., "content": ...}]

    def chat(self, instruction: str = "") -> list[dict[str, Any]]:
        """The chat messages the prompt is rendered from: the task's own ``messages`` as given (their author wrote
        the whole prompt), else one user turn, the question and then ``instruction`` after a blank line."""
        if self.messages is not None:
            return [dict(message) for message in self.messages]
        return user_turn(self.question, instruction)

    def row(self) -> Row:
        """The task as plain data for a reward or an environment: its fields, its id, question and answer."""
        return Row({**self.fields, "id": self.id, "question": self.question, "answer": self.answer})


def user_turn(question: str, instruction: str = "") -> list[dict[str, str]]:
    """Chat messages for one question: a single user turn, the question, a blank line, then the instruction. No
    system turn (the model's chat template supplies its default one); an empty instruction leaves the question
    alone."""
    question = question.strip()
    return [{"role": "user", "content": f"{question}\n\n{instruction.strip()}" if instruction.strip() else question}]


class Row(dict):
    """A task's fields as a dict (``row["answer"]``); ``row.answer`` reads the same key, for rewards written
    against the earlier ``task.answer``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass(frozen=True)
class TaskSet:
    """The training prompts and held-out tasks of one run, with the counts that produced them.

    ``counts`` holds ``train_pool`` and ``test_pool`` (the split sizes), ``test`` (held out),
    ``train_contaminated`` (training questions dropped for sharing an 8-gram with a held-out question),
    ``train_kept`` (the pool left after that) and ``train`` (sampled from the kept pool).
    ``source`` is ``hub:<id>``, ``local:<directory name>``, ``file:<name>``, ...; ``instruction`` is appended to
    each question (GSM8K's asks for a ``#### N`` line; your own prompts are sent as given); ``reward`` is the task's
    own grader, ``reward(completion, row) -> float`` (None: the GSM8K grader).
    """

    train: list[Task]
    test: list[Task]
    counts: dict[str, int]
    source: str
    instruction: str = ""
    reward: Callable[..., Any] | None = None


# --- the one grader ----------------------------------------------------------------------------------------------


def is_batched(reward: Callable[..., Any]) -> bool:
    """A reward takes whole batches when it says so (``reward.batched = True``) or its first parameter is named
    ``completions``; otherwise it is called once per completion."""
    if getattr(reward, "batched", None) is not None:
        return bool(reward.batched)
    try:
        first = next(iter(inspect.signature(reward).parameters), None)
    except (TypeError, ValueError):
        return False
    return first == "completions"


def _name_of(reward: Callable[..., Any]) -> str:
    module = getattr(reward, "__module__", None) or ""
    name = getattr(reward, "__qualname__", None) or type(reward).__name__
    return f"{module}:{name}" if module else name


class Scorer:
    """The task's reward over completions and their rows: checked finite, cut-off replies scored as the config
    says (``truncated_reward`` "zero": 0; "grade": graded like any reply), the same in training, eval and serving.
    ``name`` says which reward it is in errors and in config.json (its import path when it has one)."""

    def __init__(
        self,
        reward: Callable[..., Any],
        *,
        truncated_reward: str = "zero",
        name: str | None = None,
        timeout: float = 0.0,
        concurrency: int = 16,
    ):
        if not callable(reward):
            raise ConfigError(f"a reward must be callable, got {preview(reward)}")
        if truncated_reward not in ("zero", "grade"):
            raise ConfigError(f"truncated_reward must be 'zero' or 'grade', got {truncated_reward!r}")
        self.reward, self.truncated_reward = reward, truncated_reward
        self.name = name or _name_of(reward)
        self.batched = is_batched(reward)
        self.timeout = timeout  # seconds per call (a batch, for a batched reward); 0: no limit
        self.concurrency = max(1, int(concurrency))  # per-completion calls in flight at once

    def score(self, completions: Sequence[str], rows: Sequence[dict[str, Any]]) -> list[float]:
        """The reward of each completion against its row (no cut-off rule applied). A reward that raises or exits
        is a ``PluginError``; one that outlives ``timeout`` a ``PluginTimeout`` (``score_within`` scores it 0)."""
        values, timed_out = self.score_within(completions, rows)
        if any(timed_out):
            row = rows[timed_out.index(True)]
            raise PluginTimeout(f"reward {self.name}", str(row.get("id", "a row")), self.timeout)
        return values

    def score_within(
        self, completions: Sequence[str], rows: Sequence[dict[str, Any]]
    ) -> tuple[list[float], list[bool]]:
        """(rewards, timed out) per completion: a call still running after ``timeout`` scores its rows 0 and
        marks them, for the caller to cut and count; anything else wrong is a one-line error."""
        if len(completions) != len(rows):
            raise ValueError(f"{len(completions)} completions for {len(rows)} rows")
        rows = [r if isinstance(r, Row) else Row(r) for r in rows]
        if not rows:
            return [], []
        plugin = f"reward {self.name}"
        if self.batched or inspect.iscoroutinefunction(self.reward):  # one call for the batch

            def work() -> Any:
                if self.batched:
                    return _run(self.reward(list(completions), rows))
                return _run(_gather([self.reward(c, r) for c, r in zip(completions, rows, strict=True)]))

            where = f"{rows[0].get('id', 'a row')} (a batch of {len(rows)})"
            try:
                values = plugins.call(work, plugin=plugin, row=where, timeout=self.timeout)
            except PluginTimeout:
                return [0.0] * len(rows), [True] * len(rows)
            if not isinstance(values, list | tuple) or len(values) != len(rows):
                raise ConfigError(
                    f"reward {self.name} returned {preview(values)} for {len(rows)} completions; a "
                    "batched reward returns one number per completion"
                )
            return [self._checked(v, row) for v, row in zip(values, rows, strict=True)], [False] * len(rows)
        # one call per completion, ``concurrency`` at once: a reward that hangs on every row costs one timeout a batch
        values = plugins.call_each(
            lambda pair: _run(self.reward(*pair)),
            list(zip(completions, rows, strict=True)),
            plugin=plugin,
            rows=[str(row.get("id", "a row")) for row in rows],
            timeout=self.timeout,
            concurrency=self.concurrency,
        )
        late = [isinstance(v, PluginTimeout) for v in values]
        return [0.0 if t else self._checked(v, row) for v, t, row in zip(values, late, rows, strict=True)], late

    def cut_off(self, scores: Sequence[float], cut: Sequence[bool]) -> tuple[list[float], dict[str, int]]:
        """The cut-off rule, the one place it is written: a reply cut at the token limit without finishing scores 0
        under "zero" ("grade": as graded); with the counts every step and eval logs (``truncated_replies``, and
        ``truncated_with_credit``: those the grader credits)."""
        cut = [bool(c) for c in cut]
        counts = {
            "truncated_replies": sum(cut),
            "truncated_with_credit": sum(c and s > 0 for c, s in zip(cut, scores, strict=True)),
        }
        if self.truncated_reward == "zero":
            scores = [0.0 if c else s for c, s in zip(cut, scores, strict=True)]
        return list(scores), counts

    def graded(self, completions: Sequence[str], rows: Sequence[dict[str, Any]], cut: Sequence[bool]) -> list[float]:
        """``score`` under the cut-off rule."""
        return self.cut_off(self.score(completions, rows), cut)[0]

    def rewards(self, rollout: Rollout, rows: Sequence[dict[str, Any] | None]) -> tuple[torch.Tensor, dict[str, int]]:
        """A training batch's rewards: [B] for one reply per prompt, or [B, R] per turn when an environment answered
        between actions (its rewards kept, the cut turn earning 0 under "zero"). ``rows[i]`` None: row i's reward
        is already in ``rollout.turns`` (an environment's, or a logged trace's); else its completion is graded and
        put on its last action token. Returns (rewards, {truncated_replies, truncated_with_credit})."""
        columns = torch.arange(rollout.action_mask.shape[1], device=rollout.action_mask.device)
        last = (rollout.action_mask.long() * columns).argmax(dim=1)  # [B] each row's last action token
        cut = rollout.cut  # [B] the last action hit a token limit
        todo = [i for i, row in enumerate(rows) if row is not None]
        graded, timed_out = self.score_within([rollout.texts[i] for i in todo], [rows[i] for i in todo])
        late = [i for i, late in zip(todo, timed_out, strict=True) if late]
        if late:  # a reward call that outlived its timeout: those trajectories end as cut (scored 0)
            rollout.cut[late] = True
        if rollout.turns is None:  # one reply per prompt: every row graded from its text
            scores, counts = self.cut_off(graded, cut.tolist())
            counts["reward_timeouts"] = len(late)
            return torch.tensor(scores, dtype=torch.float32, device=cut.device), counts
        per_turn = rollout.turns.rewards.clone()  # [B, R] each turn's reward on its last action token
        for i, value in zip(todo, graded, strict=True):
            per_turn[i, last[i]] = value
        rows_ = torch.arange(per_turn.shape[0], device=per_turn.device)
        final, counts = self.cut_off(per_turn[rows_, last].tolist(), cut.tolist())  # the last turn's reward, cut
        per_turn[rows_, last] = torch.tensor(final, dtype=per_turn.dtype, device=per_turn.device)
        counts["reward_timeouts"] = len(late)
        return (per_turn if bool((rollout.turns.count > 1).any()) else per_turn.sum(dim=1)), counts

    def _checked(self, value: Any, row: dict[str, Any]) -> float:
        """The shared rule (``sao.core.reading.reward_problem``), worded for a reward function."""
        problem = reward_problem(value)
        if problem is None:
            return float(value)
        where = f"reward {self.name} returned {preview(value)} for {row.get('id', 'a row')}"
        if problem.startswith("a reward must be a number"):
            raise ConfigError(f"{where}; it must return a number")
        raise ConfigError(f"{where}; it must return a finite number of magnitude at most {REWARD_LIMIT:g}")

    def __repr__(self) -> str:
        return f"Scorer({self.name})"


def _run(value: Any) -> Any:
    """A reward's value, awaited when it is a coroutine (an ``async`` reward): on this thread, or, when an event
    loop already runs here (a server), on a thread of its own."""
    if not inspect.isawaitable(value):
        return value
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_awaited(value))
    # a daemon thread of its own (a pool's thread is joined at exit: an abandoned call would keep the process alive)
    done: concurrent.futures.Future = concurrent.futures.Future()

    def work() -> None:
        try:
            done.set_result(asyncio.run(_awaited(value)))
        except BaseException as error:
            done.set_exception(error)

    threading.Thread(target=work, name="sao-reward-loop", daemon=True).start()
    return done.result()


async def _awaited(value: Any) -> Any:
    return await value


async def _gather(coroutines: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*coroutines))
