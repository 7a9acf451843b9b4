"""KVStore: K and V of every layer for every canvas position, plus the per-request position facts.

The store only stores. The model writes the K/V of the positions it computes (``write``) and reads the
full tensors back for attention; cache policies never touch it. K is stored *after* RoPE: canvas
positions never move during a request, so rotating once at write time is exact and saves the
re-rotation of the whole key sequence that Fast-dLLM does on every call (docs/MODELS.md §3.4).

Rows leave, are copied out and join through ``engine/rows.py`` (``KVStore.ROW_FIELDS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .contract import rows as row_fields
from .contract.rows import ROW


@dataclass
class KVStore:
    """Per-request key/value store.

    Attributes:
        k, v: one tensor per layer, (B, H_kv, T, D), model dtype, K after RoPE.
        key_mask: (B, T) bool, True for real tokens, False for left padding (masked as keys).
        positions: (B, T) long RoPE position ids, ``cumsum(key_mask) - 1`` with pads at 0, so a row's
            real tokens get the same positions alone or left-padded inside a batch.
        attn_mask: (B, 1, 1, T) bool for SDPA, or None when the batch has no padding (faster kernel).
        rope: (cos, signed_sin) tables (``models.layers.rope_tables``) filled by the model on first use,
            each (B, 1, T, D).
        hidden: optional per-layer *input* hidden states (B, T, d) of every position as last computed
            (``keep_hidden``), read by layer-selective recomputation (``expand_from_layer``).
        queries: per-layer post-RoPE queries (B, H, R, D) of the rows a forward was asked to keep
            (``attn_pos``), or None; overwritten by every forward, read by ``model.attention_rows``.
        shrunk: what the last forward's shrinks (``contract.hooks.Shrink``) kept, one
            (layer, width, kept) per shrink applied: from that layer on the forward computed ``width``
            query rows (padding included), ``kept`` (B,) long of them real positions; None when the
            last forward applied none. Overwritten by every forward.
        produced: (B, R) bool, which of the last forward's ``logits_pos`` reached the last layer (a
            shrink with ``keep_logits=False`` may drop some: their logits rows are meaningless);
            None when it produced all of them. Overwritten by every forward.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    key_mask: torch.Tensor
    positions: torch.Tensor
    attn_mask: torch.Tensor | None
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    hidden: list[torch.Tensor] | None = field(default=None)  # optional per-layer inputs (B, T, d)
    queries: list[torch.Tensor] | None = field(default=None)  # per-layer (B, H, R, D) of the last forward
    shrunk: list[tuple[int, int, torch.Tensor]] | None = field(default=None)  # the last forward's shrinks
    produced: torch.Tensor | None = field(default=None)  # (B, R) bool logits the last forward produced

    @classmethod
    def allocate(
        cls,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        key_mask: torch.Tensor,
        dtype: torch.dtype,
        keep_hidden: int | None = None,
    ) -> "KVStore":
        """Allocate an empty store for a (B, T) canvas whose padding is given by ``key_mask`` (B, T) bool.

        ``keep_hidden`` = d_model to also keep every layer's input hidden states (for layer-selective
        recomputation); None keeps none. Memory: 2 * layers * B * H_kv * T * D elements.
        """
        B, T = key_mask.shape
        dev = key_mask.device
        k = [torch.zeros(B, n_kv_heads, T, head_dim, dtype=dtype, device=dev) for _ in range(n_layers)]
        v = [torch.zeros_like(t) for t in k]
        positions = (key_mask.long().cumsum(1) - 1).clamp_min(0)  # (B, T)
        attn_mask = None if bool(key_mask.all()) else key_mask[:, None, None, :]  # (B, 1, 1, T)
        hidden = None
        if keep_hidden:
            hidden = [torch.zeros(B, T, keep_hidden, dtype=dtype, device=dev) for _ in range(n_layers)]
        return cls(k=k, v=v, key_mask=key_mask, positions=positions, attn_mask=attn_mask, hidden=hidden)

    @property
    def n_layers(self) -> int:
        return len(self.k)

    def write(self, layer: int, idx: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of the computed positions of one layer.

        Args:
            idx: (B, S) long canvas positions, or None when every position was computed (full forward).
            k, v: (B, H_kv, S, D). Duplicate positions in a row must carry identical values.
        """
        if idx is None:
            self.k[layer].copy_(k)
            self.v[layer].copy_(v)
            return
        H, D = k.shape[1], k.shape[3]
        index = idx[:, None, :, None].expand(-1, H, -1, D)  # (B, H_kv, S, D)
        self.k[layer].scatter_(2, index, k)
        self.v[layer].scatter_(2, index, v)

    def write_hidden(self, layer: int, idx: torch.Tensor | None, h: torch.Tensor) -> None:
        """Keep the input hidden states (B, S, d) of ``layer`` at positions ``idx`` (B, S) or all."""
        if self.hidden is None:
            return
        if idx is None:
            self.hidden[layer].copy_(h)
        else:
            self.hidden[layer].scatter_(1, idx[:, :, None].expand(-1, -1, h.shape[-1]), h)

    #: the per-row fields (not ``queries``, ``shrunk``, ``produced``: they belong to the last forward's batch)
    ROW_FIELDS = {name: ROW for name in ("k", "v", "key_mask", "positions", "attn_mask", "rope", "hidden")}

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only batch rows ``keep`` (K,) long (finished rows stop costing memory and compute)."""
        row_fields.keep(self, self.ROW_FIELDS, keep)
        self.queries = self.shrunk = self.produced = None

    def scratch_rows(self, rows: torch.Tensor) -> "KVStore":
        """A store for batch rows ``rows`` (R,) long with *uninitialised* K/V (and hidden states when
        kept): for a full forward of those rows only, which writes every position before reading any.
        Padding mask, RoPE positions and tables are the rows' own (no device sync). Copy the result back
        with :meth:`put_rows`."""
        k = [t.new_empty((len(rows), *t.shape[1:])) for t in self.k]
        hidden = None if self.hidden is None else [t.new_empty((len(rows), *t.shape[1:])) for t in self.hidden]
        return KVStore(
            k=k, v=[torch.empty_like(t) for t in k], key_mask=self.key_mask[rows], positions=self.positions[rows],
            attn_mask=None if self.attn_mask is None else self.attn_mask[rows],
            rope=None if self.rope is None else (self.rope[0][rows], self.rope[1][rows]), hidden=hidden,
        )

    def take_rows(self, rows: torch.Tensor) -> "KVStore":
        """A copy of batch rows ``rows`` (R,) long: their K/V (and hidden states when kept), padding mask,
        RoPE positions and tables, for a forward of those rows only that reads what is cached (one
        ``index_select`` per tensor, no device sync). Copy the result back with
        :meth:`put_rows`."""
        return KVStore(**row_fields.take(self, self.ROW_FIELDS, rows))

    def put_rows(self, rows: torch.Tensor, sub: "KVStore") -> None:
        """Overwrite batch rows ``rows`` (R,) long with every K/V (and hidden state) of ``sub``, a store of
        R rows made by :meth:`scratch_rows` or :meth:`take_rows` (one ``index_copy_`` per tensor, no
        device sync)."""
        for dst, src in zip(self.k + self.v, sub.k + sub.v):
            dst.index_copy_(0, rows, src)
        if self.hidden is not None and sub.hidden is not None:
            for dst, src in zip(self.hidden, sub.hidden):
                dst.index_copy_(0, rows, src)

    def append_rows(self, sub: "KVStore") -> None:
        """Append the rows of ``sub`` (rows taken earlier, or a new store for joining rows) after this
        store's rows: every K/V, hidden state, padding mask, RoPE position and table. RoPE tables missing
        on either side are dropped (the next forward rebuilds them); an attention mask missing on one
        side (no padding there) is made all-True first."""
        if (self.attn_mask is None) != (sub.attn_mask is None):
            self.attn_mask, sub.attn_mask = (m if m is not None else torch.ones_like(km)[:, None, None, :]
                                             for m, km in ((self.attn_mask, self.key_mask),
                                                           (sub.attn_mask, sub.key_mask)))
        row_fields.append(self, self.ROW_FIELDS, {name: getattr(sub, name) for name in self.ROW_FIELDS})
        self.queries = self.shrunk = self.produced = None

    def clone(self) -> "KVStore":
        """A deep copy (used by measurement code that must not disturb the live store)."""
        return KVStore(
            k=[t.clone() for t in self.k], v=[t.clone() for t in self.v], key_mask=self.key_mask,
            positions=self.positions, attn_mask=self.attn_mask, rope=self.rope,
            hidden=None if self.hidden is None else [t.clone() for t in self.hidden],
        )
