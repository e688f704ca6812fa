"""compare(): the page's arithmetic, interval coverage on simulated data, every verdict branch, the rule that one
training seed per arm never judges a procedure, p-values and Holm's adjustment."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from sao.core.errors import ConfigError
from sao.core.stats import compare, holm, noise_floor, run_std_of


def test_noise_floor_reproduces_the_recipe_page():
    # 0.132 = 4.303 · 1.414 · 0.0217 (run_std of 3 base evals)
    assert noise_floor(0.0217, 3) == pytest.approx(0.132, abs=5e-4)
    assert noise_floor(0.0217, 3) == pytest.approx(4.302653 * 2**0.5 * 0.0217, rel=1e-5)


def test_run_std_of_is_the_sample_sd():
    assert run_std_of([0.40, 0.43, 0.42]) == (pytest.approx(np.std([0.40, 0.43, 0.42], ddof=1)), 3)


def test_paired_interval_over_tasks_by_hand():
    before = np.array([0.0, 0.25, 0.5, 0.5, 1.0])
    after = np.array([0.25, 0.25, 1.0, 0.75, 1.0])
    d = after - before
    c = compare(before, after)
    half = 2.776445 * d.std(ddof=1) / np.sqrt(5)  # t(0.975, 4)
    assert c.delta == pytest.approx(d.mean())
    assert (c.ci_low, c.ci_high) == (
        pytest.approx(d.mean() - half, rel=1e-5),
        pytest.approx(d.mean() + half, rel=1e-5),
    )
    assert c.unit == "task" and c.n == 5


def _simulate(rng, tasks, true_delta, samples=4, seeds=1):
    difficulty = rng.uniform(0.1, 0.9, size=tasks)
    b = rng.binomial(samples, difficulty, size=(seeds, tasks)) / samples
    p_after = np.clip(difficulty + true_delta, 0, 1)
    a = rng.binomial(samples, p_after, size=(seeds, tasks)) / samples
    return b, a, (np.clip(difficulty + true_delta, 0, 1) - difficulty).mean()


@pytest.mark.parametrize("true_delta", [0.0, 0.05])
def test_interval_covers_the_true_delta_about_95_percent_of_the_time(true_delta):
    rng = np.random.default_rng(123)
    hits, trials = 0, 1000
    for _ in range(trials):
        b, a, truth = _simulate(rng, 120, true_delta)
        c = compare(b[0], a[0])
        hits += c.ci_low <= truth <= c.ci_high
    # Binomial(1000, 0.95) has sd 6.9: [0.93, 0.97] is ±3 sd.
    assert 0.93 <= hits / trials <= 0.97


def test_seed_level_interval_covers_about_95_percent():
    """Each training seed shifts every task of its run: the seed, not the task, is the unit."""
    rng = np.random.default_rng(7)
    hits, trials, delta = 0, 1000, 0.04
    for _ in range(trials):
        difficulty = rng.uniform(0.1, 0.9, size=60)
        b = difficulty + rng.normal(0, 0.03, size=(3, 1)) + rng.normal(0, 0.2, size=(3, 60))
        a = difficulty + delta + rng.normal(0, 0.03, size=(3, 1)) + rng.normal(0, 0.2, size=(3, 60))
        c = compare(b, a)
        assert c.unit == "seed" and c.n == 3
        hits += c.ci_low <= delta <= c.ci_high
    assert 0.93 <= hits / trials <= 0.97


def _seeds(per_seed_shift, tasks=100):
    """[seeds, tasks] scores: a task ramp plus one shift per training seed."""
    return np.linspace(-0.05, 0.05, tasks)[None, :] + np.asarray(per_seed_shift, dtype=float)[:, None]


def test_improved_needs_two_seeds_the_interval_off_zero_and_delta_above_the_floor():
    before = _seeds([0.0, 0.01, -0.01])
    after = _seeds([0.30, 0.32, 0.29])
    c = compare(before, after, run_std=0.0217, run_std_runs=3)
    assert c.verdict == "improved" and "exceeds" in c.reason
    assert c.unit == "seed" and c.about == "training procedure"
    # seed deltas 0.04..0.16: the interval [+0.056, +0.145] excludes 0 and reaches past the floor 0.132
    small = compare(_seeds([0.0] * 6), _seeds([0.04, 0.16, 0.07, 0.13, 0.10, 0.10]), run_std=0.0217, run_std_runs=3)
    assert small.verdict == "unresolved" and "within the noise floor" in small.reason
    down = compare(after, before, run_std=0.0217, run_std_runs=3)
    assert down.verdict == "regressed"


def test_one_seed_per_arm_never_says_improved_or_regressed_but_reports_the_per_task_interval():
    """However large the per-task delta, one trained model per arm says nothing about the procedure."""
    before = np.zeros(100)
    after = np.full(100, 0.3) + np.linspace(-0.05, 0.05, 100)
    for b, a in ((before, after), (after, before)):
        c = compare(b, a, run_std=0.0217, run_std_runs=3)
        assert c.verdict == "unresolved"
        assert c.ci_low > 0 or c.ci_high < 0, "the per-task interval is still computed and reported"
        assert c.unit == "task" and c.n == 100 and c.about == "two trained models"
        assert "two trained models, not the training procedure" in c.reason and "train-runs 2" in c.reason
    rng = np.random.default_rng(11)
    for _ in range(200):  # no floor, any size of delta, either sign: never a verdict about the procedure
        b, a = rng.uniform(0, 1, 40), rng.uniform(0, 1, 40) + rng.uniform(-1, 1)
        assert compare(b, a).verdict == "unresolved"
        assert compare(b[None, :], np.stack([a, a + 0.01])).verdict == "unresolved", "a one-seed trained side too"


def test_a_fixed_base_needs_seeds_only_on_the_trained_side():
    base = np.linspace(0.2, 0.6, 60)
    trained = np.stack([base + 0.2, base + 0.22, base + 0.19])
    c = compare(base, trained, run_std=0.0217, run_std_runs=3, before_fixed=True)
    assert c.verdict == "improved" and c.unit == "seed" and c.about == "training procedure"
    one = compare(base, trained[0], run_std=0.0217, run_std_runs=3, before_fixed=True)
    assert one.verdict == "unresolved" and one.about == "the base and one trained model"
    assert "the base and one trained model" in one.reason
    with pytest.raises(ConfigError, match="one model"):
        compare(trained, trained, before_fixed=True)


def test_p_values_are_the_t_tests_behind_the_intervals():
    rng = np.random.default_rng(5)
    b, a = rng.uniform(0, 1, (4, 30)), rng.uniform(0, 1, (4, 30)) + 0.1
    paired = compare(b, a)
    assert paired.p_value == pytest.approx(sps.ttest_rel(a.mean(axis=1), b.mean(axis=1)).pvalue, rel=1e-9)
    tasks = compare(b[0], a[0])
    assert tasks.p_value == pytest.approx(sps.ttest_rel(a[0], b[0]).pvalue, rel=1e-9)
    welch = compare(b[:3], a)
    expected = sps.ttest_ind(a.mean(axis=1), b[:3].mean(axis=1), equal_var=False).pvalue
    assert welch.p_value == pytest.approx(expected, rel=1e-9)
    assert (paired.p_value < 0.05) == (paired.ci_low > 0 or paired.ci_high < 0), "same t, same df"


def test_holm_by_hand():
    # sorted 0.01 (x4), 0.03 (x3), 0.04 (x2 = 0.08, but never below the step before: 0.09), 0.5 (x1)
    assert holm([0.04, 0.01, 0.5, 0.03]) == pytest.approx([0.09, 0.04, 0.5, 0.09])
    assert holm([0.6, 0.9]) == pytest.approx([1.0, 1.0]), "capped at 1"
    assert holm([0.02]) == [0.02] and holm([]) == []
    with pytest.raises(ConfigError, match="p-values"):
        holm([0.1, float("nan")])


def test_flat_needs_two_seeds_and_the_interval_inside_the_floor():
    rng = np.random.default_rng(0)
    base = rng.uniform(0, 1, size=(3, 120))
    same = base + rng.normal(0, 0.002, size=(3, 120))
    c = compare(base, same, run_std=0.0217, run_std_runs=3)
    assert c.verdict == "flat" and c.unit == "seed"
    one_seed = compare(base[0], same[0], run_std=0.0217, run_std_runs=3)
    assert one_seed.verdict == "unresolved" and "train-runs" in one_seed.reason
    no_floor = compare(base, same)
    assert no_floor.verdict == "unresolved" and "noise floor" in no_floor.reason


def test_unequal_seed_counts_use_welch_and_a_single_run_is_a_fixed_reference():
    b = np.full((1, 10), 0.5)
    a = np.array([[0.6] * 10, [0.7] * 10, [0.8] * 10])
    c = compare(b, a)
    # one-sample t over the 3 seed means against the fixed 0.5: mean 0.2, sd 0.1, df 2
    assert c.delta == pytest.approx(0.2)
    assert c.ci_high - c.delta == pytest.approx(4.302653 * 0.1 / np.sqrt(3), rel=1e-5)


def test_proxy_that_rises_while_target_falls_is_flagged():
    before = np.full(50, 0.6) + np.linspace(0, 0.1, 50)
    after = before - 0.1
    c = compare(before, after, proxy=([0.4, 0.5], [0.8, 0.9]))
    assert c.proxy_delta == pytest.approx(0.4)
    assert c.proxy_diverges and "proxy" in c.reason
    ok = compare(after, before, proxy=(0.4, 0.8))
    assert not ok.proxy_diverges


def test_bad_inputs_raise_config_errors():
    with pytest.raises(ConfigError, match="same tasks"):
        compare(np.zeros(5), np.zeros(6))
    with pytest.raises(ConfigError, match="run_std"):
        compare(np.zeros(5), np.ones(5), run_std=0.02)
    with pytest.raises(ConfigError, match="non-finite"):
        compare(np.zeros(5), np.array([0, 0, np.nan, 0, 0]))
    with pytest.raises(ConfigError, match=">= 2"):
        noise_floor(0.02, 1)


def test_a_noise_level_dip_under_a_rising_proxy_is_not_flagged():
    rng = np.random.default_rng(3)
    before = rng.uniform(0, 1, 120)
    after = before + rng.normal(-0.005, 0.2, 120)  # a dip well inside its interval
    c = compare(before, after, proxy=(0.4, 0.5))
    assert c.ci_low < 0 < c.ci_high and c.proxy_delta == pytest.approx(0.1)
    assert not c.proxy_diverges and "proxy" not in c.reason
