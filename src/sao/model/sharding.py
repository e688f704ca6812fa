"""FSDP2 over torchrun's processes (``--shard fsdp``): each model's parameters, gradients and optimizer state split
over the ranks, gathered layer by layer when a pass needs them.

    shard      ``fully_shard`` per decoder layer, then a ``Root`` over the whole model; gradients are summed over
               the ranks (the coefficients already hold the whole batch's token count, so the sum is the step of
               one process on the whole batch); bf16 compute with float32 reduction on a GPU, float32 on the CPU
    Root       the FSDP root: its forward runs a function, so that passes which call the trunk and the head apart
               (the teacher-forced pass, the chunked log-softmax) gather the root's own parameters (embeddings,
               final norm, head) around them, and keep them for the backward
    gathered   every parameter of a root unsharded for a while (decoding, publishing): no collective runs inside,
               so the ranks may take different numbers of forwards (each draws its own rows)
    full       the whole of a possibly sharded tensor on every rank (a collective: every rank must call it)

Without a process group nothing here is used: a single process trains the unsharded models. Deliberately left out:
tensor and pipeline parallelism, CPU offload, and decoding layer by layer (a draw holds the whole model).
Design notes: docs/design/sharding.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


class Root(nn.Module):
    """The FSDP root over ``model``: ``root(fn, *args)`` runs ``fn(*args)`` with the root's parameters gathered."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a Hugging Face model (through PEFT and value-model wrappers): the first
    ``ModuleList`` named ``layers``."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers":
            return module
    raise ValueError(f"{type(model).__name__} has no decoder layers (a ModuleList named 'layers') to shard")


def shard(model: nn.Module, device: torch.device) -> Root:
    """Shard ``model`` in place over the default process group and return its ``Root``: one FSDP unit per decoder
    layer (gathered for its forward, freed after it, gathered again for its backward), then the root unit with the
    rest, kept gathered from its forward to the end of its backward (the head's chunks are recomputed there)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    precision = MixedPrecisionPolicy()  # float32 on the CPU: the single-process numbers
    if device.type == "cuda":
        precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=precision)
    root = Root(model)
    fully_shard(root, mp_policy=precision, reshard_after_forward=False)
    for unit in root.modules():
        if isinstance(unit, FSDPModule):  # Σ over ranks, never the mean (gloo has no pre-scaled sum)
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    return root


def units(root: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in root.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(root: nn.Module | None) -> Iterator[None]:
    """Every parameter under ``root`` whole on this rank until the block ends (a collective on entry and exit:
    every rank enters together); inside, forwards run without collectives. ``None``: nothing to gather."""
    if root is None:
        yield
        return
    root(_nothing)  # FSDP's set-up runs from the root (a first forward through a layer would claim the root's part)
    found = units(root)
    for unit in found:
        unit.set_reshard_after_forward(False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in found:
            unit.reshard()
            unit.set_reshard_after_forward(unit is not root)


def _nothing() -> None:
    return None


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's shards gathered (a collective), anything else as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
