"""The SAO update: length-adaptive GAE over a critic, and an off-policy correction rule. Pure tensor math.

B stale trajectories (padded to T tokens) become per-token coefficients. Trajectory i has L_i action tokens a_k and
reward r_k on a_k (``rewards`` [B]: terminal, on a_{L_i}; [B, T]: per turn, on each turn's last action token):

    λ_i  = max(0, 1 − 1 / (α L_i)),  α = 1.5,  γ = 1               length-adaptive GAE (or one fixed λ)
    A_k  = δ_k + λ_i A_{k+1},  δ_k = r_k + V(a_{k+1}) − V(a_k)     V(a_{L_i+1}) = 0; the bootstrap skips observations
    G_t  = Σ_{action tokens a_k at or after t} r_k                 value target: return-to-go
    ρ_t  = exp(logprobs_t − sampler_logprobs_t)                    against the sampler's own recorded probability
    c_t  = f(ρ_t) · A_t / N,  loss = −Σ_t c_t.detach() · logprobs_t      N = action tokens in the whole batch
    f    = dis: ρ if lo < ρ < hi else 0 | none: ρ | tis: min(ρ, C) | seqmask | random   (the one difference)

No advantage normalisation, no separate π_old; a non-finite ratio or advantage gets coefficient 0. Left out: the
model, the critic's optimisation and the backward (all ``torch.no_grad``; the caller multiplies ``coefficients``
into its own differentiable ``logprobs``). Design notes: docs/design/update.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from sao.core.config import AlgorithmSettings
from sao.core.errors import ConfigError
from sao.core.registry import CORRECTIONS

Tensor = torch.Tensor


@dataclass(frozen=True)
class SAO(AlgorithmSettings):
    """The algorithm: its settings (``sao.core.config.AlgorithmSettings`` — ratio band, gae_alpha, correction,
    tis_cap, random_mask_share, critic_steps, critic_warmup, the recipe page's defaults) and its update.

    Only ``update`` is math; ``critic_steps`` and ``critic_warmup`` are read by the trainer so that every
    knob of the method lives in one object.
    """

    @classmethod
    def of(cls, settings: AlgorithmSettings) -> SAO:
        """The algorithm a config's ``algorithm`` section describes."""
        return settings if isinstance(settings, cls) else cls(**dataclasses.asdict(settings))

    @torch.no_grad()
    def update(self, batch: Mapping[str, Tensor], *, normalizer: float | None = None) -> Update:
        """Advantages, value targets and policy-gradient coefficients for one batch.

        ``batch`` holds ``logprobs``, ``sampler_logprobs``, ``values`` and ``action_mask`` as [B, T]
        tensors (``action_mask`` bool) and ``rewards`` either as [B] (one terminal reward per trajectory,
        on its last action token) or as [B, T] (per-turn rewards: each turn's reward on that turn's last
        action token, 0 on every other token; a non-zero reward on a non-action token is a ConfigError).
        float32 or float64; the output has the dtype and device of ``logprobs``. ``value_targets`` are
        the return-to-go G_t, which for a [B] reward is R_i up to the last action token.

        ``normalizer`` is N, the action-token count of the whole batch; leave it None unless ``batch`` is
        a micro-batch of a larger one. Every rule is per trajectory, so micro-batch updates with the
        whole batch's N give exactly the whole batch's coefficients (the stats are the micro-batch's).

        Two optional [B] entries key the ``"random"`` control (``sao.algorithm.corrections.random``):
        ``random_key`` (int64, ``row_keys(seed, step, B)``: each row's integer key, sliced with the rows of a
        micro-batch) and ``staleness`` (integers: each row's level, for a share per staleness level).
        """
        logprobs, sampler_logprobs, values, rewards, action_mask = _validate(batch)
        advantages, lam = gae(values, rewards, action_mask, self.gae_alpha, self.gae_lambda)
        value_targets = monte_carlo_returns(rewards, action_mask)
        correction = self._correct(logprobs, sampler_logprobs, advantages, action_mask, normalizer, batch)

        stats = dict(correction.stats)
        nonfinite = stats.pop("nonfinite")
        has_actions = action_mask.any(dim=1)  # [B]
        stats["lambda_mean"] = float(lam[has_actions].mean())
        stats["explained_variance"] = explained_variance(values, value_targets, action_mask)
        stats["nonfinite"] = nonfinite
        zero = torch.zeros_like(advantages)
        return Update(
            advantages=torch.where(action_mask & torch.isfinite(advantages), advantages, zero),
            value_targets=value_targets,
            coefficients=correction.coefficients,
            ratio=correction.ratio,
            mask=correction.mask,
            stats=stats,
        )

    @torch.no_grad()
    def correct(self, batch: Mapping[str, Tensor], *, normalizer: float | None = None) -> Correction:
        """The correction alone, for advantages estimated elsewhere (a framework's estimator, ``gae`` run apart):
        ρ_t, f(ρ_t), the mask and c_t = f(ρ_t) · A_t / N, exactly as ``update`` computes them.

        ``batch`` holds ``logprobs``, ``sampler_logprobs``, ``advantages`` and ``action_mask`` as [B, T] tensors
        (plus the entries the rule reads, as in ``update``). ``normalizer`` is N as in ``update``; 1 leaves
        f(ρ_t) · A_t for a caller whose own aggregation divides by the batch's action tokens. Without
        ``sampler_logprobs`` it refuses: the ratio is never silently 1."""
        logprobs, sampler_logprobs, advantages, action_mask = _validate_correction(batch)
        return self._correct(logprobs, sampler_logprobs, advantages, action_mask, normalizer, batch)

    def _correct(
        self,
        logprobs: Tensor,
        sampler_logprobs: Tensor,
        advantages: Tensor,
        action_mask: Tensor,
        normalizer: float | None,
        batch: Mapping[str, Tensor],
    ) -> Correction:
        one = torch.ones_like(logprobs)
        ratio = torch.where(action_mask, (logprobs - sampler_logprobs).exp(), one)  # [B, T], 1 off-action
        weight = CORRECTIONS.get(self.correction)(ratio, action_mask, self, batch)  # [B, T] f(r)
        weight = torch.where(action_mask, weight, torch.zeros_like(weight))

        n_tokens = action_mask.sum() if normalizer is None else torch.tensor(float(normalizer), dtype=ratio.dtype)
        finite = torch.isfinite(ratio) & torch.isfinite(advantages)
        mask = action_mask & finite & (weight != 0)  # [B, T] tokens that carry gradient
        zero = torch.zeros_like(ratio)
        coefficients = torch.where(mask, weight * advantages, zero) / n_tokens  # [B, T]
        stats = _stats(self, ratio, weight, advantages, action_mask, mask)
        return Correction(coefficients=coefficients, ratio=ratio, mask=mask, stats=stats)


@dataclass(frozen=True)
class Update:
    """What one ``SAO.update`` returns. All tensors are [B, T], detached, zero off the action tokens
    (``ratio`` is 1 there; ``value_targets`` also cover an observation token that an action token follows)."""

    advantages: Tensor
    value_targets: Tensor
    coefficients: Tensor
    ratio: Tensor
    mask: Tensor
    stats: dict[str, float] = field(default_factory=dict)

    def policy_loss(self, logprobs: Tensor) -> Tensor:
        """−Σ c_t · logprobs_t with the coefficients held constant (``logprobs`` keeps its graph)."""
        return -(self.coefficients.detach().to(logprobs.dtype) * logprobs).sum()


@dataclass(frozen=True)
class Correction:
    """What ``SAO.correct`` returns: the coefficients, ratio and mask as in ``Update`` ([B, T], detached) and the
    stats that need no critic (``Update.stats`` less ``lambda_mean`` and ``explained_variance``)."""

    coefficients: Tensor
    ratio: Tensor
    mask: Tensor
    stats: dict[str, float] = field(default_factory=dict)

    def policy_loss(self, logprobs: Tensor) -> Tensor:
        """−Σ c_t · logprobs_t with the coefficients held constant (``logprobs`` keeps its graph)."""
        return -(self.coefficients.detach().to(logprobs.dtype) * logprobs).sum()


# ---------------------------------------------------------------------------------------------------------
# The estimators, usable on their own.


def gae_lambda(lengths: Tensor, alpha: float, dtype: torch.dtype = torch.float64) -> Tensor:
    """λ_i = max(0, 1 − 1/(α L_i)); 0 for an empty trajectory. ``lengths`` [B] → [B] of ``dtype``."""
    lengths = lengths.to(dtype)
    lam = 1.0 - 1.0 / (alpha * lengths.clamp(min=1))
    return torch.where(lengths > 0, lam.clamp(min=0.0), torch.zeros_like(lam))


def gae(
    values: Tensor, rewards: Tensor, action_mask: Tensor, alpha: float, fixed: float | None = None
) -> tuple[Tensor, Tensor]:
    """Length-adaptive GAE with γ = 1 over the action tokens only. Returns (advantages [B,T], λ [B]).
    ``fixed``: one λ for every trajectory instead of λ(L) (``--gae-lambda``; 1: no bootstrapping).

    ``rewards`` is [B] (R_i on the last action token) or [B, T] (r_k read at each action token; entries
    on non-action tokens are ignored here, ``SAO.update`` rejects non-zero ones). The action tokens of
    each row are packed to the left in order (observation tokens and padding drop out, so V(a_{k+1}) is
    the value at the next *action* token), the recurrence A_k = δ_k + λ A_{k+1} is solved for all rows
    at once by recursive doubling (log2 T vector steps, no loop over tokens), and the result is
    scattered back to the original positions.
    """
    B, T = values.shape
    lengths = action_mask.sum(dim=1)  # [B] L_i
    lam = gae_lambda(lengths, alpha, values.dtype)  # [B]
    if fixed is not None:  # one λ for every trajectory that has an action token
        lam = torch.where(lengths > 0, torch.full_like(lam, float(fixed)), torch.zeros_like(lam))
    rank = action_mask.cumsum(dim=1) - 1  # [B, T] k of each action token (0-based)
    slot = torch.where(action_mask, rank, torch.full_like(rank, T))  # non-actions go to a spill column

    packed = values.new_zeros(B, T + 1)
    packed.scatter_(1, slot, torch.where(action_mask, values, torch.zeros_like(values)))
    v = packed[:, :T]  # [B, T] V(a_k) packed left, 0 past L_i
    v_next = torch.cat([v[:, 1:], v.new_zeros(B, 1)], dim=1)  # [B, T] V(a_{k+1}), 0 past the end
    k = torch.arange(T, device=values.device)[None, :]  # [1, T]
    last = k == (lengths[:, None] - 1)  # [B, T] the terminal action token
    valid = k < lengths[:, None]  # [B, T]
    if rewards.dim() == 1:  # terminal: R_i at k = L_i − 1 (the path every [B] batch has always taken)
        r = torch.where(last, rewards[:, None].to(values.dtype), torch.zeros_like(v))
    else:  # per turn: pack each action token's reward left exactly like its value
        action_rewards = torch.where(action_mask, rewards.to(values.dtype), torch.zeros_like(values))  # [B, T]
        packed_rewards = values.new_zeros(B, T + 1)
        packed_rewards.scatter_(1, slot, action_rewards)
        r = packed_rewards[:, :T]  # [B, T] r_k packed left, 0 past L_i
    delta = torch.where(valid, r + v_next - v, torch.zeros_like(v))  # [B, T] δ_k

    adv = _discounted_reverse_sum(delta, lam)  # [B, T] A_k = Σ_j λ^(j-k) δ_j
    advantages = torch.gather(adv, 1, slot.clamp(max=T - 1))  # back to original positions
    return torch.where(action_mask, advantages, torch.zeros_like(advantages)), lam


def _discounted_reverse_sum(x: Tensor, lam: Tensor) -> Tensor:
    """y_k = Σ_{j≥k} λ^(j−k) x_j per row, by recursive doubling.

    After step s, y_k sums the 2^s terms x_k .. x_{k+2^s−1}; each step adds λ^(2^s) times the window
    that starts 2^s later. Only products of λ ∈ [0, 1] appear, so it is stable for any length (λ = 0
    gives y = x), unlike the closed form λ^(−k) Σ λ^j x_j.
    """
    y = x.clone()
    T = x.shape[1]
    factor = lam[:, None].clone()  # [B, 1] λ^(2^s)
    shift = 1
    while shift < T:
        shifted = torch.cat([y[:, shift:], y.new_zeros(y.shape[0], shift)], dim=1)
        y = y + factor * shifted
        factor = factor * factor
        shift *= 2
    return y


def monte_carlo_returns(rewards: Tensor, action_mask: Tensor) -> Tensor:
    """Value targets with γ = 1 and λ_critic = 1: the return-to-go G_t = Σ_{action tokens k at or after t} r_k.
    An observation token carries the return of the next action token; 0 after the last action token and
    on padding. [B] or [B, T] rewards → [B, T] in the rewards' dtype.

    [B] (terminal): R_i on every token that an action token follows. [B, T] (per turn): a reversed cumsum
    of the rewards on action tokens (entries on non-action tokens are ignored here; ``SAO.update`` rejects
    non-zero ones). With a single reward on the last action token both give the same tensor exactly: the
    cumsum only ever adds zeros to R_i.
    """
    if rewards.dim() == 1:
        action_at_or_after = action_mask.flip(1).cummax(dim=1).values.flip(1)  # [B, T]
        r = rewards[:, None].expand_as(action_mask)
        return torch.where(action_at_or_after, r, torch.zeros_like(r))
    action_rewards = torch.where(action_mask, rewards, torch.zeros_like(rewards))  # [B, T] r_k in place
    return action_rewards.flip(1).cumsum(dim=1).flip(1)  # [B, T] G_t


def explained_variance(values: Tensor, targets: Tensor, mask: Tensor) -> float:
    """1 − Var(target − V) / Var(target) over the masked tokens; NaN when the targets do not vary."""
    t = targets[mask]
    v = values[mask]
    ok = torch.isfinite(t) & torch.isfinite(v)
    t, v = t[ok], v[ok]
    if t.numel() < 2:
        return float("nan")
    var_t = t.var(unbiased=False)
    if var_t <= 0:
        return float("nan")
    return float(1.0 - (t - v).var(unbiased=False) / var_t)


# ---------------------------------------------------------------------------------------------------------
# Validation and diagnostics.

_KEYS = ("logprobs", "sampler_logprobs", "values", "rewards", "action_mask")


def _validate(batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    out = _validate_floats(batch, ("logprobs", "sampler_logprobs", "values"), _KEYS)
    logprobs = out[0]
    B, T = logprobs.shape
    dtype, device = logprobs.dtype, logprobs.device
    rewards = batch["rewards"]
    if not isinstance(rewards, torch.Tensor) or tuple(rewards.shape) not in ((B,), (B, T)):
        raise ConfigError(
            f"batch['rewards'] must have shape [{B}] (terminal) or [{B}, {T}] (per turn), got {_shape(rewards)}"
        )
    rewards = rewards.detach().to(device=device, dtype=dtype)
    out.append(rewards)
    action_mask = _validate_action_mask(batch, B, T, device)
    if rewards.dim() == 2:
        stray = (rewards != 0) & ~action_mask  # [B, T] NaN counts as non-zero
        if bool(stray.any()):
            i, t = (int(x) for x in stray.nonzero()[0])
            raise ConfigError(
                f"batch['rewards'][{i}, {t}] = {float(rewards[i, t])} is on a non-action token; "
                "a per-turn reward goes on its turn's last action token"
            )
    out.append(action_mask)
    return out[0], out[1], out[2], out[3], out[4]


_CORRECTION_KEYS = ("logprobs", "sampler_logprobs", "advantages", "action_mask")


def _validate_correction(batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    logprobs, sampler_logprobs, advantages = _validate_floats(batch, _CORRECTION_KEYS[:3], _CORRECTION_KEYS)
    B, T = logprobs.shape
    return logprobs, sampler_logprobs, advantages, _validate_action_mask(batch, B, T, logprobs.device)


def _validate_floats(batch: Mapping[str, Tensor], floats: tuple[str, ...], needed: tuple[str, ...]) -> list[Tensor]:
    """``floats[0]`` (``logprobs``) checked as a non-empty float32/float64 [B, T] tensor, the others as [B, T]
    tensors cast to its dtype and device; a ConfigError for anything missing or misshapen."""
    missing = [k for k in needed if k not in batch]
    if missing:
        raise ConfigError(f"batch is missing {missing}; it needs {list(needed)}")
    logprobs = batch[floats[0]]
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 2:
        raise ConfigError("batch['logprobs'] must be a [B, T] tensor")
    if logprobs.dtype not in (torch.float32, torch.float64):
        raise ConfigError(f"batch['logprobs'] must be float32 or float64, got {logprobs.dtype}")
    B, T = logprobs.shape
    if B == 0 or T == 0:
        raise ConfigError(f"batch is empty: logprobs has shape [{B}, {T}]; need B >= 1 and T >= 1")
    dtype, device = logprobs.dtype, logprobs.device
    out = [logprobs.detach()]
    for key in floats[1:]:
        x = batch[key]
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (B, T):
            raise ConfigError(f"batch[{key!r}] must have shape [{B}, {T}] like logprobs, got {_shape(x)}")
        out.append(x.detach().to(device=device, dtype=dtype))
    return out


def _validate_action_mask(batch: Mapping[str, Tensor], B: int, T: int, device: torch.device) -> Tensor:
    action_mask = batch["action_mask"]
    if not isinstance(action_mask, torch.Tensor) or tuple(action_mask.shape) != (B, T):
        raise ConfigError(f"batch['action_mask'] must have shape [{B}, {T}], got {_shape(action_mask)}")
    action_mask = action_mask.to(device=device, dtype=torch.bool)
    if not bool(action_mask.any()):
        raise ConfigError("batch['action_mask'] has no True entry: a batch needs at least one action token")
    return action_mask


def _shape(x: object) -> str:
    return str(list(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _stats(
    sao: SAO, ratio: Tensor, weight: Tensor, advantages: Tensor, action_mask: Tensor, mask: Tensor
) -> dict[str, float]:
    """The correction's diagnostics (``update`` adds ``lambda_mean`` and ``explained_variance`` before
    ``nonfinite``)."""
    n = action_mask.sum()
    lo, hi = sao.ratio
    r = ratio[action_mask]
    finite_r = r[torch.isfinite(r)]
    nonfinite = action_mask & ~(torch.isfinite(ratio) & torch.isfinite(advantages))
    has_actions = action_mask.any(dim=1)  # [B]
    admitted = mask.any(dim=1) & has_actions
    adv = advantages[action_mask]
    adv = adv[torch.isfinite(adv)]
    log_ratio = finite_r.log().abs() if finite_r.numel() else finite_r

    def q(x: Tensor, p: float) -> float:
        return float(torch.quantile(x.double(), p)) if x.numel() else float("nan")

    masked = action_mask & (weight == 0) & torch.isfinite(ratio)  # [B, T] action tokens the rule gave no gradient
    counted = action_mask & torch.isfinite(ratio)  # [B, T]
    below, above = counted & (ratio <= lo), counted & (ratio >= hi)  # [B, T] outside the band, by side
    r64 = finite_r.double()
    # Kish's effective sample size of the ratios as weights, (Σ r)² / Σ r², as a share of the tokens: 1 when every
    # ratio is equal, 1/N when one token carries all the weight
    ess_share = float(r64.sum() ** 2 / (r64.square().sum() * r64.numel())) if r64.numel() else float("nan")
    return {
        "tokens": float(n),
        "trajectories": float(action_mask.shape[0]),
        "masked_share": float(masked.sum() / n),
        "would_be_masked_share": float(
            (action_mask & torch.isfinite(ratio) & ~((ratio > lo) & (ratio < hi))).sum() / n
        ),
        "masked_share_low": float((masked & below).sum() / n),  # masked with ratio <= lo
        "masked_share_high": float((masked & above).sum() / n),  # masked with ratio >= hi
        "would_be_masked_share_low": float(below.sum() / n),  # the band's low side, on any rule
        "would_be_masked_share_high": float(above.sum() / n),  # the band's high side
        "ratio_ess_share": ess_share,
        "ratio_min": float(finite_r.min()) if finite_r.numel() else float("nan"),
        "ratio_mean": float(finite_r.mean()) if finite_r.numel() else float("nan"),
        "ratio_max": float(finite_r.max()) if finite_r.numel() else float("nan"),
        "ratio_p99": q(finite_r, 0.99),
        "abs_log_ratio_mean": float(log_ratio.mean()) if log_ratio.numel() else float("nan"),
        "abs_log_ratio_max": float(log_ratio.max()) if log_ratio.numel() else float("nan"),
        "admitted_share": float(admitted.sum() / has_actions.sum()),
        "advantage_mean": float(adv.mean()) if adv.numel() else float("nan"),
        "nonfinite": float(nonfinite.sum()),
    }
