"""The random correction control reproduces: its mask is a hash of integers (seed, step, row, position) alone, so it
is the same at any thread count and under a last-bit change of the log-probabilities, changes with the seed and the
step, and drops at each staleness level the share dis masked at that level."""

from __future__ import annotations

import math

import pytest
import torch

from sao.algorithm.corrections import mix64, row_keys, token_uniforms
from sao.algorithm.update import SAO
from sao.experiment.runner import dis_shares_by_staleness

LEVELS = 4  # staleness 0 .. 3


def _batch(B: int, T: int, *, seed: int = 7, step: int = 3) -> dict[str, torch.Tensor]:
    """B rows of T action tokens whose ratio drifts further from 1 the staler the row (staleness = row % LEVELS)."""
    g = torch.Generator().manual_seed(11)
    staleness = torch.arange(B) % LEVELS  # [B]
    sampler = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3  # [B, T]
    drift = 0.25 * staleness[:, None].double() * torch.randn(B, T, generator=g, dtype=torch.float64)  # [B, T]
    return {
        "logprobs": sampler + drift,
        "sampler_logprobs": sampler,
        "values": torch.zeros(B, T, dtype=torch.float64),
        "rewards": torch.ones(B, dtype=torch.float64),
        "action_mask": torch.ones(B, T, dtype=torch.bool),
        "staleness": staleness,
        "random_key": row_keys(seed, step, B),
    }


def _dropped(update, batch) -> torch.Tensor:
    return batch["action_mask"] & ~update.mask  # [B, T]


def test_mix64_is_splitmix64s_finaliser_bit_for_bit():
    mask = 2**64 - 1

    def reference(x: int) -> int:  # the uint64 arithmetic in Python's unbounded integers
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    words = [0, 1, 2, 17, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF]
    signed = torch.tensor([w - 2**64 if w >= 2**63 else w for w in words], dtype=torch.int64)
    assert [int(v) % 2**64 for v in mix64(signed)] == [reference(w) for w in words]


def test_the_random_mask_is_the_same_at_one_and_two_threads():
    batch = _batch(1024, 64)  # 65536 tokens: large enough that torch splits elementwise work over threads
    rule = SAO(correction="random", random_mask_share=0.3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _dropped(rule.update(batch), batch)
        torch.set_num_threads(2)
        two = _dropped(rule.update(batch), batch)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_the_random_mask_does_not_move_when_the_log_probabilities_move_by_1e_7():
    batch = _batch(64, 32)
    rule = SAO(correction="random", random_mask_share=(0.0, 0.1, 0.2, 0.3))
    g = torch.Generator().manual_seed(5)
    nudged = {
        **batch,
        "logprobs": batch["logprobs"] + 1e-7 * torch.randn(64, 32, generator=g, dtype=torch.float64),
        "sampler_logprobs": batch["sampler_logprobs"] - 1e-7,
    }
    assert torch.equal(_dropped(rule.update(batch), batch), _dropped(rule.update(nudged), nudged))


def test_the_random_mask_differs_across_seeds_and_steps_and_keeps_its_rows_in_a_micro_batch():
    rule = SAO(correction="random", random_mask_share=0.3)
    base = _batch(64, 32)
    masks = {
        key: _dropped(rule.update(b), b)
        for key, b in {"base": base, "seed": _batch(64, 32, seed=8), "step": _batch(64, 32, step=4)}.items()
    }
    assert not torch.equal(masks["base"], masks["seed"]) and not torch.equal(masks["base"], masks["step"])
    n = float(base["action_mask"].sum())
    parts = (slice(0, 40), slice(40, 64))
    halves = [rule.update({k: v[rows] for k, v in base.items()}, normalizer=n) for rows in parts]
    assert torch.equal(torch.cat([h.mask for h in halves]), rule.update(base).mask)
    assert torch.equal(row_keys(7, 3, 24, first_row=40), base["random_key"][40:]), "a row's key is its own"


def test_the_random_mask_drops_the_share_dis_masks_at_each_staleness_level():
    batch = _batch(2048, 32)
    staleness = batch["staleness"]
    dis = SAO(correction="dis").update(batch)
    dis_share = [float(_dropped(dis, batch)[staleness == s].float().mean()) for s in range(LEVELS)]
    assert dis_share[0] == 0 and dis_share[1] < dis_share[2] < dis_share[3], "the band binds more the staler the row"
    random = SAO(correction="random", random_mask_share=tuple(dis_share)).update(batch)
    for s in range(LEVELS):
        tokens = float(batch["action_mask"][staleness == s].sum())  # 16384
        share = float(_dropped(random, batch)[staleness == s].float().mean())
        tolerance = 4 * math.sqrt(dis_share[s] * (1 - dis_share[s]) / tokens) + 1 / tokens  # binomial rounding
        assert abs(share - dis_share[s]) <= tolerance, (s, share, dis_share[s])
    in_band = (random.ratio > 0.7) & (random.ratio < 6.0)
    assert (_dropped(random, batch) & in_band).any(), "it drops tokens dis keeps"


def test_the_random_arm_takes_the_dis_runs_share_at_each_staleness_level():
    records = [{"phase": "critic-warmup", "masked_share": 0.9},
               {"phase": "policy", "masked_share": 0.0, "masked_share_by_staleness": {"0": 0.0}},
               {"phase": "policy", "masked_share": 0.1, "masked_share_by_staleness": {"1": 0.1}},
               {"phase": "policy", "masked_share": 0.2, "masked_share_by_staleness": {"1": 0.3, "3": 0.1}},
               {"phase": "policy", "masked_share": 0.4, "staleness": 4}]  # fmt: skip  # an older log: one level a step
    shares = dis_shares_by_staleness(records)
    assert shares == pytest.approx((0.0, 0.2, 0.175, 0.1, 0.4)), "level 2 never seen: the mean over every policy step"
    assert dis_shares_by_staleness([]) == (0.0,)


def test_uniforms_are_exact_binary_fractions_in_the_unit_interval():
    u = token_uniforms(row_keys(0, 0, 8), 16)  # [8, 16]
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(u * 2**53, (u * 2**53).floor())
