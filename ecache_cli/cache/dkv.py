"""``dkv``: dKV-Cache-Decode (Ma et al., "dKV-Cache: The Cache for Diffusion Language Models",
arXiv 2505.15781, 2025; horseee/dKV-Cache, ``generation_utils/llada_dkv_cache_decode.py``).

Delayed caching: a token's K/V enter the cache one step after it is committed. At a cached step the
forward computes every still-masked position of the canvas (masks are never cached, inside or outside
the current block) and the positions committed at the previous step (their K/V are recomputed once
with the decoded token, then served from the cache); the prompt and older committed tokens come from
the store. Every ``refresh_every`` steps of a block (counted from the block's first step) a full
forward refreshes everything. Default 8: the LLaDA setting of the authors' README
(``cache_reloading_step=8``); their Dream example uses 16.

Difference from the reference code: it also refreshes at a block's second step (an artefact of how it
builds its cache); here only the ``refresh_every`` schedule refreshes. Dream: the positions whose
logits predict the block's masks (one to the left) are computed too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..contract.fields import count
from ..contract.state import DecodeState
from ..errors import UsageError
from .base import CachePolicy, ForwardPlan

DEFAULT_REFRESH_EVERY = 8  # dKV-Cache README, LLaDA: cache_reloading_step=8


@dataclass
class DKVCache(CachePolicy):
    """dKV-Cache-Decode; see the module docstring. ``refresh_every`` in denoising steps (1 = always)."""

    refresh_every: int = DEFAULT_REFRESH_EVERY
    name = "dkv"
    forced_refresh = {"refresh_every": 1}
    test_params = {"refresh_every": 3}
    ranges = {"refresh_every": count(1, "8", "dkv refreshes every N steps of a block")}

    def __post_init__(self):
        if self.refresh_every < 1:
            raise UsageError(f"--refresh-every {self.refresh_every} must be ≥ 1 for dkv (it refreshes every N steps)")

    def plan(self, state: DecodeState) -> ForwardPlan:
        refresh = state.step_in_block % self.refresh_every == 0  # (B,) counted from each row's block start
        just_committed = state.commit_step == state.own_steps()[:, None] - 1  # (B, T) at the row's previous step
        return ForwardPlan(refresh=refresh, compute=state.masked | just_committed | self.targets_and_sources(state))
