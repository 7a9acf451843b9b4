"""LLaDA (GSAI-ML/LLaDA-8B-Base / -Instruct, LLaDA-1.5): a bidirectional Llama-like transformer.

config.json uses OLMo's field names (``d_model``, ``n_layers``, ``n_heads``, ``mlp_hidden_size``, ...;
docs/MODELS.md §1.1). State-dict names and shapes are those of the official safetensors (§1.2):
``model.transformer.{wte, blocks.{i}.{attn_norm, q_proj, k_proj, v_proj, attn_out, ff_norm, ff_proj,
up_proj, ff_out}, ln_f, ff_out}``. ``ff_proj`` is the SiLU-gated branch (gate), ``up_proj`` the linear
branch, the block's ``ff_out`` the down projection; the top-level ``ff_out`` is the untied LM head.
No biases; RoPE theta 500000 applied in float32; logits aligned (logits[i] predict token i). Decoded by
LLaDA's generate.py rules (``sampler`` "llada").
"""

from __future__ import annotations

import torch
from torch import nn

from ..base import BlockParts, DiffusionLM
from ..family import Alias, Family
from ..layers import RMSNorm
from ..spec import ConfigReader, ModelSpec

#: The LLaDA-8B-Instruct chat template's shape (Llama-3 headers), for the tiny checkpoint.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
)


LLADA_8B = 8_015_581_184  # parameters of LLaDA-8B's config.json
LLADA_8B_OUTER = 126_464 * 4096 * 2  # embedding and untied head: vocab 126464 × hidden 4096


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


class LLaDAFamily(Family):
    name = "llada"
    title = "LLaDA (Llama-like, bidirectional, dense)"
    sampler = "llada"
    model_class = LLaDA
    aliases = {
        "llada-8b": Alias("GSAI-ML/LLaDA-8B-Instruct", LLADA_8B, "Instruct", outer=LLADA_8B_OUTER),
        "llada-8b-instruct": Alias("GSAI-ML/LLaDA-8B-Instruct", LLADA_8B, "Instruct", outer=LLADA_8B_OUTER),
        "llada-8b-base": Alias("GSAI-ML/LLaDA-8B-Base", LLADA_8B, "Base", outer=LLADA_8B_OUTER),
        "llada-1.5": Alias("GSAI-ML/LLaDA-1.5", LLADA_8B, "VRPO", outer=LLADA_8B_OUTER),
    }
    eot_token = "<|eot_id|>"
    fixture_specials = ["<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eot_id|>"]
    fixture_mask, fixture_eos = "<|mdm_mask|>", "<|endoftext|>"
    fixture_tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
                                "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                                "chat_template": CHAT_TEMPLATE}
    field_names = (("d_model", "d_model"), ("n_layers", "n_layers"), ("n_heads", "n_heads"),
                   ("n_kv_heads", "n_kv_heads"), ("mlp_hidden", "mlp_hidden_size"),
                   ("vocab_size", "embedding_size/vocab_size"), ("max_positions", "max_sequence_length"),
                   ("rms_eps", "rms_norm_eps"), ("rope_theta", "rope_theta"))

    @classmethod
    def claims(cls, cfg: dict) -> bool:
        """model_type ``llada`` without experts (LLaDA-MoE ships the same model_type)."""
        return str(cfg.get("model_type", "")).lower() == "llada" and "num_experts" not in cfg \
            and not any("MoE" in str(a) for a in cfg.get("architectures") or ())

    @classmethod
    def read(cls, r: ConfigReader) -> ModelSpec:
        cfg = r.cfg
        d = int(r.need("d_model"))
        n_heads = r.heads("n_heads")
        n_kv = r.num("n_kv_heads") if cfg.get("n_kv_heads") is not None else \
            (1 if cfg.get("multi_query_attention") else n_heads)
        mlp = r.num("mlp_hidden_size") if cfg.get("mlp_hidden_size") is not None else \
            int(r.num("mlp_ratio", 4, float) * d)
        vocab = int(cfg.get("embedding_size") or r.need("vocab_size"))
        if cfg.get("include_bias") or cfg.get("alibi") or not cfg.get("rope", True):
            raise r.refuse("LLaDA variants with biases, ALiBi or no RoPE are not supported")
        return ModelSpec(
            family=cls.name, d_model=d, n_layers=int(r.need("n_layers")), n_heads=n_heads,
            n_kv_heads=int(n_kv), head_dim=d // n_heads, mlp_hidden=int(mlp), vocab_size=vocab,
            rms_eps=r.num("rms_norm_eps", 1e-5, float), rope_theta=r.num("rope_theta", 10000.0, float),
            rope_full_precision=bool(cfg.get("rope_full_precision", True)),
            qkv_bias=bool(cfg.get("include_qkv_bias", False)), tie_embeddings=bool(cfg.get("weight_tying", False)),
            mask_id=r.num("mask_token_id", 126336), eos_id=r.num("eos_token_id", 126081),
            pad_id=r.num("pad_token_id", cfg.get("eos_token_id", 126081)),
            bos_id=cfg.get("bos_token_id"), logit_shift=0, max_positions=r.num("max_sequence_length", 4096),
            sampler=cls.sampler, field_names=cls.field_names,
        )

    @classmethod
    def tiny_config(cls, mask: int = 2, eos: int = 1, vocab_size: int = 128, d_model: int = 64, n_layers: int = 2,
                    n_heads: int = 4, n_kv_heads: int | None = None, mlp_hidden: int = 128) -> dict:
        return {
            "model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": d_model, "n_layers": n_layers,
            "n_heads": n_heads, "n_kv_heads": n_kv_heads or n_heads, "mlp_hidden_size": mlp_hidden,
            "activation_type": "silu", "block_type": "llama", "vocab_size": vocab_size, "embedding_size": vocab_size,
            "layer_norm_type": "rms", "rms_norm_eps": 1e-5, "include_bias": False, "include_qkv_bias": False,
            "rope": True, "rope_theta": 500000.0, "rope_full_precision": True, "alibi": False,
            "max_sequence_length": 4096, "weight_tying": False, "mask_token_id": mask,
            "eos_token_id": eos, "pad_token_id": eos,
            "torch_dtype": "float32",
        }
