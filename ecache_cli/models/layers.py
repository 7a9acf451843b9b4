"""Layers shared by every model family: RMSNorm, RoPE, attention over the KV store, SwiGLU.

Numerics follow the official modeling files (docs/MODELS.md §3.1, §3.2):
- RMSNorm normalises in float32, casts back to the activation dtype, *then* multiplies by the weight.
- RoPE is half-rotation (NeoX / HF-Llama style). LLaDA rotates q/k in float32
  (``rope_full_precision``); Dream casts cos/sin to the activation dtype and rotates in it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm with a weight vector and no bias; x: (..., d) -> (..., d), same dtype."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; in float32 it is the same arithmetic as below
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(dtype) * self.weight


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for RoPE, in the form :func:`apply_rope` takes.

    Args:
        positions: (B, T) long position ids.
    Returns:
        (cos, signed_sin), each (B, 1, T, head_dim) float32; inv_freq = theta^(-2j/head_dim) in float32,
        angle j and j + D/2 equal (half rotation). ``signed_sin`` is sin with its first half negated: the
        sign of rotate_half (−x2, x1) folded into the table, so a rotation is t·cos + roll(t)·signed_sin.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float()
                                / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
    sin = emb.sin()
    sin[..., :head_dim // 2].neg_()
    return emb.cos()[:, None], sin[:, None]


def apply_rope(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, full_precision: bool) -> torch.Tensor:
    """Rotate t (..., D) by half rotation (NeoX / HF-Llama ``rotate_half``) with the :func:`rope_tables`
    tables, float32, broadcast against t (e.g. t (B, H, S, D) with (B, 1, S, D)); returns t's dtype.

    t·cos + rotate_half(t)·sin with rotate_half(t) = (−t2, t1), computed as t·cos + (t2, t1)·signed_sin:
    the same products, negated exactly, so the same values in any dtype.
    """
    if full_precision:  # LLaDA: fp32 rotation, cast back
        tf = t if t.dtype == torch.float32 else t.float()
        out = tf * cos + tf.roll(t.shape[-1] // 2, -1) * signed_sin
        return out if out.dtype == t.dtype else out.to(t.dtype)
    cos, signed_sin = cos.to(t.dtype), signed_sin.to(t.dtype)  # Dream: tables cast to activation dtype
    return t * cos + t.roll(t.shape[-1] // 2, -1) * signed_sin


def gather_rows(x: torch.Tensor, idx: torch.Tensor | None, dim: int) -> torch.Tensor:
    """Select positions ``idx`` (B, S) along ``dim`` of x (B, ..., T, ...); None returns x."""
    if idx is None:
        return x
    if x.dim() == 2 and idx.shape[0] == x.shape[0]:  # (B, T) token ids, one index row per row: as it is
        return x.gather(dim, idx)
    shape = [1] * x.dim()
    shape[0], shape[dim] = idx.shape
    index = idx.view(shape).expand(*[s if i != dim else idx.shape[1] for i, s in enumerate(x.shape)])
    return x.gather(dim, index)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
    """Bidirectional attention of the computed queries over every canvas position.

    Args:
        q: (B, H, S, D); k, v: (B, H_kv, T, D) from the store; attn_mask: (B, 1, 1, T) bool (True =
        attend) or None. Pad keys are masked, pad queries are not (their outputs are never used), so
        no row is fully masked (docs/MODELS.md §1.4).
    Returns:
        (B, S, H*D).
    """
    gqa = k.shape[1] != q.shape[1]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)  # (B, H, S, D)
    B, H, S, D = o.shape
    return o.transpose(1, 2).reshape(B, S, H * D)


def swiglu(x: torch.Tensor, gate: nn.Linear, up: nn.Linear, down: Callable) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)); x: (B, S, d) -> (B, S, d). ``down``: the down projection or its forward."""
    return down(F.silu(gate(x)) * up(x))


def swiglu_fused(x: torch.Tensor, gate_up: torch.Tensor, down: Callable) -> torch.Tensor:
    """swiglu with gate's and up's weights stacked as ``gate_up`` (2M, d): one matmul for both branches."""
    a, b = F.linear(x, gate_up).chunk(2, dim=-1)  # (B, S, M) each
    return down(F.silu(a) * b)


def fuse_rows(params: list[nn.Parameter]) -> torch.Tensor:
    """Concatenate ``params`` along dim 0 and make each parameter a view of its rows; returns the whole
    (one matmul then computes every projection; the parameters keep their names and shapes)."""
    whole = torch.cat([t.detach() for t in params])
    start = 0
    for t in params:
        t.data = whole[start:start + t.shape[0]]
        start += t.shape[0]
    return whole


class SwiGLU(nn.Module):
    """A SwiGLU feed-forward, ``down(silu(gate(x)) * up(x))``, under the Hugging Face names ``gate_proj``,
    ``up_proj``, ``down_proj`` (no biases); x (..., d) -> (..., d). A dense layer's MLP (its projections
    are then the layer's ``BlockParts`` roles) or one expert of a mixture (``models/moe.py``)."""

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


class Attention(nn.Module):
    """The Hugging Face decoder layout's attention projections under their official names: ``q_proj``,
    ``k_proj``, ``v_proj`` (with biases when ``bias``: Qwen2/Dream), ``o_proj``, and with ``qk_norm`` the
    per-head RMSNorms ``q_norm`` / ``k_norm`` (weights (head_dim,), eps ``eps``: OLMoE/LLaDA-MoE, Qwen3/SDAR).
    Holds parameters only; ``models/base.py`` computes with them (``BlockParts``)."""

    def __init__(self, d: int, n_heads: int, n_kv_heads: int, head_dim: int, bias: bool, qk_norm: bool, eps: float):
        super().__init__()
        self.q_proj = nn.Linear(d, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
