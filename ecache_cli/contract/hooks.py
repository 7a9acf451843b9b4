"""The hook surface between a cache policy and the model: what a policy asks of one forward.

A policy decides; the model computes; the engine passes the request through without reading it,
except to group rows whose forwards differ in shape (``grow_from_layer``). The rule
(docs/ARCHITECTURE.md, "Hook surface"): a policy may ask a forward for

- positions per layer: ``grow_from_layer`` (rows compute every position from that layer on, the
  layer inputs of the positions they did not compute coming from the store's hidden states;
  Elastic-Cache) and ``shrink`` (at layer ``shrink.layer`` a policy function sees the layer's input
  states of the computed positions and keeps a subset; the others stop being computed and their
  deeper K/V are read from the store; several shrinks at increasing layers narrow the set in turn;
  ES-dLLM);
- extra outputs: ``attention_rows`` (head-averaged attention rows of chosen positions, per layer);
- before planning, reads of the model through ``state.probe`` (:class:`ModelProbe`).

This module imports nothing of ecache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class LayerView:
    """What a shrink function sees at its layer.

    layer: the layer index. x: (B, S, d) the layer's input hidden states of the computed positions.
    positions: (B, S) long their canvas positions (padded rows repeat a position). cached: (B, S, d) the
    same positions' inputs to this layer as last stored (``store.hidden[layer]``), or None when the
    store keeps no hidden states.
    """

    layer: int
    x: torch.Tensor
    positions: torch.Tensor
    cached: torch.Tensor | None


@dataclass(frozen=True)
class Shrink:
    """At ``layer``, keep only the positions ``keep(view, rows)`` marks: a (B, S) bool over ``view.positions``.

    ``keep`` gets the view and ``rows`` (B,) long, the policy's rows of the forward's batch rows (the
    engine applies shrinks in the forward of the whole batch, so row b is the policy's row b). Requested
    attention rows are always kept; the positions whose logits the forward returns are kept too unless
    ``keep_logits`` is False: then a dropped logit position gets no logits this step, and the forward
    reports which ones it produced (``KVStore.produced``), so the engine never samples or commits the
    others (ES-dLLM: a skipped position cannot be committed at that step).
    """

    layer: int
    keep: Callable[[LayerView, torch.Tensor], torch.Tensor]
    keep_logits: bool = True

    def __call__(self, view: LayerView) -> torch.Tensor:
        return self.keep(view, torch.arange(view.x.shape[0], device=view.x.device))


@dataclass(frozen=True)
class ForwardHooks:
    """A policy's requests for one forward, per row of the batch (all optional).

    grow_from_layer: (B,) long, from that layer on the row computes every position (≥ n_layers: never).
    attention_rows: (B, T) bool, computed positions whose head-averaged attention rows the step's record
        gets in ``record.outputs["attention"]`` as (positions (B, A) long, [per layer (B, A, T) float32]).
    shrink: a :class:`Shrink`, a tuple of them (applied in the order of their layers, each to the
        survivors of the ones before), or None. Shrinks act on partial forwards only.
    """

    grow_from_layer: torch.Tensor | None = None
    attention_rows: torch.Tensor | None = None
    shrink: Shrink | tuple[Shrink, ...] | None = None

    @property
    def shrinks(self) -> tuple[Shrink, ...]:
        """The requested shrinks as a tuple sorted by layer (empty when none)."""
        if self.shrink is None:
            return ()
        found = (self.shrink,) if isinstance(self.shrink, Shrink) else tuple(self.shrink)
        return tuple(sorted(found, key=lambda sh: sh.layer))


class ModelProbe:
    """The model, read before a step's plan (the time counts as the policy's decision time).

    ``layer_values(tokens)``: fresh layer-0 value vectors of a canvas, (B, T, H_kv*D);
    ``cached_values()``: the store's layer-0 values in the same layout. dLLM-Cache compares the two.
    """

    def __init__(self, model, store_of):
        self._model, self._store_of = model, store_of

    def layer_values(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._model.probe_values(tokens)

    def cached_values(self) -> torch.Tensor:
        return self._store_of().v[0].transpose(1, 2).flatten(2)
