"""sao: single-rollout, critic-baselined, off-policy-corrected RL for language models.

The pure parts (no model) are importable without transformers:

    from sao import SAO, compare
    update = SAO(ratio=(0.7, 6.0)).update(batch)
"""

from sao.core.algorithm import SAO, Update
from sao.core.stats import Comparison, compare

__all__ = ["SAO", "Comparison", "Update", "compare"]
__version__ = "0.1.0"
