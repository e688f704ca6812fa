"""sao in verl: a ``verl.plugins`` entry point that every ``import verl`` loads (driver and Ray workers alike).

    losses     ``sao_dis``, ``sao_none``, ``sao_tis``, ``sao_seqmask`` in verl's policy-loss registry: SAO's
               correction against ``old_log_prob``, which in bypass mode (v1 trainer) is the rollout's own
               log-probability; band = (1 − clip_ratio_low, 1 + clip_ratio_high), the tis cap = clip_ratio_c;
               sao's stats in verl's metric dict as ``sao/<name>``
    sao_gae    in verl's estimator registry; verl passes critic values to its built-in ``gae`` only, so
               ``ray_trainer.compute_advantage`` is wrapped, when that module is first imported and for ``sao_gae``
               alone, to pass ``values`` (every other estimator takes the untouched original)
    checks     ``validate_config`` refuses, in one line each, a run where a sao loss would not be SAO (no bypass
               mode, the legacy trainer that swaps the loss for "bypass_mode", no rollout log-probs, another
               aggregation, a second IS correction) or ``sao_gae`` would have no critic

Loading imports no verl module the process has not asked for: the names are registered when ``core_algos`` is
first imported. A failure is one WARNING (verl logs a plug-in's failure at DEBUG only);
``VERL_USE_EXTERNAL_PLUGINS=none`` keeps it out. Left out: the random control, α other than 1.5, the legacy trainer.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger("sao.integrations.verl")

TESTED = ("0.9.1", "0.10")  # verl releases tested: >=0.9.1,<0.10 (0.9.1 itself; the extra pins the same range)
RAY_TRAINER = "verl.trainer.ppo.ray_trainer"
ROLLOUT_CORRECTION = "verl.trainer.ppo.rollout_corr_helper"
CONFIG = "verl.utils.config"
CORE_ALGOS = "verl.trainer.ppo.core_algos"
SAO_MARK = "__sao_rule__"  # set on every function this module registers or wraps


# ---------------------------------------------------------------------------------------------------------
# The registered functions.


def policy_loss(rule: str) -> Callable[..., Any]:
    """The verl policy loss for correction rule ``rule`` (verl's ``PolicyLossFn`` signature)."""

    def loss(
        old_log_prob: Any,
        log_prob: Any,
        advantages: Any,
        response_mask: Any,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Any = None,
    ) -> tuple[Any, dict[str, float]]:
        from verl.trainer.ppo.core_algos import agg_loss

        from sao.integrations import shared

        name = shared.loss_name(rule)
        if loss_agg_mode != "token-mean":
            raise _refusal(
                f"{name} divides by the batch's action tokens: set actor.loss_agg_mode=token-mean "
                f"(got {loss_agg_mode!r})"
            )
        if rollout_is_weights is not None:
            raise _refusal(
                f"{name} is the correction; verl's rollout IS weights would apply a second one: set "
                "algorithm.rollout_correction.rollout_is=null and bypass_mode=true"
            )
        sao = actor_settings(config, rule)
        per_token, stats = shared.policy_loss_terms(sao, log_prob, old_log_prob, advantages, response_mask)  # [B, T]
        batch_info = dict(getattr(config, "global_batch_info", None) or {})
        return agg_loss(per_token, response_mask, "token-mean", **batch_info), shared.metrics(stats)

    loss.__name__ = loss.__qualname__ = f"sao_{rule}_policy_loss"
    setattr(loss, SAO_MARK, rule)
    return loss


def sao_gae(
    token_level_rewards: Any, response_mask: Any, config: Any = None, values: Any = None, **kwargs: Any
) -> tuple[Any, Any]:
    """verl's estimator signature plus ``values`` (the critic's [B, T]), which verl 0.9 passes only to its own
    ``gae``: the wrapped ``compute_advantage`` passes them; any other caller gets a one-line refusal."""
    from sao.algorithm.update import SAO
    from sao.integrations import shared

    if values is None:
        raise _refusal(
            "sao_gae needs the critic's values and verl passed none: set critic.enable=true (sao's "
            "plug-in passes data.batch['values'] through ray_trainer.compute_advantage)"
        )
    return shared.gae_and_returns(token_level_rewards, values, response_mask, SAO().gae_alpha)


setattr(sao_gae, SAO_MARK, "gae")


def actor_settings(config: Any, rule: str) -> Any:
    """SAO from verl's actor config: band (1 − clip_ratio_low, 1 + clip_ratio_high), tis cap clip_ratio_c; sao's
    defaults when verl passes no config."""
    from sao.algorithm.update import SAO
    from sao.integrations import shared

    if config is None:
        return SAO(correction=rule)
    low = _get(config, "clip_ratio_low", None)
    high = _get(config, "clip_ratio_high", None)
    clip = _get(config, "clip_ratio", 0.2)
    return shared.settings(
        rule,
        clip if low is None else low,
        clip if high is None else high,
        _get(config, "clip_ratio_c", 3.0),
        "actor.clip_ratio_low / clip_ratio_high / clip_ratio_c",
    )


# ---------------------------------------------------------------------------------------------------------
# Checks of a run's config (the driver, before any worker starts).


def check_run(config: Any, use_critic: bool | None = None) -> None:
    """Refuse, in one line, a verl config in which a sao loss or ``sao_gae`` would not be SAO. ``use_critic`` is
    verl's ``need_critic(config)`` (read from ``critic.enable`` when None)."""
    from verl.trainer.ppo import core_algos

    from sao.integrations import shared

    actor = config.actor_rollout_ref.actor
    loss_mode = _get(_get(actor, "policy_loss", {}), "loss_mode", "vanilla")
    estimator = str(_get(config.algorithm, "adv_estimator", "gae"))
    ours = {shared.loss_name(rule) for rule in shared.rule_names()}
    if loss_mode in ours:
        found = core_algos.POLICY_LOSS_REGISTRY.get(loss_mode)
        if getattr(found, SAO_MARK, None) is None:
            raise _refusal(
                f"verl's policy loss {loss_mode!r} is not sao's (something else registered that name "
                "first): rename or remove it"
            )
        correction = _get(config.algorithm, "rollout_correction", None) or {}
        if not _get(correction, "bypass_mode", False):
            raise _refusal(
                f"actor.policy_loss.loss_mode={loss_mode} needs algorithm.rollout_correction."
                "bypass_mode=true: without it verl recomputes old_log_prob and the ratio is not against "
                "the sampler"
            )
        if _get(correction, "rollout_is", None) or _get(correction, "rollout_rs", None):
            raise _refusal(
                f"{loss_mode} is the correction: set algorithm.rollout_correction.rollout_is=null and rollout_rs=null"
            )
        if not _get(config.trainer, "use_v1", True):
            raise _refusal(
                f"verl's legacy trainer replaces actor.policy_loss.loss_mode={loss_mode} with "
                "'bypass_mode' in bypass mode: set trainer.use_v1=true"
            )
        if not _get(config.actor_rollout_ref.rollout, "calculate_log_probs", False):
            raise _refusal(
                f"{loss_mode} needs the sampler's log-probs: set actor_rollout_ref.rollout.calculate_log_probs=true"
            )
        if _get(actor, "loss_agg_mode", "token-mean") != "token-mean":
            raise _refusal(f"{loss_mode} divides by the batch's action tokens: set actor.loss_agg_mode=token-mean")
        sao = actor_settings(actor, loss_mode.removeprefix("sao_"))
        if _get(actor, "clip_ratio_low", None) == _get(actor, "clip_ratio_high", None) == 0.2:
            log.warning(
                "%s uses the band (%.2g, %.2g) from verl's PPO clip defaults; the recipe's band (0.7, 6.0) "
                "is actor.clip_ratio_low=0.3 actor.clip_ratio_high=5.0",
                loss_mode,
                *sao.ratio,
            )
    if estimator == shared.GAE_NAME:
        found = core_algos.ADV_ESTIMATOR_REGISTRY.get(estimator)
        if getattr(found, SAO_MARK, None) is None:
            raise _refusal("verl's advantage estimator 'sao_gae' is not sao's: rename or remove it")
        critic = bool(_get(config.critic, "enable", False)) if use_critic is None else use_critic
        if not critic:
            raise _refusal("algorithm.adv_estimator=sao_gae needs the critic's values: set critic.enable=true")
        if float(_get(config.algorithm, "gamma", 1.0)) != 1.0:
            raise _refusal("sao_gae is γ = 1: set algorithm.gamma=1.0")


# ---------------------------------------------------------------------------------------------------------
# The wrappers (each keeps the original as ``__wrapped__``).


def with_values(original: Callable[..., Any]) -> Callable[..., Any]:
    """``ray_trainer.compute_advantage`` that passes the critic's values to ``sao_gae``; any other estimator
    calls ``original`` with exactly its arguments."""

    @functools.wraps(original)
    def compute_advantage(data: Any, adv_estimator: Any, *args: Any, **kwargs: Any) -> Any:
        from verl.trainer.ppo import core_algos

        from sao.integrations import shared

        if getattr(adv_estimator, "value", adv_estimator) != shared.GAE_NAME:
            return original(data, adv_estimator, *args, **kwargs)
        if "response_mask" not in data.batch.keys():  # noqa: SIM118 (a TensorDict refuses `in`)
            data.batch["response_mask"] = sys.modules[original.__module__].compute_response_mask(data)
        config = kwargs.get("config", args[4] if len(args) > 4 else None)  # after gamma, lam, num_repeat, norm
        values = data.batch["values"] if "values" in data.batch.keys() else None  # noqa: SIM118
        estimator = core_algos.get_adv_estimator_fn(shared.GAE_NAME)  # verl's own lookup
        advantages, returns = estimator(
            token_level_rewards=data.batch["token_level_rewards"],
            response_mask=data.batch["response_mask"],
            config=config,
            values=values,
        )
        data.batch["advantages"] = advantages
        data.batch["returns"] = returns
        return data

    setattr(compute_advantage, SAO_MARK, "compute_advantage")
    return compute_advantage


def guard_bypass(original: Callable[..., Any]) -> Callable[..., Any]:
    """``rollout_corr_helper.apply_bypass_mode`` that refuses to swap a sao loss for "bypass_mode" (what the legacy,
    fully-async and separation trainers do in bypass mode)."""

    @functools.wraps(original)
    def apply_bypass_mode(batch: Any, rollout_corr_config: Any = None, policy_loss_config: Any = None) -> Any:
        mode = _get(policy_loss_config, "loss_mode", None) if policy_loss_config is not None else None
        if isinstance(mode, str) and mode.startswith("sao_"):
            raise _refusal(
                f"this verl trainer replaces actor.policy_loss.loss_mode={mode} with 'bypass_mode' in "
                "bypass mode: run it with the v1 trainer (trainer.use_v1=true)"
            )
        return original(batch, rollout_corr_config, policy_loss_config)

    setattr(apply_bypass_mode, SAO_MARK, "apply_bypass_mode")
    return apply_bypass_mode


def checked(original: Callable[..., Any]) -> Callable[..., Any]:
    """``verl.utils.config.validate_config`` with ``check_run`` first."""

    @functools.wraps(original)
    def validate_config(config: Any, use_reference_policy: bool, use_critic: bool) -> Any:
        check_run(config, use_critic)
        return original(config, use_reference_policy, use_critic)

    setattr(validate_config, SAO_MARK, "validate_config")
    return validate_config


PATCHES: dict[str, tuple[str, Callable[[Callable[..., Any]], Callable[..., Any]]]] = {
    RAY_TRAINER: ("compute_advantage", with_values),
    ROLLOUT_CORRECTION: ("apply_bypass_mode", guard_bypass),
    CONFIG: ("validate_config", checked),
}


def patch(module: Any, attribute: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``module.attribute`` by its wrapped version, and every copy a loaded verl module bound with
    ``from module import attribute`` before this ran. Idempotent."""
    original = getattr(module, attribute)
    if getattr(original, SAO_MARK, None) is not None:
        return
    wrapped = wrap(original)
    for loaded in list(sys.modules.values()):
        spec = getattr(
            loaded, "__spec__", None
        )  # a verl module run as __main__ (python -m verl...) keeps its name here
        name = getattr(spec, "name", None) or getattr(loaded, "__name__", "")
        if (name == "verl" or name.startswith("verl.")) and getattr(loaded, attribute, None) is original:
            setattr(loaded, attribute, wrapped)
    setattr(module, attribute, wrapped)


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` right after the module ``name`` is first imported, so that loading the plug-in imports
    nothing it patches (verl loads it in every process; the trainer module is heavy)."""

    def __init__(self, name: str, then: Callable[[Any], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Then(spec.loader, self)
                return spec
        return None


class _Then(importlib.abc.Loader):
    def __init__(self, loader: Any, hook: AfterImport):
        self.loader, self.hook = loader, hook

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        if self.hook in sys.meta_path:
            sys.meta_path.remove(self.hook)
        try:
            self.hook.then(module)
        except Exception as error:
            log.warning("sao's verl plug-in could not act on %s: %s", module.__name__, _describe(error))

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: the real loader's
        return getattr(self.loader, name)


def patch_when_imported(module_name: str) -> None:
    attribute, wrap = PATCHES[module_name]
    if module_name in sys.modules:
        patch(sys.modules[module_name], attribute, wrap)
    elif not any(isinstance(f, AfterImport) and f.name == module_name for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(module_name, lambda module: patch(module, attribute, wrap)))


# ---------------------------------------------------------------------------------------------------------
# Loading.


def register() -> list[str]:
    """Register sao's losses and ``sao_gae`` in verl's registries; returns the names registered now. A name verl
    already has from someone else is left alone, with a WARNING."""
    from verl.trainer.ppo import core_algos

    from sao.integrations import shared

    added = []
    wanted = {
        shared.loss_name(rule): (core_algos.POLICY_LOSS_REGISTRY, policy_loss(rule)) for rule in shared.rule_names()
    }
    wanted[shared.GAE_NAME] = (core_algos.ADV_ESTIMATOR_REGISTRY, sao_gae)
    for name, (registry, function) in wanted.items():
        found = registry.get(name)
        if found is None:
            if registry is core_algos.POLICY_LOSS_REGISTRY:
                core_algos.register_policy_loss(name)(function)
            else:
                core_algos.register_adv_est(name)(function)
            added.append(name)
        elif getattr(found, SAO_MARK, None) is None:
            log.warning("verl already has %r from elsewhere; sao's is not registered under that name", name)
    return added


def load() -> None:
    """What ``import verl`` runs through the entry point: the version check, the patches (each when its module is
    first imported), and the registration when verl's ``core_algos`` is (now, when it already is). Imports no verl
    module that the process has not asked for."""
    import verl

    from sao.integrations import shared

    shared.check_version("verl", verl.__version__, TESTED)
    for module_name in PATCHES:
        patch_when_imported(module_name)
    if CORE_ALGOS in sys.modules:
        register()
    elif not any(isinstance(f, AfterImport) and f.name == CORE_ALGOS for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(CORE_ALGOS, lambda module: _loaded(register)))


def _loaded(step: Callable[[], Any]) -> None:
    try:
        step()
    except Exception as error:  # verl hides a plug-in's failure at DEBUG; this one says so
        log.warning(
            "sao's verl plug-in did not load (%s): the sao_* losses and sao_gae are not registered", _describe(error)
        )


def _get(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    getter = getattr(config, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except Exception:
            pass
    return getattr(config, key, default)


def _refusal(message: str) -> Exception:
    from sao.core.errors import ConfigError

    return ConfigError(message)


def _describe(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


_loaded(load)
