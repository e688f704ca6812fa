"""One policy, one seed: critic warmup, then policy steps on whatever batches a source hands it.

    prompts ──► source ──► trajectories + sampler_logprobs ──► scorer (rewards)
            ──► teacher-forced pass, micro-batch by micro-batch (logprobs with grad, hidden detached)
            ──► value head ──► SAO.update ──► loss = −Σ c·logprobs (+ optional KL, entropy) ──► backward
            ──► clip ──► AdamW on LoRA (scheduled lr) ──► critic_steps × squared error ──► one log record

Global step g runs 0 .. W + steps − 1; the first W steps train only the critic, each on a fresh batch: W is
``critic_warmup``, or with ``critic_warmup="auto"`` the first step count at which the critic, scored on each warmup
batch before it trains on it, explains ``critic_warmup_target`` of the returns' variance on two batches in a row
(at most ``critic_warmup_limit``). The trainer takes its parts (models, source, scorer, hooks) and knows no source
by name: where a batch comes from is the source's business, and everything beside the step (publishing, tracking,
warnings, evaluation) is a hook's. A killed run resumes from its last checkpoint; with the local source it ends with the
same numbers as one that never stopped. Assembling the parts from a config is ``sao.training.build``.

Deliberately left out: evaluation and the two-arm experiment (``sao.experiment``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from sao.algorithm.corrections import row_keys
from sao.algorithm.update import SAO, explained_variance
from sao.core import timeline
from sao.core.config import Config
from sao.core.errors import NothingTrained
from sao.core.names import POLICY, WARMUP
from sao.model import artifacts
from sao.model.forward import TeacherForced
from sao.model.memory import auto_micro_batch, with_oom_retry
from sao.model.policy import Models, describe, lora_state
from sao.rollout.sources import Source, SourceExhausted
from sao.rollout.types import Batch
from sao.tasks.base import Scorer
from sao.training import checkpoint
from sao.training.distributed import SINGLE, BroadcastSource, World
from sao.training.learn import apply_policy_step, critic_optimizer, critic_steps, lr_factor, policy_gradient_pass
from sao.training.records import step_record

log = logging.getLogger("sao.training")


class Hook:
    """A trainer callback: override the events you need; every one gets the trainer (``sao.training.hooks`` lists the
    events and holds the built-in hooks)."""

    name = "hook"
    recorded = True  # config.json names the hook's class, for a replay (False: a part of whatever built the run)

    def on_run_start(self, trainer: Trainer) -> None: ...

    def on_pass(self, trainer: Trainer, batch: Batch, forward: TeacherForced) -> dict[str, Any]:
        return {}

    def on_update(self, trainer: Trainer, version: int) -> None: ...

    def on_step_end(self, trainer: Trainer, record: dict[str, Any]) -> None: ...

    def on_checkpoint(self, trainer: Trainer, step: int) -> None: ...

    def on_eval(self, trainer: Trainer, label: str, metrics: dict[str, Any]) -> None: ...

    def on_run_end(self, trainer: Trainer) -> None: ...

    def on_close(self, trainer: Trainer) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Trainer:
    """Trains ``models`` on ``source``'s batches, graded by ``scorer``, into the run folder ``run``; ``run()``
    returns the log records. ``config`` supplies the algorithm and training settings (and the rollout temperature
    the teacher-forced pass takes). ``run`` is a ``checkpoint.RunDir`` the builder opened (claimed, its checkpoint
    read on --resume; ``sao.training.build.trainer``), or a path, claimed here for a new run. The constructor
    restores from the checkpoint in memory and writes nothing: config.json is written when ``run()`` starts."""

    def __init__(
        self,
        models: Models,
        source: Source | None,
        scorer: Scorer,
        config: Config,
        run: checkpoint.RunDir | str | Path,
        *,
        hooks: Sequence[Hook] = (),
        world: World = SINGLE,
        progress: bool = True,
        label: str | None = None,
    ):
        if world.size > 1:  # rank 0 reads the source and broadcasts each batch; the other ranks hold none
            source = BroadcastSource(world, source, models.device)
        self.models, self.source, self.scorer, self.config = models, source, scorer, config
        self.settings, self.sao = config.training, SAO.of(config.algorithm)
        world.shard(config.training.batch_size)  # a batch that does not split evenly over the ranks is refused here
        if not isinstance(run, checkpoint.RunDir):
            run = checkpoint.RunDir.open(run, {"config": config.to_dict()})
        self.run_dir, self.out, self.hooks, self.world = run, run.out, list(hooks), world
        self.progress = progress and world.is_main
        self.label = label or f"{config.algorithm.correction} seed {config.training.seed}"
        self.lora_params = list(lora_state(models.policy).values())
        self.policy_opt = torch.optim.AdamW(self.lora_params, lr=self.settings.lr,
                                            weight_decay=self.settings.weight_decay)  # fmt: skip
        self.critic_opt = critic_optimizer(models.value_head, self.settings.critic_lr, self.settings.critic_bias_lr)
        auto = self.sao.critic_warmup == "auto"
        self.warmup_length: int | None = None if auto else int(self.sao.critic_warmup)  # W; None: not yet decided
        self.policy_version = 0  # policy updates applied so far
        self.micro_batch = self.settings.micro_batch  # halves on out-of-memory and stays halved
        self.next_step, self.records, self.warnings = 0, [], []
        self.ended_early: str | None = None  # why the source had no further batch (a trace log read to its end)
        self._saved_at = 0  # the step count of the newest checkpoint
        self._restore(run.state)

    @property
    def total_steps(self) -> int:
        """W + steps; while an automatic warmup is undecided, its bound stands in for W."""
        warmup = self.sao.critic_warmup_limit if self.warmup_length is None else self.warmup_length
        return warmup + self.settings.steps

    def _decide_warmup(self, record: dict[str, Any]) -> None:
        """``critic_warmup="auto"``: end the warmup after this step when the critic explained at least the target on
        this batch and the one before (each scored before the critic trained on it), or at the limit."""
        g, target, limit = record["step"], self.sao.critic_warmup_target, self.sao.critic_warmup_limit
        scores = [r.get("critic_explained_variance", r["explained_variance"]) for r in (*self.records, record)
                  if r["phase"] == WARMUP][-2:]  # fmt: skip
        reached = len(scores) == 2 and all(v >= target for v in scores)
        if reached or g + 1 >= limit:
            self.warmup_length = record["critic_warmup_steps"] = g + 1
            how = (
                f"explained variance {scores[-2]:.3f}, {scores[-1]:.3f} >= {target:g}"
                if reached
                else (f"the limit; explained variance {scores[-1]:.3f} had not reached {target:g} twice in a row")
            )
            line = f"[{self.label}] critic warmup: {g + 1} steps ({how})"
            if reached:
                self.say(line)
            else:
                self.warn(line.removeprefix(f"[{self.label}] "))

    # -- one step, in the order of the data path ---------------------------------------------------------------

    def step(self, g: int) -> dict[str, Any]:
        """Global step ``g``: its log record, with its phase timers (the loop's clock when the loop runs it, which
        times the hooks after the step too; else a clock of its own)."""
        clock = timeline.running() or timeline.Phases()
        with clock:  # the sources' and environments' phases reach it
            return self._step(g, clock)

    def _step(self, g: int, clock: timeline.Phases) -> dict[str, Any]:
        phase = WARMUP if self.warmup_length is None or g < self.warmup_length else POLICY
        started = time.perf_counter()
        with clock.phase("wait"):  # (a source that draws here marks "draw" and "env" inside)
            batch = self.source.next_batch(g, phase, self.policy_version)  # prompts → source → trajectories
        rollout = batch.rollout
        with clock.phase("score"):
            rewards, truncation = self.scorer.rewards(rollout, self.rows(batch))  # [B], or [B, R] per turn
        sampled = time.perf_counter()
        policy_step = phase == POLICY

        def attempt(rows: int):  # teacher-forced pass → SAO.update → loss → backward (this rank's rows)
            self.policy_opt.zero_grad(set_to_none=True)
            return policy_gradient_pass(
                self.models, self.sao, rollout, rewards, rows=rows, with_policy_gradient=policy_step,
                temperature=self.config.rollout.temperature, logprob_chunk=self.config.model.logprob_chunk,
                world=self.world, kl_coef=self.settings.kl_coef, entropy_coef=self.settings.entropy_coef,
                row_info=row_info,
            )  # fmt: skip

        row_info = {  # [B] each: the random control's integer key (seed, step, row) and each row's staleness
            "random_key": row_keys(self.settings.seed, g, len(rewards)),
            "staleness": torch.tensor(batch.staleness, dtype=torch.int64),
        }

        own = self.world.shard(len(rewards))  # this rank's rows (every row on one process)
        width = rollout.prompt_ids.shape[1] + rollout.response_ids.shape[1]
        rows = self.micro_batch or auto_micro_batch(self.models.policy, width, own.stop - own.start)
        with clock.phase("pass"):
            result, rows, retries = with_oom_retry(attempt, rows, self._say_oom)
        self.micro_batch = rows if retries else self.micro_batch  # a halving holds for the rest of the run
        extras: dict[str, Any] = {}
        with clock.phase("checks"):
            for hook in self.hooks:  # before any update: a hook may refuse what the batch holds
                extras.update(hook.on_pass(self, batch, result.forward))
        loss, finite = self.world.total(result.loss), self.world.all(result.finite)  # over ranks (as is on one)
        grad_norm, skipped, lr = float("nan"), False, float("nan")
        if policy_step:  # (sum over ranks) → clip → AdamW on LoRA, unless something was not finite
            with clock.phase("update"):
                if finite:
                    self.world.sum_gradients(self.lora_params)
                lr = self._set_lr(g - self.warmup_length)
                grad_norm, skipped = apply_policy_step(self.policy_opt, self.lora_params, self.settings.grad_clip,
                                                       finite)  # fmt: skip
            if not skipped:
                self.policy_version += 1
                with clock.phase("publish"):  # (a hook that evaluates marks "eval" inside)
                    self.source.after_update(self.policy_version)
                    for hook in self.hooks:
                        hook.on_update(self, self.policy_version)
        targets = result.update.value_targets[own]  # [b, R] Monte Carlo returns of this rank's rows
        with clock.phase("critic"):
            critic_loss = critic_steps(self.models.value_head, self.critic_opt, result.forward.hidden, targets,
                                       rollout.action_mask[own], self.sao.critic_steps, world=self.world)  # fmt: skip
        with clock.phase("stats"):
            record = step_record(
                step=g, phase=phase, policy_step=g - self.warmup_length if policy_step else None,
                policy_version=self.policy_version, staleness=batch.staleness, token_staleness=batch.token_staleness(),
                rollout=rollout, rewards=rewards,
                update=result.update, critic_loss=critic_loss, grad_norm=grad_norm, skipped=skipped,
                band=self.sao.ratio, token_text=self._token_text,
            )  # fmt: skip
            if self.sao.baseline != "critic":  # the update's EV is the fixed baseline's: the critic's, beside it
                record["critic_explained_variance"] = explained_variance(
                    result.critic_values, result.update.value_targets, rollout.action_mask
                )
        return {
            "arm": self.sao.correction, "seed": self.settings.seed, **record, **batch.info, **extras, "loss": loss,
            **result.extra_stats, "lr": lr, "micro_batch": self.micro_batch, "oom_retries": retries,
            "world_size": self.world.size, **truncation, **clock.fields(), "time_sample": sampled - started,
        }  # fmt: skip

    def _token_text(self, ids: Sequence[int]) -> list[str]:
        """Each token id as the text it decodes to alone (for the log's tokens outside the band)."""
        return [self.models.tokenizer.decode([i]) for i in ids]

    def rows(self, batch: Batch) -> list[dict[str, Any] | None]:
        """Each row's task as plain data for the scorer, or None where the row's reward is already in the
        trajectories (an environment's, a logged trace's): the fields a row carries (a logged trace's task), else
        the source's training task of that id."""
        if batch.rollout.turns is not None and batch.tasks is None:
            return [None] * len(batch.task_ids)
        if batch.tasks is not None:
            return [None if fields is None else {"id": i, **fields} for i, fields in zip(batch.task_ids, batch.tasks,
                                                                                        strict=True)]  # fmt: skip
        return [self.source.tasks[i].row() for i in batch.task_ids]

    def _set_lr(self, k: int) -> float:
        """The policy learning rate of policy step k (``lr_schedule`` after ``warmup_steps``)."""
        s = self.settings
        lr = s.lr * lr_factor(k, s.steps, s.warmup_steps, s.lr_schedule)
        for group in self.policy_opt.param_groups:
            group["lr"] = lr
        return lr

    def _say_oom(self, rows: int) -> None:
        self.say(f"[{self.label}] out of memory in the training pass: micro-batch -> {rows}, retrying")

    # -- the loop ----------------------------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        """Every remaining step, a checkpoint every ``checkpoint_every`` steps (and after the last), then the
        adapter. A run killed between checkpoints repeats the steps since the last one."""
        progress = _Progress(self, self.total_steps, self.next_step)
        failed = True
        try:
            self.world.barrier()  # every rank has claimed the folder before rank 0 writes into it
            if self.world.is_main:
                checkpoint.write_config(self.out, self.run_dir.record)
                if self.run_dir.state is not None and checkpoint.ensure_log(self.out, self.records):
                    self.say(f"[{self.label}] {self.out / checkpoint.LOG_FILE} was missing, damaged, behind or ahead "
                             "of its checkpoint: rewrote it from the checkpoint's records", always=True)  # fmt: skip
            for hook in self.hooks:
                hook.on_run_start(self)
            while self.next_step < self.total_steps:
                g, version, clock = self.next_step, self.policy_version, timeline.Phases()
                with clock:  # the step and the hooks after it (an evaluation marks "eval") are in its time
                    try:
                        record = self.step(g)
                    except SourceExhausted as end:  # e.g. a trace log with no further batch: the run ends here
                        self.ended_early = str(end)
                        self.say(f"[{self.label}] stopped after {g} of {self.total_steps} steps: {end}")
                        break
                    if self.warmup_length is None:
                        self._decide_warmup(record)
                    self.records.append(record)
                    self.next_step = g + 1
                    for hook in self.hooks:
                        hook.on_step_end(self, record)
                record.update(clock.fields())
                clock.emit(timeline.TRAINER.format(rank=self.world.rank),
                           {"step": g, "phase": record["phase"], "version": version, "staleness": record["staleness"],
                            "staleness_mean": record["staleness_mean"], "time": record["time"]})  # fmt: skip
                if self.world.is_main:
                    checkpoint.append_log(self.out, record)
                if self.next_step % self.settings.checkpoint_every == 0 or self.next_step == self.total_steps:
                    self.save_checkpoint()
                for hook in self.hooks:
                    hook.on_checkpoint(self, g)
                progress.update(record)
                self._check_fault_budget()
            if self._saved_at != self.next_step:  # a run that ended early: its last steps made durable
                self.save_checkpoint()
            self._check_trained()
            if self.world.is_main:
                if self.records and checkpoint.ensure_log(self.out, self.records):
                    self.say(f"[{self.label}] {self.out / checkpoint.LOG_FILE} was missing, damaged or behind its "
                             "checkpoint: rewrote it from the checkpoint's records", always=True)  # fmt: skip
                self.save_adapter()
            for hook in self.hooks:
                hook.on_run_end(self)
            failed = False
        finally:
            progress.close()
            self.source.close()  # rollout workers stop even when a step fails
            for hook in self.hooks:
                hook.on_close(self)
            if failed and self.world.is_main:
                self.run_dir.undo()  # a new run that failed before its first checkpoint leaves its folder as found
        self.world.barrier()  # no rank returns before rank 0 has written the adapter
        return self.records

    # -- a run that trained on nothing fails --------------------------------------------------------------------

    def _check_fault_budget(self) -> None:
        """Stop (``NothingTrained``) once the environment ended more than ``fault_budget`` of the trajectories of the
        last ``fault_window`` steps by a fault: their rewards say nothing about the replies. The checkpoint is made
        first, so that --resume continues once the environment is fixed."""
        budget, window = self.settings.fault_budget, self.settings.fault_window
        shares = [r["env_fault_share"] for r in self.records[-window:] if r.get("env_fault_share") is not None]
        if budget >= 1 or len(shares) < window or sum(shares) / window <= budget:
            return
        if self._saved_at != self.next_step:
            self.save_checkpoint()
        raise NothingTrained(
            f"[{self.label}] the environment ended {sum(shares) / window:.0%} of the trajectories of the last {window} "
            f"steps by a fault (--fault-budget {budget:g} over --fault-window {window}; each fault's line was "
            f"logged): their rewards say nothing about the replies; fix the environment, then --resume continues "
            f"from step {self.next_step}"
        )

    def _check_trained(self) -> None:
        """A run that ends having trained on nothing fails (``NothingTrained``) rather than succeeding: no policy
        update although policy steps were asked for, or every trajectory of every step cut at a limit. Its
        checkpoint stays, so --resume continues it; a run with no step at all leaves its folder as it was found."""
        if not self.records:
            if self.total_steps > 0:
                raise NothingTrained(f"[{self.label}] nothing was trained: {self._why_no_batch()}; the run folder is "
                                     "left as it was found")  # fmt: skip
            return
        n = len(self.records)
        if self.settings.steps > 0 and self.policy_version == 0:
            policy = [r for r in self.records if r["phase"] == POLICY]
            why = (f"all {len(policy)} policy steps were skipped (a non-finite loss or gradient)" if policy
                   else f"the run ended after {n} critic warmup steps: {self._why_no_batch()}")  # fmt: skip
            raise NothingTrained(f"[{self.label}] no policy update was made: {why}; the run folder keeps its "
                                 "checkpoint (--resume continues it)")  # fmt: skip
        if all(r.get("truncation_share") == 1.0 for r in self.records):
            r = self.config.rollout
            raise NothingTrained(
                f"[{self.label}] every trajectory of all {n} steps was cut at a limit (--max-new-tokens "
                f"{r.max_new_tokens}{'' if self.config.data.env is None else ', --max-turns, --max-total-tokens'}): "
                "no reply ended, so every reward is the cut-off one and nothing was learned about the task; raise "
                "the limit or check that the model ends its replies (its EOS token)"
            )

    def _why_no_batch(self) -> str:
        """Why the source gave no (further) batch, with what it dropped, in words."""
        why = self.ended_early or "the source gave no batch"
        summary = self.source.summary() if hasattr(self.source, "summary") else {}
        dropped = ", ".join(f"{k.removeprefix('traces_dropped_')} {v}" for k, v in (summary or {}).items()
                            if k.startswith("traces_dropped_") and v)  # fmt: skip
        return why + (f" (traces dropped: {dropped})" if dropped else "")

    def warn(self, message: str) -> None:
        """A warning for the run's summary and results, shown now (by rank 0 alone)."""
        self.warnings.append(message)
        if not self.world.is_main:
            return
        if self.progress:
            tqdm.write("warning: " + message, file=sys.stderr)
        else:
            log.warning(message)

    def say(self, line: str, *, always: bool = False) -> None:
        """A line of progress, by rank 0 alone; ``always`` shows it even on a quiet run (a repair the user should
        know of)."""
        if not self.world.is_main:
            return
        if self.progress:
            tqdm.write(line, file=sys.stderr)
        else:
            (log.warning if always else log.info)(line)

    def eval_done(self, label: str, metrics: dict[str, Any]) -> None:
        """Tell the hooks about an evaluation of this policy (a tracker mirrors it)."""
        for hook in self.hooks:
            hook.on_eval(self, label, metrics)

    # -- checkpoints -------------------------------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        if self.world.is_main:
            track = timeline.TRAINER.format(rank=0)
            with timeline.span("checkpoint", "checkpoint", track, "step", step=self.next_step):
                checkpoint.save(self.out, self._state(), self.records, keep=self.settings.keep_checkpoints)
        self._saved_at = self.next_step

    def _state(self) -> dict[str, Any]:
        return {
            "next_step": self.next_step,
            "policy_version": self.policy_version,
            "critic_warmup_steps": self.warmup_length,
            "micro_batch": self.micro_batch,
            "policy": {n: p.detach().cpu().clone() for n, p in lora_state(self.models.policy).items()},
            "source": self.source.state_dict(),
            "value_head": self.models.value_head.state_dict(),
            "policy_opt": self.policy_opt.state_dict(),
            "critic_opt": self.critic_opt.state_dict(),
            "records": self.records,
            "warnings": self.warnings,
            "hooks": {hook.name: hook.state_dict() for hook in self.hooks},
        }

    def _restore(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        with torch.no_grad():
            for name, p in lora_state(self.models.policy).items():
                p.copy_(state["policy"][name].to(p.device))
        self.source.load_state_dict(state["source"])
        self.models.value_head.load_state_dict(state["value_head"])
        self.policy_opt.load_state_dict(state["policy_opt"])
        self.critic_opt.load_state_dict(state["critic_opt"])
        self.policy_version = state["policy_version"]
        if self.warmup_length is None:  # an automatic warmup the checkpoint may have decided
            self.warmup_length = state.get("critic_warmup_steps")
        self.micro_batch = state.get("micro_batch", self.micro_batch)
        self.next_step, self.records, self.warnings = state["next_step"], state["records"], state["warnings"]
        self._saved_at = self.next_step
        saved = state.get("hooks") or {}
        if "footing" in state and "footing" not in saved:  # a checkpoint from before hooks: the audit's state
            saved["footing"] = {"footing": state["footing"]}
        for hook in self.hooks:
            hook.load_state_dict(saved.get(hook.name, {}))

    # -- the adapter -------------------------------------------------------------------------------------------

    def save_adapter(self) -> Path:
        """OUT/adapter/: the policy adapter (PEFT), the tokenizer and the value head (safetensors + its size),
        loadable with plain ``PeftModel.from_pretrained`` and ``AutoTokenizer``; ``sao export`` merges it."""
        return self.write_adapter(self.out / "adapter")

    def write_adapter(self, path: Path) -> Path:
        m = self.models
        return artifacts.save_adapter(m.policy, m.tokenizer, m.value_head, path, base_model=m.name,
                                      policy_version=self.policy_version)  # fmt: skip

    def describe(self) -> str:
        return describe(self.models.policy)


class _Progress:
    """A progress bar on a terminal; elsewhere (a log file, CI) one plain line every ``log_every`` steps."""

    def __init__(self, trainer: Trainer, total: int, initial: int):
        self.trainer, self.every = trainer, trainer.settings.log_every
        self.tty = trainer.progress and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, desc=f"train {trainer.label}", dynamic_ncols=True,
                        disable=not self.tty, file=sys.stderr)  # fmt: skip

    def update(self, record: dict[str, Any]) -> None:
        summary = {"reward": f"{record['reward_mean']:.2f}", "masked": f"{record['masked_share']:.4f}",
                   "ratio_max": f"{record['ratio_max']:.2f}", "stale": record["staleness"]}  # fmt: skip
        if self.tty:
            self.bar.total = self.trainer.total_steps  # an automatic warmup shortens the run once it ends
            self.bar.update(1)
            self.bar.set_postfix(summary)
        elif self.trainer.progress and (record["step"] + 1) % self.every == 0:
            fields = " ".join(f"{k} {v}" for k, v in summary.items())
            print(f"[{self.trainer.label}] step {record['step'] + 1}/{self.trainer.total_steps} {fields} "
                  f"({record['time']:.1f}s)", file=sys.stderr, flush=True)  # fmt: skip

    def close(self) -> None:
        self.bar.close()
