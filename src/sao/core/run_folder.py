"""A run's output folder, claimed by the one process that writes it: refused when another run holds it, when it
holds another run (a resume needs the same settings) or files that are not a run's; locked while the run writes;
put back as it was found when a new run fails before its first checkpoint.

    claim             the checks and the lock, in one look at the folder (a ``Claim`` can undo a fresh one)
    settings_differ   a saved settings record against today's, in words (``--lr 0.001 then, 0.003 now``)
    CONFIG_FILE ...   the names in a run folder that say a run is there

The training layer's ``checkpoint.RunDir`` opens a run with it; an experiment claims its folder the same way.
Deliberately left out: what a run writes into the folder (``sao.training.checkpoint``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sao.core.config import Config, flatten, recorded
from sao.core.errors import ConfigError
from sao.core.io import DamagedFileError, as_json, check_output_path, output_problem, read_saved_json

LOG_FILE, CONFIG_FILE, CHECKPOINTS_DIR = "train_log.jsonl", "config.json", "checkpoints"
LEGACY_CHECKPOINT, LEGACY_LOG = "checkpoint.pt", "train_log.json"  # folders written by sao 0.1 before sections


def contents(out: Path) -> list[Path]:
    """The folder's entries, less the temporary files of a write that was killed (``.<name>.<random>.tmp``)."""
    return [p for p in out.iterdir() if not (p.name.startswith(".") and p.name.endswith((".tmp", ".partial")))]


def has_steps(out: Path) -> bool:
    return (out / CHECKPOINTS_DIR).is_dir() or (out / LEGACY_CHECKPOINT).exists()


class FolderLock:
    """An exclusive lock on a run folder while a run holds it: ``flock`` on the folder itself, so nothing is written
    for it, and the lock ends with the process however the process ends (a killed run leaves no stale lock). A
    second process asking for it is refused at once (``acquire``)."""

    def __init__(self, out: Path):
        self.out, self._fd = out, None

    def acquire(self) -> FolderLock:
        import fcntl

        fd = os.open(self.out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"output folder {self.out} is in use by another sao run right now; wait for it to end "
                "(then --resume continues it), or choose another --out"
            ) from None
        except OSError:  # a file system without locks (some network mounts): the run goes on unlocked
            os.close(fd)
            return self
        self._fd = fd
        return self

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor ends the flock

    def __del__(self) -> None:
        self.release()


@dataclass
class Claim:
    """A claimed run folder. ``fresh``: a new run in a folder that was absent (``created``) or empty, so that a
    run failing before its first checkpoint can be ``undone``: nothing it wrote there was worth keeping, and the
    corrected command must find the folder as the first one did. ``lock``: held while the run may write there
    (``release``); ``made``: the folders created to hold it (``out`` and any missing parent), removed by ``undo``."""

    out: Path
    fresh: bool = False
    created: bool = False
    lock: FolderLock | None = None
    made: tuple[Path, ...] = ()

    def undo(self) -> bool:
        """Put a fresh folder back as it was found, unless a checkpoint is already in it; whether it did. The lock
        ends either way."""
        try:
            if not self.fresh or has_steps(self.out) or not self.out.is_dir():
                return False
            for entry in self.out.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        entry.unlink()
            if self.created:
                for folder in self.made or (self.out,):  # out first, then the parents made for it
                    with contextlib.suppress(OSError):
                        folder.rmdir()
            return True
        finally:
            self.release()

    def release(self) -> None:
        """End the lock (the run is over; another may take the folder)."""
        if self.lock is not None:
            self.lock.release()


def claim(out: Path, record: dict[str, Any], resume: bool, *, lock: bool = False) -> Claim:
    """Refuse to mix runs: a folder with a config.json needs --resume and the same settings; a folder with
    other files is not ours to write into; --resume needs a run to continue. With ``lock`` (the process that writes
    the run), the folder is locked first, so a second run on it at the same time is refused (a new run's folder is
    created for that, and removed again by ``Claim.undo``); nothing else is written. The ``Claim`` can undo what a
    new run writes later."""
    check_output_path(out, folder=True)
    made: tuple[Path, ...] = ()
    if lock and not resume and not out.is_dir():  # a new run's folder: made now, so that it is locked before use
        made = tuple(p for p in (out, *out.parents) if not os.path.lexists(p))
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise output_problem(out, error) from None
    held = None
    try:
        held = FolderLock(out).acquire() if lock and out.is_dir() else None
        found = _claim(out, record, resume)  # with the lock held: what is there now, whoever made it
    except BaseException:
        if held is not None:
            held.release()
        for folder in made:  # out first, then the parents made for it
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    found.lock, found.made, found.created = held, made, found.created or bool(made)
    return found


def _claim(out: Path, record: dict[str, Any], resume: bool) -> Claim:
    config_file = out / CONFIG_FILE
    if config_file.exists():
        if not resume:
            raise ConfigError(
                f"output folder {out} already holds a run; pass --resume to continue it or choose another --out"
            )
        fix = "it records the settings the run was started with: restore it, or start again with a new --out"
        differ = settings_differ(read_saved_json(config_file, fix, expect=dict), record)
        if differ is None:
            return Claim(out)
        raise ConfigError(
            f"--resume: the run in {out} was started with other settings ({differ}); give the same "
            "settings, or use a new --out"
        )
    if resume:
        if has_steps(out) or (out / LOG_FILE).exists() or (out / LEGACY_LOG).exists():
            raise DamagedFileError(
                f"{config_file} is missing beside the run's checkpoint and log; restore it, "
                "or start again with a new --out"
            )
        what = "does not exist" if not out.exists() else "holds no run" if contents(out) else "is empty"
        raise ConfigError(f"--resume: {out} {what}; check --out, or leave out --resume to start a new run")
    if out.exists() and contents(out):
        raise ConfigError(f"output folder {out} is not empty and holds no sao run; choose another --out")
    return Claim(out, fresh=True, created=not out.exists())


# Settings that change how a run is watched, how long it waits for a trace log or whether a malformed trace line
# stops it, not what a step computes: a resume may change them.
NOT_COMPARED_ON_RESUME = (
    "track",
    "follow",
    "follow_timeout",
    "skip_bad_traces",
    "log_every",
    "timeline_steps",
    "otel_endpoint",
)
# Parts of the run record a resume may change: the number of training processes (a step is the single-process step
# on the whole batch whatever the count; a sharded checkpoint is read back on any count), the hooks passed in (they
# watch the step, as --track does; a hook's state is restored only where the hook is passed again) and whether the
# run can be replayed, which follows from the rest.
RECORD_NOT_COMPARED_ON_RESUME = ("world_size", "replayable", "not_replayable")
PASSED_NOT_COMPARED_ON_RESUME = ("hooks",)


def _comparable(value: Any) -> Any:
    """A settings record as resumes compare it: its settings as today's flat names, watching aside."""
    value = as_json(value)
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if k not in RECORD_NOT_COMPARED_ON_RESUME}
        if isinstance(value.get("passed"), dict):
            value["passed"] = {k: v for k, v in value["passed"].items() if k not in PASSED_NOT_COMPARED_ON_RESUME}
            if not value["passed"]:
                del value["passed"]
    if isinstance(value, dict) and isinstance(value.get("config"), dict):
        with contextlib.suppress(ConfigError):
            value["config"] = Config.load(**recorded(flatten(value["config"]))).flat()
        value["config"] = as_json({k: v for k, v in value["config"].items() if k not in NOT_COMPARED_ON_RESUME})
    return value


def settings_differ(saved: Any, record: dict[str, Any], limit: int = 6) -> str | None:
    """None when a saved settings record (config.json, experiment.json) is ``record``, watching aside (settings
    compared as today's sections, so a folder an earlier sao version wrote, flat, still resumes); else what differs,
    in words: each setting as its flag with the value it was started with and the one given now (``--lr 0.001 then,
    0.003 now``), then any other part of the record (the data, what was passed); at most ``limit`` named, the rest
    counted."""
    before, now = _comparable(saved), _comparable(record)
    if before == now:
        return None
    if not (isinstance(before, dict) and isinstance(now, dict)):
        return "the record is not a mapping"
    parts = []
    old, new = before.get("config"), now.get("config")
    if isinstance(old, dict) and isinstance(new, dict):
        for name in sorted(set(old) | set(new), key=lambda n: (n not in new, n)):
            if old.get(name, "(absent)") != new.get(name, "(absent)"):
                shown = [
                    json.dumps(v)[:40] if v != "(absent)" else v
                    for v in (old.get(name, "(absent)"), new.get(name, "(absent)"))
                ]
                parts.append(f"--{name.replace('_', '-')} {shown[0]} then, {shown[1]} now")
    for key in sorted(set(before) | set(now)):
        if key != "config" and before.get(key) != now.get(key):
            parts.append(f"its {key}")
    more = f" and {len(parts) - limit} more" if len(parts) > limit else ""
    return "; ".join(parts[:limit]) + more if parts else "nothing that can be named"
