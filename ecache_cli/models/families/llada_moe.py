"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B-Base / -Instruct): LLaDA's bidirectional masked diffusion on an
OLMoE-style mixture-of-experts transformer.

Read from the official modeling and configuration code (``modeling_lladamoe.py`` /
``configuration_lladamoe.py``, shipped with the checkpoint and carried by the ``dllm`` repository;
docs/MODELS.md "LLaDA-MoE"):

- config.json keeps ``model_type`` "llada" (LLaDA-8B's) with Qwen-style field names; the family is told
  apart by its experts (``num_experts``, architectures ``LLaDAMoEModelLM``). dllm's copy says "lladamoe".
- Attention: no biases, grouped-query heads, an RMSNorm over each head's query and key (weights
  (head_dim,), eps ``rms_norm_eps``) before RoPE, then an optional clamp of q, k, v to ±``clip_qkv``;
  RoPE over the first ``head_dim × partial_rotary_factor`` dimensions with theta ``rope_theta``, its
  cos/sin cast to the activation dtype; keys of padding masked (dllm's copy; the checkpoint's own file
  drops the mask, which changes only padded batches).
- Feed-forward: for each layer whose ``moe_layer_freq`` entry is non-zero, a router ``mlp.gate``
  (no bias) whose softmax over every expert, in float32, is top-k'd without renormalisation (the weights
  sum to less than 1; an ``expert_bias`` buffer, when enabled, is added before the top-k and so enters
  the weights too); the chosen SwiGLU experts ``mlp.experts.{j}.{gate,up,down}_proj`` are summed with
  those weights in the activation dtype; a ``shared_expert`` beside ``mlp`` is added unweighted when
  ``shared_expert_intermediate_size`` is set. Other layers are dense SwiGLU ``mlp.{gate,up,down}_proj``.
- Final ``model.norm``, untied ``lm_head``; logits aligned (no shift); no logit scaling.
- Tokens: the mask ``<|mask|>`` (156895) and EOS ``<|endoftext|>`` (156892) are not in config.json:
  they come from the tokenizer (those official ids when it lacks them); end of turn ``<|role_end|>``.
  Decoded with LLaDA's generate.py rules (``sampler`` "llada").
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..base import BlockParts, DecoderLayout
from ..family import Alias, Family
from ..layers import Attention, RMSNorm, SwiGLU
from ..moe import SparseMoE, WithShared
from ..spec import ConfigReader, ModelSpec

MASK_ID, EOS_ID = 156895, 156892  # the official ids (dInfer's benchmarks, the model card's generate call)
PARAMS = 7_356_880_896  # 16 layers of 64 experts (1024 wide) on hidden 2048, vocab 157184, untied head
ACTIVE = 1_719_736_320  # the same with 8 experts a token (embeddings and head included)
OUTER = 157_184 * 2048 * 2  # embedding and untied head: vocab 157184 × hidden 2048
#: The role-tag chat format the official tools render (dInfer's benchmarks), for the tiny checkpoint.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<role>' + {'user': 'HUMAN', 'assistant': 'ASSISTANT', 'system': 'SYSTEM'}.get(message['role'], "
    "message['role'] | upper) + '</role>' + message['content'] + '<|role_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<role>ASSISTANT</role>' }}{% endif %}"
)


class LLaDAMoESparseBlock(SparseMoE):
    """The official ``LLaDAMoESparseMoeBlock``: ``gate`` (E, d) router, ``experts``, optional ``expert_bias``."""

    def __init__(self, s: ModelSpec):
        super().__init__()
        self.top_k = s.experts_per_token
        self.gate = nn.Linear(s.d_model, s.n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(s.d_model, s.expert_hidden) for _ in range(s.n_experts))
        if s.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(s.n_experts))
        else:
            self.expert_bias = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """softmax over all experts in float32, (+ expert_bias), top-k, weights not renormalised, cast to
        x's dtype: (idx (N, k), weight (N, k))."""
        p = F.softmax(self.gate(x), dim=1, dtype=torch.float32)  # (N, E)
        if self.expert_bias is not None:
            p = p + self.expert_bias
        weight, idx = torch.topk(p, self.top_k, dim=-1)
        return idx, weight.to(x.dtype)


class LLaDAMoELayer(nn.Module):
    """One ``LLaDAMoEDecoderLayer``'s parameters (official names)."""

    def __init__(self, s: ModelSpec, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(s.d_model, s.rms_eps)
        self.self_attn = a = Attention(s.d_model, s.n_heads, s.n_kv_heads, s.head_dim, False, s.qk_norm, s.rms_eps)
        self.post_attention_layernorm = RMSNorm(s.d_model, s.rms_eps)
        norms = dict(q_norm=getattr(a, "q_norm", None), k_norm=getattr(a, "k_norm", None))
        if s.is_moe(i):
            self.mlp = LLaDAMoESparseBlock(s)
            moe = self.mlp
            if s.shared_expert_hidden:
                self.shared_expert = SwiGLU(s.d_model, s.shared_expert_hidden)
                moe = WithShared(self.mlp, self.shared_expert)
            self.parts = BlockParts(self.input_layernorm, a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                    self.post_attention_layernorm, moe=moe, **norms)
        else:
            self.mlp = m = SwiGLU(s.d_model, s.mlp_hidden)
            self.parts = BlockParts(self.input_layernorm, a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                    self.post_attention_layernorm, m.gate_proj, m.up_proj, m.down_proj, **norms)


class LLaDAMoE(DecoderLayout):
    """``LLaDAMoEModelLM`` equivalent; see :class:`DiffusionLM.forward` for the forward API."""

    layer_class = LLaDAMoELayer


class LLaDAMoEFamily(Family):
    name = "llada-moe"
    title = "LLaDA-MoE (OLMoE-style mixture of experts, bidirectional)"
    sampler = "llada"
    model_class = LLaDAMoE
    aliases = {
        "llada-moe": Alias("inclusionAI/LLaDA-MoE-7B-A1B-Instruct", PARAMS, "Instruct", ACTIVE, OUTER),
        "llada-moe-instruct": Alias("inclusionAI/LLaDA-MoE-7B-A1B-Instruct", PARAMS, "Instruct", ACTIVE, OUTER),
        "llada-moe-base": Alias("inclusionAI/LLaDA-MoE-7B-A1B-Base", PARAMS, "Base", ACTIVE, OUTER),
    }
    mask_token, eot_token = "<|mask|>", "<|role_end|>"
    fixture_specials = ["<|padding|>", "<|endoftext|>", "<|mask|>", "<role>", "</role>", "<|role_end|>"]
    fixture_mask, fixture_eos = "<|mask|>", "<|endoftext|>"
    fixture_tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                                "pad_token": "<|padding|>", "mask_token": "<|mask|>", "chat_template": CHAT_TEMPLATE}
    field_names = (("d_model", "hidden_size"), ("n_layers", "num_hidden_layers"),
                   ("n_heads", "num_attention_heads"), ("n_kv_heads", "num_key_value_heads"),
                   ("mlp_hidden", "dense_intermediate_size"), ("vocab_size", "vocab_size"),
                   ("max_positions", "max_position_embeddings"), ("rms_eps", "rms_norm_eps"),
                   ("rope_theta", "rope_theta"), ("rotary_dim", "partial_rotary_factor"),
                   ("n_experts", "num_experts"), ("experts_per_token", "num_experts_per_tok"),
                   ("expert_hidden", "expert_intermediate_size"), ("moe_layers", "moe_layer_freq"))

    @classmethod
    def claims(cls, cfg: dict) -> bool:
        """model_type ``llada`` (as shipped) or ``lladamoe`` (dllm's rewrite) with experts."""
        return str(cfg.get("model_type", "")).lower() in ("llada", "lladamoe") and (
            "num_experts" in cfg or any("MoE" in str(a) for a in cfg.get("architectures") or ()))

    @classmethod
    def read(cls, r: ConfigReader) -> ModelSpec:
        cfg = r.cfg
        d, n_layers = int(r.need("hidden_size")), int(r.need("num_hidden_layers"))
        n_heads = r.heads("num_attention_heads")
        if cfg.get("attention_bias"):
            raise r.refuse("attention_bias true is not a released LLaDA-MoE variant; ecache runs it without biases")
        if cfg.get("rope_scaling") is not None:
            raise r.refuse(f"rope_scaling {cfg['rope_scaling']!r}: only the default RoPE is supported (null)")
        factor = r.num("partial_rotary_factor", None, float)
        if factor is None or not 0 < factor <= 1:
            raise r.refuse(f"partial_rotary_factor is {factor}: the official code then rotates nothing (its default "
                           "is -1); set it to the share of each head RoPE turns, in (0, 1] (1.0 in the released "
                           "checkpoints)")
        clip = r.num("clip_qkv", None, float)
        if clip is not None and not clip > 0:
            raise r.refuse(f"clip_qkv is {clip}; it must be > 0 (the bound q, k and v are clamped to) or null")
        freq = cfg.get("moe_layer_freq")
        if not isinstance(freq, list) or len(freq) != n_layers or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) for f in freq):
            raise r.refuse(f"moe_layer_freq {freq!r} must list one number per layer ({n_layers}); 0 = dense, "
                           "else MoE")
        shared = cfg.get("shared_expert_intermediate_size")
        head_dim = d // n_heads
        return ModelSpec(
            family=cls.name, d_model=d, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=r.num("num_key_value_heads", n_heads), head_dim=head_dim,
            mlp_hidden=max(r.num("dense_intermediate_size", -1), 0) or r.need("expert_intermediate_size"),
            vocab_size=int(r.need("vocab_size")), rms_eps=r.num("rms_norm_eps", 1e-5, float),
            rope_theta=r.num("rope_theta", None, float) or r.need("rope_theta"),
            rope_full_precision=False, qkv_bias=False, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mask_id=r.num("mask_token_id", MASK_ID), eos_id=EOS_ID, pad_id=r.num("pad_token_id", 1),
            bos_id=cfg.get("bos_token_id"), logit_shift=0, max_positions=r.num("max_position_embeddings", 4096),
            sampler=cls.sampler, qk_norm=bool(cfg.get("qk_layernorm")), clip_qkv=clip,
            rotary_dim=max(int(head_dim * factor), 0) // 2 * 2, n_experts=int(r.need("num_experts")),
            experts_per_token=int(r.need("num_experts_per_tok")), expert_hidden=int(r.need("expert_intermediate_size")),
            shared_expert_hidden=int(shared or 0), expert_bias=bool(cfg.get("moe_router_enable_expert_bias")),
            moe_layers=tuple(bool(f) for f in freq), field_names=cls.field_names,
        )

    @classmethod
    def complete(cls, spec: ModelSpec, vocab: dict[str, int]) -> ModelSpec:
        """The tokenizer's ``<|endoftext|>`` as EOS and ``<|mask|>`` as the mask (unless config.json names a
        ``mask_token_id``), then the end-of-turn id."""
        spec = replace(spec, eos_id=vocab.get("<|endoftext|>", spec.eos_id))
        if spec.mask_id == MASK_ID and "<|mask|>" in vocab:
            spec = replace(spec, mask_id=vocab["<|mask|>"])
        return super().complete(spec, vocab)

    @classmethod
    def tiny_config(cls, mask: int = 2, eos: int = 1, vocab_size: int = 128, d_model: int = 64, n_layers: int = 2,
                    n_heads: int = 4, n_kv_heads: int | None = None, mlp_hidden: int = 96) -> dict:
        """The fields the official configuration class writes (no mask id: the tokenizer has it)."""
        return {
            "architectures": ["LLaDAMoEModelLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": None, "clip_qkv": None, "dense_intermediate_size": mlp_hidden,
            "eos_token_id": eos, "expert_intermediate_size": 32, "hidden_act": "silu", "hidden_size": d_model,
            "max_position_embeddings": 4096, "model_type": "llada", "moe_layer_freq": [1] * n_layers,
            "moe_router_enable_expert_bias": False, "moe_router_score_function": "softmax",
            "norm_topk_prob": False, "num_attention_heads": n_heads, "num_experts": 8, "num_experts_per_tok": 2,
            "num_hidden_layers": n_layers, "num_key_value_heads": n_kv_heads or 2, "pad_token_id": 0,
            "partial_rotary_factor": 1.0, "qk_layernorm": True, "rms_norm_eps": 1e-05, "rope_scaling": None,
            "rope_theta": 50000, "routed_scaling_factor": 1, "shared_expert_intermediate_size": None,
            "tie_word_embeddings": False, "use_cache": False, "vocab_size": vocab_size,
        }
