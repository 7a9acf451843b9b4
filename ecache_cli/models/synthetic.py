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

from .registry import FAMILIES, spec_from_config

#: :func:`tiny_config`'s family-neutral shape arguments.
SHAPE_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden")


def tiny_config(family: str, vocab_size: int = 128, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                n_kv_heads: int | None = None, mlp_hidden: int = 128, mask: int | None = None,
                eos: int | None = None) -> dict:
    """A config.json dict in the official field naming of ``family`` (a registry name: ``llada``,
    ``dream``, ``llada-moe``, ...), shrunk to the sizes given; ``mask`` / ``eos`` default to the ids of
    the family's mask and EOS tokens in the tiny tokenizer (:func:`write_char_tokenizer`)."""
    fam = FAMILIES[family]
    ids = {t: i for i, t in enumerate(fam.fixture_specials)}
    return fam.tiny_config(mask=ids[fam.fixture_mask] if mask is None else mask,
                           eos=ids[fam.fixture_eos] if eos is None else eos, vocab_size=vocab_size, d_model=d_model,
                           n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, mlp_hidden=mlp_hidden)


def write_char_tokenizer(out: Path, family: str, size: int | None = None) -> dict[str, int]:
    """Write a character-level tokenizer (the family's specials first) loadable by AutoTokenizer, with the
    family's tokenizer_config.json entries (chat template included); return the special ids. ``size``:
    pad the vocabulary with reserved tokens ``<|reserved_i|>`` to that many ids (a tokenizer covering every
    row of the model, as the official ones do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    fam = FAMILIES[family]
    specials = list(fam.fixture_specials)
    chars = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    reserved = [f"<|reserved_{i}|>" for i in range(max(0, (size or 0) - len(specials) - len(chars)))]
    vocab = {t: i for i, t in enumerate(specials + chars + reserved)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials + reserved)
    tok.save(str(out / "tokenizer.json"))
    cfg = dict(fam.fixture_tokenizer_config)
    cfg.update(add_bos_token=False, add_eos_token=False, clean_up_tokenization_spaces=False, model_max_length=4096)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return {t: vocab[t] for t in specials}


def random_state(model, seed: int, scale: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random weights for every tensor of ``model``'s state dict: norms 1 + 0.1·N(0, 1), biases
    0.1·N(0, 1), embeddings N(0, 1), matrices N(0, 1)·scale/sqrt(fan_in) (large enough that the token
    distributions are not flat)."""
    g = torch.Generator().manual_seed(seed)
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
    return state


def write_random_checkpoint(out: str | Path, family: str = "llada", shards: int = 1, seed: int = 0,
                            scale: float = 0.5, dtype: torch.dtype = torch.float32, **cfg_overrides) -> Path:
    """Write a random checkpoint of ``family`` into ``out`` in the official layout; return ``out``.
    ``cfg_overrides``: the shape arguments of :func:`tiny_config` (``SHAPE_KEYS``, family-neutral names)
    and any config.json fields under the family's own names, set over the tiny config.

    ``scale`` sets the init std of linear layers times 1/sqrt(fan_in) (large enough that the token
    distributions are not flat). ``shards`` > 1 writes a sharded checkpoint with an index.
    """
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_char_tokenizer(out, family)  # the family's specials first: the ids tiny_config assumes
    fam = FAMILIES[family]
    shape = {k: cfg_overrides.pop(k) for k in SHAPE_KEYS if k in cfg_overrides}
    cfg = {**tiny_config(family, **shape), **cfg_overrides}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    model = fam.model_class(spec_from_config(cfg, vocab=ids))
    state = random_state(model, seed, scale, dtype)
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
