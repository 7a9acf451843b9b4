"""``none``: a full forward every step. The reference every other policy is tested against."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract.state import DecodeState
from .base import CachePolicy, ForwardPlan


@dataclass
class NoCache(CachePolicy):
    """Plain masked-diffusion decoding (LLaDA generate.py): recompute every position every step."""

    name = "none"
    attention = "any"  # a full forward is exact under either attention
    forced_refresh = {}  # every step is a full forward

    def plan(self, state: DecodeState) -> ForwardPlan:
        return ForwardPlan.full(state)
