"""``prefix``: Fast-dLLM's prefix cache (Wu et al., arXiv 2505.22618; NVlabs/Fast-dLLM llada/generate.py
``generate_with_prefix_cache``).

A full forward at each row's first step of a block; inside the block compute the positions from the
block start to the end of the canvas and reuse the prompt/prefix K/V. With the logit shift (Dream)
the position before the block is computed too, since its hidden state predicts the block's first
token. ``refresh_every`` > 0 also refreshes every that many steps inside a block (1 = every step:
equals ``none``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract.fields import count
from ..contract.state import DecodeState
from ..errors import UsageError
from .base import CachePolicy, ForwardPlan


@dataclass
class PrefixCache(CachePolicy):
    """Fast-dLLM prefix cache; see the module docstring. ``refresh_every`` in steps of a block."""

    refresh_every: int = 0
    name = "prefix"
    forced_refresh = {"refresh_every": 1}
    ranges = {"refresh_every": count(0, "8", "0 = block starts only")}
    test_params = {}

    def __post_init__(self):
        if self.refresh_every < 0:
            raise UsageError(f"--refresh-every {self.refresh_every} must be ≥ 0 for {self.name} "
                             "(0 = refresh only at block starts, N = also every N steps inside a block)")

    def _refresh(self, state: DecodeState) -> torch.Tensor:
        """(B,) bool: rows at their block's first step (or, with ``refresh_every``, every that many steps)."""
        sib = state.step_in_block
        if self.refresh_every > 0:
            return sib % self.refresh_every == 0
        return sib == 0

    def window(self, state: DecodeState) -> torch.Tensor:
        """(B, T) bool: the positions a row computes inside its block."""
        return state.span(state.block_start, state.length)

    def plan(self, state: DecodeState) -> ForwardPlan:
        return ForwardPlan(refresh=self._refresh(state), compute=self.window(state) | self.targets_and_sources(state))
