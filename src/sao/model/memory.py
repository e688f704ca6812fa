"""Memory: the one out-of-memory retry (training pass and eval alike) and the micro-batch that fits.

    retry        on out-of-memory, halve the rows and try again from the start (down to one row); the caller
                 decides whether the halving holds for the rest of the run
    micro-batch  rows per forward+backward that fit in free accelerator memory; the whole batch on the CPU

Deliberately left out: anything about what is retried (the caller's function is rerun as it is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from sao.model.policy import causal_lm

T = TypeVar("T")

# Activation bytes a LoRA training pass keeps per token, per layer, per unit of hidden size (bf16, SDPA
# attention, no activation checkpointing): 41 GB peak at 16 rows × 384 tokens on the 1.5B shape, less
# ~13 GB of weights and full-vocabulary logits, is ~100 bytes · hidden · layers per token.
ACTIVATION_BYTES_PER_HIDDEN = 100


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or any allocator error that says so (CPU, MPS)."""
    oom = getattr(torch.cuda, "OutOfMemoryError", ())
    return (bool(oom) and isinstance(error, oom)) or "out of memory" in str(error).lower()


def with_oom_retry(attempt: Callable[[int], T], rows: int, on_retry: Callable[[int], None]) -> tuple[T, int, int]:
    """Run ``attempt(rows)``; on out-of-memory halve ``rows``, call ``on_retry(rows)`` and try again (down to
    one row). Returns (result, rows it succeeded with, retries). Any other error propagates."""
    retries = 0
    while True:
        try:
            return attempt(rows), rows, retries
        except RuntimeError as error:
            if not is_out_of_memory(error) or rows == 1:
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            retries += 1
            rows = max(1, rows // 2)
            on_retry(rows)


def auto_micro_batch(model: nn.Module, seq_len: int, batch: int, headroom: float = 0.7) -> int:
    """Rows per micro-batch that fit in free accelerator memory (a power of two ≤ batch); the whole batch on
    the CPU. An estimate — the trainer halves it and retries if a step still runs out of memory."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return batch
    free, _ = torch.cuda.mem_get_info(device)
    config = causal_lm(model).config
    per_row = ACTIVATION_BYTES_PER_HIDDEN * config.hidden_size * config.num_hidden_layers * seq_len
    rows = max(1, int(free * headroom // per_row))
    return min(batch, 1 << (rows.bit_length() - 1))
