"""ModelSpec: the architecture facts of a checkpoint, and the checks every family's ``config.json`` passes.

Each model family reads its own ``config.json`` field names into a :class:`ModelSpec`
(``models/families/<name>.py``, chosen by ``models/registry.py``); what is checked here is common to
all of them: counts and sizes ≥ 1, heads that divide the hidden size, special token ids inside the
vocabulary (docs/MODELS.md §1.1, §2.1 and the sections of each newer family).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..contract.lines import not_an_object
from ..errors import ModelLoadError


@dataclass(frozen=True)
class ModelSpec:
    """Architecture and special-token facts shared by the model code, the engine and the policies.

    ``family`` is the registry name of the checkpoint's family (``llada``, ``dream``, ``llada-moe``);
    ``sampler`` names the official sampler whose rules decode it (``llada``: LLaDA generate.py's
    schedule and remasking; ``dream``: Dream's ``diffusion_generate``), shared by every family built on
    that model. ``logit_shift`` is 0 when logits[i] predict token i (LLaDA, LLaDA-MoE) and 1 when they
    predict token i+1 (Dream and its coders, docs/MODELS.md §2.5). ``eot_id`` is the end-of-turn token
    and ``stop_ids`` any further ids that end an answer (DiffuCoder-Instruct's ``<|dlm_pad|>``), both
    filled in from the tokenizer by the loader.

    Mixture-of-experts layers (``n_experts`` > 0): ``experts_per_token`` experts of hidden size
    ``expert_hidden`` per token; ``moe_layers`` says which layers are MoE (the others are dense SwiGLU
    of ``mlp_hidden``), each MoE layer with a shared expert of ``shared_expert_hidden`` when > 0.
    ``rotary_dim``: RoPE rotates the first ``rotary_dim`` dimensions of each head (partial rotary; 0 = no
    rotation, None = all of them). ``qk_norm``: an RMSNorm over each head's query and key vectors before RoPE
    (weights (head_dim,)); ``clip_qkv``: q, k and v clamped to ±clip after it (None: no clamp).
    ``field_names`` maps the spec's fields to the family's config.json names, for error messages.

    Block diffusion (``block_causal``: SDAR, LLaDA2.x): attention is causal across blocks and bidirectional
    inside one, blocks counted from position 0 of each sequence; ``block_size`` is the block the model was
    trained with (the default ``--block-length``; None = no such default). A grouped router
    (``expert_groups`` > 1) keeps the ``expert_groups_kept`` best groups of consecutive experts before its
    top-k; ``routed_scaling`` multiplies the chosen experts' weights (LLaDA2, docs/MODELS.md §10).
    """

    family: str
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_hidden: int
    vocab_size: int  # embedding / lm-head rows
    rms_eps: float
    rope_theta: float
    rope_full_precision: bool  # LLaDA: rotate q/k in fp32; the others: cos/sin cast to the activation dtype
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
    sampler: str = "llada"
    qk_norm: bool = False
    clip_qkv: float | None = None
    rotary_dim: int | None = None  # dimensions of each head RoPE rotates (the first ones); None = all
    n_experts: int = 0
    experts_per_token: int = 0
    expert_hidden: int = 0
    shared_expert_hidden: int = 0  # an always-on SwiGLU expert beside the routed ones (0 = none)
    expert_bias: bool = False  # the router adds a learned per-expert bias (a buffer of the checkpoint)
    moe_layers: tuple[bool, ...] = ()
    stop_ids: tuple[int, ...] = ()
    field_names: tuple[tuple[str, str], ...] = ()
    block_causal: bool = False
    block_size: int | None = None
    expert_groups: int = 1
    expert_groups_kept: int = 1
    routed_scaling: float = 1.0

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Every id that ends an answer: EOS, end of turn, then ``stop_ids`` (no repeats, None left out)."""
        out = []
        for i in (self.eos_id, self.eot_id, *self.stop_ids):
            if i is not None and i not in out:
                out.append(i)
        return tuple(out)

    def is_moe(self, layer: int) -> bool:
        """Whether ``layer``'s feed-forward is a mixture of experts."""
        return self.n_experts > 0 and bool(self.moe_layers[layer])

    def name_of(self, field: str) -> str:
        """The family's config.json name of a spec field (the field's own name when none is declared)."""
        return dict(self.field_names).get(field, field)

    @property
    def n_params(self) -> int:
        """Parameter count implied by the shapes (embeddings and an untied head counted separately)."""
        d, hd = self.d_model, self.head_dim
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2
        if self.qkv_bias:
            attn += self.n_heads * hd + 2 * self.n_kv_heads * hd
        if self.qk_norm:
            attn += 2 * hd
        total = 0
        for i in range(self.n_layers):
            ffn = (self.n_experts * 3 * d * self.expert_hidden + self.n_experts * d
                   + 3 * d * self.shared_expert_hidden + self.n_experts * self.expert_bias) if self.is_moe(i) \
                else 3 * d * self.mlp_hidden
            total += attn + ffn + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + total + d + head

    @property
    def n_active_params(self) -> int:
        """Parameters one token's forward uses: :attr:`n_params` with each MoE layer's experts counted as
        ``experts_per_token`` of them (the router counted whole)."""
        skipped = sum(self.n_experts - self.experts_per_token for i in range(self.n_layers) if self.is_moe(i))
        return self.n_params - skipped * 3 * self.d_model * self.expert_hidden


class ConfigReader:
    """Typed access to a parsed ``config.json`` (``cfg``, read from ``path``), every failure a one-line
    :class:`ModelLoadError` naming the file and the field."""

    def __init__(self, cfg: dict, path: Path | str = "config.json", family_hint: str = "LLaDA or Dream"):
        self.cfg, self.path, self.family_hint = cfg, Path(path), family_hint

    def need(self, key: str) -> int:
        """``cfg[key]`` as a whole number; ModelLoadError when it is missing, null or not one."""
        if key not in self.cfg:
            raise ModelLoadError(f"{self.path}: config.json has no '{key}' field; is this an official "
                                 f"{self.family_hint} checkpoint?")
        if self.cfg[key] is None:
            raise ModelLoadError(f"{self.path}: config.json field {key!r} is null; it must be a whole number")
        return self.num(key)

    def num(self, key: str, default=None, kind=int):
        """``cfg[key]`` (or ``default`` when absent or null) as ``kind``; a value of another type is a
        ModelLoadError naming it."""
        v = self.cfg.get(key, default)
        if v is None:
            v = default
        if v is None:
            return None
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or float(v).is_integer())
        if not ok:
            raise ModelLoadError(f"{self.path}: config.json field {key!r} is {v!r}; it must be "
                                 f"{'a whole number' if kind is int else 'a number'}")
        return kind(v)

    def heads(self, key: str) -> int:
        """A head count, checked ≥ 1 before it divides the hidden size."""
        n = self.need(key)
        if n < 1:
            raise ModelLoadError(f"{self.path}: {key} is {n}; it must be ≥ 1; the config.json is not a working "
                                 "checkpoint's (fix the value or use the official config)")
        return n

    def refuse(self, msg: str) -> ModelLoadError:
        """A ModelLoadError ``<path>: <msg>``."""
        return ModelLoadError(f"{self.path}: {msg}")


def check_spec(spec: ModelSpec, path: Path | str = "config.json") -> None:
    """Refuse architecture values no checkpoint can have, with one line naming the field: sizes and
    counts must be ≥ 1, ``n_heads`` must divide the hidden size and ``n_kv_heads`` divide ``n_heads``
    (grouped-query attention shares each K/V head among n_heads / n_kv_heads query heads), RMSNorm's eps
    and RoPE's theta must be finite and > 0, a MoE's top-k within its experts. Field names are the
    family's config.json names (``spec.field_names``). Raises ModelLoadError."""
    name = spec.name_of

    def bad(msg: str):
        return ModelLoadError(f"{path}: {msg}; the config.json is not a working checkpoint's (fix the value or "
                              "use the official config)")

    for field in ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden", "vocab_size", "max_positions"):
        v = getattr(spec, field)
        if v < 1:
            raise bad(f"{name(field)} is {v}; it must be ≥ 1")
    if spec.d_model % spec.n_heads and "head_dim" not in dict(spec.field_names):
        raise bad(f"{name('n_heads')} {spec.n_heads} does not divide {name('d_model')} {spec.d_model} "
                  "(each head takes hidden size / heads dimensions)")
    if spec.n_heads % spec.n_kv_heads:
        raise bad(f"{name('n_kv_heads')} {spec.n_kv_heads} does not divide {name('n_heads')} {spec.n_heads}")
    rd = spec.head_dim if spec.rotary_dim is None else spec.rotary_dim
    if not 0 <= rd <= spec.head_dim or rd % 2:
        raise bad(f"{name('rotary_dim')} gives {rd} rotated dimensions of a {spec.head_dim}-dimension head; RoPE "
                  "rotates an even number of them, at most the head size")
    if spec.head_dim % 2 and rd:
        raise bad(f"the head size {spec.head_dim} ({name('d_model')} / {name('n_heads')}) is odd; RoPE rotates "
                  "pairs of dimensions")
    for field in ("rms_eps", "rope_theta"):
        v = getattr(spec, field)
        if not (math.isfinite(v) and v > 0):
            raise bad(f"{name(field)} is {v}; it must be a finite number > 0")
    if spec.moe_layers and any(spec.moe_layers) and spec.n_experts < 1:
        raise bad(f"{name('n_experts')} is {spec.n_experts} but {name('moe_layers')} makes layers MoE; it must be ≥ 1")
    if spec.n_experts:
        for field in ("experts_per_token", "expert_hidden"):
            if getattr(spec, field) < 1:
                raise bad(f"{name(field)} is {getattr(spec, field)}; it must be ≥ 1")
        if spec.experts_per_token > spec.n_experts:
            raise bad(f"{name('experts_per_token')} {spec.experts_per_token} is more than {name('n_experts')} "
                      f"{spec.n_experts}")
        if len(spec.moe_layers) != spec.n_layers:
            raise bad(f"{name('moe_layers')} lists {len(spec.moe_layers)} layers; the model has {spec.n_layers}")


def check_token_ids(spec: ModelSpec, path: Path | str = "config.json", config: dict | None = None) -> ModelSpec:
    """Check that the special token ids of ``spec`` (mask, EOS, pad, BOS) are rows of the model's
    vocabulary, ``0 ≤ id < vocab_size``: an id outside would fail deep inside the embedding lookup.
    Returns ``spec``; raises ModelLoadError naming the config field, its value and the vocabulary size, and,
    where ``config`` (the parsed config.json) lacks the field, that the value is the family's default."""
    fields = {"mask": ("mask_token_id", spec.mask_id), "eos": ("eos_token_id", spec.eos_id),
              "pad": ("pad_token_id", spec.pad_id), "bos": ("bos_token_id", spec.bos_id)}
    if spec.vocab_size < 1:
        raise ModelLoadError(f"{path}: {spec.name_of('vocab_size')} {spec.vocab_size} must be ≥ 1; the config.json "
                             "is damaged")
    for what, (key, value) in fields.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < spec.vocab_size:
            default = f", the {spec.family} family's default: config.json has no {key}" \
                if config is not None and key not in config else ""
            raise ModelLoadError(f"{path}: {key} {value!r} (the {what} token{default}) is outside the vocabulary of "
                                 f"{spec.vocab_size} tokens (ids 0..{spec.vocab_size - 1}); fix config.json or use "
                                 "the checkpoint's original one")
    return spec


def read_json_object(path: Path) -> dict:
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
        raise ModelLoadError(f"{path}: holds {not_an_object(data)}; is this a checkpoint's "
                             f"{path.name}?")
    return data
