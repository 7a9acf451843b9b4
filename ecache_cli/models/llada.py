"""LLaDA (GSAI-ML/LLaDA-8B-Base / -Instruct, LLaDA-1.5): a bidirectional Llama-like transformer.

State-dict names and shapes are those of the official safetensors (docs/MODELS.md §1.2):
``model.transformer.{wte, blocks.{i}.{attn_norm, q_proj, k_proj, v_proj, attn_out, ff_norm, ff_proj,
up_proj, ff_out}, ln_f, ff_out}``. ``ff_proj`` is the SiLU-gated branch (gate), ``up_proj`` the linear
branch, the block's ``ff_out`` the down projection; the top-level ``ff_out`` is the untied LM head.
No biases; RoPE theta 500000 applied in float32; logits aligned (logits[i] predict token i).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import BlockParts, DiffusionLM
from .layers import RMSNorm
from .spec import ModelSpec


class LLaDABlock(nn.Module):
    """One LLaDALlamaBlock's parameters (official names)."""

    def __init__(self, s: ModelSpec):
        super().__init__()
        d, hd = s.d_model, s.head_dim
        self.attn_norm = RMSNorm(d, s.rms_eps)
        self.q_proj = nn.Linear(d, s.n_heads * hd, bias=s.qkv_bias)
        self.k_proj = nn.Linear(d, s.n_kv_heads * hd, bias=s.qkv_bias)
        self.v_proj = nn.Linear(d, s.n_kv_heads * hd, bias=s.qkv_bias)
        self.attn_out = nn.Linear(s.n_heads * hd, d, bias=False)
        self.ff_norm = RMSNorm(d, s.rms_eps)
        self.ff_proj = nn.Linear(d, s.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(d, s.mlp_hidden, bias=False)
        self.ff_out = nn.Linear(s.mlp_hidden, d, bias=False)
        self.parts = BlockParts(self.attn_norm, self.q_proj, self.k_proj, self.v_proj, self.attn_out,
                                self.ff_norm, self.ff_proj, self.up_proj, self.ff_out)


class _LLaDAModel(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        t = nn.ModuleDict(dict(
            wte=nn.Embedding(s.vocab_size, s.d_model),
            blocks=nn.ModuleList(LLaDABlock(s) for _ in range(s.n_layers)),
            ln_f=RMSNorm(s.d_model, s.rms_eps),
        ))
        if not s.tie_embeddings:
            t["ff_out"] = nn.Linear(s.d_model, s.vocab_size, bias=False)
        self.transformer = t


class LLaDA(DiffusionLM):
    """LLaDAModelLM equivalent; see :class:`DiffusionLM.forward` for the forward API."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = _LLaDAModel(spec)

    def parts(self, i: int) -> BlockParts:
        return self.model.transformer["blocks"][i].parts

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.transformer["wte"](ids)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.transformer["ln_f"](h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        t = self.model.transformer
        if "ff_out" in t:
            return t["ff_out"](h)
        return h @ t["wte"].weight.T
