"""ModelSpec: the architecture facts of a checkpoint, parsed from its ``config.json``.

Two families are understood, keyed on ``model_type`` (spec/models.md A1.1 and A2.1):

- ``llada`` (GSAI-ML/LLaDA-8B-*, LLaDA-1.5): OLMo-style field names (``d_model``, ``n_layers``, ...),
  no biases, plain MHA, RoPE applied in float32 (``rope_full_precision``), logits aligned (no shift).
- ``Dream`` (Dream-org/Dream-v0-*-7B): Qwen2 field names, q/k/v biases, GQA, RoPE cos/sin cast to the
  activation dtype, logits shifted by one (the hidden state at i-1 predicts token i).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ModelLoadError


@dataclass(frozen=True)
class ModelSpec:
    """Architecture and special-token facts shared by the model code, the engine and the policies.

    ``logit_shift`` is 0 for LLaDA (logits[i] predict token i) and 1 for Dream (logits[i] predict
    token i+1, spec/models.md A2.5). ``eot_id`` is the end-of-turn token (``<|eot_id|>`` /
    ``<|im_end|>``), filled in from the tokenizer by the loader when present.
    """

    family: str  # "llada" | "dream"
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_hidden: int
    vocab_size: int  # embedding / lm-head rows
    rms_eps: float
    rope_theta: float
    rope_full_precision: bool  # LLaDA: rotate q/k in fp32; Dream: cos/sin cast to activation dtype
    qkv_bias: bool
    tie_embeddings: bool
    mask_id: int
    eos_id: int
    pad_id: int
    bos_id: int | None = None
    eot_id: int | None = None
    logit_shift: int = 0
    max_positions: int = 4096
    eps: float = 1e-3  # Dream's last timestep: generation_config.json "eps" when present (Dream ships 1e-3)

    @property
    def n_params(self) -> int:
        """Parameter count implied by the shapes (embeddings and head counted separately)."""
        d, h = self.d_model, self.mlp_hidden
        attn = d * self.n_heads * self.head_dim * 2 + d * self.n_kv_heads * self.head_dim * 2
        if self.qkv_bias:
            attn += self.n_heads * self.head_dim + 2 * self.n_kv_heads * self.head_dim
        layer = attn + 3 * d * h + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * layer + d + head


def _need(cfg: dict, key: str, path: Path):
    if key not in cfg:
        raise ModelLoadError(f"{path}: config.json has no '{key}' field; is this an official LLaDA or Dream checkpoint?")
    return cfg[key]


def spec_from_config(cfg: dict, path: Path | str = "config.json") -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed ``config.json``.

    Raises :class:`ModelLoadError` for an unknown ``model_type``, a missing or wrongly typed field, or a
    special token id outside the vocabulary (:func:`check_token_ids`).
    """
    path = Path(path)
    mtype = str(cfg.get("model_type", "")).lower()
    try:
        spec = _spec_of(cfg, mtype, path)
    except (TypeError, ValueError) as e:  # e.g. "d_model": "abc" or null
        raise ModelLoadError(f"{path}: a config.json field has a wrong type ({e}); fix config.json or use the "
                             "checkpoint's original one") from None
    return check_token_ids(spec, path)


def _spec_of(cfg: dict, mtype: str, path: Path) -> ModelSpec:
    """:func:`spec_from_config` for a known ``mtype`` (its int/float conversions may raise)."""
    if mtype == "llada":
        d = int(_need(cfg, "d_model", path))
        n_heads = int(_need(cfg, "n_heads", path))
        n_kv = cfg.get("n_kv_heads") or (1 if cfg.get("multi_query_attention") else n_heads)
        mlp = cfg.get("mlp_hidden_size") or int(cfg.get("mlp_ratio", 4) * d)
        vocab = int(cfg.get("embedding_size") or _need(cfg, "vocab_size", path))
        if cfg.get("include_bias") or cfg.get("alibi") or not cfg.get("rope", True):
            raise ModelLoadError(f"{path}: LLaDA variants with biases, ALiBi or no RoPE are not supported")
        return ModelSpec(
            family="llada", d_model=d, n_layers=int(_need(cfg, "n_layers", path)), n_heads=n_heads,
            n_kv_heads=int(n_kv), head_dim=d // n_heads, mlp_hidden=int(mlp), vocab_size=vocab,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-5)), rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_full_precision=bool(cfg.get("rope_full_precision", True)),
            qkv_bias=bool(cfg.get("include_qkv_bias", False)), tie_embeddings=bool(cfg.get("weight_tying", False)),
            mask_id=int(cfg.get("mask_token_id", 126336)), eos_id=int(cfg.get("eos_token_id", 126081)),
            pad_id=int(cfg.get("pad_token_id", cfg.get("eos_token_id", 126081))),
            bos_id=cfg.get("bos_token_id"), logit_shift=0,
            max_positions=int(cfg.get("max_sequence_length", 4096)),
        )
    if mtype == "dream":
        d = int(_need(cfg, "hidden_size", path))
        n_heads = int(_need(cfg, "num_attention_heads", path))
        return ModelSpec(
            family="dream", d_model=d, n_layers=int(_need(cfg, "num_hidden_layers", path)), n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads", n_heads)), head_dim=d // n_heads,
            mlp_hidden=int(_need(cfg, "intermediate_size", path)), vocab_size=int(_need(cfg, "vocab_size", path)),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(cfg.get("rope_theta", 1e6)),
            rope_full_precision=False, qkv_bias=True, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mask_id=int(cfg.get("mask_token_id", 151666)), eos_id=int(cfg.get("eos_token_id", 151643)),
            pad_id=int(cfg.get("pad_token_id", 151643)), bos_id=cfg.get("bos_token_id"), logit_shift=1,
            max_positions=int(cfg.get("max_position_embeddings", 2048)),
        )
    raise ModelLoadError(
        f"{path}: model_type {cfg.get('model_type')!r} is not supported; ecache runs LLaDA ('llada') and Dream ('Dream') checkpoints"
    )


def read_spec(model_dir: Path) -> tuple[ModelSpec, dict]:
    """Read ``model_dir/config.json`` and return (spec, raw config dict). Raises ModelLoadError.

    ``spec.eps`` comes from ``generation_config.json`` beside it when that file has an ``eps`` (Dream's
    diffusion_generate reads its timesteps' end from there); a missing file keeps 1e-3.
    """
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{model_dir}: no config.json; point --model at a checkpoint directory")
    cfg = _read_json_object(path)
    spec = spec_from_config(cfg, path)
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        eps = _read_json_object(gen_path).get("eps")
        if eps is not None:
            if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
                raise ModelLoadError(f"{gen_path}: eps {eps!r} must be a number in [0, 1) (Dream ships 1e-3)")
            spec = replace(spec, eps=float(eps))
    return spec, cfg


def _read_json_object(path: Path) -> dict:
    """A checkpoint's JSON file as a dict: UTF-8 text holding one JSON object, else a one-line
    ModelLoadError naming the file and what is wrong."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror}); check the checkpoint folder") from None
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); the file "
                             "is damaged: download or copy the checkpoint again") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e.msg}, line {e.lineno}); the file is damaged: download "
                             "or copy the checkpoint again") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: holds a JSON {type(data).__name__}, not an object; is this a checkpoint's "
                             f"{path.name}?")
    return data


def check_token_ids(spec: ModelSpec, path: Path | str = "config.json") -> ModelSpec:
    """Check that the special token ids of ``spec`` (mask, EOS, pad, BOS) are rows of the model's
    vocabulary, ``0 ≤ id < vocab_size``: an id outside would fail deep inside the embedding lookup.
    Returns ``spec``; raises ModelLoadError naming the config field, its value and the vocabulary size."""
    fields = {"mask": ("mask_token_id", spec.mask_id), "eos": ("eos_token_id", spec.eos_id),
              "pad": ("pad_token_id", spec.pad_id), "bos": ("bos_token_id", spec.bos_id)}
    if spec.vocab_size < 1:
        raise ModelLoadError(f"{path}: vocab_size {spec.vocab_size} must be ≥ 1; the config.json is damaged")
    for what, (key, value) in fields.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < spec.vocab_size:
            raise ModelLoadError(f"{path}: {key} {value!r} (the {what} token) is outside the vocabulary of "
                                 f"{spec.vocab_size} tokens (ids 0..{spec.vocab_size - 1}); fix config.json or use "
                                 "the checkpoint's original one")
    return spec
