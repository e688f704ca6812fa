"""Content hashes of a model folder: its weights (sha256 over the safetensors tensors, whatever the sharding; the
file bytes of *.bin / *.pt) and its tokenizer files (JSON canonicalised), so that two folders compare by what they
hold, not by their names. The stand-in models check their shipped hash with it; provenance blocks record it
(``sao.experiment.provenance``). Deliberately left out: hashing a hub model before it is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sao.core.errors import DataError
from sao.core.reading import Limits, parse_json, read_json_file

CHUNK = 1 << 24  # bytes read at a time while hashing a tensor (16 MiB)
MODEL_FILES = Limits(max_bytes=1 << 30)  # a model's tokenizer.json or safetensors header: large, never deep
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def weights_sha256(folder: str | os.PathLike[str]) -> tuple[str | None, str]:
    """(hash, how it was taken) of the model weights in ``folder``; (None, why) when it holds none."""
    folder = Path(folder)
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        tensors: dict[str, tuple[Path, int, dict[str, Any]]] = {}
        for shard in shards:
            with shard.open("rb") as handle:
                (size,) = struct.unpack("<Q", handle.read(8))
                if size > MODEL_FILES.max_bytes:
                    raise DataError(f"{shard}: a safetensors header of {size} bytes (is this the right file?)")
                header = parse_json(handle.read(size), where=str(shard), limits=MODEL_FILES)
            for name, info in header.items():
                if name != "__metadata__":
                    tensors[name] = (shard, 8 + size, info)
        digest = hashlib.sha256()
        for name in sorted(tensors):
            shard, start, info = tensors[name]
            lo, hi = info["data_offsets"]
            digest.update(json.dumps([name, info["dtype"], info["shape"]]).encode())
            with shard.open("rb") as handle:
                handle.seek(start + lo)
                left = hi - lo
                while left > 0:
                    block = handle.read(min(CHUNK, left))
                    if not block:
                        raise OSError(f"{shard} ends inside tensor {name!r}")
                    digest.update(block)
                    left -= len(block)
        return digest.hexdigest(), f"safetensors tensors ({len(tensors)} in {len(shards)} file(s))"
    files = sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt"))
    if files:
        return files_sha256(files, canonical_json=False), f"file bytes ({len(files)} file(s))"
    return None, f"no *.safetensors, *.bin or *.pt in {folder.name}"


def tokenizer_sha256(folder: str | os.PathLike[str]) -> str | None:
    """Hash of the tokenizer files present in ``folder`` (None when there is none)."""
    files = [Path(folder) / name for name in TOKENIZER_FILES if (Path(folder) / name).is_file()]
    return files_sha256(files, canonical_json=True) if files else None


def files_sha256(files: Iterable[Path], canonical_json: bool) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        if canonical_json and path.suffix == ".json":
            data = read_json_file(path, limits=MODEL_FILES, expect=(dict, list))
            digest.update(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())
        else:
            with path.open("rb") as handle:
                while block := handle.read(CHUNK):
                    digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()
