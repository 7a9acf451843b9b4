"""The cache-policy interface: a policy decides which positions the next forward computes.

A policy never computes, never stores and never knows the model family (docs/ARCHITECTURE.md,
"Policy contract"). Before every forward the engine calls ``plan(state)``; after the step's commits it
calls ``observe(state, record)``. The plan is per row: rows that refresh recompute every position
(and so rewrite their whole KV store); the other rows compute only ``compute`` and read everything
else from the store. The positions whose logits the step needs (each row's current-block masked
positions, moved by the model's logit shift: ``state.sources``) must be in ``compute``;
``targets_and_sources`` gives them. Anything more a policy needs from the model it asks for through
the plan's ``hooks`` (``engine/hooks.py``) or, before planning, through ``state.probe``.

Per-row state: a policy declares its per-row attributes in ``row_state`` (name → :class:`PerRow`);
the engine keeps, drops and appends exactly those when rows finish or join (``engine/rows.py``).
``reset(state)`` initialises them for the rows of ``state``; a joining row gets what ``reset`` gives
it alone (:meth:`CachePolicy.add_rows`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from ..contract import rows as row_fields
from ..contract.hooks import ForwardHooks
from ..contract.rows import PerRow
from ..contract.state import DecodeState, StepRecord
from ..errors import UsageError


@dataclass(slots=True)  # built every step: a slotted class builds in a third of a frozen one's time
class ForwardPlan:
    """refresh: (B,) bool rows that run a full forward. compute: (B, T) bool positions to compute
    for the other rows (ignored for refreshing rows; None when every row refreshes). hooks: what the
    forward must do beyond computing ``compute`` at every layer (``engine/hooks.py``), or None."""

    refresh: torch.Tensor
    compute: torch.Tensor | None = None
    hooks: ForwardHooks | None = None

    @classmethod
    def full(cls, state: DecodeState) -> "ForwardPlan":
        return cls(refresh=torch.ones(state.batch, dtype=torch.bool, device=state.tokens.device))


class CachePolicy:
    """Base class. Subclasses set ``name``, declare ``row_state`` and override ``plan`` (and ``reset`` /
    ``observe`` if they keep state).

    Decisions are per row: a row's plan depends on that row alone, counted in its own steps
    (``state.own_steps()``, ``state.step_in_block``), so a prompt decodes the same in any batch and a
    row may join a running batch. ``keeps_hidden``: the KV store must keep every layer's input hidden
    states (for ``ForwardHooks.grow_from_layer`` and shrink functions that read ``LayerView.cached``).

    Two declarations let the test suite cover every registered policy from its own file:
    ``forced_refresh``, the parameters under which every step is a full forward (the policy must then
    decode exactly as ``none``), or None when it has no such setting; ``test_params``, parameters under
    which it computes partial forwards inside a 16-token answer in blocks of 8 (the suite's
    batch == alone and joining-row checks).
    """

    name: ClassVar[str] = "base"
    #: the attention the policy is made for: "bidirectional" (the approximate caches), "block-causal" (the exact
    #: cache of finished blocks) or "any" (``none``); ``check_model`` refuses a model of the other kind
    attention: ClassVar[str] = "bidirectional"
    row_state: ClassVar[dict[str, PerRow]] = {}
    keeps_hidden: ClassVar[bool] = False
    forced_refresh: ClassVar[dict | None] = None
    test_params: ClassVar[dict] = {}
    ranges: ClassVar[dict] = {}  # name → contract.fields.Range of each numeric parameter

    def check_model(self, spec) -> None:
        """UsageError when this policy does not apply to a model with ``spec`` (a ``ModelSpec``: its
        ``block_causal`` and ``family``): the approximate policies need bidirectional attention, ``block``
        block-causal attention (docs/METHOD.md, "Block diffusion"). The message names the family and the
        policies that apply. The engine calls it before a run starts."""
        kind = "block-causal" if spec.block_causal else "bidirectional"
        if self.attention in ("any", kind):
            return
        from . import policies_for

        fits = policies_for(spec.block_causal)
        why = ("its attention is block-causal, so the keys and values of finished blocks are cached exactly"
               if spec.block_causal else "its attention is bidirectional: no block is ever finished for attention")
        use = " or ".join(fits) if len(fits) <= 2 else "one of " + ", ".join(fits)
        raise UsageError(f"--cache {self.name} does not apply to the {spec.family} model family ({why}); use {use}")

    def reset(self, state: DecodeState) -> None:
        """Initialise the per-row state for the rows of ``state`` (called before their first step)."""

    def plan(self, state: DecodeState) -> ForwardPlan:  # pragma: no cover - abstract
        raise NotImplementedError

    def observe(self, state: DecodeState, record: StepRecord) -> None:
        """Called after the step's tokens are committed."""

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep`` (K,) long of every declared per-row attribute."""
        row_fields.keep(self, self.row_state, keep)

    def append_rows(self, taken: dict) -> None:
        """Append rows (``{attribute: value}`` of ``row_state``) after the current rows."""
        row_fields.append(self, self.row_state, taken)

    def add_rows(self, state: DecodeState) -> None:
        """Append the per-row state of new rows, whose decode state is ``state``: what ``reset`` gives
        them alone (a copy of the policy is reset on their rows; its per-row attributes are appended)."""
        fresh = copy.copy(self)
        fresh.reset(state)
        self.append_rows({name: getattr(fresh, name) for name in self.row_state})

    @staticmethod
    def targets_and_sources(state: DecodeState) -> torch.Tensor:
        """(B, T) bool: each row's current-block masked positions and the positions whose logits predict them."""
        t = state.block_masked()
        return t if state.logit_shift == 0 else t | state.sources(t)  # LLaDA: each position predicts itself

    @staticmethod
    def span(state: DecodeState, start, end) -> torch.Tensor:
        """(B, T) bool, True on canvas positions [start, end) (ints or (B,) long tensors)."""
        return state.span(start, end)

    def params(self) -> dict:
        """The policy's hyperparameters (for records and manifests)."""
        if hasattr(self, "__dataclass_fields__"):
            return {f.name: getattr(self, f.name) for f in fields(self)}
        return {}


class ReusedPrefix:
    """A policy whose plans leave uncomputed the prompt positions a prefix store gave a row
    (``DecodeState.reused_span``): the keys and values written there when the row joined stay frozen
    for the whole request. Every other attribute and call is the wrapped policy's.

    The rule, per row: a refresh becomes a forward of every position but those (``refresh`` False,
    ``compute`` = the row's real positions outside the span), and a partial plan drops them from its
    ``compute``; the positions whose logits the step needs and any attention rows the hooks request are
    always computed. On block-causal attention this is exact: a whole prompt block's keys and values
    depend only on the blocks up to it, so the stored ones are what the row would compute (``block``
    never recomputes them either). On bidirectional attention it is an approximation (a prompt's keys
    and values depend on the whole canvas they were computed with), the one of bicache (arXiv
    2606.07571): a shared prefix is encoded once and read by every request that starts with it.
    A policy that keeps hidden states (``keeps_hidden``) gets no reuse: its layer-selective
    recomputation would read hidden states the store never had (``wraps`` says so).

    ``frozen`` False applies the rule to a row's first step only: its later refreshes recompute the
    reused positions in its own canvas (less approximate on bidirectional attention, and less saved;
    ``bench/prefix_reuse.py`` measures both).
    """

    def __init__(self, policy, frozen: bool = True):
        self.inner, self.frozen = policy, frozen
        self._memo = None  # (state.reused, frozen span (B, T), rows with reuse (B,), any of them): per batch

    @staticmethod
    def wraps(policy) -> bool:
        """Whether ``policy`` can run with reused prefix positions (it keeps no hidden states)."""
        return not getattr(policy, "keeps_hidden", False)

    def __getattr__(self, name):
        if name == "inner":  # not set yet (a copy under construction): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def plan(self, state: DecodeState) -> ForwardPlan:
        """The wrapped policy's plan with the reused positions of every row left out (class docstring)."""
        plan = self.inner.plan(state)
        if state.reused is None:
            return plan
        memo = self._memo
        if memo is None or memo[0] is not state.reused:  # rows joined or left (the tensor is replaced): one sync
            frozen = state.reused_span()  # (B, T) bool
            memo = self._memo = (state.reused, frozen, frozen.any(1), bool(state.reused.any()))
        _, frozen, hit, any_hit = memo
        if not any_hit:
            return plan
        if not self.frozen:
            hit = hit & (state.row_step == 0)
        hooks = plan.hooks
        keep = self.targets_and_sources(state)
        if hooks is not None and hooks.attention_rows is not None:
            keep = keep | hooks.attention_rows
        own = state.key_mask if plan.compute is None else torch.where(plan.refresh[:, None], state.key_mask,
                                                                      plan.compute)
        compute = torch.where(hit[:, None], own & ~frozen | keep, own)
        return ForwardPlan(refresh=plan.refresh & ~hit, compute=compute, hooks=hooks)
