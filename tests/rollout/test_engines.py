"""The remote-engine seam: an engine of its own (``fake_engine.py``: one file and one registry line) draws the batches
of ``--rollout fake`` through the same source, audits and delivery check as vLLM, with no edit anywhere else."""

from __future__ import annotations

import pytest

import sao
from sao.core.errors import ConfigError, DataError

fake_engine = pytest.importorskip("fake_engine")  # registers --rollout fake


def _settings(**changes):
    return {
        "preset": "tiny",
        "rollout": "fake",
        "steps": 3,
        "critic_warmup": 1,
        "batch_size": 8,
        "lag": 1,
        "train_prompts": 32,
        "test_prompts": 8,
        "temperature": 0.7,
        "micro_batch": 8,
        **changes,
    }


def test_a_registered_engine_draws_the_batches_under_the_footing_audit_and_the_delivery_check(tiny_model_dir, tmp_path):
    trainer = sao.train(_settings(), tmp_path / "run", progress=False)
    records = trainer.records
    assert [r["staleness"] for r in records] == [0, 0, 1, 1]  # the stale sampler's cycle at LAG 1, as the local one
    assert [r["engine_adapter_version"] for r in records] == [0, 0, 0, 1]  # refreshed after each policy step's draw
    fresh = [r["mismatch_fresh"] for r in records if r["staleness"] == 0]
    assert fresh and max(fresh) < 1e-5  # staleness-0 rows: the engine served exactly the published adapter
    assert records[0]["footing_abs_log_ratio_at_T"] < 1e-5 < records[0]["footing_abs_log_ratio_at_1"]  # at T = 0.7
    assert (tmp_path / "run" / "fake-adapters").is_dir() and records[-1]["policy_version"] == 3


def test_an_engine_that_never_loads_the_published_adapter_stops_the_run_in_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(DataError, match="not serving the adapter the trainer published"):
        sao.train(_settings(fake_ignores_adapters=True, lag=0, lr=0.05), tmp_path / "run", progress=False)


def test_an_engine_setting_of_another_source_is_refused_in_one_line():
    expected = "--fake-ignores-adapters is a setting of --rollout fake, not of --rollout local"
    with pytest.raises(ConfigError, match=expected):
        sao.Config.load("tiny", fake_ignores_adapters=True)
