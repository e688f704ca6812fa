"""A run folder: claiming it, the checkpoint written after every step, and reading both back.

    OUT/config.json      the settings the run was started with (written once everything has loaded); a
                         folder holding one needs --resume and the same settings, so runs never mix
    OUT/checkpoint.pt    adapters, value head, both optimizers, counters, the source's state, the records
    OUT/train_log.json   the records, readable while the run goes on
    OUT/traces.json      with --traces: the run's totals (used, dropped by reason, staleness histogram, footing)
    OUT/published/       with --traces or --publish: v{N}/ the adapter after N policy updates (the newest 3), and
                         LATEST.json {"version": N, "path": "v{N}"}, replaced atomically once v{N} is complete, for a
                         server to reload

Both per-step files are written atomically (beside, rename), the checkpoint first and fsynced: a run killed
between the two resumes from the checkpoint and rewrites the log, so nothing is lost or counted twice. The
log is not fsynced (a checkpoint's fsync is the durable point of a step; the log is the checkpoint's records
as JSON), so a machine crash can at worst leave a log that ``ensure_log`` and ``read_log`` rebuild from the
checkpoint, exactly.

A damaged folder is a one-line error naming the file and what to do, and nothing in it is overwritten: a
``config.json`` or ``checkpoint.pt`` that cannot be read, a checkpoint missing beside a log that has steps, a
``--resume`` of a folder that is missing, empty or holds no run. The only file ever rewritten is a missing
or damaged ``train_log.json``, and only from the checkpoint's copy of the same records.

Deliberately left out: the adapter export (``sao.model.artifacts``), anything about the step itself, and
repairing a damaged checkpoint (its weights and optimizer state exist nowhere else).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sao.core.errors import ConfigError
from sao.core.io import (
    DamagedFileError,
    as_json,
    check_output_path,
    read_json,
    read_saved_json,
    save_torch,
    write_json,
)

LOG_FILE, CHECKPOINT_FILE, CONFIG_FILE = "train_log.json", "checkpoint.pt", "config.json"
# What a checkpoint holds; one without these keys was not written by this version of sao.
STATE_KEYS = ("next_step", "policy_version", "policy", "source", "value_head", "policy_opt", "critic_opt", "records",
              "warnings")  # fmt: skip


def start_again(out: Path) -> str:
    """The fix for a run folder that cannot be continued: train it again from the first step."""
    return f"this run cannot continue from it: remove {out} to train it again from the start, or use a new --out"


def _contents(out: Path) -> list[Path]:
    """The folder's entries, less the temporary files of a write that was killed (``.<name>.<random>.tmp``)."""
    return [p for p in out.iterdir() if not (p.name.startswith(".") and p.name.endswith(".tmp"))]


def claim(out: Path, record: dict[str, Any], resume: bool) -> None:
    """Refuse to mix runs: a folder with a config.json needs --resume and the same settings; a folder with
    other files is not ours to write into; --resume needs a run to continue. Writes nothing."""
    check_output_path(out, folder=True)
    config_file = out / CONFIG_FILE
    if config_file.exists():
        if not resume:
            raise ConfigError(
                f"output folder {out} already holds a run; pass --resume to continue it or choose another --out"
            )
        fix = "it records the settings the run was started with: restore it, or start again with a new --out"
        if same_settings(read_saved_json(config_file, fix, expect=dict), record):
            return
        raise ConfigError(f"--resume: the run in {out} was started with other settings; use a new --out")
    if resume:
        if (out / CHECKPOINT_FILE).exists() or (out / LOG_FILE).exists():
            raise DamagedFileError(f"{config_file} is missing beside the run's checkpoint and log; restore it, "
                                   "or start again with a new --out")  # fmt: skip
        what = "does not exist" if not out.exists() else "holds no run" if _contents(out) else "is empty"
        raise ConfigError(f"--resume: {out} {what}; check --out, or leave out --resume to start a new run")
    if out.exists() and _contents(out):
        raise ConfigError(f"output folder {out} is not empty and holds no sao run; choose another --out")


# Settings that change how a run is watched, how long it waits for a trace log or whether a malformed trace line
# stops it, not what a step computes: a resume may change them.
NOT_COMPARED_ON_RESUME = ("track", "follow", "follow_timeout", "skip_bad_traces")


def same_settings(saved: Any, record: dict[str, Any]) -> bool:
    """Whether a saved settings record (config.json, experiment.json) is ``record``, watching aside."""

    def comparable(value: Any) -> Any:
        value = as_json(value)
        if isinstance(value, dict) and isinstance(value.get("config"), dict):
            value["config"] = {k: v for k, v in value["config"].items() if k not in NOT_COMPARED_ON_RESUME}
        return value

    return comparable(saved) == comparable(record)


def write_config(out: Path, record: dict[str, Any]) -> None:
    write_json(out / CONFIG_FILE, record)


def save(out: Path, state: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """The checkpoint (fsynced), then the log (rebuilt from the checkpoint if a machine crash damages it)."""
    save_torch(out / CHECKPOINT_FILE, state)
    write_json(out / LOG_FILE, records, durable=False)


PUBLISHED_DIR, LATEST_FILE, KEEP_PUBLISHED = "published", "LATEST.json", 3


def publish(out: Path, version: int, write_adapter: Callable[[Path], Any]) -> Path:
    """Publish the adapter after ``version`` policy updates: ``write_adapter(folder)`` writes OUT/published/v{N}/
    (staged and fsynced, so it appears complete or not at all), then LATEST.json is replaced atomically to point
    at it, then all but the newest ``KEEP_PUBLISHED`` versions are removed. A server that reads LATEST.json and
    then the folder it names always finds a complete adapter (a reader slower than 2 updates may lose it)."""
    root = out / PUBLISHED_DIR
    folder = root / f"v{version}"
    write_adapter(folder)
    write_json(root / LATEST_FILE, {"version": version, "path": folder.name})
    versions = sorted(int(p.name[1:]) for p in root.glob("v*") if p.is_dir() and p.name[1:].isdigit())
    for old in versions[:-KEEP_PUBLISHED]:
        shutil.rmtree(root / f"v{old}", ignore_errors=True)
    return folder


TRACES_FILE = "traces.json"


def write_traces_summary(out: Path, summary: dict[str, Any]) -> None:
    """OUT/traces.json: a trace run's totals (used, dropped by reason, staleness histogram, the footing audit)."""
    write_json(out / TRACES_FILE, summary)


def load(out: Path, fix: str | None = None) -> dict[str, Any] | None:
    """The last checkpoint's state, or None when the run has not completed a step. A checkpoint that cannot be
    read, or is missing beside a log that has steps, is a DamagedFileError ending in ``fix`` (default: train
    the run again)."""
    fix = fix or start_again(out)
    path = out / CHECKPOINT_FILE
    if not path.exists():
        log = out / LOG_FILE
        if log.exists():
            raise DamagedFileError(f"{path} is missing but {log} holds the run's steps; {fix}")
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # torch raises RuntimeError, EOFError, UnpicklingError, ... for a damaged file
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:120]
        raise DamagedFileError(f"{path} is damaged ({reason}); {fix}") from None
    missing = [key for key in STATE_KEYS if key not in state] if isinstance(state, dict) else list(STATE_KEYS)
    if missing:
        raise DamagedFileError(f"{path} is not a sao checkpoint (it has no {missing[0]!r}); {fix}")
    return state


def ensure_log(out: Path, records: list[dict[str, Any]]) -> bool:
    """Make train_log.json hold ``records``: a finished run that is resumed takes no step, so nothing else
    would notice a log that is missing, damaged or different. Returns True when it had to be rewritten."""
    try:
        if read_json(out / LOG_FILE) == as_json(records):
            return False
    except (OSError, ValueError):  # missing, unreadable or not JSON: rewritten below
        pass
    write_json(out / LOG_FILE, records)
    return True


def read_log(out: Path, fix: str) -> list[dict[str, Any]]:
    """A finished run's records as JSON holds them: its train_log.json, or, when that is missing or damaged,
    the checkpoint's copy of the same records, written back to train_log.json. With neither readable it is a
    DamagedFileError ending in ``fix``."""
    try:
        return read_saved_json(out / LOG_FILE, fix, expect=list)
    except DamagedFileError:
        if not (out / CHECKPOINT_FILE).exists():
            raise
    state = load(out, fix)
    assert state is not None  # the checkpoint exists
    write_json(out / LOG_FILE, state["records"])
    return as_json(state["records"])
