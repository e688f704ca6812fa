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
``records`` (the log record, the reachability checks), ``checkpoint`` (the run folder).

Deliberately left out: evaluation and the two-arm experiment (``sao.experiment``), and learning-rate
schedules (the page used a constant rate).
"""

from __future__ import annotations

import time
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
        self.config, self.out, self.progress = config, Path(out_dir), progress
        self.label = label or f"{config.arm} seed {config.seed}"
        self.sao = config.sao()
        self.split = split or load_split(config)
        if len(self.split.train) < config.batch_size:
            raise ConfigError(
                f"--batch-size {config.batch_size} is larger than the {len(self.split.train)} training prompts"
            )
        run_record = {"config": config.to_dict(), "data": self.split.counts, "source": self.split.source}
        checkpoint.claim(self.out, run_record, resume)
        self.model_path = model_path(config)
        self.models = Models.load(
            self.model_path,
            device=config.device,
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
        checkpoint.write_config(self.out, run_record)  # claimed only once everything loaded
        self.next_step, self.records, self.warnings = 0, [], []
        self._last_mask_report: int | None = None
        if resume:
            self._restore(checkpoint.load(self.out))
        self.tracker = make_tracker(config.track, self.out, self.label, config.to_dict())  # after the claim

    def _make_source(self) -> Source:
        """``--engine local`` (default, reproducible) or ``--engine ray`` (asynchronous rollout workers)."""
        c, m = self.config, self.models
        order = PromptOrder([t.id for t in self.split.train], c.seed)
        if c.engine == "ray":
            from sao.rollout.ray_workers import RaySource  # optional dependency

            return RaySource(
                c, model_path=self.model_path, policy=m.policy, pad_token_id=m.tokenizer.pad_token_id,
                prompts=self.prompts, order=order, label=self.label, progress=self.progress,
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

        def attempt(rows: int):  # teacher-forced pass → SAO.update → loss → backward
            self.policy_opt.zero_grad(set_to_none=True)
            return policy_gradient_pass(
                self.models, self.sao, rollout, rewards, rows=rows, with_policy_gradient=phase == POLICY,
                temperature=self.config.temperature, logprob_chunk=self.config.logprob_chunk,
            )  # fmt: skip

        width = rollout.prompt_ids.shape[1] + rollout.response_ids.shape[1]
        rows = self.micro_batch or auto_micro_batch(self.models.policy, width, len(rewards))
        result, rows, retries = with_oom_retry(attempt, rows, self._say_oom)
        self.micro_batch = rows if retries else self.micro_batch  # a halving holds for the rest of the run
        grad_norm, skipped = float("nan"), False
        if phase == POLICY:  # clip → AdamW on LoRA, unless something was not finite
            grad_norm, skipped = apply_policy_step(self.policy_opt, self.lora_params, self.config.grad_clip,
                                                   result.finite)  # fmt: skip
            if not skipped:
                self.policy_version += 1
                self.source.after_update(self.policy_version)
        targets = result.update.value_targets  # [B, R] Monte Carlo returns
        critic_loss = critic_steps(self.models.value_head, self.critic_opt, result.forward.hidden, targets,
                                   rollout.actions, self.sao.critic_steps)  # fmt: skip
        record = step_record(
            step=g, phase=phase, policy_step=g - self.sao.critic_warmup if phase == POLICY else None,
            policy_version=self.policy_version, staleness=batch.staleness, rollout=rollout, rewards=rewards,
            update=result.update, critic_loss=critic_loss, grad_norm=grad_norm, skipped=skipped,
        )  # fmt: skip
        return {
            "arm": self.config.arm, "seed": self.config.seed, **record, **batch.info, "loss": result.loss,
            "micro_batch": self.micro_batch, "oom_retries": retries,
            "time": time.perf_counter() - started, "time_sample": sampled - started,
        }  # fmt: skip

    def rewards(self, batch) -> torch.Tensor:
        """The environments' rewards when they graded the trajectories (per turn when some took several),
        else the task's reward function on each reply."""
        rollout = batch.rollout
        if rollout.rewards is not None:
            return rollout.turn_rewards if bool((rollout.turns > 1).any()) else rollout.rewards
        pairs = zip(rollout.texts, batch.task_ids, strict=True)
        return torch.tensor([self.reward_fn(text, self.tasks[i]) for text, i in pairs])

    def _say_oom(self, rows: int) -> None:
        tqdm.write(f"[{self.label}] out of memory in the training pass: micro-batch -> {rows}, retrying")

    # -- the loop ---------------------------------------------------------------------------------------

    def run(self, close_tracker: bool = True) -> list[dict[str, Any]]:
        """Every remaining step, a checkpoint after each, then the adapter. ``close_tracker`` False leaves the
        tracker open for the caller's eval."""
        bar = tqdm(total=self.total_steps, initial=self.next_step, desc=f"train {self.label}",
                   disable=not self.progress, dynamic_ncols=True)  # fmt: skip
        try:
            for g in range(self.next_step, self.total_steps):
                record = self.step(g)
                self.records.append(record)
                self.check_reachability()
                self.next_step = g + 1
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
        self.save_adapter()
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
