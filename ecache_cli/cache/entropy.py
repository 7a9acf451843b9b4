"""``entropy``: EntropyCache (Cheong et al., arXiv 2603.18489, 2026; docs/METHOD.md §2).

After each step, the signal E is the maximum entropy (nats) of the distributions that produced the
tokens committed at that step. If E > tau the next step is a full forward that refreshes every
cached K/V; otherwise it computes only the current block's masked positions plus the ``recent_k``
most recently committed positions (ranked by commit order, not by position) and reads everything
else from the store. The decision is O(V) per committed token, independent of length and depth.

Our choices where the paper is silent (each an option): ``signal`` max-entropy (default),
sum-entropy or max-confidence (1 - min probability); entropy of softmax(raw logits) in nats;
``block_refresh`` off by default (forced refresh at each block start); decisions are per row, so a
batch decodes each row exactly as it would alone. The first step always refreshes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract.fields import Range, count
from ..contract.rows import ROW
from ..contract.state import SIGNALS, DecodeState, StepRecord
from .base import CachePolicy, ForwardPlan

DEFAULT_TAU = 1.0  # nats; overridden by a calibrated profile (ecache calibrate)
DEFAULT_RECENT_K = 64  # docs/METHOD.md §2.4 (k = 64, medium confidence)


@dataclass
class EntropyCache(CachePolicy):
    """EntropyCache; see the module docstring. tau in nats (same unit as the signal)."""

    tau: float = DEFAULT_TAU
    recent_k: int = DEFAULT_RECENT_K
    signal: str = "max-entropy"
    block_refresh: bool = False
    name = "entropy"
    forced_refresh = {"tau": 0.0}  # every step commits a token with entropy > 0 nats
    test_params = {"tau": 1.0, "recent_k": 4}
    ranges = {"tau": Range(0, example="0.5", why="an entropy in nats"), "recent_k": count(0, "64")}
    row_state = {"refresh_next": ROW}

    def __post_init__(self):
        if self.signal not in SIGNALS:
            from ..errors import UsageError

            raise UsageError(f"--signal {self.signal!r} is not known; use one of {', '.join(SIGNALS)}")
        if self.recent_k < 0:
            from ..errors import UsageError

            raise UsageError(f"--recent-k {self.recent_k} must be ≥ 0")
        if self.tau < 0:  # every signal is ≥ 0 (an entropy in nats, or 1 - a probability)
            from ..errors import UsageError

            raise UsageError(f"--tau {self.tau} must be ≥ 0 (τ is an entropy in nats; e.g. --tau 0.5)")
        self.refresh_next: torch.Tensor | None = None

    def reset(self, state: DecodeState) -> None:
        self.refresh_next = torch.ones(state.batch, dtype=torch.bool, device=state.tokens.device)

    def recent(self, state: DecodeState) -> torch.Tensor:
        """(B, T) bool: the ``recent_k`` most recently committed positions of each row."""
        cutoff = (state.n_committed - self.recent_k).clamp_(min=0)[:, None]  # (B, 1); uncommitted: order −1
        return state.commit_order >= cutoff

    def plan(self, state: DecodeState) -> ForwardPlan:
        refresh = self.refresh_next
        if self.block_refresh:
            refresh = refresh | (state.step_in_block == 0)
        compute = self.targets_and_sources(state) | self.recent(state)
        return ForwardPlan(refresh=refresh, compute=compute)

    def observe(self, state: DecodeState, record: StepRecord) -> None:
        if self.signal == "max-entropy":  # max over the committed tokens > tau, as one comparison (entropy ≥ 0)
            self.refresh_next = ((record.entropy > self.tau) & record.committed).any(1)  # (B,) bool
        else:
            self.refresh_next = record.signal(self.signal) > self.tau  # (B,) bool
