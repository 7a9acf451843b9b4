"""Fast-dLLM's block caches (Wu et al., arXiv 2505.22618; NVlabs/Fast-dLLM generate.py).

``prefix``: a full forward at the first step of each block; inside the block compute the positions
from the block start to the end of the canvas and reuse the prompt/prefix K/V.
``dual``: the same refresh; inside the block compute only the block and reuse prefix and suffix K/V.
Dream's shift adds the position before the block (spec/models.md B3.5). ``refresh_every`` > 0 also
refreshes every that many steps inside a block (1 = every step: equals ``none``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.state import DecodeState
from .base import CachePolicy, ForwardPlan


@dataclass
class PrefixCache(CachePolicy):
    """Fast-dLLM prefix cache; see the module docstring."""

    refresh_every: int = 0
    name = "prefix"

    def __post_init__(self):
        if self.refresh_every < 0:
            from ..errors import UsageError

            raise UsageError(f"--refresh-every {self.refresh_every} must be ≥ 0 for {self.name} "
                             "(0 = refresh only at block starts, N = also every N steps inside a block)")

    def _refresh(self, state: DecodeState) -> bool:
        return state.step_in_block == 0 or (self.refresh_every > 0 and state.step_in_block % self.refresh_every == 0)

    def window(self, state: DecodeState) -> torch.Tensor:
        return self.span(state, state.block_start, state.length)

    def plan(self, state: DecodeState) -> ForwardPlan:
        if self._refresh(state):
            return ForwardPlan.full(state)
        compute = self.window(state) | self.targets_and_sources(state)
        return ForwardPlan(refresh=torch.zeros(state.batch, dtype=torch.bool, device=compute.device), compute=compute)


@dataclass
class DualCache(PrefixCache):
    """Fast-dLLM dual cache; see the module docstring."""

    name = "dual"

    def window(self, state: DecodeState) -> torch.Tensor:
        return self.span(state, state.block_start, state.block_end)
