"""Mixture-of-experts feed-forward shared by the MoE families: SwiGLU experts run as grouped work.

A family's MoE block (``models/families/<name>.py``) declares its router under the official names and
implements :meth:`SparseMoE.route`; this module runs the chosen experts. The tokens' expert assignments
are sorted by expert, the experts' stacked weights run over their contiguous slices as two grouped
matmuls (``torch.nn.functional.grouped_mm``; one matmul pair per expert where that is unavailable), and
the weighted outputs are summed back per token with ``index_add_`` in the activation dtype, as the
official blocks accumulate them (docs/MODELS.md §7.3). A partial forward passes only the positions it
computes, so only those are routed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import SwiGLU, fuse_rows


def stack_rows(params: list[nn.Parameter]) -> torch.Tensor:
    """Stack ``params`` (each (r, c)) into one (E, r, c) tensor and make each parameter a view of its slice;
    returns the whole (the parameters keep their names and shapes)."""
    whole = torch.stack([t.detach() for t in params])
    for e, t in enumerate(params):
        t.data = whole[e]
    return whole


def grouped_ok(x: torch.Tensor) -> bool:
    """Whether :func:`torch.nn.functional.grouped_mm` runs on x's device and dtype (CPU: every float dtype;
    CUDA: bfloat16)."""
    return hasattr(F, "grouped_mm") and (x.device.type == "cpu" or x.dtype == torch.bfloat16)


def run_experts(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, experts: nn.ModuleList,
                stacked: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Σ_j weight[n, j] · experts[idx[n, j]](x[n]) for every token n, as grouped work.

    Args:
        x: (N, d) the tokens' normed inputs. idx: (N, k) long expert ids. weight: (N, k) in x's dtype.
        experts: the E :class:`SwiGLU` modules. stacked: their weights as (gate_up (E, 2M, d),
            down (E, d, M)) (:meth:`SparseMoE.fuse`), or None.
    Returns:
        (N, d) in x's dtype. With ``stacked`` (and :func:`grouped_ok`) two grouped matmuls over the
        assignments sorted by expert (fixed shapes, no host sync: a compiled graph holds it whole; torch
        traces ``grouped_mm`` in bfloat16 only, so a compiled graph in another dtype runs every expert
        over every assignment and keeps each one's own rows, E/k times the work); otherwise each expert with
        assigned tokens runs once over its slice (one host sync for the counts). Each output row is the same
        dot products every way.
    """
    N, k = idx.shape
    flat = idx.reshape(-1)  # (N*k,) assignment a = n*k + j
    order = flat.argsort(stable=True)  # assignments grouped by expert, token order kept inside a group
    token = order // k  # (N*k,) the token of each sorted assignment
    xs = x.index_select(0, token)  # (N*k, d)
    counts = torch.bincount(flat, minlength=len(experts))  # (E,)
    tracing = torch.compiler.is_compiling()
    if stacked is not None and grouped_ok(x) and not (tracing and x.dtype != torch.bfloat16):
        gate_up, down = stacked
        ends = counts.cumsum(0).to(torch.int32)
        a, b = F.grouped_mm(xs, gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)  # (N*k, M) each
        out = F.grouped_mm(F.silu(a) * b, down.transpose(1, 2), offs=ends)  # (N*k, d)
    elif tracing:  # a compiled graph in a dtype grouped_mm's tracing refuses: fixed shapes, every expert on all
        chosen = flat.index_select(0, order)[:, None]  # (N*k, 1) each sorted assignment's expert
        out = torch.zeros_like(xs)
        for e, expert in enumerate(experts):
            out = torch.where(chosen == e, expert(xs), out)
    else:
        out = torch.empty_like(xs)
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c:
                out[start:start + c] = experts[e](xs[start:start + c])
                start += c
    out = out * weight.reshape(-1).index_select(0, order)[:, None]
    return x.new_zeros(x.shape).index_add_(0, token, out)


class SparseMoE(nn.Module):
    """A mixture-of-experts feed-forward: ``route`` (the family's router) picks each token's experts and
    weights, :func:`run_experts` computes them.

    Subclasses set ``experts`` (an ``nn.ModuleList`` of :class:`SwiGLU`) and implement
    :meth:`route`. ``routes``: set it to a list to record each forward's (N, k) expert ids (``trace-drift``
    and ``profile`` compare a cached forward's routing with a full one's); None records nothing.
    """

    routes: list | None = None
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # (gate_up (E, 2M, d), down (E, d, M)) after fuse()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover - abstract
        """(idx (N, k) long, weight (N, k) in x's dtype) for tokens x (N, d)."""
        raise NotImplementedError

    def fuse(self) -> None:
        """Lay the experts' weights out as two stacked tensors, gate and up rows of each expert together
        (E, 2M, d) and the down projections (E, d, M), each parameter a view of its slice: the experts then
        run as two grouped matmuls (:func:`run_experts`). A later dtype or device move gives the parameters
        storage of their own, and the experts run one by one again (:meth:`is_stacked`)."""
        rows = [t for e in self.experts for t in (e.gate_proj.weight, e.up_proj.weight)]
        gate_up = fuse_rows(rows).view(len(self.experts), -1, rows[0].shape[1])
        self.stacked = (gate_up, stack_rows([e.down_proj.weight for e in self.experts]))

    def is_stacked(self) -> bool:
        """Whether the stacked weights still hold the experts' parameters (compiled forwards read it once,
        when traced: ``models/compiled.py`` marks it a constant result, as ``BlockParts.fused``)."""
        if self.stacked is None:
            return False
        e0 = self.experts[0]
        return (e0.gate_proj.weight.data_ptr() == self.stacked[0].data_ptr()
                and e0.down_proj.weight.data_ptr() == self.stacked[1].data_ptr())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., d) -> (..., d): the routed experts' weighted sum."""
        x = h.reshape(-1, h.shape[-1])  # (N, d)
        idx, weight = self.route(x)
        if self.routes is not None:
            self.routes.append(idx)
        return run_experts(x, idx, weight, self.experts, self.stacked if self.is_stacked() else None).view(h.shape)


class WithShared(nn.Module):
    """A routed MoE plus an always-on shared expert, ``routed(h) + shared(h)``, for a family whose
    checkpoint keeps the shared expert beside the MoE block (the two stay registered where the family
    declares them; this module only calls them)."""

    def __init__(self, routed: SparseMoE, shared: SwiGLU):
        super().__init__()
        self.routed, self.shared = routed, shared

    def fuse(self) -> None:
        self.routed.fuse()
        self.shared.fuse()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.routed(h) + self.shared(h)
