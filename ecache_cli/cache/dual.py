"""``dual``: Fast-dLLM's dual cache (Wu et al., arXiv 2505.22618; NVlabs/Fast-dLLM llada/generate.py
``generate_with_dual_cache``).

The prefix cache's refreshes (each row's first step of a block, and every ``refresh_every`` steps);
inside the block compute only the block (and, with the logit shift, the position before it) and reuse
both the prefix and the suffix K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract.state import DecodeState
from .prefix import PrefixCache


@dataclass
class DualCache(PrefixCache):
    """Fast-dLLM dual cache; see the module docstring."""

    name = "dual"

    def window(self, state: DecodeState) -> torch.Tensor:
        return state.in_block()
