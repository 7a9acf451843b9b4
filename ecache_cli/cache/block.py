"""``block``: the exact cache of finished blocks, for block-diffusion models (SDAR, LLaDA2.x).

Their attention is block-causal: a block sees itself and the blocks before it, never a later one, so
once a block's last mask is committed the keys and values of its positions never change again (as in
an autoregressive model; docs/METHOD.md, "Block diffusion"). Each step therefore computes only the
row's current block against the cached prefix. A row's first step computes its prompt and first block
(the prefill); the first step of each later block also computes the block just finished, from its final
tokens, writing its keys and values once (the official SDAR loop and SGLang/dInfer spend one extra
forward per block on that write; here it rides on the next block's first forward, with the same result
since that block's queries see the finished block's new keys in the same forward). Nothing is
approximate: decoding equals ``none`` (every position recomputed every step) token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract.state import DecodeState
from .base import CachePolicy, ForwardPlan


@dataclass
class BlockCache(CachePolicy):
    """The exact cache of finished blocks; see the module docstring. No parameters."""

    name = "block"
    attention = "block-causal"

    def plan(self, state: DecodeState) -> ForwardPlan:
        start, end = state.block_start, state.block_end  # (B,) each row's current block
        first = state.row_step == 0  # the prefill: everything up to the end of the first block
        entering = state.step_in_block == 0  # also the finished block before, from its final tokens
        lo = torch.where(first, 0, torch.where(entering, start - state.block_length, start))
        compute = state.span(lo, end) & state.key_mask | self.targets_and_sources(state)
        refresh = torch.zeros(state.batch, dtype=torch.bool, device=state.tokens.device)
        return ForwardPlan(refresh=refresh, compute=compute)
