"""SDAR (JetLM/SDAR-1.7B-Chat, -4B-Chat, -8B-Chat): block diffusion on a Qwen3 transformer.

Read from the official code (JetAstra/SDAR ``modeling_sdar.py``, ``configuration_sdar.py`` and
``generate.py``; docs/MODELS.md §10):

- config.json has Qwen3's field names with ``model_type`` "sdar"; ``head_dim`` is its own field (it need
  not be hidden / heads). The GitHub copy adds ``block_size`` (4) and ``mask_token_id``; without them the
  block is 4 and the mask is the tokenizer's ``<|MASK|>`` (151669).
- State-dict names are Qwen3's: ``model.embed_tokens``, ``model.layers.{i}.{input_layernorm,
  self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}``,
  ``model.norm`` and an untied ``lm_head`` (1.7B/4B too, unlike Qwen3's base models). No biases.
- Attention: an RMSNorm over each head's query and key (weights (head_dim,)) before RoPE; RoPE over the
  whole head, theta ``rope_theta`` (1e6), tables cast to the activation dtype; grouped-query heads;
  block-causal: a query sees every key of its own block and of earlier blocks, blocks counted from
  position 0 of the sequence (prompt included).
- Logits aligned (position i predicts token i). Decoded block by block with ``generate.py``'s rules
  (``sampler`` "sdar": decoding/commit.py).
- Tokens: EOS ``<|endoftext|>`` (151643), end of turn ``<|im_end|>`` (151645): the official stop ids.
  Qwen3's ChatML chat template.

SDAR-30B-A3B (``model_type`` "sdar_moe", Qwen3-MoE experts) is another code path, refused with one line.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from ..base import BlockParts, DecoderLayout
from ..family import Alias, Family
from ..layers import Attention, RMSNorm, SwiGLU
from ..spec import ConfigReader, ModelSpec

MASK_ID = 151669  # <|MASK|> in the official tokenizer
BLOCK = 4  # the block every released SDAR chat model was trained with
VOCAB = 151936

#: Qwen3's ChatML (no default system prompt), for the tiny checkpoint.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class SDARLayer(nn.Module):
    """One ``SDARDecoderLayer``'s parameters (official names)."""

    def __init__(self, s: ModelSpec, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(s.d_model, s.rms_eps)
        self.self_attn = a = Attention(s.d_model, s.n_heads, s.n_kv_heads, s.head_dim, False, True, s.rms_eps)
        self.post_attention_layernorm = RMSNorm(s.d_model, s.rms_eps)
        self.mlp = m = SwiGLU(s.d_model, s.mlp_hidden)
        self.parts = BlockParts(self.input_layernorm, a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                self.post_attention_layernorm, m.gate_proj, m.up_proj, m.down_proj,
                                q_norm=a.q_norm, k_norm=a.k_norm)


class SDAR(DecoderLayout):
    """``SDARForCausalLM`` equivalent; see :class:`DiffusionLM.forward` for the forward API (its store
    carries the block of the block-causal attention)."""

    layer_class = SDARLayer


def _sdar_params(d: int, layers: int, heads: int, kv: int, mlp: int, hd: int = 128) -> int:
    """Parameters of an SDAR config (untied head, q/k norms, no biases)."""
    attn = d * heads * hd * 2 + d * kv * hd * 2 + 2 * hd
    return 2 * VOCAB * d + layers * (attn + 3 * d * mlp + 2 * d) + d


class SDARFamily(Family):
    name = "sdar"
    title = "SDAR (Qwen3, block diffusion)"
    sampler = "sdar"
    model_class = SDAR
    aliases = {
        "sdar-1.7b": Alias("JetLM/SDAR-1.7B-Chat", _sdar_params(2048, 28, 16, 8, 6144), "Chat",
                           outer=2 * VOCAB * 2048),
        "sdar-4b": Alias("JetLM/SDAR-4B-Chat", _sdar_params(2560, 36, 32, 8, 9728), "Chat", outer=2 * VOCAB * 2560),
        "sdar-8b": Alias("JetLM/SDAR-8B-Chat", _sdar_params(4096, 36, 32, 8, 12288), "Chat", outer=2 * VOCAB * 4096),
    }
    mask_token, eot_token = "<|MASK|>", "<|im_end|>"
    # generate.py's defaults: blocks of 4, low_confidence_dynamic at 0.85 (greedy here: ecache's temperature 0)
    decode_defaults = {"block_length": BLOCK, "threshold": 0.85}
    cache_default, block_causal = "block", True
    fixture_specials = ["<|im_start|>", "<|endoftext|>", "<|MASK|>", "<|im_end|>"]
    fixture_mask, fixture_eos = "<|MASK|>", "<|endoftext|>"
    fixture_tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                                "pad_token": "<|endoftext|>", "mask_token": "<|MASK|>", "chat_template": CHAT_TEMPLATE}
    field_names = (("d_model", "hidden_size"), ("n_layers", "num_hidden_layers"),
                   ("n_heads", "num_attention_heads"), ("n_kv_heads", "num_key_value_heads"),
                   ("head_dim", "head_dim"), ("mlp_hidden", "intermediate_size"), ("vocab_size", "vocab_size"),
                   ("max_positions", "max_position_embeddings"), ("rms_eps", "rms_norm_eps"),
                   ("rope_theta", "rope_theta"), ("block_size", "block_size"))

    @classmethod
    def claims(cls, cfg: dict) -> bool:
        return str(cfg.get("model_type", "")).lower() in ("sdar", "sdar_moe")

    @classmethod
    def read(cls, r: ConfigReader) -> ModelSpec:
        cfg = r.cfg
        if str(cfg.get("model_type", "")).lower() == "sdar_moe":
            raise r.refuse("model_type 'sdar_moe' (SDAR-30B-A3B, Qwen3-MoE experts) is not supported yet; ecache "
                           "runs the dense SDAR chat models (sdar-1.7b, sdar-4b, sdar-8b)")
        if cfg.get("attention_bias"):
            raise r.refuse("attention_bias true is not a released SDAR variant; ecache runs it without biases")
        if cfg.get("rope_scaling") is not None:
            raise r.refuse(f"rope_scaling {cfg['rope_scaling']!r}: only the default RoPE is supported (null)")
        if cfg.get("use_sliding_window"):
            raise r.refuse("use_sliding_window true: SDAR's released models attend over the whole prefix; "
                           "ecache has no sliding window")
        d = int(r.need("hidden_size"))
        n_heads = r.heads("num_attention_heads")
        block = r.num("block_size", BLOCK)
        if block < 1:
            raise r.refuse(f"block_size {block} must be ≥ 1 (the released models use 4)")
        return ModelSpec(
            family=cls.name, d_model=d, n_layers=int(r.need("num_hidden_layers")), n_heads=n_heads,
            n_kv_heads=r.num("num_key_value_heads", n_heads), head_dim=r.num("head_dim", None) or d // n_heads,
            mlp_hidden=int(r.need("intermediate_size")), vocab_size=int(r.need("vocab_size")),
            rms_eps=r.num("rms_norm_eps", 1e-6, float), rope_theta=r.num("rope_theta", 1e6, float),
            rope_full_precision=False, qkv_bias=False, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mask_id=r.num("mask_token_id", MASK_ID), eos_id=r.num("eos_token_id", 151643),
            pad_id=r.num("pad_token_id", None) or r.num("eos_token_id", 151643), bos_id=cfg.get("bos_token_id"),
            logit_shift=0, max_positions=r.num("max_position_embeddings", 32768), sampler=cls.sampler,
            qk_norm=True, field_names=cls.field_names, block_causal=True, block_size=block,
        )

    @classmethod
    def complete(cls, spec: ModelSpec, vocab: dict[str, int]) -> ModelSpec:
        """The tokenizer's ``<|MASK|>`` as the mask when config.json names none, then the end-of-turn id."""
        if spec.mask_id == MASK_ID and "<|MASK|>" in vocab:
            spec = replace(spec, mask_id=vocab["<|MASK|>"])
        return super().complete(spec, vocab)

    @classmethod
    def tiny_config(cls, mask: int = 2, eos: int = 1, vocab_size: int = 128, d_model: int = 64, n_layers: int = 2,
                    n_heads: int = 4, n_kv_heads: int | None = None, mlp_hidden: int = 128) -> dict:
        """The fields of the GitHub SDAR-4B-Chat config.json, shrunk (block 4, mask id given)."""
        return {
            "architectures": ["SDARForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "block_size": BLOCK, "bos_token_id": eos, "eos_token_id": eos, "head_dim": d_model // n_heads,
            "hidden_act": "silu", "hidden_size": d_model, "intermediate_size": mlp_hidden,
            "mask_token_id": mask, "max_position_embeddings": 32768, "model_type": "sdar",
            "num_attention_heads": n_heads, "num_hidden_layers": n_layers, "num_key_value_heads": n_kv_heads or 2,
            "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
            "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": False, "use_sliding_window": False,
            "vocab_size": vocab_size,
        }
