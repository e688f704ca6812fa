"""The trace log ``sao serve`` writes: JSONL, one record a line, every line written whole.

Records are trajectories (id, policy version, temperature, messages, token ids, logprobs, finish reason, and the
graded reward when the request carried task fields) and feedback (a reward posted later). Each is one ``os.write``
on an O_APPEND descriptor, then an fsync, before the client hears about it; opening again cuts a torn last line
off. The index of ids is rebuilt on open and bounded (``max_ids``); a feedback for an id it holds is accepted once.
A lock file (``LOG.lock``) keeps a second server off the same log.

Deliberately left out: rotation, compression, and more than one writer. Design notes: docs/design/tracelog.md.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

from sao.core.errors import ConfigError
from sao.core.reading import parse_jsonl_line

FEEDBACK = "feedback"
MAX_IDS = 1_000_000  # ~100 MB of index at most; older ids are forgotten (their feedback is then a 404)
UNKNOWN, OPEN, REWARDED = "unknown", "open", "rewarded"


class TraceLog:
    """Append-only writer of the trace log, with the bounded index of the ids it holds."""

    def __init__(self, path: str | os.PathLike[str], *, max_ids: int = MAX_IDS):
        self.path = Path(path)
        self.max_ids = max_ids
        self._ids: OrderedDict[str, bool] = OrderedDict()  # id → has a reward
        self.records = self.torn_bytes = self.bad_lines = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise ConfigError(f"cannot open the trace log {self.path}: {error.strerror or error}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ConfigError(f"another sao serve is writing {self.path} (it holds {self.path}.lock)") from None
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            self._recover()
        except OSError as error:
            self.close()
            raise ConfigError(f"cannot open the trace log {self.path}: {error.strerror or error}") from None

    def _recover(self) -> None:
        """Cut a torn last line off, then rebuild the id index from the whole lines."""
        size = os.fstat(self._fd).st_size
        with open(self.path, "rb") as file:
            data_end = 0
            for line in file:
                if not line.endswith(b"\n"):
                    break  # a torn tail: never answered for
                data_end += len(line)
                self._index_line(line)
        if data_end < size:
            self.torn_bytes = size - data_end
            os.ftruncate(self._fd, data_end)
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

    def _append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n").encode()
        written = os.write(self._fd, line)
        if written != len(line):  # a regular file takes the whole write or fails; a short one is a full disk
            raise OSError(f"short write to {self.path} ({written} of {len(line)} bytes)")
        os.fsync(self._fd)

    def append_trajectory(self, record: dict[str, Any]) -> None:
        """Write one trajectory record (the caller's lock makes id registration and the write one step)."""
        if record["id"] in self._ids:
            raise ValueError(f"id {record['id']} is already in {self.path}")
        self._append(record)
        self.records += 1
        self._remember(record["id"], "reward" in record)

    def append_feedback(self, id_: str, reward: float) -> None:
        if not math.isfinite(reward):
            raise ValueError("reward must be finite")
        self._append({"type": FEEDBACK, "id": id_, "reward": reward})
        self._ids[id_] = True

    def close(self) -> None:
        for name in ("_fd", "_lock_fd"):
            fd = getattr(self, name, None)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)


__all__ = ["FEEDBACK", "OPEN", "REWARDED", "UNKNOWN", "TraceLog"]
