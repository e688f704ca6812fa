"""compare(): the page's arithmetic, interval coverage on simulated data, and every verdict branch."""

from __future__ import annotations

import numpy as np
import pytest

from sao.core.errors import ConfigError
from sao.core.stats import compare, noise_floor, run_std_of


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


def test_improved_needs_interval_off_zero_and_delta_above_floor():
    before = np.zeros(100)
    after = np.full(100, 0.3) + np.linspace(-0.05, 0.05, 100)
    c = compare(before, after, run_std=0.0217, run_std_runs=3)
    assert c.verdict == "improved" and "exceeds" in c.reason
    small = compare(before, before + 0.05 + np.linspace(-0.01, 0.01, 100), run_std=0.0217, run_std_runs=3)
    assert small.verdict == "unresolved" and "within the noise floor" in small.reason
    down = compare(after, before, run_std=0.0217, run_std_runs=3)
    assert down.verdict == "regressed"


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
