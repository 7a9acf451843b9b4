"""``d2cache``: d2Cache, Dual aDaptive Cache (Jiang et al., "d2Cache: Accelerating Diffusion-Based LLMs
via Dual Adaptive Caching", arXiv 2509.23094, 2025; Kamichanw/d2Cache ``src/cache/d2cache.py``).

The first step is a full forward; after that d2Cache never refreshes everything. Per step it picks
the positions to recompute in two stages, and serves every other position from the store:
1. Masked positions, by certainty density: each masked position scores its last confidence times the
   Gaussian-weighted share (σ = ``sigma`` positions) of committed positions around it; the top
   ``current_k`` masked positions within the search window are chosen, the current block's first.
   The window runs from the block start to the first block boundary that holds ``current_k`` masks.
2. The other positions, by attention rollout: the head-averaged attention rows of the previous
   forward's query positions, with the residual identity, multiplied over layers; a position's
   importance is its column sum (how much the canvas draws on it). The smallest set of remaining
   positions holding ``rollout_p`` of the total importance (at least one) is recomputed.
Positions committed at the previous step are recomputed too. Defaults rollout_p 0.1, current_k 32,
sigma 10: the authors' configs/cache/d2cache.yaml.

Adaptations (our choices): attention weights come from ``model.attention_rows`` for the query rows
only, apart from the fused attention (the engine counts them as decision time); the rollout's column
sums are computed exactly with one vector pass per layer (O(depth · S · T)) instead of the T×T matrix
product. The engine produces logits only for the current block, so masked positions outside it rank
by density alone (unknown confidence = 1), as do block positions not yet scored. ``refresh_every``
(0 = never, the paper) is our option, used to check that a forced refresh reproduces ``none``.

Per row (d2Cache selects per sequence; our engine decides per row): the first step, ``refresh_every``
and "committed at the previous step" count in the row's own steps (``state.own_steps()``), and the
confidences and rollout importance are the row's own, summed over its real positions only (left
padding adds nothing), so a prompt decodes the same alone or in any batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..contract.fields import Range, count
from ..contract.hooks import ForwardHooks
from ..contract.rows import ROW
from ..contract.state import DecodeState, StepRecord
from ..errors import UsageError
from .base import CachePolicy, ForwardPlan


def certainty_density(decided: torch.Tensor, sigma: float) -> torch.Tensor:
    """Gaussian-smoothed share of committed positions, (B, G) float32 in [0, 1].

    ``decided`` (B, G) bool over the generated positions. Beyond the left edge counts as committed (the
    prompt); beyond the right edge as committed only when the last position is (d2Cache's padding
    rule). The kernel exp(-d²/2σ²) is cut at ±4σ and normalised to sum 1.
    """
    B, G = decided.shape
    r = max(int(math.ceil(4 * sigma)), 1)
    d = torch.arange(-r, r + 1, device=decided.device, dtype=torch.float32)
    kernel = torch.exp(-d ** 2 / (2 * sigma ** 2))
    kernel = (kernel / kernel.sum())[None, None]  # (1, 1, 2r+1)
    m = decided.float()
    left = torch.ones(B, r, device=m.device)
    right = m[:, -1:].expand(B, r)
    ext = torch.cat([left, m, right], 1)[:, None]  # (B, 1, G + 2r)
    return F.conv1d(ext, kernel).squeeze(1)  # (B, G)


def rollout_importance(pos: torch.Tensor, probs: list[torch.Tensor], length: int,
                       real: torch.Tensor | None = None) -> torch.Tensor:
    """Column sums of the attention rollout R_{L-1} ⋯ R_0, (B, T) float32.

    ``pos`` (B, A) long query positions of the forward (padded by repeating the first), ``probs`` per
    layer (B, A, T) head-averaged attention rows. R_l is the identity for positions that were not
    queries and (a_i + e_i)/2 for query rows i (attention plus residual, rows renormalised), as in
    d2Cache; 1ᵀR_{L-1}⋯R_0 is accumulated from the last layer down, one (A × T) product per layer.
    ``real`` (B, T) bool (the key mask) sums over the row's real positions only: left padding adds
    nothing, so a row's importance is the same alone or padded inside a batch (None = every position).
    """
    B, A = pos.shape
    first = (torch.arange(A, device=pos.device) == 0) | (pos != pos[:, :1])  # (B, A) real entries
    is_query = torch.zeros(B, length, dtype=torch.bool, device=pos.device).scatter_(1, pos, True)
    u = torch.ones(B, length, device=pos.device) if real is None else real.float()
    for a in reversed(probs):
        ui = u.gather(1, pos) * first  # (B, A)
        u = torch.where(is_query, 0.5 * u, u) + 0.5 * (ui[:, None, :] @ a).squeeze(1)
    return u


def nucleus(scores: torch.Tensor, p: float, allowed: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the highest ``scores`` among ``allowed`` whose normalised cumulative share is ≤ p,
    and always the top one (d2Cache's ``nucleus_select`` with min_k = 1)."""
    s = torch.where(allowed, scores, 0.0)
    share = s / (s.sum(1, keepdim=True) + 1e-9)
    sorted_share, order = share.sort(1, descending=True)
    keep = sorted_share.cumsum(1) <= p
    keep[:, 0] = True
    keep &= allowed.gather(1, order)
    return torch.zeros_like(allowed).scatter_(1, order, keep)


@dataclass
class D2Cache(CachePolicy):
    """d2Cache; see the module docstring. sigma in positions; rollout_p a share of total importance."""

    rollout_p: float = 0.1
    current_k: int = 32
    sigma: float = 10.0
    refresh_every: int = 0
    name = "d2cache"
    forced_refresh = {"refresh_every": 1}  # our option (the paper never refreshes after step 0)
    test_params = {"current_k": 4}
    ranges = {"rollout_p": Range(0, 1, example="0.1", why="a share of the total importance"),
              "current_k": count(1, "32"),
              "sigma": Range(0, 65536, lo_open=True, example="10", why="a width in positions"),
              "refresh_every": count(0, "8", "0 = never")}
    row_state = {"conf": ROW, "importance": ROW}

    def __post_init__(self):
        if not 0.0 <= self.rollout_p <= 1.0:
            raise UsageError(f"d2cache rollout_p {self.rollout_p} must be within [0, 1]")
        if self.current_k < 1 or self.sigma <= 0:
            raise UsageError(f"d2cache current_k {self.current_k} must be ≥ 1 and sigma {self.sigma} > 0")
        if self.refresh_every < 0:
            raise UsageError(f"--refresh-every {self.refresh_every} must be ≥ 0 (0 = never, d2Cache's rule)")
        self.conf: torch.Tensor | None = None  # (B, T) float32 last confidence of each masked position
        self.importance: torch.Tensor | None = None  # (B, T) float32 rollout importance of the last forward

    def reset(self, state: DecodeState) -> None:
        self.conf = torch.ones(state.tokens.shape, device=state.tokens.device)
        self.importance = torch.zeros(state.tokens.shape, device=state.tokens.device)  # none before a row's first step

    def masked_selection(self, state: DecodeState) -> torch.Tensor:
        """(B, T) bool: up to ``current_k`` masked positions by certainty density (stage 1)."""
        P, G, BL = state.prompt_len, state.gen_length, state.block_length
        masked = state.masked[:, P:]  # (B, G)
        score = self.conf[:, P:] * certainty_density(~masked, self.sigma)  # (B, G)
        col = torch.arange(G, device=masked.device)
        enough = masked.long().cumsum(1) >= self.current_k
        end = torch.where(enough.any(1), enough.float().argmax(1), G - 1)  # (B,) first index with k masks
        end = ((end // BL) + 1) * BL - 1  # round up to the end of its block
        start = (state.block_start - P)[:, None]  # (B, 1) each row's block
        window = masked & (col >= start) & (col <= end[:, None])
        in_block = (col >= start) & (col < (state.block_end - P)[:, None])
        key = torch.where(window, score + 2.0 * in_block, float("-inf"))  # block first (scores ≤ 1)
        k = min(self.current_k, G)
        top = key.topk(k, dim=1)
        pick = torch.zeros_like(masked).scatter_(1, top.indices, top.values > float("-inf"))
        out = torch.zeros_like(state.masked)
        out[:, P:] = pick
        return out | state.sources(out)

    def plan(self, state: DecodeState) -> ForwardPlan:
        """Per row, in the row's own steps: its first step (and, with ``refresh_every``, every that many
        of its steps) is a full forward whose attention rows cover its real positions; otherwise the two
        stages above."""
        steps = state.own_steps()  # (B,)
        refresh = steps == 0
        if self.refresh_every > 0:
            refresh = refresh | (steps % self.refresh_every == 0)
        compute = self.targets_and_sources(state) | self.masked_selection(state)
        compute |= state.commit_step == steps[:, None] - 1  # committed at the row's previous step
        compute |= nucleus(self.importance, self.rollout_p, state.key_mask & ~compute)
        attn = torch.where(refresh[:, None], state.key_mask, compute)
        return ForwardPlan(refresh=refresh, compute=compute, hooks=ForwardHooks(attention_rows=attn))

    def observe(self, state: DecodeState, record: StepRecord) -> None:
        prob = torch.where(record.valid, record.prob.float(), 0.0)  # (B, R); padding repeats carry 0
        scored = torch.zeros_like(self.conf).scatter_reduce(1, record.targets, prob, "amax")  # (B, T)
        hit = torch.zeros_like(state.tokens).scatter_add_(1, record.targets, record.valid.long()) > 0
        self.conf = torch.where(hit, scored, self.conf)
        pos, probs = record.outputs["attention"]
        self.importance = rollout_importance(pos, probs, state.length, state.key_mask)
