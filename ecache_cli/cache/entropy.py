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

Variants inside the same idea (refresh when decoding is uncertain, recompute what is still moving;
docs/METHOD.md §2.7), both off by default so the paper's rule is exactly the default:
- ``recent_steps`` > 0: also recompute every committed position younger than that many of the row's
  own steps (age = row_step − commit_step, 1 for the previous step's commits). A token's K/V keep
  moving for a few steps after its commit (the volatility curve of ``ecache trace-drift``, which is a
  function of steps since commit); a window in steps follows that curve whatever the number of tokens
  committed per step, where the count ``recent_k`` covers fewer steps the more tokens a step commits
  (threshold decoding). The recomputed set is the union of both rules (``recent_k=0`` for steps alone).
- ``block_tau``: at a row's block start, refresh when the largest signal of any step of the block just
  finished exceeds ``block_tau`` (the signal decides whether the finished block's K/V need the refresh
  that ``block_refresh`` forces every time). None: off; ``block_refresh`` on refreshes every block
  start whatever ``block_tau``.
- ``refresh_prompt`` False: a refresh that the signal triggers recomputes the generated canvas (every
  position after the prompt) and keeps the prompt's K/V. Prompt tokens never change, so their K/V move
  only through their attention to the canvas, far less than the canvas's own (the prompt rows of
  ``trace-drift``); dLLM-Cache refreshes the prompt at a long interval for the same reason (its kp).
  The row's first step and the block-start refreshes (``block_refresh``, ``block_tau``) stay full
  forwards, which bound how stale the prompt's K/V get. On a few-shot prompt several times longer than
  the canvas, such a refresh costs a fraction of a full one.
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
    recent_steps: int = 0
    block_tau: float | None = None
    refresh_prompt: bool = True
    name = "entropy"
    # every step commits a token with entropy > 0 nats, and each refresh is a full forward
    forced_refresh = {"tau": 0.0, "refresh_prompt": True}
    test_params = {"tau": 1.0, "recent_k": 4}
    ranges = {"tau": Range(0, example="0.5", why="an entropy in nats"), "recent_k": count(0, "64"),
              "recent_steps": count(0, "4", "0 = off: the recent_k latest commits only"),
              "block_tau": Range(0, example="0.5", why="an entropy in nats, like tau")}
    row_state = {"refresh_next": ROW, "block_signal": ROW}

    def __post_init__(self):
        if self.signal not in SIGNALS:
            from ..errors import UsageError

            raise UsageError(f"--signal {self.signal!r} is not a signal; use one of {', '.join(SIGNALS)}")
        if self.recent_k < 0:
            from ..errors import UsageError

            raise UsageError(f"--recent-k {self.recent_k} must be ≥ 0")
        if self.tau < 0:  # every signal is ≥ 0 (an entropy in nats, or 1 - a probability)
            from ..errors import UsageError

            raise UsageError(f"--tau {self.tau} must be ≥ 0 (τ is an entropy in nats; e.g. --tau 0.5)")
        if self.recent_steps < 0:
            from ..errors import UsageError

            raise UsageError(f"entropy recent_steps {self.recent_steps} must be ≥ 0 (0 = off)")
        if self.block_tau is not None and self.block_tau < 0:
            from ..errors import UsageError

            raise UsageError(f"entropy block_tau {self.block_tau} must be ≥ 0 nats (or unset: off)")
        self.refresh_next: torch.Tensor | None = None
        self.block_signal: torch.Tensor | None = None

    def reset(self, state: DecodeState) -> None:
        self.refresh_next = torch.ones(state.batch, dtype=torch.bool, device=state.tokens.device)
        # (B,) float64: the largest signal of the row's current block so far (-inf: none yet)
        self.block_signal = torch.full((state.batch,), float("-inf"), dtype=torch.float64, device=state.tokens.device)

    def recent(self, state: DecodeState) -> torch.Tensor:
        """(B, T) bool: the ``recent_k`` most recently committed positions of each row, and with
        ``recent_steps`` every position committed within the row's last ``recent_steps`` steps."""
        out = None
        if self.recent_k > 0 or self.recent_steps == 0:
            cutoff = (state.n_committed - self.recent_k).clamp_(min=0).unsqueeze(1)  # (B, 1); uncommitted: order −1
            out = state.commit_order >= cutoff
        if self.recent_steps > 0:
            # age = row_step − commit_step ≤ recent_steps (1 = the previous step's commits), as one comparison:
            # a commit step ≥ row_step − recent_steps ≥ 0 (never committed: −1)
            since = (state.row_step - self.recent_steps).clamp_(min=0).unsqueeze(1)  # (B, 1)
            young = state.commit_step >= since
            out = young if out is None else out | young
        return out

    def plan(self, state: DecodeState) -> ForwardPlan:
        refresh = self.refresh_next
        full = None  # (B,) bool: the block-start refreshes, or None
        if self.block_refresh or self.block_tau is not None:
            at_start = state.step_in_block == 0
            full = at_start if self.block_refresh else at_start & (self.block_signal > self.block_tau)
            if self.block_tau is not None:  # a new block's signal starts afresh
                self.block_signal = self.block_signal.masked_fill(at_start, float("-inf"))
        compute = self.targets_and_sources(state)
        if self.recent_k > 0 or self.recent_steps > 0:  # else the recent set is empty
            compute = compute | self.recent(state)
        if self.refresh_prompt:
            return ForwardPlan(refresh=refresh if full is None else refresh | full, compute=compute)
        full = state.row_step == 0 if full is None else full | (state.row_step == 0)  # always full forwards
        canvas = refresh & ~full  # (B,) triggered refreshes: the generated canvas only, the prompt kept
        compute = compute | (canvas[:, None] & self.span(state, state.prompt_len, state.length))
        return ForwardPlan(refresh=full, compute=compute)

    def observe(self, state: DecodeState, record: StepRecord) -> None:
        if self.block_tau is not None or self.signal != "max-entropy":
            sig = record.signal(self.signal)  # (B,) float64
            self.refresh_next = sig > self.tau  # (B,) bool
            if self.block_tau is not None:
                self.block_signal = torch.maximum(self.block_signal, sig.to(self.block_signal.dtype))
        else:  # max over the committed tokens > tau, as one comparison (entropy ≥ 0)
            self.refresh_next = ((record.entropy > self.tau) & record.committed).any(1)  # (B,) bool
