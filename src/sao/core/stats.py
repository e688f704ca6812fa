"""Paired comparison of two models on the same eval tasks, with a 95% interval, a noise floor and a verdict.

``compare``: with one training run per arm the task is the unit (a paired t over tasks, which compares two trained
models); with several seeds per arm the seed is the unit (paired by index, or Welch's t for unequal counts; the
untrained base as a fixed reference). Noise floor from R repeated evals: t(0.975, R−1) · √2 · run_std. Verdict,
only with ≥ 2 seeds per trained side: ``improved``/``regressed`` when the interval excludes 0 and |delta| exceeds
the floor, ``flat`` when the whole interval is inside ± floor; else ``unresolved``, with the reason in words. A
proxy that rises while the target falls is flagged. ``holm`` adjusts the p-values of a family planned in advance.

Deliberately left out: corrections applied after the fact to an exploratory grid, and bootstrap intervals.
Design notes: docs/design/stats.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from sao.core.errors import ConfigError

ArrayLike = Sequence[float] | Sequence[Sequence[float]] | np.ndarray


def _student_t():
    """scipy's Student t distribution, imported on first use: scipy.stats takes seconds to import on a busy
    machine, and only the statistics need it (``import sao``, ``sao train`` and ``sao --help`` do not)."""
    from scipy import stats

    return stats.t


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
    p_value: float  # two-sided t test of delta = 0, the same t and df as the interval
    about: str  # what the interval is about: "training procedure" or "two trained models"
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
    return float(_student_t().ppf(0.975, runs - 1) * math.sqrt(2.0) * run_std)


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
    before_fixed: bool = False,
) -> Comparison:
    """Compare ``after`` against ``before`` on the same tasks.

    ``before`` / ``after``: per-task scores, ``[tasks]`` or ``[seeds, tasks]`` (one row per training seed);
    the task axis must match. ``run_std`` / ``run_std_runs``: sd of R repeated pass@1 evals of one model, and
    R; without them there is no noise floor, so the verdict can be ``improved``/``regressed`` on the interval
    alone but never ``flat``. ``proxy``: (before, after) values of a proxy metric, scalars or arrays (their
    means are used). ``before_fixed``: ``before`` is one fixed model (the untrained base), not a training
    procedure, so its single row is a reference rather than a seed; only ``after`` then needs seeds.

    With one training seed on a trained side the verdict is ``unresolved`` whatever the interval says: the
    per-task interval is reported (``unit`` "task", ``about`` "two trained models") but holds no training noise.
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

    if before_fixed and b.shape[0] != 1:
        raise ConfigError(f"before_fixed: before must be one model's per-task scores, got {b.shape[0]} rows")
    if max(b.shape[0], a.shape[0]) == 1:
        delta, half, n, p = _t_interval(a[0] - b[0])
        unit = "task"
    elif b.shape[0] == a.shape[0]:
        delta, half, n, p = _t_interval(a.mean(axis=1) - b.mean(axis=1))
        unit = "seed"
    else:
        delta, half, n, p = _welch(b.mean(axis=1), a.mean(axis=1))
        unit = "seed"
    seeds = a.shape[0] if before_fixed else min(b.shape[0], a.shape[0])  # seeds on the trained side(s)
    about = "training procedure" if seeds >= 2 else "two trained models"
    if before_fixed and seeds < 2:
        about = "the base and one trained model"
    lo, hi = delta - half, delta + half
    verdict, reason = _verdict(delta, lo, hi, floor, seeds, unit, n, about)

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
        p_value=float(p),
        about=about,
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


def _t_interval(d: np.ndarray) -> tuple[float, float, int, float]:
    """(mean, half-width of the 95% t interval, n, two-sided p of mean = 0) of paired differences."""
    n = d.size
    if n < 2:
        raise ConfigError(f"need at least 2 paired units for an interval, got {n}")
    se = d.std(ddof=1) / math.sqrt(n)
    half = _student_t().ppf(0.975, n - 1) * se
    return float(d.mean()), float(half), n, _p_value(float(d.mean()), se, n - 1)


def _welch(b: np.ndarray, a: np.ndarray) -> tuple[float, float, int, float]:
    """Welch's interval (and p) for mean(a) − mean(b); a side with one run is a fixed reference (variance 0)."""
    vb = b.var(ddof=1) / b.size if b.size > 1 else 0.0
    va = a.var(ddof=1) / a.size if a.size > 1 else 0.0
    se2 = va + vb
    terms = [v**2 / (x.size - 1) for v, x in ((va, a), (vb, b)) if x.size > 1]
    df = se2**2 / sum(terms) if se2 > 0 and terms else max(a.size, b.size) - 1
    half = _student_t().ppf(0.975, df) * math.sqrt(se2)
    delta = float(a.mean() - b.mean())
    return delta, float(half), int(max(a.size, b.size)), _p_value(delta, math.sqrt(se2), df)


def _p_value(delta: float, se: float, df: float) -> float:
    """Two-sided p of the t statistic delta / se; a zero standard error gives 0 (a delta) or 1 (none)."""
    if se == 0:
        return 0.0 if delta != 0 else 1.0
    return float(2 * _student_t().sf(abs(delta) / se, df))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of a family of m p-values, in the order given: sort ascending, multiply the
    k-th smallest by (m − k + 1), carry the running maximum, cap at 1. Rejecting where the adjusted p < alpha
    keeps the chance of any false rejection in the family at most alpha, whatever the dependence."""
    m = len(p_values)
    for p in p_values:
        if not (isinstance(p, (int, float)) and math.isfinite(p) and 0.0 <= p <= 1.0):
            raise ConfigError(f"holm needs p-values in [0, 1], got {p!r}")
    adjusted, running = [0.0] * m, 0.0
    for k, i in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        running = max(running, min(1.0, (m - k) * float(p_values[i])))
        adjusted[i] = running
    return adjusted


def _verdict(
    delta: float, lo: float, hi: float, floor: float | None, seeds: int, unit: str, n: int, about: str
) -> tuple[str, str]:
    span = f"delta {delta:+.3f}, 95% interval [{lo:+.3f}, {hi:+.3f}] over {n} {unit}s"
    floor_txt = "no noise floor given" if floor is None else f"noise floor {floor:.3f}"
    excludes_zero = lo > 0 or hi < 0
    above_floor = floor is None or abs(delta) > floor
    if seeds < 2:
        why = (
            f"unresolved: with one training seed this compares {about}, not the training procedure: {span} "
            "holds the eval's noise, not training's"
        )
        if excludes_zero and above_floor:
            why += " (it separates those two models, which a second seed could reverse)"
        return "unresolved", why + "; pass --train-runs 2 or more to judge the procedure."
    if excludes_zero and above_floor:
        word = "improved" if delta > 0 else "regressed"
        return word, f"{word}: {span} excludes 0 and |delta| exceeds the {floor_txt}."
    if floor is not None and seeds >= 2 and -floor < lo and hi < floor:
        return "flat", f"flat: {span} lies inside ± the {floor_txt}, with {seeds} training seeds per arm."
    if excludes_zero:
        return "unresolved", f"unresolved: {span} excludes 0, but |delta| is within the {floor_txt}."
    why = f"unresolved: {span} covers 0"
    if floor is None:
        why += "; without a noise floor it cannot be called flat"
    else:
        why += f" and reaches beyond ± the {floor_txt}; more seeds or tasks would narrow it"
    return "unresolved", why + "."
