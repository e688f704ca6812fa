"""The parts a config names, built from its strings: the one place where names become objects.

    trainer      the task set, the models, the task's parts (``sao.tasks.setup``), the source (``SOURCES`` by
                 ``--rollout``, or yours) and the hooks the settings ask for, assembled into a ``Trainer``: what
                 ``sao.train()``, ``sao train`` and each run of an experiment use
    the gate     ``--gate held-out``: the held-aside tasks and the trace log's live rewards (``sao.training.gate``)

Deliberately left out: what the parts do (each lives in its own layer).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sao.core.config import Config
from sao.core.errors import ConfigError
from sao.core.plugins import describe
from sao.model.policy import Models, context_length
from sao.rollout.environment import EnvFactory
from sao.rollout.registry import build_source, builds_on_every_rank
from sao.rollout.sampler import derived_seed
from sao.rollout.sources import Source, SourceContext
from sao.tasks import custom, setup
from sao.tasks.base import Task, TaskSet
from sao.training import checkpoint, otel
from sao.training.distributed import World
from sao.training.gate import Gate, HeldAside, LiveRewards
from sao.training.hooks import FootingAudit, Mismatch, Publish, Reachability, SourceSummary, Timeline, Tracking
from sao.training.oracle import OracleCeiling
from sao.training.trainer import Hook, Trainer, check_hooks, check_source

log = logging.getLogger("sao.training")


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
    """A ``Trainer`` with every part the config names, unless passed in, built in phases that each stay in one layer:
    what this process checks alone (the telemetry, the processes, the hooks), the tasks (``setup.prepare``: the
    plug-ins, the model's folder, the data, the gate's tasks), the run folder, then the models, the task's parts,
    the gate and the source. Nothing in ``out_dir`` is claimed until every check has passed, and a mistake found
    after that leaves the folder as it was found."""
    otel.check(config)  # --otel-endpoint without the SDK: one line, nothing loaded
    world = World.from_env(config.model.device)  # one process, or this rank of a torchrun group
    world.shard(config.training.batch_size)  # a batch that does not split over the processes: refused before loading
    if config.training.shard == "fsdp" and world.size == 1:
        print(
            "notice: --shard fsdp without torchrun: one process trains the unsharded models (its checkpoints are "
            "sharded ones, which torchrun can resume on any number of processes)",
            file=sys.stderr,
        )
    hooks = check_hooks(hooks)  # a class or a function where an instance belongs: before anything is claimed
    check_source(source)
    named = named_hooks(config.training.hooks)  # --hooks: imported and built now
    tasks, held = setup.prepare(config, dataset, tasks=tasks, reward_fn=reward_fn, env_factory=env_factory)
    passed = {"dataset": dataset, "reward_fn": reward_fn, "env_factory": env_factory, "source": source}
    record = checkpoint.run_record(config, tasks, world.size, **passed, hooks=list(hooks))
    # another run's folder, one in use, a damaged checkpoint: now (rank 0 holds the folder's lock)
    run = checkpoint.RunDir.open(out_dir, record, resume=resume, lock=world.is_main)
    try:
        # a source built on every process draws with the trainer's own models: room for its stale sampler first
        every_rank = source is None and builds_on_every_rank(config.rollout.source)
        models = load_models(config, world, stale_sampler=every_rank)
        task_parts = setup.parts(
            config,
            models.tokenizer,
            tasks,
            reward_fn=reward_fn,
            env_factory=env_factory,
            eos_token_ids=models.eos_token_ids,
            context_length=context_length(models.policy),
        )
        gate = [held_aside_gate(config, models, held, task_parts)] if held else []
        label = label or f"{config.algorithm.correction} seed {config.training.seed}"
        if source is None and (world.is_main or every_rank):
            context = SourceContext(
                config,
                models,
                {t.id: t for t in tasks.train},
                task_parts.prompts,
                task_parts.episodes,
                Path(out_dir),
                task_parts.sampling(),
                world.training_gpus(),
                label,
                progress,
                world_size=world.size,
                world=world,
            )
            source = build_source(config.rollout.source, context)  # a launched vLLM fleet writes into out_dir
        return Trainer(
            models,
            source,
            task_parts.scorer,
            config,
            run,
            hooks=[*default_hooks(config), *gate, *named, *hooks],
            world=world,
            progress=progress,
            label=label,
        )
    except BaseException:
        if world.is_main:
            run.undo()  # a new run's folder as it was found, so that the corrected command is not refused
        run.release()
        raise


def load_models(config: Config, world: World, *, stale_sampler: bool = False) -> Models:
    """The models the config names on this process's device: the policy (LoRA or every weight), the critic (a head or
    a value model), with room for the stale sampler when ``stale_sampler`` (its adapter, or its copy of the whole
    policy), sharded over the processes with --shard fsdp under torchrun."""
    m = config.model
    sharded = config.training.shard == "fsdp" and world.size > 1
    models = Models.load(
        m.name,
        device=world.device(m.device),
        lora_rank=m.lora_rank,
        lora_alpha=m.lora_alpha,
        seed=config.training.seed,
        grad_checkpoint=m.grad_checkpoint,
        finetune=m.finetune,
        critic=m.critic,
        critic_model=m.critic_model,
        master_float32=sharded,
    )
    if stale_sampler:
        models.add_stale_sampler()  # before sharding: the sampler's tensors are sharded with the policy's
    if sharded:
        models.shard()
    return models


def named_hooks(specs: str | None) -> list[Hook]:
    """``--hooks module:Class[,module:Class...]``: each class imported and built with no arguments; one that is not
    a ``Hook`` subclass, or cannot be built so, is a one-line ConfigError."""
    hooks = []
    for spec in (specs or "").split(","):
        if not spec.strip():
            continue
        cls = custom.load_plugin(spec.strip(), "--hooks", "Class")
        if not (isinstance(cls, type) and issubclass(cls, Hook)):
            raise ConfigError(
                f"--hooks {spec.strip()!r}: {getattr(cls, '__qualname__', cls)!r} is not a Hook "
                "subclass (sao.training.trainer.Hook)"
            )
        try:
            hooks.append(cls())
        except Exception as error:  # a constructor that needs arguments, or one that raises
            raise ConfigError(
                f"--hooks {spec.strip()!r}: {cls.__qualname__}() failed ({describe(error)}); a hook "
                "named here is built with no arguments"
            ) from None
    return hooks


def held_aside_gate(config: Config, models: Models, held: list[Task], parts: setup.TaskParts) -> Gate:
    """The gate over ``held`` (``gate_tasks``): one reply (or episode, in the run's environment and under its
    settings) each at the eval settings from a seed of the data seed, and the trace log's rewards for the rollback."""
    t, r = config.training, config.rollout
    aside = HeldAside(
        held,
        instruction=parts.tasks.instruction,
        tokenizer=models.tokenizer,
        scorer=parts.scorer,
        sampling=parts.sampling(eval=True),
        episodes=parts.episodes_for(held),
        batch=config.eval.eval_batch,
        decoder=r.decoder,
        seed=derived_seed(config.data.data_seed, "gate"),
    )
    live = LiveRewards(r.traces) if r.traces is not None else None
    # the live traces of a served version count until they are older than the source's bound (the trace reader's)
    bound = getattr(config.source, "max_staleness", None) if live is not None else None
    return Gate(aside, margin=t.gate_margin, alpha=t.gate_alpha, live=live, max_staleness=bound)


def default_hooks(config: Config) -> list[Hook]:
    """What the settings ask for beside the step: the reachability lines and the mismatch split always; what the
    source's section says it needs (``needs``: the footing audit, the sampler tolerance, its summary, publishing);
    publishing with --publish; the oracle ceiling with --ceiling-every; the timeline (timeline.json, OpenTelemetry)
    unless --timeline-steps 0 and no collector; tracking with --track (last, so it sees every other hook's work)."""
    t, chunk, needs = config.training, config.model.logprob_chunk, config.source.needs()
    temperature = config.rollout.temperature
    hooks: list[Hook] = [Reachability(t.dead_band_share, config.algorithm.ratio, t.steps)]
    if needs.get("footing_audit"):  # before the tolerance: a wrong footing is the more telling reason to stop
        hooks.append(FootingAudit(temperature, chunk))
    hooks.append(Mismatch(temperature, chunk, tolerance=needs.get("sampler_tolerance")))
    if needs.get("summary"):
        hooks.append(SourceSummary())
    if (t.publish or needs.get("publish")) and t.gate == "off":  # a gate publishes what passes it (held_aside_gate)
        hooks.append(Publish())
    if t.ceiling_every:  # before the timeline and tracking, so that they see the snapshot's numbers in the record
        hooks.append(
            OracleCeiling(
                t.ceiling_every, t.ceiling_prompts, config.algorithm.oracle_samples, t.steps, temperature, chunk
            )
        )
    telemetry = otel.from_config(config, log.warning)
    if t.timeline_steps > 0 or telemetry is not None:
        hooks.append(Timeline(t.timeline_steps, telemetry))
    if t.track is not None:
        hooks.append(Tracking(t.track, config.to_dict()))
    return hooks
