"""SAO.update against slow, obviously-correct references written here, plus property tests."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import multi_turn_batch, reference_per_turn
from sao.algorithm.update import CORRECTIONS, SAO, gae, monte_carlo_returns
from sao.core.errors import ConfigError

# ------------------------------------------------------------------------------------------------------
# References: one trajectory at a time, one token at a time, straight from SPEC §1.


def reference_gae(values, rewards, action_mask, alpha):
    """Per row: list the action positions, run the backward recursion over them in plain Python."""
    B, T = len(values), len(values[0])
    adv = [[0.0] * T for _ in range(B)]
    lams = []
    for i in range(B):
        pos = [t for t in range(T) if action_mask[i][t]]
        L = len(pos)
        lam = max(0.0, 1.0 - 1.0 / (alpha * L)) if L else 0.0
        lams.append(lam)
        a_next = 0.0
        for k in reversed(range(L)):
            v_next = values[i][pos[k + 1]] if k + 1 < L else 0.0
            r = rewards[i] if k == L - 1 else 0.0
            delta = r + v_next - values[i][pos[k]]
            a_next = delta + lam * a_next
            adv[i][pos[k]] = a_next
    return adv, lams


def reference_targets(rewards, action_mask):
    B, T = len(action_mask), len(action_mask[0])
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if any(action_mask[i][s] for s in range(t, T)):
                out[i][t] = rewards[i]
    return out


def random_batch(B, T, seed, dtype=torch.float64, spread=0.3, p_action=0.7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < p_action
    # Trajectories of different lengths: cut each row at a random length (padding after it).
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask &= torch.arange(T)[None, :] < lengths[:, None]
    mask[:, 0] |= ~mask.any(dim=1)  # at least one action token per row
    sampler = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    return {
        "logprobs": sampler + torch.randn(B, T, generator=g, dtype=dtype) * spread,
        "sampler_logprobs": sampler,
        "values": torch.rand(B, T, generator=g, dtype=dtype),
        "rewards": (torch.rand(B, generator=g) < 0.5).to(dtype),
        "action_mask": mask,
    }


# ------------------------------------------------------------------------------------------------------
# GAE and value targets.


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("alpha", [1.5, 0.05, 10.0])
def test_gae_matches_slow_reference_with_observation_gaps_and_ragged_lengths(seed, alpha):
    T = 1 + seed * 7 % 61  # 1 .. 61, crossing several powers of two
    batch = random_batch(6, T, seed)
    adv, lam = gae(batch["values"], batch["rewards"], batch["action_mask"], alpha)
    ref_adv, ref_lam = reference_gae(
        batch["values"].tolist(), batch["rewards"].tolist(), batch["action_mask"].tolist(), alpha
    )
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lam, torch.tensor(ref_lam, dtype=torch.float64))


def test_gae_lambda_is_vapo_rule_with_alpha_one_and_a_half():
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[0, :1] = True  # L = 1 → λ = 1 − 1/1.5 = 1/3
    mask[1, :4] = True  # L = 4 → λ = 1 − 1/6
    mask[2, :10] = True
    _, lam = gae(torch.zeros(3, 10, dtype=torch.float64), torch.ones(3, dtype=torch.float64), mask, 1.5)
    assert lam.tolist() == pytest.approx([1 / 3, 5 / 6, 1 - 1 / 15])


def test_gae_with_zero_critic_gives_discounted_terminal_reward():
    """V ≡ 0: A_k = λ^(L−1−k) R, the textbook shape; the observation token in the middle is skipped."""
    mask = torch.tensor([[True, True, False, True, False]])
    adv, lam = gae(torch.zeros(1, 5, dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64), mask, 1.5)
    lam_ = 1 - 1 / 4.5
    assert adv[0].tolist() == pytest.approx([lam_**2, lam_, 0.0, 1.0, 0.0])
    assert lam.item() == pytest.approx(lam_)


def test_gae_bootstrap_jumps_over_observation_tokens():
    """A huge value on an observation token must not leak into any advantage."""
    mask = torch.tensor([[True, False, True]])
    values = torch.tensor([[0.5, 1e6, 0.25]], dtype=torch.float64)
    adv, _ = gae(values, torch.tensor([1.0], dtype=torch.float64), mask, 1.5)
    lam = 1 - 1 / 3
    d1 = 1.0 - 0.25  # terminal: r + 0 − V(a_2)
    d0 = 0.25 - 0.5  # r = 0, bootstrap from the next *action* token
    assert adv[0].tolist() == pytest.approx([d0 + lam * d1, 0.0, d1])


@pytest.mark.parametrize("seed", range(10))
def test_value_targets_are_monte_carlo_returns(seed):
    batch = random_batch(5, 17, seed)
    got = monte_carlo_returns(batch["rewards"], batch["action_mask"])
    ref = reference_targets(batch["rewards"].tolist(), batch["action_mask"].tolist())
    assert got.tolist() == ref


def test_observation_token_carries_next_action_tokens_return_and_trailing_ones_zero():
    mask = torch.tensor([[False, True, False, True, False, False]])
    got = monte_carlo_returns(torch.tensor([0.7]), mask)
    assert got[0].tolist() == pytest.approx([0.7, 0.7, 0.7, 0.7, 0.0, 0.0])


# ------------------------------------------------------------------------------------------------------
# Ratio, correction rules, coefficients.


def reference_coefficients(batch, band, correction):
    lo, hi = band
    lp, slp = batch["logprobs"].tolist(), batch["sampler_logprobs"].tolist()
    mask = batch["action_mask"].tolist()
    adv, _ = reference_gae(batch["values"].tolist(), batch["rewards"].tolist(), mask, 1.5)
    N = sum(map(sum, mask))
    out = []
    for i in range(len(mask)):
        row = []
        for t in range(len(mask[0])):
            if not mask[i][t]:
                row.append(0.0)
                continue
            r = math.exp(lp[i][t] - slp[i][t])
            f = r if correction == "none" or lo < r < hi else 0.0
            row.append(f * adv[i][t] / N)
        out.append(row)
    return out


@pytest.mark.parametrize("correction", ["dis", "none"])
@pytest.mark.parametrize("seed", range(8))
def test_coefficients_match_reference(correction, seed):
    batch = random_batch(8, 23, seed, spread=1.0)  # ratios well outside the band on many tokens
    update = SAO(correction=correction).update(batch)
    ref = torch.tensor(reference_coefficients(batch, (0.7, 6.0), correction), dtype=torch.float64)
    torch.testing.assert_close(update.coefficients, ref, rtol=1e-10, atol=1e-14)


def test_dis_masks_strictly_outside_the_open_band():
    lp = torch.log(torch.tensor([[0.69, 0.7, 0.71, 5.99, 6.0, 6.01]], dtype=torch.float64))
    batch = {
        "logprobs": lp,
        "sampler_logprobs": torch.zeros_like(lp),
        "values": torch.zeros_like(lp),
        "rewards": torch.tensor([1.0], dtype=torch.float64),
        "action_mask": torch.ones_like(lp, dtype=torch.bool),
    }
    update = SAO().update(batch)
    assert update.mask[0].tolist() == [False, False, True, True, False, False]
    assert update.stats["masked_share"] == pytest.approx(4 / 6)


def _ratios(rows: list[list[float]], mask: list[list[bool]] | None = None) -> dict[str, torch.Tensor]:
    """A batch whose trainer/sampler ratios are ``rows`` exactly where the action mask is True."""
    lp = torch.log(torch.tensor(rows, dtype=torch.float64))
    return {
        "logprobs": lp,
        "sampler_logprobs": torch.zeros_like(lp),
        "values": torch.zeros_like(lp),
        "rewards": torch.ones(lp.shape[0], dtype=torch.float64),
        "action_mask": torch.ones_like(lp, dtype=torch.bool) if mask is None else torch.tensor(mask),
    }


def test_the_effective_sample_size_of_hand_made_ratios():
    ratios = [0.5, 1.0, 2.0, 8.0, 0.6, 1.5]
    s = SAO().update(_ratios([ratios])).stats
    assert s["ratio_ess_share"] == pytest.approx(sum(ratios) ** 2 / (6 * sum(r * r for r in ratios)))  # 0.4290
    assert SAO().update(_ratios([[1.3] * 5])).stats["ratio_ess_share"] == pytest.approx(1.0), "equal weights"
    one = SAO().update(_ratios([[1e-6, 1e-6, 1e6, 1e-6]])).stats["ratio_ess_share"]
    assert one == pytest.approx(1 / 4, rel=1e-6), "one token carries the weight: 1 of 4"
    padded = SAO().update(_ratios([[2.0, 2.0, 50.0]], [[True, True, False]])).stats["ratio_ess_share"]
    assert padded == pytest.approx(1.0), "only action tokens count"


def test_the_masked_share_splits_into_the_band_s_low_and_high_sides():
    """Band (0.7, 6.0): 0.5 and 0.6 fall below it, 8.0 above, the edges themselves count as outside (the band is
    open); dis masks exactly those, none masks nothing but would have."""
    batch = _ratios([[0.5, 1.0, 2.0, 8.0, 0.6, 1.5], [6.0, 1.0, 1.0, 1.0, 0.7, 1.0]])
    dis, none = SAO(correction="dis").update(batch).stats, SAO(correction="none").update(batch).stats
    assert dis["masked_share_low"] == dis["would_be_masked_share_low"] == pytest.approx(3 / 12)  # 0.5, 0.6, 0.7
    assert dis["masked_share_high"] == dis["would_be_masked_share_high"] == pytest.approx(2 / 12)  # 8.0, 6.0
    assert dis["masked_share"] == pytest.approx(dis["masked_share_low"] + dis["masked_share_high"])
    assert none["masked_share_low"] == none["masked_share_high"] == none["masked_share"] == 0.0
    assert none["would_be_masked_share_low"] == pytest.approx(3 / 12)
    assert none["would_be_masked_share_high"] == pytest.approx(2 / 12)
    assert none["would_be_masked_share"] == pytest.approx(5 / 12)
    # a random mask drops tokens inside the band: those count in neither side
    keys = torch.tensor([11, 12], dtype=torch.int64)
    rnd = SAO(correction="random", random_mask_share=0.5).update({**batch, "random_key": keys}).stats
    assert rnd["masked_share_low"] + rnd["masked_share_high"] <= rnd["masked_share"]


def test_arms_share_advantages_and_targets_and_differ_only_on_out_of_band_tokens():
    batch = random_batch(16, 40, seed=3, spread=1.5)
    dis, base = SAO(correction="dis").update(batch), SAO(correction="none").update(batch)
    assert torch.equal(dis.advantages, base.advantages)
    assert torch.equal(dis.value_targets, base.value_targets)
    assert torch.equal(dis.ratio, base.ratio)
    out_of_band = batch["action_mask"] & ~((dis.ratio > 0.7) & (dis.ratio < 6.0))
    assert out_of_band.any() and (~out_of_band & batch["action_mask"]).any()
    differ = dis.coefficients != base.coefficients
    nonzero_adv = dis.advantages != 0
    assert torch.equal(differ, out_of_band & nonzero_adv)
    assert dis.stats["masked_share"] == pytest.approx(base.stats["would_be_masked_share"])
    assert base.stats["masked_share"] == 0.0


def test_policy_loss_gradient_is_coefficients_times_score():
    batch = random_batch(4, 9, seed=1)
    logprobs = batch["logprobs"].clone().requires_grad_(True)
    update = SAO().update({**batch, "logprobs": logprobs})
    update.policy_loss(logprobs).backward()
    torch.testing.assert_close(logprobs.grad, -update.coefficients)


def test_tis_caps_and_seqmask_drops_whole_trajectories():
    lp = torch.log(torch.tensor([[0.5, 3.0, 1.0], [20.0, 20.0, 20.0]], dtype=torch.float64))
    batch = {
        "logprobs": lp,
        "sampler_logprobs": torch.zeros_like(lp),
        "values": torch.zeros_like(lp),
        "rewards": torch.tensor([1.0, 1.0], dtype=torch.float64),
        "action_mask": torch.ones_like(lp, dtype=torch.bool),
    }
    tis = SAO(correction="tis", tis_cap=2.0).update(batch)
    assert tis.mask.all()
    ratio_used = tis.coefficients * 6 / tis.advantages
    torch.testing.assert_close(ratio_used, torch.tensor([[0.5, 2.0, 1.0], [2.0, 2.0, 2.0]], dtype=torch.float64))
    seq = SAO(correction="seqmask").update(batch)  # row 0 geo-mean 1.14 inside, row 1 = 20 outside
    assert seq.mask[0].all() and not seq.mask[1].any()
    assert seq.stats["admitted_share"] == 0.5


# ------------------------------------------------------------------------------------------------------
# Properties.


@st.composite
def batches(draw):
    B = draw(st.integers(1, 6))
    T = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.sampled_from([0.0, 0.1, 1.0, 3.0]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    return random_batch(B, T, seed, dtype=dtype, spread=spread)


@settings(max_examples=150, deadline=None)
@given(batch=batches(), correction=st.sampled_from(sorted(CORRECTIONS)))
def test_coefficients_are_zero_exactly_where_the_mask_is_off(batch, correction):
    update = SAO(correction=correction).update(batch)
    assert not update.coefficients[~update.mask].any()
    assert not update.mask[~batch["action_mask"]].any()
    carries = update.mask & (update.advantages != 0)
    assert (update.coefficients[carries] != 0).all()
    for t in (update.advantages, update.value_targets, update.coefficients, update.ratio):
        assert t.dtype == batch["logprobs"].dtype and t.shape == batch["logprobs"].shape


@settings(max_examples=100, deadline=None)
@given(batch=batches())
def test_baseline_arm_never_masks(batch):
    update = SAO(correction="none").update(batch)
    assert torch.equal(update.mask, batch["action_mask"])
    assert update.stats["masked_share"] == 0.0
    assert update.stats["admitted_share"] == 1.0


@settings(max_examples=60, deadline=None)
@given(batch=batches(), k=st.integers(2, 4))
def test_coefficients_scale_as_one_over_n(batch, k):
    """Repeating the batch k times multiplies N by k: every coefficient divides by k."""
    once = SAO().update(batch)
    many = SAO().update({key: torch.cat([v] * k) for key, v in batch.items()})
    torch.testing.assert_close(many.coefficients[: batch["rewards"].shape[0]], once.coefficients / k)


@settings(max_examples=60, deadline=None)
@given(batch=batches())
def test_at_lag_zero_nothing_is_masked_and_ratio_is_one(batch):
    batch = {**batch, "logprobs": batch["sampler_logprobs"].clone()}
    update = SAO().update(batch)
    assert update.stats["masked_share"] == 0.0
    assert update.stats["ratio_max"] == pytest.approx(1.0) and update.stats["ratio_min"] == pytest.approx(1.0)


@settings(max_examples=40, deadline=None)
@given(batch=batches())
def test_float32_and_float64_agree(batch):
    b64 = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    b32 = {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}
    u64, u32 = SAO().update(b64), SAO().update(b32)
    torch.testing.assert_close(u32.advantages.double(), u64.advantages, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------------
# Diagnostics, non-finite inputs, validation.


def test_stats_report_ratio_quantiles_lambda_and_explained_variance():
    batch = random_batch(8, 30, seed=5, spread=0.5)
    update = SAO().update(batch)
    r = update.ratio[batch["action_mask"]]
    s = update.stats
    assert s["ratio_min"] == pytest.approx(r.min().item())
    assert s["ratio_max"] == pytest.approx(r.max().item())
    assert s["ratio_mean"] == pytest.approx(r.mean().item())
    assert s["ratio_p99"] == pytest.approx(torch.quantile(r, 0.99).item())
    v, g = batch["values"][batch["action_mask"]], update.value_targets[batch["action_mask"]]
    assert s["explained_variance"] == pytest.approx(1 - ((g - v).var(unbiased=False) / g.var(unbiased=False)).item())
    lengths = batch["action_mask"].sum(1).double()
    assert s["lambda_mean"] == pytest.approx((1 - 1 / (1.5 * lengths)).clamp(min=0).mean().item())
    assert s["tokens"] == batch["action_mask"].sum().item()


def test_perfect_critic_explains_all_variance():
    batch = random_batch(8, 12, seed=2)
    targets = monte_carlo_returns(batch["rewards"], batch["action_mask"])
    update = SAO().update({**batch, "values": targets})
    assert update.stats["explained_variance"] == pytest.approx(1.0)
    assert update.advantages.abs().max().item() == pytest.approx(0.0, abs=1e-12)


def test_nonfinite_tokens_get_zero_coefficient_and_are_counted(faults):
    batch = random_batch(4, 10, seed=0)
    batch["action_mask"][:] = True
    batch["logprobs"][0, 3] = float("nan")
    batch["logprobs"][1, 5] = float("inf")
    batch["values"][2, 9] = float("nan")  # poisons the advantages of row 2 (the recursion carries it back)
    for correction in ("dis", "none"):
        update = SAO(correction=correction).update(batch)
        assert torch.isfinite(update.coefficients).all()
        assert update.coefficients[0, 3] == 0 and update.coefficients[1, 5] == 0
        assert not update.coefficients[2].any()
        assert update.stats["nonfinite"] == 2 + 10
        assert math.isfinite(update.stats["ratio_max"])
    faults.record("non-finite values", "NaN/inf ratios and values in SAO.update")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ratio": (1.2, 6.0)}, "ratio"),
        ({"ratio": (0.7, 0.9)}, "ratio"),
        ({"ratio": (-0.1, 2.0)}, "ratio"),
        ({"gae_alpha": 0.0}, "gae-alpha"),
        ({"gae_alpha": -1.0}, "gae-alpha"),
        ({"correction": "ppo"}, "correction"),
        ({"tis_cap": 0.5}, "tis-cap"),
    ],
)
def test_invalid_configuration_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SAO(**kwargs)


def test_invalid_batches_name_the_field():
    good = random_batch(3, 5, seed=0)
    with pytest.raises(ValueError, match="values"):
        SAO().update({**good, "values": torch.zeros(3, 4, dtype=torch.float64)})
    with pytest.raises(ValueError, match="rewards"):
        SAO().update({**good, "rewards": torch.zeros(4, dtype=torch.float64)})
    with pytest.raises(ValueError, match="empty"):
        SAO().update({k: v[:0] for k, v in good.items()})
    with pytest.raises(ValueError, match="action_mask"):
        SAO().update({**good, "action_mask": torch.zeros(3, 5, dtype=torch.bool)})
    with pytest.raises(ValueError, match="missing"):
        SAO().update({k: v for k, v in good.items() if k != "values"})
    with pytest.raises(ValueError, match="float32 or float64"):
        SAO().update({**good, "logprobs": good["logprobs"].half()})


# ------------------------------------------------------------------------------------------------------
# Per-turn rewards: `rewards` [B, T], each turn's reward on its last action token.


def terminal_as_per_turn(rewards, action_mask):
    """[B] terminal rewards written as [B, T]: R_i on the last action token, 0 everywhere else."""
    last = action_mask & (action_mask.cumsum(dim=1) == action_mask.sum(dim=1, keepdim=True))
    return torch.where(last, rewards[:, None], torch.zeros(action_mask.shape, dtype=rewards.dtype))


def assert_updates_identical(a, b):
    for name in ("advantages", "value_targets", "coefficients", "ratio", "mask"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.stats.keys() == b.stats.keys()
    for key, x in a.stats.items():
        y = b.stats[key]
        assert x == y or (math.isnan(x) and math.isnan(y)), key


@st.composite
def multi_turn_batches(draw):
    B = draw(st.integers(1, 6))
    T = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.sampled_from([0.0, 0.1, 1.0, 3.0]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    return multi_turn_batch(B, T, seed, dtype=dtype, spread=spread)


@settings(max_examples=200, deadline=None)
@given(
    batch=multi_turn_batches(), alpha=st.sampled_from([1.5, 0.05, 10.0]), correction=st.sampled_from(["dis", "none"])
)
def test_per_turn_update_matches_slow_reference_on_ragged_multi_turn_batches(batch, alpha, correction):
    update = SAO(gae_alpha=alpha, correction=correction).update(batch)
    mask = batch["action_mask"].tolist()
    ref_adv, ref_targets, _ = reference_per_turn(
        batch["values"].double().tolist(), batch["rewards"].double().tolist(), mask, alpha
    )
    dtype = batch["logprobs"].dtype
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    ref_adv = torch.tensor(ref_adv, dtype=torch.float64)
    torch.testing.assert_close(update.advantages.double(), ref_adv, **tol)
    torch.testing.assert_close(update.value_targets.double(), torch.tensor(ref_targets, dtype=torch.float64), **tol)
    lo, hi = 0.7, 6.0
    ratio = (batch["logprobs"].double() - batch["sampler_logprobs"].double()).exp()
    f = ratio if correction == "none" else torch.where((ratio > lo) & (ratio < hi), ratio, torch.zeros_like(ratio))
    ref_coef = torch.where(batch["action_mask"], f * ref_adv, torch.zeros_like(ratio)) / sum(map(sum, mask))
    torch.testing.assert_close(update.coefficients.double(), ref_coef, **tol)


@pytest.mark.parametrize("seed", range(10))
def test_per_turn_gae_and_targets_match_reference_across_powers_of_two(seed):
    T = 1 + seed * 13 % 97  # 1 .. 97
    batch = multi_turn_batch(5, T, seed)
    adv, lam = gae(batch["values"], batch["rewards"], batch["action_mask"], 1.5)
    targets = monte_carlo_returns(batch["rewards"], batch["action_mask"])
    ref_adv, ref_targets, ref_lam = reference_per_turn(
        batch["values"].tolist(), batch["rewards"].tolist(), batch["action_mask"].tolist(), 1.5
    )
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(targets, torch.tensor(ref_targets, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lam, torch.tensor(ref_lam, dtype=torch.float64))


def test_per_turn_by_hand_with_zero_critic():
    """Two turns [a a] obs [a] pad, rewards 0.5 and 2: A_k sums the later rewards discounted by λ per
    action token (the observation is skipped); G_t is the undiscounted return-to-go."""
    mask = torch.tensor([[True, True, False, True, False]])
    rewards = torch.tensor([[0.0, 0.5, 0.0, 2.0, 0.0]], dtype=torch.float64)
    values = torch.zeros(1, 5, dtype=torch.float64)
    adv, lam = gae(values, rewards, mask, 1.5)
    lam_ = 1 - 1 / 4.5
    assert lam.item() == pytest.approx(lam_)
    assert adv[0].tolist() == pytest.approx([lam_ * (0.5 + lam_ * 2.0), 0.5 + lam_ * 2.0, 0.0, 2.0, 0.0])
    assert monte_carlo_returns(rewards, mask)[0].tolist() == [2.5, 2.5, 2.0, 2.0, 0.0]


def test_per_turn_bootstrap_jumps_over_observation_tokens():
    """A huge value on the observation token between two turns leaks into no advantage."""
    mask = torch.tensor([[True, False, True]])
    values = torch.tensor([[0.5, 1e6, 0.25]], dtype=torch.float64)
    adv, _ = gae(values, torch.tensor([[0.75, 0.0, 1.0]], dtype=torch.float64), mask, 1.5)
    lam = 1 - 1 / 3
    d1 = 1.0 - 0.25
    d0 = 0.75 + 0.25 - 0.5  # this turn's reward, bootstrapped from the next *action* token
    assert adv[0].tolist() == pytest.approx([d0 + lam * d1, 0.0, d1])


@settings(max_examples=300, deadline=None)
@given(batch=batches(), correction=st.sampled_from(sorted(CORRECTIONS)), alpha=st.sampled_from([1.5, 0.05]))
def test_terminal_reward_written_per_turn_gives_bit_identical_update(batch, correction, alpha):
    """[B] rewards and the same rewards on each row's last action token of a [B, T] tensor: equal tensors
    (torch.equal, float32 and float64) and equal stats, for every correction rule."""
    sao = SAO(correction=correction, gae_alpha=alpha)
    per_turn = terminal_as_per_turn(batch["rewards"], batch["action_mask"])
    assert_updates_identical(sao.update(batch), sao.update({**batch, "rewards": per_turn}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(30))
def test_terminal_reward_written_per_turn_gives_bit_identical_estimators(seed, dtype):
    T = 1 + seed * 7 % 61
    batch = random_batch(7, T, seed, dtype=dtype)
    batch["rewards"] = torch.randn(7, generator=torch.Generator().manual_seed(seed), dtype=dtype)  # not just 0/1
    mask = batch["action_mask"]
    per_turn = terminal_as_per_turn(batch["rewards"], mask)
    adv_b, lam_b = gae(batch["values"], batch["rewards"], mask, 1.5)
    adv_bt, lam_bt = gae(batch["values"], per_turn, mask, 1.5)
    assert torch.equal(adv_b, adv_bt) and torch.equal(lam_b, lam_bt)
    assert torch.equal(monte_carlo_returns(batch["rewards"], mask), monte_carlo_returns(per_turn, mask))
    assert_updates_identical(SAO().update(batch), SAO().update({**batch, "rewards": per_turn}))


@settings(max_examples=100, deadline=None)
@given(batch=multi_turn_batches())
def test_multi_turn_batch_rewarded_only_on_its_last_turn_equals_the_terminal_case(batch):
    mask = batch["action_mask"]
    last = mask & (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True))  # [B, T]
    only_last = torch.where(last, batch["rewards"], torch.zeros_like(batch["rewards"]))
    terminal = only_last.sum(dim=1)  # [B] the last turn's reward
    assert_updates_identical(
        SAO().update({**batch, "rewards": terminal}), SAO().update({**batch, "rewards": only_last})
    )


def test_terminal_and_per_turn_agree_with_nonfinite_inputs():
    batch = random_batch(4, 10, seed=0)
    batch["action_mask"][:] = True
    batch["logprobs"][1, 5] = float("inf")
    batch["values"][2, 9] = float("nan")
    per_turn = terminal_as_per_turn(batch["rewards"], batch["action_mask"])
    assert_updates_identical(SAO().update(batch), SAO().update({**batch, "rewards": per_turn}))


def test_perfect_critic_on_per_turn_rewards_explains_all_variance():
    batch = multi_turn_batch(8, 30, seed=4)
    targets = monte_carlo_returns(batch["rewards"], batch["action_mask"])
    update = SAO().update({**batch, "values": targets})
    assert update.stats["explained_variance"] == pytest.approx(1.0)
    assert update.advantages.abs().max().item() == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("value", [1.0, -0.5, float("nan")])
@pytest.mark.parametrize(("row", "col"), [(0, 1), (0, 4)])  # an observation token, a padding token
def test_per_turn_reward_on_a_non_action_token_is_rejected(row, col, value):
    mask = torch.tensor([[True, False, True, True, False], [True, True, True, True, True]])
    lp = torch.zeros(2, 5, dtype=torch.float64)
    rewards = torch.zeros(2, 5, dtype=torch.float64)
    rewards[0, 3] = 1.0
    batch = {"logprobs": lp, "sampler_logprobs": lp, "values": lp, "rewards": rewards, "action_mask": mask}
    SAO().update(batch)  # rewards on action tokens only: accepted
    rewards = rewards.clone()
    rewards[row, col] = value
    with pytest.raises(ConfigError, match=rf"rewards'\]\[{row}, {col}\].*non-action token"):
        SAO().update({**batch, "rewards": rewards})


def test_per_turn_rewards_of_the_wrong_width_are_rejected():
    good = random_batch(3, 5, seed=0)
    with pytest.raises(ConfigError, match=r"rewards.*\[3\] \(terminal\) or \[3, 5\] \(per turn\)"):
        SAO().update({**good, "rewards": torch.zeros(3, 6, dtype=torch.float64)})


# ------------------------------------------------------------------------------------------------------
# The correction alone (SAO.correct): what a framework's loss applies to advantages its estimator made.


@pytest.mark.parametrize("correction", sorted(set(CORRECTIONS) - {"random"}))
@pytest.mark.parametrize("seed", range(5))
def test_correct_on_the_updates_own_advantages_gives_its_coefficients_bit_for_bit(seed, correction):
    batch = multi_turn_batch(6, 30, seed)
    sao = SAO(correction=correction)
    update = sao.update(batch)
    raw, _ = gae(batch["values"], batch["rewards"], batch["action_mask"], sao.gae_alpha)
    correction_only = sao.correct({**batch, "advantages": raw})
    for name in ("coefficients", "ratio", "mask"):
        assert torch.equal(getattr(correction_only, name), getattr(update, name)), name
    assert list(update.stats) == [*list(correction_only.stats)[:-1], "lambda_mean", "explained_variance", "nonfinite"]
    for key, value in correction_only.stats.items():
        assert value == update.stats[key] or (math.isnan(value) and math.isnan(update.stats[key])), key
    scaled = sao.correct({**batch, "advantages": raw}, normalizer=1.0)  # f(ρ)·A, the framework divides by N
    n = batch["action_mask"].sum()
    torch.testing.assert_close(scaled.coefficients / n, update.coefficients, rtol=1e-15, atol=0)


def test_correct_refuses_a_batch_without_the_samplers_logprobs():
    batch = multi_turn_batch(3, 8, seed=1)
    batch["advantages"] = batch.pop("values")
    del batch["sampler_logprobs"]
    with pytest.raises(ConfigError, match=r"missing \['sampler_logprobs'\]"):
        SAO().correct(batch)
