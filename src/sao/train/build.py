"""The parts a config names, built from its strings: the task set, the prompt instruction, the model folder.

Deliberately left out: what the parts do (each lives in its own layer); this module only maps names to them.
"""

from __future__ import annotations

from sao.core.config import Config
from sao.tasks import custom
from sao.tasks.base import TaskSet
from sao.tasks.gsm8k import DEFAULT_INSTRUCTION, load_gsm8k
from sao.tiny import arithmetic as tiny
from sao.tiny import calculator as tiny_calc


def load_split(config: Config) -> TaskSet:
    """The training prompts and held-out tasks the config names: a data file or hub dataset (with the config's
    field names) through ``custom``; None, a GSM8K directory and "tiny" exactly as before."""
    if custom.uses_custom_loader(config.data, config.prompt_field, config.answer_field, config.messages_field):
        return custom.load_custom(
            config.data,
            prompt_field=config.prompt_field,
            answer_field=config.answer_field,
            messages_field=config.messages_field,
            n_train=config.train_prompts,
            n_test=config.test_prompts,
            seed=config.data_seed,
        )
    if config.data == "tiny" and config.env == "tiny-calc":
        return tiny_calc.make_split(config.train_prompts, config.test_prompts, config.data_seed)
    if config.data == "tiny":
        return tiny.make_split(config.train_prompts, config.test_prompts, config.data_seed)
    return load_gsm8k(config.data, n_train=config.train_prompts, n_test=config.test_prompts, seed=config.data_seed)


def instruction_for(config: Config) -> str:
    """The instruction appended to each question (the tiny tasks ask for a shorter form)."""
    if config.data == "tiny" and config.env == "tiny-calc":
        return tiny_calc.TINY_CALC_INSTRUCTION
    if config.data == "tiny":
        return tiny.TINY_INSTRUCTION
    return DEFAULT_INSTRUCTION


def model_path(config: Config) -> str:
    """A hub id or directory; "tiny" is the warm-started stand-in (the calculator agent's with --env tiny-calc),
    built and cached on first use."""
    if config.model == "tiny" and config.env == "tiny-calc":
        return str(tiny_calc.ensure_calc_model())
    if config.model == "tiny":
        return str(tiny.ensure_model())
    return config.model
