"""Estimands for runs that collapse, checked against scipy: the Hodges–Lehmann shift and its signed-rank interval,
the sign test, McNemar's exact test of paired collapses, and power simulated from a mixture of collapsed and healthy
runs (against the noncentral t where nothing collapses, and against an independent simulation where runs do)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from sao.core import stats
from sao.core.errors import ConfigError


def _wilcoxon_p(d: np.ndarray) -> float:
    return float(sps.wilcoxon(d, method="exact").pvalue)


@pytest.mark.parametrize("n", [7, 12, 24])
def test_the_hodges_lehmann_interval_is_every_shift_the_signed_rank_test_keeps(n):
    """At each end of the interval scipy's exact two-sided Wilcoxon test of d − θ flips from keeping θ (inside) to
    rejecting it (outside); the estimate is the shift the test is least against."""
    d = np.random.default_rng(n).normal(0.05, 0.1, n)
    r = stats.rank_estimate(d)
    eps = 1e-9
    for edge, inward in ((r.low, 1.0), (r.high, -1.0)):
        assert _wilcoxon_p(d - (edge + inward * eps)) >= 0.05 > _wilcoxon_p(d - (edge - inward * eps))
    assert r.low < r.hodges_lehmann < r.high and 0.95 <= r.confidence < 1.0
    around = [_wilcoxon_p(d - (r.hodges_lehmann + s)) for s in np.linspace(-0.05, 0.05, 11) if abs(s) > 1e-12]
    assert _wilcoxon_p(d - r.hodges_lehmann - eps) >= max(around)
    walsh = [(d[i] + d[j]) / 2 for i in range(n) for j in range(i, n)]
    assert r.hodges_lehmann == pytest.approx(np.median(walsh))


def test_the_signed_rank_null_is_the_one_scipy_uses():
    """P(W+ <= w) from the exact distribution equals half of scipy's exact two-sided p at that statistic."""
    n = 10
    cdf = np.cumsum(stats.signed_rank_null(n))
    d = np.arange(1, n + 1, dtype=float)  # ranks 1..n; making the first k negative sets W− = k(k+1)/2
    for k in range(1, 6):
        x = d.copy()
        x[:k] *= -1
        assert sps.wilcoxon(x, method="exact").pvalue == pytest.approx(2 * cdf[k * (k + 1) // 2])


def test_five_seeds_have_no_95_percent_rank_interval_and_six_do():
    assert stats.rank_estimate([0.1, 0.2, 0.3, 0.4, 0.5]).low is None
    six = stats.rank_estimate([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert (
        six.low == pytest.approx(0.1) and six.high == pytest.approx(0.6) and six.confidence == pytest.approx(1 - 2 / 64)
    )


def test_the_sign_test_is_scipys_binomial_test_with_ties_left_out():
    d = np.array([0.0] * 5 + [-0.3] * 12 + [0.02] * 4 + [0.1] * 3)  # 5 seeds where both runs collapsed
    r = stats.rank_estimate(d)
    assert (r.positive, r.negative, r.ties, r.n) == (7, 12, 5, 24)
    assert r.sign_p == pytest.approx(sps.binomtest(7, 19, 0.5).pvalue, rel=1e-12)
    assert stats.rank_estimate([0.0, 0.0]).sign_p == 1.0


def test_the_rank_estimate_shrugs_off_collapsed_seeds_that_move_the_mean():
    rng = np.random.default_rng(2)
    healthy = rng.normal(0.04, 0.03, 20)
    d = np.concatenate([healthy, [-0.6, -0.55, -0.62]])  # three seeds where only one arm collapsed
    r = stats.rank_estimate(d)
    assert d.mean() < 0 < r.hodges_lehmann and abs(r.hodges_lehmann - np.median(healthy)) < 0.02


def test_mcnemar_is_the_exact_binomial_test_of_the_discordant_seeds():
    before = [0.6, 0.0, 0.55, 0.0, 0.7, 0.62, 0.01, 0.58, 0.6, 0.0, 0.0, 0.6]
    after = [0.0, 0.0, 0.0, 0.6, 0.0, 0.0, 0.0, 0.0, 0.59, 0.0, 0.0, 0.0]
    c = stats.collapse_compare(before, after, floor=0.05, names=("dis", "none"))
    a, b = np.array(after) < 0.05, np.array(before) < 0.05
    assert (c.after_only, c.before_only) == (int((a & ~b).sum()), int((b & ~a).sum())) == (6, 1)
    assert c.p_value == pytest.approx(sps.binomtest(6, 7, 0.5).pvalue, rel=1e-12)
    assert c.rate_after == pytest.approx(10 / 12) and c.rate_before == pytest.approx(5 / 12)
    assert c.verdict == "unresolved" and "dis collapsed in 10 of 12 seeds and none in 5" in c.reason
    table = np.array([[int((a & b).sum()), c.after_only], [c.before_only, int((~a & ~b).sum())]])
    assert sps.binomtest(table[0, 1], table[0, 1] + table[1, 0]).pvalue == pytest.approx(c.p_value)
    many = stats.collapse_compare([0.6] * 10, [0.0] * 10, floor=0.05)
    assert many.verdict == "more collapses" and many.p_value == pytest.approx(2 * 0.5**10)
    fewer = stats.collapse_compare([0.0] * 10, [0.6] * 10, floor=0.05)
    assert fewer.verdict == "fewer collapses" and fewer.delta == -1.0
    with pytest.raises(ConfigError, match="floor"):
        stats.collapse_compare([0.1], [0.2], floor=0.0)


def test_with_nothing_collapsing_the_mixture_power_is_the_noncentral_t():
    model = stats.Mixture(collapse_after=0.0, collapse_before=0.0, sd=0.06, healthy=0.6)
    for n, effect in ((20, 0.04), (12, 0.05)):
        simulated = stats.mixture_power(model, effect, n, 0.05)["t"]
        assert simulated == pytest.approx(stats.power(effect, 0.06, n, 0.05), abs=0.015)
    beyond = stats.mixture_power(model, 0.1, 20, 0.05, smallest_effect=0.05)["beyond"]
    assert beyond == pytest.approx(stats.power_beyond(0.1, 0.05, 0.06, 20, 0.05), abs=0.015)
    assert stats.mixture_power(model, 1.0, 5, 0.05)["t"] == 0.0, "the exact floor of 5 seeds is 1/16 > 0.05"


def test_the_mixture_power_matches_an_independent_simulation_of_collapsing_runs():
    """Runs of the after arm collapse 20% of the time: experiments drawn apart and tested with scipy's own tests give
    the same power (within the two simulations' error) for the t test, the rank interval and the sign test."""
    model = stats.Mixture(collapse_after=0.2, collapse_before=0.0, sd=0.06, healthy=0.6, collapsed=0.01)
    n, effect, trials = 20, 0.06, 6000
    got = stats.mixture_power(model, effect, n, 0.05, draws=20_000, seed=1)
    rng = np.random.default_rng(99)
    fell = rng.random((trials, n)) < 0.2
    after = np.where(fell, 0.01, 0.6 + effect + rng.normal(0, 0.06 / np.sqrt(2), (trials, n)))
    d = after - (0.6 + rng.normal(0, 0.06 / np.sqrt(2), (trials, n)))  # [trials, n], no ties: before never falls
    sign_p = [[sps.binomtest(k, n, 0.5).pvalue for k in range(n + 1)]]
    seen = {
        "t": sps.ttest_1samp(d, 0.0, axis=1).pvalue < 0.05,
        "rank": sps.wilcoxon(d, axis=1, method="exact").pvalue < 0.05,
        "sign": np.array(sign_p[0])[(d > 0).sum(axis=1)] < 0.05,
    }
    for key, hit in seen.items():
        p = hit.mean()
        error = np.sqrt(p * (1 - p) / trials + got[key] * (1 - got[key]) / 20_000)
        assert abs(got[key] - p) < 4 * error + 1e-3, (key, got[key], p)
    assert got["rank"] > got["t"] > 0.05, "collapses cost the mean's test more power than the rank test's"


def test_a_mixture_is_fitted_from_per_seed_pass_at_1():
    before = [0.6, 0.62, 0.0, 0.58, 0.61, 0.59]
    after = [0.65, 0.0, 0.0, 0.63, 0.66, 0.62]
    m = stats.fit_mixture(before, after, floor=0.05)
    assert (m.collapse_after, m.collapse_before) == (pytest.approx(2 / 6), pytest.approx(1 / 6))
    healthy = [0.05, 0.05, 0.05, 0.03]  # the deltas of seeds 0, 3, 4, 5
    assert m.sd == pytest.approx(np.std(healthy, ddof=1))
    assert m.healthy == pytest.approx(np.mean([0.6, 0.62, 0.58, 0.61, 0.59]))
    assert m.collapsed == 0.0
    with pytest.raises(ConfigError, match="at least 2 seeds"):
        stats.fit_mixture([0.0, 0.6], [0.6, 0.0], floor=0.05)
    with pytest.raises(ConfigError, match="probability"):
        stats.Mixture(collapse_after=1.0, collapse_before=0.0, sd=0.1, healthy=0.5)


def test_realised_power_uses_the_sd_the_runs_gave():
    before = np.full(40, 0.5)
    after = before + np.tile([0.3, -0.3], 20)  # sd 0.30 where 0.06 was assumed
    r = stats.realised_power(before, after, smallest_effect=0.05, alpha=0.05)
    assert r["sd"] == pytest.approx(np.std(after - before, ddof=1))
    assert r["power"] == pytest.approx(stats.power(0.05, r["sd"], 40, 0.05)) and r["power"] < 0.2
    assert r["mixture"] is None
    fitted = stats.realised_power(before, after, smallest_effect=0.05, alpha=0.05, collapse_floor=0.3)
    assert fitted["mixture"]["collapse_after"] == 0.5 and fitted["mixture_power"] is not None
