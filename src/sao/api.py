"""sao as a library: objects in, the same runs the CLI makes from strings.

    sao.train(config, out_dir, *, dataset=None, reward_fn=None, env_factory=None, source=None, hooks=())
    sao.evaluate(config, out_dir=None, *, dataset=None, reward_fn=None, env_factory=None, adapter=None, seed=0)
    sao.recipe(config, out_dir, *, dataset=None, reward_fn=None, env_factory=None)

``config`` is a ``sao.Config``, a mapping of settings as a --config file takes them (flat or in sections; a
``"preset"`` key names the defaults; a run's config.json as read), a preset's name or a settings file's path.
``dataset``: a list of dicts with a ``prompt`` (text or chat messages) and any other fields, a ``{"train": rows,
"test": rows}`` mapping, a Hugging Face dataset, or a path. ``reward_fn``: ``reward(completion, row) -> float`` (or
batched, or async; ``sao.tasks.base``). ``env_factory``: ``(task_id, fields) -> env`` with SkyRL-Gym's text
interface. ``hooks``: ``Hook`` instances. config.json records what was passed, by import path (or path) when it has
one, so that ``sao train --config RUN/config.json`` replays it, and says when a run cannot be replayed from it
(``--config`` then refuses it).
``sao.evaluate`` takes the arguments ``sao.train`` took and evaluates what it trained (the adapter in
``out_dir``; the untrained base without one), or ``adapter=DIR``.

Deliberately left out: argument parsing and printing (``sao.cli``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sao.core.config import Config, settings_of
from sao.core.errors import ConfigError
from sao.core.machine import apply_threads
from sao.core.registry import PRESETS


def as_config(config: Config | Mapping[str, Any] | str | Path) -> Config:
    """``config`` as a Config: a Config as it is; a mapping of settings as a --config file holds them (flat or in
    sections, a ``"preset"`` key naming the defaults; a run's config.json as read, replaying what it records); a
    preset's name (``"tiny"``); or a settings file's path (.yaml, .yml, .json). Anything else is a TypeError naming
    the argument. Torch's CPU threads are set as it says (once, here, where a run starts)."""
    if isinstance(config, Path) or (isinstance(config, str) and config.lower().endswith((".yaml", ".yml", ".json"))):
        config = Config.load(file=config)
    elif isinstance(config, str):
        if config not in PRESETS:
            raise ConfigError(
                f"config {config!r} is neither a preset ({', '.join(PRESETS.names())}) nor a settings "
                "file (.yaml, .yml, .json)"
            )
        config = Config.load(config)
    elif isinstance(config, Mapping):
        values, _ = settings_of(dict(config), "config")
        config = Config.load(**values)
    elif not isinstance(config, Config):
        raise TypeError(
            f"config must be a sao.Config, a mapping of settings, a preset's name or a settings file's "
            f"path, got {type(config).__name__}"
        )
    apply_threads(config)
    return config


def trainer(
    config: Config | Mapping[str, Any],
    out_dir: str | Path,
    *,
    dataset: Any = None,
    reward_fn: Callable[..., Any] | None = None,
    env_factory: Callable[..., Any] | None = None,
    source: Any = None,
    hooks: Sequence[Any] = (),
    resume: bool = False,
    progress: bool = True,
):
    """The ``Trainer`` ``train`` runs, built but not run (``.run()`` trains; ``.describe()`` says what it trains)."""
    from sao.training import build

    config = as_config(config)
    return build.trainer(
        config,
        out_dir,
        dataset=dataset,
        reward_fn=reward_fn,
        env_factory=env_factory,
        source=source,
        hooks=hooks,
        resume=resume,
        progress=progress,
    )


def train(
    config: Config | Mapping[str, Any],
    out_dir: str | Path,
    *,
    dataset: Any = None,
    reward_fn: Callable[..., Any] | None = None,
    env_factory: Callable[..., Any] | None = None,
    source: Any = None,
    hooks: Sequence[Any] = (),
    resume: bool = False,
    progress: bool = True,
):
    """Train one policy (critic warmup, then policy steps) into ``out_dir``; returns the finished ``Trainer``
    (``.records``, ``.models``, ``.warnings``; the adapter is in ``out_dir/adapter``)."""
    built = trainer(
        config,
        out_dir,
        dataset=dataset,
        reward_fn=reward_fn,
        env_factory=env_factory,
        source=source,
        hooks=hooks,
        resume=resume,
        progress=progress,
    )
    built.run()
    return built


def evaluate(
    config: Config | Mapping[str, Any],
    out_dir: str | Path | None = None,
    *,
    dataset: Any = None,
    reward_fn: Callable[..., Any] | None = None,
    env_factory: Callable[..., Any] | None = None,
    adapter: str | Path | None = None,
    seed: int = 0,
    progress: bool = True,
):
    """pass@1 on the held-out tasks, with the config's eval settings, of what ``sao.train`` trained into ``out_dir``
    (its ``adapter/``; the same arguments train took), of an ``adapter`` folder, or, with neither, of the untrained
    base model; ``seed`` picks the sampling draw. Returns an ``EvalResult``."""
    from sao.experiment.evaluate import load_adapter, pass_at_1
    from sao.model.artifacts import check_adapter_files, find_adapter_dir
    from sao.model.policy import context_length, eos_ids, load_base, pick_device
    from sao.rollout.sampler import derived_seed
    from sao.tasks import setup

    for name, value in (("out_dir", out_dir), ("adapter", adapter)):
        if value is not None and not isinstance(value, str | os.PathLike):
            raise TypeError(f"sao.evaluate: {name} must be a folder (a str or a path), got {type(value).__name__}")
    if out_dir is not None and adapter is not None:
        raise TypeError("sao.evaluate: give out_dir (a run sao.train wrote) or adapter (an adapter folder), not both")
    config = as_config(config)
    setup.preflight(config, reward_fn=reward_fn, env_factory=env_factory)  # before any data or model
    if out_dir is not None or adapter is not None:
        # a run or its adapter/: one holding neither, or a truncated one, fails now, not after a model loads
        adapter = find_adapter_dir(out_dir if out_dir is not None else adapter)
        check_adapter_files(adapter, "restore the adapter folder, or train the run again")
    tasks = setup.task_set(config, dataset)
    if not tasks.test:
        raise ConfigError("the dataset has no held-out tasks to evaluate on: pass {'train': rows, 'test': rows}")
    model, tokenizer = load_base(config.model.name, pick_device(config.model.device))
    if adapter is not None:
        model = load_adapter(model, adapter)
    parts = setup.parts(
        config,
        tokenizer,
        tasks,
        reward_fn=reward_fn,
        env_factory=env_factory,
        eos_token_ids=eos_ids(tokenizer, model),
        context_length=context_length(model),
    )
    label = "adapter" if adapter is not None else "base"
    return pass_at_1(
        model,
        tokenizer,
        tasks.test,
        label,
        seed=derived_seed(config.training.seed, "eval", seed),
        parts=parts,
        progress=progress,
    )


def recipe(
    config: Config | Mapping[str, Any],
    out_dir: str | Path,
    *,
    dataset: Any = None,
    reward_fn: Callable[..., Any] | None = None,
    env_factory: Callable[..., Any] | None = None,
    resume: bool = False,
    progress: bool = True,
    command: str | None = None,
) -> dict[str, Any]:
    """The controlled experiment: the recipe arm (dis) and the baseline (none) trained with the same seeds, each
    evaluated, the base evaluated for the noise floor, compared, reported. Returns results.json's content."""
    from sao.experiment.runner import Experiment, Grid

    config = as_config(config)
    experiment = Experiment(
        config,
        Grid.recipe(config),
        out_dir,
        resume=resume,
        progress=progress,
        command=command,
        dataset=dataset,
        reward_fn=reward_fn,
        env_factory=env_factory,
    )
    return experiment.run()
