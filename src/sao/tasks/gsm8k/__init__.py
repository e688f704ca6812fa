"""GSM8K: the protocol's data (``data``: load, hold out, decontaminate, prompt) and its reward (``grading``:
the final answer compared numerically with the gold)."""

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
    "word_ngrams",
]
