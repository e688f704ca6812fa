"""`sao selftest`: the recipe page's check that the two arms run the same update and differ only in the mask.

A hand-made batch of four trajectories (one with an observation gap, one of a single token, ragged
lengths) whose ratios straddle the band (0.7, 6.0) on both sides goes through ``SAO.update`` once per arm.
The check passes when both arms get identical advantages, value targets and ratios, and their
coefficients differ on exactly the out-of-band action tokens. No model, no data: it runs in a second.
"""

from __future__ import annotations

import math

import torch

from sao.algorithm.update import SAO


def handmade_batch() -> dict[str, torch.Tensor]:
    """Four trajectories, T = 6, with ratios chosen on both sides of (0.7, 6.0) and on its edges."""
    ratios = torch.tensor(
        [
            [1.0, 0.5, 1.2, 8.0, 1.0, 1.0],  # 0.5 and 8.0 out of band
            [0.9, 1.1, 1.0, 6.0, 0.0, 0.0],  # 6.0 exactly: out (the band is open); then padding
            [1.3, 1.0, 1.0, 0.69, 2.0, 1.0],  # observation tokens at 1..2; 0.69 out
            [30.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # a single action token, far out
        ],
        dtype=torch.float64,
    )
    action_mask = torch.tensor(
        [
            [True, True, True, True, True, False],
            [True, True, True, True, False, False],
            [True, False, False, True, True, True],
            [True, False, False, False, False, False],
        ]
    )
    sampler_logprobs = torch.full_like(ratios, -1.5)
    return {
        "logprobs": sampler_logprobs + ratios.clamp(min=1e-9).log(),
        "sampler_logprobs": sampler_logprobs,
        "values": torch.tensor(
            [
                [0.2, 0.3, 0.4, 0.5, 0.6, 0.0],
                [0.1, 0.1, 0.2, 0.2, 0.0, 0.0],
                [0.5, 9.0, 9.0, 0.4, 0.3, 0.2],
                [0.3, 0.0, 0.0, 0.0, 0.0, 0.0],
            ],
            dtype=torch.float64,
        ),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64),
        "action_mask": action_mask,
    }


# The action tokens whose ratio lies outside (0.7, 6.0), picked by hand when the batch was written.
EXPECTED_OUT_OF_BAND = torch.tensor(
    [
        [False, True, False, True, False, False],
        [False, False, False, True, False, False],
        [False, False, False, True, False, False],
        [True, False, False, False, False, False],
    ]
)


def run(verbose: bool = True) -> bool:
    """Run every check, print one line each, return True when all pass."""
    batch = handmade_batch()
    sao_dis, sao_none = SAO(correction="dis"), SAO(correction="none")
    dis, base = sao_dis.update(batch), sao_none.update(batch)
    lo, hi = sao_dis.ratio
    action = batch["action_mask"]
    out_of_band = action & ~((dis.ratio > lo) & (dis.ratio < hi))
    differs = dis.coefficients != base.coefficients

    checks = [
        ("both arms get the same advantages", torch.equal(dis.advantages, base.advantages)),
        ("both arms get the same value targets", torch.equal(dis.value_targets, base.value_targets)),
        ("both arms see the same ratios", torch.equal(dis.ratio, base.ratio)),
        (
            f"the batch straddles the band: {int(out_of_band.sum())} of {int(action.sum())} action tokens out",
            bool(out_of_band.any()) and bool((action & ~out_of_band).any()),
        ),
        ("they are exactly the tokens chosen by hand", torch.equal(out_of_band, EXPECTED_OUT_OF_BAND)),
        ("every out-of-band token has a non-zero advantage", bool((dis.advantages[out_of_band] != 0).all())),
        ("coefficients differ exactly on the out-of-band tokens", torch.equal(differs, out_of_band)),
        ("the recipe arm zeroes every out-of-band token", not dis.coefficients[out_of_band].any()),
        ("the baseline arm masks nothing", torch.equal(base.mask, action)),
        (
            "in-band coefficients are equal on both arms",
            torch.equal(dis.coefficients[~out_of_band], base.coefficients[~out_of_band]),
        ),
        (
            "recipe masked share equals baseline would-be masked share",
            math.isclose(dis.stats["masked_share"], base.stats["would_be_masked_share"]),
        ),
        ("no coefficient is non-finite", bool(torch.isfinite(dis.coefficients).all())),
    ]
    ok = all(passed for _, passed in checks)
    if verbose:
        for name, passed in checks:
            print(f"  {'ok  ' if passed else 'FAIL'} {name}")
        s = dis.stats
        print(
            f"  masked share {s['masked_share']:.3f}, ratio max {s['ratio_max']:.1f}, "
            f"lambda mean {s['lambda_mean']:.3f}, admitted share {s['admitted_share']:.2f}"
        )
        print("selftest " + ("passed" if ok else "FAILED"))
    return ok
