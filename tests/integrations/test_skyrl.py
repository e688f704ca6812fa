"""sao inside SkyRL (``sao.integrations.skyrl``, experimental), run in the venv ``make install-integrations`` builds
(skyrl 0.3.0 without its train extra): the losses and ``sao_gae`` through SkyRL's registries, its token-mean advantage
scaling and ``reduce_loss`` equal ``SAO.update``; they reach a Ray worker through SkyRL's registry actor; every refusal
is one line. Skipped where SkyRL is absent."""

from __future__ import annotations

import logging
import sys
import typing

import numpy as np
import pytest
import torch

pytest.importorskip("skyrl")

from helpers import multi_turn_batch
from sao.algorithm.update import SAO
from sao.core.errors import ConfigError
from sao.integrations import shared
from sao.integrations import skyrl as plugin  # before any SkyRL module: it applies the 3.11 shim

ppo_utils = plugin.ppo_utils

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}
BAND = (0.7, 6.0)
SEEDS = range(20)


def algorithm(rule: str = "dis", **changes):
    from skyrl.train.config.config import AlgorithmConfig

    fields = {
        "policy_loss_type": f"sao_{rule}",
        "advantage_estimator": "sao_gae",
        "eps_clip_low": 0.3,
        "eps_clip_high": 5.0,
        "clip_ratio_c": 2.0,
        **changes,
    }
    return AlgorithmConfig(**fields)


def skyrl_advantages(batch, config, **extra):
    """SkyRL's trainer path: ``compute_advantages_and_returns`` (the registry's estimator), then its token-mean
    reduction of the mini-batch's advantages (÷ N)."""
    B, T = batch["action_mask"].shape
    mask = batch["action_mask"].to(batch["values"].dtype)
    advantages, returns = ppo_utils.compute_advantages_and_returns(
        token_level_rewards=batch["rewards"],
        response_mask=mask,
        index=np.array([str(i) for i in range(B)]),
        adv_estimator="sao_gae",
        config=config,
        values=batch["values"],
        **extra,
    )
    scaled = ppo_utils.apply_loss_reduction_to_advantages_minibatch(advantages, mask, "token_mean", B, T)
    return advantages, returns, scaled


def assert_close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def test_importing_registers_every_rule_and_sao_gae_and_the_311_shim():
    losses = ppo_utils.PolicyLossRegistry.list_available()
    assert {"sao_dis", "sao_none", "sao_tis", "sao_seqmask"} <= set(losses) and "sao_random" not in losses
    assert "sao_gae" in ppo_utils.AdvantageEstimatorRegistry.list_available()
    if sys.version_info < (3, 12):
        import typing_extensions

        assert typing.TypedDict is typing_extensions.TypedDict
    assert plugin.register() == []  # importing again (a Ray worker unpickling) registers nothing twice


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rule", ["dis", "none", "tis", "seqmask"])
def test_the_losses_and_sao_gae_through_skyrls_registries_equal_sao_update(rule, dtype):
    loss_fn = ppo_utils.PolicyLossRegistry.get(f"sao_{rule}")
    masked = 0
    for seed in SEEDS:
        batch = multi_turn_batch(6, 40, seed, dtype=dtype)
        update = SAO(correction=rule, ratio=BAND, tis_cap=2.0).update(batch)
        action = batch["action_mask"]
        advantages, returns, scaled = skyrl_advantages(batch, algorithm(rule), loss_mask=action.to(dtype))
        assert_close(advantages, update.advantages, dtype)
        assert_close(returns[action], update.value_targets[action], dtype)

        logprobs = batch["logprobs"].clone().requires_grad_(True)
        loss, metrics = loss_fn(
            logprobs,
            logprobs.detach(),
            scaled,
            algorithm(rule),
            loss_mask=action.to(dtype),
            rollout_logprobs=batch["sampler_logprobs"],
        )
        reference = batch["logprobs"].clone().requires_grad_(True)
        expected = update.policy_loss(reference)
        loss.backward()
        expected.backward()
        assert_close(loss, expected, dtype)
        assert_close(logprobs.grad, reference.grad, dtype)
        assert metrics["sao/masked_share"] == pytest.approx(update.stats["masked_share"], abs=TOLERANCE[dtype])
        masked += int((action & ~update.mask).sum())
    assert (masked > 0) == (rule in ("dis", "seqmask"))


def test_without_loss_mask_sao_gae_reads_response_mask_and_says_so_once(caplog):
    """SkyRL 0.3 passes only ``response_mask``: on rows without observation tokens that is the action mask and
    the result is exact; with observations it is not, which one WARNING says."""
    batch = multi_turn_batch(4, 30, seed=7)
    single_turn = torch.arange(30)[None, :] < torch.tensor([[30], [12], [5], [21]])  # actions then padding
    batch["action_mask"] = single_turn
    last = single_turn & ~torch.cat([single_turn[:, 1:], torch.zeros(4, 1, dtype=torch.bool)], dim=1)
    batch["rewards"] = torch.where(
        last, torch.randn(4, 30, dtype=torch.float64), torch.zeros(4, 30, dtype=torch.float64)
    )
    plugin.Gae._said = False
    with caplog.at_level(logging.WARNING, logger="sao.integrations"):
        advantages, _, _ = skyrl_advantages(batch, algorithm())
        skyrl_advantages(batch, algorithm())
    assert_close(advantages, SAO().update(batch).advantages, torch.float64)
    assert sum("without loss_mask" in r.getMessage() for r in caplog.records) == 1


def test_registered_after_ray_init_the_loss_reaches_a_worker_through_skyrls_registry_actor():
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        logging_level=logging.WARNING,
    )
    try:
        ppo_utils.sync_registries()  # what SkyRL's entry point does after ray.init()
        batch = multi_turn_batch(6, 40, seed=11)
        _, _, scaled = skyrl_advantages(batch, algorithm(), loss_mask=batch["action_mask"].double())

        @ray.remote
        def loss_in_a_worker(logprobs, sampler, advantages, mask):
            import sys
            import typing

            import typing_extensions

            typing.TypedDict = typing_extensions.TypedDict  # SkyRL's own import on 3.11, as a SkyRL worker has it
            from skyrl.backends.skyrl_train.utils import ppo_utils as worker_utils
            from skyrl.train.config.config import AlgorithmConfig as Config

            imported_before = "sao.integrations.skyrl" in sys.modules
            loss_fn = worker_utils.PolicyLossRegistry.get("sao_dis")  # synced from the registry actor
            config = Config(eps_clip_low=0.3, eps_clip_high=5.0)
            loss, _ = loss_fn(logprobs, logprobs, advantages, config, loss_mask=mask, rollout_logprobs=sampler)
            return imported_before, float(loss)

        mask = batch["action_mask"].double()
        before, loss = ray.get(loss_in_a_worker.remote(batch["logprobs"], batch["sampler_logprobs"], scaled, mask))
    finally:
        ray.shutdown()
        for registry in (ppo_utils.PolicyLossRegistry, ppo_utils.AdvantageEstimatorRegistry):
            registry._ray_actor, registry._synced_to_actor = None, False
    assert before is False  # the worker had no sao until the registry handed it the loss
    assert loss == pytest.approx(float(SAO(ratio=BAND).update(batch).policy_loss(batch["logprobs"])), rel=1e-12)


# ---------------------------------------------------------------------------------------------------------
# Refusals.


def test_the_loss_refuses_a_batch_without_rollout_logprobs_and_settings_that_are_not_sao():
    batch = multi_turn_batch(3, 10, seed=5)
    args = (batch["logprobs"], batch["logprobs"], batch["values"])
    mask = batch["action_mask"].double()
    loss_fn = ppo_utils.PolicyLossRegistry.get("sao_dis")
    with pytest.raises(ConfigError, match="no rollout_logprobs") as refused:
        loss_fn(*args, algorithm(), loss_mask=mask, rollout_logprobs=None)
    assert "\n" not in str(refused.value)
    cases = [
        ({"loss_reduction": "sequence_mean"}, "loss_reduction=token_mean"),
        ({"use_tis": True}, "use_tis"),
        ({"eps_clip_low": 1.5}, "eps_clip_low"),
    ]
    for changes, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            loss_fn(*args, algorithm(**changes), loss_mask=mask, rollout_logprobs=batch["sampler_logprobs"])


def test_sao_gae_refuses_no_values_and_another_gamma():
    batch = multi_turn_batch(3, 10, seed=6)
    estimator = ppo_utils.AdvantageEstimatorRegistry.get("sao_gae")
    with pytest.raises(ConfigError, match=r"critic\.model\.path"):
        estimator(token_level_rewards=batch["rewards"], response_mask=batch["action_mask"], values=None)
    with pytest.raises(ConfigError, match=r"gamma=1\.0"):
        estimator(
            token_level_rewards=batch["rewards"],
            response_mask=batch["action_mask"],
            values=batch["values"],
            config=algorithm(gamma=0.99),
        )


def test_a_name_skyrl_already_has_from_elsewhere_is_left_alone(monkeypatch, caplog):
    def foreign(*args, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setitem(ppo_utils.PolicyLossRegistry._functions, "sao_dis", foreign)
    with caplog.at_level(logging.WARNING, logger="sao.integrations"):
        assert plugin.register() == []
    assert ppo_utils.PolicyLossRegistry._functions["sao_dis"] is foreign
    assert any("already has 'sao_dis'" in r.getMessage() for r in caplog.records)
    assert shared.loss_name("dis") == "sao_dis"
