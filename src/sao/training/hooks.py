"""What a run does beside the step, as hooks the trainer calls by event: it knows none of them by name.

    on_run_start(trainer)                after a resume's restore, before the first step
    on_pass(trainer, batch, forward)     after the teacher-forced pass, before any update: a dict of record extras
    on_update(trainer, version)          after each policy update (the policy's ``version``-th)
    on_step_end(trainer, record)         after a step's record, before its checkpoint (a kill repeats both)
    on_checkpoint(trainer, step)         once the step is durable
    on_eval(trainer, label, metrics)     an evaluation of the policy (the experiment's)
    on_run_end(trainer)                  after the last step and the adapter
    on_close(trainer)                    always, last (release what the hook holds)

A hook with state (``state_dict``/``load_state_dict``) has it saved in the trainer's checkpoint under its ``name``.
Here: the reachability lines, publishing, tracking, the footing audit of logged log-probs, a source's summary, the
timeline (timeline.json and OpenTelemetry).

Deliberately left out: evaluation (``sao.experiment`` adds its own hooks) and anything that changes the update.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sao.core import timeline
from sao.core.errors import DataError
from sao.core.io import write_json
from sao.model.forward import token_logprobs, trunk_and_head
from sao.training import checkpoint
from sao.training.records import dead_band_warning, masking_line
from sao.training.tracking import make_tracker
from sao.training.trainer import Hook, Trainer

if TYPE_CHECKING:
    from sao.model.forward import TeacherForced
    from sao.rollout.types import Batch
    from sao.training.otel import Telemetry


class Reachability(Hook):
    """The dead-band warning (once, early: a band that masks almost nothing makes the two arms the same experiment)
    and, at the end of each staleness cycle, the masked share so far by staleness."""

    name = "reachability"

    def __init__(self, dead_band_share: float, ratio: tuple[float, float], steps: int):
        self.dead_band_share, self.ratio, self.steps = dead_band_share, ratio, steps
        self.last_report: int | None = None

    def on_step_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        stale = trainer.source.max_staleness
        warning = dead_band_warning(trainer.records, stale, self.dead_band_share, self.ratio, trainer.label)
        if warning:
            trainer.warn(warning)
        line = masking_line(trainer.records, stale, self.last_report, self.steps)
        if line:
            self.last_report = record["policy_step"] + 1
            trainer.say(f"[{trainer.label}] {line}")

    def state_dict(self) -> dict[str, Any]:
        return {"last_report": self.last_report}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_report = state.get("last_report")


class Publish(Hook):
    """OUT/published/v{N}/ after every policy update (and v0, or the resumed version, at the start), with
    LATEST.json pointing at the newest, for a server to reload (``checkpoint.publish``): the adapter, or under full
    fine-tuning every weight as safetensors shards (``artifacts.save_full_weights``). Sharded, every process takes
    part in gathering the weights; rank 0 writes."""

    name = "publish"

    def on_run_start(self, trainer: Trainer) -> None:
        latest = checkpoint.latest_published(trainer.out) if trainer.world.is_main else None
        if trainer.models.sharded:
            latest = trainer.world.broadcast(latest)
        if latest is not None and latest < trainer.policy_version:
            self.on_update(trainer, trainer.policy_version)

    def on_update(self, trainer: Trainer, version: int) -> None:
        if trainer.world.is_main or trainer.models.sharded:
            kind = "model" if trainer.models.finetune == "full" else "adapter"
            track = timeline.TRAINER.format(rank=trainer.world.rank)
            with timeline.span("adapter publish", "adapter", track, "step", version=version, to="published"):
                checkpoint.publish(trainer.out, version, trainer.write_adapter, kind=kind, write=trainer.world.is_main)


class Tracking(Hook):
    """Every step record and eval mirrored to TensorBoard, trackio or W&B (``sao.training.tracking``), after the step
    is durable, so a killed run never shows a step twice."""

    name = "tracking"

    def __init__(self, kind: str, config: dict[str, Any]):
        self.kind, self.config, self.tracker = kind, config, None

    def on_run_start(self, trainer: Trainer) -> None:
        if trainer.world.is_main:
            self.tracker = make_tracker(self.kind, trainer.out, trainer.label, self.config)

    def on_checkpoint(self, trainer: Trainer, step: int) -> None:
        if self.tracker is not None:
            self.tracker.log_step(trainer.records[-1], step)

    def on_eval(self, trainer: Trainer, label: str, metrics: dict[str, Any]) -> None:
        if self.tracker is not None:
            self.tracker.log_eval(label, metrics, trainer.next_step)

    def on_close(self, trainer: Trainer) -> None:
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


# The footing audit, on mean |log r| per action token at staleness 0. A footing fits within TOLERANCE (float32 gives
# ~1e-7; a bf16 serving engine against this pass ~1e-3..1e-2). Footing 1 is preferred when it is at least MARGIN
# times closer than footing T, and T is off by more than FLOOR (below it the two footings are indistinguishable, and
# so harmless: a confident model's log-probs barely move with the temperature; the tiny model's move ~0.03 between
# 0.7 and 1).
FOOTING_TOLERANCE, FOOTING_MARGIN, FOOTING_FLOOR = 0.05, 2.0, 1e-3


class FootingAudit(Hook):
    """Whether logged log-probs are on the footing of the temperature they were sampled at.

    On the first batch with staleness-0 rows (the trajectory's adapter is the policy of this pass), the recorded
    log-probs must equal the teacher-forced ones at temperature T (|log r| ~ 0, up to a serving engine's numerics).
    They are compared at T and at 1 from the pass's own hidden states (one extra head over those rows' action
    tokens). Footing 1 fits and is clearly closer than T: the server logged log-probs before temperature, every
    ratio would be false, and the run stops with one line before the step trains on them. Otherwise T fits: go on;
    or neither fits: a warning (another model or adapter, or other numerics). Decided once; skipped at T = 1."""

    name = "footing"

    def __init__(self, temperature: float, logprob_chunk: int):
        self.temperature, self.logprob_chunk = temperature, logprob_chunk
        self.footing: dict[str, float] | None = None

    def on_pass(self, trainer: Trainer, batch: Batch, forward: TeacherForced) -> dict[str, Any]:
        if self.footing is not None or self.temperature == 1.0:
            return {}
        rollout, world = batch.rollout, trainer.world
        mask = rollout.action_mask & (batch.token_staleness() == 0)  # [B, R] action tokens at staleness 0
        if not bool(mask.any()):
            return {}
        own = world.shard(len(mask))  # the pass's rows: this process's (all of them on one)
        mine = mask[own]  # [b, R]
        recorded = rollout.sampler_logprobs[own][mine]  # [n]
        with torch.no_grad():
            head = trunk_and_head(trainer.models.policy)[1]
            at_one = trainer.models.call(
                token_logprobs, head, forward.hidden[mine], rollout.response_ids[own][mine], 1.0, self.logprob_chunk
            )
        at_t = _mean_over_ranks(world, forward.logprobs[mine] - recorded)
        at_1 = _mean_over_ranks(world, at_one - recorded)
        self.footing = {"footing_abs_log_ratio_at_T": at_t, "footing_abs_log_ratio_at_1": at_1}
        closer_to_1 = at_1 * FOOTING_MARGIN < at_t and at_t > FOOTING_FLOOR
        if closer_to_1 and at_1 <= FOOTING_TOLERANCE:
            raise DataError(
                f"the traces' log-probs were taken before temperature: at staleness 0 they match the policy at "
                f"temperature 1 (mean |log r| {at_1:.2e}) and not at the traces' temperature {self.temperature} "
                f"({at_t:.2e}); log the log-probs of the distribution actually sampled from (vLLM: logprobs-mode "
                "processed_logprobs)"
            )
        if closer_to_1 or at_t > FOOTING_TOLERANCE:
            trainer.warn(
                f"[{trainer.label}] the traces' log-probs match neither the policy at temperature "
                f"{self.temperature} (mean |log r| {at_t:.2e} at staleness 0) nor at 1 ({at_1:.2e}): is the "
                "server running this run's base model and published adapter?"
            )
        return dict(self.footing)

    def state_dict(self) -> dict[str, Any]:
        return {"footing": self.footing}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.footing = state.get("footing")


class SourceSummary(Hook):
    """OUT/<file>: the source's totals at the end of the run (a trace log's: used, dropped by reason, the staleness
    histogram), with the footing audit's numbers when one ran."""

    name = "source-summary"

    def __init__(self, file: str = checkpoint.TRACES_FILE):
        self.file = file

    def on_run_end(self, trainer: Trainer) -> None:
        if not trainer.world.is_main:
            return
        summary = dict(trainer.source.summary()) if hasattr(trainer.source, "summary") else {}
        audit = next((h for h in trainer.hooks if isinstance(h, FootingAudit)), None)
        write_json(trainer.out / self.file, {**summary, "footing": audit.footing if audit else None})


class Mismatch(Hook):
    """The ratio split into its two causes, every step: the engine's numerics and staleness.

    ``mismatch_fresh``: mean |log r| over the action tokens of staleness-0 rows (the sampler's adapter is the
    policy's: what is left is numerics). ``mismatch_rescored`` and ``staleness_drift``: up to ``rows`` stale rows
    re-scored here under the adapter version that drew them (``source.adapter(version)``): |recorded − that
    version's| is the engine's numerics on those rows, |that version's − the policy's| the drift staleness made.
    With ``tolerance``, fresh rows that disagree by more stop the run: a sampler that never received the published
    adapter looks like staleness forever otherwise."""

    name = "mismatch"
    RESCORE = "rescore"

    def __init__(self, temperature: float, logprob_chunk: int, rows: int = 4, tolerance: float | None = None):
        self.temperature, self.chunk, self.rows, self.tolerance = temperature, logprob_chunk, rows, tolerance

    def on_pass(self, trainer: Trainer, batch: Batch, forward: TeacherForced) -> dict[str, Any]:
        rollout = batch.rollout
        staleness = batch.token_staleness()  # [B, R] each token's
        recorded = rollout.sampler_logprobs  # [B, R]
        now = trainer.world.gather_rows(forward.logprobs.detach())  # [B, R] every rank's rows (as is on one)
        out: dict[str, Any] = {"mismatch_fresh": _mean_abs(now - recorded, rollout.action_mask & (staleness == 0))}
        fresh = out["mismatch_fresh"]
        if self.tolerance is not None and fresh == fresh and fresh > self.tolerance:
            raise DataError(
                f"[{trainer.label}] at staleness 0 the sampler's log-probs differ from the policy's by {fresh:.2e} "
                f"(mean |log r|, tolerance {self.tolerance:g}): the sampler is not serving the adapter the trainer "
                "published (or another model, or other numerics: raise --sampler-tolerance for a bf16 engine)"
            )
        adapter = getattr(trainer.source, "adapter", None)
        stale = rollout.action_mask & (staleness > 0)  # [B, R]
        if adapter is None or not bool(stale.any()):
            return out
        level = int(staleness[stale][0])  # the first stale token's staleness: its version is re-scored
        at_level = rollout.action_mask & (staleness == level)  # [B, R]
        rows = [i for i in range(len(batch.staleness)) if bool(at_level[i].any())][: self.rows]
        weights = adapter(trainer.policy_version - level)
        if weights is None:
            return out
        then = self._rescore(trainer, rollout, rows, weights)  # [n, R] under the version that drew them
        mask = at_level[rows]  # the tokens that version drew (a row may span versions)
        out["mismatch_rescored"] = _mean_abs(then - recorded[rows], mask)
        out["staleness_drift"] = _mean_abs(now[rows] - then, mask)
        return out

    def _rescore(self, trainer: Trainer, rollout, rows: list[int], weights: Any) -> torch.Tensor:
        from safetensors.torch import load_file

        from sao.model.forward import teacher_forced
        from sao.model.policy import POLICY_ADAPTER, lora_state

        policy = trainer.models.policy
        if self.RESCORE not in policy.peft_config:
            policy.add_adapter(self.RESCORE, policy.peft_config[POLICY_ADAPTER])
        state = load_file(str(weights / "adapter_model.safetensors")) if isinstance(weights, Path) else weights
        with torch.no_grad():
            for name, p in lora_state(policy, self.RESCORE).items():
                p.copy_(state[name.replace(f".{self.RESCORE}.", ".")].to(p))
            policy.set_adapter(self.RESCORE, inference_mode=True)
            try:
                return teacher_forced(
                    policy,
                    rollout.prompt_ids[rows],
                    rollout.prompt_mask[rows],
                    rollout.response_ids[rows],
                    rollout.response_mask[rows],
                    temperature=self.temperature,
                    logprob_chunk=self.chunk,
                ).logprobs
            finally:
                policy.set_adapter(POLICY_ADAPTER)
                for p in lora_state(policy, self.RESCORE).values():
                    p.requires_grad_(False)


def _mean_over_ranks(world: Any, difference: torch.Tensor) -> float:
    """mean |difference| over every process's entries (one process: this one's)."""
    if world.size == 1:
        return float(difference.abs().mean())
    return world.total(float(difference.abs().sum())) / world.total(float(difference.numel()))


def _mean_abs(difference: torch.Tensor, mask: torch.Tensor) -> float:
    return float(difference[mask].abs().mean()) if bool(mask.any()) else float("nan")


DELIVERY_TOLERANCE = 1e-3  # the delivery check's verdict where the source enforces none (the remote engines' default)


class Timeline(Hook):
    """OUT/timeline.json (``sao.core.timeline.TraceFile``, the newest ``steps`` steps at least; 0: no file) and, with
    ``telemetry``, the same steps as OpenTelemetry spans (``sao.training.otel``). This process records from the run's
    start (a Ray source's workers and the environment calls too); each step's events are written once the step is
    durable, every rank's phases on rank 0. A step that drew fresh rows gets the delivery check's verdict: the
    sampler's log-probs against the policy's at staleness 0 (``mismatch_fresh``) within the tolerance the source
    enforces (--sampler-tolerance), else ``DELIVERY_TOLERANCE``."""

    name = "timeline"
    FILE = "timeline.json"

    def __init__(self, steps: int, telemetry: Telemetry | None = None):
        self.steps, self.telemetry = steps, telemetry
        self.file: timeline.TraceFile | None = None
        self.recorder: timeline.Recorder | None = None
        self.version = 0  # the policy version of the step's pass: staleness-0 rows were drawn by it

    def on_run_start(self, trainer: Trainer) -> None:
        self.recorder = timeline.start()
        if self.telemetry is not None:
            self.telemetry.exporter.warn = trainer.warn  # its one warning goes in the run's summary
        track = timeline.TRAINER.format(rank=trainer.world.rank)
        if trainer.world.is_main and self.steps > 0:
            path = trainer.out / self.FILE
            about = {"run": trainer.label, "tool": "sao"}
            self.file = timeline.TraceFile(path, self.steps, about).open(resume=path.exists())
            if self.file.repaired:
                trainer.say(f"[{trainer.label}] {self.file.repaired}", always=True)
        what = f"resumed at step {trainer.next_step}" if trainer.next_step else "run start"
        timeline.instant(what, "run", track, "step", step=trainer.next_step, version=trainer.policy_version)

    def on_pass(self, trainer: Trainer, batch: Batch, forward: TeacherForced) -> dict[str, Any]:
        self.version = trainer.policy_version
        return {}

    def on_step_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        fresh = record.get("mismatch_fresh")
        if isinstance(fresh, float) and fresh == fresh:  # rows at staleness 0: did the sampler get the adapter?
            enforced = next((h.tolerance for h in trainer.hooks if isinstance(h, Mismatch)), None)
            tolerance = enforced if enforced is not None else DELIVERY_TOLERANCE
            track = timeline.TRAINER.format(rank=trainer.world.rank)
            timeline.instant(
                "delivery check",
                "adapter",
                track,
                "step",
                step=record["step"],
                version=self.version,
                mismatch_fresh=fresh,
                tolerance=tolerance,
                passed=fresh <= tolerance,
                enforced=enforced is not None,
            )

    def on_checkpoint(self, trainer: Trainer, step: int) -> None:
        self._flush(trainer, gather=True)

    def _flush(self, trainer: Trainer, gather: bool) -> None:
        if self.recorder is None:
            return
        events, dropped = self.recorder.drain()
        if dropped:
            for event in events:
                if event.get("cat") == "step":
                    event["args"]["events_dropped"] = dropped
        if gather and trainer.world.size > 1:  # every rank's events on rank 0
            gathered = trainer.world.gather_objects(events)
            events = [e for part in gathered or [] for e in part]
        if not trainer.world.is_main:
            return
        if self.file is not None and events:
            self.file.write(events)
        if self.telemetry is not None:
            self.telemetry.steps(trainer.label, events)

    def on_close(self, trainer: Trainer) -> None:
        try:
            self._flush(trainer, gather=False)  # what came after the last step (this rank's)
        finally:
            timeline.stop()
            self.recorder = None
            if self.telemetry is not None and trainer.world.is_main:
                trainer.say(f"[{trainer.label}] {self.telemetry.close()}")
                self.telemetry = None
