"""Every hyperparameter of a run, in one place, with the published protocol as the default.

``Config()`` is the recipe page's round 1 (SPEC §3). ``Config.preset("tiny")`` is the embedded default
that runs on a 2-core CPU with no network: a tiny Qwen2-shaped model warm-started on a generated
arithmetic task. Each field says what it is and, one line away, why its default is what it is. The CLI
maps ``--flag-name`` to ``flag_name`` and changes nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from sao.algorithm import CORRECTIONS, SAO
from sao.errors import ConfigError


@dataclass(frozen=True)
class Config:
    # --- what to train -----------------------------------------------------------------------------------
    model: str = "Qwen/Qwen2.5-1.5B-Instruct"
    """Hub id or local directory of the base causal LM; "tiny" builds the CPU stand-in. The page's base."""
    data: str | None = None
    """GSM8K source: None for the hub (openai/gsm8k), or a directory with train.jsonl and test.jsonl;
    "tiny" generates the arithmetic task."""
    train_prompts: int = 512
    """Training prompts drawn from the train split after decontamination. The page's 512."""
    test_prompts: int = 120
    """Held-out tasks drawn from the test split for eval. The page's 120."""
    data_seed: int = 0
    """Seed of the held-out and training draws; fixed so that every run scores the same tasks."""

    # --- the algorithm (SAO) -----------------------------------------------------------------------------
    arm: str = "dis"
    """Correction rule: "dis" (recipe: mask outside the band), "none" (baseline), "tis", "seqmask"."""
    band: tuple[float, float] = (0.7, 6.0)
    """IS band (lo, hi); must bracket 1. The page's; the paper's coding band is (0.2, 4.0)."""
    gae_alpha: float = 1.5
    """λ_i = 1 − 1/(α L_i). SAO's α (VAPO used 0.05)."""
    tis_cap: float = 2.0
    """Cap C for the "tis" rule only."""
    critic_steps: int = 2
    """Critic updates per policy update. The page's 2."""
    critic_warmup: int = 10
    """Critic-only steps, each on a fresh batch, before the first policy step. The page's 10."""

    # --- optimisation ------------------------------------------------------------------------------------
    steps: int = 40
    """Policy steps after the critic warmup. The page's 40."""
    batch_size: int = 64
    """Prompts (= trajectories: one rollout per prompt) per optimizer step. The page's 64."""
    lr: float = 1e-5
    """AdamW on the LoRA adapter. The page's round 1 (round 2 is 1e-4)."""
    critic_lr: float = 1e-4
    """AdamW on the value head. The page's override: a one-layer head at 5e-6 does not leave its zero init."""
    grad_clip: float = 1.0
    """Global norm clip on the policy gradient. The page's 1.0."""
    lora_rank: int = 16
    """LoRA rank. The page's 16."""
    lora_alpha: int = 32
    """LoRA alpha. The page's 32."""
    seed: int = 17
    """Training seed: set right before the adapter is built, and the root of every sampler and data-order
    RNG. The page's 17. Run s of --train-runs uses seed + s."""

    # --- staleness and sampling --------------------------------------------------------------------------
    lag: int = 4
    """The sampler's adapter is refreshed every LAG policy steps: staleness 0, then 1..LAG. The page's 4."""
    temperature: float = 1.0
    """Rollout temperature. 1.0 with no top-p/top-k/penalty: the ratio needs common support."""
    max_new_tokens: int = 256
    """Rollout length cap. The page's 256."""

    # --- evaluation --------------------------------------------------------------------------------------
    eval_samples: int = 4
    """Samples per held-out task for pass@1. The page's 4."""
    eval_temperature: float = 0.7
    """Eval sampling temperature. The page's 0.7."""
    eval_max_new_tokens: int = 256
    """Eval reply length cap; the same as training by default."""
    base_evals: int = 3
    """Evals of the untrained base model, for the noise floor. The page's 3."""
    train_runs: int = 1
    """Training seeds per arm. The page ran 1 (hence "unresolved"); 2+ lets compare() say "flat"."""

    # --- machinery (no effect on results beyond floating-point order) ------------------------------------
    device: str = "auto"
    """"auto" picks CUDA when available, else the CPU."""
    micro_batch: int = 0
    """Rows per forward+backward in the training pass; 0 = as many as fit in free GPU memory (the whole batch
    on the CPU). Memory only: the loss is a sum over rows, so every micro-batch size gives the same update."""
    grad_checkpoint: bool = False
    """Recompute each decoder layer's activations in the backward instead of storing them: ~1/3 more compute
    for a fraction of the memory, so larger micro-batches fit (the bench measures both)."""
    logprob_chunk: int = 1024
    """Rows per full-vocabulary log-softmax chunk (memory only)."""
    eval_batch: int = 480
    """Sequences decoded together during eval (all samples of 120 tasks × 4 at once on a GPU)."""
    engine: str = "local"
    """Where batches come from: "local" (the stale sampler in this process, reproducible) or "ray"
    (asynchronous rollout workers, for throughput; see sao.distributed)."""
    max_staleness: int = 4
    """--engine ray: the oldest a trajectory may be when it is put in a batch (policy updates since the
    adapter that wrote it); older ones are dropped and counted. Equal to the default LAG, so both engines
    train on the same staleness range (0..4)."""
    rollout_workers: int = 2
    """--engine ray: rollout workers (Ray actors), each with its own copy of the model."""
    ray_address: str | None = None
    """--engine ray: address of a running Ray cluster to join ("auto", "ray://host:10001", "host:6379");
    None starts a local one for the run and stops it afterwards."""
    worker_cpus: float = 1.0
    """--engine ray: CPUs Ray reserves for each rollout worker (also its torch thread count)."""
    worker_gpus: float = 0.0
    """--engine ray: GPUs Ray reserves for each rollout worker; > 0 puts the worker's model on CUDA,
    fractions share a GPU between workers."""
    rollout_batch: int = 8
    """--engine ray: prompts per worker draw call (small, so that trajectories arrive continuously)."""
    decoder: str = "auto"
    """How tokens are decoded: "plain" (the reference loop), "graph" (sao.engine: static KV cache, the decode
    step as a CUDA graph on a GPU, eager elsewhere), or "auto": graph on a GPU, plain on the CPU."""
    dead_band_share: float = 0.001
    """Reachability warning threshold: a masked share below this (0.1%) on stale batches means the band
    is dead at these settings."""

    def __post_init__(self) -> None:
        if self.arm not in CORRECTIONS:
            raise ConfigError(f"--arm must be one of {sorted(CORRECTIONS)}, got {self.arm!r}")
        object.__setattr__(self, "band", tuple(float(x) for x in self.band))
        self.sao()  # validates band, alpha, cap, critic settings with SAO's own messages
        positive = {
            "steps": self.steps >= 0,
            "batch_size": self.batch_size >= 1,
            "train_prompts": self.train_prompts >= 1,
            "test_prompts": self.test_prompts >= 1,
            "max_new_tokens": self.max_new_tokens >= 1,
            "eval_max_new_tokens": self.eval_max_new_tokens >= 1,
            "eval_samples": self.eval_samples >= 1,
            "base_evals": self.base_evals >= 0,
            "train_runs": self.train_runs >= 1,
            "lora_rank": self.lora_rank >= 1,
            "micro_batch": self.micro_batch >= 0,
            "logprob_chunk": self.logprob_chunk >= 1,
            "eval_batch": self.eval_batch >= 1,
        }
        for name, ok in positive.items():
            if not ok:
                raise ConfigError(f"--{name.replace('_', '-')} is out of range: {getattr(self, name)}")
        if self.lag < 0:
            raise ConfigError(f"--lag must be >= 0 (0 = always fresh), got {self.lag}")
        for name in ("lr", "critic_lr", "grad_clip", "temperature", "eval_temperature"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")
        if self.engine not in ("local", "ray"):
            raise ConfigError(f"--engine must be 'local' or 'ray', got {self.engine!r}")
        if self.max_staleness < 0:
            raise ConfigError(f"--max-staleness must be >= 0 (0 = only fresh trajectories), got {self.max_staleness}")
        if self.rollout_workers < 1 or self.rollout_batch < 1:
            raise ConfigError(
                f"--rollout-workers and --rollout-batch must be >= 1, got {self.rollout_workers} and "
                f"{self.rollout_batch}"
            )
        for name in ("worker_cpus", "worker_gpus"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
        if self.ray_address is not None and not self.ray_address.strip():
            raise ConfigError("--ray-address must not be empty (leave it out to start a local Ray cluster)")
        if self.decoder not in ("auto", "plain", "graph"):
            raise ConfigError(f"--decoder must be 'auto', 'plain' or 'graph', got {self.decoder!r}")

    def uses_engine(self, device_type: str) -> bool:
        """Whether rollouts and evals go through ``sao.engine`` on this device."""
        return self.decoder == "graph" or (self.decoder == "auto" and device_type == "cuda")

    def sao(self) -> SAO:
        """The algorithm object these settings describe."""
        return SAO(
            ratio=self.band,
            gae_alpha=self.gae_alpha,
            correction=self.arm,
            tis_cap=self.tis_cap,
            critic_steps=self.critic_steps,
            critic_warmup=self.critic_warmup,
        )

    def replace(self, **changes: Any) -> Config:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown settings: {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Config:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (tuple(v) if k == "band" else v) for k, v in values.items() if k in known})

    @classmethod
    def preset(cls, name: str, **changes: Any) -> Config:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **changes})


PRESETS: dict[str, dict[str, Any]] = {
    # The published protocol (SPEC §3).
    "protocol": {},
    # The CPU stand-in: the protocol's counts (64 prompts a step, 10 warmup + 40 policy steps, LAG 4,
    # 3 base evals of 120 tasks × 4 samples) on the tiny model and task. Replies are ~14 tokens, so 20
    # new tokens is the cap. A 0.14M-parameter model needs a larger step than a 1.5B one: at 1e-3 the
    # reward rises ~0.16 in 40 steps on every seed measured (at 2e-3 it oscillates and falls); the
    # critic's 1e-3 tracks the batch mean within a few steps.
    "tiny": {
        "model": "tiny",
        "data": "tiny",
        "train_prompts": 480,
        "test_prompts": 120,
        "lr": 1e-3,
        "critic_lr": 1e-3,
        "max_new_tokens": 20,
        "eval_max_new_tokens": 20,
        "micro_batch": 64,
    },
}
