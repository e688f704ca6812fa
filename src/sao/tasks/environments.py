"""Which environment a run's trajectories talk to: ``--env`` turned into a factory ``(task_id, fields) -> env``.

    None            no environment: one reply per prompt, graded by the task's reward (the page's protocol)
    a registered    ``ENVIRONMENTS`` in ``sao.core.registry``: "gsm8k" (the single-turn task as an environment),
    name            "gsm8k-calc" (a calculator tool, in the tokenizer's own tool-call format when its template has
                    tools), "tiny-calc" (the CPU preset's calculator task); each ``factory(tokenizer)``
    "skyrl:<id>"    a SkyRL-Gym environment, unchanged (``pip install 'sao[agents]'``), built with the task's
                    answer as its ``reward_spec`` ground truth; ``skyrl:<module>:<id>`` imports your module first,
                    so the ids it registers with ``skyrl_gym.register`` are found
    "module:Class"  your own, ``Class(task_id, fields)``, or a SkyRL-style ``Class(env_config, extras)`` built as
                    ``skyrl:<id>`` is (``custom.load_env_class``)

``episodes_for`` turns a factory and the tasks into what a source needs to draw multi-turn episodes;
``prompt_text`` renders a task's chat prompt for a single reply. Deliberately left out: environment-specific
configuration files (an environment reads what it needs from the task's fields).
"""

from __future__ import annotations

from typing import Any

from sao.core.errors import ConfigError
from sao.core.registry import ENVIRONMENTS
from sao.rollout.environment import EnvFactory
from sao.rollout.episodes import DEFAULT_CONCURRENCY
from sao.rollout.sources import Episodes
from sao.tasks import calc, custom
from sao.tasks.base import Task
from sao.tasks.gsm8k.data import format_chat


def env_factory(name: str | None, tokenizer: Any, max_turns: int) -> EnvFactory | None:
    """The factory ``--env name`` names (None: no environment)."""
    if name is None:
        return None
    if name in ENVIRONMENTS:
        return ENVIRONMENTS.get(name)(tokenizer)
    if name.startswith("skyrl:"):
        return _skyrl_factory(name.removeprefix("skyrl:"), max_turns)
    if ":" in name:
        return custom.load_env_class(name, max_turns)
    raise ConfigError(f"--env {name!r}: choose {', '.join(ENVIRONMENTS.names())}, skyrl:<id> or module:Class")


def gsm8k(tokenizer: Any) -> EnvFactory:
    """``--env gsm8k``: one reply graded by the GSM8K grader, as an environment."""
    return calc.Gsm8kEnv


def gsm8k_calc(tokenizer: Any) -> EnvFactory:
    """``--env gsm8k-calc``: GSM8K with a calculator, in the tokenizer's tool format."""
    return calc.calc_env_factory(tokenizer)


def episodes_for(
    factory: EnvFactory | None,
    tasks: list[Task],
    instruction: str,
    max_turns: int,
    max_total_tokens: int,
    env_concurrency: int = DEFAULT_CONCURRENCY,
    *,
    name: str | None = None,
    env_timeout: float = 0.0,
    env_rejoin: str = "turn",
) -> Episodes | None:
    """What a source needs to draw multi-turn episodes of ``tasks`` (None without an environment); ``name`` is what
    its one-line faults call the environment (``--env`` as given), ``env_timeout`` the seconds one call of it may
    take (0: no limit), ``env_concurrency`` the steps in flight at once (0: batch-synchronous)."""
    if factory is None:
        return None
    messages = {t.id: t.chat(instruction) for t in tasks}
    fields = {t.id: task_fields(t) for t in tasks}
    label = f"environment {name}" if name else f"environment {getattr(factory, '__qualname__', 'factory')}"
    return Episodes(
        factory, messages, fields, max_turns, max_total_tokens, env_concurrency, env_rejoin, env_timeout, label
    )


def prompt_text(tokenizer: Any, task: Task, instruction: str) -> str:
    """The prompt a single reply continues: the chat template over the task's messages, with the generation
    prompt."""
    return format_chat(tokenizer, task.chat(instruction))


def task_fields(task: Task) -> dict[str, Any]:
    """What an environment is built from: the task's raw fields, its question and its gold answer."""
    return {**task.fields, "question": task.question, "answer": task.answer}


def _skyrl_factory(env_id: str, max_turns: int) -> EnvFactory:
    """``skyrl:<id>`` (SkyRL-Gym's own registry) or ``skyrl:<module>:<id>``: the module is imported first, so the
    environments it registers with ``skyrl_gym.register`` are found as they are."""
    given = env_id
    try:
        import skyrl_gym
        from skyrl_gym.envs.registration import registry
    except ImportError:
        raise ConfigError(f"--env skyrl:{given} needs SkyRL-Gym: pip install 'sao[agents]'") from None
    if ":" in env_id:  # found as --env module:Class finds its module (the working folder last), failures one line
        module, env_id = env_id.rsplit(":", 1)
        custom.import_plugin_module(module, f"skyrl:{given}", "--env")
    if env_id not in registry:
        known = ", ".join(sorted(registry)[:12])
        raise ConfigError(f"--env skyrl:{env_id}: SkyRL-Gym has no such environment (it has {known}, ...)")

    def build(task_id: str, fields: dict[str, Any]):
        return skyrl_gym.make(env_id, env_config={}, extras=custom.skyrl_extras(fields, max_turns))

    return build
