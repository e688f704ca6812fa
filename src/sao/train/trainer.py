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
from sao.core.errors import ConfigError
from sao.model import artifacts
from sao.model.policy import Models, auto_micro_batch, describe, lora_state
from sao.rollout.source import POLICY, WARMUP, LocalStaleSource, PromptOrder, Sampling, Source
from sao.tasks import DataSplit, instruction_for, load_reward, load_split, model_path
from sao.tasks.envs import episodes_for, prompt_text
from sao.train import checkpoint
from sao.train.distributed import BroadcastSource, World
from sao.train.learn import apply_policy_step, critic_steps, policy_gradient_pass, with_oom_retry
from sao.train.records import dead_band_warning, masking_line, step_record
from sao.train.tracking import make_tracker


class Trainer:
    """Trains one arm with one seed into ``out_dir``; ``run()`` returns the log records."""

    def __init__(
        self,
        config: Config,
        out_dir: str | Path,
        *,
        split: DataSplit | None = None,
        resume: bool = False,
        progress: bool = True,
        label: str | None = None,
    ):
        self.world = World.from_env(config.device)  # one process, or this rank of a torchrun group
        self.config, self.out, self.progress = config, Path(out_dir), progress and self.world.is_main
        self.label = label or f"{config.arm} seed {config.seed}"
        self.sao = config.sao()
        self.split = split or load_split(config)
        if len(self.split.train) < config.batch_size:
            raise ConfigError(
                f"--batch-size {config.batch_size} is larger than the {len(self.split.train)} training prompts"
            )
        self.world.shard(config.batch_size)  # a batch that does not split evenly over the ranks is refused here
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
        self._restore(resumed)
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
        """The largest staleness a batch can have: LAG for the stale sampler, the bound for Ray workers."""
        return self.config.max_staleness if self.config.engine == "ray" else self.config.lag

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
        targets = result.update.value_targets[own]  # [b, R] Monte Carlo returns of this rank's rows
        critic_loss = critic_steps(self.models.value_head, self.critic_opt, result.forward.hidden, targets,
                                   rollout.actions[own], self.sao.critic_steps, world=self.world)  # fmt: skip
        record = step_record(
            step=g, phase=phase, policy_step=g - self.sao.critic_warmup if phase == POLICY else None,
            policy_version=self.policy_version, staleness=batch.staleness, rollout=rollout, rewards=rewards,
            update=result.update, critic_loss=critic_loss, grad_norm=grad_norm, skipped=skipped,
        )  # fmt: skip
        return {
            "arm": self.config.arm, "seed": self.config.seed, **record, **batch.info, "loss": loss,
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
        if rollout.rewards is not None:
            return self._episode_rewards(rollout)
        pairs = zip(rollout.texts, batch.task_ids, strict=True)
        graded = torch.tensor([self.reward_fn(text, self.tasks[i]) for text, i in pairs])  # [B]
        cut = rollout.truncated.to(graded.device)  # [B] hit max_new_tokens without finishing
        credited = cut & (graded > 0)  # [B] cut off, yet the grader found a credited answer in the text
        self.truncation = {"truncated_replies": int(cut.sum()), "truncated_with_credit": int(credited.sum())}
        if self.config.truncated_reward == "zero":
            return torch.where(cut, torch.zeros_like(graded), graded)
        return graded

    def _episode_rewards(self, rollout) -> torch.Tensor:
        """The environments' rewards, per turn when some trajectory took several: under ``truncated_reward``
        "zero" the turn whose action was cut at a token limit earns 0, as a cut single reply does."""
        per_turn = rollout.turn_rewards.clone()  # [B, R] each turn's reward on its last action token
        columns = torch.arange(per_turn.shape[1], device=per_turn.device)
        last = (rollout.actions.long() * columns).argmax(dim=1)  # [B] the last action token
        rows = torch.arange(per_turn.shape[0], device=per_turn.device)
        cut = rollout.cut.to(per_turn.device)  # [B]
        credited = cut & (per_turn[rows, last] > 0)
        self.truncation = {"truncated_replies": int(cut.sum()), "truncated_with_credit": int(credited.sum())}
        if self.config.truncated_reward == "zero":
            per_turn[rows[cut], last[cut]] = 0.0
        return per_turn if bool((rollout.turns > 1).any()) else per_turn.sum(dim=1)

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
                record = self.step(g)
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

    def save_adapter(self) -> Path:
        """OUT/adapter/: the policy adapter (PEFT), the tokenizer and the value head (safetensors + its size),
        loadable with plain ``PeftModel.from_pretrained`` and ``AutoTokenizer``; ``sao export`` merges it."""
        m = self.models
        return artifacts.save_adapter(m.policy, m.tokenizer, m.value_head, self.out / "adapter",
                                      base_model=self.model_path)  # fmt: skip

    def describe(self) -> str:
        return describe(self.models.policy)
