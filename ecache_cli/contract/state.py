"""The decode state a cache policy reads before each step, and the record of each step the engine yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from . import rows as row_fields
from .rows import ROW

if TYPE_CHECKING:
    from .hooks import ModelProbe

SIGNALS = ("max-entropy", "sum-entropy", "max-confidence")


@dataclass
class DecodeState:
    """What a cache policy may look at before a forward (all tensors batch-first, on the model device).

    Every row carries its own clock, so rows may be at different blocks in one step and rows may join or
    leave between steps.

    tokens: (B, T) long canvas, left padded to ``prompt_len``; generated positions [prompt_len, T).
    key_mask: (B, T) bool, True for real tokens (False = left padding). masked: (B, T) bool, True where
    the canvas still holds the mask token. commit_order: (B, T) long, the rank at which each generated
    position was committed within its row (0, 1, 2, ...; -1 = prompt, padding or still masked);
    ``n_committed`` (B,) long is the count. commit_step: (B, T) long, the row's own step (``row_step``)
    at which each position was committed (-1 = never).
    block: (B,) long each row's current block; step_in_block: (B,) long its steps taken in that block
    (0 = the block's first step); row_step: (B,) long its steps taken in the request (0 = its first).
    ``block_start`` / ``block_end`` (B,) long are the block's canvas positions [start, end).
    block_offset: (B,) long, or None (all 0): block-diffusion families lay blocks from each row's first
    prompt token, so a row's first block starts ``block_offset`` positions before ``prompt_len`` and holds
    the prompt's last ``block_offset`` tokens beside its first masks (docs/MODELS.md §10).
    block_done: (B,) bool, rows whose block ended with the last step (``StepDecoder.block_done``);
    mask_free_steps: (B,) long, the current block's steps that began without a mask (LLaDA2.1's editing).
    reused: (B,) long, or None (all 0): each row's leading prompt positions whose keys and values came from a
    prefix store when it joined (``reused_span``); a policy's plan may leave them uncomputed
    (``cache.base.ReusedPrefix``).
    schedule: (B, steps_per_block) long per-step commit counts of each row's current block, or None
    (threshold / factor decoding). step: the run's step counter (steps the batch took together).
    rows: (B,) long the rows' indices in the run (``Run.add`` numbers joining rows on).
    probe: a ``contract.hooks.ModelProbe`` for policies that read the model before planning (None outside a run).
    """

    tokens: torch.Tensor
    key_mask: torch.Tensor
    masked: torch.Tensor
    commit_order: torch.Tensor
    commit_step: torch.Tensor
    n_committed: torch.Tensor
    rows: torch.Tensor
    block: torch.Tensor
    step_in_block: torch.Tensor
    row_step: torch.Tensor
    prompt_len: int
    gen_length: int
    block_length: int
    logit_shift: int
    n_layers: int
    schedule: torch.Tensor | None = None
    step: int = 0
    probe: ModelProbe | None = None
    block_mask: torch.Tensor | None = None  # (B, T) bool in_block(), kept by the engine as blocks change
    block_offset: torch.Tensor | None = None  # (B,) long prompt tokens in each row's first block (block diffusion)
    block_done: torch.Tensor | None = None  # (B,) bool rows whose block ended with the last step (the decoder's rule)
    mask_free_steps: torch.Tensor | None = None  # (B,) long steps of the block begun without a mask (token editing)
    reused: torch.Tensor | None = None  # (B,) long leading prompt positions whose K/V a prefix store gave (None: 0)
    # (masked, in_block(), their AND): block_masked() of the step, for as long as both are the same tensors
    _block_masked_memo: tuple | None = field(default=None, repr=False, compare=False)

    #: the per-row fields (rows along dimension 0)
    ROW_FIELDS = {name: ROW for name in ("tokens", "key_mask", "masked", "commit_order", "commit_step", "n_committed",
                                          "rows", "block", "step_in_block", "row_step", "schedule",
                                          "block_mask", "block_offset", "block_done", "mask_free_steps", "reused")}

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def block_start(self) -> torch.Tensor:
        """(B,) long canvas position where each row's current block starts."""
        start = self.prompt_len + self.block * self.block_length
        return start if self.block_offset is None else start - self.block_offset

    @property
    def block_end(self) -> torch.Tensor:
        """(B,) long canvas position just past each row's current block."""
        return self.block_start + self.block_length

    def span(self, start, end) -> torch.Tensor:
        """(B, T) bool, True on canvas positions [start, end): ints or (B,) long tensors."""
        pos = torch.arange(self.length, device=self.tokens.device)[None, :]  # (1, T)
        start = torch.as_tensor(start, device=pos.device).reshape(-1, 1)
        end = torch.as_tensor(end, device=pos.device).reshape(-1, 1)
        return ((pos >= start) & (pos < end)).expand(self.batch, -1)

    def reused_span(self) -> torch.Tensor:
        """(B, T) bool: each row's leading prompt positions whose keys and values were written from a prefix
        store when the row joined (``reused``; ``Run.add``'s ``reuse``), none when ``reused`` is None."""
        if self.reused is None:
            return torch.zeros_like(self.key_mask)
        start = self.prompt_len - self.key_mask[:, :self.prompt_len].sum(1)  # (B,) each row's first prompt token
        return self.span(start, start + self.reused)

    def in_block(self) -> torch.Tensor:
        """(B, T) bool: the positions of each row's current block (``block_mask`` when the engine keeps it)."""
        if self.block_mask is not None:
            return self.block_mask
        return self.span(self.block_start, self.block_end)

    def enter_blocks(self) -> None:
        """Recompute ``block_mask`` after ``block`` changed (the engine calls it; one mask per block, not per use)."""
        self.block_mask = None
        self.block_mask = self.span(self.block_start, self.block_end)

    def block_masked(self) -> torch.Tensor:
        """(B, T) bool: masked positions of each row's current block (the positions that can be committed).

        Computed once per step: the engine and the policy both ask for it, and ``masked`` and
        ``block_mask`` are replaced, never edited in place, when a step commits or a block changes, so
        the result is kept while both are the same tensor objects. Do not modify the returned tensor.
        """
        block, memo = self.in_block(), self._block_masked_memo
        if memo is not None and memo[0] is self.masked and memo[1] is block:
            return memo[2]
        out = self.masked & block
        self._block_masked_memo = (self.masked, block, out)
        return out

    def sources(self, targets: torch.Tensor) -> torch.Tensor:
        """(B, T) bool of the hidden-state positions whose logits predict ``targets`` (B, T) bool.

        The model's logit shift s: the hidden state at position i - s predicts token i (s = 0 for
        LLaDA; s = 1 for Dream, which was trained with shifted prediction), so the set moves s to the left.
        """
        if self.logit_shift == 0:
            return targets
        out = torch.zeros_like(targets)
        out[:, :-self.logit_shift] = targets[:, self.logit_shift:]
        return out

    def own_steps(self) -> torch.Tensor:
        """(B,) long: each row's own step index (``row_step``)."""
        return self.row_step

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only rows ``keep`` (K,) long (indices into the current batch)."""
        row_fields.keep(self, self.ROW_FIELDS, keep)

    def append_rows(self, taken: dict) -> None:
        """Append rows (``{field: value}`` of ``ROW_FIELDS``, e.g. a new state's) after the current rows."""
        row_fields.append(self, self.ROW_FIELDS, taken)


@dataclass
class StepRecord:
    """One denoising step, as the engine yields it (rows = the rows active at this step).

    step: the run's step counter. block, step_in_block: (B,) long each row's block and its step in it.
    refresh: (B,) bool, rows that ran a full forward. computed: (B,) long, positions the step's forwards
    computed per row, padding included (a row in a forward of query width S costs S; a refreshing row of
    a mixed step costs T plus its share of the partial forward; layer-averaged for forwards whose
    positions change at a layer). planned: (B,) long, the plan's own positions (T for a refreshing
    row, its ``compute`` otherwise, layer-averaged over what shrinks kept). query_width: the partial
    forward's width (T when every row refreshed). targets: (B, R) long positions whose logits were
    produced (padded with repeats;
    ``valid`` (B, R) bool marks real ones that got logits: a shrink with ``keep_logits=False``
    may leave a target without). committed: (B, R) bool, targets committed this step; x0
    (B, R) long chosen tokens; prob (B, R) float64 probability of x0; entropy (B, R) float64 nats of
    softmax(raw logits). Times in seconds: forward_s (model), decision_s (policy plan + observe and the
    extra outputs it asked for), sampling_s (sampling, remasking, commit); on CUDA they are read from
    events at the end of the run (0.0 until then) unless ``Run.step_timing``. full: True when every row
    refreshed. outputs: the extra forward outputs the plan's hooks asked for (``engine/hooks.py``),
    e.g. ``"attention"``. finished: (B,) bool rows that end at this step (set before the record is
    yielded; a consumer may add rows, e.g. at a stop string).
    """

    step: int
    block: torch.Tensor
    step_in_block: torch.Tensor
    rows: torch.Tensor
    refresh: torch.Tensor
    computed: torch.Tensor
    query_width: int
    targets: torch.Tensor
    valid: torch.Tensor
    committed: torch.Tensor
    x0: torch.Tensor
    prob: torch.Tensor
    entropy: torch.Tensor
    planned: torch.Tensor
    forward_s: float = 0.0
    decision_s: float = 0.0
    sampling_s: float = 0.0
    finished: torch.Tensor | None = None
    outputs: dict = field(default_factory=dict)

    @classmethod
    def of_step(cls, sampled, **fields) -> "StepRecord":
        """A record whose ``x0`` / ``prob`` / ``entropy`` are the step's sampled outputs
        (``decoding.sampling.Sampled``)."""
        return cls(x0=sampled.x0, prob=sampled.prob, entropy=sampled.entropy, **fields)

    @property
    def full(self) -> bool:
        return bool(self.refresh.all())

    @property
    def n_committed(self) -> torch.Tensor:
        """(B,) long tokens committed per row at this step."""
        return self.committed.sum(1)

    def signal(self, kind: str = "max-entropy") -> torch.Tensor:
        """(B,) float64 EntropyCache signal of the tokens committed at this step
        (arXiv 2603.18489; docs/METHOD.md §2.2).

        max-entropy: max entropy (nats); sum-entropy: their sum; max-confidence: 1 - min probability.
        Rows that committed nothing get -inf (max variants) or 0 (sum).
        """
        if kind == "max-entropy":
            return self.entropy.masked_fill(~self.committed, float("-inf")).amax(1)
        if kind == "sum-entropy":
            return self.entropy.masked_fill(~self.committed, 0.0).sum(1)
        if kind == "max-confidence":
            return (1.0 - self.prob).masked_fill(~self.committed, float("-inf")).amax(1)
        raise ValueError(f"unknown signal {kind!r}; use one of {', '.join(SIGNALS)}")
