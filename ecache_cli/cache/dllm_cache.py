"""``dllm-cache``: dLLM-Cache (Liu et al., "dLLM-Cache: Accelerating Diffusion Large Language Models
with Adaptive Caching", arXiv 2506.06295, 2025; maomaocun/dLLM-Cache; docs/METHOD.md §3.4).

The prompt is refreshed every ``kp`` steps and the response (the generated positions) every ``kr``
steps, counted over the whole request (step 0 refreshes both: a full forward). The steps are each
row's own (``state.own_steps()``; dLLM-Cache counts the denoising steps of its sequence): under
threshold decoding a row that waits for the others takes no step, so kp / kr, the staleness ranking
and the ρ selection are per row and a prompt decodes the same alone or in any batch. In between, only the
fraction ``rho`` of response positions whose value vectors changed most are recomputed:
ceil(rho · response length) positions with the lowest cosine similarity between a fresh V and the
cached one. Defaults kp = 50, kr = 7, rho = 0.25: the paper's LLaDA-Instruct GSM8K setting.

Adaptations to a KV-store engine (our choices, each explicit):
- The similarity probe is layer 0's V, ``v_proj(attn_norm(embed(tokens)))`` over every position (one
  norm and one matmul, read through ``state.probe`` inside ``plan``: decision time), compared
  with ``store.v[0]``. dLLM-Cache compares per layer inside its forward; a per-layer probe would need
  every layer's input for every position, i.e. the forward it is meant to skip. At layer 0 V depends
  only on the token, so the positions that changed are those committed since they were last computed.
- Ties (cosine change below ``tol``, which absorbs bf16 rounding between batch shapes) are broken by
  staleness: the position computed longest ago first, so unchanged positions are refreshed in turn.
- dLLM-Cache caches attention and FFN outputs too and serves stale logits for masks it skips; here a
  recomputed position is recomputed at every layer, and the current block's masked positions (and
  the positions whose logits predict them) are always computed, on top of the ρ selection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..contract.fields import Range, count
from ..contract.rows import ROW
from ..contract.state import DecodeState
from ..errors import UsageError
from .base import CachePolicy, ForwardPlan


@dataclass
class DLLMCache(CachePolicy):
    """dLLM-Cache; see the module docstring. kp, kr in denoising steps; rho a fraction of the response."""

    kp: int = 50
    kr: int = 7
    rho: float = 0.25
    tol: float = 1e-3  # cosine change below this counts as unchanged (numerical noise)
    name = "dllm-cache"
    forced_refresh = {"kp": 1, "kr": 1}  # prompt and response both due every step
    test_params = {"kr": 3}
    ranges = {"kp": count(1, "50", "steps between prompt refreshes"),
              "kr": count(1, "7", "steps between response refreshes"),
              "rho": Range(0, 1, example="0.25", why="a share of the response"),
              "tol": Range(0, 2, example="1e-3", why="a cosine change 1 − cos")}
    row_state = {"last": ROW}

    def __post_init__(self):
        if self.kp < 1 or self.kr < 1:
            raise UsageError(f"dllm-cache intervals kp={self.kp}, kr={self.kr} must be ≥ 1 step")
        if not 0.0 <= self.rho <= 1.0:
            raise UsageError(f"dllm-cache rho {self.rho} must be within [0, 1]")
        self.last: torch.Tensor | None = None  # (B, T) long step at which each position was last computed

    def reset(self, state: DecodeState) -> None:
        self.last = torch.full_like(state.tokens, -1)

    def n_adaptive(self, state: DecodeState) -> int:
        """Response positions recomputed between refreshes: ceil(rho · gen_length)."""
        return math.ceil(self.rho * state.gen_length)

    def select(self, state: DecodeState) -> torch.Tensor:
        """(B, T) bool: the ``n_adaptive`` response positions whose layer-0 V changed most.

        Change = 1 - cos(V_fresh, V_cached) per position; positions whose change is below ``tol`` rank
        after every changed one, oldest (last computed longest ago) first.
        """
        fresh, cached = state.probe.layer_values(state.tokens), state.probe.cached_values()  # (B, T, H_kv*D) each
        P, k = state.prompt_len, self.n_adaptive(state)
        out = torch.zeros_like(state.masked)
        if k == 0:
            return out
        cos = torch.nn.functional.cosine_similarity(fresh[:, P:].float(), cached[:, P:].float(), dim=-1)
        change = 1.0 - cos  # (B, G)
        steps = state.own_steps()[:, None]  # (B, 1) the row's own step
        age = (steps - self.last[:, P:]).float() / (steps + 2)  # (B, G) in (0, 1)
        key = torch.where(change > self.tol, 1.0 + change, age)
        idx = key.topk(min(k, key.shape[1]), dim=1).indices  # (B, k)
        out[:, P:] = torch.zeros_like(change, dtype=torch.bool).scatter_(1, idx, True)
        return out

    def plan(self, state: DecodeState) -> ForwardPlan:
        """Per row, in the row's own steps: a row whose prompt and response are both due refreshes; one
        whose prompt is due also computes the prompt; one whose response is due computes the response,
        else its ρ selection."""
        P = state.prompt_len
        steps = state.own_steps()  # (B,)
        prompt_due, response_due = (steps % self.kp == 0)[:, None], (steps % self.kr == 0)[:, None]  # (B, 1)
        refresh = (prompt_due & response_due).squeeze(1)  # (B,)
        compute = self.targets_and_sources(state) | (prompt_due & self.span(state, 0, P))
        response = self.span(state, P, state.length)
        if bool(response_due.all()):  # one host sync: skip the ρ selection when no row needs it
            compute |= response
        else:
            compute |= torch.where(response_due, response, self.select(state))
        self.last = torch.where(compute | refresh[:, None], steps[:, None], self.last)
        return ForwardPlan(refresh=refresh, compute=compute)
