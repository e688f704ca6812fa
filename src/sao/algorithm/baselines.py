"""What the advantages are taken against: the critic (the method), or a baseline that needs no critic.

Each entry of ``sao.core.registry.BASELINES`` maps a batch's ``rewards`` ([B] terminal, or [B, T] per turn) and
``action_mask`` ([B, T]) to the values V the update uses in place of the critic's, or None to use the critic's:

    critic      None: V(s_t) = w · h_t + b, the value head (SAO's baseline)
    batch-mean  V_i = (Σ_j R_j − R_i) / (B − 1) on every action token of trajectory i: the mean return of the
                other trajectories of the batch (leave-one-out, so that a trajectory's own reward never enters its
                baseline), R_i its total reward
    oracle      V_i = prompt i's success rate under the sampler, from ``oracle_samples`` fresh rollouts of it that
                are never trained on, shrunk toward their grand mean (``sao.algorithm.oracle.shrunk_rates``): the
                positive control. The caller passes the rates as ``oracle_rates`` [B] (the trainer draws them)
    none        V = 0: the advantage is the λ-weighted return itself

With a constant V along a trajectory, GAE leaves A_k = λ^(L−k) (R − V) on a terminal reward: the batch-mean
baseline is the cheapest one a single rollout per prompt allows; the oracle is the best a prompt-level one could be
(if it does not beat the batch mean on a task, no critic of the prompt can). A baseline that reads more than the
rewards names it as a keyword (``oracle_rates``); the trainer passes only what a baseline's signature asks for.
Left out: per-prompt group baselines trained on (they need several trained rollouts of one prompt, which this method
does without).
"""

from __future__ import annotations

import torch

from sao.core.errors import ConfigError

Tensor = torch.Tensor


def critic(rewards: Tensor, action_mask: Tensor) -> Tensor | None:
    return None


def batch_mean(rewards: Tensor, action_mask: Tensor) -> Tensor:
    returns = rewards if rewards.dim() == 1 else rewards.sum(dim=1)  # [B] each trajectory's total reward R_i
    B = returns.shape[0]
    if B < 2:
        others = torch.zeros_like(returns, dtype=torch.float64)
    else:
        others = (returns.sum().double() - returns.double()) / (B - 1)  # [B] leave-one-out mean
    values = others[:, None].expand(action_mask.shape)  # [B, T]
    return torch.where(action_mask, values, torch.zeros_like(values))


def none(rewards: Tensor, action_mask: Tensor) -> Tensor:
    return torch.zeros(action_mask.shape, dtype=torch.float64, device=action_mask.device)


def oracle(rewards: Tensor, action_mask: Tensor, oracle_rates: Tensor | None = None) -> Tensor:
    if oracle_rates is None:
        raise ConfigError(
            "the oracle baseline needs each row's oracle rate (oracle_rates [B]): the local source draws "
            "them beside every batch (--rollout local)"
        )
    rates = oracle_rates.to(device=action_mask.device, dtype=torch.float64)  # [B]
    if tuple(rates.shape) != (action_mask.shape[0],):
        raise ConfigError(
            f"oracle_rates must have one rate per row, shape [{action_mask.shape[0]}], got {list(rates.shape)}"
        )
    values = rates[:, None].expand(action_mask.shape)  # [B, T]
    return torch.where(action_mask, values, torch.zeros_like(values))
