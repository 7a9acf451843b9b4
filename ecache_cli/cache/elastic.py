"""``elastic``: Elastic-Cache (Nguyen-Tri, Ranjan, Shen, "Attention Is All You Need for KV Cache in
Diffusion LLMs", arXiv 2510.14973, 2025; docs/METHOD.md §3.7).

Elastic-Cache decides *when* to refresh with an attention-aware drift test and *where* with a
depth-aware schedule. Per step the forward computes a sliding window (the first ``window`` masked
positions of the canvas), the current block's masked positions and the tracked tokens below; every
other position, distant masks included, is served from the store. Per layer l the *most-attended
token* (the key receiving the most attention from the masked query rows) is tracked: at the next step
it is a query too, and its attention row is compared (cosine) with its row at the previous step. At
the first layer l where the similarity falls below ``gamma``, every position is recomputed from layer
l + 1 on (shallow layers keep their cached K/V; the inputs of the deeper layers for positions outside
the window come from the store's hidden states). Defaults: gamma 0.9 (the paper's); window 16 (our
default; the paper sweeps the window size).

Adaptations (our choices): the drift test observed in step t's forward sets the start layer of step
t + 1's forward (the model never decides mid-forward); when the most-attended token changes, its new
row is recorded and the test resumes at the next step. Positions committed at the previous step are
recomputed once (otherwise the shallow layers would keep the mask token's K/V until a refresh). The
attention rows come from ``model.attention_rows`` for the window and tracked rows only, apart from the
fused attention (decision time). The first step is a full forward; ``refresh_every`` (0 = never, the
paper) is our option, used to check that a forced refresh reproduces ``none``.

Per row (the paper's drift test and most-attended token are per sequence): the first step,
``refresh_every``, "committed at the previous step", the sliding window, the tracked tokens and the
start layer are each row's own, counted in its own steps (``state.own_steps()``), so a prompt decodes
the same alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract.fields import Range, count
from ..contract.hooks import ForwardHooks
from ..contract.rows import ROW
from ..contract.state import DecodeState, StepRecord
from ..errors import UsageError
from .base import CachePolicy, ForwardPlan


@dataclass
class ElasticCache(CachePolicy):
    """Elastic-Cache; see the module docstring. gamma a cosine similarity; window in positions."""

    gamma: float = 0.9
    window: int = 16
    refresh_every: int = 0
    name = "elastic"
    forced_refresh = {"refresh_every": 1}  # our option (the paper refreshes by layer, never in full)
    test_params = {"window": 4}
    ranges = {"gamma": Range(0, 1, example="0.9", why="a cosine similarity"), "window": count(0, "16", "positions"),
              "refresh_every": count(0, "8", "0 = never")}
    row_state = {name: ROW for name in ("tracked", "prev_row", "has_prev", "similarity", "start_next")}
    keeps_hidden = True

    def __post_init__(self):
        if self.window < 0:
            raise UsageError(f"elastic window {self.window} must be ≥ 0 positions")
        if self.refresh_every < 0:
            raise UsageError(f"--refresh-every {self.refresh_every} must be ≥ 0 (0 = never, Elastic-Cache's rule)")
        self.tracked: torch.Tensor | None = None  # (B, L) long most-attended position per layer (-1 = none)
        self.prev_row: torch.Tensor | None = None  # (B, L, T) float32 its attention row when last seen
        self.has_prev: torch.Tensor | None = None  # (B, L) bool prev_row is valid
        self.similarity: torch.Tensor | None = None  # (B, L) float32 last drift test (1 = not tested)
        self.start_next: torch.Tensor | None = None  # (B,) long start layer of the next forward (L = none)

    def reset(self, state: DecodeState) -> None:
        B, L, T, dev = state.batch, state.n_layers, state.length, state.tokens.device
        self.tracked = torch.full((B, L), -1, dtype=torch.long, device=dev)
        self.prev_row = torch.zeros(B, L, T, device=dev)
        self.has_prev = torch.zeros(B, L, dtype=torch.bool, device=dev)
        self.similarity = torch.ones(B, L, device=dev)
        self.start_next = torch.full((B,), L, dtype=torch.long, device=dev)

    def sliding_window(self, state: DecodeState) -> torch.Tensor:
        """(B, T) bool: the first ``window`` masked positions of each row."""
        return state.masked & (state.masked.long().cumsum(1) <= self.window)

    def tracked_positions(self, state: DecodeState) -> torch.Tensor:
        """(B, T) bool: the positions tracked as most-attended in any layer."""
        hits = torch.zeros_like(state.tokens).scatter_add_(1, self.tracked.clamp_min(0), (self.tracked >= 0).long())
        return hits > 0

    def plan(self, state: DecodeState) -> ForwardPlan:
        queries = self.sliding_window(state) | state.block_masked()  # the masked query rows
        rows = queries | self.tracked_positions(state)
        steps = state.own_steps()  # (B,) each row's own step: first step and refresh_every are per row
        refresh = steps == 0
        if self.refresh_every > 0:
            refresh = refresh | (steps % self.refresh_every == 0)
        compute = rows | self.targets_and_sources(state) | (state.commit_step == steps[:, None] - 1)
        return ForwardPlan(refresh=refresh, compute=compute,
                           hooks=ForwardHooks(grow_from_layer=self.start_next, attention_rows=rows))

    @staticmethod
    def _rows_of(pos: torch.Tensor, a: torch.Tensor, which: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention rows (B, L, T) of positions ``which`` (B, L) in ``a`` (B, L, A, T), and (B, L) bool found."""
        eq = pos[:, None, :] == which[:, :, None]  # (B, L, A)
        r = eq.float().argmax(-1)  # (B, L)
        rows = a.gather(2, r[:, :, None, None].expand(-1, -1, 1, a.shape[-1])).squeeze(2)
        return rows, eq.any(-1)

    def observe(self, state: DecodeState, record: StepRecord) -> None:
        pos, probs = record.outputs["attention"]  # (B, A), L x (B, A, T)
        a = torch.stack(probs, 1)  # (B, L, A, T)
        A = pos.shape[1]
        first = (torch.arange(A, device=pos.device) == 0) | (pos != pos[:, :1])  # real (not padding) entries
        masked_then = state.masked | (state.commit_step == state.own_steps()[:, None])  # masked when it ran
        from_masks = masked_then.gather(1, pos) & first  # (B, A)
        received = (a * from_masks[:, None, :, None]).sum(2)  # (B, L, T) attention each key received
        received = received.masked_fill(~state.key_mask[:, None], float("-inf"))
        # drift test on the tracked tokens, whose rows this forward computed
        cur, found = self._rows_of(pos, a, self.tracked)
        tested = self.has_prev & found
        sim = torch.nn.functional.cosine_similarity(cur, self.prev_row, dim=-1)  # (B, L)
        self.similarity = torch.where(tested, sim, torch.ones_like(sim))
        L = a.shape[1]
        drift = tested & (sim < self.gamma)
        first_l = torch.where(drift, torch.arange(L, device=pos.device), L).amin(1)  # (B,)
        self.start_next = torch.where(first_l < L, first_l + 1, L)
        # track this step's most-attended tokens
        self.tracked = received.argmax(-1)  # (B, L)
        self.prev_row, self.has_prev = self._rows_of(pos, a, self.tracked)
