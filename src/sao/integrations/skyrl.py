"""sao in SkyRL (experimental): importing this module registers SAO in SkyRL's registries.

    losses     ``sao_dis``, ``sao_none``, ``sao_tis``, ``sao_seqmask`` (``policy_loss_type``): SAO's correction
               against SkyRL's ``rollout_logprobs`` (refused without them), band = (1 − eps_clip_low, 1 +
               eps_clip_high), tis cap = clip_ratio_c, summed by SkyRL's ``reduce_loss`` over advantages its
               ``token_mean`` reduction already divided by N
    sao_gae    (``advantage_estimator``) on SkyRL's critic values; SkyRL 0.3 passes ``response_mask``, which keeps
               observation tokens, so the bootstrap skips them only when a ``loss_mask`` is passed too
    Ray        registered after ``ray.init()`` the functions go to SkyRL's registry actor, and a worker that asks
               for one imports this module (the functions pickle by reference), so it needs sao installed

No entry-point discovery in SkyRL: the training script imports this module. On Python 3.11 SkyRL's own import
fails (pydantic refuses ``typing.TypedDict`` below 3.12), so this module makes ``typing.TypedDict`` the
``typing_extensions`` one, process-wide, before it imports SkyRL. Deliberately left out: the random control.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from sao.core.errors import ConfigError
from sao.integrations import shared

log = logging.getLogger("sao.integrations.skyrl")

TESTED = ("0.3.0", "0.4")  # skyrl releases tested: >=0.3.0,<0.4 (0.3.0 itself, with skyrl-gym 0.4.0)
KEYS = "trainer.algorithm.eps_clip_low / eps_clip_high / clip_ratio_c"


def typed_dict_shim() -> None:
    """On Python < 3.12, ``typing.TypedDict`` becomes ``typing_extensions.TypedDict`` (SkyRL's pydantic models
    need it). Process-wide: SkyRL imports modules lazily, each needing it when it is first imported."""
    if sys.version_info < (3, 12):
        import typing

        import typing_extensions

        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]


typed_dict_shim()

from skyrl.backends.skyrl_train.utils import ppo_utils  # noqa: E402  (after the shim)


class PolicyLoss:
    """SkyRL's policy-loss signature for correction rule ``rule``. Pickles by reference to this module, so a Ray
    worker that unpickles it imports the module (the shim included) before SkyRL's."""

    def __init__(self, rule: str):
        self.rule = rule
        self.__name__ = shared.loss_name(rule)

    def __call__(
        self,
        log_probs: Any,
        old_log_probs: Any,
        advantages: Any,
        config: Any,
        loss_mask: Any = None,
        rollout_logprobs: Any = None,
    ) -> tuple[Any, dict[str, float]]:
        name = self.__name__
        if rollout_logprobs is None:
            raise ConfigError(
                f"{name} needs the sampler's log-probs and SkyRL passed no rollout_logprobs: keep "
                "generator.sampling_params.logprobs set (SkyRL's default, 1)"
            )
        check_algorithm(config, name)
        sao = shared.settings(self.rule, config.eps_clip_low, config.eps_clip_high, config.clip_ratio_c, KEYS)
        mask = loss_mask if loss_mask is not None else log_probs.new_ones(log_probs.shape)
        per_token, stats = shared.policy_loss_terms(sao, log_probs, rollout_logprobs, advantages, mask.bool())
        return ppo_utils.reduce_loss(per_token, mask), shared.metrics(stats)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (PolicyLoss, (self.rule,))


class Gae:
    """``sao_gae`` in SkyRL's estimator signature: advantages and return-to-go targets from the critic's values.
    Uses ``loss_mask`` (the action tokens) when SkyRL passes it, ``response_mask`` otherwise (said once)."""

    __name__ = shared.GAE_NAME
    _said = False

    def __call__(
        self, token_level_rewards: Any, response_mask: Any, values: Any = None, config: Any = None, **kwargs: Any
    ) -> tuple[Any, Any]:
        from sao.algorithm.update import SAO

        if values is None:
            raise ConfigError(
                "sao_gae needs the critic's values and SkyRL passed none: set trainer.critic.model.path "
                "(SkyRL runs a critic only then)"
            )
        gamma = float(getattr(config, "gamma", 1.0) if config is not None else 1.0)
        if gamma != 1.0:
            raise ConfigError(f"sao_gae is γ = 1: set trainer.algorithm.gamma=1.0 (got {gamma})")
        action_mask = kwargs.get("loss_mask")
        if action_mask is None:
            action_mask = response_mask
            if not Gae._said:
                Gae._said = True
                log.warning(
                    "sao_gae got SkyRL's response_mask without loss_mask: observation tokens, if any, count as "
                    "actions in the bootstrap"
                )
        return shared.gae_and_returns(token_level_rewards, values, action_mask, SAO().gae_alpha)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (Gae, ())


def check_algorithm(config: Any, name: str) -> None:
    """Refuse, in one line, SkyRL settings under which a sao loss would not be SAO."""
    reduction = getattr(config, "loss_reduction", "token_mean")
    if reduction != "token_mean":
        raise ConfigError(
            f"{name} divides by the batch's action tokens: set trainer.algorithm.loss_reduction=token_mean "
            f"(got {reduction!r})"
        )
    correction = getattr(config, "off_policy_correction", None)
    extra = [key for key in ("tis_ratio_type", "sequence_mask_metric") if getattr(correction, key, None) is not None]
    if getattr(config, "use_tis", False):
        extra.append("use_tis")
    if extra:
        raise ConfigError(f"{name} is the correction; SkyRL's {', '.join(extra)} would apply a second one: unset it")


def register() -> list[str]:
    """Register the losses and ``sao_gae``; returns the names registered now. A name SkyRL already has from
    elsewhere is left alone, with a WARNING; sao's own (a worker importing this module again) is skipped."""
    import skyrl

    shared.check_version("skyrl", getattr(skyrl, "__version__", None) or _installed("skyrl"), TESTED)
    wanted: dict[str, tuple[Any, Any]] = {
        shared.loss_name(rule): (ppo_utils.PolicyLossRegistry, PolicyLoss(rule)) for rule in shared.rule_names()
    }
    wanted[shared.GAE_NAME] = (ppo_utils.AdvantageEstimatorRegistry, Gae())
    added = []
    for name, (registry, function) in wanted.items():
        found = registry._functions.get(name)  # the local registry: asking the actor here could recurse
        if found is None:
            registry.register(name, function)
            added.append(name)
        elif not isinstance(found, PolicyLoss | Gae):
            log.warning("SkyRL already has %r from elsewhere; sao's is not registered under that name", name)
    return added


def _installed(name: str) -> str:
    from importlib.metadata import version

    return version(name)


register()
