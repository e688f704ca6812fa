"""sao: single-rollout, critic-baselined, off-policy-corrected RL for language models.

The pure parts (no model) are importable without transformers:

    from sao import SAO, compare
    update = SAO(ratio=(0.7, 6.0)).update(batch)

The names are loaded on first use (PEP 562), so importing any ``sao`` module — a Ray rollout worker
unpickling its class, say — does not pay for scipy, which only ``compare`` needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sao.core.algorithm import SAO, Update
    from sao.core.stats import Comparison, compare

_WHERE = {"SAO": "sao.core.algorithm", "Update": "sao.core.algorithm", "Comparison": "sao.core.stats",
          "compare": "sao.core.stats"}  # fmt: skip

__all__ = ["SAO", "Comparison", "Update", "compare"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'sao' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
