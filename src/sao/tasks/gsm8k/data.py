"""GSM8K tasks: load them, hold out an evaluation set, decontaminate the training prompts, build prompts.

The protocol trains on GSM8K's train split and evaluates pass@1 on tasks held out from its test split. From the
hub copy or a local directory this builds a :class:`TaskSet`: ``n_test`` held-out tasks drawn with
``random.Random(seed)``, training questions that share a word 8-gram with them dropped, ``n_train`` drawn from the
rest with ``random.Random(seed + 1)``; both sorted by row, ids ``gsm8k/<split>/<row>``. A local file is read line by
line, keeping byte offsets only; a line over ``MAX_LINE_BYTES`` is refused; every problem is a one-line ``DataError``.

Deliberately left out: grading (the gold here is the raw text after the last ``####``), shuffling for training,
few-shot prompts and system turns, and deduplication within the training split.
Design notes: docs/design/gsm8k-data.md.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import random
import re
from array import array
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from sao.core.errors import DataError
from sao.core.hub import check_reachable
from sao.core.reading import Limits, parse_jsonl_line
from sao.tasks.base import Task, TaskSet, user_turn

__all__ = [
    "DEFAULT_INSTRUCTION",
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
MAX_LINE_BYTES = 1 << 20  # the longest JSONL line read: 1 MiB
RECORD_LIMITS = Limits(max_bytes=MAX_LINE_BYTES)

DEFAULT_INSTRUCTION = (
    "Solve the problem step by step. On the last line, write only the final answer in the form "
    '"#### N", where N is the final number.'
)

# A hub dataset id: "owner/name" with the characters the hub allows.
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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


def _open(path: Path):
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise DataError(f"{path}: file not found; a data directory needs train.jsonl and test.jsonl") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read file ({e.strerror or e})") from None


def _read_line(handle, path: Path, lineno: int) -> bytes:
    """The next line (at most MAX_LINE_BYTES and its newline); a longer one is a DataError, read no further."""
    raw = handle.readline(MAX_LINE_BYTES + 1)
    if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
        raise DataError(
            f"{path} line {lineno}: longer than {MAX_LINE_BYTES >> 20} MiB (a GSM8K record is a few kB); "
            "is this the right file?"
        )
    return raw


def _decode(raw: bytes, where: str, offset: int) -> str:
    try:
        return raw.decode("utf-8-sig" if offset == 0 else "utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {offset + e.start})") from None


def _parse(text: str, split: str, row: int, where: str) -> Task:
    record = parse_jsonl_line(text, where=where, limits=RECORD_LIMITS)
    return _task_from_record(record, split, row, where)


def _records(path: Path, split: str) -> Iterator[tuple[int, Task]]:
    """(byte offset, task) of every record of a JSONL file, one line at a time, checked as it is read. Lines
    split on b"\\n" only (not inside a line on U+2028 and similar); blank lines are skipped and not counted as
    rows. A missing or empty file, a line that is too long, not UTF-8 or not JSON (a truncated last line
    included), a record missing a field, or an answer with no ``####`` gold marker is a DataError naming the
    file and line."""
    with _open(path) as handle:
        offset, row = 0, 0
        for lineno in itertools.count(1):
            raw = _read_line(handle, path, lineno)
            if not raw:
                break
            where = f"{path} line {lineno}"
            text = _decode(raw, where, offset)
            if text.strip():
                yield offset, _parse(text, split, row, where)
                row += 1
            offset += len(raw)
    if row == 0:
        raise DataError(f"{path}: file is empty (no records)")


def read_jsonl_tasks(path: str | os.PathLike[str], split: str) -> list[Task]:
    """Read a GSM8K-style JSONL file: one JSON object per line with ``question`` and ``answer``.

    Blank lines are skipped (row indices count only non-blank lines). A missing or empty file, a line over
    ``MAX_LINE_BYTES``, a line that is not JSON (including a truncated last line), a record missing a field,
    or an answer with no ``####`` gold marker raises DataError naming the file and line.
    """
    return [task for _, task in _records(Path(path), split)]


class _Rows:
    """One local split, read once: the byte offset of every record, and the rows that share no word 8-gram
    with ``banned`` (every row when ``banned`` is None). The tasks drawn are read back by offset."""

    def __init__(self, path: Path, split: str, banned: set[tuple[str, ...]] | None = None) -> None:
        self.path, self.split = path, split
        self.offsets, self.kept = array("q"), array("q")  # [rows] byte offsets; [kept rows] row numbers
        starts = {gram[0] for gram in banned or ()}
        for offset, task in _records(path, split):
            if banned is None or not _shares_ngram(task.question, banned, starts):
                self.kept.append(len(self.offsets))
            self.offsets.append(offset)

    def tasks(self, rows: Iterable[int]) -> list[Task]:
        with _open(self.path) as handle:
            out = []
            for row in rows:
                where, offset = f"{self.path} row {row}", self.offsets[row]
                handle.seek(offset)
                raw = _read_line(handle, self.path, row + 1)
                out.append(_parse(_decode(raw, where, offset), self.split, row, where))
            return out


def _load_local(directory: Path, n_train: int, n_test: int, seed: int) -> TaskSet:
    """The split of a local directory, streamed (see the module's limits): the held-out tasks are drawn from
    test.jsonl first, then train.jsonl is read once, dropping contaminated rows as it goes."""
    if not directory.is_dir():
        raise DataError(f"{directory}: not a directory; --data needs a directory with train.jsonl and test.jsonl")
    label = f"local:{directory.resolve().name}"
    test_rows = _Rows(directory / "test.jsonl", "test")
    _check_test_count(n_test, len(test_rows.offsets), label)
    test = test_rows.tasks(sorted(random.Random(seed).sample(range(len(test_rows.offsets)), n_test)))
    banned: set[tuple[str, ...]] = set().union(*(word_ngrams(t.question) for t in test))
    train_rows = _Rows(directory / "train.jsonl", "train", banned)
    pool, kept = len(train_rows.offsets), len(train_rows.kept)
    _check_train_count(n_train, kept, pool, pool - kept, label)
    drawn = sorted(random.Random(seed + 1).sample(range(kept), n_train))
    train = train_rows.tasks(train_rows.kept[i] for i in drawn)
    counts = {
        "train_pool": pool,
        "test_pool": len(test_rows.offsets),
        "test": len(test),
        "train_contaminated": pool - kept,
        "train_kept": kept,
        "train": len(train),
    }
    return TaskSet(train=train, test=test, counts=counts, source=label, instruction=DEFAULT_INSTRUCTION)


def _load_hub(hub_id: str, *, explicit: bool = False) -> tuple[list[Task], list[Task]]:
    fix = "pass a local directory with --data DIR (train.jsonl and test.jsonl)"
    if explicit:  # the user typed an owner/name that is not a local directory either: say so
        fix = f"no local directory {hub_id!r} exists either; {fix}"
    if importlib.util.find_spec("datasets") is None:  # local first: then the hub
        raise DataError(
            f"loading {hub_id} from the hub needs the 'datasets' package (pip install 'sao[hub]'); or {fix}"
        )
    check_reachable(hub_id, kind="dataset", fix=fix)  # offline or no hub: one line now, not the client's retries
    import datasets

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


# Neither alphanumeric nor whitespace: re's \w is str.isalnum() plus "_", its \s is str.isspace().
_NOT_WORD = re.compile(r"[^\w\s]|_")


def _words(text: str) -> list[str]:
    """Lowercase, replace every character that is neither alphanumeric (str.isalnum) nor whitespace with
    a space, and split on whitespace: "Janet’s $2-eggs" -> ["janet", "s", "2", "eggs"]."""
    return _NOT_WORD.sub(" ", text.lower()).split()


def _shares_ngram(text: str, banned: set[tuple[str, ...]], starts: set[str], n: int = 8) -> bool:
    """Whether ``text`` has a word n-gram in ``banned`` (``word_ngrams(text, n) & banned`` without building the
    set); ``starts`` holds the first word of every banned n-gram, so most positions cost one set lookup."""
    words = _words(text)
    return any(words[i] in starts and tuple(words[i : i + n]) in banned for i in range(len(words) - n + 1))


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
    starts = {gram[0] for gram in banned}
    for task in train:
        (dropped if _shares_ngram(task.question, banned, starts, n) else kept).append(task)
    return kept, dropped


# --- the split -----------------------------------------------------------------------------------------


def _sample(pool: list[Task], k: int, rng: random.Random) -> list[Task]:
    """``k`` tasks drawn without replacement, returned in source order."""
    return [pool[i] for i in sorted(rng.sample(range(len(pool)), k))]


def _check_test_count(n_test: int, pool: int, label: str) -> None:
    if n_test > pool:
        raise DataError(
            f"asked for {n_test} held-out tasks but the test split of {label} has only {pool}; lower --test-prompts"
        )


def _check_train_count(n_train: int, kept: int, pool: int, dropped: int, label: str) -> None:
    if n_train > kept:
        raise DataError(
            f"asked for {n_train} training prompts but only {kept} remain after decontamination "
            f"({pool} in the train split of {label}, {dropped} dropped); lower --train-prompts or --test-prompts"
        )


def load_gsm8k(
    source: str | os.PathLike[str] | None = None, *, n_train: int = 512, n_test: int = 120, seed: int = 0
) -> TaskSet:
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
        return _load_local(Path(where), n_train, n_test, seed)
    train_pool, test_pool = _load_hub(where, explicit=kind == "guess")
    label = f"hub:{where}"
    _check_test_count(n_test, len(test_pool), label)
    test = _sample(test_pool, n_test, random.Random(seed))
    kept, dropped = decontaminate(train_pool, test)
    _check_train_count(n_train, len(kept), len(train_pool), len(dropped), label)
    train = _sample(kept, n_train, random.Random(seed + 1))
    counts = {
        "train_pool": len(train_pool),
        "test_pool": len(test_pool),
        "test": len(test),
        "train_contaminated": len(dropped),
        "train_kept": len(kept),
        "train": len(train),
    }
    return TaskSet(train=train, test=test, counts=counts, source=label, instruction=DEFAULT_INSTRUCTION)


# --- prompts -------------------------------------------------------------------------------------------


def build_messages(question: str, instruction: str = DEFAULT_INSTRUCTION) -> list[dict[str, str]]:
    """Chat messages for one GSM8K task: a single user turn, the question, a blank line, then the instruction."""
    return user_turn(question, instruction)


def format_prompt(tokenizer: Any, question: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The prompt text the model continues: the chat template over :func:`build_messages`, with the assistant
    generation prompt."""
    return format_chat(tokenizer, build_messages(question, instruction))


def format_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The chat template over ``messages``, ending with the assistant generation prompt; a tokenizer without a
    template is a one-line error."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(
            f"tokenizer {name!r} has no chat template; use an instruction-tuned model "
            "(e.g. Qwen/Qwen2.5-1.5B-Instruct) or set tokenizer.chat_template"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
