"""The forward pass shared by LLaDA and Dream: full and partial forwards over a KV store.

A family module (``llada.py``, ``dream.py``) only declares its parameters under the official
state-dict names and maps them onto the roles used here. The forward computes a chosen set of query
positions per row; every other position is read from the store. A full forward is the same call
with every position chosen. The model never decides what to recompute (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..engine.store import KVStore
from .layers import apply_rope, attend, gather_rows, rope_tables, swiglu
from .spec import ModelSpec


@dataclass
class BlockParts:
    """Roles of one transformer block's modules (names differ per family)."""

    attn_norm: nn.Module
    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    o: nn.Linear
    mlp_norm: nn.Module
    gate: nn.Linear
    up: nn.Linear
    down: nn.Linear


class DiffusionLM(nn.Module):
    """Base class: subclasses set ``spec`` and implement ``embed``, ``parts(i)``, ``final_norm``, ``head``."""

    spec: ModelSpec

    def parts(self, i: int) -> BlockParts:  # pragma: no cover - abstract
        raise NotImplementedError

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def head(self, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def new_store(self, key_mask: torch.Tensor, keep_hidden: bool = False) -> KVStore:
        """Allocate an empty :class:`KVStore` for a canvas with padding ``key_mask`` (B, T) bool."""
        s = self.spec
        dtype = next(self.parameters()).dtype
        return KVStore.allocate(s.n_layers, s.n_kv_heads, s.head_dim, key_mask, dtype, s.d_model if keep_hidden else None)

    def forward(
        self,
        tokens: torch.Tensor,
        store: KVStore,
        query_pos: torch.Tensor | None = None,
        logits_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compute ``query_pos`` at every layer against the store; return logits for ``logits_pos``.

        Args:
            tokens: (B, T) long canvas (prompt + generated positions, left padded).
            store: the request's :class:`KVStore`; K/V of the computed positions are written into it.
            query_pos: (B, S) long absolute positions to compute, or None for all T (full forward).
                Duplicates within a row are allowed (they write identical K/V).
            logits_pos: (B, R) long absolute positions whose hidden states produce logits; each must be
                among the row's ``query_pos``. None = every query position.
        Gradients flow when called outside ``torch.inference_mode`` (training uses a full forward with a
        fresh store); the engine calls it under inference mode.

        Returns:
            logits (B, R, V) in the model dtype. Row r is the output of the hidden state at
            ``logits_pos[:, r]``; with ``spec.logit_shift == 1`` (Dream) it predicts token
            ``logits_pos + 1``, otherwise token ``logits_pos`` itself.
        """
        s = self.spec
        if store.rope is None:
            store.rope = rope_tables(store.positions, s.head_dim, s.rope_theta)  # (B, 1, T, D) x2
        cos, sin = (gather_rows(t, query_pos, 2) for t in store.rope)  # (B, 1, S, D)
        x = self.embed(gather_rows(tokens, query_pos, 1))  # (B, S, d)
        B, S, _ = x.shape
        for i in range(s.n_layers):
            p = self.parts(i)
            store.write_hidden(i, query_pos, x)
            h = p.attn_norm(x)
            q = p.q(h).view(B, S, s.n_heads, s.head_dim).transpose(1, 2)  # (B, H, S, D)
            k = p.k(h).view(B, S, s.n_kv_heads, s.head_dim).transpose(1, 2)  # (B, H_kv, S, D)
            v = p.v(h).view(B, S, s.n_kv_heads, s.head_dim).transpose(1, 2)
            q = apply_rope(q, cos, sin, s.rope_full_precision)
            k = apply_rope(k, cos, sin, s.rope_full_precision)
            store.write(i, query_pos, k, v)
            x = x + p.o(attend(q, store.k[i], store.v[i], store.attn_mask))  # (B, S, d)
            x = x + swiglu(p.mlp_norm(x), p.gate, p.up, p.down)
        if logits_pos is not None:
            x = gather_rows(x, self._rows_of(logits_pos, query_pos, tokens.shape[1]), 1)  # (B, R, d)
        return self.head(self.final_norm(x))  # (B, R, V)

    @staticmethod
    def _rows_of(logits_pos: torch.Tensor, query_pos: torch.Tensor | None, T: int) -> torch.Tensor:
        """Map absolute positions (B, R) to their row index in ``query_pos`` (B, S)."""
        if query_pos is None:
            return logits_pos
        B, S = query_pos.shape
        inv = torch.zeros(B, T, dtype=torch.long, device=query_pos.device)
        inv.scatter_(1, query_pos, torch.arange(S, device=query_pos.device).expand(B, S))
        return inv.gather(1, logits_pos)
