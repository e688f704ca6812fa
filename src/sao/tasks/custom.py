"""Your own tasks: prompts and answers from a JSONL or Parquet file or a Hugging Face dataset, your own
reward function and your own environment class.

``--data`` keeps its GSM8K and ``tiny`` meanings and gains a ``.jsonl``/``.parquet`` file (one pool, split and
decontaminated as GSM8K is) and a hub dataset name (its ``train``/``test`` splits); :func:`source_kind` decides.
``--prompt-field``/``--messages-field`` and ``--answer-field`` pick the fields (a dotted path such as
``reward_model.ground_truth`` reads nested objects, so verl- and SkyRL-style rows read as they are), every record's
raw fields stay on ``Task.fields``, files are streamed, and every problem is a one-line ``DataError`` naming
file, line and field.
``--reward module:function`` and ``--env module:Class`` are loaded by :func:`load_reward` and
:func:`load_env_class` (the current directory is appended to ``sys.path`` only as a last resort).

Deliberately left out: other file formats, other hub configs and splits, deduplication within the training pool,
and building environments or prompts. Design notes: docs/design/custom-tasks.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import itertools
import math
import numbers
import os
import random
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from sao.core.errors import ConfigError, DataError
from sao.core.hub import check_reachable
from sao.core.reading import Limits, parse_jsonl_line, read_bounded_line
from sao.rollout.environment import EnvFactory, check_env
from sao.tasks.base import Task, TaskSet
from sao.tasks.gsm8k import GOLD_MARKER, HUB_ID, decontaminate

__all__ = [
    "DEFAULT_ANSWER_FIELD",
    "DEFAULT_PROMPT_FIELD",
    "FILE_SUFFIXES",
    "load_custom",
    "load_env_class",
    "load_reward",
    "source_kind",
    "uses_custom_loader",
]

DEFAULT_PROMPT_FIELD = "question"
ROW_PROMPT_FIELD = "prompt"  # rows passed in from Python: the prompt's text or its chat messages
DEFAULT_ANSWER_FIELD = "answer"
FILE_SUFFIXES = (".jsonl", ".parquet")
RECORD_LIMITS = Limits(max_bytes=16 << 20)  # one record of --data: a prompt, an answer and its fields

# A hub dataset name: "name" or "owner/name" (no "./", no deeper paths: those are local paths).
_HUB_NAME_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_ENV_METHODS = ("init", "step", "close")


# --- which loader ---------------------------------------------------------------------------------------


def source_kind(data: str | os.PathLike[str] | None) -> str:
    """What ``--data`` names, in this order: ``"tiny"``; ``"gsm8k"`` (the hub's GSM8K: None, ``"hub"``,
    ``"hub:<id>"``, or ``openai/gsm8k`` when no such directory exists); ``"directory"``; ``"file"`` (a name ending
    in ``.jsonl``/``.parquet``, or any existing file, for the loader to check); ``"hub"`` (a dataset name,
    ``name`` or ``owner/name``, that is not a path on disk); else ``"missing"`` (a path that does not exist,
    reported by GSM8K's loader as before)."""
    if data is None:
        return "gsm8k"
    text = os.fspath(data)
    if text == "tiny":
        return "tiny"
    if text in ("", "hub") or text.startswith("hub:"):
        return "gsm8k"
    path = Path(text)
    if path.is_dir():  # an existing directory wins over a hub id spelled the same way, as before
        return "directory"
    if path.suffix.lower() in FILE_SUFFIXES or path.is_file():
        return "file"
    if text == HUB_ID:
        return "gsm8k"
    if _HUB_NAME_RE.match(text):
        return "hub"
    return "missing"


def uses_custom_loader(
    data: str | os.PathLike[str] | None,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    messages_field: str | None = None,
) -> bool:
    """True when :func:`load_custom` reads ``data``: a file, a hub dataset, or a directory with a field option.
    False for today's sources, read as before. A field option for GSM8K from the hub or for "tiny" (whose
    fields are fixed) is a ConfigError rather than silently ignored."""
    kind = source_kind(data)
    options = {"--prompt-field": prompt_field, "--answer-field": answer_field, "--messages-field": messages_field}
    given = [flag for flag, value in options.items() if value is not None]
    if kind in ("file", "hub"):
        return True
    if kind == "directory":
        return bool(given)
    if given and kind in ("gsm8k", "tiny"):
        what = "the generated tiny task" if kind == "tiny" else "GSM8K from the hub"
        raise ConfigError(
            f"{', '.join(given)} apply to --data FILE (.jsonl, .parquet), a directory or a hub dataset name, "
            f"not to {what} (--data {data!r})"
        )
    return False


# --- reading records ------------------------------------------------------------------------------------


class _Table(Protocol):
    """Rows of one source: scanned once for the fields every row needs, then read back for the rows drawn."""

    name: str  # names the source in errors: a file path or "hub:<id> <split>"

    # columns: field name -> the flag that names it; yields (row, where, record) for every row
    def scan(self, columns: dict[str, str]) -> Iterator[tuple[int, str, Any]]: ...

    def fetch(self, rows: list[int]) -> dict[int, Any]: ...


class _JsonlTable:
    """A JSONL file, streamed line by line; the byte offset of every record is kept to read the drawn ones back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = str(path)
        self.offsets: list[int] = []

    def _open(self) -> Any:
        try:
            return self.path.open("rb")
        except FileNotFoundError:
            raise DataError(f"{self.path}: file not found") from None
        except OSError as e:
            raise DataError(f"{self.path}: cannot read file ({e.strerror or e})") from None

    def scan(self, columns: dict[str, str]) -> Iterator[tuple[int, str, Any]]:
        self.offsets = []
        with self._open() as handle:
            offset = 0
            # Binary lines split on b"\n" only, so line numbers agree with GSM8K's reader.
            for lineno in itertools.count(1):
                raw, fits = read_bounded_line(handle, RECORD_LIMITS.max_bytes)
                if not raw:
                    break
                if not fits:
                    raise DataError(
                        f"{self.path} line {lineno}: longer than {RECORD_LIMITS.max_bytes >> 20} MiB "
                        "(is this the right file?)"
                    )
                start, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                where = f"{self.path} line {lineno}"
                record = self._parse(raw, where, first=lineno == 1)
                self.offsets.append(start)
                yield len(self.offsets) - 1, where, record
        if not self.offsets:
            raise DataError(f"{self.path}: file is empty (no records)")

    @staticmethod
    def _parse(raw: bytes, where: str, first: bool = False) -> Any:
        try:
            text = raw.decode("utf-8-sig" if first else "utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        return parse_jsonl_line(text, where=where, limits=RECORD_LIMITS)

    def fetch(self, rows: list[int]) -> dict[int, Any]:
        records = {}
        with self._open() as handle:
            for row in sorted(rows):
                handle.seek(self.offsets[row])
                raw = handle.readline(RECORD_LIMITS.max_bytes + 1)
                records[row] = self._parse(raw, f"{self.path} row {row}", first=self.offsets[row] == 0)
        return records


class _ParquetTable:
    """A Parquet file: the scan reads only the named columns, batch by batch; the drawn rows are read back
    whole, batch by batch, from the row groups that hold them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = str(path)
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs the 'pyarrow' package (pip install pyarrow)") from None
        if not path.is_file():
            raise DataError(f"{path}: file not found")
        try:
            self.file = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
            raise DataError(f"{path}: not a readable Parquet file ({_first_line(e)})") from None

    def scan(self, columns: dict[str, str]) -> Iterator[tuple[int, str, Any]]:
        names = self.file.schema_arrow.names
        for field, flag in columns.items():
            if _column(field, names) not in names:
                raise _missing_column(field, names, str(self.path), flag)
        if self.file.metadata.num_rows == 0:
            raise DataError(f"{self.path}: file is empty (no rows)")
        row = 0
        read = list(dict.fromkeys(_column(field, names) for field in columns))
        for batch in self.file.iter_batches(columns=read, batch_size=1024):
            for record in batch.to_pylist():
                yield row, f"{self.path} row {row}", record
                row += 1

    def fetch(self, rows: list[int]) -> dict[int, Any]:
        wanted = sorted(rows)
        records: dict[int, Any] = {}
        first = 0
        for group in range(self.file.metadata.num_row_groups):
            count = self.file.metadata.row_group(group).num_rows
            if any(first <= row < first + count for row in wanted):  # skip groups with no drawn row
                for batch in self.file.iter_batches(batch_size=1024, row_groups=[group]):
                    inside = [row for row in wanted if first <= row < first + batch.num_rows]
                    if inside:
                        taken = batch.take([row - first for row in inside]).to_pylist()
                        records.update(zip(inside, taken, strict=True))
                    first += batch.num_rows
            else:
                first += count
        return records


class _HubTable:
    """One split of a ``datasets`` DatasetDict (or any sequence of mappings, as the tests' fake gives)."""

    def __init__(self, hub_id: str, split: str, rows: Any) -> None:
        self.name = f"hub:{hub_id} {split}"
        self.rows = rows

    def scan(self, columns: dict[str, str]) -> Iterator[tuple[int, str, Any]]:
        rows = self.rows
        names = getattr(rows, "column_names", None)
        if names is not None:
            for field, flag in columns.items():
                if _column(field, names) not in names:
                    raise _missing_column(field, names, self.name, flag)
            if hasattr(rows, "select_columns"):  # Arrow-backed: decode only the columns the scan needs
                rows = rows.select_columns(list(dict.fromkeys(_column(field, names) for field in columns)))
        count = 0
        for count, record in enumerate(rows, start=1):
            yield count - 1, f"{self.name} row {count - 1}", record
        if count == 0:
            raise DataError(f"{self.name} split is empty")

    def fetch(self, rows: list[int]) -> dict[int, Any]:
        return {row: self.rows[row] for row in sorted(rows)}


# --- one record -> the parts of a Task ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Fields:
    """Which fields hold the prompt and the answer."""

    prompt: str
    answer: str
    messages: str | None

    @property
    def columns(self) -> dict[str, str]:
        """The fields every row needs, each with the flag that names it."""
        prompt = {self.messages: "--messages-field"} if self.messages else {self.prompt: "--prompt-field"}
        return {**prompt, self.answer: "--answer-field"}


def _field_names(prompt_field: str | None, answer_field: str | None, messages_field: str | None) -> _Fields:
    if prompt_field is not None and messages_field is not None:
        raise ConfigError(
            f"--prompt-field {prompt_field!r} and --messages-field {messages_field!r} both name the prompt; give one"
        )
    for flag, value in (("--prompt-field", prompt_field), ("--answer-field", answer_field)):
        if value is not None and not value.strip():
            raise ConfigError(f"{flag} must name a field, got an empty string")
    if messages_field is not None and not messages_field.strip():
        raise ConfigError("--messages-field must name a field, got an empty string")
    return _Fields(
        prompt=prompt_field or DEFAULT_PROMPT_FIELD,
        answer=answer_field or DEFAULT_ANSWER_FIELD,
        messages=messages_field,
    )


def _listing(names: Any, limit: int = 12) -> str:
    names = [str(n) for n in names]
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "") if names else "none"


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"


def _column(name: str, names: Any) -> str:
    """The top-level column a field path reads: the whole name if a column has it, else its first part."""
    return name if name in names else name.split(".", 1)[0]


def _missing_column(field: str, names: Any, source: str, flag: str) -> DataError:
    column = _column(field, names)
    path = f" for {field!r}" if column != field else ""
    return DataError(f"{source}: no column {column!r}{path} (columns: {_listing(names)}); name it with {flag}")


def _get(record: Any, name: str, where: str, flag: str) -> Any:
    """The field ``name`` of ``record``: a key, or a dotted path into nested objects (``reward_model.ground_truth``)
    when no key is spelled with the dots."""
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: expected an object with fields, got {type(record).__name__}")
    if name in record or "." not in name:
        if name not in record:
            raise DataError(f"{where}: no {name!r} field (the record has: {_listing(record)}); name it with {flag}")
        value = record[name]
    else:
        value, parts = record, name.split(".")
        for depth, part in enumerate(parts):
            inside = ".".join(parts[:depth]) or "the record"
            if not isinstance(value, Mapping):
                raise DataError(
                    f"{where}: no {name!r} field ({inside!r} is a {type(value).__name__}, not an object); "
                    f"name it with {flag}"
                )
            if part not in value:
                raise DataError(
                    f"{where}: no {name!r} field ({inside if depth == 0 else repr(inside)} has: "
                    f"{_listing(value)}); name it with {flag}"
                )
            value = value[part]
    if value is None:
        raise DataError(f"{where}: field {name!r} is empty (null)")
    return value


def _text(value: Any, where: str, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: field {name!r} must be a non-empty string, got {_short(value)}")
    return value.strip()


def _answer(value: Any, where: str, name: str) -> str:
    if isinstance(value, str):
        answer = value.strip()
        if name == DEFAULT_ANSWER_FIELD and GOLD_MARKER in answer:  # GSM8K's own answer format
            answer = answer.rsplit(GOLD_MARKER, 1)[1].strip()
            if not answer:
                raise DataError(f"{where}: nothing follows the last {GOLD_MARKER!r} in field {name!r}")
        if not answer:
            raise DataError(f"{where}: field {name!r} (the gold answer) is empty")
        return answer
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not math.isfinite(float(value)):  # pandas' missing value is a NaN: never a gold answer
            raise DataError(
                f"{where}: field {name!r} (the gold answer) is {float(value)} (a missing value?); "
                "give the row its answer or leave it out"
            )
        return str(value)
    raise DataError(
        f"{where}: field {name!r} (the gold answer) must be a string or a number, got {_short(value)}; "
        "a reward that needs more reads the record from task.fields"
    )


def _messages(value: Any, where: str, name: str) -> tuple[list[dict[str, Any]], str]:
    """The messages as plain dicts, and the content of the last user turn."""
    if not isinstance(value, list | tuple) or not value:
        raise DataError(f"{where}: field {name!r} must be a non-empty list of chat messages, got {_short(value)}")
    messages = []
    for i, message in enumerate(value):
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise DataError(
                f"{where}: field {name!r} message {i} must be an object with string 'role' and 'content', "
                f"got {_short(message)}"
            )
        messages.append(dict(message))
    users = [m["content"] for m in messages if m["role"] == "user" and m["content"].strip()]
    if not users:
        raise DataError(f"{where}: field {name!r} has no user message with text")
    return messages, users[-1].strip()


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _scan(table: _Table, fields: _Fields, id_prefix: str) -> list[Task]:
    """Every row of ``table`` as a Task without fields or messages: the prompt text and answer, validated."""
    tasks = []
    for row, where, record in table.scan(fields.columns):
        if fields.messages:
            _, question = _messages(_get(record, fields.messages, where, "--messages-field"), where, fields.messages)
        else:
            question = _text(_get(record, fields.prompt, where, "--prompt-field"), where, fields.prompt)
        answer = _answer(_get(record, fields.answer, where, "--answer-field"), where, fields.answer)
        tasks.append(Task(id=f"{id_prefix}/{row}", question=question, answer=answer))
    return tasks


def _complete(table: _Table, tasks: list[Task], fields: _Fields) -> list[Task]:
    """The drawn tasks with their records read back: ``fields`` (every field of the row) and ``messages``."""
    rows = {task.id: int(task.id.rsplit("/", 1)[1]) for task in tasks}
    records = table.fetch(list(rows.values()))
    complete = []
    for task in tasks:
        record = dict(records[rows[task.id]])
        messages = None
        if fields.messages:
            where = f"{table.name} row {rows[task.id]}"
            messages, _ = _messages(_get(record, fields.messages, where, "--messages-field"), where, fields.messages)
        complete.append(dataclasses.replace(task, fields=record, messages=messages))
    return complete


# --- the split --------------------------------------------------------------------------------------------


def _sample(pool: list[Task], k: int, rng: random.Random) -> list[Task]:
    """``k`` tasks drawn without replacement, in pool order (as GSM8K's draw)."""
    return [pool[i] for i in sorted(rng.sample(range(len(pool)), k))]


def _open_file(path: Path) -> _Table:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _JsonlTable(path)
    if suffix == ".parquet":
        return _ParquetTable(path)
    raise DataError(f"{path}: expected a .jsonl or .parquet file (or a directory with train.jsonl and test.jsonl)")


def _open_hub(hub_id: str) -> tuple[_Table, _Table]:
    fix = f"no local file or directory {hub_id!r} exists either; pass --data FILE (.jsonl, .parquet) or a directory"
    if importlib.util.find_spec("datasets") is None:  # local first: then the hub
        raise DataError(f"loading {hub_id!r} from the hub needs the 'datasets' package (pip install 'sao[hub]'); {fix}")
    check_reachable(hub_id, kind="dataset", fix=fix)  # offline or no hub: one line now, not the client's retries
    import datasets

    try:
        dataset = datasets.load_dataset(hub_id)
    except Exception as e:  # network, missing dataset, auth, config required: all one user-facing line
        raise DataError(f"could not load {hub_id!r} from the Hugging Face hub ({_first_line(e)}); {fix}") from None
    tables = []
    for split in ("train", "test"):
        try:
            rows = dataset[split]
        except (KeyError, TypeError):
            names = list(dataset.keys()) if hasattr(dataset, "keys") else []
            raise DataError(
                f"hub:{hub_id} has no {split!r} split (splits: {_listing(names)}); a hub dataset needs train and test"
            ) from None
        tables.append(_HubTable(hub_id, split, rows))
    return tables[0], tables[1]


def load_custom(
    source: str | os.PathLike[str],
    *,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    messages_field: str | None = None,
    n_train: int = 512,
    n_test: int = 120,
    seed: int = 0,
) -> TaskSet:
    """``n_train`` decontaminated training tasks and ``n_test`` held-out tasks from a ``.jsonl`` or ``.parquet``
    file (one pool), a directory's ``train.jsonl`` and ``test.jsonl``, or a hub dataset's train and test splits.
    The same arguments always give the same split. ``counts`` has GSM8K's keys; for a file ``test_pool`` is
    every record and ``train_pool`` those not held out."""
    if n_train < 0 or n_test < 0:
        raise DataError(f"prompt counts must be non-negative, got n_train={n_train}, n_test={n_test}")
    fields = _field_names(prompt_field, answer_field, messages_field)
    kind = source_kind(source)
    text = os.fspath(source)
    if kind == "file":
        path = Path(text)
        table = _open_file(path)
        pool = _scan(table, fields, path.stem)
        label = f"file:{path.name}"
        if n_test > len(pool):
            raise DataError(
                f"asked for {n_test} held-out tasks but {path} has only {len(pool)} records; lower --test-prompts"
            )
        test = _sample(pool, n_test, random.Random(seed))
        held = {task.id for task in test}
        train_pool = [task for task in pool if task.id not in held]
        train_table = test_table = table
    elif kind in ("directory", "hub"):
        if kind == "directory":
            directory = Path(text)
            train_table, test_table = _JsonlTable(directory / "train.jsonl"), _JsonlTable(directory / "test.jsonl")
            prefix, label = directory.resolve().name, f"local:{directory.resolve().name}"
        else:
            train_table, test_table = _open_hub(text)
            prefix, label = text, f"hub:{text}"
        train_pool = _scan(train_table, fields, f"{prefix}/train")
        test_pool = _scan(test_table, fields, f"{prefix}/test")
        if n_test > len(test_pool):
            raise DataError(
                f"asked for {n_test} held-out tasks but the test split of {label} has only {len(test_pool)}; "
                "lower --test-prompts"
            )
        test = _sample(test_pool, n_test, random.Random(seed))
        pool = test_pool
    elif kind == "missing":
        raise DataError(f"{text}: no such file or directory (and not a hub dataset name)")
    else:  # GSM8K from the hub and "tiny" have their own loaders
        raise DataError(f"--data {text!r} is read by sao.tasks.load_split (GSM8K or tiny), not by load_custom")

    kept, dropped = decontaminate(train_pool, test)
    if n_train > len(kept):
        raise DataError(
            f"asked for {n_train} training prompts but only {len(kept)} remain after decontamination "
            f"({len(train_pool)} in the training pool of {label}, {len(dropped)} dropped); "
            "lower --train-prompts or --test-prompts"
        )
    train = _sample(kept, n_train, random.Random(seed + 1))
    counts = {
        "train_pool": len(train_pool),
        "test_pool": len(pool),
        "test": len(test),
        "train_contaminated": len(dropped),
        "train_kept": len(kept),
        "train": len(train),
    }
    return TaskSet(
        train=_complete(train_table, train, fields),
        test=_complete(test_table, test, fields),
        counts=counts,
        source=label,
    )


# --- rows given as objects ------------------------------------------------------------------------------------


def from_rows(
    dataset: Any,
    *,
    n_train: int,
    n_test: int,
    seed: int,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    messages_field: str | None = None,
) -> TaskSet:
    """A task set from rows given in Python: a list of dicts (every row a training prompt; no held-out tasks), a
    mapping ``{"train": rows, "test": rows}``, or a Hugging Face ``Dataset`` / ``DatasetDict`` of the same. A row is
    a dict with a ``prompt`` (text, or chat messages as a list of ``{"role", "content"}``) and any other fields
    (``answer`` for the default reward); its fields reach the reward and the environment as they are. The fields are
    named as ``--data`` names them: ``prompt_field`` (default ``prompt``), ``messages_field`` (chat messages instead
    of the prompt) and ``answer_field`` (default ``answer``), dotted paths into nested objects allowed. Up to
    ``n_train`` training rows are used (in order; a held-out set is decontaminated against them first), ``n_test``
    held-out ones drawn with ``random.Random(seed)``. The prompt is sent as given: no instruction is added."""
    fields = _field_names(prompt_field, answer_field, messages_field)
    fields = dataclasses.replace(fields, prompt=prompt_field or ROW_PROMPT_FIELD)
    splits = _splits(dataset)
    train = [_row_task(row, f"rows/train/{i}", fields) for i, row in enumerate(splits["train"])]
    test = [_row_task(row, f"rows/test/{i}", fields) for i, row in enumerate(splits.get("test", []))]
    if not train:
        raise DataError("the dataset has no rows to train on")
    test = _sample(test, min(n_test, len(test)), random.Random(seed)) if test else []
    kept, dropped = decontaminate(train, test) if test else (train, [])
    counts = {
        "train_pool": len(train),
        "test_pool": len(splits.get("test", [])),
        "test": len(test),
        "train_contaminated": len(dropped),
        "train_kept": len(kept),
        "train": min(n_train, len(kept)),
    }
    return TaskSet(train=kept[:n_train], test=test, counts=counts, source=f"rows:{len(train)}", instruction="")


def _splits(dataset: Any) -> dict[str, list[Any]]:
    """{"train": rows[, "test": rows]} from a list, a mapping of splits, or a Hugging Face dataset."""
    if hasattr(dataset, "keys") and hasattr(dataset, "__getitem__") and not isinstance(dataset, list):
        keys = set(dataset.keys())
        if "train" in keys:  # a mapping or DatasetDict of splits
            unknown = keys - {"train", "test"}
            if unknown:
                raise ConfigError(f"dataset splits must be 'train' and 'test', got {sorted(keys)}")
            return {k: list(dataset[k]) for k in keys}
        raise ConfigError(f"a dataset mapping needs a 'train' split, got keys {_listing(sorted(map(str, keys)))}")
    if hasattr(dataset, "__iter__") and not isinstance(dataset, str | bytes):
        return {"train": list(dataset)}
    raise ConfigError(
        f"dataset must be a list of dicts, a {{'train', 'test'}} mapping, a Hugging Face dataset or a "
        f"path, got {type(dataset).__name__}"
    )


def _row_task(row: Any, task_id: str, fields: _Fields | None = None) -> Task:
    fields = fields or _Fields(prompt=ROW_PROMPT_FIELD, answer=DEFAULT_ANSWER_FIELD, messages=None)
    where = f"dataset row {task_id.rsplit('/', 2)[1]} {task_id.rsplit('/', 1)[1]}"
    if not isinstance(row, Mapping):
        raise DataError(
            f"{where}: expected a dict with a {fields.messages or fields.prompt!r}, got {type(row).__name__}"
        )
    odd = next((key for key in row if not isinstance(key, str)), None)
    if odd is not None:
        raise DataError(
            f"{where}: a field is named {odd!r:.40} ({type(odd).__name__}), not by a string; a row's "
            "fields are named by strings (they reach the reward, the environment and config.json as "
            "JSON)"
        )
    messages = None
    if fields.messages:
        messages, question = _messages(_get(row, fields.messages, where, "messages_field"), where, fields.messages)
    else:
        if fields.prompt not in row and "." not in fields.prompt:
            raise DataError(_no_prompt(row, where, fields.prompt))
        prompt = _get(row, fields.prompt, where, "prompt_field")
        if isinstance(prompt, str):
            question = _text(prompt, where, fields.prompt)
        else:
            messages, question = _messages(prompt, where, fields.prompt)
    answer = row[fields.answer] if fields.answer in row else _get_or_none(row, fields.answer)  # optional for rows
    answer = "" if answer is None else _answer(answer, where, fields.answer)
    return Task(id=task_id, question=question, answer=answer, fields=dict(row), messages=messages)


def _get_or_none(row: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted path into a row, or None where the path ends (the answer is optional for rows)."""
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _no_prompt(row: Mapping[str, Any], where: str, name: str) -> str:
    """A row without its prompt: what it has, that the prompt's text or its chat messages go under ``name``, and
    the field that would name a list of chat messages the row does hold."""
    chat = next(
        (
            k
            for k, v in row.items()
            if isinstance(k, str)
            and isinstance(v, list | tuple)
            and v
            and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in v)
        ),
        None,
    )
    hint = f"; or name the field that holds them: messages_field={chat!r}" if chat is not None else ""
    return (
        f"{where}: no {name!r} field (the record has: {_listing(row)}); the prompt goes there, as text or as chat "
        f"messages (a list of {{'role', 'content'}}){hint}"
    )


# --- your reward and your environment --------------------------------------------------------------------


def load_reward(spec: str) -> Callable[..., Any]:
    """The reward ``--reward module:function`` names: that function, called as ``function(completion, row)`` with
    ``row`` a dict of the task's fields (or batched, ``function(completions, rows)``); ``sao.tasks.base.Scorer``
    checks what it returns. One that cannot be called that way is a ConfigError now, not a TypeError mid-run."""
    function = _resolve(spec, "--reward", "function")
    _check_call(function, spec, "--reward", ("completion", {"id": "check", "question": "q", "answer": "a"}))
    return function


def skyrl_extras(fields: Mapping[str, Any], max_turns: int) -> dict[str, Any]:
    """What a SkyRL-style environment is built with besides its config: the task's answer as the rule reward's
    ground truth, the turn limit, and the other fields as ``extra_info``."""
    return {
        "reward_spec": {"method": "rule", "ground_truth": fields["answer"]},
        "max_turns": max_turns,
        "extra_info": {k: v for k, v in fields.items() if k != "answer"},
    }


def _is_skyrl_class(factory: Any) -> bool:
    """A class built SkyRL's way, ``Class(env_config, extras)`` (SkyRL-Gym's ``BaseTextEnv``)."""
    try:
        names = list(inspect.signature(factory).parameters)[:2]
    except (TypeError, ValueError):
        return False
    return isinstance(factory, type) and names == ["env_config", "extras"]


def load_env_class(spec: str, max_turns: int = 1) -> EnvFactory:
    """The environment factory ``--env module:Class`` names: ``Class`` itself, called as
    ``Class(task_id, fields)`` for each trajectory, or, for a SkyRL-style class taking ``(env_config, extras)``,
    ``Class({}, skyrl_extras(fields, max_turns))``. A class must have ``init``, ``step`` and ``close``
    (:class:`sao.rollout.environment.TextEnv`); any other callable taking ``(task_id, fields)`` is accepted as a
    factory."""
    factory = _resolve(spec, "--env", "Class")
    if _is_skyrl_class(factory):
        skyrl_class = factory

        def factory(task_id: str, fields: dict[str, Any]) -> Any:
            return skyrl_class({}, skyrl_extras(fields, max_turns))

        factory.__qualname__ = skyrl_class.__qualname__
        return factory
    _check_call(factory, spec, "--env", ("task-id", {}))
    if isinstance(factory, type):
        missing = [name for name in _ENV_METHODS if not callable(getattr(factory, name, None))]
        if missing:
            raise ConfigError(
                f"--env {spec!r}: class {factory.__name__} has no {', '.join(missing)} method"
                f"{'s' if len(missing) > 1 else ''}; an environment needs init, step and close"
            )
        check_env(factory, f"--env {spec!r}:")  # plain and async def methods mixed wrongly: one line, at start
    return factory


def load_plugin(spec: str, flag: str, what: str) -> Any:
    """The callable ``"module:attribute"`` names, for ``flag`` (e.g. ``--hooks``): imported the way ``--reward`` and
    ``--env`` are (the current directory as a last resort), every problem a one-line ConfigError."""
    return _resolve(spec, flag, what)


def _resolve(spec: str, flag: str, what: str) -> Any:
    """The object ``"module:attribute"`` names (the attribute may be dotted: ``module:Class.method``)."""
    if not isinstance(spec, str):
        raise ConfigError(f"{flag} must be a string 'module:{what}', got {spec!r}")
    module_name, colon, attribute = spec.strip().partition(":")
    if not colon or not module_name or not attribute or ":" in attribute:
        raise ConfigError(f"{flag} {spec!r}: expected 'module:{what}', e.g. my_tasks:{what.lower()}")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        raise ConfigError(
            f"{flag} {spec!r}: name the module as you would import it (my_tasks), not its file; "
            "run sao from the folder that holds it"
        )
    module = _import(module_name, spec, flag)
    found: Any = module
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            where = getattr(module, "__file__", None) or module_name
            raise ConfigError(f"{flag} {spec!r}: module {module_name!r} ({where}) has no {attribute!r}") from None
    if not callable(found):
        raise ConfigError(f"{flag} {spec!r}: {attribute!r} is a {type(found).__name__}, not a {what} (not callable)")
    return found


def _import(module_name: str, spec: str, flag: str) -> ModuleType:
    """importlib.import_module, then, only if the module itself was not found, once more with the current
    directory appended to sys.path (removed again if that does not help). A module that raises or calls
    ``sys.exit`` while it is imported is one ConfigError naming it."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if not _is_missing(e, module_name):
            raise _import_failed(e, module_name, spec, flag) from None
    except (Exception, SystemExit) as e:  # a syntax error, or the module raising or exiting while it runs
        raise _import_failed(e, module_name, spec, flag) from None
    cwd = os.getcwd()
    if any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        raise ConfigError(f"{flag} {spec!r}: no module named {module_name!r} (not in {cwd} nor on sys.path)")
    sys.path.append(cwd)
    importlib.invalidate_caches()
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        sys.path.remove(cwd)
        if _is_missing(e, module_name):
            raise ConfigError(
                f"{flag} {spec!r}: no module named {module_name!r} (not in {cwd} nor on sys.path)"
            ) from None
        raise _import_failed(e, module_name, spec, flag) from None
    except (Exception, SystemExit) as e:
        sys.path.remove(cwd)
        raise _import_failed(e, module_name, spec, flag) from None


def import_plugin_module(module_name: str, spec: str, flag: str) -> ModuleType:
    """The module a plug-in spec names, found as ``--reward``/``--env module:Class`` find theirs (the current
    directory as a last resort); every failure one ConfigError naming ``flag`` and ``spec``."""
    return _import(module_name, spec, flag)


def _import_failed(error: BaseException, module_name: str, spec: str, flag: str) -> ConfigError:
    if isinstance(error, SystemExit):
        return ConfigError(
            f"{flag} {spec!r}: importing {module_name!r} called sys.exit({error.code!r}); a plug-in "
            "module must not exit when it is imported"
        )
    return ConfigError(f"{flag} {spec!r}: importing {module_name!r} failed ({_first_line(error)})")


def _is_missing(error: ModuleNotFoundError, module_name: str) -> bool:
    """Whether the error is about ``module_name`` (or a package above it), not about something it imports."""
    return error.name is not None and (module_name == error.name or module_name.startswith(error.name + "."))


def _check_call(target: Any, spec: str, flag: str, arguments: tuple[Any, ...]) -> None:
    """A ConfigError now, rather than a TypeError mid-run, when ``target`` cannot take ``arguments``."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # some builtins and C callables have no signature: trust them
        return
    try:
        signature.bind(*arguments)
    except TypeError as e:
        shape = "(completion, row)" if flag == "--reward" else "(task_id, fields)"
        raise ConfigError(f"{flag} {spec!r}: cannot be called as {shape}: {e}") from None
