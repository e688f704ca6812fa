"""Every name a config can use, and where it lives: one ``Registry`` per plug-in point, built-ins listed here.

An entry is an object or an import path ``"module:attribute"`` resolved on first use, so this module (and the
config that checks names against it) imports nothing heavy, and a higher layer can implement a name a lower
one offers. Your own entries: ``CORRECTIONS.register("mine", rule)`` or ``@CORRECTIONS.register("mine")``; the
rollout sources have their registry in their own layer (``sao.rollout.registry``).

    PRESETS       defaults a run starts from: a mapping of settings as a --config file takes them
    CORRECTIONS   the rule f(ratio) an update applies (``sao.algorithm.corrections``)
    BASELINES     what advantages are taken against, ``(rewards, action_mask, **rows) -> values or None`` (None: the
                  critic's; ``rows``: the batch's per-row extras a baseline names, e.g. ``oracle_rates``)
    MODELS        stand-in models built on this machine, ``ensure() -> folder`` (any other name: hub id or folder)
    TASK_SETS     generated task sets, ``make(n_train, n_test, seed) -> TaskSet`` (others: GSM8K or your data)
    ENVIRONMENTS  environments by name, ``factory(tokenizer, settings) -> (task_id, fields) -> env``

Deliberately left out: discovery by entry points (a plug-in registers itself when its module is imported).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterator
from typing import Any

from sao.core.errors import ConfigError


class Registry:
    """Names → implementations for one plug-in point (``kind`` names it in errors)."""

    def __init__(self, kind: str, entries: dict[str, Any] | None = None):
        self.kind = kind
        self._entries: dict[str, Any] = dict(entries or {})

    def register(self, name: str, obj: Any = None) -> Any:
        """Add ``name``: ``register(name, obj)``, or ``@register(name)`` above a function or class."""
        if obj is None:
            return lambda target: self.register(name, target)
        self._entries[name] = obj
        return obj

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> Any:
        """The implementation of ``name`` (imported on first use); a ConfigError with a did-you-mean otherwise."""
        if name not in self._entries:
            raise ConfigError(self.unknown(name))
        entry = self._entries[name]
        if isinstance(entry, str) and ":" in entry:
            module, _, attribute = entry.partition(":")
            found: Any = importlib.import_module(module)
            for part in attribute.split("."):
                found = getattr(found, part)
            self._entries[name] = entry = found
        return entry

    def unknown(self, name: Any, flag: str | None = None) -> str:
        """The one line for a name this registry lacks: what it has, and the closest one."""
        close = difflib.get_close_matches(str(name), self.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        where = f"{flag} " if flag else ""
        return f"{where}{name!r} is no {self.kind}{hint}; choose one of {', '.join(self.names())}"


# "paper": the regime the recipe page's paper trained in, on the page's model and data: full weights at the paper's lr
# 1e-6 and a value model of its own at the paper's critic lr 5e-6 (add --shard fsdp under torchrun past one GPU).
PAPER = {"finetune": "full", "critic": "model", "lr": 1e-6, "critic_lr": 5e-6}
PRESETS = Registry("preset", {"protocol": {}, "paper": PAPER, "tiny": "sao.tiny.presets:TINY"})
CORRECTIONS = Registry(
    "correction rule",
    {name: f"sao.algorithm.corrections:{name}" for name in ("dis", "none", "tis", "seqmask", "random")},
)
BASELINES = Registry(
    "baseline",
    {name: f"sao.algorithm.baselines:{name.replace('-', '_')}" for name in ("critic", "batch-mean", "oracle", "none")},
)
MODELS = Registry(
    "stand-in model", {"tiny": "sao.tiny.arithmetic:ensure_model", "tiny-calc": "sao.tiny.calculator:ensure_calc_model"}
)
TASK_SETS = Registry(
    "generated task set", {"tiny": "sao.tiny.arithmetic:make_split", "tiny-calc": "sao.tiny.calculator:make_split"}
)
ENVIRONMENTS = Registry(
    "environment",
    {
        "gsm8k": "sao.tasks.environments:gsm8k",
        "gsm8k-calc": "sao.tasks.environments:gsm8k_calc",
        "tiny-calc": "sao.tiny.calculator:environment",
    },
)
