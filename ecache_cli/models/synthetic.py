"""Random-weight checkpoints in the exact official on-disk formats (for tests and the GPU check).

``write_random_checkpoint`` writes config.json with the official field names, ``model.safetensors``
(or shards ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``) with the
official tensor names, and a small character-level tokenizer (tokenizer.json + tokenizer_config.json)
that AutoTokenizer loads. Nothing here is used to generate real text.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

from .dream import Dream
from .llada import LLaDA
from .spec import spec_from_config

LLADA_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>"]
DREAM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<|beginoftext|>"]
LLADA_CHAT = (
    "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
)
DREAM_CHAT = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_config(family: str, vocab_size: int = 128, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                n_kv_heads: int | None = None, mlp_hidden: int = 128, **ids) -> dict:
    """A config.json dict in the official field naming of ``family`` ("llada" or "dream")."""
    if family == "llada":
        return {
            "model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": d_model, "n_layers": n_layers,
            "n_heads": n_heads, "n_kv_heads": n_kv_heads or n_heads, "mlp_hidden_size": mlp_hidden,
            "activation_type": "silu", "block_type": "llama", "vocab_size": vocab_size, "embedding_size": vocab_size,
            "layer_norm_type": "rms", "rms_norm_eps": 1e-5, "include_bias": False, "include_qkv_bias": False,
            "rope": True, "rope_theta": 500000.0, "rope_full_precision": True, "alibi": False,
            "max_sequence_length": 4096, "weight_tying": False, "mask_token_id": ids.get("mask", 2),
            "eos_token_id": ids.get("eos", 1), "pad_token_id": ids.get("eos", 1), "torch_dtype": "float32",
        }
    return {
        "model_type": "Dream", "architectures": ["DreamModel"], "hidden_size": d_model,
        "num_hidden_layers": n_layers, "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads or 2,
        "intermediate_size": mlp_hidden, "vocab_size": vocab_size, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "max_position_embeddings": 2048,
        "mask_token_id": ids.get("mask", 3), "pad_token_id": ids.get("eos", 0), "bos_token_id": ids.get("eos", 0),
        "eos_token_id": ids.get("eos", 0), "torch_dtype": "float32",
    }


def write_char_tokenizer(out: Path, family: str) -> dict[str, int]:
    """Write a character-level tokenizer (specials first) loadable by AutoTokenizer; return special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = LLADA_SPECIALS if family == "llada" else DREAM_SPECIALS
    chars = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.save(str(out / "tokenizer.json"))
    if family == "llada":
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
               "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": LLADA_CHAT}
    else:
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
               "pad_token": "<|endoftext|>", "mask_token": "<|mask|>", "chat_template": DREAM_CHAT}
    cfg.update(add_bos_token=False, add_eos_token=False, clean_up_tokenization_spaces=False, model_max_length=4096)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return {t: vocab[t] for t in specials}


def write_random_checkpoint(out: str | Path, family: str = "llada", shards: int = 1, seed: int = 0,
                            scale: float = 0.5, dtype: torch.dtype = torch.float32, **cfg_overrides) -> Path:
    """Write a random checkpoint of ``family`` into ``out`` in the official layout; return ``out``.

    ``scale`` sets the init std of linear layers times 1/sqrt(fan_in) (large enough that the token
    distributions are not flat). ``shards`` > 1 writes a sharded checkpoint with an index.
    """
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_char_tokenizer(out, family)
    if family == "llada":
        cfg = tiny_config("llada", mask=ids["<|mdm_mask|>"], eos=ids["<|endoftext|>"], **cfg_overrides)
    else:
        cfg = tiny_config("dream", mask=ids["<|mask|>"], eos=ids["<|endoftext|>"], **cfg_overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    spec = spec_from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    model = (LLaDA if family == "llada" else Dream)(spec)
    state = {}
    for k, v in model.state_dict().items():
        if k.endswith("norm.weight") or k.endswith("ln_f.weight"):
            t = 1.0 + 0.1 * torch.randn(v.shape, generator=g)
        elif v.dim() == 1:  # biases
            t = 0.1 * torch.randn(v.shape, generator=g)
        else:
            t = torch.randn(v.shape, generator=g) * scale / v.shape[-1] ** 0.5
            if "embed" in k or "wte" in k:
                t = torch.randn(v.shape, generator=g)
        state[k] = t.to(dtype).contiguous()
    names = list(state)
    if shards <= 1:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in names[s * per:(s + 1) * per]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out
