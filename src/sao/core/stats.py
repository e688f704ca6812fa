"""Paired comparison of two models on the same eval tasks, with a 95% interval, a noise floor and a verdict.

SPEC §4, in symbols. Per task j a model's score s_j is its mean correctness over the task's samples.

* One training run per arm (scores ``[tasks]``): the task is the unit. d_j = after_j − before_j,
  delta = mean(d), interval = delta ± t(0.975, n−1) · sd(d) / √n over the n tasks.
* Several training seeds per arm (scores ``[seeds, tasks]``): the seed is the unit. Each seed's pass@1
  is its mean over tasks. With the same number of seeds on both sides the seeds are paired by index
  (seed s of one arm shares prompts and sampler seeds with seed s of the other) and the interval is a
  paired t over seeds with S−1 df. With unequal counts it is Welch's two-sample t over seed means; a side
  with a single run counts as a fixed reference (variance 0).
* Noise floor from R repeated evals of one model: floor = t(0.975, R−1) · √2 · run_std, where run_std is
  the sample sd of the R pass@1 values (the page's 0.132 = 4.303 · 1.414 · 0.0217).
* Verdict: ``improved`` / ``regressed`` only when the interval excludes 0 *and* |delta| exceeds the
  floor; ``flat`` only with ≥ 2 seeds per arm and the whole interval inside ± floor; otherwise
  ``unresolved``, and ``reason`` says why in words.

An optional proxy (e.g. training reward before and after) is reported beside the target; a proxy that
rises while the target falls — its whole interval below zero, not a noise-level dip — is flagged, because
that is what over-optimising a proxy looks like.

Left out on purpose: multiple-comparison corrections across many cells (a sweep reports each cell's
interval and says so) and bootstrap intervals (the t interval over tasks is what the page used).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats as sps

from sao.core.errors import ConfigError

ArrayLike = Sequence[float] | Sequence[Sequence[float]] | np.ndarray


@dataclass(frozen=True)
class Comparison:
    """The outcome of ``compare``. Every field is a plain number or string, ready for JSON."""

    delta: float
    ci_low: float
    ci_high: float
    noise_floor: float | None
    verdict: str  # "improved" | "regressed" | "flat" | "unresolved"
    reason: str
    unit: str  # "task" or "seed": what the interval is over
    n: int  # number of units
    before_mean: float
    after_mean: float
    proxy_delta: float | None = None
    proxy_diverges: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def noise_floor(run_std: float, runs: int) -> float:
    """t(0.975, R−1) · √2 · run_std: the smallest delta two evals of the *same* model exceed 5% of the
    time, given the sd of R repeated pass@1 values."""
    if runs < 2:
        raise ConfigError(f"run_std_runs must be >= 2 to estimate a noise floor, got {runs}")
    if not (math.isfinite(run_std) and run_std >= 0):
        raise ConfigError(f"run_std must be a finite number >= 0, got {run_std}")
    return float(sps.t.ppf(0.975, runs - 1) * math.sqrt(2.0) * run_std)


def run_std_of(pass_at_1: Sequence[float]) -> tuple[float, int]:
    """(run_std, R) from R repeated pass@1 values of one model: the sample sd (ddof = 1)."""
    values = np.asarray(pass_at_1, dtype=np.float64)
    if values.size < 2:
        raise ConfigError(f"need at least 2 repeated evals for a noise floor, got {values.size}")
    return float(values.std(ddof=1)), int(values.size)


def compare(
    before: ArrayLike,
    after: ArrayLike,
    *,
    run_std: float | None = None,
    run_std_runs: int | None = None,
    proxy: tuple[ArrayLike | float, ArrayLike | float] | None = None,
) -> Comparison:
    """Compare ``after`` against ``before`` on the same tasks (SPEC §4).

    ``before`` / ``after``: per-task scores, ``[tasks]`` or ``[seeds, tasks]``; the task axis must match.
    ``run_std`` / ``run_std_runs``: sd of R repeated pass@1 evals of one model, and R; without them there
    is no noise floor, so the verdict can be ``improved``/``regressed`` on the interval alone but never
    ``flat``. ``proxy``: (before, after) values of a proxy metric, scalars or arrays (their means are used).
    """
    b = _as_runs(before, "before")
    a = _as_runs(after, "after")
    if b.shape[1] != a.shape[1]:
        raise ConfigError(f"before and after must score the same tasks: {b.shape[1]} vs {a.shape[1]} tasks")
    floor = None
    if run_std is not None or run_std_runs is not None:
        if run_std is None or run_std_runs is None:
            raise ConfigError("run_std and run_std_runs go together: pass both or neither")
        floor = noise_floor(run_std, run_std_runs)

    seeds = max(b.shape[0], a.shape[0])
    if seeds == 1:
        d = a[0] - b[0]
        delta, half, n = _t_interval(d)
        unit = "task"
    elif b.shape[0] == a.shape[0]:
        d = a.mean(axis=1) - b.mean(axis=1)
        delta, half, n = _t_interval(d)
        unit = "seed"
    else:
        delta, half, n = _welch(b.mean(axis=1), a.mean(axis=1))
        unit = "seed"
    lo, hi = delta - half, delta + half
    verdict, reason = _verdict(delta, lo, hi, floor, min(b.shape[0], a.shape[0]), unit, n)

    proxy_delta, diverges = None, False
    if proxy is not None:
        p_before, p_after = (float(np.mean(np.asarray(x, dtype=np.float64))) for x in proxy)
        proxy_delta = p_after - p_before
        diverges = proxy_delta > 0 and hi < 0  # the proxy rose while the target fell beyond its interval
        if diverges:
            reason += (
                f" Warning: the proxy rose by {proxy_delta:+.3f} while the target fell by {delta:+.3f};"
                " the proxy is not tracking the target."
            )
    return Comparison(
        delta=float(delta),
        ci_low=float(lo),
        ci_high=float(hi),
        noise_floor=floor,
        verdict=verdict,
        reason=reason,
        unit=unit,
        n=int(n),
        before_mean=float(b.mean()),
        after_mean=float(a.mean()),
        proxy_delta=proxy_delta,
        proxy_diverges=diverges,
    )


def _as_runs(x: ArrayLike, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] == 0 or arr.shape[0] == 0:
        raise ConfigError(f"{name} must be per-task scores shaped [tasks] or [seeds, tasks], got {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ConfigError(f"{name} holds non-finite scores")
    return arr


def _t_interval(d: np.ndarray) -> tuple[float, float, int]:
    """(mean, half-width of the 95% t interval, n) of paired differences."""
    n = d.size
    if n < 2:
        raise ConfigError(f"need at least 2 paired units for an interval, got {n}")
    half = sps.t.ppf(0.975, n - 1) * d.std(ddof=1) / math.sqrt(n)
    return float(d.mean()), float(half), n


def _welch(b: np.ndarray, a: np.ndarray) -> tuple[float, float, int]:
    """Welch's interval for mean(a) − mean(b); a side with one run is a fixed reference (variance 0)."""
    vb = b.var(ddof=1) / b.size if b.size > 1 else 0.0
    va = a.var(ddof=1) / a.size if a.size > 1 else 0.0
    se2 = va + vb
    terms = [v**2 / (x.size - 1) for v, x in ((va, a), (vb, b)) if x.size > 1]
    df = se2**2 / sum(terms) if se2 > 0 and terms else max(a.size, b.size) - 1
    half = sps.t.ppf(0.975, df) * math.sqrt(se2)
    return float(a.mean() - b.mean()), float(half), int(max(a.size, b.size))


def _verdict(delta: float, lo: float, hi: float, floor: float | None, seeds: int, unit: str, n: int) -> tuple[str, str]:
    span = f"delta {delta:+.3f}, 95% interval [{lo:+.3f}, {hi:+.3f}] over {n} {unit}s"
    floor_txt = "no noise floor given" if floor is None else f"noise floor {floor:.3f}"
    excludes_zero = lo > 0 or hi < 0
    above_floor = floor is None or abs(delta) > floor
    if excludes_zero and above_floor:
        word = "improved" if delta > 0 else "regressed"
        return word, f"{word}: {span} excludes 0 and |delta| exceeds the {floor_txt}."
    if floor is not None and seeds >= 2 and -floor < lo and hi < floor:
        return "flat", f"flat: {span} lies inside ± the {floor_txt}, with {seeds} training seeds per arm."
    if excludes_zero:
        return "unresolved", f"unresolved: {span} excludes 0, but |delta| is within the {floor_txt}."
    why = f"unresolved: {span} covers 0"
    if seeds < 2:
        why += "; with one training seed per arm it cannot be called flat (pass --train-runs 2 or more)"
    elif floor is None:
        why += "; without a noise floor it cannot be called flat"
    else:
        why += f" and reaches beyond ± the {floor_txt}; more seeds or tasks would narrow it"
    return "unresolved", why + "."
