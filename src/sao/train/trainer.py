"""One arm, one seed: critic warmup, then policy steps on stale rollouts. ``Trainer.step`` is the data path:

    prompts ──► source (stale sampler, or Ray workers) ──► trajectories + sampler_logprobs ──► rewards
            ──► teacher-forced pass, micro-batch by micro-batch (logprobs with grad, hidden detached)
            ──► value head ──► SAO.update ──► loss = −Σ c·logprobs ──► backward
            ──► clip 1.0 ──► AdamW on LoRA
            ──► critic_steps × squared error on the stored hidden states ──► one log record

Global step g runs 0 .. critic_warmup + steps − 1; the first ``critic_warmup`` steps train only the critic,
each on a fresh batch. With the local source (the default) every source of randomness after setup is seeded
from (seed, g), so a run resumed from the checkpoint of step g continues exactly as if it had never stopped.
The pieces beside the step: ``learn`` (the pass, the policy step, the critic, out-of-memory retry),
``records`` (the log record, the reachability checks), ``checkpoint`` (the run folder), ``distributed``
(under torchrun: rank 0 draws and writes, every rank trains its rows of the batch; the same update).

With ``--traces`` the batches come from a serving system's log (``sao.rollout.traces``): the run ends when the log
has no further batch, the first staleness-0 batch is audited for the temperature footing of its log-probs
(``audit_footing``), and every adapter is published to OUT/published/ for the server to reload (``publish``).

Deliberately left out: evaluation and the two-arm experiment (``sao.experiment``), and learning-rate
schedules (the page used a constant rate).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from sao.core.config import Config
from sao.core.errors import ConfigError, DataError
from sao.core.io import read_json
from sao.model import artifacts
from sao.model.forward import token_logprobs, trunk_and_head
from sao.model.policy import Models, auto_micro_batch, describe, lora_state
from sao.rollout.sources import POLICY, WARMUP, LocalStaleSource, PromptOrder, Source, SourceExhausted
from sao.rollout.types import Sampling
from sao.tasks import load_reward
from sao.tasks.base import Task, TaskSet
from sao.tasks.environments import episodes_for, prompt_text
from sao.train import checkpoint
from sao.train.build import instruction_for, load_split, model_path
from sao.train.distributed import BroadcastSource, World
from sao.train.learn import apply_policy_step, critic_steps, policy_gradient_pass, with_oom_retry
from sao.train.records import dead_band_warning, masking_line, step_record
from sao.train.tracking import make_tracker

# The temperature-footing audit (``Trainer.audit_footing``), on mean |log r| per action token at staleness 0. A
# footing fits within FOOTING_TOLERANCE (float32 gives ~1e-7; a bf16 serving engine against this pass ~1e-3..1e-2).
# Footing 1 is preferred when it is at least FOOTING_MARGIN times closer than footing T, and T is off by more than
# FOOTING_FLOOR (below it the two footings are indistinguishable, and so harmless: a confident model's log-probs
# barely move with the temperature; the tiny model's move ~0.03 between 0.7 and 1).
FOOTING_TOLERANCE, FOOTING_MARGIN, FOOTING_FLOOR = 0.05, 2.0, 1e-3


class Trainer:
    """Trains one arm with one seed into ``out_dir``; ``run()`` returns the log records."""

    def __init__(
        self,
        config: Config,
        out_dir: str | Path,
        *,
        split: TaskSet | None = None,
        resume: bool = False,
        progress: bool = True,
        label: str | None = None,
    ):
        self.world = World.from_env(config.device)  # one process, or this rank of a torchrun group
        self.config, self.out, self.progress = config, Path(out_dir), progress and self.world.is_main
        self.label = label or f"{config.arm} seed {config.seed}"
        self.sao = config.sao()
        if config.traces is not None:  # the prompts, completions and tasks come from the log
            split = split or TaskSet(train=[], test=[], counts={}, source=f"traces:{config.traces}")
        self.split = split or load_split(config)
        if config.traces is None and len(self.split.train) < config.batch_size:
            raise ConfigError(
                f"--batch-size {config.batch_size} is larger than the {len(self.split.train)} training prompts"
            )
        self.world.shard(config.batch_size)  # a batch that does not split evenly over the ranks is refused here
        if config.traces is not None and self.world.size > 1:
            raise ConfigError("--traces under torchrun is not supported yet: train on a trace log in one process")
        run_record = {"config": config.to_dict(), "data": self.split.counts, "source": self.split.source,
                      "world_size": self.world.size}  # fmt: skip
        checkpoint.claim(self.out, run_record, resume)
        resumed = checkpoint.load(self.out) if resume else None  # a damaged one fails here, before any load
        self.model_path = model_path(config)
        self.models = Models.load(
            self.model_path,
            device=self.world.device(config.device),
            lora_rank=config.lora_rank,
            lora_alpha=config.lora_alpha,
            seed=config.seed,
            grad_checkpoint=config.grad_checkpoint,
        )
        self.tasks = {t.id: t for t in self.split.train}
        self.reward_fn = load_reward(config.reward)  # (completion, task) -> float; the GSM8K grader by default
        instruction = instruction_for(config)
        self.prompts = {t.id: prompt_text(self.models.tokenizer, t, instruction) for t in self.split.train}
        self.episodes = episodes_for(config, self.models.tokenizer, self.split.train, instruction)
        self.lora_params = list(lora_state(self.models.policy).values())
        self.policy_opt = torch.optim.AdamW(self.lora_params, lr=config.lr, weight_decay=0.0)
        self.critic_opt = torch.optim.AdamW(self.models.value_head.parameters(), lr=config.critic_lr, weight_decay=0.0)
        self.policy_version = 0  # policy updates applied so far
        self.micro_batch = config.micro_batch  # halves on out-of-memory and stays halved
        self.source = self._make_source()
        self.world.barrier()  # every rank has claimed the folder before rank 0 writes into it
        if self.world.is_main:
            checkpoint.write_config(self.out, run_record)  # claimed only once everything loaded
        self.next_step, self.records, self.warnings = 0, [], []
        self._last_mask_report: int | None = None
        self.footing: dict[str, float] | None = None  # the temperature-footing audit of a trace log, once decided
        self.ended_early: str | None = None  # why the source had no further batch (a trace log read to its end)
        self._restore(resumed)
        self.publishing = (config.publish or config.traces is not None) and self.world.is_main
        if self.publishing and self._latest_published() < self.policy_version:
            self.publish()  # version 0 at the start (or the resumed version), for the server to load
        track = config.track if self.world.is_main else None
        self.tracker = make_tracker(track, self.out, self.label, config.to_dict())  # after the claim

    def _make_source(self) -> Source:
        """``--engine local`` (default, reproducible) or ``--engine ray`` (asynchronous rollout workers); under
        torchrun rank 0 reads it and broadcasts each batch to the other ranks."""
        if self.world.size == 1:
            return self._make_rank0_source()
        source = self._make_rank0_source() if self.world.is_main else None
        return BroadcastSource(self.world, source, self.models.device)

    def _make_rank0_source(self) -> Source:
        c, m = self.config, self.models
        if c.traces is not None:
            from sao.rollout.traces import TraceSource

            return TraceSource(
                c.traces, m.tokenizer, batch_size=c.batch_size, max_staleness=c.max_staleness,
                temperature=c.temperature, vocab_size=m.policy.get_input_embeddings().num_embeddings,
                eos_token_ids=m.eos_token_ids, pad_token_id=m.tokenizer.pad_token_id, follow=c.follow,
                follow_timeout=c.follow_timeout, skip_bad=c.skip_bad_traces, device=m.device,
                warn=lambda line: tqdm.write("warning: " + line),
            )  # fmt: skip
        order = PromptOrder([t.id for t in self.split.train], c.seed)
        if c.engine == "ray":
            from sao.rollout.ray_workers import RaySource  # optional dependency

            return RaySource(
                c, model_path=self.model_path, policy=m.policy, pad_token_id=m.tokenizer.pad_token_id,
                prompts=self.prompts, order=order, label=self.label, progress=self.progress,
                reserved_gpus=self.world.training_gpus(), episodes=self.episodes,
            )  # fmt: skip
        sampling = Sampling(c.max_new_tokens, c.temperature, m.eos_token_ids, m.tokenizer.pad_token_id)
        return LocalStaleSource(
            m.policy, m.tokenizer, self.prompts, order, lag=c.lag, batch_size=c.batch_size,
            critic_warmup=c.critic_warmup, sampling=sampling, seed=c.seed, decoder=c.decoder, episodes=self.episodes,
        )  # fmt: skip

    @property
    def total_steps(self) -> int:
        return self.sao.critic_warmup + self.config.steps

    @property
    def max_staleness(self) -> int:
        """The largest staleness a batch can have: LAG for the stale sampler, the bound for Ray workers and traces."""
        uses_bound = self.config.engine == "ray" or self.config.traces is not None
        return self.config.max_staleness if uses_bound else self.config.lag

    # -- one step, in the order of the data path ---------------------------------------------------------

    def step(self, g: int) -> dict[str, Any]:
        phase = WARMUP if g < self.sao.critic_warmup else POLICY
        started = time.perf_counter()
        batch = self.source.next_batch(g, phase, self.policy_version)  # prompts → sampler → trajectories
        rollout = batch.rollout
        rewards = self.rewards(batch)  # [B], or [B, R] per turn when an environment answered between actions
        sampled = time.perf_counter()

        def attempt(rows: int):  # teacher-forced pass → SAO.update → loss → backward (this rank's rows)
            self.policy_opt.zero_grad(set_to_none=True)
            return policy_gradient_pass(
                self.models, self.sao, rollout, rewards, rows=rows, with_policy_gradient=phase == POLICY,
                temperature=self.config.temperature, logprob_chunk=self.config.logprob_chunk, world=self.world,
            )  # fmt: skip

        own = self.world.shard(len(rewards))  # this rank's rows (every row on one process)
        width = rollout.prompt_ids.shape[1] + rollout.response_ids.shape[1]
        rows = self.micro_batch or auto_micro_batch(self.models.policy, width, own.stop - own.start)
        result, rows, retries = with_oom_retry(attempt, rows, self._say_oom)
        self.micro_batch = rows if retries else self.micro_batch  # a halving holds for the rest of the run
        footing = self.audit_footing(batch, result.forward) if self.config.traces is not None else {}
        loss, finite = self.world.total(result.loss), self.world.all(result.finite)  # over ranks (as is on one)
        grad_norm, skipped = float("nan"), False
        if phase == POLICY:  # (sum over ranks) → clip → AdamW on LoRA, unless something was not finite
            if finite:
                self.world.sum_gradients(self.lora_params)
            grad_norm, skipped = apply_policy_step(self.policy_opt, self.lora_params, self.config.grad_clip,
                                                   finite)  # fmt: skip
            if not skipped:
                self.policy_version += 1
                self.source.after_update(self.policy_version)
                if self.publishing:
                    self.publish()
        targets = result.update.value_targets[own]  # [b, R] Monte Carlo returns of this rank's rows
        critic_loss = critic_steps(self.models.value_head, self.critic_opt, result.forward.hidden, targets,
                                   rollout.action_mask[own], self.sao.critic_steps, world=self.world)  # fmt: skip
        record = step_record(
            step=g, phase=phase, policy_step=g - self.sao.critic_warmup if phase == POLICY else None,
            policy_version=self.policy_version, staleness=batch.staleness, rollout=rollout, rewards=rewards,
            update=result.update, critic_loss=critic_loss, grad_norm=grad_norm, skipped=skipped,
        )  # fmt: skip
        return {
            "arm": self.config.arm, "seed": self.config.seed, **record, **batch.info, **footing, "loss": loss,
            "micro_batch": self.micro_batch, "oom_retries": retries, "world_size": self.world.size, **self.truncation,
            "time": time.perf_counter() - started, "time_sample": sampled - started,
        }  # fmt: skip

    def rewards(self, batch) -> torch.Tensor:
        """The environments' rewards when they graded the trajectories (per turn when some took several),
        else the task's reward function on each reply — 0 for a reply cut off at the token limit under
        ``truncated_reward`` "zero" (the default). ``self.truncation`` counts the cut-off replies and those the
        grader would have credited, for the step's record."""
        rollout = batch.rollout
        self.truncation = {}
        if getattr(batch, "tasks", None) is not None:  # rows that carry their own task (logged traces)
            self._grade_carried_tasks(batch)
        if rollout.turns is not None:
            return self._episode_rewards(rollout)
        pairs = zip(rollout.texts, batch.task_ids, strict=True)
        graded = torch.tensor([self.reward_fn(text, self.tasks[i]) for text, i in pairs])  # [B]
        cut = rollout.cut.to(graded.device)  # [B] hit max_new_tokens without finishing
        credited = cut & (graded > 0)  # [B] cut off, yet the grader found a credited answer in the text
        self.truncation = {"truncated_replies": int(cut.sum()), "truncated_with_credit": int(credited.sum())}
        if self.config.truncated_reward == "zero":
            return torch.where(cut, torch.zeros_like(graded), graded)
        return graded

    def _grade_carried_tasks(self, batch) -> None:
        """Rows that carry their own task fields (logged traces with no reward): the reward function on the row's
        text, put on its last action token, where a logged reward would be."""
        rollout = batch.rollout
        columns = torch.arange(rollout.action_mask.shape[1], device=rollout.action_mask.device)
        last = (rollout.action_mask.long() * columns).argmax(dim=1)  # [B] the last action token
        for i, fields in enumerate(batch.tasks):
            if fields is None:
                continue
            task = Task(id=batch.task_ids[i], question=str(fields.get("question", "")),
                        answer=str(fields.get("answer", "")), fields=dict(fields))  # fmt: skip
            rollout.turns.rewards[i, last[i]] = float(self.reward_fn(rollout.texts[i], task))

    def _episode_rewards(self, rollout) -> torch.Tensor:
        """The environments' rewards, per turn when some trajectory took several: under ``truncated_reward``
        "zero" the turn whose action was cut at a token limit earns 0, as a cut single reply does."""
        per_turn = rollout.turns.rewards.clone()  # [B, R] each turn's reward on its last action token
        columns = torch.arange(per_turn.shape[1], device=per_turn.device)
        last = (rollout.action_mask.long() * columns).argmax(dim=1)  # [B] the last action token
        rows = torch.arange(per_turn.shape[0], device=per_turn.device)
        cut = rollout.cut.to(per_turn.device)  # [B]
        credited = cut & (per_turn[rows, last] > 0)
        self.truncation = {"truncated_replies": int(cut.sum()), "truncated_with_credit": int(credited.sum())}
        if self.config.truncated_reward == "zero":
            per_turn[rows[cut], last[cut]] = 0.0
        return per_turn if bool((rollout.turns.count > 1).any()) else per_turn.sum(dim=1)

    def _say_oom(self, rows: int) -> None:
        tqdm.write(f"[{self.label}] out of memory in the training pass: micro-batch -> {rows}, retrying")

    # -- the loop ---------------------------------------------------------------------------------------

    def run(self, close_tracker: bool = True, after_step: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
        """Every remaining step, a checkpoint after each, then the adapter. ``close_tracker`` False leaves the
        tracker open for the caller's eval. ``after_step(g)`` runs after step g and before its checkpoint (the
        experiment's intermediate evals): a run killed inside it repeats step g and the call on --resume."""
        bar = tqdm(total=self.total_steps, initial=self.next_step, desc=f"train {self.label}",
                   disable=not self.progress, dynamic_ncols=True)  # fmt: skip
        try:
            for g in range(self.next_step, self.total_steps):
                try:
                    record = self.step(g)
                except SourceExhausted as end:  # a trace log with no further batch: the run ends here, cleanly
                    self.ended_early = str(end)
                    tqdm.write(f"[{self.label}] stopped after {g} of {self.total_steps} steps: {end}")
                    break
                self.records.append(record)
                self.check_reachability()
                self.next_step = g + 1
                if after_step is not None:
                    after_step(g)
                if self.world.is_main:
                    checkpoint.save(self.out, self._state(), self.records)
                self.tracker.log_step(record, g)  # after the save: a killed run never shows a step twice
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward_mean']:.2f}", masked=f"{record['masked_share']:.4f}",
                                ratio_max=f"{record['ratio_max']:.2f}", stale=record["staleness"])  # fmt: skip
        finally:
            bar.close()
            self.source.close()  # rollout workers stop even when a step fails
            if close_tracker:
                self.tracker.close()
        if self.world.is_main:
            # A finished run resumed takes no step: its log is checked against the checkpoint's records here.
            if self.records and checkpoint.ensure_log(self.out, self.records):
                tqdm.write(f"[{self.label}] {self.out / checkpoint.LOG_FILE} was missing, damaged or behind its "
                           f"checkpoint: rewrote it from {checkpoint.CHECKPOINT_FILE}")  # fmt: skip
            self.save_adapter()
            if self.config.traces is not None:
                checkpoint.write_traces_summary(self.out, {**self.traces_summary(), "footing": self.footing})
        self.world.barrier()  # no rank returns before rank 0 has written the adapter
        return self.records

    def check_reachability(self) -> None:
        """The dead-band warning (once, early) and the masked share by staleness (every cycle), as the run goes."""
        c = self.config
        warning = dead_band_warning(self.records, self.max_staleness, c.dead_band_share, c.band, self.label)
        if warning:
            self.warnings.append(warning)
            tqdm.write("warning: " + warning)
        line = masking_line(self.records, self.max_staleness, self._last_mask_report, c.steps)
        if line and self.progress:
            self._last_mask_report = self.records[-1]["policy_step"] + 1
            tqdm.write(f"[{self.label}] {line}")

    # -- checkpoints ------------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {
            "next_step": self.next_step,
            "policy_version": self.policy_version,
            "micro_batch": self.micro_batch,
            "policy": {n: p.detach().cpu().clone() for n, p in lora_state(self.models.policy).items()},
            "source": self.source.state_dict(),
            "value_head": self.models.value_head.state_dict(),
            "policy_opt": self.policy_opt.state_dict(),
            "critic_opt": self.critic_opt.state_dict(),
            "records": self.records,
            "warnings": self.warnings,
            "footing": self.footing,
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
        self.micro_batch = state.get("micro_batch", self.micro_batch)
        self.next_step, self.records, self.warnings = state["next_step"], state["records"], state["warnings"]
        self.footing = state.get("footing")

    # -- logged traces: the footing audit, publishing, the totals ---------------------------------------

    def audit_footing(self, batch, forward) -> dict[str, float]:
        """Whether the traces' log-probs are on the footing of the temperature they were sampled at.

        On the first batch with staleness-0 rows (the trace's adapter is the policy of this pass), the recorded
        log-probs must equal the teacher-forced ones at --temperature T (|log r| ~ 0, up to a serving engine's
        numerics). They are compared at T and at 1 from the pass's own hidden states (one extra head over those
        rows' action tokens). Footing 1 fits and is clearly closer than T (``FOOTING_*`` above): the server logged
        log-probs before temperature, every ratio would be false, and the run stops with one line. Otherwise T
        fits: go on; or neither fits: a warning (another model or adapter, or other numerics). Decided once,
        logged on that step; skipped at T = 1."""
        temperature = self.config.temperature
        if self.footing is not None or temperature == 1.0:
            return {}
        rollout = batch.rollout
        fresh = torch.tensor([s == 0 for s in batch.staleness], device=rollout.action_mask.device)  # [B]
        mask = rollout.action_mask & fresh[:, None]  # [B, R] action tokens of staleness-0 rows
        if not bool(mask.any()):
            return {}
        recorded = rollout.sampler_logprobs[mask]  # [N]
        with torch.no_grad():
            head = trunk_and_head(self.models.policy)[1]
            at_one = token_logprobs(head, forward.hidden[mask], rollout.response_ids[mask], 1.0,
                                    self.config.logprob_chunk)  # fmt: skip
        at_t = float((forward.logprobs[mask] - recorded).abs().mean())
        at_1 = float((at_one - recorded).abs().mean())
        self.footing = {"footing_abs_log_ratio_at_T": at_t, "footing_abs_log_ratio_at_1": at_1}
        closer_to_1 = at_1 * FOOTING_MARGIN < at_t and at_t > FOOTING_FLOOR
        if closer_to_1 and at_1 <= FOOTING_TOLERANCE:
            raise DataError(
                f"the traces' log-probs were taken before temperature: at staleness 0 they match the policy at "
                f"temperature 1 (mean |log r| {at_1:.2e}) and not at the traces' temperature {temperature} "
                f"({at_t:.2e}); log the log-probs of the distribution actually sampled from (vLLM: logprobs-mode "
                "processed_logprobs)"
            )
        if closer_to_1 or at_t > FOOTING_TOLERANCE:
            message = (f"[{self.label}] the traces' log-probs match neither the policy at temperature {temperature} "
                       f"(mean |log r| {at_t:.2e} at staleness 0) nor at 1 ({at_1:.2e}): is the server running this "
                       "run's base model and published adapter?")  # fmt: skip
            self.warnings.append(message)
            tqdm.write("warning: " + message)
        return dict(self.footing)

    def publish(self) -> Path:
        """OUT/published/v{policy_version}/ and LATEST.json pointing at it (``checkpoint.publish``)."""
        return checkpoint.publish(self.out, self.policy_version, self._write_adapter)

    def _latest_published(self) -> int:
        try:
            return int(read_json(self.out / checkpoint.PUBLISHED_DIR / checkpoint.LATEST_FILE)["version"])
        except (OSError, ValueError, KeyError, TypeError):
            return -1

    def traces_summary(self) -> dict[str, Any]:
        """A trace run's totals: used, dropped by reason, the staleness histogram, why reading ended."""
        summary = getattr(self.source, "summary", None)
        return summary() if summary is not None else {}

    def save_adapter(self) -> Path:
        """OUT/adapter/: the policy adapter (PEFT), the tokenizer and the value head (safetensors + its size),
        loadable with plain ``PeftModel.from_pretrained`` and ``AutoTokenizer``; ``sao export`` merges it."""
        return self._write_adapter(self.out / "adapter")

    def _write_adapter(self, path: Path) -> Path:
        m = self.models
        return artifacts.save_adapter(m.policy, m.tokenizer, m.value_head, path, base_model=self.model_path)

    def describe(self) -> str:
        return describe(self.models.policy)
