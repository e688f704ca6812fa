"""The parts a config names, built from its strings: the one place where names become objects.

    model_path   "tiny", "tiny-calc" (stand-ins built here, ``MODELS``), or a hub id / folder as it is
    task_set     a generated task set (``TASK_SETS``), your data (file, folder, hub dataset; or rows passed in),
                 or GSM8K
    scorer       the reward you pass, or ``--reward module:function``, or the task set's own (GSM8K's grader)
    environment  the factory you pass, or ``--env`` (``sao.tasks.environments``)
    trainer      all of them, the source (``SOURCES`` by ``--rollout``, or yours) and the hooks the settings ask
                 for, assembled into a ``Trainer`` — what ``sao.train()``, ``sao train`` and each run of an
                 experiment use; ``run_record`` says in config.json what was passed, by import path when it has one

Deliberately left out: what the parts do (each lives in its own layer).
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sao.core.config import Config
from sao.core.errors import ConfigError
from sao.core.registry import MODELS, TASK_SETS
from sao.model.policy import Models
from sao.rollout.environment import EnvFactory
from sao.rollout.sources import Source, SourceContext, build_source
from sao.tasks import custom, gsm8k
from sao.tasks.base import Scorer, TaskSet
from sao.tasks.environments import env_factory, episodes_for, prompt_text
from sao.tasks.gsm8k import load_gsm8k
from sao.train.distributed import BroadcastSource, World
from sao.train.hooks import FootingAudit, Publish, Reachability, SourceSummary, Tracking
from sao.train.trainer import Hook, Trainer


def model_path(config: Config) -> str:
    """A hub id or folder; a registered stand-in ("tiny", "tiny-calc") is built and cached on first use."""
    name = config.model.name
    return str(MODELS.get(name)()) if name in MODELS else name


def task_set(config: Config, dataset: Any = None) -> TaskSet:
    """The training prompts and held-out tasks: ``dataset`` when given (rows, a mapping of splits, a Hugging Face
    dataset, or a path read as ``--data``), else what ``--data`` names."""
    d = config.data
    if dataset is not None and not isinstance(dataset, str | Path):
        return custom.from_rows(dataset, n_train=d.train_prompts, n_test=d.test_prompts, seed=d.seed)
    name = str(dataset) if dataset is not None else d.dataset
    if name in TASK_SETS:
        given = [f for f, v in (("--prompt-field", d.prompt_field), ("--answer-field", d.answer_field),
                                ("--messages-field", d.messages_field)) if v is not None]  # fmt: skip
        if given:
            raise ConfigError(f"{', '.join(given)} apply to --data FILE (.jsonl, .parquet), a directory or a hub "
                              f"dataset name, not to the generated task set {name!r}")  # fmt: skip
        return TASK_SETS.get(name)(d.train_prompts, d.test_prompts, d.seed)
    if custom.uses_custom_loader(name, d.prompt_field, d.answer_field, d.messages_field):
        return custom.load_custom(name, prompt_field=d.prompt_field, answer_field=d.answer_field,
                                  messages_field=d.messages_field, n_train=d.train_prompts, n_test=d.test_prompts,
                                  seed=d.seed)  # fmt: skip
    return load_gsm8k(name, n_train=d.train_prompts, n_test=d.test_prompts, seed=d.seed)


def scorer(config: Config, tasks: TaskSet | None = None, reward_fn: Callable[..., Any] | None = None) -> Scorer:
    """The one grader of training, eval and serving: ``reward_fn``, else ``--reward``, else the task set's own."""
    reward = reward_fn
    name = None
    if reward is None and config.data.reward:
        reward, name = custom.load_reward(config.data.reward), config.data.reward
    if reward is None:
        reward = (tasks.reward if tasks is not None else None) or gsm8k.reward
    return Scorer(reward, truncated_reward=config.data.truncated_reward, name=name)


def environment(config: Config, tokenizer: Any, factory: EnvFactory | None = None) -> EnvFactory | None:
    """The environment factory: the one you pass, else the one ``--env`` names (None: one reply per prompt)."""
    return factory if factory is not None else env_factory(config.data.env, tokenizer, config.rollout.max_turns)


def trainer(
    config: Config,
    out_dir: str | Path,
    *,
    dataset: Any = None,
    reward_fn: Callable[..., Any] | None = None,
    env_factory: EnvFactory | None = None,
    source: Source | None = None,
    hooks: Sequence[Hook] = (),
    tasks: TaskSet | None = None,
    resume: bool = False,
    progress: bool = True,
    label: str | None = None,
) -> Trainer:
    """A ``Trainer`` with every part the config names, unless passed in. Nothing in ``out_dir`` is claimed until
    every part is built, so a mistake found on the way leaves the folder as it was."""
    world = World.from_env(config.model.device)  # one process, or this rank of a torchrun group
    tasks = tasks or task_set(config, dataset)
    if len(tasks.train) < config.training.batch_size and config.rollout.source != "traces" and source is None:
        raise ConfigError(f"--batch-size {config.training.batch_size} is larger than the {len(tasks.train)} training "
                          "prompts")  # fmt: skip
    world.shard(config.training.batch_size)  # a batch that does not split evenly over the ranks is refused here
    if config.rollout.source == "traces" and world.size > 1:
        raise ConfigError("--traces under torchrun is not supported yet: train on a trace log in one process")
    grader = scorer(config, tasks, reward_fn)
    path = model_path(config)
    models = Models.load(path, device=world.device(config.model.device), lora_rank=config.model.lora_rank,
                         lora_alpha=config.model.lora_alpha, seed=config.training.seed,
                         grad_checkpoint=config.model.grad_checkpoint)  # fmt: skip
    label = label or f"{config.algorithm.correction} seed {config.training.seed}"
    factory = environment(config, models.tokenizer, env_factory)
    passed_source = source
    if source is None:
        context = SourceContext(
            config=config, models=models, tasks={t.id: t for t in tasks.train},
            prompts={t.id: prompt_text(models.tokenizer, t, tasks.instruction) for t in tasks.train},
            episodes=episodes_for(factory, tasks.train, tasks.instruction, config.rollout.max_turns,
                                  config.rollout.max_total_tokens),
            out_dir=Path(out_dir), reserved_gpus=world.training_gpus(), label=label, progress=progress,
        )  # fmt: skip
        built = build_source(config.rollout.source, context) if world.is_main else None
        source = built if world.size == 1 else BroadcastSource(world, built, models.device)
    record = run_record(config, tasks, world, dataset=dataset, reward_fn=reward_fn, env_factory=env_factory,
                        source=passed_source)  # fmt: skip
    return Trainer(models, source, grader, config, out_dir, hooks=[*default_hooks(config), *hooks], world=world,
                   run_record=record, resume=resume, progress=progress, label=label)  # fmt: skip


def default_hooks(config: Config) -> list[Hook]:
    """What the settings ask for beside the step: the reachability lines always; publishing with --publish or a
    trace log; the footing audit and the summary of a trace log; tracking with --track (last, so it sees every
    other hook's work)."""
    r, t = config.rollout, config.training
    hooks: list[Hook] = [Reachability(t.dead_band_share, config.algorithm.ratio, t.steps)]
    if r.source == "traces":
        hooks += [FootingAudit(r.temperature, config.model.logprob_chunk), SourceSummary()]
    if t.publish or r.source == "traces":
        hooks.append(Publish())
    if t.track is not None:
        hooks.append(Tracking(t.track, config.to_dict()))
    return hooks


def import_path(obj: Any) -> str | None:
    """``"module:qualname"`` when importing that gives back ``obj`` (so a replay can), else None."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not name or module == "__main__" or "<" in name:
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{name}" if found is obj else None


def run_record(config: Config, tasks: TaskSet, world: World, **parts: Any) -> dict[str, Any]:
    """What config.json records: the settings, the data counts, and each part passed in as an object — by import
    path when it has one; otherwise ``replayable`` is false and ``not_replayable`` says why, in words."""
    record: dict[str, Any] = {"config": config.to_dict(), "data": tasks.counts, "source": tasks.source,
                              "world_size": world.size}  # fmt: skip
    passed, reasons = {}, []
    for name, obj in parts.items():
        if obj is None:
            continue
        if name == "dataset" and isinstance(obj, str | Path):
            passed[name] = str(obj)
            continue
        if name == "dataset":
            rows = json.dumps([t.fields for t in tasks.train], sort_keys=True, default=str).encode()
            passed[name] = f"{len(tasks.train)} rows passed in (sha256 {hashlib.sha256(rows).hexdigest()[:16]})"
            reasons.append("the dataset was passed as rows, not as a path")
            continue
        if name == "source":  # an object built by the caller: its class says what it was, not how it was made
            passed[name] = import_path(type(obj)) or type(obj).__name__
            reasons.append(f"the source was passed as an object ({passed[name]}), not named by --rollout")
            continue
        path = import_path(obj)
        passed[name] = path or repr(obj)[:80]
        if path is None:
            reasons.append(f"{name} {passed[name]} cannot be imported by name (defined in a script or a function)")
    if passed:
        record["passed"] = passed
        record["replayable"] = not reasons
        if reasons:
            record["not_replayable"] = reasons
    return record
