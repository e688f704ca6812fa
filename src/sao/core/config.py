"""Every hyperparameter of a run, in one place, with the published protocol as the default.

``Config()`` is the recipe page's round 1 (SPEC §3). ``Config.preset("tiny")`` is the embedded default
that runs on a 2-core CPU with no network: a tiny Qwen2-shaped model warm-started on a generated
arithmetic task. Each field carries its own doc in its metadata (``option(default, help)``): what it is
and why its default is what it is; ``Config.help(name)`` returns it and the CLI's ``--help`` shows it. The
CLI maps ``--flag-name`` to ``flag_name`` and changes nothing else.

Every value is type-checked on construction (ints where int, floats accept ints, ``band`` a pair of
numbers, ``str | None`` where declared), so a settings file with ``lr: fast`` is a one-line ``ConfigError``.
``read_config_file`` reads such a file (YAML or JSON): a flat mapping of fields, or the files sao writes
(``config.json``, ``experiment.json``: ``{"config": {...}, ...}``) as they are, so that a run can be replayed.

Deliberately left out: merging with presets and command-line flags (the CLI does that: preset < file <
flags), validating a sweep grid (returned as read, for the sweep to check), and any coercion of strings
into numbers (``"1e-5"`` in JSON is an error; in YAML the loader reads 1e-5 as the float it looks like).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import numbers
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sao.core.errors import ConfigError

if TYPE_CHECKING:  # torch loads when a Config is built, not when `sao --help` or `sao report` starts
    from sao.core.algorithm import SAO


# Each field's doc lives in its dataclasses metadata rather than in a string literal under it (read back by
# parsing the source) or in a CLI library such as tyro: metadata survives `python -OO`, zipped installs and
# frozen apps with no .py files, is readable from `dataclasses.fields()` alone, and needs no new dependency.
def option(default: Any, help: str) -> Any:
    """A Config field with a default and its doc (``metadata["help"]``); mutable defaults get a factory."""
    if isinstance(default, list | dict | set):
        return dataclasses.field(default_factory=functools.partial(type(default), default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


MAX_LR = 1.0  # the largest --lr and --critic-lr accepted
SEED_LIMIT = 2**63  # seeds are below it
MAX_THREADS = 1024
MAX_LORA_RANK = 1024


@dataclass(frozen=True)
class Config:
    # --- what to train -----------------------------------------------------------------------------------
    model: str = option(
        "Qwen/Qwen2.5-1.5B-Instruct",
        'Hub id or local directory of the base causal LM; "tiny" builds the CPU stand-in. The page\'s base.',
    )
    data: str | None = option(
        None,
        'GSM8K source: None for the hub (openai/gsm8k), or a directory with train.jsonl and test.jsonl; "tiny" '
        "generates the arithmetic task.",
    )
    train_prompts: int = option(
        512, "Training prompts drawn from the train split after decontamination. The page's 512."
    )
    test_prompts: int = option(120, "Held-out tasks drawn from the test split for eval. The page's 120.")
    data_seed: int = option(
        0, "Seed of the held-out and training draws; fixed so that every run scores the same tasks."
    )

    # --- agents and your own tasks ------------------------------------------------------------------------
    env: str | None = option(
        None,
        "The environment each trajectory talks to: None = one reply graded by the task's reward (the page's "
        'protocol); "gsm8k" (the same, as an environment), "gsm8k-calc" (a calculator tool), "tiny-calc" (the CPU '
        'preset\'s calculator task), "skyrl:<id>" (a SkyRL-Gym environment, e.g. skyrl:gsm8k_multi_turn), or '
        '"module:Class" (your own, built as Class(task_id, fields)).',
    )
    max_turns: int = option(
        4, "Actions per trajectory at most (an environment may end it sooner); hitting it ends it as truncated."
    )
    max_total_tokens: int = option(
        1024,
        "Response tokens per trajectory at most, actions and observations together (--max-new-tokens caps each "
        "action); hitting it ends the trajectory as truncated.",
    )
    prompt_field: str | None = option(
        None, 'With --data FILE or a hub dataset: the field holding the prompt text (default "question").'
    )
    answer_field: str | None = option(
        None, 'With --data FILE or a hub dataset: the field holding the gold answer (default "answer").'
    )
    messages_field: str | None = option(
        None, "With --data: a field holding the prompt as chat messages instead of --prompt-field."
    )
    reward: str | None = option(
        None,
        'Your reward, "module:function" called as function(completion, task) -> float; default: the GSM8K grader '
        "(exact numeric match of the final answer).",
    )

    # --- the algorithm (SAO) -----------------------------------------------------------------------------
    arm: str = option(
        "dis",
        'Correction rule: "dis" (recipe: mask outside the band), "none" (baseline), "tis", "seqmask", "random" (a '
        "control: drop each token with probability --random-mask-share whatever its ratio).",
    )
    band: tuple[float, float] = option(
        (0.7, 6.0), "IS band (lo, hi); must bracket 1. The page's; the paper's coding band is (0.2, 4.0)."
    )
    gae_alpha: float = option(1.5, "λ_i = 1 − 1/(α L_i). SAO's α (VAPO used 0.05).")
    tis_cap: float = option(2.0, 'Cap C for the "tis" rule only.')
    random_mask_share: float | None = option(
        None,
        'The "random" rule only: the probability that each action token is dropped. None: the share the "dis" arm '
        "masked (its mean masked share over the policy steps) in the same cell and seed of the experiment, so that "
        "the two arms drop as much and differ in which tokens; `sao train --arm random` needs a number.",
    )
    critic_steps: int = option(2, "Critic updates per policy update. The page's 2.")
    critic_warmup: int = option(
        10, "Critic-only steps, each on a fresh batch, before the first policy step. The page's 10."
    )

    # --- optimisation ------------------------------------------------------------------------------------
    steps: int = option(40, "Policy steps after the critic warmup. The page's 40.")
    batch_size: int = option(64, "Prompts (= trajectories: one rollout per prompt) per optimizer step. The page's 64.")
    lr: float = option(1e-5, "AdamW on the LoRA adapter. The page's round 1 (round 2 is 1e-4).")
    critic_lr: float = option(
        1e-4, "AdamW on the value head. The page's override: a one-layer head at 5e-6 does not leave its zero init."
    )
    grad_clip: float = option(1.0, "Global norm clip on the policy gradient. The page's 1.0.")
    lora_rank: int = option(16, "LoRA rank. The page's 16.")
    lora_alpha: int = option(32, "LoRA alpha. The page's 32.")
    seed: int = option(
        17,
        "Training seed: set right before the adapter is built, and the root of every sampler and data-order RNG. The "
        "page's 17. Run s of --train-runs uses seed + s.",
    )

    # --- staleness and sampling --------------------------------------------------------------------------
    lag: int = option(
        4, "The sampler's adapter is refreshed every LAG policy steps: staleness 0, then 1..LAG. The page's 4."
    )
    temperature: float = option(
        1.0, "Rollout temperature. 1.0 with no top-p/top-k/penalty: the ratio needs common support."
    )
    max_new_tokens: int = option(256, "Rollout length cap. The page's 256.")

    # --- logged traces (sao.rollout.traces) ---------------------------------------------------------------
    traces: str | None = option(
        None,
        "Train on logged traces instead of drawing rollouts: a JSONL file or a folder of *.jsonl files a serving "
        "system wrote (format: trace.schema.json, README). Each trace names the policy version that sampled it; "
        "--max-staleness bounds how old it may be; rewards come from the trace or from --reward on its task. The run "
        "takes min(--steps, what the log allows) steps and publishes each adapter to OUT/published/.",
    )
    follow: bool = option(
        False,
        "--traces: wait for the log to grow (new lines, new files) instead of ending the run when it is read to its "
        "end; the run ends cleanly after --follow-timeout seconds with no new line. For a live server's log.",
    )
    follow_timeout: float = option(
        600.0, "--follow: seconds without a new trace line after which the run ends cleanly with what it did."
    )
    skip_bad_traces: bool = option(
        False,
        "--traces: count and skip malformed lines instead of stopping with a one-line error naming the file, line "
        "and field. Off by default, because a malformed log usually means a writer bug or the wrong file.",
    )
    publish: bool = option(
        False,
        "After each policy update write the adapter to OUT/published/v{N}/ and point OUT/published/LATEST.json at it "
        "(version 0 at the start; the newest 3 kept), for a server to reload (sao serve). On with --traces.",
    )

    # --- evaluation --------------------------------------------------------------------------------------
    eval_samples: int = option(4, "Samples per held-out task for pass@1. The page's 4.")
    eval_temperature: float = option(0.7, "Eval sampling temperature. The page's 0.7.")
    eval_max_new_tokens: int = option(256, "Eval reply length cap; the same as training by default.")
    base_evals: int = option(3, "Evals of the untrained base model, for the noise floor. The page's 3.")
    train_runs: int = option(
        1,
        "Training seeds per arm. The page ran 1; a verdict about the training procedure (improved, regressed, flat)"
        ' needs 2+: with 1 the two arms are two trained models and the verdict is "unresolved".',
    )
    eval_every: int = option(
        0,
        "sao recipe/sweep/confirm: also evaluate each run's policy every K policy steps (same eval settings and "
        "sampling seed as the final eval), so pass@1 over steps exists per arm and seed; 0 = the final eval only.",
    )
    truncated_reward: str = option(
        "zero",
        'How a reply that hit the token limit without finishing is scored, in training and eval: "zero" (it scores 0)'
        ' or "grade" (graded like any reply: the grader may find an answer in the '
        'cut-off text, e.g. "... = 18" scored right against 18). Our choice, not the page\'s: the recipe page does '
        "not say how to score cut-off replies. Each step and eval logs truncated_replies and truncated_with_credit "
        "(those the grader would credit). Environments score their own episodes and are not affected.",
    )

    # --- machinery (no effect on results beyond floating-point order) ------------------------------------
    device: str = option(
        "auto", '"auto" picks CUDA when available, else the CPU; "cpu", "cuda", "cuda:N" or "mps" must exist here.'
    )
    threads: int = option(
        0,
        "torch's CPU threads in this process. 0 = automatic: 1 for the tiny stand-in model on the CPU (its small "
        "operations gain nothing from more, and lost 13x with two when other processes kept 2 cores busy), torch's "
        "default otherwise. A set OMP_NUM_THREADS replaces the automatic choice (torch's default follows it).",
    )
    micro_batch: int = option(
        0,
        "Rows per forward+backward in the training pass; 0 = as many as fit in free GPU memory (the whole batch on the"
        " CPU). Memory only: the loss is a sum over rows, so every micro-batch size gives the same update.",
    )
    grad_checkpoint: bool = option(
        False,
        "Recompute each decoder layer's activations in the backward instead of storing them: ~1/3 more compute for a "
        "fraction of the memory, so larger micro-batches fit (the bench measures both).",
    )
    logprob_chunk: int = option(1024, "Rows per full-vocabulary log-softmax chunk (memory only).")
    eval_batch: int = option(
        480, "Sequences decoded together during eval (all samples of 120 tasks × 4 at once on a GPU)."
    )
    engine: str = option(
        "local",
        'Where batches come from: "local" (the stale sampler in this process, reproducible) or "ray" (asynchronous '
        "rollout workers, for throughput; see sao.rollout.ray_workers).",
    )
    max_staleness: int = option(
        4,
        "--engine ray: the oldest a trajectory may be when it is put in a batch (policy updates since the adapter that"
        " wrote it). Workers draw only as far ahead as this allows, so nothing drawn ages past it (0 = synchronous "
        "training); anything older would be dropped and counted. Equal to the default LAG, so both engines train on "
        "the same staleness range (0..4). --traces: older traces are dropped and counted (raise it to use older logs; "
        "the correction is measured on 1..LAG-old data).",
    )
    rollout_workers: int = option(2, "--engine ray: rollout workers (Ray actors), each with its own copy of the model.")
    ray_address: str | None = option(
        None,
        '--engine ray: address of a running Ray cluster to join ("auto", "ray://host:10001", "host:6379"); None starts'
        " a local one for the run and stops it afterwards.",
    )
    worker_cpus: float = option(
        1.0, "--engine ray: CPUs Ray reserves for each rollout worker (also its torch thread count)."
    )
    worker_gpus: float = option(
        0.0,
        "--engine ray: GPUs Ray reserves for each rollout worker; > 0 puts the worker's model on CUDA, fractions share"
        " a GPU between workers.",
    )
    rollout_batch: int = option(
        0,
        "--engine ray: prompts per worker draw call. 0 = --batch-size on GPU workers (one engine call fills the GPU) "
        "and 8 on CPU workers (small, so that trajectories arrive continuously).",
    )
    worker_timeout: float = option(
        300.0,
        "--engine ray: seconds a rollout worker may take to answer one draw call (its start, import and model load, "
        "may take max(this, 900 s)); past it the worker counts as hung: it is killed and replaced like a dead one, "
        "and its prompts are drawn again.",
    )
    decoder: str = option(
        "auto",
        'How tokens are decoded: "plain" (the reference loop), "graph" (sao.rollout.engine: static KV cache, the '
        'decode step as a CUDA graph on a GPU, eager elsewhere), or "auto": graph on a GPU, plain on the CPU.',
    )
    dead_band_share: float = option(
        0.001,
        "Reachability warning threshold: a masked share below this (0.1%) on stale batches means the band is dead at "
        "these settings. A share in [0, 1); 0 turns the warning off.",
    )
    track: str | None = option(
        None,
        'Experiment tracking: "tensorboard" (OUT/tensorboard/), "trackio" (its local store) or "wandb" (offline only); '
        "each logs every step record and the eval. None: train_log.json alone. Not compared on --resume.",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # types first, so that the range checks below compare numbers
            object.__setattr__(self, f.name, check_type(f.name, getattr(self, f.name)))
        from sao.core.algorithm import CORRECTIONS

        if self.arm not in CORRECTIONS:
            raise ConfigError(f"--arm must be one of {sorted(CORRECTIONS)}, got {self.arm!r}")
        if self.arm == "random" and self.random_mask_share is None:
            raise ConfigError(
                "--arm random needs --random-mask-share (sao sweep and sao confirm take it from the dis arm of the "
                "same cell and seed)"
            )
        if self.truncated_reward not in ("zero", "grade"):
            raise ConfigError(f"--truncated-reward must be 'zero' or 'grade', got {self.truncated_reward!r}")
        if self.eval_every < 0:
            raise ConfigError(f"--eval-every must be >= 0 (0 = the final eval only), got {self.eval_every}")
        self.sao()  # validates band, alpha, cap, share, critic settings with SAO's own messages
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
            "lora_alpha": self.lora_alpha >= 1,  # the adapter is scaled by alpha / rank: 0 or less switches it off
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
        for name in ("lr", "critic_lr"):  # AdamW moves every weight by about lr a step: above 1 is no learning rate
            if getattr(self, name) > MAX_LR:
                raise ConfigError(f"--{name.replace('_', '-')} must be at most {MAX_LR:g}, got {getattr(self, name)}")
        if not (math.isfinite(self.dead_band_share) and 0 <= self.dead_band_share < 1):
            raise ConfigError(
                f"--dead-band-share must be a share in [0, 1) (0 turns the warning off), got {self.dead_band_share}"
            )
        for name, value in (("seed", self.seed + self.train_runs - 1), ("data_seed", self.data_seed)):
            if not 0 <= value < SEED_LIMIT:  # torch takes seeds below 2**64; sao derives others by adding to them
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be a whole number from 0 to 2**63 - 1"
                    + (" (with --train-runs, seed + train_runs - 1)" if name == "seed" and self.train_runs > 1 else "")
                    + f", got {getattr(self, name)}"
                )
        if self.lora_rank > MAX_LORA_RANK:  # beyond any layer's width: the adapter would not even be allocated
            raise ConfigError(f"--lora-rank must be at most {MAX_LORA_RANK}, got {self.lora_rank}")
        if not 0 <= self.threads <= MAX_THREADS:
            raise ConfigError(f"--threads must be 0 (automatic) to {MAX_THREADS}, got {self.threads}")
        check_device(self.device)
        if self.engine not in ("local", "ray"):
            raise ConfigError(f"--engine must be 'local' or 'ray', got {self.engine!r}")
        if self.max_staleness < 0:
            raise ConfigError(f"--max-staleness must be >= 0 (0 = only fresh trajectories), got {self.max_staleness}")
        if self.rollout_workers < 1 or self.rollout_batch < 0:
            raise ConfigError(
                f"--rollout-workers must be >= 1 and --rollout-batch >= 0 (0 = automatic), got {self.rollout_workers}"
                f" and {self.rollout_batch}"
            )
        if not (math.isfinite(self.worker_timeout) and self.worker_timeout > 0):
            raise ConfigError(f"--worker-timeout must be a finite number of seconds > 0, got {self.worker_timeout}")
        for name in ("worker_cpus", "worker_gpus"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
        if self.ray_address is not None and not self.ray_address.strip():
            raise ConfigError("--ray-address must not be empty (leave it out to start a local Ray cluster)")
        if self.decoder not in ("auto", "plain", "graph"):
            raise ConfigError(f"--decoder must be 'auto', 'plain' or 'graph', got {self.decoder!r}")
        if self.max_turns < 1 or self.max_total_tokens < 1:
            raise ConfigError(
                f"--max-turns and --max-total-tokens must be >= 1, got {self.max_turns} and {self.max_total_tokens}"
            )
        if self.traces is not None:
            if not self.traces.strip():
                raise ConfigError("--traces must name a JSONL file or a folder of *.jsonl files")
            if self.engine == "ray" or self.env is not None:
                flag = "--engine ray" if self.engine == "ray" else "--env"
                raise ConfigError(
                    f"--traces with {flag} makes no sense: the trajectories come from the log, not from rollout "
                    "workers or an environment; leave that flag out"
                )
        elif self.follow or self.skip_bad_traces:
            flag = "--follow" if self.follow else "--skip-bad-traces"
            raise ConfigError(f"{flag} needs --traces (a trace log to read)")
        if not (math.isfinite(self.follow_timeout) and self.follow_timeout > 0):
            raise ConfigError(f"--follow-timeout must be a finite number of seconds > 0, got {self.follow_timeout}")
        if self.track not in (None, "tensorboard", "trackio", "wandb"):
            raise ConfigError(f"--track must be 'tensorboard', 'trackio' or 'wandb', got {self.track!r}")

    def sao(self) -> SAO:
        """The algorithm object these settings describe."""
        from sao.core.algorithm import SAO

        return SAO(
            ratio=self.band,
            gae_alpha=self.gae_alpha,
            correction=self.arm,
            tis_cap=self.tis_cap,
            random_mask_share=self.random_mask_share or 0.0,
            critic_steps=self.critic_steps,
            critic_warmup=self.critic_warmup,
        )

    @classmethod
    def help(cls, name: str) -> str:
        """Field ``name``'s doc, from its metadata, on one line."""
        for f in dataclasses.fields(cls):
            if f.name == name:
                return " ".join(f.metadata["help"].split())
        raise ConfigError(f"unknown setting {name!r}")

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
        overlay = PRESET_ENVS.get((name, changes.get("env", PRESETS[name].get("env"))), {})
        return cls(**{**PRESETS[name], **overlay, **changes})


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

# A preset's defaults for one environment, applied over the preset and under the file and flags.
PRESET_ENVS: dict[tuple[str, str], dict[str, Any]] = {
    # A call is up to 22 tokens ("<calc>9999-9999</calc>", the stop string ends it), so 20 new tokens would
    # cut every long call; 24 leaves the model room to write one, and the answer ("#### 19998" + EOS) is 11.
    ("tiny", "tiny-calc"): {"max_new_tokens": 24, "eval_max_new_tokens": 24},
}


# ---------------------------------------------------------------------------------------------------------
# The machine: which device, how many CPU threads.


def check_device(device: str) -> None:
    """A ConfigError unless ``device`` is "auto" or a device this machine has: "cpu", "cuda" or "cuda:N" with a
    GPU torch can use, or "mps" where torch has it."""
    if device == "auto":
        return
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device must be auto, cpu, cuda, cuda:N or mps, got {device!r}") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {device}: this torch sees no CUDA GPU (a CPU-only build, or none visible); "
                              "use --device cpu or auto")  # fmt: skip
        if parsed.index is not None and parsed.index >= count:
            raise ConfigError(f"--device {device}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    elif parsed.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError(f"--device {device}: this torch has no MPS backend here; use --device cpu or auto")
    elif parsed.type != "cpu":
        raise ConfigError(f"--device must be auto, cpu, cuda, cuda:N or mps, got {device!r}")


def torch_threads(config: Config, environ: dict[str, str] | None = None) -> int | None:
    """The CPU thread count ``config`` asks for: ``--threads`` when set; else None (torch's default, which follows
    OMP_NUM_THREADS) when OMP_NUM_THREADS is set or the model is not the tiny stand-in or the device is a GPU;
    else 1. One thread for the tiny model because its operations are too small to split: on a 2-core machine
    that other processes kept busy, torch's default of 2 threads made a tiny-preset step 13x slower (36.9 s
    against 2.8 s)."""
    environ = os.environ if environ is None else environ
    if config.threads:
        return config.threads
    if environ.get("OMP_NUM_THREADS") or config.model != "tiny" or config.device not in ("auto", "cpu"):
        return None
    if config.device == "auto":
        import torch

        if torch.cuda.is_available():
            return None
    return 1


def apply_threads(config: Config) -> int:
    """Set torch's intra-op thread count as ``torch_threads`` says (once, at the start of a command); returns the
    count in effect."""
    import torch

    wanted = torch_threads(config)
    if wanted is not None and wanted != torch.get_num_threads():
        torch.set_num_threads(wanted)
    return torch.get_num_threads()


# ---------------------------------------------------------------------------------------------------------
# Types of values, and settings files.


@functools.cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(Config)


def check_type(name: str, value: Any) -> Any:
    """``value`` as setting ``name``'s declared type: ints widen to float where float is declared, a list of
    two numbers becomes the ``band`` tuple. Anything else of the wrong type is a ConfigError naming the setting."""
    hint = _field_types()[name]
    ok, converted = _convert(hint, value)
    if not ok:
        raise ConfigError(f"setting {name!r} must be {_describe(hint)}, got {value!r}")
    return converted


def _convert(hint: Any, value: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for member in typing.get_args(hint):
            ok, converted = _convert(member, value)
            if ok:
                return True, converted
        return False, value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is str:
        return isinstance(value, str), value
    if isinstance(value, bool):  # True is an int to Python, never a count or a rate here
        return False, value
    if hint is int:
        return (True, int(value)) if isinstance(value, numbers.Integral) else (False, value)
    if hint is float:
        return (True, float(value)) if isinstance(value, numbers.Real) else (False, value)
    if origin is tuple:
        members = typing.get_args(hint)
        if not isinstance(value, list | tuple) or len(value) != len(members):
            return False, value
        items = [_convert(member, item) for member, item in zip(members, value, strict=True)]
        return (True, tuple(c for _, c in items)) if all(ok for ok, _ in items) else (False, value)
    raise TypeError(f"no type check for {hint!r}: add a rule to sao.core.config._convert")  # a new field type


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(member) for member in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        members = typing.get_args(hint)
        return "a pair of numbers [lo, hi]" if members == (float, float) else f"a list of {len(members)} values"
    names = {type(None): "null", bool: "true or false", str: "a string", int: "an integer", float: "a number"}
    return names[hint]


def read_config_file(path: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Settings from a YAML (.yaml, .yml) or JSON file: ``(values, grid)``.

    The file holds either a flat mapping of Config fields or a file sao wrote (``config.json``,
    ``experiment.json``) as it is: a mapping whose "config" key holds the fields; its other top-level keys
    ("data", "source", ...) are ignored, except "grid", returned as read (None when absent) for a sweep.
    Values are type-checked here, so that an error names the file; ranges are checked when the Config is built.
    """
    path = Path(path)
    where = f"--config {path}"
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(f"{where}: expected a .yaml, .yml or .json file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{where}: is a folder, not a settings file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: is not UTF-8 text") from None
    except OSError as error:
        raise ConfigError(f"{where}: cannot be read ({error.strerror})") from None
    data = _parse_json(text, where) if suffix == ".json" else _parse_yaml(text, where)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of settings (name: value), got {_kind(data)}")
    grid = None
    if "config" in data:  # a file sao wrote
        grid = data.get("grid")
        if grid is not None and not isinstance(grid, dict):
            raise ConfigError(f"{where}: 'grid' must be a mapping (lags, lrs, bands, arms), got {_kind(grid)}")
        data = data["config"]
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: 'config' must be a mapping of settings (name: value), got {_kind(data)}")
    known = [f.name for f in dataclasses.fields(Config)]
    unknown = [key for key in data if key not in known]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if len(unknown) == 1 and close else ""
        names = ", ".join(repr(key) for key in unknown)
        raise ConfigError(f"{where}: unknown setting{'s' if len(unknown) > 1 else ''} {names}{hint}")
    values = {}
    for name, value in data.items():
        try:
            values[name] = check_type(name, value)
        except ConfigError as error:
            raise ConfigError(f"{where}: {error}") from None
    return values, grid


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{where}: not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}"
        ) from None


def _parse_yaml(text: str, where: str) -> Any:
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())  # a SafeLoader: plain data only, no Python objects
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        problem = getattr(error, "problem", None) or str(error)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{where}: not valid YAML: {' '.join(problem.split())}{at}") from None


@functools.cache
def _yaml_loader() -> type:
    """yaml.SafeLoader that also reads ``1e-5`` as a float: YAML 1.1 wants a dot and a signed exponent
    (``1.0e-5``), so plain PyYAML hands back the string "1e-5", which JSON and YAML 1.2 read as a number."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    exponent = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$|^[-+]?\.[0-9_]+[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent, list("-+0123456789."))
    return Loader


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (an empty file or null)"
    names = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true/false"}
    return names.get(type(value), f"a {type(value).__name__}")
