"""The step record's off-policy diagnostics on hand-made batches: the ratios' effective sample size, the masked
share split by the band's side, and which tokens fall outside the band, as text and by where in the reply."""

from __future__ import annotations

import math

import pytest
import torch

from sao.algorithm.update import SAO
from sao.core.names import POLICY
from sao.experiment.results import checks
from sao.rollout.types import Rollout
from sao.training.records import outside_band, step_record

BAND = (0.7, 6.0)
NAMES = {5: " =", 6: " 42", 7: "+", 8: "The", 9: " answer"}


def _text(ids):
    return [NAMES[i] for i in ids]


def _batch():
    """Two replies of 10 action tokens each (row 0 padded at the end, row 1 with two observation tokens at 4, 5)."""
    ratio = torch.tensor(
        [
            [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 8.0, 1.0, 1.0],
            [0.6, 1.0, 1.0, 1.0, 9.0, 9.0, 1.0, 1.0, 1.0, 0.5, 7.0, 1.0],
        ],
        dtype=torch.float64,
    )
    ids = torch.tensor([[5, 8, 9, 9, 9, 9, 9, 9, 9, 6, 0, 0], [5, 8, 9, 9, 7, 7, 9, 9, 9, 5, 6, 9]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, 10:] = False
    mask[1, 4:6] = False  # tool output: not the model's tokens, whatever their ratio
    return ratio, mask, ids


def test_the_tokens_outside_the_band_are_counted_by_text_side_and_place_in_the_reply():
    ratio, mask, ids = _batch()
    got = outside_band(ratio, mask, ids, BAND, _text)
    # " =" (id 5): below at both rows' first token and at row 1's 8th action token, seen 3 times
    # " 42" (id 6): above at row 0's last token and row 1's 9th action token, seen twice
    assert got["outside_band_tokens"] == [[" =", 3, 0, 3], [" 42", 0, 2, 2]]
    # row 0: action tokens 0 and 9 of 10; row 1: 0, 7 and 8 of 10 (the observation tokens are not counted)
    assert got["outside_band_by_position"] == [2, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert got["tokens_by_position"] == [2] * 10
    assert outside_band(ratio, mask, ids, BAND, None)["outside_band_tokens"][0][0] == "5", "no tokenizer: the id"
    calm = outside_band(torch.ones_like(ratio), mask, ids, BAND, _text)
    assert calm["outside_band_tokens"] == [] and sum(calm["outside_band_by_position"]) == 0


def _rollout(mask, ids):
    B, R = ids.shape
    return Rollout(
        prompt_ids=torch.zeros(B, 2, dtype=torch.long),
        prompt_mask=torch.ones(B, 2, dtype=torch.bool),
        response_ids=ids,
        response_mask=mask | (ids == 7),
        action_mask=mask,
        sampler_logprobs=torch.zeros(B, R),
        cut=torch.zeros(B, dtype=torch.bool),
    )


def test_the_record_carries_the_ess_the_split_masked_share_and_the_outside_tokens():
    ratio, mask, ids = _batch()
    batch = {
        "logprobs": ratio.log(),
        "sampler_logprobs": torch.zeros_like(ratio),
        "values": torch.zeros_like(ratio),
        "rewards": torch.tensor([1.0, 0.0], dtype=torch.float64),
        "action_mask": mask,
    }
    update = SAO(correction="dis").update(batch)
    record = step_record(
        step=3,
        phase=POLICY,
        policy_step=0,
        policy_version=1,
        staleness=[1, 1],
        token_staleness=torch.ones_like(ids),
        rollout=_rollout(mask, ids),
        rewards=batch["rewards"],
        update=update,
        critic_loss=0.0,
        grad_norm=0.1,
        skipped=False,
        band=BAND,
        token_text=_text,
    )
    n = int(mask.sum())  # 20 action tokens: 3 below the band, 2 above
    assert record["masked_share_low"] == pytest.approx(3 / n) and record["masked_share_high"] == pytest.approx(2 / n)
    assert record["would_be_masked_share_low"] == pytest.approx(3 / n)
    r = ratio[mask]
    assert record["ratio_ess_share"] == pytest.approx(float(r.sum() ** 2 / (n * r.square().sum())))
    assert record["outside_band_tokens"][0] == [" =", 3, 0, 3]
    bare = step_record(
        step=3,
        phase=POLICY,
        policy_step=0,
        policy_version=1,
        staleness=[1, 1],
        token_staleness=torch.ones_like(ids),
        rollout=_rollout(mask, ids),
        rewards=batch["rewards"],
        update=update,
        critic_loss=0.0,
        grad_norm=0.1,
        skipped=False,
    )
    assert "outside_band_tokens" not in bare and math.isfinite(bare["ratio_ess_share"])


def _policy_record(tokens, position):
    return {
        "phase": POLICY,
        "staleness": 1,
        "masked_share": 0.1,
        "would_be_masked_share": 0.1,
        "ratio_max": 7.0,
        "grad_norm": 0.1,
        "nonfinite": 0,
        "skipped": False,
        "reward_mean": 0.5,
        "critic_loss": 0.0,
        "explained_variance": 0.0,
        "outside_band_tokens": tokens,
        "outside_band_by_position": position,
        "tokens_by_position": [5] * 10,
    }


def test_a_runs_checks_sum_the_outside_tokens_over_its_steps():
    log = [
        _policy_record([[" =", 3, 0, 3], [" 42", 0, 2, 2]], [2] + [0] * 9),
        _policy_record([[" 42", 1, 4, 6]], [0] * 9 + [5]),
    ]
    c = checks(log, grad_clip=1.0)
    assert c["outside_band_tokens"] == [[" 42", 1, 6, 8], [" =", 3, 0, 3]]
    assert c["outside_band_by_position"] == [2] + [0] * 8 + [5] and c["tokens_by_position"] == [10] * 10
    old = [{k: v for k, v in r.items() if "position" not in k and "tokens" not in k} for r in log]
    assert "outside_band_tokens" not in checks(old, grad_clip=1.0), "a log written before: the checks as they were"
