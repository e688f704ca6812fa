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
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sao.core.algorithm import CORRECTIONS, SAO
from sao.core.errors import ConfigError


# Each field's doc lives in its dataclasses metadata rather than in a string literal under it (read back by
# parsing the source) or in a CLI library such as tyro: metadata survives `python -OO`, zipped installs and
# frozen apps with no .py files, is readable from `dataclasses.fields()` alone, and needs no new dependency.
def option(default: Any, help: str) -> Any:
    """A Config field with a default and its doc (``metadata["help"]``); mutable defaults get a factory."""
    if isinstance(default, list | dict | set):
        return dataclasses.field(default_factory=functools.partial(type(default), default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


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
        'The environment each trajectory talks to: None = one reply graded by the task\'s reward (the page\'s '
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
        "dis", 'Correction rule: "dis" (recipe: mask outside the band), "none" (baseline), "tis", "seqmask".'
    )
    band: tuple[float, float] = option(
        (0.7, 6.0), "IS band (lo, hi); must bracket 1. The page's; the paper's coding band is (0.2, 4.0)."
    )
    gae_alpha: float = option(1.5, "λ_i = 1 − 1/(α L_i). SAO's α (VAPO used 0.05).")
    tis_cap: float = option(2.0, 'Cap C for the "tis" rule only.')
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

    # --- evaluation --------------------------------------------------------------------------------------
    eval_samples: int = option(4, "Samples per held-out task for pass@1. The page's 4.")
    eval_temperature: float = option(0.7, "Eval sampling temperature. The page's 0.7.")
    eval_max_new_tokens: int = option(256, "Eval reply length cap; the same as training by default.")
    base_evals: int = option(3, "Evals of the untrained base model, for the noise floor. The page's 3.")
    train_runs: int = option(
        1, 'Training seeds per arm. The page ran 1 (hence "unresolved"); 2+ lets compare() say "flat".'
    )

    # --- machinery (no effect on results beyond floating-point order) ------------------------------------
    device: str = option("auto", '"auto" picks CUDA when available, else the CPU.')
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
        " wrote it); older ones are dropped and counted. Equal to the default LAG, so both engines train on the same "
        "staleness range (0..4).",
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
        8, "--engine ray: prompts per worker draw call (small, so that trajectories arrive continuously)."
    )
    decoder: str = option(
        "auto",
        'How tokens are decoded: "plain" (the reference loop), "graph" (sao.rollout.engine: static KV cache, the '
        'decode step as a CUDA graph on a GPU, eager elsewhere), or "auto": graph on a GPU, plain on the CPU.',
    )
    dead_band_share: float = option(
        0.001,
        "Reachability warning threshold: a masked share below this (0.1%) on stale batches means the band is dead at "
        "these settings.",
    )
    track: str | None = option(
        None,
        'Experiment tracking: "tensorboard" (OUT/tensorboard/), "trackio" (its local store) or "wandb" (offline only); '
        "each logs every step record and the eval. None: train_log.json alone. Not compared on --resume.",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # types first, so that the range checks below compare numbers
            object.__setattr__(self, f.name, check_type(f.name, getattr(self, f.name)))
        if self.arm not in CORRECTIONS:
            raise ConfigError(f"--arm must be one of {sorted(CORRECTIONS)}, got {self.arm!r}")
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
        if self.max_turns < 1 or self.max_total_tokens < 1:
            raise ConfigError(
                f"--max-turns and --max-total-tokens must be >= 1, got {self.max_turns} and {self.max_total_tokens}"
            )
        if self.env is not None and self.engine == "ray":
            raise ConfigError("--env with --engine ray is not supported yet: multi-turn episodes run with --engine local")
        if self.track not in (None, "tensorboard", "trackio", "wandb"):
            raise ConfigError(f"--track must be 'tensorboard', 'trackio' or 'wandb', got {self.track!r}")

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
