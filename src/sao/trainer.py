"""One arm, one seed: critic warmup, then policy steps on stale rollouts. The data path, step by step:

    prompts ──► source (stale sampler, or Ray workers) ──► trajectories + sampler_logprobs ──► rewards
            ──► teacher-forced pass, micro-batch by micro-batch (logprobs with grad, hidden detached)
            ──► value head ──► SAO.update ──► loss = −Σ c·logprobs ──► backward
            ──► clip 1.0 ──► AdamW on LoRA
            ──► critic_steps × squared error on the stored hidden states ──► one log record

Global step g runs 0 .. critic_warmup + steps − 1; the first ``critic_warmup`` steps train only the
critic, each on a fresh batch; policy step k = g − critic_warmup follows the staleness cycle of
``sampler.StaleSampler`` (``--engine local``, the default; ``--engine ray`` takes batches from
asynchronous workers instead, see ``sao.distributed``). With the local source every source of randomness
after setup is a generator seeded from (seed, g), and the training prompts of step g are a pure function of
(seed, g), so a run resumed from the checkpoint of step g continues exactly as if it had never stopped.

A step whose loss or gradient norm is not finite is skipped (no optimizer step), counted and logged. After
each step the checkpoint (adapters, value head, both optimizers, counters, the log so far) and
``train_log.json`` are written atomically.

Deliberately left out: evaluation (``sao.evaluate``), the two-arm experiment (``sao.recipe``), and
learning-rate schedules (the page used a constant rate).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sao import grading
from sao.config import Config
from sao.data import DEFAULT_INSTRUCTION, DataSplit, Task, format_prompt, load_gsm8k
from sao.errors import ConfigError
from sao.io import as_json, read_json, save_torch, write_json
from sao.models import (
    TeacherForced,
    ValueHead,
    add_lora,
    auto_micro_batch,
    describe,
    load_base,
    lora_state,
    pick_device,
    set_activation_checkpointing,
    teacher_forced,
)
from sao.sampler import (
    SAMPLER_ADAPTER,
    Rollout,
    StaleSampler,
    decode,
    derived_seed,
    encode_prompts,
    eos_ids,
    sample,
)

WARMUP, POLICY = "critic-warmup", "policy"
LOG_FILE, CHECKPOINT_FILE, CONFIG_FILE = "train_log.json", "checkpoint.pt", "config.json"


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or any allocator error that says so (CPU, MPS)."""
    oom = getattr(torch.cuda, "OutOfMemoryError", ())
    return (bool(oom) and isinstance(error, oom)) or "out of memory" in str(error).lower()


# ---------------------------------------------------------------------------------------------------------
# Setup: data, prompts, models.


def load_split(config: Config) -> DataSplit:
    """The training prompts and held-out tasks the config names."""
    if config.data == "tiny":
        from sao import tiny

        return tiny.make_split(config.train_prompts, config.test_prompts, config.data_seed)
    return load_gsm8k(config.data, n_train=config.train_prompts, n_test=config.test_prompts, seed=config.data_seed)


def instruction_for(config: Config) -> str:
    if config.data == "tiny":
        from sao import tiny

        return tiny.TINY_INSTRUCTION
    return DEFAULT_INSTRUCTION


def model_path(config: Config) -> str:
    """A hub id or directory; "tiny" is the warm-started stand-in, built and cached on first use."""
    if config.model == "tiny":
        from sao import tiny

        return str(tiny.ensure_model())
    return config.model


@dataclass
class Models:
    """What a run trains: the policy (base + LoRA), its tokenizer, and the value head."""

    policy: nn.Module
    tokenizer: Any
    value_head: ValueHead
    device: torch.device
    eos_token_ids: list[int]

    @classmethod
    def load(cls, config: Config) -> Models:
        device = pick_device(config.device)
        base, tokenizer = load_base(model_path(config), device)
        policy = add_lora(base, rank=config.lora_rank, alpha=config.lora_alpha, seed=config.seed)
        if config.grad_checkpoint:
            set_activation_checkpointing(policy, True)
        hidden = base.config.hidden_size
        value_head = ValueHead(hidden).to(device)
        return cls(policy, tokenizer, value_head, device, eos_ids(tokenizer, base))


# ---------------------------------------------------------------------------------------------------------
# Where batches come from.


@dataclass
class Batch:
    """One optimizer step's trajectories and how stale each one is (policy updates between the adapter
    that wrote it and the policy that trains on it)."""

    tasks: list[Task]
    rollout: Rollout
    staleness: list[int]
    info: dict[str, Any] = field(default_factory=dict)  # source counters, logged with the step


class LocalStaleSource:
    """The default source: the trainer's seeded prompt stream drawn by the stale sampler, in the trainer's
    own process. Step g's batch is a pure function of (seed, g) and the adapters, so runs reproduce and
    resume exactly."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.sampler = StaleSampler(trainer.models.policy, trainer.config.lag)
        self.engine = None
        if trainer.config.uses_engine(trainer.models.device.type):
            from sao.engine import Engine

            self.engine = Engine(trainer.models.policy, adapter=SAMPLER_ADAPTER)  # reads the sampler adapter

    def next_batch(self, g: int, phase: str) -> Batch:
        t = self.trainer
        k = g - t.sao.critic_warmup
        if phase == POLICY and self.sampler.refresh_before_draw(k):
            self.sampler.refresh(t.policy_version)
        staleness = t.policy_version - self.sampler.version
        tasks = t.batch_tasks(g)
        generator = torch.Generator(device=t.models.device).manual_seed(derived_seed(t.config.seed, g, "rollout"))
        prompts = [t.prompts[task.id] for task in tasks]
        if self.engine is not None:
            rollout = t.draw_rollout(self.engine, prompts, generator)
        else:
            with self.sampler.active() as model:
                rollout = t.draw_rollout(model, prompts, generator)
        if phase == POLICY and self.sampler.refresh_after_draw(k):
            self.sampler.refresh(t.policy_version)
        return Batch(tasks=tasks, rollout=rollout, staleness=[staleness] * len(tasks))

    def after_update(self, policy_version: int) -> None:
        """Nothing to publish: the sampler copies the policy on its own schedule at draw time."""

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        pass


def make_source(trainer: Trainer):
    """``--engine local`` (default, reproducible) or ``--engine ray`` (asynchronous rollout workers)."""
    if trainer.config.engine == "ray":
        from sao.distributed import RaySource

        return RaySource(trainer)
    return LocalStaleSource(trainer)


# ---------------------------------------------------------------------------------------------------------
# The trainer.


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
        self.config = config
        self.out = Path(out_dir)
        self.progress = progress
        self.label = label or f"{config.arm} seed {config.seed}"
        self.sao = config.sao()
        self.split = split or load_split(config)
        if len(self.split.train) < config.batch_size:
            raise ConfigError(
                f"--batch-size {config.batch_size} is larger than the {len(self.split.train)} training prompts"
            )
        self._check_out_dir(resume)
        self.models = Models.load(config)
        tok = self.models.tokenizer
        instruction = instruction_for(config)
        self.prompts = {t.id: format_prompt(tok, t.question, instruction) for t in self.split.train}
        self.lora_params = list(lora_state(self.models.policy).values())
        self.policy_opt = torch.optim.AdamW(self.lora_params, lr=config.lr, weight_decay=0.0)
        self.critic_opt = torch.optim.AdamW(self.models.value_head.parameters(), lr=config.critic_lr, weight_decay=0.0)
        self.policy_version = 0
        self.source = make_source(self)
        write_json(self.out / CONFIG_FILE, self._config_record())  # claimed only once everything loaded
        self.micro_batch = config.micro_batch  # halves on out-of-memory and stays halved
        self.next_step = 0
        self.records: list[dict[str, Any]] = []
        self.warnings: list[str] = []
        self._last_mask_report: int | None = None
        if resume and (self.out / CHECKPOINT_FILE).exists():
            self._load_checkpoint()

    # -- bookkeeping -----------------------------------------------------------------------------------

    @property
    def total_steps(self) -> int:
        return self.sao.critic_warmup + self.config.steps

    def _check_out_dir(self, resume: bool) -> None:
        """Refuse to mix runs: an existing run needs --resume and the same settings; a folder with other
        files is not ours to write into."""
        config_file = self.out / CONFIG_FILE
        if config_file.exists():
            if not resume:
                raise ConfigError(
                    f"output folder {self.out} already holds a run; "
                    "pass --resume to continue it or choose another --out"
                )
            saved = read_json(config_file)
            if saved != as_json(self._config_record()):
                raise ConfigError(f"--resume: the run in {self.out} was started with other settings; use a new --out")
        elif any(self.out.glob("*")) if self.out.exists() else False:
            raise ConfigError(f"output folder {self.out} is not empty and holds no sao run; choose another --out")

    def _config_record(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "data": self.split.counts, "source": self.split.source}

    def batch_tasks(self, g: int) -> list[Task]:
        """Step g's prompts: epoch e's seeded permutation of the training prompts, read in order."""
        n, b = len(self.split.train), self.config.batch_size
        orders: dict[int, list[int]] = {}
        out = []
        for position in range(g * b, (g + 1) * b):
            epoch, i = divmod(position, n)
            if epoch not in orders:
                rng = torch.Generator().manual_seed(derived_seed(self.config.seed, epoch, "order"))
                orders[epoch] = torch.randperm(n, generator=rng).tolist()
            out.append(self.split.train[orders[epoch][i]])
        return out

    # -- one step --------------------------------------------------------------------------------------

    def step(self, g: int) -> dict[str, Any]:
        phase = WARMUP if g < self.sao.critic_warmup else POLICY
        t0 = time.perf_counter()
        batch = self.source.next_batch(g, phase)
        rollout = batch.rollout
        rewards = torch.tensor(
            [grading.reward(text, t.answer) for text, t in zip(rollout.texts, batch.tasks, strict=True)]
        )
        t_sample = time.perf_counter() - t0

        forward, update, grad_norm, skipped, loss_value, retries = self._learn_with_retry(rollout, rewards, phase)
        if not skipped and phase == POLICY:
            self.source.after_update(self.policy_version)
        critic_loss = self._critic_steps(forward.hidden, update.value_targets, rollout.response_mask)

        record = self._record(g, phase, max(batch.staleness), rollout, rewards, update, critic_loss, grad_norm, skipped)
        histogram: dict[str, int] = {}
        for s in sorted(batch.staleness):
            histogram[str(s)] = histogram.get(str(s), 0) + 1
        record.update(staleness_mean=sum(batch.staleness) / len(batch.staleness), staleness_hist=histogram)
        record.update(batch.info)
        record.update(loss=loss_value, micro_batch=self.micro_batch, oom_retries=retries)
        record.update(time=time.perf_counter() - t0, time_sample=t_sample)
        return record

    def _learn_with_retry(self, rollout: Rollout, rewards: torch.Tensor, phase: str):
        """The teacher-forced pass, SAO.update and the policy step; on out-of-memory the micro-batch halves
        (for the rest of the run) and the step is retried from its start. The result is the same function
        of the batch, only its floating-point summation order changes."""
        retries = 0
        while True:
            try:
                return (*self._learn(rollout, rewards, phase), retries)
            except RuntimeError as error:
                rows = self.micro_batch or len(rollout.response_mask)
                if not is_out_of_memory(error) or rows == 1:
                    raise
                self.policy_opt.zero_grad(set_to_none=True)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                retries += 1
                self.micro_batch = max(1, rows // 2)
                from tqdm import tqdm

                tqdm.write(
                    f"[{self.label}] out of memory in the training pass: micro-batch -> {self.micro_batch}, retrying"
                )

    def _learn(self, rollout: Rollout, rewards: torch.Tensor, phase: str):
        """One teacher-forced pass, micro-batch by micro-batch: forward (with gradients on policy steps),
        the micro-batch's coefficients from ``SAO.update`` with the whole batch's N, backward, free. Only one
        micro-batch's activations are ever alive, and the accumulated gradient is exactly the whole batch's
        −Σ c·∇logprobs. The whole batch's update (stats, value targets) is then computed from the kept
        log-probabilities and hidden states — pure tensor math, no second pass."""
        models, config = self.models, self.config
        policy_step = phase == POLICY
        mask = rollout.response_mask
        n_tokens = float(mask.sum())
        rows = self.micro_batch or auto_micro_batch(
            models.policy, rollout.prompt_ids.shape[1] + mask.shape[1], len(mask)
        )
        logprobs, hidden, values = [], [], []
        loss_value, finite = 0.0, True
        if policy_step:
            self.policy_opt.zero_grad(set_to_none=True)
        for start in range(0, len(mask), rows):
            part = slice(start, start + rows)
            with torch.set_grad_enabled(policy_step):
                forward = teacher_forced(
                    models.policy,
                    rollout.prompt_ids[part],
                    rollout.prompt_mask[part],
                    rollout.response_ids[part],
                    mask[part],
                    temperature=config.temperature,
                    logprob_chunk=config.logprob_chunk,
                )
            with torch.no_grad():
                part_values = models.value_head(forward.hidden)  # [b, R]
            if policy_step and finite:
                update = self.sao.update(
                    {
                        "logprobs": forward.logprobs.detach(),
                        "sampler_logprobs": rollout.sampler_logprobs[part],
                        "values": part_values,
                        "rewards": rewards[part].to(part_values),
                        "action_mask": mask[part],
                    },
                    normalizer=n_tokens,
                )
                loss = update.policy_loss(forward.logprobs)
                loss_value += loss.item()
                if torch.isfinite(loss):
                    loss.backward()
                else:
                    finite = False  # the step will be skipped; finish the pass for the stats and the critic
            logprobs.append(forward.logprobs.detach())
            hidden.append(forward.hidden)
            values.append(part_values)
            del forward
        forward = TeacherForced(logprobs=torch.cat(logprobs), hidden=torch.cat(hidden))
        update = self.sao.update(
            {
                "logprobs": forward.logprobs,
                "sampler_logprobs": rollout.sampler_logprobs,
                "values": torch.cat(values),
                "rewards": rewards.to(forward.logprobs),
                "action_mask": mask,
            }
        )
        grad_norm, skipped = float("nan"), False
        if policy_step:
            grad_norm, skipped = self._policy_step(finite)
        else:
            loss_value = float("nan")
        return forward, update, grad_norm, skipped, loss_value

    def draw_rollout(self, model, prompts: list[str], generator: torch.Generator) -> Rollout:
        """Sample one reply per prompt string with ``model`` (whatever adapter is active; or an ``Engine``)."""
        models, config = self.models, self.config
        prompt_ids, prompt_mask = encode_prompts(models.tokenizer, prompts, models.device)
        rollout = sample(
            model,
            prompt_ids,
            prompt_mask,
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            eos_token_ids=models.eos_token_ids,
            pad_token_id=models.tokenizer.pad_token_id,
            generator=generator,
        )
        rollout.texts = decode(models.tokenizer, rollout)
        return rollout

    def _policy_step(self, loss_finite: bool) -> tuple[float, bool]:
        """Clip and step on the accumulated gradient — unless the loss or the gradient is not finite, in
        which case nothing is applied. Returns (grad_norm, skipped)."""
        if not loss_finite:
            self.policy_opt.zero_grad(set_to_none=True)
            return float("nan"), True
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.lora_params, self.config.grad_clip))
        if not math.isfinite(grad_norm):
            self.policy_opt.zero_grad(set_to_none=True)
            return grad_norm, True
        self.policy_opt.step()
        self.policy_opt.zero_grad(set_to_none=True)
        self.policy_version += 1
        return grad_norm, False

    def _critic_steps(self, hidden: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> float:
        """``critic_steps`` squared-error updates on the detached hidden states; returns the first loss
        (the error of the values this step's advantages were computed with)."""
        first = float("nan")
        steps = max(self.sao.critic_steps, 1)
        for i in range(steps):
            values = self.models.value_head(hidden)[mask]
            loss = torch.mean((values - targets[mask].float()) ** 2)
            if i == 0:
                first = loss.item()
            if not torch.isfinite(loss):
                break
            self.critic_opt.zero_grad(set_to_none=True)
            loss.backward()
            self.critic_opt.step()
        return first

    def _record(self, g, phase, staleness, rollout, rewards, update, critic_loss, grad_norm, skipped) -> dict:
        s = update.stats
        lengths = rollout.lengths.float()
        ratio = update.ratio[rollout.response_mask]
        log_ratio = ratio.log()
        kl = float(((ratio - 1) - log_ratio)[torch.isfinite(log_ratio)].mean())  # KL(sampler‖policy), k3 estimator
        return {
            "arm": self.config.arm,
            "seed": self.config.seed,
            "step": g,
            "phase": phase,
            "policy_step": g - self.sao.critic_warmup if phase == POLICY else None,
            "staleness": staleness,
            "policy_version": self.policy_version,
            "reward_mean": float(rewards.mean()),
            "masked_share": s["masked_share"],
            "would_be_masked_share": s["would_be_masked_share"],
            "ratio_min": s["ratio_min"],
            "ratio_mean": s["ratio_mean"],
            "ratio_max": s["ratio_max"],
            "ratio_p99": s["ratio_p99"],
            "abs_log_ratio_mean": s["abs_log_ratio_mean"],
            "abs_log_ratio_max": s["abs_log_ratio_max"],
            "kl_sampler_policy": kl,
            "admitted_share": s["admitted_share"],
            "advantage_mean": s["advantage_mean"],
            "lambda_mean": s["lambda_mean"],
            "explained_variance": s["explained_variance"],
            "nonfinite": s["nonfinite"],
            "critic_loss": critic_loss,
            "response_length": float(lengths.mean()),
            "truncation_share": float(rollout.truncated.float().mean()),
            "grad_norm": grad_norm,
            "skipped": skipped,
        }

    # -- the loop, checkpoints -------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        from tqdm import tqdm

        bar = tqdm(
            total=self.total_steps,
            initial=self.next_step,
            desc=f"train {self.label}",
            disable=not self.progress,
            dynamic_ncols=True,
        )
        try:
            for g in range(self.next_step, self.total_steps):
                record = self.step(g)
                self.records.append(record)
                self._reachability(record)
                self._report_masking(record)
                self.next_step = g + 1
                self._save()
                bar.update(1)
                bar.set_postfix(
                    reward=f"{record['reward_mean']:.2f}",
                    masked=f"{record['masked_share']:.4f}",
                    ratio_max=f"{record['ratio_max']:.2f}",
                    stale=record["staleness"],
                )
        finally:
            bar.close()
            self.source.close()  # rollout workers stop even when a step fails
        self.save_adapter()
        return self.records

    @property
    def max_staleness(self) -> int:
        """The largest staleness a batch can have: LAG for the stale sampler, the bound for Ray workers."""
        return self.config.max_staleness if self.config.engine == "ray" else self.config.lag

    def _report_masking(self, record: dict[str, Any]) -> None:
        """At the end of every staleness cycle (every 10 policy steps at lag 0), one line: the masked
        share so far at each staleness, so a dead or exploding band shows while the run is young."""
        if not self.progress or record["phase"] != POLICY:
            return
        k = record["policy_step"]
        cycle_end = record["staleness"] == self.max_staleness > 0 or (self.max_staleness == 0 and (k + 1) % 10 == 0)
        due = self._last_mask_report is None or k + 1 - self._last_mask_report >= 10 or k + 1 == self.config.steps
        if not (cycle_end and due):
            return
        self._last_mask_report = k + 1
        policy = [r for r in self.records if r["phase"] == POLICY]
        parts = []
        for s in sorted({r["staleness"] for r in policy}):
            rows = [r for r in policy if r["staleness"] == s]
            masked = sum(r["masked_share"] for r in rows) / len(rows)
            would = sum(r["would_be_masked_share"] for r in rows) / len(rows)
            parts.append(f"{s}: {masked:.4f}" + (f" (would-be {would:.4f})" if would != masked else ""))
        from tqdm import tqdm

        tqdm.write(f"[{self.label}] policy step {k + 1}: masked share by staleness " + ", ".join(parts))

    def _reachability(self, record: dict[str, Any]) -> None:
        """Check once, early — after the first max(LAG, 4) stale batches — whether they mask (or would mask)
        almost nothing; if so, warn: the correction cannot move an eval, and the rest of the run cannot test
        it. Later batches are not re-checked, so the warning means the same thing in every run."""
        stale = [r for r in self.records if r["phase"] == POLICY and r["staleness"] > 0]
        if record["phase"] != POLICY or record["staleness"] == 0 or len(stale) != max(self.max_staleness, 4):
            return
        share = sum(r["would_be_masked_share"] for r in stale) / len(stale)
        if share < self.config.dead_band_share:
            lo, hi = self.config.band
            message = (
                f"[{self.label}] the band ({lo}, {hi}) is dead at these settings: over the first {len(stale)} stale "
                f"steps it would mask {share:.4%} of tokens (threshold {self.config.dead_band_share:.2%}); the two "
                "arms will run the same experiment. Raise --lr or --lag, or narrow --band, to test the mask."
            )
            self.warnings.append(message)
            from tqdm import tqdm

            tqdm.write("warning: " + message)

    def _save(self) -> None:
        state = {
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
        save_torch(self.out / CHECKPOINT_FILE, state)
        write_json(self.out / LOG_FILE, self.records)

    def _load_checkpoint(self) -> None:
        state = torch.load(self.out / CHECKPOINT_FILE, map_location="cpu", weights_only=False)
        with torch.no_grad():
            for name, p in lora_state(self.models.policy).items():
                p.copy_(state["policy"][name].to(p.device))
        self.source.load_state_dict(state["source"])
        self.models.value_head.load_state_dict(state["value_head"])
        self.policy_opt.load_state_dict(state["policy_opt"])
        self.critic_opt.load_state_dict(state["critic_opt"])
        self.policy_version = state["policy_version"]
        self.micro_batch = state.get("micro_batch", self.micro_batch)
        self.next_step = state["next_step"]
        self.records = state["records"]
        self.warnings = state["warnings"]

    def save_adapter(self) -> Path:
        """The trained policy adapter (PEFT format) and value head, for ``sao eval --adapter``."""
        path = self.out / "adapter"
        self.models.policy.save_pretrained(path, selected_adapters=["default"])
        save_torch(path / "value_head.pt", self.models.value_head.state_dict())
        return path

    def describe(self) -> str:
        return describe(self.models.policy)
