"""What the framework adapters share: SAO's loss on a framework's tensors, ``sao_gae`` on a framework's token-level
rewards, SAO's settings from the fields a framework's config already has, and the version check.

    loss       per token −c_t · logprob_t with c_t = f(ρ_t) · A_t (``SAO.correct``, N = 1): the framework's own
               token-mean aggregation divides by the batch's action tokens N, as ``SAO.update`` does
    sao_gae    λ_i = 1 − 1/(α L_i) per row, γ = 1, the bootstrap over observation tokens skipped, no whitening;
               value targets are the return-to-go (λ_critic = 1): ``sao.algorithm.update.gae`` and
               ``monte_carlo_returns`` themselves
    settings   band (lo, hi) = (1 − ε_low, 1 + ε_high) from the framework's clip fields, the "tis" cap from its
               dual-clip constant: the paper's band (0.7, 6.0) is ε_low = 0.3, ε_high = 5.0

Deliberately left out: the "random" control (its drop share and per-row keys have no field in any framework's
config) and a framework's own importance-sampling corrections (SAO's rule is the correction).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from sao.core.errors import ConfigError

if TYPE_CHECKING:
    from sao.algorithm.update import SAO

Tensor = torch.Tensor
log = logging.getLogger("sao.integrations")

GAE_NAME = "sao_gae"
UNOFFERED_RULES = ("random",)  # needs a drop share and row keys that no framework's config carries


def rule_names() -> list[str]:
    """The correction rules a framework gets as losses: every rule in sao's registry but the random control."""
    from sao.core.registry import CORRECTIONS

    return [name for name in CORRECTIONS.names() if name not in UNOFFERED_RULES]


def loss_name(rule: str) -> str:
    return f"sao_{rule}"


def settings(rule: str, eps_low: float, eps_high: float, cap: float, keys: str) -> SAO:
    """SAO with rule ``rule``, band (1 − ``eps_low``, 1 + ``eps_high``) and "tis" cap ``cap``; a bad value is a
    ConfigError that names the framework's ``keys`` (how its config spells them)."""
    from sao.algorithm.update import SAO

    try:
        return SAO(correction=rule, ratio=(1.0 - float(eps_low), 1.0 + float(eps_high)), tis_cap=float(cap))
    except ConfigError as error:
        raise ConfigError(f"{keys}: {error}") from None


def policy_loss_terms(
    sao: SAO, logprobs: Tensor, sampler_logprobs: Tensor, advantages: Tensor, action_mask: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """Per-token −f(ρ_t) · A_t · logprob_t ([B, T], 0 where no gradient flows, ``logprobs`` keeps its graph) and
    the correction's stats, for a framework whose token-mean aggregation then divides by N.

    ``sampler_logprobs`` is what the sampler recorded (a framework's rollout log-probs); ``advantages`` are taken
    as given (a framework's estimator, already scaled when its reduction scales them)."""
    correction = sao.correct(
        {
            "logprobs": logprobs.detach(),
            "sampler_logprobs": sampler_logprobs,
            "advantages": advantages,
            "action_mask": action_mask.bool(),
        },
        normalizer=1.0,
    )
    c = correction.coefficients.to(logprobs.dtype)  # [B, T] f(ρ)·A, 0 off the tokens that carry gradient
    per_token = torch.where(correction.mask, -c * logprobs, torch.zeros_like(logprobs))  # [B, T]
    return per_token, correction.stats


def metrics(stats: Mapping[str, float]) -> dict[str, float]:
    """sao's stats as a framework's metric dict: ``sao/<name>``."""
    return {f"sao/{key}": float(value) for key, value in stats.items()}


def gae_and_returns(
    token_level_rewards: Tensor, values: Tensor, action_mask: Tensor, alpha: float, *, name: str = GAE_NAME
) -> tuple[Tensor, Tensor]:
    """``sao_gae``: (advantages, value targets), [B, T] each in ``values``' dtype, 0 off the action tokens.

    A reward on a non-action token (a framework puts the score on the last response token, which is an
    observation when a reply was cut inside a tool's output) is credited to the last action token before it;
    one before any action token, or a non-finite one, is a ConfigError naming the row. A non-finite value gives
    its row's affected advantages 0 (``SAO.update``'s rule), said in one WARNING."""
    from sao.algorithm.update import gae, monte_carlo_returns

    mask = action_mask.bool()
    dtype = values.dtype
    rewards = token_level_rewards.detach().to(dtype)
    bad = ~torch.isfinite(rewards)
    if bool(bad.any()):
        i, t = (int(x) for x in bad.nonzero()[0])
        raise ConfigError(
            f"{name}: the reward of row {i} at token {t} is {float(rewards[i, t])}; rewards must be finite"
        )
    rewards = _credit_to_actions(rewards, mask, name)  # [B, T] every reward on an action token
    advantages, _ = gae(values.detach(), rewards, mask, alpha)
    returns = monte_carlo_returns(rewards, mask)
    nonfinite = mask & ~torch.isfinite(advantages)
    if bool(nonfinite.any()):
        log.warning(
            "%s: %d action tokens have a non-finite advantage (non-finite critic values); they get 0",
            name,
            int(nonfinite.sum()),
        )
    zero = torch.zeros_like(advantages)
    return torch.where(mask & torch.isfinite(advantages), advantages, zero), torch.where(mask, returns, zero)


def _credit_to_actions(rewards: Tensor, mask: Tensor, name: str) -> Tensor:
    """Each reward moved to the last action token at or before its position. [B, T] → [B, T]."""
    stray = (rewards != 0) & ~mask
    if not bool(stray.any()):
        return rewards
    B, T = rewards.shape
    position = torch.arange(T, device=rewards.device).expand(B, T)
    last_action = torch.where(mask, position, torch.full_like(position, -1)).cummax(dim=1).values  # [B, T]
    orphan = stray & (last_action < 0)
    if bool(orphan.any()):
        i, t = (int(x) for x in orphan.nonzero()[0])
        raise ConfigError(f"{name}: row {i} has a reward at token {t}, before any action token; it cannot be credited")
    moved = torch.where(mask, rewards, torch.zeros_like(rewards))
    return moved.scatter_add(1, last_action.clamp(min=0), torch.where(stray, rewards, torch.zeros_like(rewards)))


def check_version(framework: str, installed: str, tested: tuple[str, str]) -> bool:
    """True when ``tested[0] <= installed < tested[1]``; otherwise one WARNING naming the range (the adapter
    is used all the same: its hooks are checked where it calls them)."""
    from packaging.version import Version

    low, high = tested
    if Version(low) <= Version(installed) < Version(high):
        return True
    log.warning(
        "sao.integrations was tested with %s >=%s,<%s; %s %s is installed and is used as it is",
        framework,
        low,
        high,
        framework,
        installed,
    )
    return False
