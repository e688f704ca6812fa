"""What a baseline could have reached: each prompt's success rate from K rollouts, the explained variance that
sets as a ceiling, and a probe of whether a representation carries it. Pure math, no model.

    shrunk_rates  each prompt's mean return over its K rollouts, shrunk toward the mean of all of them by the
                  empirical-Bayes weight w = max(0, 1 − (mean s_i² / K) / Var(p̂)), s_i² the unbiased variance of
                  prompt i's returns: the "oracle" baseline. Its squared error is below both the raw K-sample mean's
                  and the batch mean's (in expectation, when w is right), so a few samples never make it a worse
                  baseline than the batch mean
    ceiling       the explained variance a prompt-level baseline could reach, 1 − E[Var(R | prompt)] / Var(R), which
                  for 0/1 returns is Var(p) / p̄(1 − p̄): per trajectory (each rollout counts once) and per token (each
                  rollout counts by its action tokens, as the critic's explained variance counts them, the prompt's
                  value its token-weighted mean), both without the K-sample bias (leave-one-out residuals, scaled by
                  (K − 1) / K per trajectory; the in-sample p̂ would explain part of its own noise)
    ridge_probe   a ridge regression from features to targets, cross-validated by group (a prompt's rows never sit
                  in the fold that scores them), its ridge penalty chosen inside each training fold: out-of-fold R²

A prompt-level baseline knows only the prompt; a per-token critic reads the reply so far too and may explain more.
The ceiling here bounds the first, and tells how much was there to win by knowing each prompt's difficulty.
Deliberately left out: drawing the rollouts (``sao.training.oracle``) and any model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from sao.core.errors import ConfigError

RIDGE_PENALTIES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3, 1e4)  # on standardised features, searched per fold
PROBE_FOLDS = 5


def _grid(returns: Sequence[Sequence[float]] | np.ndarray, name: str = "returns") -> np.ndarray:
    r = np.asarray(returns, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] < 1 or r.shape[1] < 2:
        raise ConfigError(f"{name} must be [prompts, K] with K >= 2 rollouts per prompt, got shape {list(r.shape)}")
    if not np.isfinite(r).all():
        raise ConfigError(f"{name} must be finite")
    return r


def shrunk_rates(returns: Sequence[Sequence[float]] | np.ndarray) -> tuple[np.ndarray, float]:
    """(each prompt's shrunk rate [P], the weight w on its own mean) from ``returns`` [P, K]. One prompt, or
    prompts whose means do not vary, give w = 0: every prompt gets the mean of all rollouts."""
    r = _grid(returns)
    k = r.shape[1]
    means = r.mean(axis=1)  # [P] p̂_i
    grand = float(r.mean())
    between = float(means.var(ddof=1)) if len(means) > 1 else 0.0  # Var(p̂) = Var(p) + E[s²] / K
    noise = float(r.var(axis=1, ddof=1).mean()) / k  # E[s_i²] / K: the part of Var(p̂) the K samples add
    weight = max(0.0, 1.0 - noise / between) if between > 0 else 0.0
    return grand + weight * (means - grand), weight


@dataclass(frozen=True)
class Ceiling:
    """What a prompt-level baseline could reach on a set of prompts, each rolled out K times."""

    prompts: int
    samples: int  # K
    mean: float  # p̄: the mean return over every rollout
    var_total: float  # Var(R) over rollouts
    var_prompt: float  # Var(p) between prompts, without the K-sample bias (may come out below 0 by chance)
    prompt_level: float  # 1 − E[Var(R | prompt)] / Var(R): Var(p)/p̄(1 − p̄) for 0/1 returns
    token_level: float  # the same with each rollout weighted by its action tokens, as the critic's EV counts
    in_sample: float  # Var(p̂) / Var(R) with p̂ fitted on the same rollouts (biased up by E[s²]/K; for reference)

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def ceiling(
    returns: Sequence[Sequence[float]] | np.ndarray, lengths: Sequence[Sequence[float]] | np.ndarray | None = None
) -> Ceiling:
    """The ceiling from ``returns`` [P, K] (each rollout's total return) and ``lengths`` [P, K] (its action tokens,
    the token-level weights; None: all equal). NaN where the returns do not vary."""
    r = _grid(returns)
    p, k = r.shape
    w = np.ones_like(r) if lengths is None else np.asarray(lengths, dtype=np.float64)
    if w.shape != r.shape or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ConfigError(f"lengths must be [prompts, K] like returns, finite, >= 0 and not all 0; got {w.shape}")
    total = float(r.var())
    within = float(r.var(axis=1, ddof=1).mean())  # E[s_i²], unbiased for E[Var(R | prompt)]
    # per token: the best constant for a prompt is its token-weighted mean; each rollout is scored against the mean
    # of the others (weighted), and its squared residual divided by 1 + Σ L_k² / (Σ L_k)² over the others, the part
    # the others' own noise adds (with equal lengths: (K − 1) / K, the per-trajectory correction)
    s1 = w.sum(axis=1, keepdims=True) - w  # [P, K] Σ of the other rollouts' lengths
    s2 = (w**2).sum(axis=1, keepdims=True) - w**2
    others = np.divide((w * r).sum(axis=1, keepdims=True) - w * r, s1, out=np.zeros_like(r), where=s1 > 0)
    residual = np.where(s1 > 0, (r - others) ** 2 / (1 + np.divide(s2, s1**2, out=np.zeros_like(r), where=s1 > 0)), 0.0)
    mean_w = float((w * r).sum() / w.sum())
    total_w = float((w * (r - mean_w) ** 2).sum() / w.sum())
    nan = float("nan")
    return Ceiling(
        prompts=p,
        samples=k,
        mean=float(r.mean()),
        var_total=total,
        var_prompt=total - within,
        prompt_level=1.0 - within / total if total > 0 else nan,
        token_level=1.0 - float((w * residual).sum() / w.sum()) / total_w if total_w > 0 else nan,
        in_sample=float(r.mean(axis=1).var()) / total if total > 0 else nan,
    )


def share_of(explained: float, reachable: float) -> float:
    """``explained`` as a share of ``reachable`` (NaN when either is not finite or nothing was reachable)."""
    if not (math.isfinite(explained) and math.isfinite(reachable)) or reachable <= 0:
        return float("nan")
    return explained / reachable


# --- the probe ----------------------------------------------------------------------------------------------------


def _fit(x: np.ndarray, y: np.ndarray, penalty: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Ridge on standardised ``x``: (feature means, scales, weights, intercept)."""
    mu, sd = x.mean(axis=0), x.std(axis=0)
    sd = np.where(sd > 0, sd, 1.0)
    z = (x - mu) / sd
    y0 = float(y.mean())
    gram = z.T @ z + penalty * len(z) * np.eye(z.shape[1])  # the penalty per row, so it means the same at any n
    beta = np.linalg.solve(gram, z.T @ (y - y0))
    return mu, sd, beta, y0


def _predict(model: tuple[np.ndarray, np.ndarray, np.ndarray, float], x: np.ndarray) -> np.ndarray:
    mu, sd, beta, y0 = model
    return ((x - mu) / sd) @ beta + y0


def _folds(groups: np.ndarray, folds: int, seed: int) -> list[np.ndarray]:
    """Each fold's rows: the groups shuffled by ``seed`` and dealt into ``folds`` folds."""
    names = np.unique(groups)
    order = np.random.default_rng(seed).permutation(len(names))
    fold_of = {names[g]: i % folds for i, g in enumerate(order)}
    which = np.array([fold_of[g] for g in groups])
    return [np.flatnonzero(which == i) for i in range(folds)]


def _choose(x: np.ndarray, y: np.ndarray, groups: np.ndarray, seed: int) -> float:
    """The penalty with the least squared error over an inner cross-validation on these rows."""
    inner = _folds(groups, min(PROBE_FOLDS - 1, len(np.unique(groups))), seed + 1)
    errors = []
    for penalty in RIDGE_PENALTIES:
        sse = 0.0
        for test in inner:
            train = np.setdiff1d(np.arange(len(y)), test)
            sse += float(((y[test] - _predict(_fit(x[train], y[train], penalty), x[test])) ** 2).sum())
        errors.append(sse)
    return RIDGE_PENALTIES[int(np.argmin(errors))]


def ridge_probe(
    features: np.ndarray,
    targets: np.ndarray,
    groups: np.ndarray | None = None,
    *,
    folds: int = PROBE_FOLDS,
    seed: int = 0,
) -> dict[str, float | int | list[float]]:
    """Out-of-fold R² of a ridge regression from ``features`` [n, d] to ``targets`` [n], the folds made of whole
    ``groups`` [n] (default: each row its own), the penalty chosen by an inner cross-validation in each training
    fold. R² = 1 − Σ(y − ŷ)² / Σ(y − ȳ)² over every row scored out of fold: about 0 (or below) when the features
    carry nothing about the targets, up to 1 when they determine them."""
    x, y = np.asarray(features, dtype=np.float64), np.asarray(targets, dtype=np.float64)
    if x.ndim != 2 or y.ndim != 1 or len(x) != len(y):
        raise ConfigError(f"ridge_probe needs features [n, d] and targets [n], got {list(x.shape)}, {list(y.shape)}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ConfigError("ridge_probe needs finite features and targets")
    g = np.arange(len(y)) if groups is None else np.asarray(groups)
    if len(g) != len(y):
        raise ConfigError(f"ridge_probe: {len(g)} groups for {len(y)} rows")
    k = min(folds, len(np.unique(g)))
    if k < 3:
        raise ConfigError(f"ridge_probe needs at least 3 groups to cross-validate, got {len(np.unique(g))}")
    predicted = np.empty_like(y)
    chosen = []
    for i, test in enumerate(_folds(g, k, seed)):
        train = np.setdiff1d(np.arange(len(y)), test)
        penalty = _choose(x[train], y[train], g[train], seed + 7 * (i + 1))
        chosen.append(penalty)
        predicted[test] = _predict(_fit(x[train], y[train], penalty), x[test])
    spread = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - predicted) ** 2).sum()) / spread if spread > 0 else float("nan")
    return {"r2": r2, "rows": len(y), "groups": len(np.unique(g)), "folds": k, "penalties": chosen}
