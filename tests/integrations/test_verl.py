"""sao inside verl (``sao.integrations.verl``), run in the venv ``make install-integrations`` builds (verl 0.9.1 on the
CPU): the plug-in is discovered by ``import verl`` in a fresh process; ``sao_*`` and ``sao_gae`` through verl's own
lookup, ``compute_advantage`` and the worker's ``ppo_loss`` equal ``SAO.update``; verl's own ``gae`` is unchanged;
the documented recipe composes and passes verl's checks; every refusal is one line. Skipped where verl is absent."""

from __future__ import annotations

import logging
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")

import torch
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig, PolicyLossConfig

from helpers import multi_turn_batch
from sao.algorithm.update import SAO
from sao.core.errors import ConfigError
from sao.integrations import shared
from sao.integrations import verl as plugin

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}
BAND = (0.7, 6.0)  # the recipe page's band: clip_ratio_low = 0.3, clip_ratio_high = 5.0
SEEDS = range(20)


def actor_config(loss_mode: str = "sao_dis", **changes) -> ActorConfig:
    fields = {"clip_ratio_low": 0.3, "clip_ratio_high": 5.0, "clip_ratio_c": 2.0, **changes}
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=2,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
        **fields,
    )


def advantages_through_verl(batch, estimator: str = "sao_gae"):
    """verl's driver path: ``ray_trainer.compute_advantage`` (as the trainers call it) on a DataProto."""
    from verl.trainer.ppo import ray_trainer

    data = DataProto.from_dict(
        tensors={
            "token_level_rewards": batch["rewards"],
            "values": batch["values"],
            "response_mask": batch["action_mask"].long(),
        }
    )
    out = ray_trainer.compute_advantage(data, estimator, gamma=1.0, lam=1.0, config=_algo())
    return out.batch["advantages"], out.batch["returns"]


def assert_close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------------------
# Discovery and loading.


def test_import_verl_in_a_fresh_process_discovers_the_plugin_and_loads_nothing_more():
    code = (
        "import sys, verl; lazy = 'verl.trainer.ppo.core_algos' not in sys.modules; "
        "from verl.trainer.ppo import core_algos as c; "
        "print(sorted(n for n in c.POLICY_LOSS_REGISTRY if n.startswith('sao_')), "
        "'sao_gae' in c.ADV_ESTIMATOR_REGISTRY, 'verl.trainer.ppo.ray_trainer' in sys.modules, lazy)"
    )
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_PLUGINS"}
    out = (
        subprocess.run(
            [sys.executable, "-W", "ignore", "-c", code],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    expected = sorted(shared.loss_name(rule) for rule in shared.rule_names())
    assert out == f"{expected} True False True"  # registered when core_algos loads, which import verl does not do
    assert expected == ["sao_dis", "sao_none", "sao_seqmask", "sao_tis"]  # every rule of sao's registry but random


def test_the_trainer_module_is_patched_when_imported_and_only_for_sao_gae():
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.v1 import utils as v1_utils

    wrapped = ray_trainer.compute_advantage
    assert getattr(wrapped, plugin.SAO_MARK, None) == "compute_advantage"
    assert v1_utils.compute_advantage is wrapped  # the v1 trainer's own binding is the wrapped one too
    original = wrapped.__wrapped__
    batch = multi_turn_batch(6, 40, seed=0, dtype=torch.float32)
    batch["rewards"] = torch.where(batch["action_mask"], batch["rewards"], torch.zeros_like(batch["rewards"]))
    for estimator in ("gae", "grpo", "reinforce_plus_plus"):
        tensors = {
            "token_level_rewards": batch["rewards"],
            "values": batch["values"],
            "response_mask": batch["action_mask"].long(),
        }
        uid = {"uid": __import__("numpy").array([str(i) for i in range(6)], dtype=object)}
        mine = wrapped(DataProto.from_dict(tensors=dict(tensors), non_tensors=dict(uid)), estimator, config=_algo())
        theirs = original(DataProto.from_dict(tensors=dict(tensors), non_tensors=dict(uid)), estimator, config=_algo())
        for key in ("advantages", "returns"):
            assert torch.equal(mine.batch[key], theirs.batch[key]), (estimator, key)


def test_verls_own_gae_is_unchanged():
    batch = multi_turn_batch(6, 40, seed=1)
    advantages, returns = advantages_through_verl(batch, "gae")
    expected_advantages, expected_returns = core_algos.compute_gae_advantage_return(
        batch["rewards"], batch["values"], batch["action_mask"].long(), gamma=1.0, lam=1.0
    )
    assert torch.equal(advantages, expected_advantages) and torch.equal(returns, expected_returns)


def test_a_plugin_that_cannot_load_says_so_at_warning(monkeypatch, caplog):
    """verl logs a failing plug-in at DEBUG; sao's says so at WARNING (here: a verl without its loss registry)."""
    monkeypatch.delattr(core_algos, "POLICY_LOSS_REGISTRY")
    with caplog.at_level(logging.WARNING, logger="sao.integrations"):
        runpy.run_path(plugin.__file__, run_name="sao_verl_plugin_copy")
    [record] = [r for r in caplog.records if "did not load" in r.getMessage()]
    assert record.levelno == logging.WARNING and "POLICY_LOSS_REGISTRY" in record.getMessage()


def test_a_name_verl_already_has_from_elsewhere_is_left_alone_and_refused_for_a_run(monkeypatch, caplog):
    def foreign(*args, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "sao_dis", foreign)
    with caplog.at_level(logging.WARNING, logger="sao.integrations"):
        assert plugin.register() == []
    assert core_algos.POLICY_LOSS_REGISTRY["sao_dis"] is foreign
    assert any("already has 'sao_dis'" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="not sao's") as refused:
        plugin.check_run(recipe_config())
    assert "\n" not in str(refused.value)


def test_a_verl_outside_the_tested_range_is_used_after_one_warning_naming_the_range(caplog):
    with caplog.at_level(logging.WARNING, logger="sao.integrations"):
        assert shared.check_version("verl", "0.9.1", plugin.TESTED)
        assert not shared.check_version("verl", "0.10.0", plugin.TESTED)
    [record] = caplog.records
    assert "verl >=0.9.1,<0.10" in record.getMessage() and "used as it is" in record.getMessage()


# ---------------------------------------------------------------------------------------------------------
# The method through verl's own lookup equals SAO.update.


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rule", ["dis", "none", "tis", "seqmask"])
def test_sao_losses_and_sao_gae_through_verls_lookup_equal_sao_update(rule, dtype):
    loss_fn = core_algos.get_policy_loss_fn(f"sao_{rule}")
    masked = 0
    for seed in SEEDS:
        batch = multi_turn_batch(6, 40, seed, dtype=dtype)
        sao = SAO(correction=rule, ratio=BAND, tis_cap=2.0)
        update = sao.update(batch)
        advantages, returns = advantages_through_verl(batch)
        action = batch["action_mask"]
        assert_close(advantages, update.advantages, dtype)
        assert_close(returns[action], update.value_targets[action], dtype)

        logprobs = batch["logprobs"].clone().requires_grad_(True)
        loss, metrics = loss_fn(
            old_log_prob=batch["sampler_logprobs"],
            log_prob=logprobs,
            advantages=advantages,
            response_mask=action,
            loss_agg_mode="token-mean",
            config=actor_config(f"sao_{rule}"),
            rollout_is_weights=None,
        )
        reference = batch["logprobs"].clone().requires_grad_(True)
        expected = update.policy_loss(reference)
        loss.backward()
        expected.backward()
        assert_close(loss, expected, dtype)
        assert_close(logprobs.grad, reference.grad, dtype)
        assert metrics["sao/masked_share"] == pytest.approx(update.stats["masked_share"], abs=TOLERANCE[dtype])
        masked += int((action & ~update.mask).sum())
    assert (masked > 0) == (rule in ("dis", "seqmask")), "the band must bind on these batches for dis and seqmask"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rule", ["dis", "none"])
def test_sao_losses_through_the_workers_ppo_loss_equal_sao_update(rule, dtype):
    """The v1 worker's entry point: ``workers.utils.losses.ppo_loss`` on unpadded log-probs, the global batch's
    token count from the data (what verl's engine passes), verl's token-mean aggregation."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    P = 3  # prompt tokens per row
    for seed in SEEDS:
        batch = multi_turn_batch(6, 40, seed, dtype=dtype)
        B, T = batch["action_mask"].shape
        update = SAO(correction=rule, ratio=BAND).update(batch)
        advantages, _ = advantages_through_verl(batch)
        logprobs = batch["logprobs"].clone().requires_grad_(True)
        pad = logprobs.new_zeros(P - 1)
        flat = torch.cat([torch.cat([pad, logprobs[i], logprobs.new_zeros(1)]) for i in range(B)])  # model output
        data = tu.get_tensordict(
            {
                "prompts": torch.ones(B, P, dtype=torch.long),
                "responses": torch.ones(B, T, dtype=torch.long),
                "attention_mask": torch.ones(B, P + T, dtype=torch.long),
                "response_mask": batch["action_mask"].long(),
                "old_log_probs": batch["sampler_logprobs"],
                "advantages": advantages,
            },
            non_tensor_dict={"dp_size": 1, "batch_num_tokens": int(batch["action_mask"].sum()), "global_batch_size": B},
        )
        loss, metrics = ppo_loss(actor_config(f"sao_{rule}"), {"log_probs": flat}, data)
        reference = batch["logprobs"].clone().requires_grad_(True)
        expected = update.policy_loss(reference)
        loss.backward()
        expected.backward()
        assert_close(loss, expected, dtype)
        assert_close(logprobs.grad, reference.grad, dtype)
        assert "sao/admitted_share" in metrics


def test_a_non_finite_sampler_logprob_gets_coefficient_zero_and_is_counted():
    batch = multi_turn_batch(4, 20, seed=2)
    first = batch["action_mask"].nonzero()[0]
    batch["sampler_logprobs"][first[0], first[1]] = float("nan")
    advantages, _ = advantages_through_verl(batch)
    loss, metrics = core_algos.get_policy_loss_fn("sao_dis")(
        batch["sampler_logprobs"], batch["logprobs"], advantages, batch["action_mask"], "token-mean", actor_config()
    )
    assert torch.isfinite(loss) and metrics["sao/nonfinite"] == 1.0


# ---------------------------------------------------------------------------------------------------------
# sao_gae's inputs.


def test_sao_gae_credits_a_reward_on_a_trailing_observation_to_the_last_action_before_it():
    batch = multi_turn_batch(1, 12, seed=3)
    batch["action_mask"] = torch.tensor([[True] * 5 + [False] * 7])
    on_action = torch.zeros(1, 12, dtype=torch.float64)
    on_action[0, 4] = 1.0
    cut = torch.zeros(1, 12, dtype=torch.float64)
    cut[0, 9] = 1.0  # verl's score on the last response token: an observation here
    moved = shared.gae_and_returns(cut, batch["values"], batch["action_mask"], 1.5)
    direct = shared.gae_and_returns(on_action, batch["values"], batch["action_mask"], 1.5)
    assert all(torch.equal(a, b) for a, b in zip(moved, direct, strict=True))


def test_sao_gae_refuses_a_non_finite_reward_and_a_call_without_values():
    batch = multi_turn_batch(3, 10, seed=4)
    last = batch["action_mask"][1].nonzero()[-1, 0]
    batch["rewards"][1, last] = float("nan")
    with pytest.raises(ConfigError, match="row 1"):
        advantages_through_verl(batch)
    estimator = core_algos.get_adv_estimator_fn("sao_gae")
    with pytest.raises(ConfigError, match=r"critic\.enable=true"):
        estimator(token_level_rewards=batch["rewards"], response_mask=batch["action_mask"], config=None)


def test_the_loss_refuses_another_aggregation_and_a_second_correction():
    batch = multi_turn_batch(3, 10, seed=5)
    args = (batch["sampler_logprobs"], batch["logprobs"], batch["values"], batch["action_mask"])
    loss_fn = core_algos.get_policy_loss_fn("sao_dis")
    with pytest.raises(ConfigError, match="loss_agg_mode=token-mean"):
        loss_fn(*args, "seq-mean-token-sum", actor_config())
    with pytest.raises(ConfigError, match="rollout_is=null"):
        loss_fn(*args, "token-mean", actor_config(), torch.ones_like(batch["logprobs"]))


# ---------------------------------------------------------------------------------------------------------
# The documented recipe and the one-line refusals.


def recipe_overrides() -> list[str]:
    """The verl command of docs/integrations.md, as hydra overrides (the test runs what the page prints)."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    block = re.search(r"```bash\n(python3? -m verl\.trainer\.main_ppo.*?)```", text, flags=re.S)
    assert block, "docs/integrations.md has no verl command"
    words = block.group(1).replace("\\\n", " ").split()
    return [w for w in words if "=" in w and not w.startswith("$")]


def recipe_config(*changes: str, model: str | None = None):
    from hydra import compose, initialize_config_module

    overrides = [o for o in recipe_overrides() if not o.startswith(tuple(c.split("=")[0] + "=" for c in changes))]
    if model is not None:
        overrides += [f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}"]
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=[*overrides, *changes])


def test_the_documented_recipe_passes_sao_and_verl_checks(tiny_model_dir, monkeypatch):
    from verl.trainer.ppo.utils import need_critic
    from verl.utils import config as verl_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = recipe_config(model=str(tiny_model_dir))
    assert (
        config.algorithm.adv_estimator == "sao_gae"
        and config.actor_rollout_ref.actor.policy_loss.loss_mode == "sao_dis"
    )
    assert getattr(verl_config.validate_config, plugin.SAO_MARK, None) == "validate_config"
    verl_config.validate_config(
        config, use_reference_policy=False, use_critic=need_critic(config)
    )  # sao's, then verl's
    sao = plugin.actor_settings(config.actor_rollout_ref.actor, "dis")
    assert sao.ratio == BAND


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ("algorithm.rollout_correction.bypass_mode=false", "bypass_mode=true"),
        ("trainer.use_v1=false", "trainer.use_v1=true"),
        ("actor_rollout_ref.rollout.calculate_log_probs=false", "calculate_log_probs=true"),
        ("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "loss_agg_mode=token-mean"),
        ("algorithm.rollout_correction.rollout_is=token", "rollout_is=null"),
        ("critic.enable=false", "critic.enable=true"),
        ("algorithm.gamma=0.99", "algorithm.gamma=1.0"),
        ("actor_rollout_ref.actor.clip_ratio_low=1.5", "clip_ratio_low"),
    ],
)
def test_a_run_where_sao_would_not_be_sao_is_refused_in_one_line(change, needle):
    from verl.utils import config as verl_config

    with pytest.raises(ConfigError) as refused:
        verl_config.validate_config(recipe_config(change), use_reference_policy=False, use_critic=None)
    assert needle in str(refused.value) and "\n" not in str(refused.value)


def test_verls_own_entry_point_refuses_a_run_where_sao_would_not_be_sao(tmp_path):
    """``python -m verl.trainer.main_ppo`` with the documented command and bypass mode off: sao's check, through
    verl's own validate_config in a fresh process, stops it before Ray starts."""
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_PLUGINS"}
    argv = [
        sys.executable,
        "-W",
        "ignore",
        "-m",
        "verl.trainer.main_ppo",
        *recipe_overrides(),
        "algorithm.rollout_correction.bypass_mode=false",
    ]
    run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)  # hydra's outputs/
    assert run.returncode != 0
    assert "ConfigError: actor.policy_loss.loss_mode=sao_dis needs algorithm.rollout_correction.bypass_mode=true" in (
        run.stdout + run.stderr
    )
    assert "ray.init" not in run.stdout + run.stderr and "Started a local Ray instance" not in run.stderr


def test_verls_ppo_clip_band_left_in_place_is_said_in_a_warning(caplog):
    config = recipe_config("actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.2")
    with caplog.at_level(logging.WARNING, logger="sao.integrations"):
        plugin.check_run(config, use_critic=True)
    assert any("clip_ratio_high=5.0" in r.getMessage() for r in caplog.records)


def test_bypass_mode_never_swaps_a_sao_loss_for_verls():
    """The legacy, fully-async and separation trainers call ``apply_bypass_mode``, which sets loss_mode to
    "bypass_mode": with a sao loss it refuses; any other loss passes through to verl's."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo import rollout_corr_helper

    batch = DataProto.from_dict(tensors={"rollout_log_probs": torch.zeros(2, 3)})
    with pytest.raises(ConfigError, match=r"trainer\.use_v1=true"):
        rollout_corr_helper.apply_bypass_mode(batch, {}, OmegaConf.create({"loss_mode": "sao_dis"}))
    theirs = OmegaConf.create({"loss_mode": "vanilla"})
    rollout_corr_helper.apply_bypass_mode(batch, {}, theirs)
    assert theirs.loss_mode == "bypass_mode" and torch.equal(batch.batch["old_log_probs"], torch.zeros(2, 3))


def _algo():
    from omegaconf import OmegaConf

    return OmegaConf.create({"gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": True, "use_pf_ppo": False})
