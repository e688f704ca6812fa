"""GSM8K: the protocol's data (``data``: load, hold out, decontaminate, prompt) and its reward (``grading``:
the final answer compared numerically with the gold; ``reward`` on a task's row)."""

from typing import Any

from sao.tasks.gsm8k import grading
from sao.tasks.gsm8k.data import (
    DEFAULT_INSTRUCTION,
    GOLD_MARKER,
    HUB_ID,
    MAX_LINE_BYTES,
    build_messages,
    decontaminate,
    format_prompt,
    load_gsm8k,
    read_jsonl_tasks,
    word_ngrams,
)

__all__ = [
    "DEFAULT_INSTRUCTION",
    "GOLD_MARKER",
    "HUB_ID",
    "MAX_LINE_BYTES",
    "build_messages",
    "decontaminate",
    "format_prompt",
    "load_gsm8k",
    "read_jsonl_tasks",
    "reward",
    "word_ngrams",
]


def reward(completion: str, row: dict[str, Any]) -> float:
    """GSM8K's reward: 1.0 when the completion's final answer equals the row's gold ``answer`` numerically, else 0."""
    return grading.reward(completion, row["answer"])
