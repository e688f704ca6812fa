"""The correction rules an update can apply: f(ratio) on each action token, by name (``CORRECTIONS`` in
``sao.core.registry`` lists them; register your own there). A token with weight 0 is masked.

    "dis"      f(ρ) = ρ if lo < ρ < hi else 0                    direct double-sided IS (the recipe arm)
    "none"     f(ρ) = ρ                                          plain importance weighting (the baseline)
    "tis"      f(ρ) = min(ρ, C)                                  truncated IS at a cap C
    "seqmask"  f(ρ) = ρ, or 0 on every token of a trajectory whose geometric-mean ratio leaves (lo, hi)
    "random"   f(ρ) = ρ, or 0 on each action token with probability p whatever its ratio: the control that tells
               masking *these* tokens (dis) from dropping *any* tokens

Deliberately left out: everything else of the update (``sao.algorithm.update``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sao.algorithm.update import SAO

Tensor = torch.Tensor

# A correction rule maps (ratio [B,T], action_mask [B,T], sao, sampler_logprobs [B,T]) to the weight f(r) [B,T]
# it applies. Tokens with weight 0 are masked. Rules see only action tokens' ratios; the caller zeroes the rest.
# The sampler's recorded log-probabilities are there for a rule that needs a per-trajectory key (``random``).
CorrectionRule = Callable[[Tensor, Tensor, "SAO", Tensor], Tensor]


def dis(ratio: Tensor, action_mask: Tensor, sao: SAO, sampler_logprobs: Tensor) -> Tensor:
    """Direct double-sided IS: keep the ratio inside the open band (lo, hi), zero outside it."""
    lo, hi = sao.ratio
    return torch.where((ratio > lo) & (ratio < hi), ratio, torch.zeros_like(ratio))


def none(ratio: Tensor, action_mask: Tensor, sao: SAO, sampler_logprobs: Tensor) -> Tensor:
    """No correction: the plain importance weight, never masked (the paper's "no DIS")."""
    return ratio


def tis(ratio: Tensor, action_mask: Tensor, sao: SAO, sampler_logprobs: Tensor) -> Tensor:
    """Truncated IS: the ratio capped from above at C (``tis_cap``); nothing is masked."""
    return ratio.clamp(max=sao.tis_cap)


def random(ratio: Tensor, action_mask: Tensor, sao: SAO, sampler_logprobs: Tensor) -> Tensor:
    """A random token mask: each action token dropped with probability ``random_mask_share`` whatever its ratio,
    the plain ratio elsewhere. A trajectory's draw is keyed on its own recorded sampler log-probabilities (a
    sha256 of their bytes seeds its generator), so it is the same however the batch is split into micro-batches,
    differs from step to step, and takes nothing from the random streams the arms share."""
    share = sao.random_mask_share or 0.0
    if share == 0:
        return ratio
    keys = torch.where(action_mask, sampler_logprobs, torch.zeros_like(sampler_logprobs)).detach().cpu()
    keys = keys.to(torch.float32).contiguous().numpy()  # [B, T] the bytes that key each row's draw
    uniform = torch.stack([
        torch.rand(ratio.shape[1], generator=torch.Generator().manual_seed(_row_seed(row)), dtype=torch.float64)
        for row in keys
    ]).to(ratio.device)  # fmt: skip  # [B, T] in [0, 1)
    return torch.where(uniform < share, torch.zeros_like(ratio), ratio)


def _row_seed(row) -> int:
    return int.from_bytes(hashlib.sha256(row.tobytes()).digest()[:8], "little") & (2**63 - 1)


def seqmask(ratio: Tensor, action_mask: Tensor, sao: SAO, sampler_logprobs: Tensor) -> Tensor:
    """Sequence-level masking: drop a whole trajectory whose geometric-mean ratio leaves (lo, hi)."""
    lo, hi = sao.ratio
    log_ratio = torch.where(action_mask, ratio.log(), torch.zeros_like(ratio))
    length = action_mask.sum(dim=1).clamp(min=1)  # [B]
    geo_mean = (log_ratio.sum(dim=1) / length).exp()  # [B]
    keep = (geo_mean > lo) & (geo_mean < hi)  # [B]
    return torch.where(keep[:, None], ratio, torch.zeros_like(ratio))
