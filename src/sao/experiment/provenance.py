"""Where a result came from: content hashes of the model, tokenizer and data, and the machine and code that ran it.

Two runs compare only when they trained the same model on the same data, and a hash says so where a name cannot.
Every results.json, training run and base eval carries a ``provenance`` block: ``weights`` (sha256 over the
safetensors tensors, whatever the sharding), ``tokenizer`` (its files, JSON canonicalised), ``data`` (training
prompts and held-out tasks), ``machine`` (what decides whether floating point repeats bit for bit) and ``code``
(library versions, sao's version and git commit). ``differences`` turns several blocks into warnings in words.

Deliberately left out: hashing a hub model before it is downloaded, hashing optimizer states or checkpoints, and
refusing to aggregate (the warning says what differs, the person decides). Design notes: docs/design/provenance.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sao.core.hashing import tokenizer_sha256, weights_sha256

HASHES = {  # path in a provenance block → what it names, for the warnings
    ("model", "weights_sha256"): "model weights",
    ("model", "tokenizer_sha256"): "tokenizer",
    ("data", "train_sha256"): "training prompts",
    ("data", "test_sha256"): "held-out tasks",
}
ENVIRONMENT = {  # what changes floating point but not what was computed
    ("machine", "cpu"): "CPU",
    ("machine", "cpu_flags"): "CPU instruction-set extensions",
    ("machine", "cpu_capability"): "CPU instruction set",
    ("machine", "torch_threads"): "torch threads",
    ("code", "versions"): "library versions",
    ("code", "commit"): "sao commit",
}


def tasks_sha256(tasks: Iterable[Any]) -> str:
    """Hash of a list of tasks (dataclasses: every field, in order; anything else: its JSON form)."""
    rows = [dataclasses.asdict(t) if dataclasses.is_dataclass(t) else t for t in tasks]
    text = json.dumps(rows, sort_keys=True, default=str, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def model_dir(model: str) -> Path | None:
    """The local folder of ``model``: itself when it is a folder, else the hub cache's snapshot (None when the
    hub id has not been downloaded here)."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # not cached, not a hub id, or no huggingface_hub: nothing local to hash
        return None


def model_block(model: str, name: str | None = None) -> dict[str, Any]:
    """The model at ``model`` (a folder or hub id) with its weights and tokenizer hashes, recorded under ``name``
    (what the config calls it, e.g. "tiny"; default ``model``) and its folder's last component only, so that no
    machine's paths end up in a results file."""
    folder = model_dir(model)
    if folder is None:
        return {
            "name": name or model,
            "folder": None,
            "weights_sha256": None,
            "weights_hashed": "not available locally",
            "tokenizer_sha256": None,
        }
    weights, how = weights_sha256(folder)
    return {
        "name": name or model,
        "folder": folder.name,
        "weights_sha256": weights,
        "weights_hashed": how,
        "tokenizer_sha256": tokenizer_sha256(folder),
    }


# The instruction-set extensions that pick floating-point kernels (vector width, fused multiply-add, bf16/fp16,
# matrix units), as /proc/cpuinfo names them on x86 ("flags") and on ARM ("Features").
CPU_FLAGS = frozenset(
    {
        "sse4_1",
        "sse4_2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "avx_vnni",
        "avx512f",
        "avx512dq",
        "avx512cd",
        "avx512bw",
        "avx512vl",
        "avx512_vnni",
        "avx512_bf16",
        "avx512_fp16",
        "avx512ifma",
        "avx512vbmi",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
        "amx_fp16",
        "asimd",
        "asimdhp",
        "asimddp",
        "sve",
        "sve2",
        "bf16",
        "i8mm",
        "sme",
    }
)


def cpuinfo(path: str | Path = "/proc/cpuinfo") -> tuple[str | None, list[str] | None]:
    """(the CPU's model name, its instruction-set flags among ``CPU_FLAGS``, sorted) from the first processor in
    ``path``; None for what the file does not say (there is no such file off Linux)."""
    cpu, flags = None, None
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None, None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if cpu is None and key == "model name":
            cpu = value.strip()
        elif flags is None and key in ("flags", "features"):
            flags = sorted(set(value.split()) & CPU_FLAGS)
    return cpu, flags


def machine() -> dict[str, Any]:
    """The CPU, its instruction set (the extensions /proc/cpuinfo lists, and the one torch's kernels use), cores
    and thread settings: what decides whether floating point repeats bit for bit."""
    import torch

    cpu, flags = cpuinfo()
    capability = None
    with contextlib.suppress(AttributeError, RuntimeError):  # older torch builds lack it
        capability = torch.backends.cpu.get_cpu_capability()
    return {
        "cpu": cpu or platform.processor() or platform.machine() or None,
        "cpu_flags": flags,
        "cpu_capability": capability,
        "architecture": platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "mkl_num_threads": os.environ.get("MKL_NUM_THREADS"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def library_versions() -> dict[str, str]:
    """Versions of python and of every library that computes a number in a run, and the device."""
    import numpy
    import peft
    import scipy
    import torch
    import transformers

    out = {
        "sao": sao_version(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
    }
    out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.machine()})"
    return out


def sao_version() -> str:
    """sao's installed version ("0+unknown" for a source tree that was never installed)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("sao")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def sao_commit() -> dict[str, Any]:
    """sao's git commit and whether its source differs from it, when sao runs from a git checkout of itself
    (an installed copy inside some other repository reports "unknown")."""
    package = Path(__file__).resolve().parents[1]
    try:
        top = _git(package, "rev-parse", "--show-toplevel")
        if (Path(top) / "src" / "sao").resolve() != package:
            return {"commit": "unknown", "dirty": None}
        commit = _git(package, "rev-parse", "HEAD")
        dirty = bool(_git(Path(top), "status", "--porcelain", "--untracked-files=no", "--", "src"))
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}


def _git(where: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10, check=True)
    return done.stdout.strip()


def collect(
    model: str, train: list[Any], test: list[Any], source: str | None = None, name: str | None = None
) -> dict[str, Any]:
    """The whole provenance block of a run of ``model`` (a folder or hub id; ``name``: what the config calls it)
    on these training prompts and held-out tasks."""
    return {
        "model": model_block(model, name),
        "data": {
            "source": source,
            "train": len(train),
            "train_sha256": tasks_sha256(train),
            "test": len(test),
            "test_sha256": tasks_sha256(test),
        },
        "machine": machine(),
        "code": {"versions": library_versions(), **sao_commit()},
    }


def _get(block: Mapping[str, Any], path: tuple[str, str]) -> Any:
    return (block.get(path[0]) or {}).get(path[1]) if isinstance(block, Mapping) else None


def differences(blocks: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Warnings in words for provenance blocks (label → block) that disagree: one per differing hash (the
    pieces are not about the same model or data), then one note for the machine and code (they need not agree
    bit for bit). A value missing from a block is not a difference; ``missing`` reports blocks without a hash."""
    out = []
    for path, what in HASHES.items():
        groups: dict[str, list[str]] = {}
        for label, block in blocks.items():
            value = _get(block, path)
            if value is not None:
                groups.setdefault(str(value), []).append(label)
        if len(groups) > 1:
            parts = "; ".join(f"{h[:12]}: {', '.join(labels)}" for h, labels in groups.items())
            out.append(
                f"the {what} differ between the pieces aggregated here ({parts}): they are not runs of the "
                "same experiment, so comparing them measures the difference too"
            )
    varying = [
        what
        for path, what in ENVIRONMENT.items()
        if len({json.dumps(v, sort_keys=True) for b in blocks.values() if (v := _get(b, path)) is not None}) > 1
    ]
    if varying:
        out.append(
            f"the pieces aggregated here ran with different {', '.join(varying)}: the same settings need "
            "not give the same numbers bit for bit"
        )
    return out


def missing(blocks: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Labels of blocks that record no model weights hash (made before sao recorded provenance, or unhashable)."""
    return [label for label, block in blocks.items() if _get(block, ("model", "weights_sha256")) is None]
