"""Which environment a run's trajectories talk to: ``--env`` turned into a factory ``(task_id, fields) -> env``.

    None            no environment: one reply per prompt, graded by the task's reward (the page's protocol,
                    and today's runs bit for bit)
    "gsm8k"         the same single-turn task as an environment (``calc.Gsm8kEnv``)
    "gsm8k-calc"    GSM8K with a calculator tool, in the tokenizer's own tool-call format when its chat
                    template supports tools, a plain ``<calc>`` tag otherwise (``calc.CalcEnv``)
    "tiny-calc"     the CPU preset's calculator task (3–4 digit sums) on its own warm-started tiny model
    "skyrl:<id>"    a SkyRL-Gym environment, unchanged (``pip install 'sao[agents]'``), built with the task's
                    answer as its ``reward_spec`` ground truth
    "module:Class"  your own, ``Class(task_id, fields)`` (``custom.load_env_class``)

Deliberately left out: environment-specific configuration files (an environment reads what it needs from
the task's fields).
"""

from __future__ import annotations

from typing import Any

from sao.core.config import Config
from sao.core.errors import ConfigError
from sao.rollout.environment import EnvFactory
from sao.rollout.sources import Episodes
from sao.tasks import calc, custom
from sao.tasks.base import Task
from sao.tasks.gsm8k import format_prompt

BUILT_IN = ("gsm8k", "gsm8k-calc", "tiny-calc")


def env_factory(config: Config, tokenizer: Any) -> EnvFactory | None:
    """The factory ``config.env`` names (None: no environment)."""
    name = config.env
    if name is None:
        return None
    if name == "gsm8k":
        return calc.Gsm8kEnv
    if name == "gsm8k-calc":
        return calc.calc_env_factory(tokenizer)
    if name == "tiny-calc":
        return calc.calc_env_factory(tokenizer)
    if name.startswith("skyrl:"):
        return _skyrl_factory(name.removeprefix("skyrl:"), config.max_turns)
    if ":" in name:
        return custom.load_env_class(name)
    raise ConfigError(f"--env {name!r}: choose {', '.join(BUILT_IN)}, skyrl:<id> or module:Class")


def episodes_for(config: Config, tokenizer: Any, tasks: list[Task], instruction: str) -> Episodes | None:
    """What a source needs to draw multi-turn episodes of ``tasks`` (None without an environment)."""
    factory = env_factory(config, tokenizer)
    if factory is None:
        return None
    messages = {t.id: custom.task_messages(t, instruction) for t in tasks}
    fields = {t.id: task_fields(t) for t in tasks}
    return Episodes(factory, messages, fields, config.max_turns, config.max_total_tokens)


def prompt_text(tokenizer: Any, task: Task, instruction: str) -> str:
    """The prompt a single-turn reply continues: the chat template over the task's messages (its own, or the
    question with ``instruction``)."""
    if task.messages is None:
        return format_prompt(tokenizer, task.question, instruction)
    return tokenizer.apply_chat_template(custom.task_messages(task, instruction), tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip


def task_fields(task: Task) -> dict[str, Any]:
    """What an environment is built from: the task's raw fields, its question and its gold answer."""
    return {**task.fields, "question": task.question, "answer": task.answer}


def _skyrl_factory(env_id: str, max_turns: int) -> EnvFactory:
    try:
        import skyrl_gym
        from skyrl_gym.envs.registration import registry
    except ImportError:
        raise ConfigError(f"--env skyrl:{env_id} needs SkyRL-Gym: pip install 'sao[agents]'") from None
    if env_id not in registry:
        known = ", ".join(sorted(registry)[:12])
        raise ConfigError(f"--env skyrl:{env_id}: SkyRL-Gym has no such environment (it has {known}, ...)")

    def build(task_id: str, fields: dict[str, Any]):
        extras = {"reward_spec": {"method": "rule", "ground_truth": fields["answer"]}, "max_turns": max_turns,
                  "extra_info": {k: v for k, v in fields.items() if k != "answer"}}  # fmt: skip
        return skyrl_gym.make(env_id, env_config={}, extras=extras)

    return build
