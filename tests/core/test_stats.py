"""compare(): the page's arithmetic, interval coverage on simulated data, every verdict branch, the rule that one
training seed per arm never judges a procedure, flat as an equivalence test against ± δ, the exact sign-flip and
permutation floors and the sd floor that keep a few seeds from claiming certainty, p-values, Holm's adjustment, and
power before a run."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from sao.core.errors import ConfigError
from sao.core.stats import compare, holm, least_exact_p, noise_floor, power, run_std_of, seeds_for_power


def test_noise_floor_reproduces_the_recipe_page():
    # 0.132 = 4.303 · 1.414 · 0.0217 (run_std of 3 base evals)
    assert noise_floor(0.0217, 3) == pytest.approx(0.132, abs=5e-4)
    assert noise_floor(0.0217, 3) == pytest.approx(4.302653 * 2**0.5 * 0.0217, rel=1e-5)


def test_run_std_of_is_the_sample_sd():
    assert run_std_of([0.40, 0.43, 0.42]) == (pytest.approx(np.std([0.40, 0.43, 0.42], ddof=1)), 3)


def test_paired_interval_over_tasks_by_hand():
    # scores that are not means of 0/1 samples and no run_std: no sd floor, the plain paired t
    before = np.array([0.03, 0.27, 0.51, 0.49, 0.98])
    after = np.array([0.26, 0.24, 0.97, 0.77, 0.99])
    d = after - before
    c = compare(before, after)
    half = 2.776445 * d.std(ddof=1) / np.sqrt(5)  # t(0.975, 4)
    assert c.delta == pytest.approx(d.mean())
    assert (c.ci_low, c.ci_high) == (pytest.approx(d.mean() - half, rel=1e-5), pytest.approx(d.mean() + half, rel=1e-5))
    assert c.unit == "task" and c.n == 5 and c.sd_floor is None and not c.sd_floored


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


OLD_RULE = "observed-above-delta"  # the verdict rule of comparisons made before the magnitude was split off


def test_under_the_old_rule_improved_needs_the_interval_off_zero_and_delta_above_the_floor():
    before = _seeds([0.0, 0.01, -0.01, 0.005, -0.005, 0.002])
    after = _seeds([0.30, 0.32, 0.29, 0.31, 0.30, 0.305])
    c = compare(before, after, run_std=0.0217, run_std_runs=3, verdict_rule=OLD_RULE)
    assert c.verdict == "improved" and "exceeds δ, the noise floor" in c.reason and c.p_rule == "t"
    assert c.unit == "seed" and c.about == "training procedure" and c.p_exact is None, "6 seeds: the t test"
    assert c.magnitude is None and c.finding == "improved" and c.verdict_rule == OLD_RULE
    # seed deltas 0.04..0.16: the interval [+0.056, +0.145] excludes 0 but delta +0.1 is within the floor 0.132
    small = compare(
        _seeds([0.0] * 6),
        _seeds([0.04, 0.16, 0.07, 0.13, 0.10, 0.10]),
        run_std=0.0217,
        run_std_runs=3,
        verdict_rule=OLD_RULE,
    )
    assert small.verdict == "unresolved" and "within δ, the noise floor" in small.reason
    down = compare(after, before, run_std=0.0217, run_std_runs=3, verdict_rule=OLD_RULE)
    assert down.verdict == "regressed"


def _reversal(shift: float) -> tuple[np.ndarray, np.ndarray]:
    """24 paired seeds whose deltas centre on ``shift`` with sd 0.1064 (a fixed pattern: the interval is known)."""
    pattern = np.array(
        [
            -1.7,
            -1.2,
            -0.9,
            -0.7,
            -0.5,
            -0.4,
            -0.3,
            -0.2,
            -0.1,
            -0.05,
            0.0,
            0.05,
            0.1,
            0.2,
            0.3,
            0.4,
            0.5,
            0.6,
            0.7,
            0.8,
            0.9,
            1.0,
            1.2,
            -1.05,
        ]
    )
    deltas = shift + 0.1064 * (pattern - pattern.mean()) / pattern.std(ddof=1)
    return _seeds([0.0] * 24), _seeds(deltas)


def test_a_significant_reversal_smaller_than_delta_is_called_regressed_not_unresolved():
    """The reversal the old rule hid: delta −0.064 with an interval clear of 0 and δ 0.10. The direction is a finding
    (regressed); against δ the interval reaches both sides of −δ, so the size is undetermined."""
    before, after = _reversal(-0.064)
    c = compare(before, after, smallest_effect=0.10)
    assert c.ci_high < 0 and -0.11 < c.ci_low < -0.10 and c.p_value < 0.01
    assert c.verdict == "regressed" and c.magnitude == "undetermined" and c.verdict_rule == "direction"
    assert c.finding == "regressed, size against δ undetermined"
    assert "excludes 0" in c.reason
    assert "size against the smallest effect of interest δ 0.100 is undetermined" in c.reason
    assert c.p_beyond == 1.0, "|delta| below δ: the minimum-effect test cannot reject"
    old = compare(before, after, smallest_effect=0.10, verdict_rule=OLD_RULE)
    assert old.verdict == "unresolved" and "within the smallest effect of interest" in old.reason


def test_a_small_significant_effect_inside_delta_is_improved_by_less_than_delta():
    before, after = _reversal(0.06)
    c = compare(before, after, smallest_effect=0.15)
    assert c.ci_low > 0 and c.equivalence_high < 0.15 and c.p_equivalence < 0.05
    assert c.verdict == "improved" and c.magnitude == "within δ" and c.finding == "improved, by less than δ"
    assert "By less than δ" in c.reason and "a real gain smaller than the effect that matters" in c.reason


def test_an_effect_whose_interval_clears_delta_is_beyond_delta():
    before, after = _reversal(0.2)
    c = compare(before, after, smallest_effect=0.10)
    assert c.ci_low > 0.10 and c.p_beyond < 0.05 and c.verdict == "improved" and c.magnitude == "beyond δ"
    assert c.finding == "improved, by more than δ" and "the minimum-effect test" in c.reason
    # the minimum-effect p is twice the one-sided t p against δ: below 0.05 exactly when the 95% interval clears δ
    d = after.mean(axis=1) - before.mean(axis=1)
    one_sided = sps.ttest_1samp(d, 0.10, alternative="greater").pvalue
    assert c.p_beyond == pytest.approx(2 * one_sided, rel=1e-9)
    edge = compare(before, after, smallest_effect=c.ci_low)
    assert edge.p_beyond == pytest.approx(0.05, rel=1e-6)
    down = compare(after, before, smallest_effect=0.10)
    assert down.verdict == "regressed" and down.magnitude == "beyond δ" and "beyond −δ" in down.reason


def test_an_equivalence_is_flat_within_delta_under_either_rule():
    before, after = _reversal(0.005)
    for rule in ("direction", OLD_RULE):
        c = compare(before, after, smallest_effect=0.08, verdict_rule=rule)
        assert c.ci_low < 0 < c.ci_high and c.verdict == "flat" and c.finding == "flat"
    assert compare(before, after, smallest_effect=0.08).magnitude == "within δ"


def test_one_seed_and_no_delta_leave_the_magnitude_out():
    before, after = _reversal(0.2)
    one = compare(before[0], after[0], smallest_effect=0.1)
    assert one.verdict == "unresolved" and one.magnitude is None and "train-runs 6 or more" in one.reason
    bare = compare(before, after)
    assert bare.verdict == "improved" and bare.magnitude is None and bare.p_beyond is None
    assert "judged against nothing" in bare.reason
    with pytest.raises(ConfigError, match="verdict_rule"):
        compare(before, after, verdict_rule="magnitude")


def test_with_few_seeds_the_minimum_effect_p_is_floored_by_its_exact_test_too():
    c = compare(_seeds([0.0] * 5), _seeds([0.5, 0.52, 0.49, 0.51, 0.5]), smallest_effect=0.1, alpha=0.1)
    assert c.p_beyond >= 2 * 2.0**-5 and c.verdict == "improved", "2 × the least one-sided share of 32 patterns"


def test_three_seeds_cannot_claim_improved_at_alpha_005_however_far_apart():
    """Every seed better by about 0.3: the t interval is far from 0, but 3 paired seeds have 8 sign patterns, and
    the exact sign-flip p cannot go below 2/8."""
    c = compare(_seeds([0.0, 0.01, -0.01]), _seeds([0.30, 0.32, 0.29]), run_std=0.0217, run_std_runs=3)
    assert c.ci_low > 0 and c.p_t < 0.01
    assert c.verdict == "unresolved" and c.p_value == pytest.approx(0.25) and c.p_rule == "exact sign-flip"
    assert "exact sign-flip p over 3 seeds is 0.25: with 3 seeds nothing better than 0.25 can be claimed" in c.reason


def test_one_seed_per_arm_never_says_improved_or_regressed_but_reports_the_per_task_interval():
    """However large the per-task delta, one trained model per arm says nothing about the procedure."""
    before = np.zeros(100)
    after = np.full(100, 0.3) + np.linspace(-0.05, 0.05, 100)
    for b, a in ((before, after), (after, before)):
        c = compare(b, a, run_std=0.0217, run_std_runs=3)
        assert c.verdict == "unresolved"
        assert c.ci_low > 0 or c.ci_high < 0, "the per-task interval is still computed and reported"
        assert c.unit == "task" and c.n == 100 and c.about == "two trained models"
        assert "two trained models, not the training procedure" in c.reason and "train-runs 6 or more" in c.reason
    rng = np.random.default_rng(11)
    for _ in range(200):  # no floor, any size of delta, either sign: never a verdict about the procedure
        b, a = rng.uniform(0, 1, 40), rng.uniform(0, 1, 40) + rng.uniform(-1, 1)
        assert compare(b, a).verdict == "unresolved"
        assert compare(b[None, :], np.stack([a, a + 0.01])).verdict == "unresolved", "a one-seed trained side too"


def test_a_fixed_base_needs_seeds_only_on_the_trained_side():
    base = np.linspace(0.2, 0.6, 60)
    trained = np.stack([base + 0.2, base + 0.22, base + 0.19, base + 0.21, base + 0.2, base + 0.23])
    c = compare(base, trained, run_std=0.0217, run_std_runs=3, before_fixed=True)
    assert c.verdict == "improved" and c.unit == "seed" and c.about == "training procedure"
    one = compare(base, trained[0], run_std=0.0217, run_std_runs=3, before_fixed=True)
    assert one.verdict == "unresolved" and one.about == "the base and one trained model"
    assert "the base and one trained model" in one.reason
    with pytest.raises(ConfigError, match="one model"):
        compare(trained, trained, before_fixed=True)


def test_p_values_are_the_t_tests_behind_the_intervals_floored_by_the_exact_tests():
    rng = np.random.default_rng(5)
    b, a = rng.uniform(0, 1, (4, 30)), rng.uniform(0, 1, (4, 30)) + 0.1
    paired = compare(b, a)
    assert paired.p_t == pytest.approx(sps.ttest_rel(a.mean(axis=1), b.mean(axis=1)).pvalue, rel=1e-9)
    assert paired.p_value == max(paired.p_t, paired.p_exact) and paired.p_exact >= least_exact_p(4)
    tasks = compare(b[0], a[0])
    assert tasks.p_value == pytest.approx(sps.ttest_rel(a[0], b[0]).pvalue, rel=1e-9) and tasks.p_exact is None
    welch = compare(b[:3], a)
    expected = sps.ttest_ind(a.mean(axis=1), b[:3].mean(axis=1), equal_var=False).pvalue
    assert welch.p_t == pytest.approx(expected, rel=1e-9)
    assert welch.p_value == max(welch.p_t, welch.p_exact) and welch.p_exact >= 1 / 35, "C(7, 4) labellings"
    assert (paired.p_t < 0.05) == (paired.ci_low > 0 or paired.ci_high < 0), "same t, same df"


def test_holm_by_hand():
    # sorted 0.01 (x4), 0.03 (x3), 0.04 (x2 = 0.08, but never below the step before: 0.09), 0.5 (x1)
    assert holm([0.04, 0.01, 0.5, 0.03]) == pytest.approx([0.09, 0.04, 0.5, 0.09])
    assert holm([0.6, 0.9]) == pytest.approx([1.0, 1.0]), "capped at 1"
    assert holm([0.02]) == [0.02] and holm([]) == []
    with pytest.raises(ConfigError, match="p-values"):
        holm([0.1, float("nan")])


def test_flat_needs_two_seeds_and_the_90_percent_interval_inside_the_floor():
    rng = np.random.default_rng(0)
    base = rng.uniform(0, 1, size=(8, 120))
    same = base + rng.normal(0, 0.002, size=(8, 120))
    c = compare(base, same, run_std=0.0217, run_std_runs=3)
    assert c.verdict == "flat" and c.unit == "seed" and c.smallest_effect == c.noise_floor
    assert c.smallest_effect_source == "noise floor" and "no smallest effect of interest was given" in c.reason
    one_seed = compare(base[0], same[0], run_std=0.0217, run_std_runs=3)
    assert one_seed.verdict == "unresolved" and "train-runs" in one_seed.reason
    no_floor = compare(base, same)
    assert no_floor.verdict == "unresolved" and "noise floor" in no_floor.reason


def test_flat_is_an_equivalence_test_the_90_percent_interval_inside_plus_minus_delta():
    """Two one-sided tests at alpha 0.05 against ± δ: flat exactly when the 90% interval lies inside (−δ, +δ),
    a weaker demand than the 95% interval inside it, and one that depends on δ, not on the noise floor."""
    deltas = np.array([0.03, -0.06, 0.09, 0.0, 0.045, -0.03, 0.06, 0.015])
    before, after = _seeds([0.0] * 8), _seeds(deltas)
    sd, n = deltas.std(ddof=1), deltas.size
    lo90, hi90 = (deltas.mean() + s * sps.t.ppf(0.95, n - 1) * sd / np.sqrt(n) for s in (-1, 1))
    c = compare(before, after, run_std=0.0217, run_std_runs=3)
    assert not c.sd_floored and (c.equivalence_low, c.equivalence_high) == (pytest.approx(lo90), pytest.approx(hi90))
    bound90, bound95 = max(-lo90, hi90), max(-c.ci_low, c.ci_high)
    assert bound90 < bound95
    between = compare(before, after, smallest_effect=(bound90 + bound95) / 2)
    assert between.verdict == "flat" and between.p_equivalence < 0.05, "the 95% interval need not lie inside ± δ"
    assert "smallest effect of interest δ" in between.reason and between.smallest_effect_source == "given"
    narrow = compare(before, after, smallest_effect=bound90 * 0.98)
    assert narrow.verdict == "unresolved" and narrow.p_equivalence > 0.05 and "not shown flat" in narrow.reason
    wide = compare(before, after, smallest_effect=bound90 * 1.02)
    assert wide.verdict == "flat"


def test_a_wide_interval_around_zero_is_unresolved_not_flat():
    deltas = np.array([0.2, -0.25, 0.15, -0.1, 0.3, -0.28, 0.05, -0.04])
    c = compare(_seeds([0.0] * 8), _seeds(deltas), smallest_effect=0.05, run_std=0.0217, run_std_runs=3)
    assert c.ci_low < 0 < c.ci_high and c.verdict == "unresolved"
    assert "not shown flat either" in c.reason and c.p_equivalence > 0.05


def test_zero_variance_across_seeds_is_never_certainty():
    """Two seeds whose per-seed deltas are equal (one lost sample of four on one of 40 tasks, −1/160): a zero sd,
    which the plain t read as an interval [−0.00625, −0.00625] and p 2.8e-15."""
    rng = np.random.default_rng(1)
    before = rng.integers(1, 5, size=(2, 40)) / 4
    after = before.copy()
    after[0, 0] -= 0.25
    after[1, 7] -= 0.25
    for kwargs in ({"run_std": 0.02, "run_std_runs": 5}, {}):  # the eval's run_std, or the binomial sd of 4 samples
        c = compare(before, after, **kwargs)
        assert c.delta == pytest.approx(-0.00625) and c.verdict == "unresolved"
        assert c.sd_floored and c.ci_high - c.ci_low > 0.1, "the sd is floored at the eval's noise: not a point"
        assert c.p_value >= 0.5 and "below the eval's own noise" in c.reason
    assert compare(before, after, smallest_effect=0.05).verdict == "unresolved", "nor can it be shown flat"
    # scores with no known eval noise: no sd floor, but the exact p still caps what two seeds can claim
    jitter = np.linspace(0.001, 0.002, 40)
    bare = compare(before + jitter, after + jitter)
    assert bare.ci_low == pytest.approx(bare.ci_high) and bare.p_t < 1e-6
    assert bare.verdict == "unresolved" and bare.p_value == 0.5 and bare.p_rule == "exact sign-flip"
    assert "exact sign-flip p over 2 seeds is 0.5: with 2 seeds nothing better than 0.5 can be claimed" in bare.reason


@pytest.mark.parametrize("n", [2, 3, 5])
def test_exact_sign_flip_p_is_2_to_the_1_minus_n_for_same_sign_deltas(n):
    deltas = np.linspace(0.1, 0.3, n)
    c = compare(_seeds([0.0] * n), _seeds(deltas))
    assert c.p_exact == pytest.approx(2.0 ** (1 - n)) == least_exact_p(n)
    assert c.p_value >= c.p_exact and c.verdict == "unresolved"
    assert compare(_seeds([0.0] * n), _seeds(-deltas)).p_exact == pytest.approx(2.0 ** (1 - n))


def test_the_exact_test_is_left_to_the_t_test_from_six_seeds():
    c = compare(_seeds([0.0] * 6), _seeds(np.linspace(0.2, 0.3, 6)), run_std=0.0217, run_std_runs=3)
    assert c.p_exact is None and c.p_rule == "t" and c.verdict == "improved"


def test_unequal_seed_counts_take_the_exact_permutation_p():
    before = _seeds([0.0, 0.01, -0.01])
    after = _seeds([0.3, 0.31])
    c = compare(before, after)
    assert c.p_exact == pytest.approx(1 / 10), "the one most extreme of the C(5, 2) labellings"
    assert c.p_rule == "exact permutation" and c.verdict == "unresolved" and "10 labellings" in c.reason


def test_power_against_the_known_value_and_the_seeds_it_takes():
    # a paired t with delta half the sd of the differences needs 34 pairs for 80% power at alpha 0.05, two-sided
    assert power(0.5, 1.0, 34) == pytest.approx(0.808, abs=0.002)
    assert power(0.5, 1.0, 33) < 0.8 <= power(0.5, 1.0, 34)
    assert seeds_for_power(0.5, 1.0) == 34
    assert (
        power(0.5, 1.0, 64, paired=False) == pytest.approx(0.80, abs=0.005)
        and seeds_for_power(0.5, 1.0, paired=False) == 64
    )
    assert power(0.0, 1.0, 10) == pytest.approx(0.05), "no effect: the test's size"
    assert power(0.02, 0.05, 10, alpha=0.01) < power(0.02, 0.05, 20, alpha=0.01) < power(0.02, 0.05, 20), "n, alpha"
    # a huge effect still needs the seeds for the exact floor to go below alpha: 2^(1−6) < 0.05 <= 2^(1−5)
    assert seeds_for_power(10.0, 1.0) == 6 and seeds_for_power(10.0, 1.0, alpha=0.1) == 5
    with pytest.raises(ConfigError, match="sd > 0"):
        power(0.1, 0.0, 10)


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
