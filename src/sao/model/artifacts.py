"""What a trained run leaves for people to use: the adapter folder, and a merged model for serving engines.

    adapter folder   PEFT's files for the policy adapter, the tokenizer and the value head (safetensors + JSON);
                     plain ``PeftModel.from_pretrained`` loads it, no pickle anywhere
    model folder     full fine-tuning: every weight as a Hugging Face folder (``save_full_weights``: config,
                     safetensors shards and their index, tokenizer; sao's value head and sao_weights.json beside),
                     a sharded model gathered tensor by tensor onto rank 0; ``AutoModelForCausalLM`` loads it
    critic folder    a value model of its own: its trunk (a PEFT adapter folder, or every weight) and its head
    merged model     base + adapter by PEFT's ``merge_and_unload`` in the base's dtype, with ``sao_export.json``
                     recording ``merge_relative_error`` (a bf16 merge can round a small adapter's change away)
    full weights     every weight of a model as safetensors shards + index, config and tokenizer: a version a vLLM
                     server reloads in place (``sao.rollout.vllm_weights``) and ``from_pretrained`` loads

All are written into a hidden temporary sibling folder and renamed when complete. Deliberately left out: other
merge dtypes, quantised exports, pushing to a hub, and the value head in the merged folder.
Design notes: docs/design/artifacts.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sao.core import hub
from sao.core.errors import ConfigError
from sao.core.io import OutputError, folder_mode, follow_umask, os_error_of, output_problem, write_json
from sao.core.machine import on_terminal, quiet_libraries
from sao.core.reading import read_json_file, safetensors_problem
from sao.model.policy import POLICY_ADAPTER, ValueHead, ValueModel, lora_state
from sao.model.sharding import full

VALUE_HEAD_WEIGHTS = "value_head.safetensors"
VALUE_HEAD_INFO = "value_head.json"
EXPORT_INFO = "sao_export.json"
ADAPTER_CONFIG = "adapter_config.json"
WEIGHTS_INFO = "sao_weights.json"  # a model or critic folder: what it holds


# ---------------------------------------------------------------------------------------------------------
# Folders that appear complete or not at all.


def _fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` and the folders themselves, so the rename publishes data on disk."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _staged_folder(final: Path, *, replace: bool) -> Iterator[Path]:
    """Yield an empty hidden sibling of ``final`` to write into; on success rename it to ``final``.

    ``replace=True`` swaps out an existing folder (moved aside, then deleted once the new one is in place);
    ``replace=False`` accepts only a missing or empty ``final``. On any failure the staging folder is
    removed and ``final`` is as it was. An OS error (disk full, read-only folder) becomes an ``OutputError``.
    """
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
        os.chmod(staging, folder_mode())  # mkdtemp's 0o700 would outlive the rename: the user's umask instead
    except OSError as error:
        raise OutputError(f"could not create a folder beside {final}: {error.strerror or error}") from None
    try:
        yield staging
        follow_umask(staging)  # safetensors writes its files 0o600; everything sao writes follows the umask
        _fsync_tree(staging)
        if final.is_dir() and any(final.iterdir()):
            if not replace:
                raise ConfigError(f"{final} is not empty; pass a new or empty folder")
            aside = final.parent / f".{final.name}.{uuid.uuid4().hex[:8]}.old"
            os.rename(final, aside)
            try:
                os.rename(staging, final)
            except OSError:
                os.rename(aside, final)
                raise
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(staging, final)  # onto a missing path or an empty folder
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        # an OS error (a full disk) from Python or from a library's own writer (safetensors): one line naming
        # ``final``, with what to do about it; anything else is not about the disk and goes on as it is
        inner = error.__cause__ if isinstance(error, OutputError) else error
        cause = None if inner is None or isinstance(error, ConfigError) else os_error_of(inner)
        if cause is not None:
            raise output_problem(final, cause) from None
        raise


def _first_line(error: BaseException) -> str:
    """One line of an error's text: the first, or the first naming a mismatch (torch's state-dict errors open
    with a line that says nothing)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if "mismatch" in line), lines[0]) if lines else type(error).__name__


# ---------------------------------------------------------------------------------------------------------
# The adapter folder.


def save_adapter(
    policy: nn.Module,
    tokenizer: Any,
    value_head: ValueHead | None,
    path: str | os.PathLike[str],
    *,
    base_model: str,
    weights: dict[str, torch.Tensor] | None = None,
    policy_version: int | None = None,
) -> Path:
    """Write the policy adapter, the tokenizer and the value head to ``path`` (replacing what is there).

    Only the "default" adapter is written (a policy may also hold the stale sampler's "sampler" adapter).
    ``base_model`` is the hub id or directory the adapter was trained on; it is recorded in
    ``value_head.json`` and as ``base_model_name_or_path`` in ``adapter_config.json`` (a directory as its absolute
    path, so the folder names one base wherever it is read from). ``weights``: the adapter's whole tensors by
    parameter name, when the policy holds only its shards (``sharded_lora``). ``value_head`` None (a value model of
    its own): no value head files. ``policy_version``: the policy updates the adapter holds, recorded in
    ``value_head.json`` for a server to log with each reply. Returns ``path``.
    """
    base_model = recorded_base(base_model)
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} is a file; the adapter is written as a folder")
    extra = {} if weights is None else {"state_dict": weights}
    with _staged_folder(path, replace=True) as staging:
        # save_embedding_layers=False: LoRA never targets the embeddings here, and "auto" would look the base
        # model up on the hub to compare vocabulary sizes.
        policy.save_pretrained(staging, selected_adapters=[POLICY_ADAPTER], save_embedding_layers=False, **extra)
        config_file = staging / ADAPTER_CONFIG
        adapter_config = json.loads(config_file.read_text(encoding="utf-8"))
        adapter_config["base_model_name_or_path"] = base_model
        config_file.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tokenizer.save_pretrained(staging)
        if value_head is not None:
            _write_value_head(value_head, staging, base_model, policy_version=policy_version)
    return path


def _write_value_head(
    value_head: ValueHead,
    folder: Path,
    base_model: str,
    on: str = "the base model's",
    policy_version: int | None = None,
) -> None:
    """value_head.safetensors and value_head.json in ``folder`` (``load_value_head`` reads them)."""
    from safetensors.torch import save_file

    state = {name: full(t).detach().to("cpu").contiguous() for name, t in value_head.state_dict().items()}
    weight = state["linear.weight"]  # [1, H]
    info = {
        "format": f"sao value head: V(h) = linear(h) on {on} last hidden state, one value per token",
        "hidden_size": int(weight.shape[-1]),
        "dtype": str(weight.dtype).removeprefix("torch."),
        "parameters": sum(t.numel() for t in state.values()),
        "base_model": base_model,
        "weights": VALUE_HEAD_WEIGHTS,
        **({"policy_version": int(policy_version)} if policy_version is not None else {}),
    }
    save_file(state, str(folder / VALUE_HEAD_WEIGHTS), metadata={"format": "pt"})
    write_json(folder / VALUE_HEAD_INFO, info)


def sharded_lora(policy: nn.Module) -> dict[str, torch.Tensor] | None:
    """The policy adapter's whole tensors on the CPU when the policy holds only its shards (a collective: every
    process calls it), else None (``save_adapter`` reads the live tensors)."""
    from torch.distributed.tensor import DTensor

    state = lora_state(policy)
    if not any(isinstance(t, DTensor) for t in state.values()):
        return None
    return {name: full(t).detach().to("cpu") for name, t in state.items()}


def whole_state(model: nn.Module, keep: bool = True) -> dict[str, torch.Tensor] | None:
    """``model.state_dict()`` with every tensor whole and on the CPU, a sharded one gathered as it is reached (a
    collective: every process calls this, in step); only a ``keep`` process (the one that writes) keeps the tensors,
    the others get None. The whole model is then in that process's memory (``save_full_weights``' contract)."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        value = full(tensor.detach())
        if keep:
            state[name] = value.to("cpu")
    return state if keep else None


def describe_weights(folder: Path, *, base_model: str, value_head: ValueHead | None = None, **info: Any) -> None:
    """sao's files beside a full-weight folder's weights: the value head (``load_value_head`` reads it) and
    ``sao_weights.json`` (what the folder holds, its base model, and ``info``: a published one's policy version)."""
    if value_head is not None:
        _write_value_head(value_head, folder, base_model)
    write_json(
        folder / WEIGHTS_INFO,
        {
            "format": "sao full weights: a Hugging Face causal LM folder, every weight trained",
            "base_model": base_model,
            **info,
        },
    )


def save_value_model(
    critic: ValueModel,
    tokenizer: Any,
    path: str | os.PathLike[str],
    *,
    base_model: str,
    finetune: str,
    write: bool = True,
) -> Path:
    """A value model of its own (``critic="model"``) at ``path``: its trunk as a PEFT adapter folder ("lora", on the
    trunk of ``base_model``) or every trunk weight in safetensors with its config ("full", ``save_pretrained``), and its
    head (value_head.safetensors), with sao_weights.json saying which. Sharded: every process calls it (the tensors are
    gathered in turn), and only ``write`` ones write."""
    path = Path(path)
    trunk = critic.trunk
    weights = sharded_lora(trunk) if finetune == "lora" else whole_state(trunk, keep=write)
    head = {name: full(t) for name, t in critic.head.state_dict().items()}  # (gathered on every process)
    if not write:
        return path
    with _staged_folder(path, replace=True) as staging:
        extra = {} if weights is None else {"state_dict": weights}
        if finetune == "lora":
            trunk.save_pretrained(staging, selected_adapters=[POLICY_ADAPTER], save_embedding_layers=False, **extra)
        else:
            trunk.save_pretrained(staging, **extra)
        tokenizer.save_pretrained(staging)
        whole_head = ValueHead(int(head["linear.weight"].shape[-1]))
        whole_head.load_state_dict({k: v.to("cpu") for k, v in head.items()})
        _write_value_head(whole_head, staging, base_model, on="the value model's own trunk's")
        write_json(
            staging / WEIGHTS_INFO,
            {
                "format": f"sao value model: its trunk ({finetune}) and a linear value head on its last hidden state",
                "base_model": base_model,
                "finetune": finetune,
            },
        )
    return path


def recorded_base(base_model: str) -> str:
    """How an adapter names its base: a folder here by its absolute path (a relative one would name another folder,
    or a hub id, when read from elsewhere), a hub id as it is."""
    local = os.path.expanduser(base_model)
    return os.path.abspath(local) if os.path.isdir(local) else base_model


def policy_version(adapter_dir: str | os.PathLike[str]) -> int | None:
    """The policy updates an adapter folder holds, as ``save_adapter`` recorded them (None when it did not: an
    adapter written before sao recorded it, or by another tool)."""
    try:
        info = read_json_file(Path(adapter_dir) / VALUE_HEAD_INFO, error=ConfigError)
    except (OSError, ConfigError):
        return None
    version = info.get("policy_version") if isinstance(info, dict) else None
    return version if isinstance(version, int) and not isinstance(version, bool) and version >= 0 else None


def load_value_head(path: str | os.PathLike[str]) -> ValueHead:
    """The value head saved by ``save_adapter`` in the adapter folder ``path``, on the CPU in its saved dtype.

    A missing or malformed ``value_head.json`` or ``value_head.safetensors`` is a one-line ``ConfigError``
    naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    info_file, weights_file = folder / VALUE_HEAD_INFO, folder / VALUE_HEAD_WEIGHTS
    for file in (info_file, weights_file):
        if not file.is_file():
            raise ConfigError(f"{file} is missing; save the adapter with sao.model.artifacts.save_adapter")
    info = read_json_file(info_file, error=ConfigError)
    try:
        hidden_size, dtype_name = info["hidden_size"], info["dtype"]
    except KeyError as error:
        raise ConfigError(f"{info_file} is malformed (no {_first_line(error)})") from None
    dtype = getattr(torch, str(dtype_name), None)
    if not isinstance(hidden_size, int) or hidden_size <= 0 or not isinstance(dtype, torch.dtype):
        raise ConfigError(f"{info_file} is malformed (hidden_size {hidden_size!r}, dtype {dtype_name!r})")
    try:
        state = load_file(str(weights_file))
    except (OSError, SafetensorError) as error:
        raise ConfigError(f"{weights_file} is malformed ({_first_line(error)})") from None
    expected = {"linear.weight": (1, hidden_size), "linear.bias": (1,)}
    found = {name: tuple(t.shape) for name, t in state.items()}
    if found != expected:
        raise ConfigError(f"{weights_file} holds {found}; expected {expected} (hidden_size from {VALUE_HEAD_INFO})")
    head = ValueHead(hidden_size).to(dtype)
    head.load_state_dict(state)
    return head


def check_adapter_files(adapter_dir: str | os.PathLike[str], fix: str) -> None:
    """Every safetensors file of an adapter (or full-weight) folder whole (a truncated copy, a disk that filled): a
    one-line ConfigError naming the file and ending in ``fix``, before any model is loaded."""
    for file in sorted(Path(adapter_dir).glob("*.safetensors")):
        problem = safetensors_problem(file)
        if problem is not None:
            raise ConfigError(f"{file} is damaged ({problem}); {fix}")


def find_adapter_dir(run: str | os.PathLike[str]) -> Path:
    """The adapter folder of ``run``: ``run/adapter`` for a ``sao train`` output folder, or ``run`` itself."""
    run = Path(run)
    for candidate in (run / "adapter", run):
        if (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    raise ConfigError(f"{run} holds neither adapter/{ADAPTER_CONFIG} nor {ADAPTER_CONFIG}; pass a sao train folder")


def find_model_dir(run: str | os.PathLike[str]) -> Path | None:
    """The full-weight model folder of ``run`` (``run/model`` of a ``--finetune full`` run, or ``run`` itself), or
    None when it holds none."""
    run = Path(run)
    return next(
        (c for c in (run / "model", run) if (c / WEIGHTS_INFO).is_file() and (c / "config.json").is_file()), None
    )


def export_model(model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """A full fine-tuning run's weights (``save_full_weights``' folder) as a plain Hugging Face folder in ``out_dir``
    (missing or empty): loaded with ``AutoModelForCausalLM`` in their own dtype, so a folder that does not load
    fails here, and saved with the tokenizer and ``sao_export.json``. Returns ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"{out_dir} exists and is not empty; pass a new or empty folder for the model")
    written = read_json_file(model_dir / WEIGHTS_INFO, error=ConfigError)
    check_adapter_files(model_dir, "restore the run's weights folder, or train the run again")
    if not on_terminal():
        quiet_libraries()  # transformers' weight-loading bar draws with \r: kept out of a log file
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as error:
        raise ConfigError(f"could not load the model in {model_dir} ({_first_line(error)})") from None
    dtype = next(model.parameters()).dtype
    info = {
        "base_model": written.get("base_model"),
        "from": model_dir.name,
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in model.parameters()),
        "finetune": "full",
        "merge_relative_error": 0.0,
        "merge_relative_error_means": "every weight was trained: nothing to merge, the weights are written as they are",
    }
    with _staged_folder(out_dir, replace=False) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        write_json(staging / EXPORT_INFO, info)
    return out_dir


# ---------------------------------------------------------------------------------------------------------
# The merged model.


def _merge_error(peft_model: nn.Module) -> tuple[float, int]:
    """‖(W_merged − W) − ΔW‖ / ‖ΔW‖ over every LoRA layer, and the number of layers, computed before the merge.

    W_merged is what PEFT's merge writes, ``W + ΔW`` rounded to W's dtype; ΔW = scale · B A in float32.
    0 means the merged weights carry the adapter's change exactly (up to float32 rounding); 1 means a bf16
    merge rounded it away entirely."""
    from peft.tuners.lora import LoraLayer

    error_sq = change_sq = 0.0
    layers = 0
    with torch.no_grad():
        for module in peft_model.modules():
            if not isinstance(module, LoraLayer) or POLICY_ADAPTER not in module.lora_A:
                continue
            weight = module.get_base_layer().weight  # [out, in]
            delta = module.get_delta_weight(POLICY_ADAPTER).float()  # [out, in]
            carried = (weight.float() + delta).to(weight.dtype).float() - weight.float()  # [out, in]
            error_sq += float((carried - delta).square().sum())
            change_sq += float(delta.square().sum())
            layers += 1
    return (math.sqrt(error_sq / change_sq) if change_sq > 0 else 0.0), layers


def merge(
    adapter_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, base_model_path: str | None = None
) -> Path:
    """Fold the adapter in ``adapter_dir`` into its base model and save a plain HF model folder in ``out_dir``.

    The base is ``base_model_path`` when given, else ``base_model_name_or_path`` from the adapter's
    ``adapter_config.json``; it is loaded in its own dtype (``dtype="auto"``) on the CPU. ``out_dir`` must be
    missing or empty. The tokenizer comes from the adapter folder (from the base when the folder has none,
    as in runs saved before the folder carried one). Returns ``out_dir``.
    """
    from peft import PeftModel
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"{out_dir} exists and is not empty; pass a new or empty folder for the merged model")
    config_file = adapter_dir / ADAPTER_CONFIG
    if not config_file.is_file():
        raise ConfigError(f"{config_file} is missing; pass an adapter folder written by sao train")
    adapter_config = read_json_file(config_file, error=ConfigError)
    recorded_base = adapter_config.get("base_model_name_or_path")
    if recorded_base is not None and not isinstance(recorded_base, str):
        raise ConfigError(f"{config_file} is malformed (base_model_name_or_path is not a string)")
    check_adapter_files(adapter_dir, "restore the adapter folder, or train the run again")
    base = base_model_path or recorded_base
    if not base:
        raise ConfigError(f"{config_file} names no base model; pass --base-model PATH")
    hint = "pass --base-model PATH" if base_model_path is None else "check --base-model"
    local = os.path.expanduser(base)
    if not os.path.isdir(local) and (base.startswith(("/", ".", "~")) or base.count("/") > 1):
        raise ConfigError(f"the base model folder {base!r} does not exist; {hint}")
    if not os.path.isdir(local):  # a hub id (or a relative folder typed elsewhere): cached, or the hub reachable
        fix = (
            f"if it names a folder relative to where the adapter was trained, {hint}"
            if base_model_path is None
            else hint
        )
        hub.check_reachable(base, kind="model", fix=fix)

    if not on_terminal():
        quiet_libraries()  # transformers' weight-loading bar draws with \r: kept out of a log file
    try:
        base_lm = AutoModelForCausalLM.from_pretrained(local if os.path.isdir(local) else base, dtype="auto")
    except (OSError, ValueError) as error:
        raise ConfigError(f"could not load the base model {base!r} ({_first_line(error)}); {hint}") from None
    dtype = next(base_lm.parameters()).dtype
    try:
        peft_model = PeftModel.from_pretrained(base_lm, adapter_dir)
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as error:
        detail = _first_line(error)
        raise ConfigError(f"the adapter in {adapter_dir} does not fit {base!r} ({detail}); {hint}") from None
    relative_error, lora_layers = _merge_error(peft_model)
    merged = peft_model.merge_and_unload()
    tokenizer_from_adapter = (adapter_dir / "tokenizer_config.json").is_file()
    tokenizer_source = str(adapter_dir) if tokenizer_from_adapter else base
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    except (OSError, ValueError) as error:
        raise ConfigError(f"could not load a tokenizer from {tokenizer_source} ({_first_line(error)})") from None

    info = {
        "base_model": base,
        "adapter": adapter_dir.name,
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in merged.parameters()),
        "lora_layers_merged": lora_layers,
        "lora_rank": adapter_config.get("r"),
        "lora_alpha": adapter_config.get("lora_alpha"),
        "tokenizer_from": "adapter" if tokenizer_from_adapter else "base",
        "merge_relative_error": relative_error,
        "merge_relative_error_means": "||(W_merged - W_base) - scale*B@A|| / ||scale*B@A|| over all LoRA layers: "
        "0 = the merged weights carry the adapter's change exactly, 1 = rounding to the dtype erased it",
    }
    with _staged_folder(out_dir, replace=False) as staging:
        merged.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        write_json(staging / EXPORT_INFO, info)
    return out_dir


# ---------------------------------------------------------------------------------------------------------
# Full weights.


def save_full_weights(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    state: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 << 30,
    also: Callable[[Path], Any] | None = None,
) -> Path:
    """Write every weight of ``model`` (a Hugging Face causal LM) to ``path`` as safetensors shards, replacing what
    is there: ``model.safetensors`` or ``model-0000i-of-0000n.safetensors``, always beside
    ``model.safetensors.index.json`` (shards of at most ``max_shard_bytes``, a tensor never split), its
    ``config.json`` and, when given, the tokenizer.

    ``state`` replaces ``model.state_dict()`` (a sharded trainer gathers the full state dict on one rank and passes
    it); ``dtype`` casts every floating tensor (write what the server runs: float32 for sao's launched servers). A
    tied output layer is written as ``lm_head.weight`` too, unlike ``save_pretrained``: vLLM's CPU build repacks its
    output layer on a reload only when the folder carries it. ``also(folder)`` writes more files into the folder before
    it appears (sao's value head, ``sao_weights.json``). No pickle anywhere. Returns ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} is a file; full weights are written as a folder")
    source = model.state_dict() if state is None else state
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in source.items():
        value = tensor.detach().to("cpu")
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        value = value.contiguous()
        pointer = value.untyped_storage().data_ptr()
        if pointer in seen:  # tied weights share storage; safetensors stores each tensor on its own
            value = value.clone()
        seen.add(value.untyped_storage().data_ptr())
        tensors[name] = value
    config = getattr(model, "config", None)
    tied = bool(config is not None and getattr(config.get_text_config(), "tie_word_embeddings", False))
    if tied and "lm_head.weight" not in tensors:
        embed_name = next((n for n in tensors if n.endswith("embed_tokens.weight")), None)
        if embed_name is not None:
            tensors["lm_head.weight"] = tensors[embed_name].clone()
    shards: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for name in sorted(tensors):
        size = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append({})
            filled = 0
        shards[-1][name] = tensors[name]
        filled += size
    with _staged_folder(path, replace=True) as staging:
        if config is not None:
            config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(staging / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        # the index even for one shard: a loader (vLLM's) then reads the files it names and not sao's value head
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        write_json(
            staging / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map}
        )
        if also is not None:
            also(staging)
    return path


__all__ = [
    "check_adapter_files",
    "export_model",
    "find_adapter_dir",
    "find_model_dir",
    "load_value_head",
    "merge",
    "save_adapter",
    "save_full_weights",
    "save_value_model",
    "whole_state",
]
