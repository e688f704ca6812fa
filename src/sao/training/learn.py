"""The learning half of a step: the teacher-forced pass, ``SAO.update``, the policy step and the critic.

    pass     micro-batch by micro-batch: forward → values → ``SAO.update`` with the whole batch's N → backward;
             the accumulated gradient is exactly the whole batch's
    update   the whole batch's ``SAO.update`` from the kept log-probabilities and values (no second forward)
    step     clip to ``grad_clip`` and step AdamW, unless the loss or the gradient norm is not finite (skipped)
    critic   ``critic_steps`` squared-error updates of the value head on the stored hidden states, or of a value
             model of its own (``critic="model"``: its values come from a pass of its own, and each update runs
             it forward and backward again, micro-batch by micro-batch)
    retry    on out-of-memory the micro-batch halves and the pass is retried from its start

Under torchrun each rank passes only its rows (``sao.training.distributed``); sharded (``--shard fsdp``) the passes
run through the models' FSDP roots, FSDP sums the gradients, and the ranks agree on each micro-batch's loss being
finite before any backward (each backward is a collective). This is the only micro-batching in sao.
Deliberately left out: gradient accumulation across batches, learning-rate schedules and mixed-precision loss
scaling. Design notes: docs/design/learn.md.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from sao.algorithm.update import SAO, Update
from sao.core.registry import BASELINES
from sao.model.forward import TeacherForced, teacher_forced
from sao.model.policy import Models
from sao.model.sharding import full
from sao.rollout.types import Rollout
from sao.training.distributed import SINGLE, World


@dataclass
class PassResult:
    forward: TeacherForced  # logprobs [b, R] (detached) and hidden [b, R, H] of this process's rows (all on one)
    update: Update  # the whole batch's SAO.update (all ranks' rows)
    critic_values: torch.Tensor  # [B, R] the critic's V(s_t) before this step's critic updates (all ranks' rows)
    loss: float  # Σ over micro-batches of −Σ c·logprobs (+ the optional terms; NaN on critic-only steps)
    finite: bool  # False: a micro-batch's loss was not finite, so no gradient may be applied
    extra_stats: dict[str, float] = field(default_factory=dict)  # kl_ref_mean, entropy_mean when they are on


def baseline_values(
    name: str, rewards: torch.Tensor, actions: torch.Tensor, row_info: dict[str, torch.Tensor] | None
) -> torch.Tensor | None:
    """The baseline ``name``'s values [B, R] (None: the critic's), given the per-row extras its signature names
    (the oracle's ``oracle_rates``) out of ``row_info``."""
    baseline = BASELINES.get(name)
    wanted = inspect.signature(baseline).parameters
    extra = {key: value for key, value in (row_info or {}).items() if key in wanted}
    return baseline(rewards, actions, **extra)


def lr_factor(k: int, steps: int, warmup_steps: int, schedule: str) -> float:
    """The learning rate of policy step k (0-based) as a share of the base: linear warmup over ``warmup_steps``,
    then "constant" (1), "linear" (to 0 at the last step) or "cosine" (to 0)."""
    if k < warmup_steps:
        return (k + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    span = max(steps - warmup_steps, 1)
    progress = min((k - warmup_steps) / span, 1.0)
    return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


def policy_gradient_pass(
    models: Models,
    sao: SAO,
    rollout: Rollout,
    rewards: torch.Tensor,  # [B] terminal, or [B, R] each turn's reward on its last action token
    *,
    rows: int,
    with_policy_gradient: bool,
    temperature: float,
    logprob_chunk: int,
    world: World = SINGLE,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    row_info: dict[str, torch.Tensor] | None = None,
) -> PassResult:
    """The teacher-forced pass and the policy gradient, ``rows`` trajectories at a time (see the module doc).
    On a critic-only step no gradient is taken and ``loss`` is NaN. Under torchrun ``rollout`` and
    ``rewards`` are the whole batch and this process passes only its rows (``world.shard``): ``forward``,
    ``loss`` and ``finite`` are then this rank's, ``update`` the whole batch's. ``row_info``: further [B] entries of
    the update's batch, sliced with its rows (the random control's ``random_key`` and ``staleness``)."""
    mask = rollout.response_mask  # [B, R] every real response token (actions and observations)
    actions = rollout.action_mask  # [B, R] the tokens the model wrote
    n_tokens = float(actions.sum())  # N of the whole batch
    own = world.shard(len(mask))  # this process's rows (all of them on one process)
    fixed = baseline_values(sao.baseline, rewards, actions, row_info)  # [B, R] values, or None: the critic's
    logprobs, hidden, values, critic = [], [], [], []
    loss_total, finite = 0.0, True
    kl_total = entropy_total = 0.0
    for start in range(own.start, own.stop, rows):
        part = slice(start, min(start + rows, own.stop))
        pass_args = (rollout.prompt_ids[part], rollout.prompt_mask[part], rollout.response_ids[part], mask[part])
        with torch.set_grad_enabled(with_policy_gradient):
            forward = models.call(
                teacher_forced,
                models.policy,
                *pass_args,
                temperature=temperature,
                logprob_chunk=logprob_chunk,
                entropy=entropy_coef > 0 and with_policy_gradient,
            )
        with torch.no_grad():  # [b, R] V(s_t): the value model's own pass, or the head on the policy's hidden states
            part_critic = models.values(*pass_args) if models.critic is not None else models.value_head(forward.hidden)
        part_values = part_critic if fixed is None else fixed[part].to(part_critic)  # [b, R] the update's baseline
        if with_policy_gradient and finite:
            part_batch = {
                "logprobs": forward.logprobs.detach(),
                "sampler_logprobs": rollout.sampler_logprobs[part],
                "values": part_values,
                "rewards": rewards[part].to(part_values),
                "action_mask": actions[part],
                **{key: value[part] for key, value in (row_info or {}).items()},
            }
            loss = sao.update(part_batch, normalizer=n_tokens).policy_loss(forward.logprobs)
            on = actions[part]  # [b, R] the terms below are means over the whole batch's action tokens, like c_t
            if kl_coef > 0:  # β · KL(policy‖reference), k3 per token: exp(ref − lp) − (ref − lp) − 1 ≥ 0
                with torch.no_grad(), models.policy.disable_adapter():
                    reference = models.call(
                        teacher_forced, models.policy, *pass_args, temperature=temperature, logprob_chunk=logprob_chunk
                    ).logprobs
                gap = (reference - forward.logprobs)[on]  # [n]
                kl = (gap.exp() - gap - 1).sum() / n_tokens
                loss = loss + kl_coef * kl
                kl_total += kl.item()
            if entropy_coef > 0:  # − w · H: a bonus for keeping the distribution spread
                entropy = forward.entropy[on].sum() / n_tokens
                loss = loss - entropy_coef * entropy
                entropy_total += entropy.item()
            loss_total += loss.item()
            finite = bool(torch.isfinite(loss))
            if models.sharded:  # every rank runs the same backwards (each one a collective), or none
                finite = world.all(finite)
            if finite:
                loss.backward()
            # else: the step will be skipped; finish the pass for the stats and the critic
        logprobs.append(forward.logprobs.detach())
        hidden.append(forward.hidden)
        values.append(part_values)
        critic.append(part_critic)
        del forward
    forward = TeacherForced(logprobs=torch.cat(logprobs), hidden=torch.cat(hidden))
    whole_batch = {  # every rank's rows gathered (on one process: as passed)
        "logprobs": world.gather_rows(forward.logprobs),
        "sampler_logprobs": rollout.sampler_logprobs,
        "values": (values_all := world.gather_rows(torch.cat(values))),
        "rewards": rewards.to(forward.logprobs),
        "action_mask": actions,
        **(row_info or {}),
    }
    update = sao.update(whole_batch)
    extra = {}
    if with_policy_gradient and kl_coef > 0:
        extra["kl_ref_mean"] = world.total(kl_total)
    if with_policy_gradient and entropy_coef > 0:
        extra["entropy_mean"] = world.total(entropy_total)
    critic_values = values_all if fixed is None else world.gather_rows(torch.cat(critic))
    return PassResult(
        forward, update, critic_values, loss_total if with_policy_gradient else float("nan"), finite, extra
    )


def apply_policy_step(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], grad_clip: float, loss_finite: bool
) -> tuple[float, bool]:
    """Clip and step on the accumulated gradient, unless the loss or the gradient norm is not finite.
    Returns (grad_norm, skipped); the gradient is cleared either way."""
    grad_norm, skipped = float("nan"), True
    if loss_finite:  # sharded: the norm over every rank's shards (a collective), the same on every rank
        grad_norm = float(full(torch.nn.utils.clip_grad_norm_(params, grad_clip)))
        if math.isfinite(grad_norm):
            optimizer.step()
            skipped = False
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped


def critic_optimizer(
    value_head: nn.Module | dict[str, nn.Parameter], lr: float, bias_lr: float | None = None
) -> torch.optim.Optimizer:
    """AdamW on the value head (or the named trained parameters of a value model, ``Models.critic_trainable``), no
    weight decay; the head's bias at ``bias_lr`` when given (``--critic-bias-lr``).

    Why a rate of its own: Adam moves each parameter by about its rate per step whatever the gradient's scale, and
    the change in the mean value is Σ_i Δw_i · mean(h_i) + Δb. Hidden states share a large common component, so
    the weight term is many times the bias term: at one rate the head fits the batch mean through w · h, which
    varies token by token along a reply where a terminal return does not, and explains less than the mean does."""
    named = dict(value_head.named_parameters()) if isinstance(value_head, nn.Module) else value_head
    if bias_lr is None:
        return torch.optim.AdamW(list(named.values()), lr=lr, weight_decay=0.0)
    head_bias = ("linear.bias", "head.linear.bias")  # the head's alone: a value model's trunk has biases too
    biases = [p for name, p in named.items() if name in head_bias]
    weights = [p for name, p in named.items() if name not in head_bias]
    groups = [{"params": weights, "lr": lr}, {"params": biases, "lr": bias_lr}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, weight_decay=0.0)


def fit_critic(
    models: Models,
    optimizer: torch.optim.Optimizer,
    rollout: Rollout,
    targets: torch.Tensor,  # [B, R] Monte Carlo returns of the whole batch
    hidden: torch.Tensor,  # [b, R, H] this rank's hidden states from the pass (the head's input)
    steps: int,
    *,
    rows: int,
    world: World = SINGLE,
) -> float:
    """The critic's ``steps`` squared-error updates toward ``targets``: the value model's own passes
    (``value_model_steps``), or the value head's on the pass's ``hidden`` (``critic_steps``, this rank's rows);
    returns the first loss."""
    if models.critic is not None:
        return value_model_steps(models, optimizer, rollout, targets, steps, rows=rows, world=world)
    own = world.shard(len(targets))  # this rank's rows
    return critic_steps(models.value_head, optimizer, hidden, targets[own], rollout.action_mask[own], steps, world)


def critic_steps(
    value_head: nn.Module,
    optimizer: torch.optim.Optimizer,
    hidden: torch.Tensor,  # [B, R, H] detached
    targets: torch.Tensor,  # [B, R] Monte Carlo returns
    action_mask: torch.Tensor,  # [B, R]
    steps: int,
    world: World = SINGLE,
) -> float:
    """``steps`` squared-error updates toward the targets on action tokens; returns the first loss (the error
    of the values this step's advantages were computed with). One step is always measured, even at 0.
    Under torchrun the arguments are this rank's rows: the squared error is divided by the whole batch's
    token count and the value head's gradients are summed over the ranks, so every rank takes the step a
    single process takes on the whole batch."""
    if world.size > 1:
        return _critic_steps_sharded(value_head, optimizer, hidden, targets, action_mask, steps, world)
    first = float("nan")
    for i in range(max(steps, 1)):
        values = value_head(hidden)[action_mask]  # [N]
        loss = torch.mean((values - targets[action_mask].float()) ** 2)
        if i == 0:
            first = loss.item()
        if not torch.isfinite(loss):
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return first


def value_model_steps(
    models: Models,
    optimizer: torch.optim.Optimizer,
    rollout: Rollout,
    targets: torch.Tensor,  # [B, R] Monte Carlo returns of the whole batch
    steps: int,
    *,
    rows: int,
    world: World = SINGLE,
) -> float:
    """``critic="model"``: ``steps`` squared-error updates of the value model (its trunk and head) toward the
    targets on action tokens, ``rows`` trajectories of this rank's share at a time; returns the first loss (the
    error of the values this step's advantages were computed with). As ``critic_steps``: one update even at 0, and
    the mean is over the whole batch's action tokens, so the ranks' summed gradients are one process's. A step whose
    loss is not finite is not taken (every rank sees the same whole-batch loss)."""
    actions = rollout.action_mask  # [B, R]
    n_tokens = float(actions.sum())  # N of the whole batch
    own = world.shard(len(actions))  # this rank's rows
    params = list(models.critic_trainable().values())
    first = float("nan")
    for i in range(max(steps, 1)):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for start in range(own.start, own.stop, rows):
            part = slice(start, min(start + rows, own.stop))
            values = models.values(
                rollout.prompt_ids[part],
                rollout.prompt_mask[part],
                rollout.response_ids[part],
                rollout.response_mask[part],
            )[actions[part]]  # [n] this part's action tokens
            loss = ((values - targets[part][actions[part]].float()) ** 2).sum() / n_tokens  # its share of the mean
            total += loss.item()
            loss.backward()  # even when not finite: under FSDP every rank runs every backward (a collective)
        whole = world.total(total)  # the whole batch's mean squared error, the same on every rank
        if i == 0:
            first = whole
        if not math.isfinite(whole):
            break
        if not models.sharded:
            world.sum_gradients(params)  # data parallel: Σ over ranks (FSDP has summed them already)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return first


def _critic_steps_sharded(value_head, optimizer, hidden, targets, action_mask, steps: int, world: World) -> float:
    n_tokens = world.total(float(action_mask.sum()))  # N of the whole batch
    first = float("nan")
    for i in range(max(steps, 1)):
        values = value_head(hidden)[action_mask]  # [n] this rank's action tokens
        loss = ((values - targets[action_mask].float()) ** 2).sum() / n_tokens  # this rank's share of the mean
        whole = world.total(loss.item())  # the whole batch's mean squared error, the same on every rank
        if i == 0:
            first = whole
        if not math.isfinite(whole):
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        world.sum_gradients(value_head.parameters())
        optimizer.step()
    return first
