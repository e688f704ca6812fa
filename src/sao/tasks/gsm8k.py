"""GSM8K tasks: load them, hold out an evaluation set, decontaminate the training prompts, build prompts.

The protocol (SPEC §3) trains on prompts from GSM8K's train split and evaluates pass@1 on tasks held out
from its test split. This module turns either the Hugging Face hub copy (``openai/gsm8k``, config
``main``) or a local directory holding ``train.jsonl`` and ``test.jsonl`` into a :class:`DataSplit`:

* the held-out set is ``n_test`` tasks sampled from the test split with ``random.Random(seed)``;
* every training question that shares a word 8-gram with a held-out question is dropped (after
  lowercasing and replacing every character that is neither alphanumeric nor whitespace with a space);
  decontamination is against the held-out tasks actually drawn, not the whole test split, because those
  are the only tasks the evaluation scores; the counts record how many were dropped;
* ``n_train`` training tasks are then sampled from what is left with an independent stream,
  ``random.Random(seed + 1)``, so that changing ``n_train`` never changes the held-out set.

Both samples are returned sorted by their row index in the source, so a split is a plain function of
``(source, n_train, n_test, seed)``. Task ids are ``gsm8k/<split>/<row>`` (0-based row among the non-blank
lines of a file, or among the rows of the hub split), so the hub and an identical local copy give the
same ids. Every problem with the data raises :class:`~sao.core.errors.DataError` with one line naming the file
and line.

Deliberately left out: grading (``sao.core.grading`` compares answers; the gold here is the raw text after the
last ``####``, e.g. ``"1,000"``, not a parsed number), shuffling for training (the trainer orders its
batches with its own seed), few-shot prompts and system turns (the model's chat template supplies its
default system turn), and deduplication within the training split.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sao.core.errors import DataError

__all__ = [
    "DEFAULT_INSTRUCTION",
    "DataSplit",
    "Task",
    "build_messages",
    "decontaminate",
    "format_prompt",
    "load_gsm8k",
    "read_jsonl_tasks",
    "word_ngrams",
]

HUB_ID = "openai/gsm8k"
HUB_CONFIG = "main"
GOLD_MARKER = "####"

DEFAULT_INSTRUCTION = (
    "Solve the problem step by step. On the last line, write only the final answer in the form "
    '"#### N", where N is the final number.'
)

# A hub dataset id: "owner/name" with the characters the hub allows.
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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
class DataSplit:
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


# --- reading -------------------------------------------------------------------------------------------


def _task_from_record(record: Any, split: str, row: int, where: str) -> Task:
    """Validate one record (a JSON object or hub row) and make a Task; ``where`` prefixes any error."""
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: expected a JSON object with 'question' and 'answer', got {type(record).__name__}")
    for key in ("question", "answer"):
        if key not in record:
            raise DataError(f"{where}: record has no {key!r} field; each record needs 'question' and 'answer'")
        if not isinstance(record[key], str) or not record[key].strip():
            raise DataError(f"{where}: {key!r} must be a non-empty string")
    answer_field = record["answer"]
    if GOLD_MARKER not in answer_field:
        raise DataError(
            f"{where}: answer has no {GOLD_MARKER!r} marker, so the gold final answer is missing "
            f"(GSM8K answers end with '{GOLD_MARKER} N')"
        )
    gold = answer_field.rsplit(GOLD_MARKER, 1)[1].strip()
    if not gold:
        raise DataError(f"{where}: nothing follows the last {GOLD_MARKER!r} marker; the gold answer is empty")
    return Task(id=f"gsm8k/{split}/{row}", question=record["question"].strip(), answer=gold)


def read_jsonl_tasks(path: str | os.PathLike[str], split: str) -> list[Task]:
    """Read a GSM8K-style JSONL file: one JSON object per line with ``question`` and ``answer``.

    Blank lines are skipped (row indices count only non-blank lines). A missing or empty file, a line
    that is not JSON (including a truncated last line), a record missing a field, or an answer with no
    ``####`` gold marker raises DataError naming the file and line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: file not found; a data directory needs train.jsonl and test.jsonl") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read file ({e.strerror or e})") from None

    tasks: list[Task] = []
    # Split on "\n" only (str.splitlines would also split inside a line on U+2028 and similar).
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        tasks.append(_task_from_record(record, split, len(tasks), where))
    if not tasks:
        raise DataError(f"{path}: file is empty (no records)")
    return tasks


def _load_local(directory: Path) -> tuple[list[Task], list[Task]]:
    if not directory.is_dir():
        raise DataError(f"{directory}: not a directory; --data needs a directory with train.jsonl and test.jsonl")
    train = read_jsonl_tasks(directory / "train.jsonl", "train")
    return train, read_jsonl_tasks(directory / "test.jsonl", "test")


def _load_hub(hub_id: str, *, explicit: bool = False) -> tuple[list[Task], list[Task]]:
    fix = "pass a local directory with --data DIR (train.jsonl and test.jsonl)"
    if explicit:  # the user typed an owner/name that is not a local directory either: say so
        fix = f"no local directory {hub_id!r} exists either; {fix}"
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"loading {hub_id} from the hub needs the 'datasets' package (pip install 'sao[hub]'); or {fix}"
        ) from None
    try:
        dataset = datasets.load_dataset(hub_id, HUB_CONFIG)
    except Exception as e:  # network, missing dataset, auth, cache: all become one user-facing line
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise DataError(
            f"could not load {hub_id!r} from the Hugging Face hub ({type(e).__name__}: {reason}); {fix}"
        ) from None

    def rows(split: str) -> list[Task]:
        try:
            records: Iterable[Any] = dataset[split]
        except (KeyError, TypeError):
            raise DataError(f"hub:{hub_id} has no {split!r} split; {fix}") from None
        tasks = [_task_from_record(r, split, i, f"hub:{hub_id} {split} row {i}") for i, r in enumerate(records)]
        if not tasks:
            raise DataError(f"hub:{hub_id} {split} split is empty; {fix}")
        return tasks

    return rows("train"), rows("test")


def _resolve_source(source: str | os.PathLike[str] | None) -> tuple[str, str]:
    """Return ``(kind, target)``. kind is ``"hub"`` (None, ``"hub"`` or ``"hub:<id>"``), ``"guess"`` (an
    ``owner/name`` string that is not an existing path: tried on the hub) or ``"local"``. A path that
    exists always wins over a hub id spelled the same way."""
    if source is None or (isinstance(source, str) and source in ("", "hub")):
        return "hub", HUB_ID
    if isinstance(source, str) and source.startswith("hub:"):
        return "hub", source.removeprefix("hub:")
    if isinstance(source, str) and _HUB_ID_RE.match(source) and not Path(source).exists():
        return "guess", source
    return "local", os.fspath(source)


# --- decontamination -----------------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    """Lowercase, replace every character that is neither alphanumeric (str.isalnum) nor whitespace with
    a space, and split on whitespace: "Janet’s $2-eggs" -> ["janet", "s", "2", "eggs"]."""
    return "".join(c if c.isalnum() or c.isspace() else " " for c in text.lower()).split()


def word_ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    """The set of word n-grams of ``text`` after normalisation (see :func:`_words`).

    A text with fewer than ``n`` words has no n-grams and so never matches anything (every GSM8K
    question has at least 9 words).
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    words = _words(text)
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def decontaminate(train: list[Task], held_out: list[Task], n: int = 8) -> tuple[list[Task], list[Task]]:
    """Split ``train`` into (kept, dropped): dropped questions share at least one word n-gram with a
    held-out question. Order within each list follows ``train``."""
    banned: set[tuple[str, ...]] = set()
    for task in held_out:
        banned |= word_ngrams(task.question, n)
    kept: list[Task] = []
    dropped: list[Task] = []
    for task in train:
        (dropped if word_ngrams(task.question, n) & banned else kept).append(task)
    return kept, dropped


# --- the split -----------------------------------------------------------------------------------------


def _sample(pool: list[Task], k: int, rng: random.Random) -> list[Task]:
    """``k`` tasks drawn without replacement, returned in source order."""
    return [pool[i] for i in sorted(rng.sample(range(len(pool)), k))]


def load_gsm8k(
    source: str | os.PathLike[str] | None = None, *, n_train: int = 512, n_test: int = 120, seed: int = 0
) -> DataSplit:
    """Load GSM8K and return ``n_train`` decontaminated training tasks and ``n_test`` held-out tasks.

    ``source``: None, ``"hub"`` or a hub id (``"openai/gsm8k"``, or ``"hub:<id>"``) loads with
    ``datasets.load_dataset(id, "main")``; a local directory reads ``train.jsonl`` and ``test.jsonl``
    from it. An existing directory takes precedence over a hub id of the same spelling. The same
    arguments always give the same split.
    """
    if n_train < 0 or n_test < 0:
        raise DataError(f"prompt counts must be non-negative, got n_train={n_train}, n_test={n_test}")
    kind, where = _resolve_source(source)
    if kind == "local":
        train_pool, test_pool = _load_local(Path(where))
        label = f"local:{Path(where).resolve().name}"
    else:
        train_pool, test_pool = _load_hub(where, explicit=kind == "guess")
        label = f"hub:{where}"

    if n_test > len(test_pool):
        raise DataError(
            f"asked for {n_test} held-out tasks but the test split of {label} has only {len(test_pool)}; "
            "lower --test-prompts"
        )
    test = _sample(test_pool, n_test, random.Random(seed))
    kept, dropped = decontaminate(train_pool, test)
    if n_train > len(kept):
        raise DataError(
            f"asked for {n_train} training prompts but only {len(kept)} remain after decontamination "
            f"({len(train_pool)} in the train split of {label}, {len(dropped)} dropped); "
            "lower --train-prompts or --test-prompts"
        )
    train = _sample(kept, n_train, random.Random(seed + 1))
    counts = {
        "train_pool": len(train_pool),
        "test_pool": len(test_pool),
        "test": len(test),
        "train_contaminated": len(dropped),
        "train_kept": len(kept),
        "train": len(train),
    }
    return DataSplit(train=train, test=test, counts=counts, source=label)


# --- prompts -------------------------------------------------------------------------------------------


def build_messages(question: str, instruction: str = DEFAULT_INSTRUCTION) -> list[dict[str, str]]:
    """Chat messages for one task: a single user turn, the question, a blank line, then the instruction.

    No system turn: the model's chat template supplies its default one. An empty instruction leaves the
    question alone.
    """
    content = f"{question.strip()}\n\n{instruction.strip()}" if instruction.strip() else question.strip()
    return [{"role": "user", "content": content}]


def format_prompt(tokenizer: Any, question: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The prompt text the model continues: the tokenizer's chat template applied to
    :func:`build_messages`, ending with the assistant generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(
            f"tokenizer {name!r} has no chat template; use an instruction-tuned model "
            "(e.g. Qwen/Qwen2.5-1.5B-Instruct) or set tokenizer.chat_template"
        )
    return tokenizer.apply_chat_template(
        build_messages(question, instruction), tokenize=False, add_generation_prompt=True
    )
