"""KVStore: K and V of every layer for every canvas position, plus the per-request position facts.

The store only stores. The model writes the K/V of the positions it computes (``write``) and reads the
full tensors back for attention; cache policies never touch it. K is stored *after* RoPE: canvas
positions never move during a request, so rotating once at write time is exact and saves the
re-rotation of the whole key sequence that Fast-dLLM does on every call (docs/MODELS.md §3.4).

Rows in place. Every per-row tensor of a store (K, V, hidden states, padding mask, RoPE positions and
tables) is the prefix ``[0:B]`` of a buffer with room for ``capacity`` rows, allocated once per
layer. Rows join by being written into the free slots after ``B`` (:meth:`KVStore.add_rows`,
:meth:`KVStore.append_rows`; the buffers grow by doubling only when full) and leave by moving the
rows that stay into the slots below ``K`` (:meth:`KVStore.select_rows`), so the live rows' tensors
keep their addresses and a join or a leave copies only the rows that move, never every row of
every layer. ``KVStore.ROW_FIELDS`` names the per-row fields for copies (:meth:`KVStore.take_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .contract import rows as row_fields
from .contract.rows import ROW

#: the per-row fields kept in row buffers (``attn_mask`` is a view of ``key_mask``'s)
_BUFFERED = ("k", "v", "hidden", "key_mask", "positions", "rope")


@dataclass
class KVStore:
    """Per-request key/value store.

    Attributes:
        k, v: one tensor per layer, (B, H_kv, T, D), model dtype, K after RoPE: the live rows
            ``[0:B]`` of one buffer per layer (module docstring), so a view; write into it in place.
        key_mask: (B, T) bool, True for real tokens, False for left padding (masked as keys).
        positions: (B, T) long RoPE position ids, ``cumsum(key_mask) - 1`` with pads at 0, so a row's
            real tokens get the same positions alone or left-padded inside a batch.
        attn_mask: (B, 1, 1, T) bool for SDPA (a view of ``key_mask``), or None when the batch has no
            padding (faster kernel).
        rope: (cos, signed_sin) tables (``models.layers.rope_tables``) filled by the model on first use,
            each (B, 1, T, D) float32; None until then, and again after rows joined without tables of
            their own (the model rebuilds them).
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
        block: the block size of block-causal attention (block-diffusion families: a query at position
            p sees the keys at positions q with q // block ≤ p // block, blocks counted from each row's
            first real token), or None for bidirectional attention (docs/MODELS.md §10).
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
    #: the most rows expected at once (e.g. a server's --max-batch): full buffers grow by doubling up to
    #: it, past it only as far as the joining rows need; None: doubling without a bound
    max_rows: int | None = field(default=None)
    block: int | None = field(default=None)
    # per buffered field: (buffers, the views of their live rows handed out as the field's tensors)
    _buffers: dict = field(default_factory=dict, repr=False, compare=False)
    # (idx, H_kv, T, flat index) of the last partial write: the layers of one forward share their idx
    _write_index: tuple | None = field(default=None, repr=False, compare=False)

    @classmethod
    def allocate(
        cls,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        key_mask: torch.Tensor,
        dtype: torch.dtype,
        keep_hidden: int | None = None,
        capacity: int | None = None,
        block: int | None = None,
    ) -> "KVStore":
        """Allocate an empty (zero) store for a (B, T) canvas whose padding is given by ``key_mask`` (B, T)
        bool (copied: the store moves its rows in place).

        ``keep_hidden`` = d_model to also keep every layer's input hidden states (for layer-selective
        recomputation); None keeps none. ``capacity``: rows to allocate room for (default B; at least B),
        so rows can join without a reallocation (:meth:`add_rows`). ``block``: block-causal attention's
        block size (the class docstring), None for bidirectional. Memory: 2 * layers * capacity *
        H_kv * T * D elements.
        """
        B, T = key_mask.shape
        cap = max(B, capacity or 0)
        dev = key_mask.device
        k = [torch.zeros(cap, n_kv_heads, T, head_dim, dtype=dtype, device=dev) for _ in range(n_layers)]
        v = [torch.zeros_like(t) for t in k]
        mask = torch.zeros(cap, T, dtype=torch.bool, device=dev)
        mask[:B] = key_mask
        positions = (mask.long().cumsum(1) - 1).clamp_min(0)  # (cap, T)
        hidden = None
        if keep_hidden:
            hidden = [torch.zeros(cap, T, keep_hidden, dtype=dtype, device=dev) for _ in range(n_layers)]
        store = cls(k=k, v=v, key_mask=mask, positions=positions, attn_mask=None, hidden=hidden, block=block)
        for name, bufs in (("k", k), ("v", v), ("key_mask", [mask]), ("positions", [positions]), ("hidden", hidden)):
            if bufs is not None:
                store._put(name, bufs, B)
        store.attn_mask = None if bool(key_mask.all()) else store.key_mask[:, None, None, :]  # (B, 1, 1, T)
        return store

    @property
    def n_layers(self) -> int:
        return len(self.k)

    @property
    def batch(self) -> int:
        """Live rows B."""
        return self.key_mask.shape[0]

    @property
    def capacity(self) -> int:
        """Rows the K/V buffers hold room for (>= B) before a join must reallocate them."""
        bufs, views = self._buffers.get("k", ((), ()))
        return bufs[0].shape[0] if views and views[0] is self.k[0] else self.batch

    def write(self, layer: int, idx: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of the computed positions of one layer.

        Args:
            idx: (B, S) long canvas positions, or None when every position was computed (full forward).
                The flat index built from it is kept for the next write with the same tensor (a forward's
                layers): pass a new tensor for new positions, never the same one changed in place.
            k, v: (B, H_kv, S, D). Duplicate positions in a row must carry identical values.
        """
        if idx is None:
            self.k[layer].copy_(k)
            self.v[layer].copy_(v)
            return
        kb, vb = self.k[layer], self.v[layer]
        B, H, S, D = k.shape
        if not (kb.is_contiguous() and vb.is_contiguous()):
            index = idx[:, None, :, None].expand(-1, H, -1, D)  # (B, H_kv, S, D)
            kb.scatter_(2, index, k)
            vb.scatter_(2, index, v)
            return
        # one row copy per (row, head, position) into the (B·H_kv·T, D) view: cheaper than a scatter of
        # every element; the flat index is built once per forward (every layer writes the same idx tensor)
        T = kb.shape[2]
        cached = self._write_index
        if cached is None or cached[0] is not idx or cached[1:3] != (H, T):
            base = torch.arange(B * H, device=idx.device).view(B, H, 1) * T  # (B, H_kv, 1)
            cached = self._write_index = (idx, H, T, (base + idx[:, None, :]).reshape(-1))  # (B·H_kv·S,)
        kb.view(-1, D).index_copy_(0, cached[3], k.reshape(-1, D))
        vb.view(-1, D).index_copy_(0, cached[3], v.reshape(-1, D))

    def write_hidden(self, layer: int, idx: torch.Tensor | None, h: torch.Tensor) -> None:
        """Keep the input hidden states (B, S, d) of ``layer`` at positions ``idx`` (B, S) or all."""
        if self.hidden is None:
            return
        if idx is None:
            self.hidden[layer].copy_(h)
        else:
            self.hidden[layer].scatter_(1, idx[:, :, None].expand(-1, -1, h.shape[-1]), h)

    def write_span(self, row: int, start: int, kv: torch.Tensor) -> None:
        """Write ``kv`` (2, L, H_kv, n, D), keys (after RoPE) and values of every layer, into batch row
        ``row`` at positions [start, start + n) (e.g. a prompt's prefix kept from another request)."""
        n = kv.shape[3]
        for layer in range(self.n_layers):
            self.k[layer][row, :, start:start + n] = kv[0, layer]
            self.v[layer][row, :, start:start + n] = kv[1, layer]

    def read_span(self, row: int, start: int, n: int) -> torch.Tensor:
        """(2, L, H_kv, n, D) a copy of batch row ``row``'s keys and values at positions [start, start + n)."""
        return torch.stack([torch.stack([t[row, :, start:start + n] for t in kv]) for kv in (self.k, self.v)])

    #: the per-row fields (not ``queries``, ``shrunk``, ``produced``: they belong to the last forward's batch)
    ROW_FIELDS = {name: ROW for name in ("k", "v", "key_mask", "positions", "attn_mask", "rope", "hidden")}

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only batch rows ``keep`` (K,) long, distinct, in that order (finished rows stop costing
        memory traffic and compute), in place: row ``keep[j]`` moves to slot ``j`` of every buffer, and
        only the rows whose slot changes are copied (reads which those are: one device sync)."""
        K = keep.numel()
        dst = (keep != torch.arange(K, device=keep.device)).nonzero().squeeze(1)  # slots that get another row
        src = keep[dst]
        for name, _, bufs in self._each():
            if dst.numel():
                for buf in bufs:
                    buf.index_copy_(0, dst, buf.index_select(0, src))  # read first: moves may overlap
            self._put(name, bufs, K)
        if self.attn_mask is not None:
            self.attn_mask = self.key_mask[:, None, None, :]
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
            block=self.block,
        )

    def take_rows(self, rows: torch.Tensor) -> "KVStore":
        """A copy of batch rows ``rows`` (R,) long: their K/V (and hidden states when kept), padding mask,
        RoPE positions and tables, for a forward of those rows only that reads what is cached (one
        ``index_select`` per tensor, no device sync). Copy the result back with
        :meth:`put_rows`."""
        return KVStore(**row_fields.take(self, self.ROW_FIELDS, rows), block=self.block)

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
        """Append the rows of ``sub`` (rows taken earlier, or a store of joining rows) after this store's
        rows, written into its free slots: every K/V, hidden state, padding mask, RoPE position and
        table. A field missing on either side (RoPE tables, hidden states) is dropped (the next forward
        rebuilds RoPE tables); the attention mask is kept when either side has padding."""
        n = sub.batch
        B, need = self.batch, self.batch + n
        masked = self.attn_mask is not None or sub.attn_mask is not None
        for name, _, bufs in self._each():
            other = getattr(sub, name)
            if other is None:
                setattr(self, name, None)
                self._buffers.pop(name, None)
                continue
            bufs = self._room(bufs, B, need)
            for buf, t in zip(bufs, [other] if isinstance(other, torch.Tensor) else other):
                buf[B:need].copy_(t)
            self._put(name, bufs, need)
        self.attn_mask = self.key_mask[:, None, None, :] if masked else None
        self.queries = self.shrunk = self.produced = None

    def add_rows(self, key_mask: torch.Tensor) -> None:
        """Append ``n`` fresh rows whose padding is ``key_mask`` (n, T) bool: zero K/V (and hidden
        states), their padding mask and RoPE positions, written into the free slots after the live rows
        (the buffers grow only when full). The RoPE tables are dropped (the next forward rebuilds them)."""
        B, need = self.batch, self.batch + key_mask.shape[0]
        masked = self.attn_mask is not None or not bool(key_mask.all())
        self.rope = None
        self._buffers.pop("rope", None)
        for name, _, bufs in self._each():
            bufs = self._room(bufs, B, need)
            for buf in bufs:
                if name == "key_mask":
                    buf[B:need] = key_mask
                elif name == "positions":
                    buf[B:need] = (key_mask.long().cumsum(1) - 1).clamp_min(0)
                else:
                    buf[B:need].zero_()
            self._put(name, bufs, need)
        self.attn_mask = self.key_mask[:, None, None, :] if masked else None
        self.queries = self.shrunk = self.produced = None

    def reserve(self, rows: int) -> None:
        """Make room for ``rows`` rows in every buffer (a no-op when there is), so that many can be live
        without a reallocation; the live rows keep their values (a grown buffer is a new allocation)."""
        B = self.batch
        for name, _, bufs in self._each():
            self._put(name, [self._grow(b, B, rows) if b.shape[0] < rows else b for b in bufs], B)
        if self.attn_mask is not None:
            self.attn_mask = self.key_mask[:, None, None, :]

    # -- the row buffers ---------------------------------------------------------------------------------

    def _each(self):
        """(name, live tensors, their buffers) of every buffered per-row field present. A field whose
        tensor is not the view this store handed out (set from outside, e.g. RoPE tables the model
        built, or a store built from tensors) is first copied into a buffer of the store's own, with
        room for its rows alone: rows never move inside memory the store may share."""
        for name in _BUFFERED:
            value = getattr(self, name)
            if value is None:
                continue
            live = [value] if isinstance(value, torch.Tensor) else list(value)
            bufs, views = self._buffers.get(name, ((), ()))
            known = len(views) == len(live) and all(t is w for t, w in zip(live, views))
            yield name, live, list(bufs) if known else [t.clone(memory_format=torch.contiguous_format) for t in live]

    def _put(self, name: str, bufs: list[torch.Tensor], n: int) -> None:
        """Set field ``name`` to the first ``n`` rows of ``bufs`` (views) and remember both."""
        views = [b[:n] for b in bufs]
        self._buffers[name] = (bufs, views)
        value = getattr(self, name)
        setattr(self, name, views[0] if isinstance(value, torch.Tensor) else type(value)(views))

    def _room(self, bufs: list[torch.Tensor], B: int, need: int) -> list[torch.Tensor]:
        """``bufs`` with room for ``need`` rows: full ones grow by doubling (capped at ``max_rows``)."""
        out = []
        for b in bufs:
            cap = b.shape[0]
            if cap < need:
                grown = 2 * max(cap, 1) if self.max_rows is None else min(2 * max(cap, 1), self.max_rows)
                b = self._grow(b, B, max(need, grown))
            out.append(b)
        return out

    @staticmethod
    def _grow(buf: torch.Tensor, B: int, rows: int) -> torch.Tensor:
        """A new buffer of ``rows`` rows holding ``buf``'s first ``B`` (the rest zero)."""
        new = buf.new_zeros((rows, *buf.shape[1:]))
        new[:B] = buf[:B]
        return new

    def clone(self) -> "KVStore":
        """A deep copy of the live rows (used by measurement code that must not disturb the live store,
        whose rows move in place)."""
        key_mask = self.key_mask.clone()
        return KVStore(
            k=[t.clone() for t in self.k], v=[t.clone() for t in self.v], key_mask=key_mask,
            positions=self.positions.clone(), attn_mask=None if self.attn_mask is None else key_mask[:, None, None, :],
            rope=None if self.rope is None else (self.rope[0].clone(), self.rope[1].clone()),
            hidden=None if self.hidden is None else [t.clone() for t in self.hidden], max_rows=self.max_rows,
            block=self.block,
        )
