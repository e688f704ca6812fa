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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON (NaN/inf → null)."""
    data = json.dumps(clean(obj), indent=1, allow_nan=False).encode() + b"\n"
    _atomic_write(Path(path), lambda handle: handle.write(data))


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def save_torch(path: str | os.PathLike[str], obj: Any) -> None:
    """Atomically ``torch.save`` ``obj``."""
    _atomic_write(Path(path), lambda handle: torch.save(obj, handle))
