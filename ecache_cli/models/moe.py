"""Mixture-of-experts feed-forward shared by the MoE families: SwiGLU experts run as grouped work.

A family's MoE block (``models/families/<name>.py``) declares its router under the official names and
implements :meth:`SparseMoE.route`; this module runs the chosen experts. The tokens' expert assignments
are sorted by expert, each expert runs one matmul pair over its contiguous slice of assigned tokens
(experts that received none are skipped), and the weighted outputs are summed back per token with
``index_add_`` in the activation dtype, as the official blocks accumulate them (docs/MODELS.md,
"LLaDA-MoE"). A partial forward passes only the positions it computes, so only those are routed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import fuse_rows


class SwiGLUExpert(nn.Module):
    """One expert: ``down(silu(gate(x)) * up(x))`` under the official names ``gate_proj``, ``up_proj``,
    ``down_proj`` (no biases); x (n, d) -> (n, d)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)
        self.gate_up: torch.Tensor | None = None  # (2*hidden, d) after fuse()

    def fuse(self) -> None:
        """Lay gate's and up's weights out as one matrix (one matmul for both branches); see
        ``DiffusionLM.fuse_projections``."""
        self.gate_up = fuse_rows([self.gate_proj.weight, self.up_proj.weight])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and self.gate_proj.weight.data_ptr() == self.gate_up.data_ptr():
            a, b = F.linear(x, self.gate_up).chunk(2, dim=-1)
        else:
            a, b = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(a) * b)


def run_experts(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """Σ_j weight[n, j] · experts[idx[n, j]](x[n]) for every token n, as grouped work.

    Args:
        x: (N, d) the tokens' normed inputs. idx: (N, k) long expert ids. weight: (N, k) in x's dtype.
        experts: the E expert modules.
    Returns:
        (N, d) in x's dtype. One host sync (the per-expert counts); each expert with assigned tokens runs
        once over them, the others not at all.
    """
    N, k = idx.shape
    flat = idx.reshape(-1)  # (N*k,) assignment a = n*k + j
    order = flat.argsort(stable=True)  # assignments grouped by expert, token order kept inside a group
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    token = order // k  # (N*k,) the token of each sorted assignment
    xs = x.index_select(0, token)  # (N*k, d)
    out = torch.empty_like(xs)
    start = 0
    for e, c in enumerate(counts):
        if c:
            out[start:start + c] = experts[e](xs[start:start + c])
            start += c
    out *= weight.reshape(-1).index_select(0, order)[:, None]
    return x.new_zeros(x.shape).index_add_(0, token, out)


class SparseMoE(nn.Module):
    """A mixture-of-experts feed-forward: ``route`` (the family's router) picks each token's experts and
    weights, :func:`run_experts` computes them.

    Subclasses set ``experts`` (an ``nn.ModuleList`` of :class:`SwiGLUExpert`) and implement
    :meth:`route`. ``routes``: set it to a list to record each forward's (N, k) expert ids (``trace-drift``
    and ``profile`` compare a cached forward's routing with a full one's); None records nothing.
    """

    routes: list | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover - abstract
        """(idx (N, k) long, weight (N, k) in x's dtype) for tokens x (N, d)."""
        raise NotImplementedError

    def fuse(self) -> None:
        """Fuse every expert's gate and up projections (:meth:`SwiGLUExpert.fuse`)."""
        for e in self.experts:
            e.fuse()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., d) -> (..., d): the routed experts' weighted sum."""
        x = h.reshape(-1, h.shape[-1])  # (N, d)
        idx, weight = self.route(x)
        if self.routes is not None:
            self.routes.append(idx)
        return run_experts(x, idx, weight, self.experts).view(h.shape)


class WithShared(nn.Module):
    """A routed MoE plus an always-on shared expert, ``routed(h) + shared(h)``, for a family whose
    checkpoint keeps the shared expert beside the MoE block (the two stay registered where the family
    declares them; this module only calls them)."""

    def __init__(self, routed: SparseMoE, shared: SwiGLUExpert):
        super().__init__()
        self.routed, self.shared = routed, shared

    def fuse(self) -> None:
        self.routed.fuse()
        self.shared.fuse()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.routed(h) + self.shared(h)
