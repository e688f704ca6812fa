"""Agents end to end on the tiny model: today's task as an environment changes nothing, a SkyRL-Gym
environment runs through sao's sampler unchanged, and training follows multi-turn trajectories."""

from __future__ import annotations

import json

import pytest
import torch

from sao.core.config import Config
from sao.train.trainer import Trainer

TIMING = {"time", "time_sample"}
AGENT_KEYS = {"turns_mean", "tool_calls_mean", "tool_use_share", "tool_error_rate", "observation_share"}


def _log(out):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in json.loads((out / "train_log.json").read_text())]


def test_the_single_turn_task_as_an_environment_trains_exactly_as_today(tiny_config, tmp_path):
    Trainer(tiny_config, tmp_path / "plain", progress=False).run()
    Trainer(tiny_config.replace(env="gsm8k"), tmp_path / "env", progress=False).run()
    plain, env = _log(tmp_path / "plain"), _log(tmp_path / "env")
    assert [{k: v for k, v in r.items() if k not in AGENT_KEYS} for r in env] == plain
    assert all(r["turns_mean"] == 1.0 and r["observation_share"] == 0.0 for r in env)


def test_a_skyrl_gym_environment_runs_through_sao_unchanged(tiny_config, tmp_path):
    """SkyRL-Gym's own multi-turn GSM8K environment (per-turn rewards, a user message between turns) drives a
    short training run: its turns, rewards and observations reach the log."""
    pytest.importorskip("skyrl_gym")
    config = tiny_config.replace(env="skyrl:gsm8k_multi_turn", max_turns=2, max_new_tokens=24, steps=2)
    records = Trainer(config, tmp_path / "run", progress=False).run()
    assert len(records) == config.critic_warmup + config.steps
    assert all(1.0 <= r["turns_mean"] <= 2.0 for r in records) and any(r["turns_mean"] > 1 for r in records)
    assert all(0.0 < r["observation_share"] < 1.0 for r in records if r["turns_mean"] > 1)
    assert all(r["nonfinite"] == 0 and not r["skipped"] for r in records)


def test_gae_over_real_multi_turn_rollouts_matches_the_slow_reference(tiny_model_dir):
    """Per-turn rewards and observation gaps from real episodes, through SAO.update, against the per-token
    reference loop: the advantages and the return-to-go targets agree to float64 precision."""
    pytest.importorskip("skyrl_gym")
    from sao.core.algorithm import SAO
    from sao.model.policy import load_base
    from sao.rollout.episodes import draw_episodes
    from sao.tasks import tiny
    from sao.tasks.envs import env_factory
    from sao.tasks.gsm8k import build_messages
    from test_algorithm import reference_per_turn

    lm, tokenizer = load_base(tiny_model_dir, torch.device("cpu"))
    split = tiny.make_split(16, 8)
    factory = env_factory(Config.preset("tiny", env="skyrl:gsm8k_multi_turn", max_turns=3), tokenizer)
    envs = [factory(t.id, {"answer": t.answer, "question": t.question}) for t in split.train[:8]]
    rollout = draw_episodes(
        lm, tokenizer, envs, [build_messages(t.question, tiny.TINY_INSTRUCTION) for t in split.train[:8]],
        max_new_tokens=24, max_turns=3, max_total_tokens=200, temperature=1.0,
        eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert int(rollout.turns.max()) > 1, "at least one episode took several turns"
    values = torch.randn(rollout.response_ids.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    sampler_logprobs = rollout.sampler_logprobs.double()
    batch = {"logprobs": sampler_logprobs, "sampler_logprobs": sampler_logprobs, "values": values,
             "rewards": rollout.turn_rewards.double(), "action_mask": rollout.action_mask}  # fmt: skip
    update = SAO().update(batch)
    advantages, targets, _ = reference_per_turn(values.tolist(), batch["rewards"].tolist(),
                                                rollout.action_mask.tolist(), SAO().gae_alpha)  # fmt: skip
    torch.testing.assert_close(update.advantages, torch.tensor(advantages, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(update.value_targets, torch.tensor(targets, dtype=torch.float64), rtol=0, atol=1e-12)
