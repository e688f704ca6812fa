"""Per-task scores that other tools wrote, read for ``sao compare``: one side (BEFORE, AFTER or the noise runs) as runs.

Two formats, told apart by their first record:

    lm-eval       an lm-evaluation-harness ``samples_<task>_<date>.jsonl`` (``--log_samples``): one line per document
                  and filter (``doc_id``, ``doc_hash``, ``filter``, ``metrics`` naming the per-document metric keys,
                  e.g. ``exact_match``). One file is one run; a folder is every ``samples_*.jsonl`` below it, one run
                  each (one per seed), in path order. The lm-eval task is the file name's middle part.
    table         a CSV (with a header) or JSONL of rows ``run, seed, task, score``: ``run`` names an arm (one per
                  side, chosen with ``--before-run``/``--after-run`` when a file holds several), each ``seed`` of it
                  is one run, ``task`` an item id.

A task here is one item (a document), as in ``sao recipe``'s per-task scores. Refused in one line each, before
anything is written: a metric or filter that must be chosen, a non-finite or missing score, a document twice in a
run, a seed twice (or the same lm-eval file twice), runs of one side that score different tasks, lm-eval files of
another lm-eval task, and a document whose ``doc_hash`` differs between runs.

Deliberately left out: results_*.json aggregates (they hold no per-document scores) and corpus-level metrics
(BLEU and the like have no per-document value).
"""

from __future__ import annotations

import csv
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sao.core.errors import DataError
from sao.core.reading import Limits, iter_jsonl, preview

LINES = Limits(max_bytes=64 << 20, max_depth=32)  # an lm-eval line holds the document, its prompts and replies
TABLE_COLUMNS = ("run", "seed", "task", "score")


@dataclass
class Run:
    """One run of one side: its scores by task id, and where they came from."""

    label: str  # the file (lm-eval) or "run seed S" (table)
    path: str
    sha256: str
    scores: dict[str, float]  # task id → score
    metric: str = "score"  # the metric read (a table's score column)
    filter: str | None = None  # lm-eval's filter the scores are under
    seed: str | None = None  # a table's seed; None for an lm-eval file
    hashes: dict[str, str] = field(default_factory=dict)  # lm-eval: task id → doc_hash

    @property
    def mean(self) -> float:
        return math.fsum(self.scores.values()) / len(self.scores)


@dataclass
class Side:
    """What one argument names: its runs (one per seed) and what they score."""

    role: str  # "BEFORE", "AFTER" or "--noise": how errors name it
    name: str  # how the output names it: the table's run, else the file or folder's name
    path: str
    format: str  # "lm-eval" or "table"
    metric: str
    filter: str | None  # lm-eval's filter (e.g. strict-match); None for a table
    benchmark: str | None  # the lm-eval task (gsm8k); None for a table
    runs: list[Run]

    def tasks(self) -> list[str]:
        """The task ids every run scores, in a stable order (numbers by value)."""
        return sorted(self.runs[0].scores, key=_order)

    def matrix(self, tasks: list[str]) -> list[list[float]]:
        """[runs, tasks]: each run's scores in the order of ``tasks``."""
        return [[run.scores[t] for t in tasks] for run in self.runs]

    def to_dict(self) -> dict[str, Any]:
        runs = [
            {
                "label": r.label,
                "seed": r.seed,
                "path": r.path,
                "sha256": r.sha256,
                "tasks": len(r.scores),
                "mean": r.mean,
            }
            for r in self.runs
        ]
        return {
            "role": self.role,
            "name": self.name,
            "path": self.path,
            "format": self.format,
            "metric": self.metric,
            "filter": self.filter,
            "benchmark": self.benchmark,
            "runs": runs,
        }


def read_side(
    path: str | Path, role: str, *, metric: str | None = None, filter: str | None = None, run: str | None = None
) -> Side:
    """The runs ``path`` holds (a file, or a folder of lm-eval samples files), checked; a one-line ``DataError``
    naming ``role`` and the file otherwise. ``metric``/``filter`` choose among several; ``run``, a table's arm."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("samples_*.jsonl") if p.is_file())
        if not files:
            raise DataError(f"{role} {path}: the folder holds no lm-eval samples_*.jsonl file")
        runs = [_lm_eval_run(f, role, metric, filter, label=str(f.relative_to(path))) for f in files]
        side = _lm_eval_side(path, role, runs)
    elif not path.is_file():
        raise DataError(f"{role} {path}: no such file or folder")
    elif path.suffix.lower() == ".csv":
        side = _table_side(path, role, _csv_rows(path, role), run)
    else:
        first = next((v for _, v in iter_jsonl(path, limits=LINES) if not isinstance(v, DataError)), None)
        if isinstance(first, dict) and "doc_id" in first:
            side = _lm_eval_side(path, role, [_lm_eval_run(path, role, metric, filter)])
        elif isinstance(first, dict) and "score" in first:
            side = _table_side(path, role, _jsonl_rows(path, role), run)
        else:
            raise DataError(
                f"{role} {path}: neither an lm-eval samples file (lines with doc_id, filter, metrics) nor a "
                "table of run, seed, task, score rows"
            )
    _same_tasks(side)
    return side


def check_pair(one: Side, other: Side) -> None:
    """Two sides that can be compared: the same lm-eval task and metric, the same tasks, the same documents."""
    if one.benchmark != other.benchmark:
        raise DataError(
            f"{other.role} {other.path} is of the lm-eval task {other.benchmark!r}, {one.role}'s of "
            f"{one.benchmark!r}: compare runs of one task"
        )
    if (one.format, one.metric, one.filter) != (other.format, other.metric, other.filter):
        raise DataError(
            f"{other.role} scores {other.metric!r} ({other.format}, filter {other.filter}), {one.role} "
            f"{one.metric!r} ({one.format}, filter {one.filter}): compare one metric"
        )
    a, b = set(one.runs[0].scores), set(other.runs[0].scores)
    if a != b:
        only_a, only_b = sorted(a - b, key=_order), sorted(b - a, key=_order)
        raise DataError(
            f"{one.role} and {other.role} score different tasks: {len(only_a)} only in {one.role}"
            f"{_examples(only_a)}, {len(only_b)} only in {other.role}{_examples(only_b)}; compare runs "
            "over the same tasks"
        )
    _same_documents([*one.runs, *other.runs], f"{one.role} and {other.role}")


# ---------------------------------------------------------------------------------------------------------
# lm-eval samples files.


def lm_eval_task(path: Path) -> str | None:
    """The lm-eval task a ``samples_<task>_<date>.jsonl`` file is of (lm-eval's own rule: between the first and the
    last underscore), None for a file not named so."""
    name = path.name
    if not (name.startswith("samples_") and name.endswith(".jsonl")) or name.count("_") < 2:
        return None
    return name[name.find("_") + 1 : name.rfind("_")]


def _lm_eval_run(path: Path, role: str, metric: str | None, chosen: str | None, label: str | None = None) -> Run:
    lines: list[tuple[int, dict[str, Any]]] = []
    for lineno, value in iter_jsonl(path, limits=LINES):
        if isinstance(value, DataError):
            raise DataError(f"{role} {value}")
        if not isinstance(value, dict) or not isinstance(value.get("doc_id"), int) or isinstance(value["doc_id"], bool):
            raise DataError(f"{role} {path}:{lineno}: not an lm-eval sample (a doc_id, filter and metrics per line)")
        lines.append((lineno, value))
    if not lines:
        raise DataError(f"{role} {path}: the file holds no sample")
    filters = sorted({str(v.get("filter")) for _, v in lines})
    if chosen is None and len(filters) > 1:
        raise DataError(f"{role} {path} holds the filters {', '.join(filters)}: choose one with --filter")
    use = chosen if chosen is not None else filters[0]
    if use not in filters:
        raise DataError(f"{role} {path} has no filter {use!r} (it has {', '.join(filters)})")
    kept = [(n, v) for n, v in lines if str(v.get("filter")) == use]
    metrics = sorted({m for _, v in kept for m in (v.get("metrics") or []) if isinstance(m, str)})
    if metric is None and len(metrics) != 1:
        raise DataError(f"{role} {path} holds the metrics {', '.join(metrics) or '(none)'}: choose one with --metric")
    name = metric if metric is not None else metrics[0]
    scores, hashes, where = {}, {}, {}
    for lineno, v in kept:
        doc = str(v["doc_id"])
        if doc in scores:
            raise DataError(
                f"{role} {path}:{lineno}: doc_id {doc} again (line {where[doc]}) under the filter "
                f"{use!r}: a document once per run"
            )
        scores[doc], where[doc] = _score(v.get(name), f"{role} {path}:{lineno}: {name}"), lineno
        if isinstance(v.get("doc_hash"), str):
            hashes[doc] = v["doc_hash"]
    return Run(
        label=label or str(path),
        path=str(path),
        sha256=_sha256(path),
        scores=scores,
        metric=name,
        filter=use,
        hashes=hashes,
    )


def _lm_eval_side(path: Path, role: str, runs: list[Run]) -> Side:
    tasks = {lm_eval_task(Path(r.path)) for r in runs}
    if len(tasks) > 1:
        named = ", ".join(sorted(str(t) for t in tasks))
        raise DataError(f"{role} {path} holds lm-eval files of several tasks ({named}): a side is one task's runs")
    picks = {(r.metric, r.filter) for r in runs}
    if len(picks) > 1:
        raise DataError(
            f"{role} {path}: its files score different metrics or filters {sorted(picks)}: choose with "
            "--metric and --filter"
        )
    seen: dict[str, str] = {}
    for r in runs:
        if r.sha256 in seen:
            raise DataError(
                f"{role}: {r.path} and {seen[r.sha256]} are the same run (identical files): a seed counted twice"
            )
        seen[r.sha256] = r.path
    (metric, chosen), (benchmark,) = picks.pop(), tasks
    return Side(
        role=role,
        name=str(path),
        path=str(path),
        format="lm-eval",
        metric=metric,
        filter=chosen,
        benchmark=benchmark,
        runs=runs,
    )


# ---------------------------------------------------------------------------------------------------------
# Tables: run, seed, task, score.


def _csv_rows(path: Path, role: str) -> list[tuple[str, dict[str, Any]]]:
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            missing = [c for c in TABLE_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise DataError(
                    f"{role} {path}: the header lacks {', '.join(missing)} (columns: run, seed, task, score)"
                )
            return [(f"{path}:{i}", row) for i, row in enumerate(reader, start=2)]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{role} {path}: cannot be read as CSV ({str(e).splitlines()[0][:100]})") from None


def _jsonl_rows(path: Path, role: str) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    for lineno, value in iter_jsonl(path, limits=LINES):
        if isinstance(value, DataError):
            raise DataError(f"{role} {value}")
        if not isinstance(value, dict) or any(c not in value for c in TABLE_COLUMNS):
            raise DataError(f"{role} {path}:{lineno}: a row needs run, seed, task and score")
        rows.append((f"{path}:{lineno}", value))
    return rows


def _table_side(path: Path, role: str, rows: list[tuple[str, dict[str, Any]]], run: str | None) -> Side:
    if not rows:
        raise DataError(f"{role} {path}: the table holds no row")
    names = sorted({str(r["run"]) for _, r in rows})
    flag = "--before-run" if role == "BEFORE" else "--after-run" if role == "AFTER" else "--noise-run"
    if run is None and len(names) > 1:
        raise DataError(
            f"{role} {path} holds the runs {', '.join(names)}: a side is one run (its seeds in the seed "
            f"column); choose it with {flag}"
        )
    name = run if run is not None else names[0]
    if name not in names:
        raise DataError(f"{role} {path} has no run {name!r} (it has {', '.join(names)})")
    by_seed: dict[str, dict[str, float]] = {}
    where: dict[tuple[str, str], str] = {}
    for here, r in rows:
        if str(r["run"]) != name:
            continue
        seed, task = str(r["seed"]).strip(), str(r["task"]).strip()
        if not seed or not task:
            raise DataError(f"{role} {here}: seed and task must not be empty")
        if (seed, task) in where:
            raise DataError(
                f"{role} {here}: seed {seed} scores task {task} again ({where[seed, task]}): a duplicated "
                "seed; each seed once per task"
            )
        where[seed, task] = here
        by_seed.setdefault(seed, {})[task] = _score(r["score"], f"{role} {here}: score")
    digest = _sha256(path)
    runs = [
        Run(label=f"{name} seed {seed}", path=str(path), sha256=digest, scores=scores, seed=seed)
        for seed, scores in sorted(by_seed.items(), key=lambda kv: _order(kv[0]))
    ]
    return Side(
        role=role, name=name, path=str(path), format="table", metric="score", filter=None, benchmark=None, runs=runs
    )


# ---------------------------------------------------------------------------------------------------------
# Shared checks.


def _score(value: Any, where: str) -> float:
    """A score: a finite number (a CSV's text is read as one); a one-line error otherwise."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise DataError(f"{where} is {preview(value)}, not a number") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DataError(f"{where} is {preview(value)}, not a per-task number (a corpus-level metric has none)")
    if not math.isfinite(value):
        raise DataError(f"{where} is {value}: a non-finite score cannot be compared")
    return float(value)


def _same_tasks(side: Side) -> None:
    first = side.runs[0]
    for r in side.runs[1:]:
        if set(r.scores) != set(first.scores):
            a, b = set(first.scores), set(r.scores)
            raise DataError(
                f"{side.role}: {r.label} scores {len(b)} tasks and {first.label} {len(a)}, "
                f"{len(a ^ b)} of them not in both{_examples(sorted(a ^ b, key=_order))}: every run of a "
                "side scores the same tasks"
            )
    _same_documents(side.runs, side.role)


def _same_documents(runs: list[Run], what: str) -> None:
    """lm-eval's doc_hash: a document id must name the same document in every run."""
    first: dict[str, tuple[str, str]] = {}
    for r in runs:
        for doc, digest in r.hashes.items():
            seen = first.setdefault(doc, (digest, r.label))
            if seen[0] != digest:
                raise DataError(
                    f"{what}: doc_id {doc} is another document in {r.label} than in {seen[1]} (doc_hash "
                    "differs): the runs did not read the same data"
                )


def _order(task: str) -> tuple[int, int, str]:
    return (0, int(task), "") if task.lstrip("-").isdigit() else (1, 0, task)


def _examples(ids: list[str]) -> str:
    return f" (e.g. {', '.join(ids[:3])})" if ids else ""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
