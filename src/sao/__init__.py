"""sao: single-rollout, critic-baselined, off-policy-corrected RL for language models.

    import sao
    sao.train({"preset": "tiny", "steps": 2}, "runs/one", dataset=rows, reward_fn=my_reward)
    update = sao.SAO(ratio=(0.7, 6.0)).update(batch)       # the algorithm alone, pure tensor math

The names are loaded on first use (PEP 562), so importing any ``sao`` module — a Ray rollout worker unpickling
its class, say — pays for nothing it does not use.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sao.algorithm.update import SAO, Update
    from sao.api import evaluate, recipe, train
    from sao.core.config import Config
    from sao.core.stats import Comparison, compare

_WHERE = {
    "SAO": "sao.algorithm.update",
    "Update": "sao.algorithm.update",
    "Comparison": "sao.core.stats",
    "compare": "sao.core.stats",
    "Config": "sao.core.config",
    "train": "sao.api",
    "evaluate": "sao.api",
    "recipe": "sao.api",
}

__all__ = ["SAO", "Comparison", "Config", "Update", "compare", "evaluate", "recipe", "train"]
try:
    __version__ = importlib.metadata.version("sao")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'sao' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
