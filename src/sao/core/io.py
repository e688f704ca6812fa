"""Writing files so that a crash never leaves a half-written one: write beside, fsync, rename.

JSON is written with NaN and ±inf as ``null`` (JSON has no such numbers; a reader should not choke on a
log because one step's explained variance was undefined).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from sao.core.errors import SaoError


class OutputError(SaoError, OSError):
    """A result file could not be written (disk full, read-only folder, ...)."""


def clean(value: Any) -> Any:
    """Recursively turn NaN/inf floats into None, tuples into lists, tensors and numpy scalars into numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, torch.Tensor):
        return clean(value.tolist())
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return clean(value.item())
    return value


def _atomic_write(path: Path, write) -> None:
    """Write to a temporary file beside ``path``, fsync, then rename over it. On any failure the temporary
    file is removed and ``path`` keeps its previous complete content; an OS error (disk full, permission
    denied) becomes an ``OutputError`` with one line a user can act on."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(error, OSError):
            raise OutputError(
                f"could not write {path}: {error.strerror or error}; the files already there are complete — "
                "free space or fix permissions, then rerun with --resume"
            ) from error
        raise


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON (NaN/inf → null)."""
    data = json.dumps(clean(obj), indent=1, allow_nan=False).encode() + b"\n"
    _atomic_write(Path(path), lambda handle: handle.write(data))


def as_json(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples become lists, NaN becomes null): for comparing a
    settings record with the one saved on disk."""
    return json.loads(json.dumps(clean(obj), allow_nan=False))


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def save_torch(path: str | os.PathLike[str], obj: Any) -> None:
    """Atomically ``torch.save`` ``obj``."""
    _atomic_write(Path(path), lambda handle: torch.save(obj, handle))
