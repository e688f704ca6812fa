"""The correction rules an update can apply: f(ratio) on each action token, by name (``CORRECTIONS`` in
``sao.core.registry`` lists them; register your own there). A token with weight 0 is masked.

    "dis"      f(ρ) = ρ if lo < ρ < hi else 0                    direct double-sided IS (the recipe arm)
    "none"     f(ρ) = ρ                                          plain importance weighting (the baseline)
    "tis"      f(ρ) = min(ρ, C)                                  truncated IS at a cap C
    "seqmask"  f(ρ) = ρ, or 0 on every token of a trajectory whose geometric-mean ratio leaves (lo, hi)
    "random"   f(ρ) = ρ, or 0 on each action token with probability p whatever its ratio: the control that tells
               masking *these* tokens (dis) from dropping *any* tokens; p may differ by staleness level

The random mask is keyed on integers only: a counter-based hash (splitmix64's finaliser, in wrapping int64
arithmetic) of (seed, step, row, token position). No float enters the key, so the same run draws the same mask on
any CPU, thread count or device, and a change in the last bit of a log-probability leaves it as it was.

Deliberately left out: everything else of the update (``sao.algorithm.update``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from sao.core.errors import ConfigError

if TYPE_CHECKING:
    from sao.algorithm.update import SAO

Tensor = torch.Tensor

# A correction rule maps (ratio [B,T], action_mask [B,T], sao, batch) to the weight f(r) [B,T] it applies. Tokens
# with weight 0 are masked. Rules see only action tokens' ratios; the caller zeroes the rest. ``batch`` is the
# mapping ``SAO.update`` was given, for a rule that reads more of it (``random``: ``random_key`` and ``staleness``).
CorrectionRule = Callable[[Tensor, Tensor, "SAO", Mapping[str, Tensor]], Tensor]


def dis(ratio: Tensor, action_mask: Tensor, sao: SAO, batch: Mapping[str, Tensor]) -> Tensor:
    """Direct double-sided IS: keep the ratio inside the open band (lo, hi), zero outside it."""
    lo, hi = sao.ratio
    return torch.where((ratio > lo) & (ratio < hi), ratio, torch.zeros_like(ratio))


def none(ratio: Tensor, action_mask: Tensor, sao: SAO, batch: Mapping[str, Tensor]) -> Tensor:
    """No correction: the plain importance weight, never masked (the paper's "no DIS")."""
    return ratio


def tis(ratio: Tensor, action_mask: Tensor, sao: SAO, batch: Mapping[str, Tensor]) -> Tensor:
    """Truncated IS: the ratio capped from above at C (``tis_cap``); nothing is masked."""
    return ratio.clamp(max=sao.tis_cap)


def random(ratio: Tensor, action_mask: Tensor, sao: SAO, batch: Mapping[str, Tensor]) -> Tensor:
    """A random token mask: each action token dropped with probability p whatever its ratio, the plain ratio
    elsewhere. p is ``random_mask_share``: one number for every row, or one per staleness level (row i gets entry
    ``batch["staleness"][i]``, levels past the end the last entry), so that the rows of each level lose the share
    dis masked at that level.

    Token (i, t) is dropped when ``token_uniforms(batch["random_key"])[i, t] < p_i``: a hash of the row's integer
    key (``row_keys(seed, step, B)``, made by the trainer) and the position t. Without ``random_key`` row i's key is
    ``row_keys(0, 0, B)[i]``, the same at every call; pass the key when the batch is a micro-batch of a larger one
    (the rows keep their keys wherever they fall) or when the draw should change from step to step. The mask never
    depends on the ratio, and takes nothing from the random streams the arms share."""
    B, T = ratio.shape
    shares = row_shares(sao.random_mask_share, batch.get("staleness"), B)  # [B] float64 on the CPU
    if not bool((shares > 0).any()):
        return ratio
    keys = batch.get("random_key")
    keys = row_keys(0, 0, B) if keys is None else keys.detach().to("cpu")
    if keys.dtype != torch.int64 or tuple(keys.shape) != (B,):
        raise ConfigError(
            f"batch['random_key'] must be a [{B}] int64 tensor (row_keys), got {keys.dtype} {list(keys.shape)}"
        )
    drop = (token_uniforms(keys, T) < shares[:, None]).to(ratio.device)  # [B, T]
    return torch.where(drop, torch.zeros_like(ratio), ratio)


def row_shares(share: float | Sequence[float] | None, staleness: Tensor | None, rows: int) -> Tensor:
    """The drop probability of each of ``rows`` rows: ``share`` itself, or ``share[staleness_i]`` (the last entry
    past its end) for a share per staleness level. [rows] float64 on the CPU."""
    if share is None or isinstance(share, int | float):
        return torch.full((rows,), float(share or 0.0), dtype=torch.float64)
    levels = torch.tensor([float(p) for p in share], dtype=torch.float64)  # [S]
    if levels.numel() == 1:
        return levels.expand(rows).clone()
    if staleness is None:
        raise ConfigError("a random_mask_share per staleness level needs batch['staleness'] ([B] integers)")
    level = staleness.detach().to("cpu", torch.int64)  # [B]
    if tuple(level.shape) != (rows,) or bool((level < 0).any()):
        raise ConfigError(f"batch['staleness'] must be [{rows}] integers >= 0, got {list(level.shape)}")
    return levels[level.clamp(max=levels.numel() - 1)]


def seqmask(ratio: Tensor, action_mask: Tensor, sao: SAO, batch: Mapping[str, Tensor]) -> Tensor:
    """Sequence-level masking: drop a whole trajectory whose geometric-mean ratio leaves (lo, hi)."""
    lo, hi = sao.ratio
    log_ratio = torch.where(action_mask, ratio.log(), torch.zeros_like(ratio))
    length = action_mask.sum(dim=1).clamp(min=1)  # [B]
    geo_mean = (log_ratio.sum(dim=1) / length).exp()  # [B]
    keep = (geo_mean > lo) & (geo_mean < hi)  # [B]
    return torch.where(keep[:, None], ratio, torch.zeros_like(ratio))


# ---------------------------------------------------------------------------------------------------------
# The integer hash behind the random mask. uint64 constants are held as the int64 with the same bits; torch's
# int64 + and * wrap modulo 2**64 and >> is arithmetic, so a logical shift masks the sign bits away.

_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # splitmix64's increment
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shift_right(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 bits by k (1 <= k <= 63)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: Tensor) -> Tensor:
    """splitmix64's finaliser on int64 tensors: a bijection of 64-bit words whose every output bit depends on
    every input bit. Elementwise, any shape; bit for bit the uint64 result, read as int64."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def _absorb(state: Tensor, value: Tensor | int) -> Tensor:
    """One more integer folded into a hash state (splitmix64's step with the value added to the counter)."""
    return mix64(state + value + _GOLDEN)


def row_keys(seed: int, step: int, rows: int, first_row: int = 0) -> Tensor:
    """The random mask's key of rows ``first_row .. first_row + rows − 1`` of step ``step`` of a run seeded
    ``seed``: [rows] int64 on the CPU, a function of those three integers alone."""
    state = _absorb(torch.tensor(int(seed), dtype=torch.int64), int(step))
    return _absorb(state, torch.arange(first_row, first_row + rows, dtype=torch.int64))


def token_uniforms(keys: Tensor, positions: int) -> Tensor:
    """A number in [0, 1) for each (row key, token position): the top 53 bits of the hash over 2**53, so that
    every value is exact in float64. ``keys`` [B] int64 → [B, positions] float64 on the CPU."""
    t = torch.arange(positions, dtype=torch.int64)  # [T]
    bits = _absorb(keys.to("cpu")[:, None], t[None, :])  # [B, T]
    return _shift_right(bits, 11).to(torch.float64) / float(2**53)
