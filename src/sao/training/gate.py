"""The live loop's gate (``--gate held-out``): an adapter reaches the server only when it is no worse than the one
being served, and a served one that does worse on live traffic than its predecessor is rolled back.

    held aside   the first ``--gate-tasks`` held-out tasks, one reply each at the eval temperature, from one seed
                 for the run: every version answers the same tasks with the same seeds (paired task by task)
    publish      after each policy update, ``stats.noninferior`` of the candidate against the served version:
                 published when the one-sided (1 − alpha) lower bound of candidate − served is above −margin,
                 and likewise against the best held-aside mean served so far (so candidates each within the
                 margin of the last cannot walk down), else held back (the trainer trains on from the candidate)
    rollback     with ``--traces``, each version's live rewards (a trace's ``reward``/``turn_rewards`` or its
                 feedback) are tested after every step against the version served before (``stats.regression``:
                 always-valid confidence sequences); when the whole interval lies below −margin, LATEST.json names
                 the predecessor again (``rolled_back_from``), which ``sao serve`` (and ``--upstream``) reloads
    the record   every decision with its interval: a line of OUT/gate.jsonl (rewritten from the checkpointed
                 state, so each decision is there once across a resume) and ``gate_*`` fields of the step's record

Served versions form a chain: a publish pushes, a rollback pops (never served again). Rewards are taken to lie in
[0, 1] (said once otherwise). Deliberately left out: gating on live traffic (not paired), resetting the trainer to
the served version, and gating the Ray and vLLM samplers' internal adapters. Design notes: docs/design/gate.md.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from sao.core import stats, timeline
from sao.core.errors import DataError
from sao.core.io import atomic_write, write_json
from sao.core.reading import parse_jsonl_line, reward_problem
from sao.model.policy import POLICY_ADAPTER, lora_state
from sao.rollout.sampler import derived_seed
from sao.rollout.sources import Episodes, draw_batch, draw_episode_batch, make_decoder
from sao.rollout.traces import MAX_LINE_BYTES, TRACE_LIMITS
from sao.rollout.types import Sampling
from sao.tasks.base import Scorer, Task
from sao.tasks.environments import prompt_text
from sao.training import checkpoint
from sao.training.trainer import Hook, Trainer

GATE_FILE = "gate.jsonl"
KEEP_SERVED = 3  # the newest versions of the served chain whose folders are kept (a rollback needs the one before)
MAX_PENDING = 100_000  # trajectories waiting for a feedback reward that the live reader remembers


class HeldAside:
    """The fixed comparison set: ``tasks``, each answered once per version with the same seeds."""

    def __init__(
        self,
        tasks: list[Task],
        *,
        instruction: str,
        tokenizer: Any,
        scorer: Scorer,
        sampling: Sampling,
        seed: int,
        batch: int,
        decoder: str = "auto",
        episodes: Episodes | None = None,
    ):
        self.tasks, self.tokenizer, self.scorer, self.sampling = tasks, tokenizer, scorer, sampling
        self.seed, self.batch, self.decoder, self.episodes = seed, batch, decoder, episodes
        self.prompts = [prompt_text(tokenizer, t, instruction) for t in tasks]
        self.rows = [t.row() for t in tasks]

    @torch.no_grad()
    def scores(self, model: torch.nn.Module) -> list[float]:
        """Each task's reward for the reply (or episode) ``model``'s policy adapter draws, in task order. The
        policy's LoRA stays as trainable as it was (drawing through a named adapter marks it frozen)."""
        trainable = {n: p.requires_grad for n, p in lora_state(model).items()}
        try:
            return self._scores(model)
        finally:
            for name, p in lora_state(model).items():
                p.requires_grad_(trainable[name])

    def _scores(self, model: torch.nn.Module) -> list[float]:
        decoder = make_decoder(model, POLICY_ADAPTER, self.decoder)
        device = next(model.parameters()).device
        out: list[float] = []
        for c, first in enumerate(range(0, len(self.tasks), self.batch)):
            part = slice(first, first + self.batch)
            generator = torch.Generator(device=device).manual_seed(derived_seed(self.seed, c))
            if self.episodes is not None:
                ids = [t.id for t in self.tasks[part]]
                rollout = draw_episode_batch(decoder, self.tokenizer, ids, self.episodes, self.sampling, generator)
                out += rollout.turns.total.tolist()
            else:
                rollout = draw_batch(decoder, self.tokenizer, self.prompts[part], self.sampling, generator)
                out += self.scorer.graded(rollout.texts, self.rows[part], rollout.cut.tolist())
        return [float(x) for x in out]


def _skip_line(handle: Any) -> int | None:
    """Read past the rest of the current line in chunks; the offset after its newline, or None at the end of the
    file before one."""
    while True:
        rest = handle.readline(1 << 16)
        if not rest:
            return None
        if rest.endswith(b"\n"):
            return handle.tell()


class LiveRewards:
    """The rewards a trace log holds for each policy version's replies, read incrementally (complete lines only;
    a line that is not a trace or feedback record is skipped: the trace source reports malformed lines). Lines are
    read as the trace reader reads them (``sao.rollout.traces``): through the bounded reader (too long, too deep, NaN
    or 1e400: skipped), and a reward it refuses (not a finite number of magnitude at most 1e6) is not counted."""

    def __init__(self, path: str | os.PathLike[str]):
        self.root = Path(path)
        self.offsets: dict[str, int] = {}
        self.totals: dict[str, list[float]] = {}  # str(version) → [sum, count]
        self.pending: dict[str, int] = {}  # trajectory id → version, waiting for its feedback
        self.out_of_range = 0  # rewards outside [0, 1]

    def files(self) -> list[Path]:
        if self.root.is_dir():
            return sorted(p for p in self.root.glob("*.jsonl") if p.is_file())
        return [self.root] if self.root.is_file() else []

    def read(self) -> int:
        """Read what was appended since the last call; returns the rewards added."""
        added = 0
        for path in self.files():
            key = str(path)
            with open(path, "rb") as handle:
                offset = self.offsets.get(key, 0)
                if os.fstat(handle.fileno()).st_size < offset:
                    offset = 0  # a new log at the same path
                handle.seek(offset)
                while True:
                    line = handle.readline(MAX_LINE_BYTES + 1)
                    if line.endswith(b"\n"):
                        offset += len(line)
                        added += self._line(line)
                        continue
                    if len(line) <= MAX_LINE_BYTES:
                        break  # a writer mid-line: read it next time
                    end = _skip_line(handle)  # longer than any record: skipped whole, never held
                    if end is None:
                        break  # its end not written yet
                    offset = end
                self.offsets[key] = offset
        return added

    def _line(self, line: bytes) -> int:
        try:  # as the trace reader parses a line: nesting, long integers, NaN and 1e400 are refused, not read
            record = parse_jsonl_line(line.strip(), where=str(self.root), limits=TRACE_LIMITS)
        except DataError:
            return 0
        if not isinstance(record, dict) or not isinstance(record.get("id"), str):
            return 0
        if record.get("type") == "feedback":
            version = self.pending.pop(record["id"], None)
            return 0 if version is None else self._add(version, record.get("reward"))
        version = record.get("policy_version")
        segments = record.get("segments")
        if isinstance(segments, list):  # an agent served by several versions: its outcome is its last action's
            served = [
                s.get("policy_version", version)
                for s in segments
                if isinstance(s, dict) and s.get("role") == "assistant"
            ]
            version = served[-1] if served else version
        if not isinstance(version, int) or isinstance(version, bool):
            return 0
        reward = record.get("reward")
        turns = record.get("turn_rewards")
        if reward is None and isinstance(turns, list) and turns:  # every turn's reward a reward, or none counted
            reward = sum(turns) if all(reward_problem(x) is None for x in turns) else math.nan
        if reward is None:
            if len(self.pending) >= MAX_PENDING:
                self.pending.pop(next(iter(self.pending)))
            self.pending[record["id"]] = version
            return 0
        return self._add(version, reward)

    def _add(self, version: int, reward: Any) -> int:
        if reward_problem(reward) is not None:  # what the trace reader refuses is not counted here either
            return 0
        if not 0.0 <= reward <= 1.0:
            self.out_of_range += 1
        entry = self.totals.setdefault(str(version), [0.0, 0])
        entry[0] += float(reward)
        entry[1] += 1
        return 1

    def of(self, version: int) -> tuple[float, int]:
        total, count = self.totals.get(str(version), [0.0, 0])
        return float(total), int(count)

    def state_dict(self) -> dict[str, Any]:
        return {
            "offsets": dict(self.offsets),
            "totals": {k: list(v) for k, v in self.totals.items()},
            "pending": dict(self.pending),
            "out_of_range": self.out_of_range,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offsets = dict(state.get("offsets", {}))
        self.totals = {k: [float(v[0]), int(v[1])] for k, v in state.get("totals", {}).items()}
        self.pending = dict(state.get("pending", {}))
        self.out_of_range = int(state.get("out_of_range", 0))


class Gate(Hook):
    """Publishes through the gate and rolls back on live traffic (see the module doc); replaces ``Publish``."""

    name = "gate"

    def __init__(
        self,
        held: HeldAside,
        *,
        margin: float,
        alpha: float,
        live: LiveRewards | None = None,
        max_staleness: int | None = None,
    ):
        self.held, self.margin, self.alpha, self.live = held, margin, alpha, live
        self.max_staleness = max_staleness
        self.chain: list[dict[str, Any]] = []  # served versions, oldest first: {"version", "scores"}
        self.decisions: list[dict[str, Any]] = []
        self.streak = 0  # candidates held back since the last publish
        self.rolled_back: list[int] = []
        self._written = -1  # decisions in OUT/gate.jsonl
        self._step: list[dict[str, Any]] = []  # this step's decisions, for its record
        self._said_range = False

    @property
    def served(self) -> int | None:
        return self.chain[-1]["version"] if self.chain else None

    @property
    def best(self) -> dict[str, Any]:
        """The served version with the best held-aside mean so far (ties: the newest): {"version", "scores"}."""
        return max(reversed(self.chain), key=lambda c: _mean(c["scores"]))

    # -- events ------------------------------------------------------------------------------------------

    def on_run_start(self, trainer: Trainer) -> None:
        if not trainer.world.is_main:
            return
        if not self.chain:  # a new run: its first version is published as it is (nothing served to compare with)
            version = trainer.policy_version
            scores = self.held.scores(trainer.models.policy)
            self._publish(trainer, version)
            self.chain.append({"version": version, "scores": scores})
            self._decide(
                trainer,
                "published",
                version=version,
                served=None,
                held_aside_mean=_mean(scores),
                n=len(scores),
                why="the first version: nothing is served yet to compare it with",
            )
        elif checkpoint.latest_published(trainer.out) != self.served:  # killed between a decision and its checkpoint
            self._point(trainer, self.served, because="resumed: the checkpoint's served version")
        self._step = []
        self._write(trainer)

    def on_update(self, trainer: Trainer, version: int) -> None:
        if not trainer.world.is_main:
            return
        served = self.chain[-1]
        best = self.best
        with timeline.phase("eval"):
            candidate = self.held.scores(trainer.models.policy)
        self._check_range(trainer, candidate)
        test = stats.noninferior(served["scores"], candidate, self.margin, self.alpha)
        interval = {
            "delta": test.delta,
            "lower": test.lower,
            "p_value": test.p_value,
            "n": test.n,
            "candidate_mean": test.candidate_mean,
            "served_mean": test.served_mean,
        }
        if best is not served:  # and against the best: candidates each within the margin of the last cannot walk down
            anchor = stats.noninferior(best["scores"], candidate, self.margin, self.alpha)
            interval |= {
                "best": best["version"],
                "best_delta": anchor.delta,
                "best_lower": anchor.lower,
                "best_mean": anchor.served_mean,
            }
            test = test if not test.passed else anchor
        if test.passed:
            self._publish(trainer, version)
            self.chain.append({"version": version, "scores": candidate})
            self.streak = 0
            self._decide(trainer, "published", version=version, served=served["version"], **interval)
            return
        self.streak += 1
        self._decide(trainer, "held_back", version=version, served=served["version"], **interval)
        if self.max_staleness is not None and self.streak == self.max_staleness + 1:
            trainer.warn(
                f"[{trainer.label}] gate: {self.streak} candidates in a row held back; new traces of the "
                f"served v{served['version']} are now older than --max-staleness {self.max_staleness} and "
                "will be dropped as too stale"
            )

    def on_step_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if trainer.world.is_main and self.live is not None:
            self.check_live(trainer)
        if self._step:  # the step's decisions, last one's fields, in its record
            last = self._step[-1]
            record.update(
                {
                    "gate_decisions": [d["decision"] for d in self._step],
                    "gate_served": self.served,
                    **{f"gate_{k}": last[k] for k in ("delta", "lower", "upper") if k in last},
                }
            )
        self._step = []

    def on_checkpoint(self, trainer: Trainer, step: int) -> None:
        self._write(trainer)

    def on_run_end(self, trainer: Trainer) -> None:
        self._write(trainer)

    # -- rollback ----------------------------------------------------------------------------------------

    def check_live(self, trainer: Trainer) -> stats.Regression | None:
        """Read the trace log's new rewards and roll the served version back when it regressed (module doc)."""
        assert self.live is not None
        self.live.read()
        if self.live.out_of_range and not self._said_range:
            self._said_range = True
            trainer.warn(
                f"[{trainer.label}] gate: {self.live.out_of_range} live reward(s) outside [0, 1]; the "
                "rollback's confidence sequence assumes rewards in [0, 1]"
            )
        if len(self.chain) < 2:
            return None
        now, before = self.chain[-1]["version"], self.chain[-2]["version"]
        test = stats.regression(*self.live.of(now), *self.live.of(before), self.margin, self.alpha)
        if not test.regressed:
            return test
        folder = trainer.out / checkpoint.PUBLISHED_DIR / f"v{before}"
        interval = {
            "delta": test.delta,
            "lower": test.lower,
            "upper": test.upper,
            "n": test.n,
            "n_before": test.n_before,
            "live_mean": test.mean,
            "live_mean_before": test.mean_before,
        }
        if not folder.is_dir():
            self._decide(
                trainer,
                "rollback_impossible",
                version=now,
                served=now,
                to=before,
                **interval,
                why=f"{folder} is no longer on disk",
            )
            self.chain.pop(-2)  # test the served version against the one before that from now on
            return test
        self.chain.pop()
        self.rolled_back.append(now)
        self._point(trainer, before, rolled_back_from=now)
        self._decide(trainer, "rolled_back", version=now, served=before, **interval)
        return test

    # -- writing -----------------------------------------------------------------------------------------

    def _publish(self, trainer: Trainer, version: int) -> None:
        keep = [c["version"] for c in self.chain[-(KEEP_SERVED - 1) :]] + [version]
        checkpoint.publish(trainer.out, version, trainer.write_adapter, protect=keep)

    def _point(self, trainer: Trainer, version: int | None, **extra: Any) -> None:
        """LATEST.json → an already published version (a rollback, or a resume that must undo a later one)."""
        root = trainer.out / checkpoint.PUBLISHED_DIR
        if version is None or not (root / f"v{version}").is_dir():
            return
        write_json(root / checkpoint.LATEST_FILE, {"version": version, "path": f"v{version}", **extra})

    def _decide(self, trainer: Trainer, decision: str, **fields: Any) -> None:
        entry = {
            "decision": decision,
            "step": trainer.next_step,
            "policy_version": trainer.policy_version,
            "margin": self.margin,
            "alpha": self.alpha,
            **fields,
            "time": time.time(),
        }
        self.decisions.append(entry)
        self._step.append(entry)
        trainer.say(f"[{trainer.label}] gate: {describe(entry)}")

    def _write(self, trainer: Trainer) -> None:
        if not trainer.world.is_main or self._written == len(self.decisions):
            return
        text = "".join(json.dumps(d, allow_nan=False) + "\n" for d in _clean(self.decisions))
        atomic_write(trainer.out / GATE_FILE, text.encode(), durable=False)
        self._written = len(self.decisions)

    def _check_range(self, trainer: Trainer, scores: list[float]) -> None:
        if not self._said_range and any(not 0.0 <= s <= 1.0 for s in scores):
            self._said_range = True
            trainer.warn(
                f"[{trainer.label}] gate: held-aside rewards outside [0, 1]; the size check at start "
                "assumed rewards in [0, 1]"
            )

    # -- state -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "chain": self.chain,
            "decisions": _clean(self.decisions),
            "streak": self.streak,
            "rolled_back": list(self.rolled_back),
            "said_range": self._said_range,
            "live": self.live.state_dict() if self.live is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.chain = [dict(c) for c in state.get("chain", [])]
        self.decisions = [dict(d) for d in state.get("decisions", [])]
        self.streak, self.rolled_back = int(state.get("streak", 0)), list(state.get("rolled_back", []))
        self._said_range = bool(state.get("said_range", False))
        if self.live is not None and state.get("live"):
            self.live.load_state_dict(state["live"])
        self._written = -1


def describe(d: dict[str, Any]) -> str:
    """One decision in words, with its interval."""
    v, kind = d.get("version"), d["decision"]
    if kind == "published" and d.get("served") is None:
        return f"published v{v} (the first version; held-aside mean {d.get('held_aside_mean', float('nan')):.3f})"
    if kind in ("published", "held_back"):
        word = "published" if kind == "published" else "held back"
        served_fails = kind == "held_back" and not (d["lower"] is not None and d["lower"] > -d["margin"])
        text = (
            f"{word} v{v} against the served v{d['served']}: candidate − served {d['delta']:+.3f} over "
            f"{d['n']} held-aside tasks, one-sided {1 - d['alpha']:.0%} lower bound {d['lower']:+.3f} "
            f"{'<=' if served_fails else '>'} −{d['margin']:g}"
        )
        if d.get("best") is not None:
            best_fails = kind == "held_back" and not served_fails
            text += (
                f"; against the best served v{d['best']}: {d['best_delta']:+.3f}, lower bound "
                f"{d['best_lower']:+.3f} {'<=' if best_fails else '>'} −{d['margin']:g}"
            )
        return text
    target = d["served"] if kind == "rolled_back" else d.get("to")
    word = "rolled back" if kind == "rolled_back" else "could not roll back"
    return (
        f"{word} v{v} to v{target}: "
        f"live {d['live_mean']:.3f} over {d['n']} replies against {d['live_mean_before']:.3f} over "
        f"{d['n_before']}, difference {d['delta']:+.3f}, always-valid {1 - d['alpha']:.0%} interval "
        f"[{d['lower']:+.3f}, {d['upper']:+.3f}] below −{d['margin']:g}"
    )


def read_decisions(out: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """OUT/gate.jsonl's decisions, oldest first ([] when the run had no gate)."""
    path = Path(out) / GATE_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _clean(values: Any) -> Any:
    """Decisions as strict JSON: a non-finite number (an interval that is still unbounded) as None."""
    if isinstance(values, dict):
        return {k: _clean(v) for k, v in values.items()}
    if isinstance(values, list):
        return [_clean(v) for v in values]
    return None if isinstance(values, float) and not math.isfinite(values) else values


__all__ = ["GATE_FILE", "Gate", "HeldAside", "LiveRewards", "describe", "read_decisions"]
