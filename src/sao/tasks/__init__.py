"""Tasks: what the model is asked and how its answers are scored — GSM8K (``gsm8k``) and the tiny
arithmetic task with its CPU stand-in model (``tiny``). ``load_split``, ``instruction_for`` and
``model_path`` turn a config's ``data`` and ``model`` settings into tasks, a prompt instruction and a
model directory."""

from __future__ import annotations

from sao.core.config import Config
from sao.tasks import tiny
from sao.tasks.gsm8k import DEFAULT_INSTRUCTION, DataSplit, Task, load_gsm8k

__all__ = ["DataSplit", "Task", "instruction_for", "load_split", "model_path"]


def load_split(config: Config) -> DataSplit:
    """The training prompts and held-out tasks the config names."""
    if config.data == "tiny":
        return tiny.make_split(config.train_prompts, config.test_prompts, config.data_seed)
    return load_gsm8k(config.data, n_train=config.train_prompts, n_test=config.test_prompts, seed=config.data_seed)


def instruction_for(config: Config) -> str:
    """The instruction appended to each question (the tiny task asks for a shorter form)."""
    if config.data == "tiny":
        return tiny.TINY_INSTRUCTION
    return DEFAULT_INSTRUCTION


def model_path(config: Config) -> str:
    """A hub id or directory; "tiny" is the warm-started stand-in, built and cached on first use."""
    if config.model == "tiny":
        return str(tiny.ensure_model())
    return config.model
