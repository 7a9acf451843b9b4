"""Dream-v0 (Dream-org/Dream-v0-Base-7B / -Instruct-7B): a bidirectional Qwen2.5 transformer.

State-dict names are Qwen2's (docs/MODELS.md §2.2): ``model.embed_tokens``, ``model.layers.{i}.
{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}``,
``model.norm``, ``lm_head``. q/k/v carry biases, attention is GQA, RoPE theta 1e6 with cos/sin cast
to the activation dtype. Dream was trained with shifted prediction: the hidden state at position
i-1 predicts token i (``spec.logit_shift == 1``, docs/MODELS.md §2.5).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import BlockParts, DiffusionLM
from .layers import RMSNorm
from .spec import ModelSpec


class _Attn(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        d, hd = s.d_model, s.head_dim
        self.q_proj = nn.Linear(d, s.n_heads * hd, bias=True)
        self.k_proj = nn.Linear(d, s.n_kv_heads * hd, bias=True)
        self.v_proj = nn.Linear(d, s.n_kv_heads * hd, bias=True)
        self.o_proj = nn.Linear(s.n_heads * hd, d, bias=False)


class _MLP(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(s.d_model, s.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(s.d_model, s.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(s.mlp_hidden, s.d_model, bias=False)


class DreamLayer(nn.Module):
    """One DreamDecoderLayer's parameters (official names)."""

    def __init__(self, s: ModelSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(s.d_model, s.rms_eps)
        self.self_attn = _Attn(s)
        self.post_attention_layernorm = RMSNorm(s.d_model, s.rms_eps)
        self.mlp = _MLP(s)
        a, m = self.self_attn, self.mlp
        self.parts = BlockParts(self.input_layernorm, a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                self.post_attention_layernorm, m.gate_proj, m.up_proj, m.down_proj)


class _DreamBase(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.d_model)
        self.layers = nn.ModuleList(DreamLayer(s) for _ in range(s.n_layers))
        self.norm = RMSNorm(s.d_model, s.rms_eps)


class Dream(DiffusionLM):
    """DreamModel equivalent; see :class:`DiffusionLM.forward` for the forward API."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = _DreamBase(spec)
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
