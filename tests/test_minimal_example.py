"""examples/sao_minimal.py writes the update out: its advantages, value targets and coefficients equal
``SAO.update``'s (on random multi-turn batches with observation tokens, and on every batch of a real run), its log
matches ``Trainer``'s on the tiny preset (5 steps: 2 critic-warmup, 3 policy, staleness 0..2), and its flags work."""

from __future__ import annotations

import importlib.util
import math
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

import sao
from sao import SAO

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sao_minimal.py"
KEYS = ("logprobs", "sampler_logprobs", "values", "rewards", "action_mask")  # sao_update's arguments before args


@pytest.fixture
def example():
    spec = importlib.util.spec_from_file_location("sao_minimal", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sao_minimal"] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop("sao_minimal", None)
    return module


def multi_turn_batch(seed: int, dtype: torch.dtype, B: int = 8, T: int = 40) -> dict[str, torch.Tensor]:
    """Ragged rows whose action tokens come in turns, observation tokens between and after them, padding at the
    end; ratios on both sides of the band (0.7, 6.0)."""
    g = torch.Generator().manual_seed(seed)
    length = torch.randint(1, T + 1, (B,), generator=g)  # [B] response tokens, actions and observations
    real = torch.arange(T)[None, :] < length[:, None]  # [B, T]
    turn = torch.randint(2, 8, (B, T), generator=g).cumsum(dim=1)  # [B, T] segment borders
    segment = (torch.arange(T)[None, :, None] >= turn[:, None, :]).sum(dim=2)  # [B, T] which segment t is in
    action_mask = real & (segment % 2 == 0)  # [B, T] even segments are the model's turns
    action_mask[0] = False  # a row with no action token at all
    action_mask[1, :] = torch.arange(T) == 0  # a row of one action token
    sampler_logprobs = -3 * torch.rand(B, T, generator=g, dtype=dtype)
    return {
        "logprobs": sampler_logprobs + 0.9 * torch.randn(B, T, generator=g, dtype=dtype),
        "sampler_logprobs": sampler_logprobs,
        "values": torch.randn(B, T, generator=g, dtype=dtype),
        "rewards": torch.randint(0, 2, (B,), generator=g).to(dtype),
        "action_mask": action_mask,
    }


def assert_matches_library(sao_update, batch: dict[str, torch.Tensor], args) -> None:
    A, G, c, ratio, mask = sao_update(*(batch[key] for key in KEYS), args)
    library = SAO(ratio=args.ratio, correction=args.correction, gae_alpha=args.gae_alpha).update(batch)
    on = batch["action_mask"]
    assert torch.equal(G, library.value_targets)
    assert torch.equal(mask, library.mask)
    assert torch.equal(ratio[on], library.ratio[on])
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if A.dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(A, library.advantages, **tolerance)
    torch.testing.assert_close(c, library.coefficients, **tolerance)


def test_the_written_out_update_is_sao_update_on_multi_turn_batches(example):
    between_turns = 0  # observation tokens with an action token on either side, which the bootstrap jumps over
    for seed in range(4):
        for dtype in (torch.float32, torch.float64):
            batch = multi_turn_batch(seed, dtype)
            on = batch["action_mask"]
            before, after = on.cummax(dim=1).values, on.flip(1).cummax(dim=1).values.flip(1)  # [B, T]
            between_turns += int((before & after & ~on).sum())
            for correction, band in (("dis", (0.7, 6.0)), ("dis", (0.2, 4.0)), ("none", (0.7, 6.0))):
                assert_matches_library(example.sao_update, batch, example.Args(correction=correction, ratio=band))
    assert between_turns > 100


def test_the_minimal_example_matches_the_trainer_step_for_step(example, tmp_path, tiny_model_dir):
    written_out, real_batches = example.sao_update, []

    def checked(*arguments):  # every batch of the run also goes through SAO.update
        *tensors, args = arguments
        assert_matches_library(written_out, dict(zip(KEYS, tensors, strict=True)), args)
        real_batches.append(tensors[-1].shape)
        return written_out(*arguments)

    example.sao_update = checked
    flat = example.main(example.Args(steps=3, critic_warmup=2, batch_size=16))
    settings = {"preset": "tiny", "steps": 3, "critic_warmup": 2, "batch_size": 16}
    trainer = sao.train(settings, tmp_path / "run", progress=False)
    assert len(real_batches) == len(flat) == len(trainer.records) == 5
    assert [r["staleness"] for r in flat] == [0, 0, 0, 1, 2]
    for mine, theirs in zip(flat, trainer.records, strict=True):
        for key, value in mine.items():
            same = math.isclose(value, theirs[key], rel_tol=1e-5, abs_tol=1e-7) or (
                math.isnan(value) and math.isnan(theirs[key])
            )
            assert same, f"step {mine['step']} {key}: example {value} vs trainer {theirs[key]}"
    assert len(EXAMPLE.read_text().splitlines()) <= 300


def test_flags_reach_the_run(example, tiny_model_dir, monkeypatch, capsys):
    assert example.parse_args(["--ratio", "0.2", "4.0", "--critic-warmup", "0"]) == example.Args(
        ratio=(0.2, 4.0), critic_warmup=0
    )
    argv = ["--lag", "8", "--steps", "6", "--critic-warmup", "0", "--batch-size", "2", "--max-new-tokens", "3"]
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), *argv])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    staleness = [int(s) for s in re.findall(r" stale (\d+) ", capsys.readouterr().out)]
    assert staleness == [0, 1, 2, 3, 4, 5]  # at the default lag of 4 the sampler is refreshed after step 4: 1 again
