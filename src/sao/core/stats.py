"""Paired comparison of two models on the same eval tasks: an interval, a p-value that cannot overclaim, a verdict.

``compare``: with one training run per arm the task is the unit (a paired t over tasks: two trained models); with
several seeds per arm the seed is the unit (paired by index, or Welch's t; the untrained base as a fixed reference).
With fewer than ``EXACT_BELOW`` units the exact sign-flip (or permutation) p floors the t test's, and the sd is
floored at the eval's noise, so equal per-seed deltas are never certainty. The verdict (≥ 2 seeds per trained side)
says the direction — ``improved``/``regressed`` when the interval excludes 0, ``flat`` when two one-sided tests put
the effect inside ± δ, else ``unresolved`` — and apart its magnitude against δ (``beyond δ``: the minimum-effect
test; ``within δ``; ``undetermined``). ``verdict_rule="observed-above-delta"`` keeps the older rule (improved only
when also |delta| > δ) for plans written under it. ``holm`` adjusts a planned family; ``power``,
``seeds_for_power`` and ``mixture_power`` size one. For runs that collapse: ``rank_estimate`` (Hodges–Lehmann with
its signed-rank interval, the sign test) and ``collapse_compare`` (collapse rates, McNemar's exact test).

For the live loop's gate (``sao.training.gate``): ``noninferior`` (candidate − served over tasks against a margin),
``tasks_for_margin``, and ``mean_radius``, an always-valid confidence sequence for a running mean of rewards in
[0, 1] (``regression``: two of them, for a rollback that may be checked after every step).

Deliberately left out: corrections applied after the fact to an exploratory grid, and bootstrap intervals.
Design notes: docs/design/stats.md.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from sao.core.errors import ConfigError

ArrayLike = Sequence[float] | Sequence[Sequence[float]] | np.ndarray

VERDICT_RULES = ("direction", "observed-above-delta")  # compare's verdict rules; the first is the default
ALPHA = 0.05  # compare's default level: a 95% interval, and the 90% interval of the equivalence test
EXACT_BELOW = 6  # with fewer units than this the exact sign-flip / permutation p is computed and floors the t p
MOST_SAMPLES = 64  # scores that are multiples of 1/k for some k up to this count as means of k 0/1 samples


def _scipy_stats():
    """scipy.stats, imported on first use: it takes seconds to import on a busy machine, and only the statistics
    need it (``import sao``, ``sao train`` and ``sao --help`` do not)."""
    from scipy import stats

    return stats


def _student_t():
    return _scipy_stats().t


@dataclass(frozen=True)
class Comparison:
    """The outcome of ``compare``. Every field is a plain number or string, ready for JSON."""

    delta: float
    ci_low: float  # the 1 − alpha interval (95% at the default alpha)
    ci_high: float
    noise_floor: float | None
    verdict: str  # "improved" | "regressed" | "flat" | "unresolved"
    reason: str
    unit: str  # "task" or "seed": what the interval is over
    n: int  # number of units
    p_value: float  # two-sided p of delta = 0: max(p_t, p_exact), the rule named in p_rule
    about: str  # what the interval is about: "training procedure" or "two trained models"
    before_mean: float
    after_mean: float
    alpha: float = ALPHA
    smallest_effect: float | None = None  # δ the verdict used: the one given, else the noise floor, else None
    smallest_effect_source: str | None = None  # "given" | "noise floor" | None
    equivalence_low: float | None = None  # the 1 − 2·alpha interval (90%): flat when it lies inside ± δ
    equivalence_high: float | None = None
    p_equivalence: float | None = None  # two one-sided tests against ± δ: the larger p, each floored by its exact p
    p_t: float | None = None  # the t test's two-sided p (with the floored sd)
    p_exact: float | None = None  # the exact sign-flip / permutation p, with fewer than EXACT_BELOW units
    p_rule: str = "t"  # what set p_value: "t", "exact sign-flip" or "exact permutation"
    sd_floor: float | None = None  # the least sd per unit the interval may use (the eval's noise), if known
    sd_floored: bool = False  # the units' own sd was below sd_floor, so the interval used sd_floor
    proxy_delta: float | None = None
    proxy_diverges: bool = False
    verdict_rule: str = "direction"  # VERDICT_RULES: what improved/regressed needs (see ``compare``)
    magnitude: str | None = None  # against δ: "beyond δ" | "within δ" | "undetermined"; None: no δ, one seed or
    # the observed-above-delta rule
    p_beyond: float | None = None  # the minimum-effect test of |delta| <= δ: p < alpha when the interval clears δ
    finding: str = ""  # the verdict and the magnitude in a few words, e.g. "regressed, by less than δ"

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
    smallest_effect: float | None = None,
    alpha: float = ALPHA,
    verdict_rule: str = "direction",
) -> Comparison:
    """Compare ``after`` against ``before`` on the same tasks.

    ``before`` / ``after``: per-task scores, ``[tasks]`` or ``[seeds, tasks]`` (one row per training seed);
    the task axis must match. ``run_std`` / ``run_std_runs``: sd of R repeated pass@1 evals of one model, and
    R: the noise floor, and the least sd an interval may use. ``proxy``: (before, after) values of a proxy
    metric, scalars or arrays (their means are used). ``before_fixed``: ``before`` is one fixed model (the
    untrained base), not a training procedure, so its single row is a reference rather than a seed; only
    ``after`` then needs seeds. ``smallest_effect``: δ > 0, the smallest delta that matters, fixed before looking;
    without it the noise floor stands in (and the reason says so), and without either nothing is called flat.
    ``alpha``: the level of the test (the interval is 1 − alpha, the equivalence interval 1 − 2·alpha).
    ``verdict_rule``: "direction" (improved/regressed when the interval excludes 0, with the magnitude against δ
    given apart: a significant effect smaller than δ is still a finding) or "observed-above-delta" (improved/regressed
    only when also |delta| > δ, and no magnitude: the rule of comparisons made before the two were split).

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
    if smallest_effect is not None and not (_is_number(smallest_effect) and smallest_effect > 0):
        raise ConfigError(f"smallest_effect must be a number > 0, got {smallest_effect!r}")
    if not (_is_number(alpha) and 0 < alpha < 0.5):
        raise ConfigError(f"alpha must be a number in (0, 0.5), got {alpha!r}")
    if verdict_rule not in VERDICT_RULES:
        raise ConfigError(f"verdict_rule must be one of {list(VERDICT_RULES)}, got {verdict_rule!r}")
    effect, source = (
        (float(smallest_effect), "given")
        if smallest_effect is not None
        else ((floor, "noise floor") if floor is not None else (None, None))
    )

    if before_fixed and b.shape[0] != 1:
        raise ConfigError(f"before_fixed: before must be one model's per-task scores, got {b.shape[0]} rows")
    eval_sd, eval_sd_how = _eval_sd(b, a, run_std)
    test, unit, sd_min = _test_of_design(b, a, eval_sd, alpha, effect)
    seeds = a.shape[0] if before_fixed else min(b.shape[0], a.shape[0])  # seeds on the trained side(s)
    about = "training procedure" if seeds >= 2 else "two trained models"
    if before_fixed and seeds < 2:
        about = "the base and one trained model"
    if verdict_rule == "direction":
        verdict, magnitude, reason = _verdict_by_direction(test, effect, source, seeds, unit, about, alpha)
    else:
        (verdict, reason), magnitude = _verdict(test, effect, source, seeds, unit, about, alpha), None
    if test.sd_floored:
        reason += (
            f" The sd over {unit}s, {test.sd:.3g}, is below the eval's own noise, {sd_min:.3g} per {unit} "
            f"({eval_sd_how}), so the interval uses {sd_min:.3g}: no spread can be smaller than re-evaluating "
            "the same models."
        )
    if smallest_effect is not None and floor is not None and smallest_effect < floor:
        reason += f" δ {smallest_effect:.3f} is below the noise floor {floor:.3f} of re-evaluating one model."

    proxy_delta, diverges = None, False
    if proxy is not None:
        p_before, p_after = (float(np.mean(np.asarray(x, dtype=np.float64))) for x in proxy)
        proxy_delta = p_after - p_before
        diverges = proxy_delta > 0 and test.high < 0  # the proxy rose while the target fell beyond its interval
        if diverges:
            reason += (
                f" Warning: the proxy rose by {proxy_delta:+.3f} while the target fell by {test.delta:+.3f};"
                " the proxy is not tracking the target."
            )
    return Comparison(
        delta=float(test.delta),
        ci_low=float(test.low),
        ci_high=float(test.high),
        noise_floor=floor,
        verdict=verdict,
        reason=reason,
        unit=unit,
        n=int(test.n),
        p_value=float(test.p_value),
        about=about,
        before_mean=float(b.mean()),
        after_mean=float(a.mean()),
        alpha=float(alpha),
        smallest_effect=effect,
        smallest_effect_source=source,
        equivalence_low=float(test.eq_low),
        equivalence_high=float(test.eq_high),
        p_equivalence=test.p_equivalence,
        p_t=float(test.p_t),
        p_exact=test.p_exact,
        p_rule=test.rule,
        sd_floor=None if sd_min is None else float(sd_min),
        sd_floored=test.sd_floored,
        proxy_delta=proxy_delta,
        proxy_diverges=diverges,
        verdict_rule=verdict_rule,
        magnitude=magnitude,
        p_beyond=test.p_beyond if effect is not None else None,
        finding=finding(verdict, magnitude),
    )


def _test_of_design(
    b: np.ndarray, a: np.ndarray, eval_sd: float | None, alpha: float, effect: float | None
) -> tuple[_Test, str, float | None]:
    """The test the design calls for, on ``b`` and ``a`` ([runs, tasks] each): (its result, the unit, the least sd it
    may use). One model a side: the tasks are the units, paired. Seeds on both sides, as many: paired by index. One
    side a single run: the other's seeds against it. Otherwise Welch's test over the seeds' means. ``eval_sd``, the
    noise of re-evaluating one model, bounds the sd from below (a paired difference holds two evals' noise)."""
    if max(b.shape[0], a.shape[0]) == 1:  # one model each: the task is the unit
        sd_min = None if eval_sd is None else math.sqrt(2.0) * eval_sd * math.sqrt(b.shape[1])
        return _one_sample(a[0] - b[0], sd_min, alpha, effect), "task", sd_min
    if b.shape[0] == a.shape[0]:  # seeds paired by index: each difference holds two evals' noise
        sd_min = None if eval_sd is None else math.sqrt(2.0) * eval_sd
        return _one_sample(a.mean(axis=1) - b.mean(axis=1), sd_min, alpha, effect), "seed", sd_min
    if min(b.shape[0], a.shape[0]) == 1:  # one side is a fixed reference: its seeds against it
        d = a.mean(axis=1) - b.mean() if b.shape[0] == 1 else a.mean() - b.mean(axis=1)
        return _one_sample(d, eval_sd, alpha, effect), "seed", eval_sd
    return _welch(b.mean(axis=1), a.mean(axis=1), eval_sd, alpha, effect), "seed", eval_sd


FINDINGS = {"beyond δ": "by more than δ", "within δ": "by less than δ", "undetermined": "size against δ undetermined"}


def finding(verdict: str, magnitude: str | None) -> str:
    """The verdict and its magnitude against δ in a few words: "regressed, by less than δ", "improved, by more than
    δ", "improved, size against δ undetermined"; the verdict alone where there is no magnitude (or it is flat)."""
    if verdict in ("improved", "regressed") and magnitude in FINDINGS:
        return f"{verdict}, {FINDINGS[magnitude]}"
    return verdict


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _as_runs(x: ArrayLike, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] == 0 or arr.shape[0] == 0:
        raise ConfigError(f"{name} must be per-task scores shaped [tasks] or [seeds, tasks], got {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ConfigError(f"{name} holds non-finite scores")
    return arr


def samples_per_task(scores: np.ndarray) -> int | None:
    """k when every score in [0, 1] is a multiple of 1/k (the mean of k 0/1 samples), the least such k up to
    ``MOST_SAMPLES``; None for scores that are not (a graded reward, a made-up number)."""
    if scores.size == 0 or scores.min() < 0 or scores.max() > 1:
        return None
    for k in range(1, MOST_SAMPLES + 1):
        if np.all(np.abs(scores * k - np.round(scores * k)) < 1e-6):
            return k
    return None


def _eval_sd(b: np.ndarray, a: np.ndarray, run_std: float | None) -> tuple[float | None, str]:
    """(sd of one eval's pass@1 from the eval's sampling alone, how it was found): the repeated evals' run_std when
    given; else, for scores that are means of k 0/1 samples, the binomial sd √(mean_j p_j(1 − p_j) / (k · tasks))
    with p_j each task's mean over every row; else None (no floor)."""
    if run_std is not None:
        return float(run_std), "from run_std, the sd of repeated evals of one model"
    both = np.concatenate([b, a])
    k = samples_per_task(both)
    if k is None:
        return None, ""
    p = both.mean(axis=0)
    sd = math.sqrt(float(np.mean(p * (1 - p))) / (k * both.shape[1]))
    return sd, f"the binomial sd of {k} sample(s) per task over {both.shape[1]} tasks"


@dataclass(frozen=True)
class _Test:
    delta: float
    low: float
    high: float
    eq_low: float
    eq_high: float
    n: int
    df: float
    p_t: float
    p_exact: float | None
    exact_least: float | None  # the least two-sided p the exact test can give with these units
    exact_kind: str  # "sign-flip" or "permutation"
    exact_over: str  # what the exact test runs over, in words: "3 units", "the 10 labellings of 3 and 2 units"
    exact_with: str  # the units it had: "3 units", "3 and 2 units"
    exact_count: int  # how many equally likely sign patterns or labellings: 1 / count is the least one-sided p
    p_equivalence: float | None
    p_equivalence_exact: float | None
    sd: float  # the units' own sd (Welch: the larger group sd)
    sd_floored: bool
    p_beyond: float | None = None  # the minimum-effect test against δ (twice the one-sided p, at most 1)

    @property
    def p_value(self) -> float:
        return max(self.p_t, self.p_exact or 0.0)

    @property
    def rule(self) -> str:
        return f"exact {self.exact_kind}" if self.p_exact is not None and self.p_exact > self.p_t else "t"


def _t_parts(delta: float, se: float, df: float, alpha: float, effect: float | None) -> tuple[float, ...]:
    """(half-width at 1 − alpha, half-width at 1 − 2·alpha, two-sided p, equivalence p or NaN) of a t statistic."""
    t = _student_t()
    half, half_eq = t.ppf(1 - alpha / 2, df) * se, t.ppf(1 - alpha, df) * se
    if se == 0:  # no spread and no floor to put under it: a point
        p = 0.0 if delta != 0 else 1.0
        p_eq = math.nan if effect is None else (0.0 if -effect < delta < effect else 1.0)
        return float(half), float(half_eq), p, p_eq
    p = float(2 * t.sf(abs(delta) / se, df))
    p_eq = math.nan if effect is None else float(max(t.sf((delta + effect) / se, df), t.cdf((delta - effect) / se, df)))
    return float(half), float(half_eq), p, p_eq


def _beyond_t(delta: float, se: float, df: float, effect: float | None) -> float | None:
    """Twice the t test's one-sided p of H0 |delta| <= δ on the side delta fell (at most 1): below alpha exactly when
    the 1 − alpha interval clears δ. 1 when |delta| <= δ; None without a δ."""
    if effect is None:
        return None
    if abs(delta) <= effect:
        return 1.0
    if se == 0:
        return 0.0
    return float(min(1.0, 2 * _student_t().sf((abs(delta) - effect) / se, df)))


def _beyond_exact(null: np.ndarray, observed: float, side: float) -> float:
    """Twice the exact one-sided share of ``null`` at least as far as ``observed`` on ``side`` (+1 up, −1 down)."""
    shares = _tail_shares(null, observed)
    return min(1.0, 2 * (shares[1] if side > 0 else shares[2]))


def _tail_shares(null: np.ndarray, observed: float) -> tuple[float, float, float]:
    """(two-sided, upper, lower) shares of a null distribution at least as extreme as ``observed``, ties counted."""
    tol = 1e-12 * (1.0 + float(np.max(np.abs(null))) + abs(observed))
    return (
        float(np.mean(np.abs(null) >= abs(observed) - tol)),
        float(np.mean(null >= observed - tol)),
        float(np.mean(null <= observed + tol)),
    )


def _one_sample(d: np.ndarray, sd_min: float | None, alpha: float, effect: float | None) -> _Test:
    """Paired differences (or seeds against a fixed reference): the t test with its sd floored at ``sd_min``, and,
    with fewer than EXACT_BELOW units, the exact sign-flip test over all 2^n sign patterns of the differences."""
    n = d.size
    if n < 2:
        raise ConfigError(f"need at least 2 paired units for an interval, got {n}")
    sd = float(d.std(ddof=1))
    floored = sd_min is not None and sd < sd_min
    se = (sd_min if floored else sd) / math.sqrt(n)
    delta = float(d.mean())
    half, half_eq, p_t, p_eq = _t_parts(delta, se, n - 1, alpha, effect)
    p_beyond = _beyond_t(delta, se, n - 1, effect)
    p_exact = least = p_eq_exact = None
    if n < EXACT_BELOW:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))
        p_exact = _tail_shares(signs @ d / n, delta)[0]
        least = 2.0 ** (1 - n)
        if effect is not None:  # H0 mean <= −δ (reject when d + δ sits high) and H0 mean >= δ (d − δ sits low)
            p_eq_exact = max(
                _tail_shares(signs @ (d + effect) / n, delta + effect)[1],
                _tail_shares(signs @ (d - effect) / n, delta - effect)[2],
            )
        if p_beyond is not None and p_beyond < 1:  # H0 |mean| <= δ on delta's side: d shifted to that edge
            side = math.copysign(1.0, delta)
            p_beyond = max(p_beyond, _beyond_exact(signs @ (d - side * effect) / n, delta - side * effect, side))
    return _Test(
        delta=delta,
        low=delta - half,
        high=delta + half,
        eq_low=delta - half_eq,
        eq_high=delta + half_eq,
        n=n,
        df=n - 1,
        p_t=p_t,
        p_exact=p_exact,
        exact_least=least,
        exact_kind="sign-flip",
        exact_over=f"{n} units",
        exact_with=f"{n} units",
        exact_count=2**n,
        p_equivalence=_equivalence(p_eq, p_eq_exact),
        p_equivalence_exact=p_eq_exact,
        sd=sd,
        sd_floored=floored,
        p_beyond=p_beyond,
    )


def _welch(b: np.ndarray, a: np.ndarray, sd_min: float | None, alpha: float, effect: float | None) -> _Test:
    """Welch's interval (and p) for mean(a) − mean(b), each group's sd floored at ``sd_min``; with fewer than
    EXACT_BELOW seeds on the larger side, the exact permutation test over every assignment of the group labels."""
    sds = [float(x.std(ddof=1)) for x in (a, b)]
    floored = sd_min is not None and min(sds) < sd_min
    va, vb = ((max(s, sd_min or 0.0) ** 2) / x.size for s, x in zip(sds, (a, b), strict=True))
    se2 = va + vb
    df = se2**2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1)) if se2 > 0 else a.size + b.size - 2
    delta = float(a.mean() - b.mean())
    half, half_eq, p_t, p_eq = _t_parts(delta, math.sqrt(se2), df, alpha, effect)
    p_beyond = _beyond_t(delta, math.sqrt(se2), df, effect)
    n = int(max(a.size, b.size))
    p_exact = least = p_eq_exact = None
    if n < EXACT_BELOW:
        groups = [list(c) for c in itertools.combinations(range(a.size + b.size), a.size)]
        pick = np.zeros((len(groups), a.size + b.size), dtype=bool)
        for row, chosen in enumerate(groups):
            pick[row, chosen] = True

        def null(shift: float) -> np.ndarray:  # mean(a) − mean(b) under every labelling, a shifted by −shift first
            pooled = np.concatenate([a - shift, b])
            return (pick @ pooled) / a.size - ((~pick) @ pooled) / b.size

        p_exact = _tail_shares(null(0.0), delta)[0]
        least = (2.0 if a.size == b.size else 1.0) / len(groups)
        if effect is not None:
            p_eq_exact = max(
                _tail_shares(null(-effect), delta + effect)[1], _tail_shares(null(effect), delta - effect)[2]
            )
        if p_beyond is not None and p_beyond < 1:
            side = math.copysign(1.0, delta)
            p_beyond = max(p_beyond, _beyond_exact(null(side * effect), delta - side * effect, side))
    count = math.comb(a.size + b.size, a.size)
    return _Test(
        delta=delta,
        low=delta - half,
        high=delta + half,
        eq_low=delta - half_eq,
        eq_high=delta + half_eq,
        n=n,
        df=df,
        p_t=p_t,
        p_exact=p_exact,
        exact_least=least,
        exact_kind="permutation",
        exact_over=f"the {count} labellings of {a.size} and {b.size} units",
        exact_with=f"{a.size} and {b.size} units",
        exact_count=count,
        p_equivalence=_equivalence(p_eq, p_eq_exact),
        p_equivalence_exact=p_eq_exact,
        sd=max(sds),
        sd_floored=floored,
        p_beyond=p_beyond,
    )


def _equivalence(p_t: float, p_exact: float | None) -> float | None:
    return None if math.isnan(p_t) else max(p_t, p_exact or 0.0)


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


def least_exact_p(n: int, paired: bool = True) -> float:
    """The smallest two-sided p the exact test can give with n seeds per arm (0 from EXACT_BELOW seeds on, where it
    is not applied): 2^(1−n) over the sign patterns of n paired deltas, 2 / C(2n, n) over the labellings of two
    groups of n."""
    if n >= EXACT_BELOW:
        return 0.0
    return 2.0 ** (1 - n) if paired else 2.0 / math.comb(2 * n, n)


def seeds_for_a_verdict(alpha: float = ALPHA, paired: bool = True) -> int:
    """The fewest seeds per arm whose exact floor (``least_exact_p``) is below ``alpha``: with fewer, no verdict
    (improved, regressed, flat) is possible whatever the runs show (6 at alpha 0.05 for paired seeds)."""
    n = 2
    while least_exact_p(n, paired) >= alpha:
        n += 1
    return n


def power(delta: float, sd: float, n: int, alpha: float = ALPHA, paired: bool = True) -> float:
    """The chance that the two-sided t test at ``alpha`` rejects delta = 0 when the true delta is ``delta``:
    noncentral t. ``paired``: n pairs, ``sd`` the sd of the paired differences (df n − 1, noncentrality
    delta·√n / sd); else two groups of n, ``sd`` the sd within a group (df 2n − 2, noncentrality delta / (sd·√(2/n))).
    The t test alone: with fewer than EXACT_BELOW seeds the exact floor (``least_exact_p``) may forbid any claim."""
    if not (_is_number(sd) and sd > 0):
        raise ConfigError(f"power needs an sd > 0, got {sd!r}")
    if not (isinstance(n, int) and n >= 2):
        raise ConfigError(f"power needs n >= 2 units, got {n!r}")
    if not (_is_number(alpha) and 0 < alpha < 1) or not _is_number(delta):
        raise ConfigError(f"power needs a finite delta and alpha in (0, 1), got {delta!r}, {alpha!r}")
    st = _scipy_stats()
    df, ncp = (n - 1, delta * math.sqrt(n) / sd) if paired else (2 * n - 2, delta / (sd * math.sqrt(2.0 / n)))
    crit = st.t.ppf(1 - alpha / 2, df)
    # P(T > crit) + P(T < −crit), the lower tail as P(T' > crit) at −ncp: scipy's nct.cdf far in a tail is NaN
    total = st.nct.sf(crit, df, ncp) + st.nct.sf(crit, df, -ncp)
    if not math.isfinite(total):
        raise ConfigError(f"power: no finite value at delta {delta:g}, sd {sd:g}, n {n}")
    return float(min(total, 1.0))


def seeds_for_power(
    delta: float, sd: float, alpha: float = ALPHA, target: float = 0.8, paired: bool = True, most: int = 100_000
) -> int:
    """The fewest seeds per arm (at least 2) whose ``power`` reaches ``target`` and whose exact floor
    (``least_exact_p``) is below ``alpha``; a ConfigError past ``most``."""
    if not (_is_number(target) and 0 < target < 1) or not (_is_number(delta) and delta != 0):
        raise ConfigError(f"seeds_for_power needs a delta != 0 and a target in (0, 1), got {delta!r}, {target!r}")

    def enough(n: int) -> bool:
        return least_exact_p(n, paired) < alpha and power(delta, sd, n, alpha, paired) >= target

    high = 2
    while not enough(high):
        if high >= most:
            raise ConfigError(f"more than {most} seeds would be needed for power {target:g} at delta {delta:g}")
        high = min(2 * high, most)
    low = high // 2  # enough(low) is false (or low < 2); power grows with n
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if mid >= 2 and enough(mid) else (mid, high)
    return max(high, 2)


# --- runs that collapse: a rank estimand, the sign test, a collapse rate, and power from a mixture ---------------

TIE = 1e-12  # a per-seed delta this close to 0 is a tie (e.g. both runs collapsed to the same score)
EXACT_RANKS_UP_TO = 300  # the signed-rank distribution is computed exactly up to this many units, else normal
MIXTURE_DRAWS = 20_000  # simulated experiments per power from a mixture: its standard error is at most 0.0035


@dataclass(frozen=True)
class RankEstimate:
    """``rank_estimate``'s outcome: the Hodges–Lehmann shift of paired deltas with its signed-rank interval, and the
    sign test. Robust where the mean is not: a few collapsed seeds move it little."""

    hodges_lehmann: float  # the median of the n(n+1)/2 Walsh averages (d_i + d_j) / 2, i <= j
    low: float | None  # the interval: every shift the two-sided signed-rank test at alpha does not reject
    high: float | None  # (None: with so few units no interval reaches the level)
    confidence: float | None  # its exact coverage under the signed-rank null, at least 1 − alpha
    sign_p: float  # two-sided exact sign test of a median delta of 0, ties left out
    positive: int  # units with delta > 0
    negative: int
    ties: int  # units with delta 0 (both runs scored the same)
    n: int
    alpha: float

    def to_dict(self) -> dict:
        return asdict(self)


def signed_rank_null(n: int) -> np.ndarray:
    """P(W+ = w) for w = 0 .. n(n+1)/2: the signed-rank statistic of n untied units under the null (each sign a fair
    coin), exactly, by adding one rank at a time."""
    pmf = np.ones(1)
    for k in range(1, n + 1):
        grown = np.zeros(pmf.size + k)
        grown[: pmf.size] += pmf  # rank k negative
        grown[k:] += pmf  # rank k positive
        pmf = grown / 2
    return pmf


def _signed_rank_cut(n: int, alpha: float) -> tuple[int, float]:
    """(c, coverage): the largest c with P(W+ <= c) <= alpha / 2 (−1 when even W+ = 0 is likelier) and the
    interval's coverage 1 − 2·P(W+ <= c); exact up to ``EXACT_RANKS_UP_TO`` units, the normal approximation (with
    a continuity correction) above."""
    if n <= EXACT_RANKS_UP_TO:
        cdf = np.cumsum(signed_rank_null(n))
        below = np.nonzero(cdf <= alpha / 2 * (1 + 1e-12))[0]
        c = int(below[-1]) if below.size else -1
        return c, float(1 - 2 * cdf[c]) if c >= 0 else 0.0
    norm = _scipy_stats().norm
    mean, sd = n * (n + 1) / 4, math.sqrt(n * (n + 1) * (2 * n + 1) / 24)
    c = math.floor(mean + sd * norm.ppf(alpha / 2) - 0.5)
    return c, float(1 - 2 * norm.cdf((c + 0.5 - mean) / sd))


def _sign_p(positive: int, negative: int) -> float:
    m = positive + negative
    if m == 0:
        return 1.0
    return float(min(1.0, 2 * _scipy_stats().binom.cdf(min(positive, negative), m, 0.5)))


def rank_estimate(deltas: Sequence[float], alpha: float = ALPHA) -> RankEstimate:
    """The Hodges–Lehmann estimate of the shift of paired per-seed ``deltas`` (after − before) with its 1 − alpha
    interval, and the sign test.

    Walsh averages W = (d_i + d_j) / 2 over i <= j, sorted; HL = their median. The interval is [W_(c+1), W_(N−c)]
    with c the largest count whose signed-rank tail P(W+ <= c) is at most alpha / 2 (Tukey): the shifts θ for which
    the two-sided Wilcoxon signed-rank test of d − θ does not reject. The sign test counts deltas above and below 0
    (ties dropped) against a fair coin."""
    d = np.asarray(deltas, dtype=np.float64)
    if d.ndim != 1 or d.size < 2 or not np.all(np.isfinite(d)):
        raise ConfigError(f"rank_estimate needs at least 2 finite paired deltas, got {d.shape} values")
    if not (_is_number(alpha) and 0 < alpha < 0.5):
        raise ConfigError(f"alpha must be a number in (0, 0.5), got {alpha!r}")
    n = d.size
    i, j = np.triu_indices(n)
    walsh = np.sort((d[i] + d[j]) / 2)  # [n(n+1)/2]
    c, coverage = _signed_rank_cut(n, alpha)
    low, high = (float(walsh[c]), float(walsh[walsh.size - 1 - c])) if c >= 0 else (None, None)
    positive, negative = int(np.sum(d > TIE)), int(np.sum(d < -TIE))
    return RankEstimate(
        hodges_lehmann=float(np.median(walsh)),
        low=low,
        high=high,
        confidence=coverage if c >= 0 else None,
        sign_p=_sign_p(positive, negative),
        positive=positive,
        negative=negative,
        ties=n - positive - negative,
        n=n,
        alpha=float(alpha),
    )


@dataclass(frozen=True)
class CollapseComparison:
    """``collapse_compare``'s outcome: each arm's share of runs below the floor, and McNemar's exact test of the
    seeds where one arm collapsed and the other did not."""

    floor: float  # a run whose pass@1 is below this collapsed
    n: int  # seeds (pairs)
    after_collapsed: int
    before_collapsed: int
    after_only: int  # seeds where only after's run collapsed
    before_only: int  # seeds where only before's run collapsed
    rate_after: float
    rate_before: float
    delta: float  # rate_after − rate_before
    p_value: float  # McNemar's exact test: two-sided binomial of after_only among the discordant seeds
    alpha: float
    verdict: str  # "fewer collapses" | "more collapses" (after against before) | "unresolved"
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


COLLAPSE_VERDICTS = ("fewer collapses", "more collapses")


def collapse_compare(
    before: Sequence[float],
    after: Sequence[float],
    floor: float,
    alpha: float = ALPHA,
    names: tuple[str, str] = ("after", "before"),
) -> CollapseComparison:
    """Collapse rates of two arms over the same seeds (pass@1 per seed, paired by index): a run collapsed when its
    pass@1 is below ``floor``. McNemar's exact test: among the seeds where exactly one arm collapsed, is it either
    arm's run as often as a fair coin says? ``names``: (after, before) for the reason."""
    b, a = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if b.shape != a.shape or b.ndim != 1 or b.size < 1 or not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ConfigError(f"collapse_compare needs finite pass@1 per seed, paired: {b.shape} vs {a.shape}")
    if not (_is_number(floor) and 0 < floor <= 1):
        raise ConfigError(f"the collapse floor must be a pass@1 in (0, 1], got {floor!r}")
    if not (_is_number(alpha) and 0 < alpha < 0.5):
        raise ConfigError(f"alpha must be a number in (0, 0.5), got {alpha!r}")
    ca, cb = a < floor, b < floor
    after_only, before_only = int(np.sum(ca & ~cb)), int(np.sum(cb & ~ca))
    p = _sign_p(after_only, before_only)
    n = int(a.size)
    verdict = "unresolved"
    if p < alpha:
        verdict = COLLAPSE_VERDICTS[0] if after_only < before_only else COLLAPSE_VERDICTS[1]
    after_name, before_name = names
    reason = (
        f"{verdict}: below pass@1 {floor:g}, {after_name} collapsed in {int(ca.sum())} of {n} seeds and "
        f"{before_name} in {int(cb.sum())}; {after_only} seed(s) collapsed under {after_name} only, "
        f"{before_only} under {before_name} only (McNemar's exact p = {p:.3g}"
        + (
            f", at least {_sign_p(0, after_only + before_only):.3g} with {after_only + before_only} such seeds"
            if after_only + before_only
            else ", no seed separates them"
        )
        + ")."
    )
    return CollapseComparison(
        floor=float(floor),
        n=n,
        after_collapsed=int(ca.sum()),
        before_collapsed=int(cb.sum()),
        after_only=after_only,
        before_only=before_only,
        rate_after=float(ca.mean()),
        rate_before=float(cb.mean()),
        delta=float(ca.mean() - cb.mean()),
        p_value=p,
        alpha=float(alpha),
        verdict=verdict,
        reason=reason,
    )


@dataclass(frozen=True)
class Mixture:
    """Per-seed outcomes of two arms whose runs sometimes collapse. Each run of an arm collapses with that arm's
    probability and then scores ``collapsed``; a healthy run of before scores ``healthy`` plus noise, of after
    ``healthy`` + the effect plus noise, each run's noise normal with sd ``sd`` / √2, so the delta of two healthy
    runs has sd ``sd`` (the sd of the rest). Runs collapse independently of each other. Unclipped: a model of the
    spread, not of the [0, 1] range."""

    collapse_after: float
    collapse_before: float
    sd: float
    healthy: float
    collapsed: float = 0.0

    def __post_init__(self) -> None:
        for name in ("collapse_after", "collapse_before"):
            q = getattr(self, name)
            if not (_is_number(q) and 0 <= q < 1):
                raise ConfigError(f"{name} must be a probability in [0, 1), got {q!r}")
        if not (_is_number(self.sd) and self.sd > 0):
            raise ConfigError(f"the mixture's sd must be a number > 0, got {self.sd!r}")
        if not (_is_number(self.healthy) and _is_number(self.collapsed)):
            raise ConfigError(f"healthy and collapsed must be numbers, got {self.healthy!r}, {self.collapsed!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    def draw(self, effect: float, n: int, draws: int, rng: np.random.Generator) -> np.ndarray:
        """[draws, n] per-seed deltas (after − before) of ``draws`` simulated experiments of ``n`` paired seeds."""
        noise = rng.normal(0.0, self.sd / math.sqrt(2.0), size=(2, draws, n))
        after = np.where(rng.random((draws, n)) < self.collapse_after, self.collapsed, self.healthy + effect + noise[0])
        before = np.where(rng.random((draws, n)) < self.collapse_before, self.collapsed, self.healthy + noise[1])
        return after - before


def fit_mixture(before: Sequence[float], after: Sequence[float], floor: float) -> Mixture:
    """The mixture that describes two arms' per-seed pass@1 (paired by index): each arm's share of runs below
    ``floor``, the sd of the deltas of the seeds where neither collapsed, before's mean healthy pass@1 (after's
    minus nothing when before never stayed healthy) and the collapsed runs' mean score (0 when none collapsed)."""
    b, a = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if b.shape != a.shape or b.ndim != 1:
        raise ConfigError(f"fit_mixture needs pass@1 per seed, paired: {b.shape} vs {a.shape}")
    ca, cb = a < floor, b < floor
    both = ~ca & ~cb
    if both.sum() < 2:
        raise ConfigError(f"fit_mixture needs at least 2 seeds where neither run collapsed, got {int(both.sum())}")
    sd = float(np.std(a[both] - b[both], ddof=1))
    healthy = float(b[~cb].mean()) if (~cb).any() else float(a[~ca].mean())
    fallen = np.concatenate([a[ca], b[cb]])
    return Mixture(
        collapse_after=float(ca.mean()),
        collapse_before=float(cb.mean()),
        sd=sd,
        healthy=healthy,
        collapsed=float(fallen.mean()) if fallen.size else 0.0,
    )


def mixture_power(
    model: Mixture,
    effect: float,
    n: int,
    alpha: float = ALPHA,
    *,
    smallest_effect: float | None = None,
    draws: int = MIXTURE_DRAWS,
    seed: int = 0,
    ranks: bool = True,
) -> dict[str, float]:
    """Power by simulation: ``draws`` experiments of ``n`` paired seeds drawn from ``model`` with the true effect
    ``effect`` on healthy runs, each tested as the run will be. Returns the share of them in which

        t        the paired t test at ``alpha`` rejects delta = 0 (the verdict's direction)
        beyond   the minimum-effect test rejects |delta| <= ``smallest_effect`` (with a smallest effect only)
        rank     the Hodges–Lehmann interval excludes 0 (the signed-rank test rejects)  } with ``ranks`` only (the
        sign     the sign test rejects                                                  } rank test is O(n²) a draw)

    With fewer seeds than ``EXACT_BELOW`` the exact sign-flip floor applies: no power where it is at least alpha.
    A draw whose deltas do not vary at all rejects nothing (compare floors the sd at the eval's noise)."""
    if not (isinstance(n, int) and n >= 2):
        raise ConfigError(f"mixture_power needs n >= 2 seeds, got {n!r}")
    if not (_is_number(alpha) and 0 < alpha < 1) or not _is_number(effect):
        raise ConfigError(f"mixture_power needs a finite effect and alpha in (0, 1), got {effect!r}, {alpha!r}")
    st, rng = _scipy_stats(), np.random.default_rng(seed)
    c, _ = _signed_rank_cut(n, alpha) if ranks else (-1, 0.0)
    i, j = np.triu_indices(n) if ranks else (np.zeros(0, dtype=int), np.zeros(0, dtype=int))
    hits = {"t": 0, **({"rank": 0, "sign": 0} if ranks else {})}
    hits.update({"beyond": 0} if smallest_effect is not None else {})
    block = max(1, min(draws, 2_000_000 // max(i.size, n)))
    for start in range(0, draws, block):
        d = model.draw(effect, n, min(block, draws - start), rng)  # [b, n]
        mean, se = d.mean(axis=1), d.std(axis=1, ddof=1) / math.sqrt(n)
        spread = se > 0
        t = np.abs(mean) / np.where(spread, se, 1.0)
        hits["t"] += int(np.sum(spread & (2 * st.t.sf(t, n - 1) < alpha)))
        if smallest_effect is not None:
            far = (np.abs(mean) - smallest_effect) / np.where(spread, se, 1.0)
            hits["beyond"] += int(np.sum(spread & (np.abs(mean) > smallest_effect) & (2 * st.t.sf(far, n - 1) < alpha)))
        if not ranks:
            continue
        walsh = (d[:, i] + d[:, j]) / 2  # [b, n(n+1)/2]
        if c >= 0:
            hits["rank"] += int(np.sum(((walsh <= 0).sum(axis=1) <= c) | ((walsh >= 0).sum(axis=1) <= c)))
        positive, negative = (d > TIE).sum(axis=1), (d < -TIE).sum(axis=1)
        m = positive + negative
        sign_p = np.where(m > 0, np.minimum(1.0, 2 * st.binom.cdf(np.minimum(positive, negative), m, 0.5)), 1.0)
        hits["sign"] += int(np.sum(sign_p < alpha))
    out = {k: v / draws for k, v in hits.items()}
    if least_exact_p(n) >= alpha:
        out = {**out, "t": 0.0, **({"beyond": 0.0} if "beyond" in out else {})}
    return out


def power_beyond(effect: float, smallest_effect: float, sd: float, n: int, alpha: float = ALPHA) -> float:
    """The chance that the minimum-effect test (the paired t interval at 1 − alpha clears δ = ``smallest_effect``)
    rejects when the true delta is ``effect``: the noncentral t, df n − 1, noncentrality (|effect| − δ)·√n / sd."""
    if not (_is_number(sd) and sd > 0) or not (isinstance(n, int) and n >= 2):
        raise ConfigError(f"power_beyond needs an sd > 0 and n >= 2, got {sd!r}, {n!r}")
    if not (_is_number(smallest_effect) and smallest_effect > 0) or not _is_number(effect):
        raise ConfigError(f"power_beyond needs δ > 0 and a finite effect, got {smallest_effect!r}, {effect!r}")
    st = _scipy_stats()
    crit = st.t.ppf(1 - alpha / 2, n - 1)
    return float(st.nct.sf(crit, n - 1, (abs(effect) - smallest_effect) * math.sqrt(n) / sd))


def realised_power(
    before: Sequence[float],
    after: Sequence[float],
    smallest_effect: float,
    alpha: float,
    collapse_floor: float | None = None,
    expected_effect: float | None = None,
) -> dict[str, Any]:
    """What the plan's power turned out to be: the same test (paired t at ``alpha`` for δ over the same seeds) with
    the sd the runs gave in place of the one assumed; with ``collapse_floor``, also from the mixture fitted to the
    runs (``fit_mixture``; None where fewer than 2 seeds stayed healthy in both arms). With ``expected_effect``, the
    minimum-effect test's power at that true delta (a plan under the minimum-effect rule). Post hoc: it says how far
    the planning assumption was off, not what the result means."""
    b, a = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    n = int(a.size)
    sd = float(np.std(a - b, ddof=1)) if n >= 2 else math.nan
    ok = n >= 2 and sd > 0 and least_exact_p(n) < alpha
    effect = smallest_effect if expected_effect is None else expected_effect

    def at(sd_: float) -> float:
        if expected_effect is None:
            return power(smallest_effect, sd_, n, alpha)
        return power_beyond(expected_effect, smallest_effect, sd_, n, alpha)

    out: dict[str, Any] = {
        "seeds": n,
        "sd": sd,
        "alpha": float(alpha),
        "smallest_effect": float(smallest_effect),
        "effect": float(effect),
        "power": at(sd) if ok else 0.0,
        "mixture": None,
        "mixture_power": None,
    }
    if collapse_floor is not None and n >= 2:
        try:
            model = fit_mixture(b, a, collapse_floor)
        except ConfigError:
            return out
        out["mixture"] = model.to_dict()
        beyond = expected_effect is not None
        got = mixture_power(model, effect, n, alpha, smallest_effect=smallest_effect if beyond else None, ranks=False)
        out["mixture_power"] = got["beyond" if beyond else "t"]
    return out


# --- the live loop's gate: non-inferiority before a publish, a sequential test after it -----------------------


@dataclass(frozen=True)
class NonInferiority:
    """``noninferior``'s outcome: the paired mean difference (candidate − served) over ``n`` tasks, the lower bound
    of its one-sided (1 − alpha) interval, and whether that bound clears −margin."""

    delta: float
    lower: float
    margin: float
    alpha: float
    n: int
    p_value: float  # one-sided p of H0: delta <= −margin (the t test)
    candidate_mean: float
    served_mean: float
    passed: bool

    def to_dict(self) -> dict:
        return asdict(self)


def noninferior(served: Sequence[float], candidate: Sequence[float], margin: float, alpha: float) -> NonInferiority:
    """Is ``candidate`` no worse than ``served`` by more than ``margin``, task by task on the same tasks and the same
    sampling seeds? The paired t interval over tasks (``_one_sample`` with no sd floor: with common seeds two equal
    models score equally on every task, so a re-evaluation's noise is not there to floor it), one-sided at
    ``1 − alpha``: passed when its lower bound is above −margin (equivalently, the t test rejects delta <= −margin
    at ``alpha``)."""
    if not (_is_number(margin) and margin > 0):
        raise ConfigError(f"the gate's margin must be a number > 0, got {margin!r}")
    if not (_is_number(alpha) and 0 < alpha < 0.5):
        raise ConfigError(f"the gate's alpha must be a number in (0, 0.5), got {alpha!r}")
    b, a = np.asarray(served, dtype=np.float64), np.asarray(candidate, dtype=np.float64)
    if b.shape != a.shape or b.ndim != 1:
        raise ConfigError(f"served and candidate must score the same tasks: {b.shape} vs {a.shape}")
    test = _one_sample(a - b, None, alpha, margin)
    se = (test.sd / math.sqrt(test.n)) if test.n else 0.0
    if se > 0:
        p = float(_student_t().sf((test.delta + margin) / se, test.n - 1))
    else:
        p = 0.0 if test.delta > -margin else 1.0
    return NonInferiority(
        delta=test.delta,
        lower=test.eq_low,
        margin=float(margin),
        alpha=float(alpha),
        n=test.n,
        p_value=p,
        candidate_mean=float(a.mean()),
        served_mean=float(b.mean()),
        passed=bool(test.eq_low > -margin),
    )


def tasks_for_margin(margin: float, alpha: float, most: int = 10_000_000) -> int:
    """The fewest held-aside tasks whose one-sided (1 − alpha) paired t interval can be narrower than ``margin`` when
    the per-task differences have the worst sd a difference of two rewards in [0, 1] can have, 1:
    t(1 − alpha, n − 1) / √n <= margin."""
    if not (_is_number(margin) and margin > 0) or not (_is_number(alpha) and 0 < alpha < 0.5):
        raise ConfigError(f"tasks_for_margin needs margin > 0 and alpha in (0, 0.5), got {margin!r}, {alpha!r}")
    t = _student_t()
    z = float(_scipy_stats().norm.ppf(1 - alpha))
    n = max(2, math.ceil((z / margin) ** 2))  # the normal answer; t's heavier tail needs a few more
    while t.ppf(1 - alpha, n - 1) / math.sqrt(n) > margin:
        if n >= most:
            raise ConfigError(f"a margin of {margin:g} at alpha {alpha:g} needs more than {most} tasks")
        n += 1
    return n


# Robbins' normal mixture is tightest near this many samples: ρ = σ²·N with σ = 1/2 (any [0, 1] reward).
MIXTURE_TUNED_AT = 100


def mean_radius(n: int, alpha: float, tuned_at: int = MIXTURE_TUNED_AT) -> float:
    """The radius of an always-valid (1 − alpha) confidence sequence for the mean of i.i.d. rewards in [0, 1] after
    ``n`` of them: |mean_n − μ| <= radius(n) for every n at once, with probability >= 1 − alpha.

    Robbins' normal-mixture boundary for σ-sub-Gaussian increments (a reward in [0, 1] is 1/2-sub-Gaussian by
    Hoeffding's lemma): mixing exp(λ S_n − λ² n σ² / 2) over λ ~ N(0, 1/ρ) gives a nonnegative supermartingale
    sqrt(ρ / (nσ² + ρ)) · exp(S_n² / (2 (nσ² + ρ))), and Ville's inequality bounds the chance that it ever reaches
    1/alpha; so |S_n| < sqrt((nσ² + ρ) · log((nσ² + ρ) / (ρ · alpha²))) at every n. Peeking after every reward
    costs nothing more: the bound already holds uniformly over n. ∞ for n = 0."""
    if n <= 0:
        return math.inf
    if not (0 < alpha < 1):
        raise ConfigError(f"mean_radius needs alpha in (0, 1), got {alpha!r}")
    v, rho = n / 4.0, tuned_at / 4.0
    return math.sqrt((v + rho) * math.log((v + rho) / (rho * alpha**2))) / n


@dataclass(frozen=True)
class Regression:
    """``regression``'s outcome: the live mean difference (served − predecessor), its always-valid interval, and
    whether the whole interval lies below −margin (the served version regressed by more than the margin)."""

    delta: float
    lower: float
    upper: float
    margin: float
    alpha: float
    n: int  # rewards of the served version so far
    n_before: int  # rewards of its predecessor
    mean: float
    mean_before: float
    regressed: bool

    def to_dict(self) -> dict:
        return asdict(self)


def regression(total: float, n: int, total_before: float, n_before: int, margin: float, alpha: float) -> Regression:
    """Has the served version's live reward fallen below its predecessor's by more than ``margin``? Each running
    mean gets ``mean_radius`` at alpha / 2, so both confidence sequences hold at every sample count of either with
    probability >= 1 − alpha (a union bound), and so does the interval of their difference, [Δ − r − r', Δ + r + r']:
    a rollback checked after every step is wrong at most alpha of the time. Rewards are taken to lie in [0, 1]."""
    mean = total / n if n else math.nan
    before = total_before / n_before if n_before else math.nan
    r, r0 = mean_radius(n, alpha / 2), mean_radius(n_before, alpha / 2)
    delta = mean - before if n and n_before else math.nan
    lower, upper = (delta - r - r0, delta + r + r0) if n and n_before else (-math.inf, math.inf)
    return Regression(
        delta=delta,
        lower=lower,
        upper=upper,
        margin=float(margin),
        alpha=float(alpha),
        n=int(n),
        n_before=int(n_before),
        mean=mean,
        mean_before=before,
        regressed=bool(upper < -margin),
    )


def _pct(x: float) -> str:
    return f"{100 * x:.4g}%"


@dataclass(frozen=True)
class _Phrases:
    """The pieces every verdict's reason is written from."""

    span: str  # "delta +0.064, 95% interval [...] over 24 seeds"
    eq_interval: str  # "90% interval [...]"
    effect: str  # what δ is, in words
    over: str  # what the exact test runs over
    had: str  # the units it had
    exact: str  # the exact test's floor in words ("" without one)
    p: str  # how p was set


def _phrases(t: _Test, effect: float | None, source: str | None, unit: str, alpha: float) -> _Phrases:
    span = f"delta {t.delta:+.3f}, {_pct(1 - alpha)} interval [{t.low:+.3f}, {t.high:+.3f}] over {t.n} {unit}s"
    eq_interval = f"{_pct(1 - 2 * alpha)} interval [{t.eq_low:+.3f}, {t.eq_high:+.3f}]"
    if effect is None:
        effect_txt = "no smallest effect of interest or noise floor given"
    elif source == "given":
        effect_txt = f"the smallest effect of interest δ {effect:.3f}"
    else:
        effect_txt = f"δ, the noise floor {effect:.3f} (no smallest effect of interest was given)"
    over, had = (x.replace("units", unit + "s") for x in (t.exact_over, t.exact_with))
    exact_txt = ""
    if t.p_exact is not None:
        exact_txt = (
            f"the exact {t.exact_kind} p over {over} is {t.p_exact:.3g}: with {had} nothing better than "
            f"{t.exact_least:.3g} can be claimed"
        )
    p_txt = f"{exact_txt}; the t test's p is {t.p_t:.3g}" if t.rule != "t" else f"p = {t.p_value:.3g}, t test"
    return _Phrases(span=span, eq_interval=eq_interval, effect=effect_txt, over=over, had=had, exact=exact_txt, p=p_txt)


def _one_seed(about: str, span: str, separated: bool, alpha: float = ALPHA) -> str:
    why = (
        f"unresolved: with one training seed this compares {about}, not the training procedure: {span} "
        "holds the eval's noise, not training's"
    )
    if separated:
        why += " (it separates those two models, which a second seed could reverse)"
    fewest = seeds_for_a_verdict(alpha)
    return why + (
        f"; pass --train-runs {fewest} or more to judge the procedure (with fewer seeds the exact "
        f"sign-flip p cannot go below alpha {alpha:g})."
    )


def _not_separated(t: _Test, w: _Phrases, effect: float | None, alpha: float) -> str:
    """The reason of an unresolved verdict whose interval does not exclude 0 (or only by the t test)."""
    if t.p_t < alpha:
        return f"unresolved: {w.span} excludes 0 by the t test (p {t.p_t:.3g}), but {w.exact}."
    why = f"unresolved: {w.span} covers 0 ({w.p})"
    if effect is None:
        why += "; without a smallest effect of interest or a noise floor it cannot be called flat"
    else:
        why += f"; its {w.eq_interval} reaches beyond ± {w.effect}, so it is not shown flat either"
        if t.p_equivalence_exact is not None and t.p_equivalence_exact >= alpha:
            why += (
                f" (the exact equivalence p over {w.over} is {t.p_equivalence_exact:.3g}; with {w.had} it "
                f"cannot go below {1 / t.exact_count:.3g})"
            )
        why += "; more seeds or tasks would narrow it"
    return why + "."


def _verdict_by_direction(
    t: _Test, effect: float | None, source: str | None, seeds: int, unit: str, about: str, alpha: float
) -> tuple[str, str | None, str]:
    """(verdict, magnitude, reason): the direction when the interval excludes 0, whatever its size; apart, how it
    stands against δ: beyond (the interval clears δ), within (two one-sided tests put it inside ± δ), or
    undetermined. With one training seed: unresolved, and no magnitude."""
    w = _phrases(t, effect, source, unit, alpha)
    separated = t.p_value < alpha
    if seeds < 2:
        return "unresolved", None, _one_seed(about, w.span, separated, alpha)
    within = effect is not None and t.p_equivalence is not None and t.p_equivalence < alpha
    beyond = separated and t.p_beyond is not None and t.p_beyond < alpha
    magnitude = None if effect is None else "beyond δ" if beyond else "within δ" if within else "undetermined"
    eq_p = "" if t.p_equivalence is None else f"{t.p_equivalence:.3g}"
    if separated:
        word = "improved" if t.delta > 0 else "regressed"
        why = f"{word}: {w.span} excludes 0 ({w.p})."
        if effect is None:
            return word, None, why + f" Its size is judged against nothing ({w.effect})."
        edge = "+" if t.delta > 0 else "−"
        if beyond:
            why += (
                f" By more than δ: the interval lies beyond {edge}δ, {w.effect} (the minimum-effect test of "
                f"|delta| <= δ: p = {t.p_beyond:.3g})."
            )
        elif within:
            change = "gain" if t.delta > 0 else "loss"
            why += (
                f" By less than δ: its {w.eq_interval} lies inside ± {w.effect} (two one-sided tests: p = "
                f"{eq_p}): a real {change} smaller than the effect that matters."
            )
        else:
            why += (
                f" Its size against {w.effect} is undetermined: the interval reaches both inside and beyond "
                f"{edge}δ (the minimum-effect test: p = {t.p_beyond:.3g}; equivalence: p = {eq_p})."
            )
        return word, magnitude, why
    if within:
        return (
            "flat",
            magnitude,
            (
                f"flat: delta {t.delta:+.3f}, {w.eq_interval} over {t.n} {unit}s lies inside ± {w.effect}: "
                f"two one-sided tests at alpha {alpha:g} reject an effect that large (p = "
                f"{t.p_equivalence:.3g}), with {seeds} training seeds per arm."
            ),
        )
    return "unresolved", magnitude, _not_separated(t, w, effect, alpha)


def _verdict(
    t: _Test, effect: float | None, source: str | None, seeds: int, unit: str, about: str, alpha: float
) -> tuple[str, str]:
    """The observed-above-delta rule: improved/regressed only when the interval excludes 0 and |delta| > δ."""
    w = _phrases(t, effect, source, unit, alpha)
    separated = t.p_value < alpha
    big = effect is None or abs(t.delta) > effect
    if seeds < 2:
        return "unresolved", _one_seed(about, w.span, separated and big, alpha)
    if separated and big:
        word = "improved" if t.delta > 0 else "regressed"
        above = f"exceeds {w.effect}" if effect is not None else f"is judged on the interval alone ({w.effect})"
        return word, f"{word}: {w.span} excludes 0 ({w.p}) and |delta| {above}."
    if effect is not None and t.p_equivalence is not None and t.p_equivalence < alpha:
        return "flat", (
            f"flat: delta {t.delta:+.3f}, {w.eq_interval} over {t.n} {unit}s lies inside ± {w.effect}: "
            f"two one-sided tests at alpha {alpha:g} reject an effect that large (p = "
            f"{t.p_equivalence:.3g}), with {seeds} training seeds per arm."
        )
    if separated:
        return "unresolved", f"unresolved: {w.span} excludes 0 ({w.p}), but |delta| is within {w.effect}."
    return "unresolved", _not_separated(t, w, effect, alpha)
