"""ModelSpec: the architecture facts of a checkpoint, parsed from its ``config.json``.

Two families are understood, keyed on ``model_type`` (docs/MODELS.md §1.1 and §2.1):

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
    token i+1, docs/MODELS.md §2.5). ``eot_id`` is the end-of-turn token (``<|eot_id|>`` /
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
    """``cfg[key]`` as a whole number; ModelLoadError when it is missing or not one."""
    if key not in cfg:
        raise ModelLoadError(f"{path}: config.json has no '{key}' field; "
                             "is this an official LLaDA or Dream checkpoint?")
    return _num(cfg, key, path)


def spec_from_config(cfg: dict, path: Path | str = "config.json") -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed ``config.json``.

    Raises :class:`ModelLoadError` for an unknown ``model_type``, a missing or wrongly typed field, a
    special token id outside the vocabulary (:func:`check_token_ids`), or a value no model can have
    (:func:`check_spec`).
    """
    spec = _spec_from_config(cfg, Path(path))
    check_spec(spec, Path(path))
    return spec


def check_spec(spec: ModelSpec, path: Path | str = "config.json") -> None:
    """Refuse architecture values no checkpoint can have, with one line naming the field: sizes and
    counts must be ≥ 1, ``n_heads`` must divide the hidden size and ``n_kv_heads`` divide ``n_heads``
    (grouped-query attention shares each K/V head among n_heads / n_kv_heads query heads), RMSNorm's eps
    and RoPE's theta must be finite and > 0 (the special token ids: :func:`check_token_ids`, which
    :func:`spec_from_config` runs first). Field names are the family's config.json names. Raises
    ModelLoadError."""
    import math

    names = {"llada": {"d_model": "d_model", "n_layers": "n_layers", "n_heads": "n_heads", "n_kv_heads": "n_kv_heads",
                       "mlp_hidden": "mlp_hidden_size", "vocab_size": "embedding_size/vocab_size",
                       "max_positions": "max_sequence_length"},
             "dream": {"d_model": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                       "n_kv_heads": "num_key_value_heads", "mlp_hidden": "intermediate_size",
                       "vocab_size": "vocab_size", "max_positions": "max_position_embeddings"}}[spec.family]

    def bad(msg: str):
        return ModelLoadError(f"{path}: {msg}; the config.json is not a working checkpoint's (fix the value or "
                              "use the official config)")

    for field in ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden", "vocab_size", "max_positions"):
        v = getattr(spec, field)
        if v < 1:
            raise bad(f"{names[field]} is {v}; it must be ≥ 1")
    if spec.d_model % spec.n_heads:
        raise bad(f"{names['n_heads']} {spec.n_heads} does not divide {names['d_model']} {spec.d_model} "
                  "(each head takes hidden size / heads dimensions)")
    if spec.n_heads % spec.n_kv_heads:
        raise bad(f"{names['n_kv_heads']} {spec.n_kv_heads} does not divide {names['n_heads']} {spec.n_heads}")
    if spec.head_dim % 2:
        raise bad(f"the head size {spec.head_dim} ({names['d_model']} / {names['n_heads']}) is odd; RoPE rotates "
                  "pairs of dimensions")
    for field, key in (("rms_eps", "rms_norm_eps"), ("rope_theta", "rope_theta")):
        v = getattr(spec, field)
        if not (math.isfinite(v) and v > 0):
            raise bad(f"{key} is {v}; it must be a finite number > 0")


def _num(cfg: dict, key: str, path: Path, default=None, kind=int):
    """``cfg[key]`` (or ``default``) as ``kind``; a value of another type is a ModelLoadError naming it."""
    v = cfg.get(key, default)
    if v is None:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or float(v).is_integer())
    if not ok:
        raise ModelLoadError(f"{path}: config.json field {key!r} is {v!r}; it must be "
                             f"{'a whole number' if kind is int else 'a number'}")
    return kind(v)


def _heads(n: int, key: str, path: Path) -> int:
    """The head count, checked before it divides the hidden size."""
    if n < 1:
        raise ModelLoadError(f"{path}: {key} is {n}; it must be ≥ 1; the config.json is not a working checkpoint's "
                             "(fix the value or use the official config)")
    return n


def _spec_from_config(cfg: dict, path: Path) -> ModelSpec:
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
        n_heads = _heads(_need(cfg, "n_heads", path), "n_heads", path)
        n_kv = cfg.get("n_kv_heads") or (1 if cfg.get("multi_query_attention") else n_heads)
        mlp = cfg.get("mlp_hidden_size") or int(cfg.get("mlp_ratio", 4) * d)
        vocab = int(cfg.get("embedding_size") or _need(cfg, "vocab_size", path))
        if cfg.get("include_bias") or cfg.get("alibi") or not cfg.get("rope", True):
            raise ModelLoadError(f"{path}: LLaDA variants with biases, ALiBi or no RoPE are not supported")
        return ModelSpec(
            family="llada", d_model=d, n_layers=int(_need(cfg, "n_layers", path)), n_heads=n_heads,
            n_kv_heads=int(n_kv), head_dim=d // n_heads, mlp_hidden=int(mlp), vocab_size=vocab,
            rms_eps=_num(cfg, "rms_norm_eps", path, 1e-5, float),
            rope_theta=_num(cfg, "rope_theta", path, 10000.0, float),
            rope_full_precision=bool(cfg.get("rope_full_precision", True)),
            qkv_bias=bool(cfg.get("include_qkv_bias", False)), tie_embeddings=bool(cfg.get("weight_tying", False)),
            mask_id=_num(cfg, "mask_token_id", path, 126336), eos_id=_num(cfg, "eos_token_id", path, 126081),
            pad_id=_num(cfg, "pad_token_id", path, cfg.get("eos_token_id", 126081)),
            bos_id=cfg.get("bos_token_id"), logit_shift=0,
            max_positions=_num(cfg, "max_sequence_length", path, 4096),
        )
    if mtype == "dream":
        d = int(_need(cfg, "hidden_size", path))
        n_heads = _heads(_need(cfg, "num_attention_heads", path), "num_attention_heads", path)
        return ModelSpec(
            family="dream", d_model=d, n_layers=int(_need(cfg, "num_hidden_layers", path)), n_heads=n_heads,
            n_kv_heads=_num(cfg, "num_key_value_heads", path, n_heads), head_dim=d // n_heads,
            mlp_hidden=int(_need(cfg, "intermediate_size", path)), vocab_size=int(_need(cfg, "vocab_size", path)),
            rms_eps=_num(cfg, "rms_norm_eps", path, 1e-6, float), rope_theta=_num(cfg, "rope_theta", path, 1e6, float),
            rope_full_precision=False, qkv_bias=True, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mask_id=_num(cfg, "mask_token_id", path, 151666), eos_id=_num(cfg, "eos_token_id", path, 151643),
            pad_id=_num(cfg, "pad_token_id", path, 151643), bos_id=cfg.get("bos_token_id"), logit_shift=1,
            max_positions=_num(cfg, "max_position_embeddings", path, 2048),
        )
    raise ModelLoadError(
        f"{path}: model_type {cfg.get('model_type')!r} is not supported; "
        "ecache runs LLaDA ('llada') and Dream ('Dream') checkpoints"
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
