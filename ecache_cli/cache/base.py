"""The cache-policy interface: a policy decides which positions the next forward computes.

A policy never computes, never stores and never knows the model family. Before every forward the
engine calls ``plan(state)``; after the step's commits it calls ``observe(state, record)``. The plan
is per row: rows that refresh recompute every position (and so rewrite their whole KV store);
the other rows compute only ``compute`` and read everything else from the store. The positions
whose logits the step needs (the current block's masked positions, moved by the model's logit
shift: ``state.sources``) must be in ``compute``; ``targets_and_sources`` gives them.

Capabilities: a policy that needs more than logits declares it with class attributes, and the engine
asks the model for it (the model never inspects the policy): ``needs_values`` (layer-0 value vectors
of the canvas beside the cached ones, in ``state.value_probe`` before ``plan``), ``needs_attention``
(head-averaged attention rows of the positions ``ForwardPlan.attn_rows`` marks, in
``record.attention``), ``needs_hidden`` (the store keeps every layer's input hidden states, for
``ForwardPlan.start_layer``). The engine counts the time of these extras as decision time.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..engine.state import DecodeState, StepRecord
from ..engine.store import append_rows_to, rows_of


@dataclass(frozen=True)
class ForwardPlan:
    """refresh: (B,) bool rows that run a full forward. compute: (B, T) bool positions to compute
    for the other rows (ignored for refreshing rows; may be None when every row refreshes).
    start_layer: (B,) long or None; a non-refreshing row computes every position from that layer on
    (layer-selective recomputation; ≥ n_layers = never; needs ``needs_hidden``). attn_rows: (B, T) bool
    or None; computed positions whose attention rows the policy wants in ``record.attention`` (needs
    ``needs_attention``)."""

    refresh: torch.Tensor
    compute: torch.Tensor | None = None
    start_layer: torch.Tensor | None = None
    attn_rows: torch.Tensor | None = None

    @classmethod
    def full(cls, state: DecodeState) -> "ForwardPlan":
        return cls(refresh=torch.ones(state.batch, dtype=torch.bool, device=state.tokens.device))


class CachePolicy:
    """Base class. Subclasses set ``name`` and override ``plan`` (and ``observe`` if they learn).

    Decisions are per row: a row's plan depends on that row alone, counted in its own steps
    (``state.own_steps()``, never the batch's ``state.step``), so a prompt decodes the same in any batch.
    Per-row bookkeeping kept as tensor attributes with the batch as first dimension is dropped for
    finished rows by ``select_rows`` and set aside / restored for parked rows by ``take_rows`` /
    ``append_rows`` automatically.
    """

    name = "base"
    needs_values = False  # engine fills state.value_probe before plan
    needs_attention = False  # engine fills record.attention for plan.attn_rows
    needs_hidden = False  # store keeps per-layer input hidden states (for plan.start_layer)

    def reset(self, state: DecodeState) -> None:
        """Called once per request before the first step."""

    def plan(self, state: DecodeState) -> ForwardPlan:  # pragma: no cover - abstract
        raise NotImplementedError

    def observe(self, state: DecodeState, record: StepRecord) -> None:
        """Called after the step's tokens are committed."""

    def _row_tensors(self, batch: int) -> dict:
        """The per-row tensor attributes: every tensor attribute whose first dim is ``batch``."""
        return {k: v for k, v in vars(self).items()
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch}

    def select_rows(self, keep: torch.Tensor, batch: int) -> None:
        """Keep rows ``keep`` (K,) of every per-row tensor attribute (first dim == ``batch``)."""
        for k, v in self._row_tensors(batch).items():
            setattr(self, k, v[keep])

    def take_rows(self, rows: torch.Tensor, batch: int) -> dict:
        """Rows ``rows`` (K,) long of every per-row tensor attribute, copied, for :meth:`append_rows` (the
        engine parks a row that waits for the others, so its bookkeeping only moves on at its own steps)."""
        return rows_of(self._row_tensors(batch), rows)

    def append_rows(self, taken: dict) -> None:
        """Append rows taken by :meth:`take_rows` after the current rows (one ``torch.cat`` per attribute)."""
        append_rows_to(self, taken)

    @staticmethod
    def targets_and_sources(state: DecodeState) -> torch.Tensor:
        """(B, T) bool: the current block's masked positions and the positions whose logits predict them."""
        t = state.block_masked()
        return t | state.sources(t)

    @staticmethod
    def span(state: DecodeState, start: int, end: int) -> torch.Tensor:
        """(B, T) bool, True on canvas positions [start, end)."""
        m = torch.zeros_like(state.masked)
        m[:, max(start, 0):end] = True
        return m

    def params(self) -> dict:
        """The policy's hyperparameters (for records and manifests)."""
        if hasattr(self, "__dataclass_fields__"):
            return {f.name: getattr(self, f.name) for f in fields(self)}
        return {}
