"""What a step leaves behind: its log record, and the reachability checks read off the records so far.

    record          one flat dict per step: phase, staleness, reward, masked (also by staleness and by the band's
                    side) and would-be masked share (over action tokens), the ratios' effective sample size, ratio
                    quantiles, KL(sampler‖policy), advantage, λ, explained variance, critic loss, length, truncation,
                    grad norm, skipped; which tokens fall outside the band (the most frequent, as text, with how
                    often they were seen) and where in the reply (by tenth of its action tokens) — and for
                    multi-turn trajectories turns, tool calls, tool use, tool error rate and the observation share
    reachability    once, after the first max(LAG, 4) stale batches: if they would mask almost nothing, warn
                    in words that the band is dead and the two arms will run the same experiment
    masking report  at the end of each staleness cycle (at most every 10 policy steps), one line of the masked
                    share so far at each staleness, so a dead or exploding band shows while the run is young

Deliberately left out: writing files (``sao.training.checkpoint``) and folding records into results
(``sao.experiment.results``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from sao.algorithm.update import Update
from sao.core.names import POLICY
from sao.rollout.types import Rollout


def masked_by_staleness(update: Update, action_mask: torch.Tensor, token_staleness: torch.Tensor) -> dict[str, float]:
    """The masked share among the action tokens at each staleness level ({"4": 0.12, ...}; a masked token is an
    action token with a finite ratio that carries no gradient), what the random control matches. Levels are each
    token's own (``token_staleness`` [B, T]): a row that spans versions counts at several levels."""
    level = token_staleness.to(action_mask.device)  # [B, T]
    masked = action_mask & ~update.mask & torch.isfinite(update.ratio)  # [B, T]
    out = {}
    for value in sorted(set(level.flatten().tolist())):  # every row's level (off its actions) and every token's
        tokens = action_mask & (level == value)  # [B, T]
        count = float(tokens.sum())
        out[str(value)] = float((masked & tokens).sum()) / count if count else 0.0
    return out


OUTSIDE_TOKENS_PER_STEP = 20  # the token strings a step records outside the band: its most frequent ones
POSITION_BINS = 10  # where in the reply: tenths of each row's action tokens


def outside_band(
    ratio: torch.Tensor,
    action_mask: torch.Tensor,
    response_ids: torch.Tensor,
    band: tuple[float, float],
    token_text: Callable[[Sequence[int]], list[str]] | None,
) -> dict[str, Any]:
    """Which action tokens the band (lo, hi) leaves out, whatever the rule (on ``dis`` exactly the masked ones, on
    ``none`` the ones it would have masked): the ``OUTSIDE_TOKENS_PER_STEP`` most frequent token ids among them as
    [text, below lo, above hi, seen among the action tokens] (text from ``token_text``, or the id without it), and
    per tenth of the reply (a token's rank among its row's action tokens over their count) how many fell outside
    and how many action tokens there were."""
    lo, hi = band
    counted = action_mask & torch.isfinite(ratio)  # [B, T]
    below, above = counted & (ratio <= lo), counted & (ratio >= hi)  # [B, T]
    outside = below | above
    rank = action_mask.long().cumsum(dim=1) - 1  # [B, T] k of each action token
    length = action_mask.sum(dim=1, keepdim=True).clamp(min=1)  # [B, 1] L_i
    tenth = (rank * POSITION_BINS // length).clamp(0, POSITION_BINS - 1)  # [B, T]
    by_position = torch.bincount(tenth[outside], minlength=POSITION_BINS)
    tokens_by_position = torch.bincount(tenth[counted], minlength=POSITION_BINS)
    ids = response_ids.to(ratio.device)
    top: list[list[Any]] = []
    if bool(outside.any()):
        found, counts = ids[outside].unique(return_counts=True)
        order = sorted(range(found.numel()), key=lambda i: (-int(counts[i]), int(found[i])))[:OUTSIDE_TOKENS_PER_STEP]
        chosen = [int(found[i]) for i in order]
        texts = token_text(chosen) if token_text is not None else [str(i) for i in chosen]
        for token, text in zip(chosen, texts, strict=True):
            here = ids == token  # [B, T]
            top.append([text, int((below & here).sum()), int((above & here).sum()), int((counted & here).sum())])
    return {
        "outside_band_tokens": top,
        "outside_band_by_position": by_position.tolist(),
        "tokens_by_position": tokens_by_position.tolist(),
    }


def step_record(
    *,
    step: int,
    phase: str,
    policy_step: int | None,
    policy_version: int,
    staleness: list[int],
    token_staleness: torch.Tensor,
    rollout: Rollout,
    rewards: torch.Tensor,
    update: Update,
    critic_loss: float,
    grad_norm: float,
    skipped: bool,
    band: tuple[float, float] | None = None,
    token_text: Callable[[Sequence[int]], list[str]] | None = None,
) -> dict[str, Any]:
    """The log record of one step (before the caller adds arm, seed, timings and the source's counters).
    ``staleness`` [B] is each row's (its oldest action token's), ``token_staleness`` [B, T] each token's. With the
    ``band``, the tokens outside it (``outside_band``), as text through ``token_text`` (a tokenizer's decode of
    single ids)."""
    s = update.stats
    ratio = update.ratio[rollout.action_mask]  # [N]
    log_ratio = ratio.log()
    kl = float(((ratio - 1) - log_ratio)[torch.isfinite(log_ratio)].mean())  # KL(sampler‖policy), k3 estimator
    histogram: dict[str, int] = {}
    for value in sorted(staleness):
        histogram[str(value)] = histogram.get(str(value), 0) + 1
    record = {
        "step": step,
        "phase": phase,
        "policy_step": policy_step,
        "staleness": max(staleness),
        "policy_version": policy_version,
        "reward_mean": float((rewards.sum(dim=1) if rewards.dim() == 2 else rewards).mean()),  # per trajectory
        **{k: s[k] for k in ("masked_share", "would_be_masked_share", "ratio_min", "ratio_mean", "ratio_max")},
        **{k: s[k] for k in ("masked_share_low", "masked_share_high", "ratio_ess_share")},
        **{k: s[k] for k in ("would_be_masked_share_low", "would_be_masked_share_high")},
        **{k: s[k] for k in ("ratio_p99", "abs_log_ratio_mean", "abs_log_ratio_max")},
        "kl_sampler_policy": kl,
        **{k: s[k] for k in ("admitted_share", "advantage_mean", "lambda_mean", "explained_variance", "nonfinite")},
        "critic_loss": critic_loss,
        "response_length": float(rollout.lengths.float().mean()),
        "truncation_share": float(rollout.truncated.float().mean()),
        "grad_norm": grad_norm,
        "skipped": skipped,
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_hist": histogram,
        "masked_share_by_staleness": masked_by_staleness(update, rollout.action_mask, token_staleness),
    }
    if band is not None:
        record.update(outside_band(update.ratio, rollout.action_mask, rollout.response_ids, band, token_text))
    if rollout.versions is not None:  # trajectories that span versions: action tokens at each staleness
        levels = token_staleness.to(rollout.action_mask.device)[rollout.action_mask].tolist()
        record["token_staleness_hist"] = {str(v): levels.count(v) for v in sorted(set(levels))}
    if rollout.turns is not None:  # multi-turn trajectories: how the agent used its environment
        turns = rollout.turns
        calls = float(turns.tool_calls.sum())
        record.update(
            turns_mean=float(turns.count.float().mean()),
            tool_calls_mean=float(turns.tool_calls.float().mean()),
            tool_use_share=float((turns.tool_calls > 0).float().mean()),
            tool_error_rate=float(turns.tool_errors.sum()) / calls if calls else 0.0,
            observation_share=1.0 - float(rollout.action_mask.sum()) / max(float(rollout.response_mask.sum()), 1.0),
        )
        if turns.faults is not None and turns.timeouts is not None and turns.context_cuts is not None:
            record.update(  # drawn episodes: what ended them early
                env_fault_share=float((turns.faults > 0).float().mean()),  # a tool that raised, hung, overflowed...
                env_timeouts=int(turns.timeouts.sum()),  # ... of those, past --env-timeout
                context_cuts=int(turns.context_cuts.sum()),  # the model's context full
            )
    return record


def dead_band_warning(
    records: list[dict[str, Any]], max_staleness: int, threshold: float, band: tuple[float, float], label: str
) -> str | None:
    """The reachability warning, on the record that completes the first max(LAG, 4) stale batches (None on
    every other record, so it is raised at most once and means the same thing in every run)."""
    record = records[-1]
    stale = [r for r in records if r["phase"] == POLICY and r["staleness"] > 0]
    if record["phase"] != POLICY or record["staleness"] == 0 or len(stale) != max(max_staleness, 4):
        return None
    share = sum(r["would_be_masked_share"] for r in stale) / len(stale)
    if share >= threshold:
        return None
    lo, hi = band
    return (
        f"[{label}] the band ({lo}, {hi}) is dead at these settings: over the first {len(stale)} stale "
        f"steps it would mask {share:.4%} of tokens (threshold {threshold:.2%}); the two "
        "arms will run the same experiment. Raise --lr or --lag, or narrow --band, to test the mask."
    )


def masking_line(records: list[dict[str, Any]], max_staleness: int, last_report: int | None, steps: int) -> str | None:
    """The masked share so far at each staleness, when the latest record ends a staleness cycle and the last
    line is at least 10 policy steps old (or the run ends); None otherwise."""
    record = records[-1]
    if record["phase"] != POLICY:
        return None
    k = record["policy_step"]
    cycle_end = record["staleness"] == max_staleness > 0 or (max_staleness == 0 and (k + 1) % 10 == 0)
    due = last_report is None or k + 1 - last_report >= 10 or k + 1 == steps
    if not (cycle_end and due):
        return None
    policy = [r for r in records if r["phase"] == POLICY]
    parts = []
    for s in sorted({r["staleness"] for r in policy}):
        rows = [r for r in policy if r["staleness"] == s]
        masked = sum(r["masked_share"] for r in rows) / len(rows)
        would = sum(r["would_be_masked_share"] for r in rows) / len(rows)
        parts.append(f"{s}: {masked:.4f}" + (f" (would-be {would:.4f})" if would != masked else ""))
    return f"policy step {k + 1}: masked share by staleness " + ", ".join(parts)
