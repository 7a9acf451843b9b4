"""The forward pass shared by every model family: full and partial forwards over a KV store.

A family module (``models/families/<name>.py``) only declares its parameters under the official
state-dict names and maps them onto the roles used here (:class:`BlockParts`: norms, projections,
per-head q/k norms, a dense SwiGLU or a mixture of experts). The forward computes a chosen set of query
positions per row; every other position is read from the store. A full forward is the same call with
every position chosen. The model never decides what to recompute (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

from ..contract.hooks import ForwardHooks, LayerView, Shrink
from ..contract.rows import padded_index
from ..kvstore import KVStore
from .layers import RMSNorm, apply_rope, attend, fuse_rows, gather_rows, rope_tables, swiglu, swiglu_fused
from .spec import ModelSpec


@dataclass
class BlockParts:
    """Roles of one transformer block's modules (names differ per family).

    A dense block has ``gate``, ``up`` and ``down`` (SwiGLU); a mixture-of-experts block has ``moe``
    instead, a module mapping normed inputs (..., d) to the feed-forward output (..., d) (``models/moe.py``).
    ``q_norm`` / ``k_norm``: per-head RMSNorms (weights (head_dim,)) applied to q and k before RoPE, or
    None. A checkpoint that stores q, k and v as one matrix (LLaDA2's ``query_key_value``, rows: the query
    heads, then the key heads, then the value heads) gives that projection as ``q`` and None as ``k`` and
    ``v``."""

    attn_norm: nn.Module
    q: nn.Linear
    k: nn.Linear | None
    v: nn.Linear | None
    o: nn.Linear
    mlp_norm: nn.Module
    gate: nn.Linear | None = None
    up: nn.Linear | None = None
    down: nn.Linear | None = None
    moe: nn.Module | None = None
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    qkv: torch.Tensor | None = None  # (H*D + 2*H_kv*D, d) rows of q, k, v's weights (fuse_projections)
    qkv_bias: torch.Tensor | None = None  # (H*D + 2*H_kv*D,) or None
    gate_up: torch.Tensor | None = None  # (2*mlp_hidden, d) rows of gate's then up's weight

    @property
    def mlp_out(self) -> nn.Module:
        """The module whose output ends the feed-forward: ``down``, or the MoE block."""
        return self.down if self.moe is None else self.moe

    def fused(self) -> bool:
        """True while the fused weights still hold the projections' parameters (a dtype or device move
        gives the parameters storage of their own: the forward then runs the projections one by one).
        Compiled forwards (``--compile``) read it once, when traced (``models/compiled.py`` marks it a
        constant result; marking it here would import torch's compiler with every model)."""
        return (self.qkv is not None and self.q.weight.data_ptr() == self.qkv.data_ptr()
                and (self.moe is not None or self.gate.weight.data_ptr() == self.gate_up.data_ptr()))

    def calls(self) -> tuple[Callable, Callable, Callable, Callable]:
        """attn_norm, o, mlp_norm and the feed-forward's last part (``down``, or the MoE block) as callables
        x -> y: the modules' own ``forward`` methods while no hook would run on calling them, otherwise the
        modules (so that hooks fire: the profiler's layer ranges, tests that watch a layer's input). Either
        gives the same numbers; the methods skip ``nn.Module.__call__``'s dispatch, ~2 µs a call (a tenth of
        a narrow partial forward's time outside matmuls and attention on the embedded model)."""
        mods = (self.attn_norm, self.o, self.mlp_norm, self.mlp_out)
        if _hooks_would_run(mods):
            return mods
        return tuple(m.forward for m in mods)


def _hooks_would_run(modules: tuple[nn.Module, ...]) -> bool:
    """True when calling any of ``modules`` would do more than its ``forward``: a forward or backward hook
    of its own or a global one, or TorchScript tracing (the test ``nn.Module._call_impl`` makes before
    its fast path), a module compiled on its own (``Module.compile``) or a class with a ``__call__`` of
    its own."""
    if (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
            or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks
            or torch._C._get_tracing_state()):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               or m._compiled_call_impl is not None or type(m).__call__ is not nn.Module.__call__
               for m in modules)


class DiffusionLM(nn.Module):
    """Base class: subclasses set ``spec`` and implement ``embed``, ``parts(i)``, ``final_norm``, ``head``.

    Forward API, ``model(tokens, store, query_pos=None, logits_pos=None, expand_from_layer=None,
    attn_pos=None, shrink=None, logits_rows=None, pack=None)``:

    Args:
        tokens: (B, T) long canvas (prompt + generated positions, left padded).
        store: the request's :class:`KVStore`; K/V of the computed positions are written into it.
        query_pos: (B, S) long absolute positions to compute, or None for all T (full forward).
            Duplicates within a row are allowed (they write identical K/V).
        logits_pos: (B, R) long absolute positions whose hidden states produce logits; each must be
            among the row's ``query_pos``. None = every query position, in ``query_pos`` order.
        expand_from_layer: layer-selective recomputation (Elastic-Cache): an int for every row, or
            (B,) per row; from that layer on the row computes *every* position, taking the layer
            inputs of the positions outside ``query_pos`` from ``store.hidden`` (the store must keep
            hidden states; layer 0 re-embeds the canvas instead). Values ≥ n_layers (or None) mean
            no expansion; 0 equals a full forward for that row.
        attn_pos: (B, A) long positions (computed at every layer) whose post-RoPE queries are kept
            in ``store.queries`` for :meth:`attention_rows`; None keeps nothing.
        shrink: a ``contract.hooks.Shrink`` or a sequence of them: at its layer (partial forwards
            only) each sees the layer inputs of the positions still computed and keeps a subset
            (always with ``attn_pos``, and with ``logits_pos`` unless its ``keep_logits`` is False);
            the others are not computed from that layer on, their K/V there being read from the
            store (early skipping, ES-dLLM). Shrinks run in the order of their layers; each one's
            host sync reads the kept width. What they kept is left in ``store.shrunk``, and which
            ``logits_pos`` reached the last layer in ``store.produced`` (the logits of the others
            are meaningless).
        logits_rows: (B, R) bool, or None for all: the ``logits_pos`` entries whose logits are
            needed. The final norm and the LM head run on those alone (a batch's padded targets
            cost nothing there); the other entries' logits are zeros.
        pack: (order (N,) long, unpack (B*S,) long) from ``contract.rows.packed_rows`` for a padded
            ``query_pos``: the per-position work (norms, projections, MLP) runs on the N real
            entries alone, packed into one list, and only attention sees the padded (B, S) layout
            (a batch whose rows want different widths pays for the real ones). The same numbers as
            without it, row for row; ignored with ``expand_from_layer``, ``attn_pos``, ``shrink``
            or a store that keeps hidden states.
    Gradients flow when called outside ``torch.inference_mode`` (training uses a full forward with a
    fresh store); the engine calls it under inference mode.

    Returns:
        logits (B, R, V) in the model dtype. Row r is the output of the hidden state at
        ``logits_pos[:, r]``; with ``spec.logit_shift == 1`` (Dream) it predicts token
        ``logits_pos + 1``, otherwise token ``logits_pos`` itself.
    """

    spec: ModelSpec
    quantization = None  # the blocks' weights' ``models/quantize.Quantization`` (load_model's quantize), or None
    packs_rows = True  # forward takes ``pack`` (the engine packs a batch's padded partial forwards)

    def parts(self, i: int) -> BlockParts:  # pragma: no cover - abstract
        raise NotImplementedError

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def head(self, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Lay each block's q, k, v weights (and biases) out as one matrix, and gate and up as another,
        so that a layer runs two matmuls where it ran five (fewer, larger operations per step).

        The parameters keep their names and shapes: each becomes a view of its rows of the fused
        matrix (``BlockParts.qkv``, ``qkv_bias``, ``gate_up``), so state dicts, weight loading and
        forward hooks on the norms and output projections are unchanged; the projections' own
        forward hooks no longer fire. Outputs are the same matmuls' rows: in float32 each output
        element is the same dot product. Layers whose weights are quantized (tensor subclasses,
        ``models/quantize.py``) are left unfused. Call outside ``torch.inference_mode`` (the views become the
        parameters' storage); a later ``.to()`` of the model undoes the fusion (see ``BlockParts.fused``).
        """
        for i in range(self.spec.n_layers):
            p = self.parts(i)
            if type(p.q.weight) is not nn.Parameter or p.k is None:  # quantized (models/quantize.py), or q, k, v
                continue  # stored as one projection already: runs module by module
            p.qkv = fuse_rows([p.q.weight, p.k.weight, p.v.weight])
            if p.q.bias is not None:
                p.qkv_bias = fuse_rows([p.q.bias, p.k.bias, p.v.bias])
            if p.moe is None:
                p.gate_up = fuse_rows([p.gate.weight, p.up.weight])
            elif hasattr(p.moe, "fuse"):
                p.moe.fuse()

    def routers(self) -> list:
        """The mixture-of-experts blocks (``models/moe.py`` ``SparseMoE``), one per MoE layer in layer order
        (empty for a dense model): set a block's ``routes`` to a list to record its expert choices."""
        out = []
        for p in self._block_parts():
            moe = p.moe
            moe = getattr(moe, "routed", moe)  # a routed block wrapped with a shared expert
            if moe is not None:
                out.append(moe)
        return out

    def _block_parts(self) -> list[BlockParts]:
        """Every layer's :class:`BlockParts`, looked up once (``parts(i)`` walks the family's module tree)."""
        found = self.__dict__.get("_parts_list")
        if found is None:
            found = self.__dict__["_parts_list"] = [self.parts(i) for i in range(self.spec.n_layers)]
        return found

    def new_store(self, key_mask: torch.Tensor, keep_hidden: bool = False, block: int | None = None) -> KVStore:
        """Allocate an empty :class:`KVStore` for a canvas with padding ``key_mask`` (B, T) bool; ``block``:
        the block size of block-causal attention (``KVStore.block``), None for bidirectional."""
        s = self.spec
        dtype = next(self.parameters()).dtype
        return KVStore.allocate(s.n_layers, s.n_kv_heads, s.head_dim, key_mask, dtype,
                                s.d_model if keep_hidden else None, block=block)

    def forward(
        self,
        tokens: torch.Tensor,
        store: KVStore,
        query_pos: torch.Tensor | None = None,
        logits_pos: torch.Tensor | None = None,
        expand_from_layer: int | list[int] | torch.Tensor | None = None,
        attn_pos: torch.Tensor | None = None,
        shrink: Shrink | Sequence[Shrink] | None = None,
        logits_rows: torch.Tensor | None = None,
        pack: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Compute ``query_pos`` at every layer against the store; return logits for ``logits_pos``: (B, R, V)
        in the model dtype. The arguments and the result: the class docstring ("Forward API").
        """
        s = self.spec
        T = tokens.shape[1]
        if store.rope is None:
            store.rope = rope_tables(store.positions, s.head_dim if s.rotary_dim is None else s.rotary_dim,
                                     s.rope_theta)  # (B, 1, T, D_rot) x2
        starts = self._starts(expand_from_layer, tokens.shape[0]) if query_pos is not None else None
        shrinks = () if shrink is None or query_pos is None else ForwardHooks(shrink=shrink).shrinks
        if pack is not None and (query_pos is None or starts is not None or attn_pos is not None or shrinks
                                 or store.hidden is not None):
            pack = None
        store.queries = [] if attn_pos is not None else None
        store.shrunk, store.produced = ([] if shrinks else None), None
        loop = _Loop(self.embed, tokens, store, query_pos, attn_pos, pack, T)
        for i, p in enumerate(self._block_parts()):
            for sh in shrinks:
                if sh.layer == i and loop.idx is not None:
                    required = (logits_pos, attn_pos) if sh.keep_logits else (attn_pos,)
                    loop.move(*self._shrink(store, i, loop.x, loop.idx, sh, required, T))  # (B, S', d)
            if starts is not None and loop.idx is not None and i in starts:
                loop.move(*self._expand(tokens, store, i, loop.x, loop.idx, [st <= i for st in starts]))
            self._layer(i, p, loop)
        return self._logits(loop.unpacked(), loop.idx, query_pos, logits_pos, logits_rows, store, T)

    def _layer(self, i: int, p: BlockParts, loop: "_Loop") -> None:
        """One transformer block over the loop's computed positions: pre-norm attention against the whole
        store (this layer's K/V of the computed positions written first), then the pre-norm feed-forward
        (SwiGLU, or the block's mixture of experts); updates ``loop.x`` in place of the residual stream."""
        store, x, pack = loop.store, loop.x, loop.pack
        fused = p.fused()
        attn_norm, o, mlp_norm, mlp_out = p.calls()
        store.write_hidden(i, loop.idx, x)
        q, k, v = self._attention_inputs(p, attn_norm(x), loop.cos, loop.sin, fused,
                                         loop.idx.shape if pack else None, pack[1] if pack else None)
        store.write(i, loop.idx, k, v)
        if loop.attn_pos is not None:
            store.queries.append(gather_rows(q, self._rows_of(loop.attn_pos, loop.idx, loop.T), 2))  # (B, H, A, D)
        a = attend(q, store.k[i], store.v[i], loop.attn_mask)  # (B, S, H*D)
        x = x + o(a if pack is None else a.reshape(-1, a.shape[-1])[pack[0]])  # (B, S, d) or packed (N, d)
        h = mlp_norm(x)
        if p.moe is not None:
            x = x + mlp_out(h)
        else:
            x = x + (swiglu_fused(h, p.gate_up, mlp_out) if fused else swiglu(h, p.gate, p.up, mlp_out))
        loop.x = x

    def _logits(self, x: torch.Tensor, idx: torch.Tensor | None, query_pos: torch.Tensor | None,
                logits_pos: torch.Tensor | None, logits_rows: torch.Tensor | None, store: KVStore,
                T: int) -> torch.Tensor:
        """The final norm and LM head over the last layer's output ``x`` (B, S, d) at ``logits_pos`` (see
        :meth:`forward`); ``idx``: the positions x holds (None = all T)."""
        if logits_pos is None and idx is not query_pos:  # expanded: still the logits of query_pos
            logits_pos = query_pos
        if logits_pos is not None:
            rows = self._rows_of(logits_pos, idx, T)  # (B, R)
            if store.shrunk and idx is not None:  # a position not computed at the last layer maps to row 0
                store.produced = idx.gather(1, rows) == logits_pos  # (B, R)
            x = gather_rows(x, rows, 1)  # (B, R, d)
        if logits_rows is None:
            return self.head(self.final_norm(x))  # (B, R, V)
        packed = self.head(self.final_norm(x[logits_rows]))  # (K, V), K = the needed entries
        out = packed.new_zeros((*logits_rows.shape, packed.shape[-1]))  # (B, R, V)
        out[logits_rows] = packed
        return out

    def _attention_inputs(self, p: BlockParts, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool,
                          shape: tuple[int, int] | None = None, unpack: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of one layer from its normed input h (B, S, d) (``fused``: ``p.fused()``, one matmul
        for the three projections): q (B, H, S, D) and k (B, H_kv, S, D)
        rotated by cos/sin (B, 1, S, D), v (B, H_kv, S, D); contiguous slices of one (B, H + 2 H_kv, S, D)
        tensor (the attention kernel is slower on strided queries). q and k are rotated together: RoPE
        acts on each head's vector alone. A packed h (N, d) (``forward``'s ``pack``) comes with the
        padded ``shape`` (B, S) and ``unpack`` (B*S,) long, which restore the padded layout after the
        projection."""
        s = self.spec
        B, S = h.shape[:2] if shape is None else shape
        H, Hk, D = s.n_heads, s.n_kv_heads, s.head_dim
        if fused:
            qkv = F.linear(h, p.qkv, p.qkv_bias)  # (B, S, (H + 2 H_kv) D), or packed (N, ...)
        elif p.k is None:  # the checkpoint's own fused projection
            qkv = p.q(h)
        else:
            qkv = torch.cat([p.q(h), p.k(h), p.v(h)], -1)
        if unpack is not None:
            qkv = qkv[unpack]  # (B*S, (H + 2 H_kv) D)
        qkv = qkv.view(B, S, H + 2 * Hk, D).transpose(1, 2).contiguous()  # (B, H + 2 H_kv, S, D)
        qk, v = qkv[:, :H + Hk], qkv[:, H + Hk:]
        if p.q_norm is not None:  # per-head RMSNorm of q and k before RoPE
            qk = torch.cat([p.q_norm(qk[:, :H]), p.k_norm(qk[:, H:])], 1)
        if s.clip_qkv is not None:
            qk, v = qk.clamp(-s.clip_qkv, s.clip_qkv), v.clamp(-s.clip_qkv, s.clip_qkv)
        if s.rotary_dim is None:
            qk = apply_rope(qk, cos, sin, s.rope_full_precision)
        elif s.rotary_dim:  # partial rotary: the first rotary_dim dimensions of each head turn, the rest do not
            qk = torch.cat([apply_rope(qk[..., :s.rotary_dim], cos, sin, s.rope_full_precision),
                            qk[..., s.rotary_dim:]], -1)
        return qk[:, :H], qk[:, H:], v

    def _starts(self, expand_from_layer, B: int) -> list[int] | None:
        """Per-row start layers as a Python list (one sync for a tensor), or None when no row expands."""
        if expand_from_layer is None:
            return None
        if isinstance(expand_from_layer, int):
            starts = [expand_from_layer] * B
        elif isinstance(expand_from_layer, torch.Tensor):
            starts = expand_from_layer.tolist()
        else:
            starts = list(expand_from_layer)
        starts = [max(int(st), 0) for st in starts]
        return starts if min(starts) < self.spec.n_layers else None

    def _expand(self, tokens: torch.Tensor, store: KVStore, i: int, x: torch.Tensor, idx: torch.Tensor,
                grow: list[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Switch rows ``grow`` to computing every position from layer ``i`` on.

        The layer-``i`` input of every position is the cached one (``store.hidden[i]``; at layer 0 the
        embedding of the current canvas) overwritten by this forward's ``x`` at ``idx``. Rows that do not
        grow keep their positions, padded to T by repeating their first one. Returns (x, idx): (B, T, d)
        and (B, T) long, or idx None when every row grows.
        """
        B, S, d = x.shape
        T = tokens.shape[1]
        if i == 0:
            full = self.embed(tokens)  # (B, T, d)
        else:
            if store.hidden is None:
                raise ValueError("expand_from_layer > 0 needs a store with hidden states: new_store(keep_hidden=True)")
            full = store.hidden[i].clone()  # (B, T, d) cached layer inputs
        full.scatter_(1, idx[:, :, None].expand(-1, -1, d), x)  # this forward's positions are fresh
        if all(grow):
            return full, None
        rows = torch.tensor(grow, device=x.device)[:, None]  # (B, 1)
        pad = torch.cat([idx, idx[:, :1].expand(B, T - S)], 1)  # (B, T)
        new_idx = torch.where(rows, torch.arange(T, device=x.device).expand(B, T), pad)
        return full.gather(1, new_idx[:, :, None].expand(-1, -1, d)), new_idx

    @staticmethod
    def _shrink(store: KVStore, i: int, x: torch.Tensor, idx: torch.Tensor, shrink: Shrink, required,
                T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the positions ``shrink`` chooses at layer ``i`` (plus every position in ``required``:
        (B, R) long tensors or None). Returns (x, idx) of the kept positions, (B, S', d) and (B, S') long,
        in their order in ``idx``, each row padded by repeating its first kept position (padding entries
        of ``idx``, repeats of the row's first position, are never kept twice). Appends
        (i, S', kept (B,) long) to ``store.shrunk``."""
        cached = None if store.hidden is None else gather_rows(store.hidden[i], idx, 1)
        keep = shrink(LayerView(layer=i, x=x, positions=idx, cached=cached)).clone()  # (B, S) bool
        need = torch.zeros(idx.shape[0], T, dtype=torch.bool, device=idx.device)
        for pos in required:
            if pos is not None:
                need.scatter_(1, pos, True)
        keep |= need.gather(1, idx)
        S = idx.shape[1]
        real = (torch.arange(S, device=idx.device) == 0) | (idx != idx[:, :1])  # (B, S) not padding
        keep &= real
        order, _ = padded_index(keep)  # (B, S') indices into the S computed positions
        store.shrunk.append((i, order.shape[1], keep.sum(1)))
        return gather_rows(x, order, 1), idx.gather(1, order)

    def probe_values(self, tokens: torch.Tensor) -> torch.Tensor:
        """Layer-0 value vectors of the canvas: v_proj(attn_norm(embed(tokens))), (B, T, H_kv*D).

        One norm and one matmul over all positions (dLLM-Cache's similarity probe); compare with the
        cached ``store.v[0]`` (B, H_kv, T, D) transposed to the same layout. Writes nothing.
        """
        p = self.parts(0)
        return p.v(p.attn_norm(self.embed(tokens)))  # (B, T, H_kv*D)

    def attention_rows(self, store: KVStore) -> list[torch.Tensor]:
        """Attention probabilities of the rows the last forward kept (``attn_pos``), one tensor per layer.

        softmax(q·Kᵀ/√D) over every canvas position with padding keys masked, computed in float32 apart
        from the fused attention (which never returns weights), averaged over heads: (B, A, T) float32,
        each row summing to 1. K is the store's, as the forward's attention read it.
        """
        if store.queries is None:
            raise ValueError("attention_rows needs a forward called with attn_pos")
        s = self.spec
        out = []
        for i, q in enumerate(store.queries):
            B, H, A, D = q.shape
            k = store.k[i]  # (B, H_kv, T, D)
            Hk = k.shape[1]
            qg = q.float().view(B, Hk, H // Hk, A, D)  # GQA: query heads grouped per KV head
            scores = qg @ k.float()[:, :, None].transpose(-1, -2) / s.head_dim ** 0.5  # (B, H_kv, g, A, T)
            if store.attn_mask is not None:
                scores = scores.masked_fill(~store.attn_mask[:, :, None], float("-inf"))
            out.append(scores.softmax(-1).mean((1, 2)))  # (B, A, T)
        return out

    @staticmethod
    def _rows_of(logits_pos: torch.Tensor, query_pos: torch.Tensor | None, T: int) -> torch.Tensor:
        """Map absolute positions (B, R) to their row index in ``query_pos`` (B, S)."""
        if query_pos is None:
            return logits_pos
        B, S = query_pos.shape
        inv = torch.zeros(B, T, dtype=torch.long, device=query_pos.device)
        inv.scatter_(1, query_pos, torch.arange(S, device=query_pos.device).expand(B, S))
        return inv.gather(1, logits_pos)




class _Decoder(nn.Module):
    def __init__(self, s: ModelSpec, layer: Callable[[ModelSpec, int], nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.d_model)
        self.layers = nn.ModuleList(layer(s, i) for i in range(s.n_layers))
        self.norm = RMSNorm(s.d_model, s.rms_eps)


class DecoderLayout(DiffusionLM):
    """A :class:`DiffusionLM` in the Hugging Face decoder layout most families share: ``model.embed_tokens``,
    ``model.layers[i]`` (``layer_class(spec, i)``, each with a ``parts`` :class:`BlockParts`), ``model.norm``
    (RMSNorm), and ``lm_head`` unless the embeddings are tied. A subclass sets ``layer_class``."""

    layer_class: Callable[[ModelSpec, int], nn.Module]

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = _Decoder(spec, type(self).layer_class)
        if not spec.tie_embeddings:
            self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)

    def parts(self, i: int) -> BlockParts:
        return self.model.layers[i].parts

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "lm_head"):
            return self.lm_head(h)
        return h @ self.model.embed_tokens.weight.T

def attention_mask(store: KVStore, query_pos: torch.Tensor | None) -> torch.Tensor | None:
    """The attention mask of queries at ``query_pos`` (B, S) long (None: every position) over the store's
    keys: the store's padding mask (B, 1, 1, T) bool (None without padding) for bidirectional attention;
    with ``store.block`` set, block-causal (docs/MODELS.md §10): (B, 1, S, T) bool, True where the key is
    real and its block (its RoPE position // block) is not after the query's, as the official SDAR and
    LLaDA2 code build it (a left-padded row's blocks start at its first real token)."""
    if store.block is None:
        return store.attn_mask
    kb = torch.div(store.positions, store.block, rounding_mode="floor")  # (B, T)
    qb = kb if query_pos is None else kb.gather(1, query_pos)  # (B, S)
    return ((kb[:, None, :] <= qb[:, :, None]) & store.key_mask[:, None, :])[:, None]  # (B, 1, S, T)


class _Loop:
    """The layer loop's moving state: the residual stream ``x`` of the computed positions ``idx`` ((B, S)
    long, None = all T), their RoPE tables, and the forward's fixed inputs. With ``pack`` (order, unpack)
    x is the (N, d) list of real entries (``forward``'s ``pack``) until :meth:`unpacked`."""

    def __init__(self, embed, tokens, store: KVStore, query_pos, attn_pos, pack, T: int):
        self.store, self.attn_pos, self.pack, self.T = store, attn_pos, pack, T
        self.idx = query_pos
        self.cos, self.sin = (gather_rows(t, query_pos, 2) for t in store.rope)  # (B, 1, S, D)
        self.attn_mask = attention_mask(store, query_pos)
        x = embed(gather_rows(tokens, query_pos, 1))  # (B, S, d) the computed positions' embeddings
        self.shape = x.shape
        if pack is not None:
            B, S, d = x.shape
            x = x.reshape(B * S, d)[pack[0]]  # (N, d) the real query entries
        self.x = x

    def move(self, x: torch.Tensor, idx: torch.Tensor | None) -> None:
        """Continue with other positions (a shrink or an expansion): their states and RoPE tables."""
        self.x, self.idx = x, idx
        self.cos, self.sin = (gather_rows(t, idx, 2) for t in self.store.rope)
        self.attn_mask = attention_mask(self.store, idx)

    def unpacked(self) -> torch.Tensor:
        """The last layer's output in the padded (B, S, d) layout."""
        if self.pack is None:
            return self.x
        return self.x[self.pack[1]].view(self.shape)
