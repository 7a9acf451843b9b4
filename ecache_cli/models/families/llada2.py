"""LLaDA2.x (inclusionAI/LLaDA2.0-mini, LLaDA2.1-mini): block diffusion on a mixture-of-experts transformer
(Ling 2.0 architecture).

Read from the official modeling and configuration code (``modeling_llada2_moe.py`` /
``configuration_llada2_moe.py``, as carried by the ``dllm`` repository and dInfer; docs/MODELS.md §10):

- config.json: ``model_type`` "llada2_moe". State-dict names: ``model.word_embeddings``,
  ``model.layers.{i}.{input_layernorm, attention.{query_key_value, query_layernorm, key_layernorm,
  dense}, post_attention_layernorm, mlp...}``, ``model.norm``, an untied ``lm_head``.
- Attention: q, k and v are one matrix ``query_key_value`` (rows: every query head, then the key
  heads, then the value heads, ``head_dim`` rows each); an RMSNorm over each head's query and key
  before RoPE (always, whatever ``use_qk_norm`` says); RoPE over the first
  ``head_dim × partial_rotary_factor`` dimensions of each head, frequencies 1/θ^(2j/rotary_dim), the
  rest passed through; grouped-query heads; block-causal over blocks counted from position 0.
- Feed-forward: the first ``first_k_dense_replace`` layers are dense SwiGLU (``intermediate_size``); the
  others route each token in float32: sigmoid scores s, s + ``expert_bias`` chooses (the experts split
  into ``n_group`` groups of consecutive experts, each scored by the sum of its two best, the
  ``topk_group`` best groups kept, then the top ``num_experts_per_tok`` of their experts); the weights
  are the chosen experts' unbiased s divided by their sum (+1e-20), times ``routed_scaling_factor``; a
  shared SwiGLU expert (``moe_intermediate_size × num_shared_experts`` wide) is added unweighted.
  Fields the code ignores (``score_function``, ``norm_topk_prob``, ``router_dtype``,
  ``moe_router_enable_expert_bias``, ``use_qk_norm``) are ignored here too.
- Logits aligned (no shift), cast to float32 by the official head (equal in a float32 model).
- Tokens: mask ``<|mask|>`` (156895) and EOS ``<|endoftext|>`` (156892), end of turn ``<|role_end|>``;
  role-tag chat format. Decoded block by block with the official ``generate`` rules (``sampler``
  "llada2": threshold decoding with a per-step minimum, stop after the block holding EOS).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..base import BlockParts, DiffusionLM
from ..family import Alias, Family
from ..layers import RMSNorm, SwiGLU
from ..moe import SparseMoE, WithShared
from ..spec import ConfigReader, ModelSpec

MASK_ID, EOS_ID = 156895, 156892
VOCAB = 157184
#: LLaDA2.1-mini's config.json: 20 layers (the first dense), 256 experts of 512 (8 a token, 1 shared) on
#: hidden 2048, 16 query / 4 key-value heads of 128, vocab 157184, untied head
MINI = dict(d=2048, layers=20, dense=1, heads=16, kv=4, hd=128, mlp=5120, experts=256, top=8, expert=512, shared=1)
#: The role-tag chat format of the official tools (SGLang's and dInfer's rendered prompts), thinking off.
CHAT_TEMPLATE = (
    "{{ '<role>SYSTEM</role>' }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n' }}"
    "{% endif %}{{ 'detailed thinking off<|role_end|>' }}"
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ '<role>' + {'user': 'HUMAN', 'assistant': 'ASSISTANT'}.get(message['role'], message['role'] | upper) "
    "+ '</role>' + message['content'] + '<|role_end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<role>ASSISTANT</role>' }}{% endif %}"
)


def _mini_params(active: bool) -> int:
    """Parameters of LLaDA2.x-mini's config (``active``: with 8 of the 256 experts per MoE layer)."""
    m = MINI
    d, hd = m["d"], m["hd"]
    attn = d * (m["heads"] + 2 * m["kv"]) * hd + m["heads"] * hd * d + 2 * hd + 2 * d
    experts = m["top"] if active else m["experts"]
    moe = experts * 3 * d * m["expert"] + m["experts"] * (d + 1) + m["shared"] * 3 * d * m["expert"]
    layers = m["dense"] * (attn + 3 * d * m["mlp"]) + (m["layers"] - m["dense"]) * (attn + moe)
    return 2 * VOCAB * d + layers + d


class _Gate(nn.Module):
    """``mlp.gate``: the router's weight (E, d) and its ``expert_bias`` (E,) buffer (selection only)."""

    def __init__(self, s: ModelSpec):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(s.n_experts, s.d_model))
        self.register_buffer("expert_bias", torch.zeros(s.n_experts))


class LLaDA2SparseBlock(SparseMoE):
    """The official ``LLaDA2MoeSparseMoeBlock``: ``gate``, ``experts``, ``shared_experts``."""

    def __init__(self, s: ModelSpec):
        super().__init__()
        self.top_k, self.groups, self.kept, self.scaling = (s.experts_per_token, s.expert_groups,
                                                            s.expert_groups_kept, s.routed_scaling)
        self.gate = _Gate(s)
        self.experts = nn.ModuleList(SwiGLU(s.d_model, s.expert_hidden) for _ in range(s.n_experts))
        if s.shared_expert_hidden:
            self.shared_experts = SwiGLU(s.d_model, s.shared_expert_hidden)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``LLaDA2MoeGate`` (module docstring): (idx (N, k) in ``torch.topk`` order, weight (N, k) in x's dtype)."""
        s = torch.sigmoid(F.linear(x.float(), self.gate.weight.float()))  # (N, E) float32
        biased = s + self.gate.expert_bias.float()
        N, E = biased.shape
        if self.groups > 1:
            per_group = biased.view(N, self.groups, E // self.groups)
            score = per_group.topk(2, dim=-1).values.sum(-1)  # (N, groups)
            keep = torch.zeros_like(score, dtype=torch.bool).scatter_(
                1, score.topk(self.kept, dim=-1, sorted=False).indices, True)  # (N, groups)
            biased = per_group.masked_fill(~keep[:, :, None], float("-inf")).view(N, E)
        idx = biased.topk(self.top_k, dim=-1).indices  # (N, k)
        w = s.gather(1, idx)
        if self.top_k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, (w * self.scaling).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        hd = s.head_dim
        self.query_key_value = nn.Linear(s.d_model, (s.n_heads + 2 * s.n_kv_heads) * hd, bias=False)
        self.dense = nn.Linear(s.n_heads * hd, s.d_model, bias=False)
        self.query_layernorm = RMSNorm(hd, s.rms_eps)
        self.key_layernorm = RMSNorm(hd, s.rms_eps)


class LLaDA2Layer(nn.Module):
    """One ``LLaDA2MoeDecoderLayer``'s parameters (official names)."""

    def __init__(self, s: ModelSpec, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(s.d_model, s.rms_eps)
        self.attention = a = _Attention(s)
        self.post_attention_layernorm = RMSNorm(s.d_model, s.rms_eps)
        attn = dict(attn_norm=self.input_layernorm, q=a.query_key_value, k=None, v=None, o=a.dense,
                    mlp_norm=self.post_attention_layernorm, q_norm=a.query_layernorm, k_norm=a.key_layernorm)
        if s.is_moe(i):
            self.mlp = m = LLaDA2SparseBlock(s)
            moe = WithShared(m, m.shared_experts) if s.shared_expert_hidden else m
            self.parts = BlockParts(**attn, moe=moe)
        else:
            self.mlp = m = SwiGLU(s.d_model, s.mlp_hidden)
            self.parts = BlockParts(**attn, gate=m.gate_proj, up=m.up_proj, down=m.down_proj)


class _Model(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.word_embeddings = nn.Embedding(s.vocab_size, s.d_model)
        self.layers = nn.ModuleList(LLaDA2Layer(s, i) for i in range(s.n_layers))
        self.norm = RMSNorm(s.d_model, s.rms_eps)


class LLaDA2(DiffusionLM):
    """``LLaDA2MoeModelLM`` equivalent; see :class:`DiffusionLM.forward` for the forward API (its store
    carries the block of the block-causal attention)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = _Model(spec)
        self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)

    def parts(self, i: int) -> BlockParts:
        return self.model.layers[i].parts

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.word_embeddings(ids)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)


class LLaDA2Family(Family):
    name = "llada2"
    title = "LLaDA2.x (mixture of experts, block diffusion)"
    sampler = "llada2"
    model_class = LLaDA2
    aliases = {
        "llada2-mini": Alias("inclusionAI/LLaDA2.0-mini", _mini_params(False), "Instruct", _mini_params(True),
                             2 * VOCAB * MINI["d"]),
        "llada2.1-mini": Alias("inclusionAI/LLaDA2.1-mini", _mini_params(False), "Instruct",
                               _mini_params(True), 2 * VOCAB * MINI["d"]),
    }
    mask_token, eot_token = "<|mask|>", "<|role_end|>"
    # the official generate's defaults (LLaDA2.0 tech report: temperature 0, block 32, threshold 0.95)
    decode_defaults = {"block_length": 32, "threshold": 0.95}
    cache_default, block_causal = "block", True
    fixture_specials = ["<|startoftext|>", "<|endoftext|>", "<|mask|>", "<role>", "</role>", "<|role_end|>"]
    fixture_mask, fixture_eos = "<|mask|>", "<|endoftext|>"
    fixture_tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                                "pad_token": "<|endoftext|>", "mask_token": "<|mask|>", "chat_template": CHAT_TEMPLATE}
    field_names = (("d_model", "hidden_size"), ("n_layers", "num_hidden_layers"),
                   ("n_heads", "num_attention_heads"), ("n_kv_heads", "num_key_value_heads"),
                   ("head_dim", "head_dim"), ("mlp_hidden", "intermediate_size"), ("vocab_size", "vocab_size"),
                   ("max_positions", "max_position_embeddings"), ("rms_eps", "rms_norm_eps"),
                   ("rope_theta", "rope_theta"), ("rotary_dim", "partial_rotary_factor"),
                   ("n_experts", "num_experts"), ("experts_per_token", "num_experts_per_tok"),
                   ("expert_hidden", "moe_intermediate_size"), ("moe_layers", "first_k_dense_replace"),
                   ("expert_groups", "n_group"), ("expert_groups_kept", "topk_group"))

    @classmethod
    def claims(cls, cfg: dict) -> bool:
        return str(cfg.get("model_type", "")).lower() in ("llada2_moe", "llada21_moe")

    @classmethod
    def read(cls, r: ConfigReader) -> ModelSpec:
        cfg = r.cfg
        for key in ("use_bias", "use_qkv_bias"):
            if cfg.get(key):
                raise r.refuse(f"{key} true is not a released LLaDA2 variant; ecache runs it without biases")
        if cfg.get("rope_scaling") is not None:
            raise r.refuse(f"rope_scaling {cfg['rope_scaling']!r}: only the default RoPE is supported (null)")
        d, n_layers = int(r.need("hidden_size")), int(r.need("num_hidden_layers"))
        n_heads = r.heads("num_attention_heads")
        head_dim = r.num("head_dim", None) or d // n_heads
        factor = r.num("partial_rotary_factor", 0.5, float)
        if not 0 < factor <= 1:
            raise r.refuse(f"partial_rotary_factor {factor} must be in (0, 1] (the share of each head RoPE turns; "
                           "0.5 in the released models)")
        n_experts, groups = int(r.need("num_experts")), r.num("n_group", 1)
        kept = r.num("topk_group", groups)
        if groups < 1 or n_experts % groups or not 1 <= kept <= groups or (groups > 1 and n_experts // groups < 2):
            raise r.refuse(f"n_group {groups} / topk_group {kept} do not split num_experts {n_experts} into groups "
                           "of at least 2 experts of which 1..n_group are kept; use the official config")
        dense = r.num("first_k_dense_replace", 0)
        expert = int(r.need("moe_intermediate_size"))
        return ModelSpec(
            family=cls.name, d_model=d, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=r.num("num_key_value_heads", n_heads), head_dim=head_dim,
            mlp_hidden=int(r.need("intermediate_size")), vocab_size=int(r.need("vocab_size")),
            rms_eps=r.num("rms_norm_eps", 1e-6, float), rope_theta=r.num("rope_theta", 600000, float),
            rope_full_precision=False, qkv_bias=False, tie_embeddings=False,
            mask_id=r.num("mask_token_id", MASK_ID), eos_id=r.num("eos_token_id", EOS_ID),
            pad_id=r.num("pad_token_id", EOS_ID), bos_id=None, logit_shift=0,
            max_positions=r.num("max_position_embeddings", 32768), sampler=cls.sampler, qk_norm=True,
            rotary_dim=int(head_dim * factor) // 2 * 2, n_experts=n_experts,
            experts_per_token=int(r.need("num_experts_per_tok")), expert_hidden=expert,
            shared_expert_hidden=expert * r.num("num_shared_experts", 0), expert_bias=True,
            moe_layers=tuple(i >= dense for i in range(n_layers)), field_names=cls.field_names,
            block_causal=True, block_size=32, expert_groups=groups, expert_groups_kept=kept,
            routed_scaling=r.num("routed_scaling_factor", 1.0, float),
        )

    @classmethod
    def complete(cls, spec: ModelSpec, vocab: dict[str, int]) -> ModelSpec:
        """The tokenizer's ``<|mask|>`` as the mask (config.json names none), then the end-of-turn id."""
        if spec.mask_id == MASK_ID and "<|mask|>" in vocab:
            spec = replace(spec, mask_id=vocab["<|mask|>"])
        return super().complete(spec, vocab)

    @classmethod
    def tiny_config(cls, mask: int = 2, eos: int = 1, vocab_size: int = 128, d_model: int = 64, n_layers: int = 3,
                    n_heads: int = 4, n_kv_heads: int | None = None, mlp_hidden: int = 128) -> dict:
        """The fields of LLaDA2.1-mini's config.json, shrunk (8 experts in 2 groups, the first layer dense;
        the mask id is the tokenizer's)."""
        return {
            "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0, "dtype": "float32",
            "embedding_dropout": 0.0, "eos_token_id": eos, "first_k_dense_replace": 1, "head_dim": d_model // n_heads,
            "hidden_act": "silu", "hidden_size": d_model, "intermediate_size": mlp_hidden,
            "max_position_embeddings": 32768, "model_type": "llada2_moe", "moe_intermediate_size": 32,
            "moe_router_enable_expert_bias": True, "n_group": 2, "norm_head": False, "norm_softmax": False,
            "norm_topk_prob": True, "num_attention_heads": n_heads, "num_experts": 8, "num_experts_per_tok": 2,
            "num_hidden_layers": n_layers, "num_key_value_heads": n_kv_heads or 2, "num_shared_experts": 1,
            "pad_token_id": eos, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06, "rope_scaling": None,
            "rope_theta": 600000, "routed_scaling_factor": 2.5, "router_dtype": "fp32", "score_function": "sigmoid",
            "tie_word_embeddings": False, "topk_group": 1, "use_bias": False, "use_qk_norm": True,
            "use_qkv_bias": False, "vocab_size": vocab_size,
        }
