"""A config's task settings turned into objects: the task set, its scorer, the environment, the prompts.

    prepare    a run's tasks, checked before a model loads: the plug-ins and the model's folder (``preflight``),
               the task set, the gate's held-aside tasks (``held_aside``)
    task_set   a generated task set (``TASK_SETS``: "tiny", "tiny-calc"), your data (a file, a folder, a hub
               dataset; or rows passed in as objects), or GSM8K
    scorer     the reward you pass, else ``--reward module:function``, else the task set's own (GSM8K's grader)
    parts      all of them for one tokenizer, built once: what a source draws from (prompts, or episodes with an
               environment), and the episodes and sampling of evaluations and the gate

Deliberately left out: models and sources (the trainer's builder, ``sao.training.build``, brings them together).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sao.core.config import Config
from sao.core.errors import ConfigError, DataError
from sao.core.registry import ENVIRONMENTS, TASK_SETS
from sao.core.stats import tasks_for_margin
from sao.model.policy import locate
from sao.rollout.environment import EnvFactory, check_factory
from sao.rollout.sources import Episodes
from sao.rollout.types import Sampling
from sao.tasks import custom, environments, gsm8k
from sao.tasks.base import Scorer, Task, TaskSet
from sao.tasks.environments import episodes_for, prompt_text


def preflight(
    config: Config, *, reward_fn: Callable[..., Any] | None = None, env_factory: EnvFactory | None = None
) -> None:
    """What can be known before any data, hub or model is touched, so that a mistake costs seconds, not a download
    or a model load: the model's folder (a name that reads as a path and is no folder), and the ``--reward`` and
    ``--env`` plug-ins (imported, their call shape checked). The data's own paths are read next (``task_set``,
    local and quick) and the hub is asked last (``sao.core.hub``: one line at once offline or without a network)."""
    check_factory(env_factory)  # an environment instance, or something that cannot build one: a TypeError now
    d = config.data
    if reward_fn is None and d.reward:
        custom.load_reward(d.reward)
    if env_factory is None and d.env is not None and d.env not in ENVIRONMENTS:
        environments.env_factory(d.env, None, config.rollout.max_turns)  # "skyrl:..." or "module:Class"
    locate(config.model.name)


def prepare(
    config: Config,
    dataset: Any = None,
    *,
    tasks: TaskSet | None = None,
    reward_fn: Callable[..., Any] | None = None,
    env_factory: EnvFactory | None = None,
) -> tuple[TaskSet, list[Task]]:
    """A run's tasks, every check on them made before a model is loaded: ``preflight``, then the task set
    (``tasks`` when given, else ``task_set``: a bad --data fails here), then the gate's held-aside tasks
    (``held_aside``: a held-out split too small for its margin is refused)."""
    preflight(config, reward_fn=reward_fn, env_factory=env_factory)
    tasks = tasks or task_set(config, dataset)
    return tasks, held_aside(config, tasks)


def task_set(config: Config, dataset: Any = None) -> TaskSet:
    """The training prompts and held-out tasks: ``dataset`` when given (rows, a mapping of splits, a Hugging Face
    dataset, or a path read as ``--data``), else what ``--data`` names."""
    d = config.data
    if dataset is not None and not isinstance(dataset, str | Path):
        return custom.from_rows(
            dataset,
            n_train=d.train_prompts,
            n_test=d.test_prompts,
            seed=d.data_seed,
            prompt_field=d.prompt_field,
            answer_field=d.answer_field,
            messages_field=d.messages_field,
        )
    name = str(dataset) if dataset is not None else d.dataset
    if name in TASK_SETS:
        given = [
            f
            for f, v in (
                ("--prompt-field", d.prompt_field),
                ("--answer-field", d.answer_field),
                ("--messages-field", d.messages_field),
            )
            if v is not None
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)} apply to --data FILE (.jsonl, .parquet), a directory or a hub "
                f"dataset name, not to the generated task set {name!r}"
            )
        return TASK_SETS.get(name)(d.train_prompts, d.test_prompts, d.data_seed)
    if custom.uses_custom_loader(name, d.prompt_field, d.answer_field, d.messages_field):
        return custom.load_custom(
            name,
            prompt_field=d.prompt_field,
            answer_field=d.answer_field,
            messages_field=d.messages_field,
            n_train=d.train_prompts,
            n_test=d.test_prompts,
            seed=d.data_seed,
        )
    return gsm8k.load_gsm8k(name, n_train=d.train_prompts, n_test=d.test_prompts, seed=d.data_seed)


def held_aside(config: Config, tasks: TaskSet) -> list[Task]:
    """``--gate held-out``'s held-aside tasks: the first ``--gate-tasks`` of the held-out split (all of it with 0);
    [] without a gate. A split smaller than the gate's margin needs is refused with the size it would need."""
    t = config.training
    if t.gate == "off":
        return []
    need = max(tasks_for_margin(t.gate_margin, t.gate_alpha), t.gate_tasks)
    if len(tasks.test) < need:
        raise ConfigError(
            f"--gate held-out: the held-out split holds {len(tasks.test)} tasks; --gate-margin "
            f"{t.gate_margin:g} at --gate-alpha {t.gate_alpha:g}"
            f"{f' with --gate-tasks {t.gate_tasks}' if t.gate_tasks else ''} needs at least {need} "
            "(raise --test-prompts, or use a larger task set)"
        )
    return list(tasks.test[: t.gate_tasks or len(tasks.test)])


def scorer(config: Config, tasks: TaskSet | None = None, reward_fn: Callable[..., Any] | None = None) -> Scorer:
    """The one grader of training, eval and serving: ``reward_fn``, else ``--reward``, else the task set's own."""
    reward, name = reward_fn, None
    if reward is None and config.data.reward:
        reward, name = custom.load_reward(config.data.reward), config.data.reward
    if reward is None:
        reward = (tasks.reward if tasks is not None else None) or gsm8k.reward
    d = config.data
    return Scorer(
        reward,
        truncated_reward=d.truncated_reward,
        name=name,
        timeout=d.reward_timeout,
        concurrency=d.reward_concurrency,
    )


@dataclass
class TaskParts:
    """What the tasks of a run are, for one tokenizer, built once (``parts``) and asked by everything that draws or
    grades: the task set, its scorer, the environment, the training prompts and episodes, and the episodes and
    sampling of any other tasks (held-out evals, the gate's) under the same environment settings."""

    tasks: TaskSet
    scorer: Scorer
    env_factory: EnvFactory | None
    prompts: dict[str, str]  # task id → the chat-formatted prompt a single reply continues
    config: Config
    eos_token_ids: list[int]  # every token that ends a reply (the tokenizer's and the model's)
    pad_token_id: int
    episodes: Episodes | None = None  # with an environment: what drawing the training tasks' episodes needs

    def __post_init__(self) -> None:
        self.episodes = self.episodes_for(self.tasks.train)

    def episodes_for(self, tasks: list[Task]) -> Episodes | None:
        """Multi-turn drawing of ``tasks`` in this run's environment, with its limits, concurrency, rejoin rule and
        timeout (None without an environment)."""
        r, d = self.config.rollout, self.config.data
        return episodes_for(
            self.env_factory,
            tasks,
            self.tasks.instruction,
            r.max_turns,
            r.max_total_tokens,
            r.env_concurrency,
            name=d.env,
            env_timeout=d.env_timeout,
            env_rejoin=r.env_rejoin,
        )

    def sampling(self, *, eval: bool = False) -> Sampling:
        """How replies are drawn: at the rollout temperature and length for training, at the eval settings for an
        evaluation (the held-out tasks, the gate's)."""
        r, e = self.config.rollout, self.config.eval
        length, temperature = (e.eval_max_new_tokens, e.eval_temperature) if eval else (r.max_new_tokens, r.temperature)
        return Sampling(length, temperature, self.eos_token_ids, self.pad_token_id)


def parts(
    config: Config,
    tokenizer: Any,
    tasks: TaskSet,
    *,
    reward_fn: Callable[..., Any] | None = None,
    env_factory: EnvFactory | None = None,
    eos_token_ids: list[int] | None = None,
    context_length: int | None = None,
) -> TaskParts:
    """The scorer, the environment (the factory you pass, else ``--env``) and the training prompts of ``tasks``;
    ``eos_token_ids``: the model's (default: the tokenizer's EOS). With the model's ``context_length`` (prompt and
    reply together), a task whose prompt leaves no room for a reply is a one-line DataError naming it."""
    check_prompts_fit(tokenizer, tasks, context_length)
    factory = env_factory
    if factory is None:
        factory = environments.env_factory(config.data.env, tokenizer, config.rollout.max_turns)
    return TaskParts(
        tasks=tasks,
        scorer=scorer(config, tasks, reward_fn),
        env_factory=factory,
        prompts={t.id: prompt_text(tokenizer, t, tasks.instruction) for t in tasks.train},
        config=config,
        eos_token_ids=list(eos_token_ids or [tokenizer.eos_token_id]),
        pad_token_id=tokenizer.pad_token_id,
    )


def check_prompts_fit(tokenizer: Any, tasks: TaskSet, context_length: int | None) -> None:
    """A DataError naming the first task (training or held out) whose chat-formatted prompt takes the model's
    whole context, leaving no position for a reply: it would train and score as an empty reply, silently."""
    if context_length is None:
        return
    for task in [*tasks.train, *tasks.test]:
        n = len(tokenizer(prompt_text(tokenizer, task, tasks.instruction), add_special_tokens=False)["input_ids"])
        if n >= context_length:
            raise DataError(
                f"task {task.id}: its prompt is {n} tokens and the model attends over {context_length} "
                "positions, prompt and reply together, so no reply fits; shorten the prompt or leave "
                "the task out"
            )
