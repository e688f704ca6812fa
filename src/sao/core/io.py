"""Writing files so that a crash never leaves a half-written one: write beside, fsync, rename; and reading
back the files sao wrote, so that a damaged one is a one-line error naming it rather than a traceback.

JSON is written with NaN and ±inf as ``null`` (JSON has no such numbers; a reader should not choke on a
log because one step's explained variance was undefined).

A failed write says what to do about its cause: a full disk (free space, then rerun: with ``--resume`` where
the command has one, see ``OutputError.message``) is not a bad path (a file where a folder should be, a
device such as ``/dev/null``, a folder where a file should be, a read-only or virtual file system such as
``/proc``: choose another output path). Only regular files are ever replaced: a target that exists and is a
folder, a device or a pipe is refused before anything is written.

Deliberately left out: deciding what a damaged file means for a run (``sao.training.checkpoint`` and the
experiment runner do: regenerate it when that is exact, otherwise say which file and what to do).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from sao.core.errors import SaoError
from sao.core.reading import read_json_file


class OutputError(SaoError, OSError):
    """A result file could not be written. ``problem`` says which file and why; ``space`` is True when the cause
    is room on the disk (free some and run again) rather than the path (choose another)."""

    def __init__(self, problem: str, *, space: bool = False) -> None:
        self.problem, self.space = problem, space
        super().__init__(self.message(resumable=True))

    def message(self, resumable: bool) -> str:
        """The one line for a user; ``resumable``: the command has ``--resume`` (train, recipe, sweep)."""
        if not self.space:
            return self.problem
        again = "then rerun with --resume" if resumable else "then run the same command again"
        return f"{self.problem}; the files already there are complete — free space, {again}"


class DamagedFileError(SaoError, ValueError):
    """A file sao wrote earlier cannot be read back (truncated, edited by hand, or not sao's)."""


# Errors whose cause is room on the disk: the same command succeeds once there is space.
_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def clean(value: Any) -> Any:
    """Recursively turn NaN/inf floats into None, tuples into lists, tensors and numpy values into numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if hasattr(value, "tolist") and callable(value.tolist):  # a tensor or a numpy array or scalar
        return clean(value.tolist())
    return value


def _kind_of(path: Path) -> str | None:
    """What ``path`` is when it exists and is not a regular file ("a folder", "a device", ...), else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a pipe, socket or other special file"


def _first_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(path.anchor or ".")


def output_problem(path: Path, error: OSError) -> OutputError:
    """The OutputError for ``error`` raised while writing ``path``: what is wrong, and what to do about it."""
    reason = error.strerror or str(error)
    where = f"could not write {path}: {reason}"
    if error.errno in _SPACE_ERRNOS:
        return OutputError(where, space=True)
    if error.errno in (errno.ENOTDIR, errno.EEXIST):  # some folder on the way is a file (or a device)
        blocker = next((p for p in path.parents if os.path.lexists(p) and not os.path.isdir(p)), None)
        if blocker is not None:
            return OutputError(
                f"{where}: {blocker} is {_kind_of(blocker) or 'a file'}, not a folder; choose another output path"
            )
    if error.errno == errno.EISDIR:
        return OutputError(f"{where}: it is a folder; name a file instead")
    if error.errno in (errno.EACCES, errno.EPERM):
        return OutputError(f"{where}; choose an output path you can write to (or change the folder's permissions)")
    if error.errno == errno.EROFS:
        return OutputError(f"{where}; the file system is read-only: choose another output path")
    return OutputError(
        f"{where}; {_first_existing(path.parent)} cannot hold sao's files: choose an output path on "
        "an ordinary, writable disk"
    )


def check_output_path(path: str | os.PathLike[str], *, folder: bool) -> None:
    """Before any work: an OutputError when ``path`` can never be the output folder (``folder``) or file it is
    meant to be, because it, or a folder above it, exists and is something else (a file where a folder should
    be, ``/dev/null``, a folder where a file should be). What only a write can tell (a full disk, a file system
    that refuses files, as ``/proc`` does) is left to the write."""
    path = Path(path)
    above = next((p for p in path.parents if os.path.lexists(p)), None)
    if above is not None and not os.path.isdir(above):
        raise OutputError(
            f"cannot write {path}: {above} is {_kind_of(above) or 'a file'}, not a folder; choose another output path"
        )
    if not os.path.lexists(path):
        return
    kind = _kind_of(path) or "a file"
    if folder and kind != "a folder":
        raise OutputError(f"cannot write into {path}: it is {kind}, not a folder; choose another output folder")
    if not folder and kind != "a file":
        hint = "name a file instead" if kind == "a folder" else "choose an ordinary file as the output"
        raise OutputError(f"cannot write {path}: it is {kind}, not a file; {hint}")


@functools.cache
def _umask() -> int:
    """The process's umask (read once: setting it is the only way to read it, and it is process-wide)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a plain ``open()`` would give a new file: 0o666 less the umask (``mkstemp`` gives 0o600)."""
    return 0o666 & ~_umask()


def folder_mode() -> int:
    """The mode a plain ``mkdir`` would give a new folder: 0o777 less the umask (``mkdtemp`` gives 0o700)."""
    return 0o777 & ~_umask()


def follow_umask(root: str | os.PathLike[str]) -> None:
    """Give ``root`` and everything below it the modes a plain ``open()`` and ``mkdir`` would: files 0o666 and folders
    0o777, less the umask. For what a library wrote with a mode of its own (safetensors writes 0o600, ``mkdtemp``
    0o700); symbolic links are left alone."""
    root = Path(root)
    if root.is_symlink():
        return
    if not root.is_dir():
        os.chmod(root, file_mode())
        return
    for folder, folders, files in os.walk(root):
        os.chmod(folder, folder_mode())
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, file_mode())
        folders[:] = [f for f in folders if not os.path.islink(os.path.join(folder, f))]


def cached_folder(target: Path, build: Callable[[Path], Any], done: str) -> Path:
    """``target``, built once by ``build(scratch)`` into a folder beside it and renamed into place whole, so that a
    crash or a second process building it at the same time never leaves a half-built one; ``done`` names the file
    a finished folder holds. Its modes follow the umask (``mkdtemp`` makes 0o700, safetensors writes 0o600)."""
    if (target / done).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(scratch)
        follow_umask(scratch)
        try:
            os.rename(scratch, target)
        except OSError:  # another process finished first: theirs is as good as ours
            if not (target / done).exists():
                raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_error_of(error: BaseException) -> OSError | None:
    """The operating-system error behind ``error``: itself when it is an ``OSError``, or the one a library written in
    Rust names in its text (safetensors: "I/O error: No space left on device (os error 28)"); None for any other."""
    if isinstance(error, OSError):
        return error
    found = _OS_ERROR.search(str(error))
    if found is None:
        return None
    number = int(found.group(1))
    return OSError(number, os.strerror(number))


def atomic_write(path: str | os.PathLike[str], write: bytes | Callable[[BinaryIO], Any], durable: bool = True) -> None:
    """Write ``write`` (bytes, or a function that writes to a binary handle) to a temporary file beside ``path``,
    with the mode the user's umask gives, fsync (unless not ``durable``), then rename over it. On any
    failure the temporary file is removed and ``path`` keeps its previous complete content; an OS error (disk
    full, a bad path) becomes an ``OutputError`` with one line a user can act on. A ``path`` that exists and
    is not a regular file (a folder, ``/dev/null``, a pipe) is refused: renaming over it would replace it.

    Without the fsync a crash of the process still leaves either file whole (the rename is atomic); only a
    crash of the machine can leave the new name with no data, which is why only files that can be rebuilt
    from a durable one are written that way (the per-step log, from the checkpoint)."""
    path = Path(path)
    kind = _kind_of(path)
    if kind is not None:
        hint = "name a file instead" if kind == "a folder" else "choose an ordinary file as the output"
        raise OutputError(f"could not write {path}: it is {kind}, not a file; {hint}")
    writer = (lambda handle: handle.write(write)) if isinstance(write, bytes | bytearray) else write
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as handle:
            writer(handle)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(error, OSError) and not isinstance(error, OutputError):
            raise output_problem(path, error) from error
        raise


def write_json(path: str | os.PathLike[str], obj: Any, *, durable: bool = True) -> None:
    """Atomically write ``obj`` as indented JSON (NaN/inf → null). ``durable`` False skips the fsync: only for
    a file that can be rebuilt from a durable one (see ``atomic_write``)."""
    data = json.dumps(clean(obj), indent=1, allow_nan=False).encode() + b"\n"
    atomic_write(path, data, durable)


def as_json(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples become lists, NaN becomes null): for comparing a
    settings record with the one saved on disk."""
    return json.loads(json.dumps(clean(obj), allow_nan=False))


def read_json(path: str | os.PathLike[str], *, expect: type | tuple[type, ...] = object) -> Any:
    """A JSON file, read through the bounded reader (``sao.core.reading``): a ``DataError`` naming the file
    when it is missing, too large, too deep, not JSON or not of type ``expect``."""
    return read_json_file(path, expect=expect)


def read_saved_json(path: str | os.PathLike[str], fix: str, expect: type = object) -> Any:
    """A JSON file sao wrote, read back through the bounded reader; missing, unreadable, too large or deep, not
    JSON or not of type ``expect``, it is a ``DamagedFileError``: "<path> is damaged (<why>); <fix>"."""
    if not os.path.lexists(path):
        raise DamagedFileError(f"{path} is missing; {fix}")
    try:
        value = read_json_file(path, where="", error=_Unreadable, expect=object)
    except _Unreadable as error:
        why = str(error).removeprefix(": ")
        if why.startswith("cannot be read") or why.startswith("is a folder"):
            raise DamagedFileError(f"{path} {why}; {fix}") from None
        raise DamagedFileError(f"{path} is damaged ({why}); {fix}") from None
    if not isinstance(value, expect):
        found = {dict: "object", list: "list", str: "string"}.get(type(value), "number, boolean or null")
        raise DamagedFileError(f"{path} is damaged (it holds a JSON {found}, not what sao writes there); {fix}")
    return value


class _Unreadable(SaoError):
    """The bounded reader's problem with a saved file, reworded by ``read_saved_json``."""
