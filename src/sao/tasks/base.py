"""What every task source hands the layers above: ``Task`` (one prompt, its gold answer, the record's fields)
and ``TaskSet`` (the training prompts and held-out tasks of a run, with the counts that produced them).

GSM8K (``sao.tasks.gsm8k``), your own data (``sao.tasks.custom``) and the CPU stand-ins (``sao.tiny``) all
return a ``TaskSet``. Deliberately left out: loading (each source loads its own) and prompting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    """One task: a prompt and its gold answer.

    ``id`` names the source and the row (GSM8K: ``gsm8k/test/17``); ``answer`` is the gold final answer
    (GSM8K: the text after the last ``####`` in its answer field, stripped: ``"18"``, ``"1,000"``).
    ``fields`` holds the record's raw fields, for a reward or an environment that needs more than the
    answer (GSM8K's loader leaves it empty); ``messages`` is the prompt as chat messages when the data gives
    one (``question`` is then its last user turn, the text decontamination and logs use). Both are left out
    of the hash (a dict and a list cannot be hashed) but not of equality; ``Task(id, question, answer)``
    leaves them empty.
    """

    id: str
    question: str
    answer: str
    fields: dict[str, Any] = field(default_factory=dict, hash=False)  # the record as read: {"answer": ..., ...}
    messages: list[dict[str, Any]] | None = field(default=None, hash=False)  # [{"role": ..., "content": ...}]


@dataclass(frozen=True)
class TaskSet:
    """The training prompts and held-out tasks of one run, with the counts that produced them.

    ``counts`` holds ``train_pool`` and ``test_pool`` (the split sizes), ``test`` (held out),
    ``train_contaminated`` (training questions dropped for sharing an 8-gram with a held-out question),
    ``train_kept`` (the pool left after that) and ``train`` (sampled from the kept pool).
    ``source`` is ``hub:<id>`` or ``local:<directory name>``.
    """

    train: list[Task]
    test: list[Task]
    counts: dict[str, int]
    source: str
