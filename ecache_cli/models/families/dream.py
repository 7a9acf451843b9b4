"""Dream (Dream-org/Dream-v0-Base-7B / -Instruct-7B) and the code models built on it (apple/DiffuCoder-7B
Base / Instruct / cpGRPO, Dream-org/Dream-Coder-v0-Instruct-7B): a bidirectional Qwen2.5 transformer.

config.json uses Qwen2's field names with ``model_type`` "Dream" (docs/MODELS.md §2.1; the coders ship
the same architecture and ids, §"Dream-based coders"). State-dict names are Qwen2's (§2.2):
``model.embed_tokens``, ``model.layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``model.norm``, ``lm_head``. q/k/v carry biases,
attention is GQA, RoPE theta 1e6 with cos/sin cast to the activation dtype. Dream was trained with
shifted prediction: the hidden state at position i-1 predicts token i (``spec.logit_shift == 1``,
§2.5). Decoded by Dream's ``diffusion_generate`` rules (``sampler`` "dream"). DiffuCoder-Instruct ends
its answers with ``<|dlm_pad|>``, a stop id wherever the tokenizer has it.
"""

from __future__ import annotations

from torch import nn

from ..base import BlockParts, DecoderLayout
from ..family import Alias, Family
from ..layers import Attention, RMSNorm, SwiGLU
from ..spec import ConfigReader, ModelSpec

#: Qwen2.5's ChatML with Dream's default system prompt, for the tiny checkpoint.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DREAM_7B = 7_615_616_512  # parameters of Dream-v0-7B's config.json (and of the coders: the same shapes)
DREAM_7B_OUTER = 152_064 * 3584 * 2  # embedding and untied head: vocab 152064 × hidden 3584


class DreamLayer(nn.Module):
    """One DreamDecoderLayer's parameters (official names)."""

    def __init__(self, s: ModelSpec, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(s.d_model, s.rms_eps)
        self.self_attn = Attention(s.d_model, s.n_heads, s.n_kv_heads, s.head_dim, True, False, s.rms_eps)
        self.post_attention_layernorm = RMSNorm(s.d_model, s.rms_eps)
        self.mlp = SwiGLU(s.d_model, s.mlp_hidden)
        a, m = self.self_attn, self.mlp
        self.parts = BlockParts(self.input_layernorm, a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                self.post_attention_layernorm, m.gate_proj, m.up_proj, m.down_proj)


class Dream(DecoderLayout):
    """DreamModel equivalent; see :class:`DiffusionLM.forward` for the forward API."""

    layer_class = DreamLayer


class DreamFamily(Family):
    name = "dream"
    title = "Dream (Qwen2.5, bidirectional, shifted logits) and its coders"
    sampler = "dream"
    model_class = Dream
    aliases = {
        "dream-7b": Alias("Dream-org/Dream-v0-Instruct-7B", DREAM_7B, "Instruct", outer=DREAM_7B_OUTER),
        "dream-7b-instruct": Alias("Dream-org/Dream-v0-Instruct-7B", DREAM_7B, "Instruct", outer=DREAM_7B_OUTER),
        "dream-7b-base": Alias("Dream-org/Dream-v0-Base-7B", DREAM_7B, "Base", outer=DREAM_7B_OUTER),
        "diffucoder-7b": Alias("apple/DiffuCoder-7B-Instruct", DREAM_7B, "code", outer=DREAM_7B_OUTER),
        "diffucoder-7b-base": Alias("apple/DiffuCoder-7B-Base", DREAM_7B, "code base", outer=DREAM_7B_OUTER),
        "diffucoder-7b-cpgrpo": Alias("apple/DiffuCoder-7B-cpGRPO", DREAM_7B, "code cpGRPO", outer=DREAM_7B_OUTER),
        "dream-coder-7b": Alias("Dream-org/Dream-Coder-v0-Instruct-7B", DREAM_7B, "code", outer=DREAM_7B_OUTER),
    }
    eot_token = "<|im_end|>"
    stop_tokens = ("<|dlm_pad|>",)
    fixture_specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<|beginoftext|>"]
    fixture_mask, fixture_eos = "<|mask|>", "<|endoftext|>"
    fixture_tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                                "pad_token": "<|endoftext|>", "mask_token": "<|mask|>", "chat_template": CHAT_TEMPLATE}
    field_names = (("d_model", "hidden_size"), ("n_layers", "num_hidden_layers"),
                   ("n_heads", "num_attention_heads"), ("n_kv_heads", "num_key_value_heads"),
                   ("mlp_hidden", "intermediate_size"), ("vocab_size", "vocab_size"),
                   ("max_positions", "max_position_embeddings"), ("rms_eps", "rms_norm_eps"),
                   ("rope_theta", "rope_theta"))

    @classmethod
    def claims(cls, cfg: dict) -> bool:
        return str(cfg.get("model_type", "")).lower() == "dream"

    @classmethod
    def read(cls, r: ConfigReader) -> ModelSpec:
        cfg = r.cfg
        d = int(r.need("hidden_size"))
        n_heads = r.heads("num_attention_heads")
        return ModelSpec(
            family=cls.name, d_model=d, n_layers=int(r.need("num_hidden_layers")), n_heads=n_heads,
            n_kv_heads=r.num("num_key_value_heads", n_heads), head_dim=d // n_heads,
            mlp_hidden=int(r.need("intermediate_size")), vocab_size=int(r.need("vocab_size")),
            rms_eps=r.num("rms_norm_eps", 1e-6, float), rope_theta=r.num("rope_theta", 1e6, float),
            rope_full_precision=False, qkv_bias=True, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mask_id=r.num("mask_token_id", 151666), eos_id=r.num("eos_token_id", 151643),
            pad_id=r.num("pad_token_id", 151643), bos_id=cfg.get("bos_token_id"), logit_shift=1,
            max_positions=r.num("max_position_embeddings", 2048), sampler=cls.sampler,
            field_names=cls.field_names,
        )

    @classmethod
    def tiny_config(cls, mask: int = 3, eos: int = 0, vocab_size: int = 128, d_model: int = 64, n_layers: int = 2,
                    n_heads: int = 4, n_kv_heads: int | None = None, mlp_hidden: int = 128) -> dict:
        return {
            "model_type": "Dream", "architectures": ["DreamModel"], "hidden_size": d_model,
            "num_hidden_layers": n_layers, "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads or 2,
            "intermediate_size": mlp_hidden, "vocab_size": vocab_size, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": False, "max_position_embeddings": 2048,
            "mask_token_id": mask, "pad_token_id": eos, "bos_token_id": eos, "eos_token_id": eos,
            "torch_dtype": "float32",
        }
