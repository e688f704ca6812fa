"""Agents end to end on the tiny model: today's task as an environment changes nothing, a SkyRL-Gym
environment runs through sao's sampler unchanged, and training follows multi-turn trajectories."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from helpers import run_log
from sao.core.timeline import TIMING_FIELDS
from sao.training import build

TIMING = set(TIMING_FIELDS)  # every step timer
AGENT_KEYS = {
    "turns_mean",
    "tool_calls_mean",
    "tool_use_share",
    "tool_error_rate",
    "observation_share",
    "env_fault_share",
    "env_timeouts",
    "context_cuts",
}


def _log(out):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in run_log(out)]


def test_the_single_turn_task_as_an_environment_trains_exactly_as_today(tiny_config, tmp_path):
    build.trainer(tiny_config, tmp_path / "plain", progress=False).run()
    build.trainer(tiny_config.replace(env="gsm8k"), tmp_path / "env", progress=False).run()
    plain, env = _log(tmp_path / "plain"), _log(tmp_path / "env")
    assert [{k: v for k, v in r.items() if k not in AGENT_KEYS} for r in env] == plain
    assert all(r["turns_mean"] == 1.0 and r["observation_share"] == 0.0 for r in env)


def test_a_skyrl_gym_environment_runs_through_sao_unchanged(tiny_config, tmp_path):
    """SkyRL-Gym's own multi-turn GSM8K environment (per-turn rewards, a user message between turns) drives a
    short training run: its turns, rewards and observations reach the log."""
    pytest.importorskip("skyrl_gym")
    config = tiny_config.replace(env="skyrl:gsm8k_multi_turn", max_turns=2, max_new_tokens=24, steps=2)
    records = build.trainer(config, tmp_path / "run", progress=False).run()
    assert len(records) == config.algorithm.critic_warmup + config.training.steps
    assert all(1.0 <= r["turns_mean"] <= 2.0 for r in records) and any(r["turns_mean"] > 1 for r in records)
    assert all(0.0 < r["observation_share"] < 1.0 for r in records if r["turns_mean"] > 1)
    assert all(r["nonfinite"] == 0 and not r["skipped"] for r in records)


def test_gae_over_real_multi_turn_rollouts_matches_the_slow_reference(tiny_model_dir):
    """Per-turn rewards and observation gaps from real episodes, through SAO.update, against the per-token
    reference loop: the advantages and the return-to-go targets agree to float64 precision."""
    pytest.importorskip("skyrl_gym")
    from helpers import reference_per_turn
    from sao.algorithm.update import SAO
    from sao.model.policy import load_base
    from sao.rollout.episodes import draw_episodes
    from sao.rollout.sampler import PlainDecoder
    from sao.tasks.environments import env_factory
    from sao.tasks.gsm8k import build_messages
    from sao.tiny import arithmetic as tiny

    lm, tokenizer = load_base(tiny_model_dir, torch.device("cpu"))
    split = tiny.make_split(16, 8)
    factory = env_factory("skyrl:gsm8k_multi_turn", tokenizer, max_turns=3)
    envs = [factory(t.id, {"answer": t.answer, "question": t.question}) for t in split.train[:8]]
    rollout = draw_episodes(
        PlainDecoder(lm),
        tokenizer,
        envs,
        [build_messages(t.question, tiny.TINY_INSTRUCTION) for t in split.train[:8]],
        max_new_tokens=24,
        max_turns=3,
        max_total_tokens=200,
        temperature=1.0,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    assert int(rollout.turns.count.max()) > 1, "at least one episode took several turns"
    values = torch.randn(rollout.response_ids.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    sampler_logprobs = rollout.sampler_logprobs.double()
    batch = {
        "logprobs": sampler_logprobs,
        "sampler_logprobs": sampler_logprobs,
        "values": values,
        "rewards": rollout.turns.rewards.double(),
        "action_mask": rollout.action_mask,
    }
    update = SAO().update(batch)
    advantages, targets, _ = reference_per_turn(
        values.tolist(), batch["rewards"].tolist(), rollout.action_mask.tolist(), SAO().gae_alpha
    )
    torch.testing.assert_close(update.advantages, torch.tensor(advantages, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(update.value_targets, torch.tensor(targets, dtype=torch.float64), rtol=0, atol=1e-12)


# --- tiny-calc: the agent the CPU preset trains ---------------------------------------------------------


@pytest.mark.slow
def test_rl_on_tiny_calc_raises_tool_use_and_reward(tmp_path):
    """`sao train --preset tiny --env tiny-calc` as a user runs it (10 critic-warmup steps, then 40 policy
    steps of 64 trajectories). Measured on seeds 17 and 1: before the first policy update (the warmup steps, 640
    trajectories drawn from the warm start) the agent calls the calculator 0.22 and 0.25 of the time and earns
    0.19 and 0.22; over the last 10 policy steps, tool use 0.99 and 0.99, reward 0.82 and 0.85 (first policy
    steps 0.47 -> last 0.82 and 0.85). The margins asked, +0.3 in tool use and +0.25 in reward, are under half
    of those rises and over ten binomial standard errors of a 640-trajectory share (0.02), so a run that learns
    passes on any machine and a run that does not (its shares move by noise only) cannot."""
    from sao.cli import main

    out = tmp_path / "agent"
    assert main(["train", "--preset", "tiny", "--env", "tiny-calc", "--out", str(out), "--quiet"]) == 0
    records = run_log(out)
    warmup = [r for r in records if r["phase"] == "critic-warmup"]
    last = [r for r in records if r["phase"] == "policy"][-10:]
    assert len(warmup) == 10 and len(last) == 10

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    assert mean(last, "tool_use_share") >= mean(warmup, "tool_use_share") + 0.3
    assert mean(last, "reward_mean") >= mean(warmup, "reward_mean") + 0.25
    assert 0.1 < mean(warmup, "tool_use_share") < 0.6, "the warm start calls the tool only sometimes"
    assert all(r["nonfinite"] == 0 for r in records)
    # observation tokens (the calculator's answers) are in the trajectories but never actions
    assert all(0.0 < r["observation_share"] < 1.0 for r in last)


@pytest.mark.slow
def test_recipe_on_tiny_calc_runs_both_arms_evals_and_verdict(tmp_path):
    """`sao recipe --env tiny-calc`, shrunk: both arms train on multi-turn calculator episodes, the base and
    trained models are evaluated on held-out episodes, and the report carries the verdict and agent series."""
    from sao.cli import main

    out = tmp_path / "exp"
    small = [
        "--batch-size",
        "16",
        "--steps",
        "4",
        "--critic-warmup",
        "2",
        "--train-prompts",
        "64",
        "--test-prompts",
        "24",
        "--eval-samples",
        "2",
        "--base-evals",
        "2",
        "--quiet",
    ]
    assert main(["recipe", "--preset", "tiny", "--env", "tiny-calc", *small, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["data"]["env"] == "tiny-calc" and results["config"]["rollout"]["max_new_tokens"] == 24
    (cell,) = results["cells"]
    assert {"dis", "none"} <= set(cell["arms"])
    assert results["verdict"]
    report = (out / "report.md").read_text()
    assert "environment tiny-calc" in report and "tool_use_share" in report
    log = run_log(out)
    assert {r["arm"] for r in log} == {"dis", "none"}
    assert all(r["turns_mean"] >= 1.0 for r in log) and any(r["tool_calls_mean"] > 0 for r in log)


def test_an_id_a_users_module_registers_with_skyrl_gym_is_found_as_it_is(user_module):
    """``--env skyrl:<module>:<id>``: the module is imported first, so the ids it registers with SkyRL-Gym's own
    ``register`` are built as SkyRL builds them (the task's answer as the reward_spec ground truth); a module that
    cannot be imported is one line."""
    pytest.importorskip("skyrl_gym")
    from sao.core.errors import ConfigError
    from sao.tasks.environments import env_factory

    name = user_module("""
        from skyrl_gym.envs.base_text_env import BaseTextEnv
        from skyrl_gym.envs.registration import register

        class Echo(BaseTextEnv):
            def __init__(self, env_config=None, extras=None):
                super().__init__()
                self.answer = extras["reward_spec"]["ground_truth"]

            def init(self, prompt):
                return prompt, {}

            def step(self, action):
                reward = float(action.strip().endswith(self.answer))
                return {"observations": [], "reward": reward, "done": True, "metadata": {}}

        register(id=__name__ + "-echo", entry_point=Echo)
    """)
    assert name not in sys.modules, "not imported yet: sao imports it"
    factory = env_factory(f"skyrl:{name}:{name}-echo", None, max_turns=2)
    env = factory("task/1", {"question": "What is 3+4?", "answer": "7"})
    assert env.answer == "7" and env.step("#### 7")["reward"] == 1.0 and env.step("#### 8")["reward"] == 0.0
    with pytest.raises(ConfigError, match="no module named 'no_such_module_here'") as refused:
        env_factory("skyrl:no_such_module_here:x", None, max_turns=2)
    assert "\n" not in str(refused.value)
