"""The trace log ``sao serve`` writes: JSONL, one record a line, every line written whole.

Records are trajectories (id, policy version, temperature, messages, token ids, logprobs, finish reason, and the
graded reward when the request carried task fields) and feedback (a reward posted later). Each is one ``os.write``
on an O_APPEND descriptor, then an fsync (concurrent replies share one), before the client hears about it; a torn
last line (a crash, a short write on a full disk) is cut off on opening and before the next append. The index of
ids is rebuilt on open and bounded (``max_ids``); a feedback for an id it holds is accepted once. An flock on the
log file itself (its device and inode, whatever name reaches it) keeps a second server off it; a FIFO or a device
is refused.

Deliberately left out: rotation, compression, and more than one writer. Design notes: docs/design/tracelog.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import stat
from collections import OrderedDict
from pathlib import Path
from typing import Any

from sao.core.errors import ConfigError
from sao.core.reading import parse_jsonl_line

FEEDBACK = "feedback"
MAX_IDS = 1_000_000  # ~100 MB of index at most; older ids are forgotten (their feedback is then a 404)
UNKNOWN, OPEN, REWARDED = "unknown", "open", "rewarded"


def check_free(path: str | os.PathLike[str]) -> None:
    """Refuse, writing nothing, a log another server holds or one that is not a regular file; a missing log is
    free (``TraceLog`` creates it). ``sao serve`` calls this before loading a model, and opens the log after."""
    path = Path(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as error:
        raise ConfigError(f"cannot open the trace log {path}: {error.strerror or error}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"the trace log {path} is not a regular file; give a file path (it is created if missing)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        raise ConfigError(f"cannot open the trace log {path}: {error.strerror or error}") from None
    try:
        _lock(fd, path)
    finally:
        os.close(fd)  # closing drops the probe's lock


def _lock(fd: int, path: Path) -> None:
    """An exclusive flock on the log's open file: held by its device and inode, so a second server reaching the
    same file by a symlink or a hard link is refused too."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise ConfigError(f"another sao serve is writing the trace log {path} (it holds the file's lock)") from None


class TraceLog:
    """Append-only writer of the trace log, with the bounded index of the ids it holds."""

    def __init__(self, path: str | os.PathLike[str], *, max_ids: int = MAX_IDS):
        self.path = Path(path)
        self.max_ids = max_ids
        self._ids: OrderedDict[str, bool] = OrderedDict()  # id → has a reward
        self.records = self.torn_bytes = self.bad_lines = 0
        self._fd: int | None = None
        check_free(self.path)  # not a FIFO or a device: opening one for writing could block or discard
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o666)
        except OSError as error:
            raise ConfigError(f"cannot open the trace log {self.path}: {error.strerror or error}") from None
        try:
            _lock(self._fd, self.path)
            self._recover()
        except ConfigError:
            self.close()
            raise
        except OSError as error:
            self.close()
            raise ConfigError(f"cannot open the trace log {self.path}: {error.strerror or error}") from None

    def _recover(self) -> None:
        """Cut a torn last line off, then rebuild the id index from the whole lines."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        data_end = 0
        with os.fdopen(os.dup(self._fd), "rb") as file:
            file.seek(0)
            for line in file:
                if not line.endswith(b"\n"):
                    break  # a torn tail: never answered for
                data_end += len(line)
                self._index_line(line)
        self._end = data_end  # where the whole lines end: the next record goes here
        if data_end < size:
            self.torn_bytes = size - data_end
            self._cut_torn_tail()

    def _cut_torn_tail(self) -> None:
        """Cut whatever follows the last whole line (a short write's torn record) so nothing glues onto it."""
        assert self._fd is not None
        os.ftruncate(self._fd, self._end)
        os.fsync(self._fd)

    def _index_line(self, line: bytes) -> None:
        try:
            record = parse_jsonl_line(line, where=str(self.path))  # bounded: depth, size, long integers
            if not isinstance(record, dict) or not isinstance(record.get("id"), str):
                raise ValueError
        except ValueError:  # DataError included
            self.bad_lines += 1
            return
        if record.get("type") == FEEDBACK:
            if record["id"] in self._ids:
                self._ids[record["id"]] = True
        else:
            self.records += 1
            self._remember(record["id"], "reward" in record)

    def _remember(self, id_: str, rewarded: bool) -> None:
        self._ids[id_] = rewarded
        self._ids.move_to_end(id_)
        while len(self._ids) > self.max_ids:
            self._ids.popitem(last=False)

    def status(self, id_: str) -> str:
        """UNKNOWN (not in this log, or forgotten), OPEN (no reward yet) or REWARDED."""
        if id_ not in self._ids:
            return UNKNOWN
        return REWARDED if self._ids[id_] else OPEN

    def _append(self, record: dict[str, Any], sync: bool = True) -> None:
        """One record as one write, fsynced (``sync`` False: the caller calls ``sync`` once its lock is let go); a
        write that fails or falls short (a full disk) is cut off again, and so is anything found past the last whole
        line before the next, so a torn record never joins one."""
        if self._fd is None:
            raise OSError(f"the trace log {self.path} is closed")
        line = (json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n").encode()
        if os.fstat(self._fd).st_size != self._end:
            self.torn_bytes += max(0, os.fstat(self._fd).st_size - self._end)
            self._cut_torn_tail()
        try:
            written = os.write(self._fd, line)
            if written != len(line):  # a regular file takes the whole write or fails; a short one is a full disk
                raise OSError(errno.ENOSPC, f"short write to {self.path} ({written} of {len(line)} bytes)")
            if sync:
                os.fsync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                self._cut_torn_tail()
            raise
        self._end += len(line)

    def sync(self) -> None:
        """Make every record written so far durable. Called outside the writers' lock, so that concurrent replies
        share the disk's flushes (one fsync covers every write before it) instead of taking one each in turn."""
        fd = self._fd
        if fd is None:
            raise OSError(f"the trace log {self.path} is closed")
        os.fsync(fd)

    def append_trajectory(self, record: dict[str, Any], sync: bool = True) -> None:
        """Write one trajectory record (the caller's lock makes id registration and the write one step); ``sync``
        False leaves the fsync to ``sync()`` after the lock."""
        if record["id"] in self._ids:
            raise ValueError(f"id {record['id']} is already in {self.path}")
        self._append(record, sync)
        self.records += 1
        self._remember(record["id"], "reward" in record)

    def append_feedback(self, id_: str, reward: float) -> None:
        if not math.isfinite(reward):
            raise ValueError("reward must be finite")
        self._append({"type": FEEDBACK, "id": id_, "reward": reward})
        self._ids[id_] = True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # and the lock with it
            self._fd = None


__all__ = ["FEEDBACK", "OPEN", "REWARDED", "UNKNOWN", "TraceLog", "check_free"]
