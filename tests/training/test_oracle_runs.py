"""The oracle on the tiny preset: the oracle baseline's draws beside each batch, the ceiling's snapshots in the record
and on disk, and the sampler-side perturbations of controlled size (logit noise, a float16 sampler)."""

from __future__ import annotations

import math
import statistics

import pytest
from safetensors import safe_open

from sao.core.config import Config
from sao.core.errors import ConfigError
from sao.training import build
from sao.training.oracle import snapshot_path


def test_the_oracle_baseline_and_the_ceiling_snapshots_on_a_tiny_run(tiny_config, tmp_path):
    config = tiny_config.replace(
        baseline="oracle",
        oracle_samples=2,
        ceiling_every=1,
        ceiling_prompts=4,
        steps=2,
        critic_warmup=1,
        batch_size=8,
        micro_batch=8,
        lag=1,
    )
    trainer = build.trainer(config, tmp_path / "run", progress=False)
    records = trainer.run()
    # the baseline: every step's K = 2 fresh rollouts per prompt, shrunk; the update's EV is the oracle's, the
    # critic's beside it
    for r in records:
        assert r["oracle_samples"] == 2 and 0.0 <= r["oracle_shrinkage"] <= 1.0
        assert 0.0 <= r["oracle_rate_mean"] <= 1.0 and "critic_explained_variance" in r
    # the ceiling: at the warmup's end, after each policy step (every 1) and so after the last
    assert [r.get("ceiling_snapshot") for r in records] == ["warmup-end", "1", "2"]
    hidden = trainer.models.policy.config.hidden_size
    for r in records:
        assert r["ceiling_prompts"] == 4 and r["ceiling_samples"] == 2 and r["ceiling_seconds"] > 0
        assert 0.0 <= r["ceiling_mean"] <= 1.0 and math.isfinite(r["ceiling_critic_ev"])
        assert r["ceiling_in_sample"] >= r["ceiling_prompt_level"] or math.isnan(r["ceiling_prompt_level"])
        with safe_open(str(snapshot_path(tmp_path / "run", r["step"])), "pt") as f:
            assert list(f.get_tensor("returns").shape) == [4, 2]
            assert list(f.get_tensor("prompt_hidden").shape) == [4, hidden]
            tokens, prompt = f.get_tensor("token_hidden"), f.get_tensor("token_prompt")
            assert tokens.shape[1] == hidden and tokens.shape[0] == prompt.shape[0] > 0
            assert int(prompt.min()) >= 0 and int(prompt.max()) < 4
            assert len(f.metadata()["task_ids"].split("\n")) == 4


def test_logit_noise_and_a_float16_sampler_are_mismatch_of_controlled_size(tiny_config, tmp_path):
    config = tiny_config.replace(lag=0, steps=1, critic_warmup=1, batch_size=16, micro_batch=16)
    mean = lambda log: statistics.fmean(r["abs_log_ratio_mean"] for r in log)  # noqa: E731
    half = build.trainer(config.replace(sampler_dtype="float16"), tmp_path / "fp16", progress=False).run()
    assert 1e-5 < mean(half) < 1e-2  # half precision's rounding: present, far inside the band
    noisy = build.trainer(config.replace(sampler_logit_noise=2.0), tmp_path / "noise", progress=False).run()
    assert mean(noisy) > 0.1 and all(r["would_be_masked_share"] > 0 for r in noisy)  # a dose the band binds on
    assert all(r["ratio_ess_share"] < 1 for r in noisy)


@pytest.mark.parametrize("setting", [{"baseline": "oracle"}, {"ceiling_every": 5}])
def test_the_oracles_draws_off_the_local_source_are_refused_in_one_line(setting):
    with pytest.raises(ConfigError, match="only --rollout local does") as error:
        Config.load("tiny", rollout="ray", **setting)
    assert "\n" not in str(error.value)


def test_a_logit_noise_off_the_local_source_or_out_of_range_is_refused():
    with pytest.raises(ConfigError, match="local"):
        Config.load("tiny", rollout="ray", sampler_logit_noise=1.0)
    with pytest.raises(ConfigError, match=r"\[0, 100\]"):
        Config.load("tiny", sampler_logit_noise=-1.0)
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        Config.load("tiny", gae_lambda=1.5)
