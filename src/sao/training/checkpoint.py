"""A run folder opened once (``RunDir``: claimed by ``sao.core.run_folder``, its checkpoint read), checkpoints, the
step log, and reading them back.

    OUT/config.json          the settings the run started with; a folder holding one needs --resume, same settings
    OUT/checkpoints/step-N/  tensors.safetensors + state.json, the newest K kept, no pickle; with --shard fsdp also
                             sharded/: each process's shards of the models and optimizer states, written and read by
                             torch.distributed.checkpoint as safetensors, read back on any number of processes
    OUT/train_log.jsonl      one record per step, appended; on --resume made to hold exactly the checkpoint's records

A checkpoint appears whole or not at all (written into a hidden folder, fsynced, renamed). A damaged folder is a
one-line error naming the file and what to do. Deliberately left out: the adapter export (``sao.model.artifacts``),
the claim's checks and lock (``sao.core.run_folder``) and repairing a damaged checkpoint.
Design notes: docs/design/checkpoint.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sao.core.config import Config
from sao.core.errors import DataError
from sao.core.io import (
    DamagedFileError,
    OutputError,
    as_json,
    atomic_write,
    clean,
    folder_mode,
    follow_umask,
    os_error_of,
    output_problem,
    read_json,
    read_saved_json,
    write_json,
)
from sao.core.reading import iter_jsonl, read_json_file
from sao.core.run_folder import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LEGACY_CHECKPOINT,
    LEGACY_LOG,
    LOG_FILE,
    Claim,
    claim,
    has_steps,
)
from sao.training.distributed import World

SHARDED_DIR = "sharded"  # a checkpoint's torch.distributed.checkpoint part (--shard fsdp)
TENSORS_FILE, STATE_FILE = "tensors.safetensors", "state.json"
# What a checkpoint holds; one without these keys was not written by sao.
STATE_KEYS = (
    "next_step",
    "policy_version",
    "policy",
    "source",
    "value_head",
    "policy_opt",
    "critic_opt",
    "records",
    "warnings",
)


def start_again(out: Path) -> str:
    """The fix for a run folder that cannot be continued: train it again from the first step."""
    return f"this run cannot continue from it: remove {out} to train it again from the start, or use a new --out"


@dataclass
class RunDir:
    """A run folder, opened once: claimed for ``record`` (``claim``: another run's folder, or one holding other
    files, is refused; ``--resume`` needs the same settings) and, on ``--resume``, its newest checkpoint read into
    ``state`` (a damaged one fails here, before a model is loaded). Opening writes nothing; the trainer writes
    config.json when it starts, and ``undo`` puts a new run's folder back as it was found."""

    out: Path
    record: dict[str, Any]
    claim: Claim
    state: dict[str, Any] | None = None  # the checkpoint to resume from; None: a new run (or none completed yet)

    @classmethod
    def open(
        cls, out: str | os.PathLike[str], record: dict[str, Any], *, resume: bool = False, lock: bool = True
    ) -> RunDir:
        """``lock``: the process that writes the run (rank 0 of a torchrun group) holds the folder's lock."""
        out = Path(out)
        claimed = claim(out, record, resume, lock=lock)
        try:
            return cls(out, record, claimed, load(out) if resume else None)
        except BaseException:
            claimed.release()
            raise

    def undo(self) -> bool:
        return self.claim.undo()

    def release(self) -> None:
        """End the folder's lock: the run is over (``Trainer.run`` ends it)."""
        self.claim.release()


def import_path(obj: Any) -> str | None:
    """``"module:qualname"`` when importing that gives back ``obj`` (so a replay can), else None."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not name or module == "__main__" or "<" in name:
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{name}" if found is obj else None


def rebuilt_by_name(cls: type) -> bool:
    """Whether ``Class()`` by its import path gives back an equal object: importable, its constructor taking no
    argument at all (one with defaults may have been given others)."""
    import inspect

    if import_path(cls) is None:
        return False
    try:
        return not inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


def run_record(config: Config, tasks: Any, world_size: int = 1, **parts: Any) -> dict[str, Any]:
    """What config.json records: the settings, the task set's counts, and each part passed in as an object — by
    import path when it has one; otherwise ``replayable`` is false and ``not_replayable`` says why, in words."""
    record: dict[str, Any] = {
        "config": config.to_dict(),
        "data": tasks.counts,
        "source": tasks.source,
        "world_size": world_size,
    }

    def rows() -> str:
        encoded = json.dumps([t.fields for t in tasks.train], sort_keys=True, default=str).encode()
        return f"{len(tasks.train)} rows passed in (sha256 {hashlib.sha256(encoded).hexdigest()[:16]})"

    return {**record, **passed_parts(rows, **parts)}


def passed_parts(rows: Callable[[], str], **parts: Any) -> dict[str, Any]:
    """What a record says of the parts passed in as objects: ``passed`` (each by import path, or path, when it has
    one; a dataset of rows as ``rows()`` describes it) and ``replayable`` (with ``not_replayable``, in words, when
    false); {} when nothing was passed. ``settings_of`` in ``sao.core.config`` reads it back for a replay."""
    passed, reasons = {}, []
    for name, obj in parts.items():
        if obj is None:
            continue
        if name == "hooks":
            hooks = [hook for hook in obj if getattr(hook, "recorded", True)]
            for hook in hooks:
                if not rebuilt_by_name(type(hook)):
                    reasons.append(
                        f"hook {type(hook).__qualname__} cannot be rebuilt by name (its class is not "
                        "importable, or its constructor takes arguments)"
                    )
            if hooks:
                passed[name] = ",".join(import_path(type(hook)) or type(hook).__qualname__ for hook in hooks)
        elif name == "dataset" and isinstance(obj, str | Path):
            local = os.path.expanduser(str(obj))  # a path as typed names another file read from elsewhere
            passed[name] = os.path.abspath(local) if os.path.exists(local) else str(obj)
        elif name == "dataset":
            passed[name] = rows()
            reasons.append("the dataset was passed as rows, not as a path")
        elif name == "source":  # an object built by the caller: its class says what it was, not how it was made
            passed[name] = import_path(type(obj)) or type(obj).__name__
            reasons.append(f"the source was passed as an object ({passed[name]}), not named by --rollout")
        else:
            passed[name] = import_path(obj) or repr(obj)[:80]
            if import_path(obj) is None:
                reasons.append(f"{name} {passed[name]} cannot be imported by name (defined in a script or a function)")
    if not passed:
        return {}
    return {"passed": passed, "replayable": not reasons, **({"not_replayable": reasons} if reasons else {})}


def write_config(out: Path, record: dict[str, Any]) -> None:
    write_json(out / CONFIG_FILE, record)


# --- checkpoints: safetensors for the tensors, JSON for the rest ------------------------------------------------


def _encode(value: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    """``value`` as JSON, its tensors moved into ``tensors`` under their path; what JSON cannot hold exactly
    (tuples, non-string keys, NaN) is tagged so that ``_decode`` gives back the same value."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().cpu().contiguous().clone()
        return {"__tensor__": path}
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, tensors, f"{path}.{k}") for k, v in value.items()}
        return {
            "__items__": [
                [_encode(k, tensors, f"{path}.k{i}"), _encode(v, tensors, f"{path}.{i}")]
                for i, (k, v) in enumerate(value.items())
            ]
        }
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"a checkpoint cannot hold {type(value).__name__} at {path}")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__float__" in value:
        return float(value["__float__"])
    if "__tuple__" in value:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    if "__items__" in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__items__"]}
    return {k: _decode(v, tensors) for k, v in value.items()}


def _step_folders(out: Path) -> list[Path]:
    root = out / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")), key=lambda p: p.name)


def save(out: Path, state: dict[str, Any], records: list[dict[str, Any]], keep: int = 1) -> Path:
    """OUT/checkpoints/step-N/ (N = ``state["next_step"]``), whole or not at all; then the newest ``keep`` are kept.
    ``records`` are the log's (saved with the state, so a damaged log can be rebuilt exactly)."""
    step = int(state["next_step"])
    root = out / CHECKPOINTS_DIR
    staging, final = root / f".step-{step:06d}.partial", root / f"step-{step:06d}"
    try:
        _stage(out, step)
        return _finish(out, staging, final, state, records, keep)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)  # no half-written checkpoint left: the previous one stands
        inner = error.__cause__ if isinstance(error, OutputError) else error
        cause = None if inner is None else os_error_of(inner)
        if cause is not None:  # a full disk, from Python or from safetensors' own writer: one line
            raise output_problem(final, cause) from None
        raise


def _stage(out: Path, step: int) -> tuple[Path, Path]:
    """A fresh hidden staging folder for step ``step``'s checkpoint, and the folder it becomes."""
    root = out / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    staging = root / f".{final.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(mode=folder_mode())
    return staging, final


def _finish(
    out: Path, staging: Path, final: Path, state: dict[str, Any], records: list[dict[str, Any]], keep: int
) -> Path:
    """Write the state into ``staging``, flush everything in it to disk, rename it to ``final``, prune."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode({**state, "records": records}, tensors, "state")
    save_file(tensors, str(staging / TENSORS_FILE))
    atomic_write(staging / STATE_FILE, json.dumps(encoded).encode())
    follow_umask(staging)  # safetensors writes 0o600; every file sao writes follows the umask
    for folder, _, files in os.walk(staging, topdown=False):  # the tensors' data, then the folders' entries
        written = [Path(folder) / name for name in files if Path(folder) / name != staging / STATE_FILE]
        for synced in [*written, Path(folder)]:  # (the state was flushed as it was written)
            fd = os.open(synced, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    for old in _step_folders(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        (out / LEGACY_CHECKPOINT).unlink()  # superseded once a folder checkpoint exists
    return final


def save_sharded(
    out: Path,
    state: dict[str, Any],
    records: list[dict[str, Any]],
    shards: dict[str, torch.Tensor],
    world: World,
    keep: int = 1,
) -> None:
    """``save`` for a sharded run (``--shard fsdp``), called by every process: ``shards`` (each process's tensors,
    DTensor shards or whole tensors, by name) go to step-N/sharded/ through torch.distributed.checkpoint as
    safetensors, each process writing its own; rank 0 writes the rest and renames the folder once every process's
    part is in it. A failure anywhere (a full disk) leaves the previous checkpoint as it was and raises the same
    ``OutputError`` on every process."""
    import torch.distributed.checkpoint as dcp

    step, problem, space = int(state["next_step"]), None, False
    root = out / CHECKPOINTS_DIR
    staging, final = root / f".step-{step:06d}.partial", root / f"step-{step:06d}"
    if world.is_main:
        try:
            _stage(out, step)
        except OSError as error:
            problem, space = f"could not create {staging}: {error.strerror or error}", _is_space(error)
    problem, space = world.broadcast((problem, space))
    if problem is None:
        try:
            writer = dcp.HuggingFaceStorageWriter(str(staging / SHARDED_DIR), save_distributed=True)
            with _one_process_is_intended():
                dcp.save(shards, storage_writer=writer, no_dist=world.size == 1)
        except Exception as error:  # a CheckpointException on every process when any one of them failed
            problem, space = f"could not write {staging / SHARDED_DIR}: {_reason(error)}", _is_space(error)
        found = [(p, s) for p, s in world.all_gather_objects((problem, space)) if p is not None]  # any rank's, first
        problem, space = found[0] if found else (None, False)
    if problem is None and world.is_main:
        try:
            _finish(out, staging, final, state, records, keep)
        except Exception as error:  # a full disk, from Python or from safetensors' own writer
            cause = os_error_of(error.__cause__ if isinstance(error, OutputError) and error.__cause__ else error)
            if cause is None:
                raise
            problem, space = f"could not write {staging}: {cause.strerror or cause}", _is_space(cause)
    problem, space = world.broadcast((problem, space))
    if problem is not None:
        if world.is_main:
            shutil.rmtree(staging, ignore_errors=True)
        raise OutputError(f"{problem}; the previous checkpoint is intact", space=space)


def _is_space(error: BaseException) -> bool:
    """Whether a failure (torch.distributed.checkpoint's wrapper included) was for room on the disk."""
    import errno

    for found in (error, *_failures(error), getattr(error, "__cause__", None)):
        if isinstance(found, OSError) and found.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return True
        if isinstance(found, OutputError) and found.space:
            return True
    return False


def _failures(error: BaseException) -> list[BaseException]:
    """The per-rank exceptions torch.distributed.checkpoint's CheckpointException carries."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict):
        return []
    return [f[0] if isinstance(f, tuple) else f for f in failures.values() if isinstance(f, BaseException | tuple)]


def _reason(error: BaseException) -> str:
    """One line of an error, through torch.distributed.checkpoint's wrapper (which lists every rank's failure)."""
    error = next(iter(_failures(error)), error)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:160]


@contextlib.contextmanager
def _one_process_is_intended() -> Any:
    """Without a process group torch.distributed.checkpoint warns that it assumes one process: that is the intent."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _in_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def newest(out: Path) -> Path | None:
    """The newest checkpoint folder, or None."""
    folders = _step_folders(out)
    return folders[-1] if folders else None


def load_sharded(out: Path, shards: dict[str, torch.Tensor], fix: str | None = None) -> None:
    """Read the newest checkpoint's sharded part into ``shards`` in place (this process's tensors by name: DTensor
    shards of any sharding, or whole tensors on one process): torch.distributed.checkpoint reshards as it reads.
    A missing part, a missing name or a shape that does not fit is a DamagedFileError ending in ``fix``."""
    import torch.distributed.checkpoint as dcp

    fix = fix or start_again(out)
    folder = newest(out)
    where = folder / SHARDED_DIR if folder is not None else out / CHECKPOINTS_DIR
    if folder is None or not where.is_dir():
        raise DamagedFileError(
            f"{where} is missing: the checkpoint holds no sharded part (written without --shard fsdp?); {fix}"
        )
    try:
        with _one_process_is_intended():
            dcp.load(shards, storage_reader=dcp.HuggingFaceStorageReader(str(where)), no_dist=not _in_group())
    except Exception as error:  # a name or a shape the checkpoint lacks, a damaged file
        raise DamagedFileError(f"{where} does not fit this run's models ({_reason(error)}); {fix}") from None


def load(out: Path, fix: str | None = None) -> dict[str, Any] | None:
    """The newest checkpoint's state, or None when the run has not completed one. A checkpoint that cannot be
    read, or none beside a log that has steps, is a DamagedFileError ending in ``fix`` (default: train again)."""
    fix = fix or start_again(out)
    folders = _step_folders(out)
    if folders:
        state = _load_folder(folders[-1], fix)
    elif (out / LEGACY_CHECKPOINT).exists():
        state = _load_legacy(out / LEGACY_CHECKPOINT, fix)
    else:
        for log in (out / LOG_FILE, out / LEGACY_LOG):
            if log.exists() and log.stat().st_size > 0:
                raise DamagedFileError(
                    f"{out / CHECKPOINTS_DIR} holds no checkpoint but {log} holds the run's steps; {fix}"
                )
        return None
    missing = [key for key in STATE_KEYS if key not in state] if isinstance(state, dict) else list(STATE_KEYS)
    if missing:
        raise DamagedFileError(f"{out / CHECKPOINTS_DIR} is not a sao checkpoint (it has no {missing[0]!r}); {fix}")
    return state


def _load_folder(folder: Path, fix: str) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(folder / TENSORS_FILE))
        return _decode(read_json_file(folder / STATE_FILE, where=STATE_FILE), tensors)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:120]
        raise DamagedFileError(f"{folder} is damaged ({reason}); {fix}") from None


def _load_legacy(path: Path, fix: str) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises RuntimeError, EOFError, UnpicklingError, ... for a damaged file
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:120]
        raise DamagedFileError(f"{path} is damaged ({reason}); {fix}") from None


# --- the step log -----------------------------------------------------------------------------------------------


def append_log(out: Path, record: dict[str, Any]) -> None:
    """One record at the end of OUT/train_log.jsonl (flushed, not fsynced: ``ensure_log`` repairs it from the
    checkpoint on --resume)."""
    line = json.dumps(clean(record), allow_nan=False) + "\n"
    fd = os.open(out / LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _read_jsonl(path: Path) -> list[Any]:
    """Every record of a JSONL file, through the bounded reader; a ``DataError`` at the first bad line."""
    records = []
    for _, value in iter_jsonl(path):
        if isinstance(value, DataError):
            raise value
        records.append(value)
    return records


def ensure_log(out: Path, records: list[dict[str, Any]]) -> bool:
    """Make train_log.jsonl hold exactly ``records`` (a checkpoint's): a log behind, ahead, damaged or missing is
    rewritten from them. Returns True when it had to be rewritten."""
    try:
        if _read_jsonl(out / LOG_FILE) == as_json(records):
            return False
    except (OSError, ValueError):  # missing, unreadable or not JSON lines: rewritten below
        pass
    text = "".join(json.dumps(clean(r), allow_nan=False) + "\n" for r in records)
    atomic_write(out / LOG_FILE, text.encode(), durable=False)
    (out / LEGACY_LOG).unlink(missing_ok=True)
    return True


def read_log(out: Path, fix: str) -> list[dict[str, Any]]:
    """A finished run's records as JSON holds them: its train_log.jsonl (train_log.json in a folder an earlier
    version wrote), or, when that is missing or damaged, the checkpoint's copy of the same records, written back
    to the log. With neither readable it is a DamagedFileError ending in ``fix``."""
    try:
        if (out / LOG_FILE).exists() or not (out / LEGACY_LOG).exists():
            return _read_jsonl(out / LOG_FILE)
        return read_saved_json(out / LEGACY_LOG, fix, expect=list)
    except (OSError, ValueError, DamagedFileError):
        if not has_steps(out):
            raise DamagedFileError(
                f"{out / LOG_FILE} is missing or damaged and no checkpoint holds its records; {fix}"
            ) from None
    state = load(out, fix)
    assert state is not None  # a checkpoint exists
    ensure_log(out, state["records"])
    return as_json(state["records"])


# --- publishing -------------------------------------------------------------------------------------------------

PUBLISHED_DIR, LATEST_FILE, KEEP_PUBLISHED = "published", "LATEST.json", 3


def publish(
    out: Path,
    version: int,
    write_adapter: Callable[[Path], Any],
    protect: Iterable[int] | None = None,
    *,
    kind: str = "adapter",
    write: bool = True,
) -> Path:
    """Publish the policy after ``version`` policy updates: ``write_adapter(folder)`` writes OUT/published/v{N}/
    (staged and fsynced, so it appears complete or not at all), then LATEST.json is replaced atomically to point
    at it, then all but the newest ``KEEP_PUBLISHED`` versions are removed (with ``protect``: every version but
    those). A server that reads LATEST.json and then the folder it names always finds a complete adapter (a reader
    slower than 2 updates may lose it). ``kind``: what the folder holds: "adapter" (a PEFT folder), or "model"
    (every weight, ``artifacts.save_full_weights``), which LATEST.json then says (``"kind": "model"``). ``write``
    False: a sharded run's other processes, which take part in ``write_adapter``'s gathers and write nothing."""
    root = out / PUBLISHED_DIR
    folder = root / f"v{version}"
    write_adapter(folder)
    if not write:
        return folder
    latest = {"version": version, "path": folder.name, **({"kind": kind} if kind != "adapter" else {})}
    write_json(root / LATEST_FILE, latest)
    versions = sorted(int(p.name[1:]) for p in root.glob("v*") if p.is_dir() and p.name[1:].isdigit())
    kept = set(versions[-KEEP_PUBLISHED:]) if protect is None else set(protect)
    for old in (v for v in versions if v not in kept):
        shutil.rmtree(root / f"v{old}", ignore_errors=True)
    return folder


TRACES_FILE = "traces.json"


def latest_published(out: Path) -> int:
    """The version LATEST.json names, or -1 when nothing was published."""
    try:
        return int(read_json(out / PUBLISHED_DIR / LATEST_FILE)["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1
