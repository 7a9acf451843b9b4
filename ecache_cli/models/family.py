"""The model-family interface: what one file under ``models/families/`` declares.

A family reads its own ``config.json`` (which ``model_type`` / ``architectures`` it claims, the field
names and their ranges), builds its model under the official state-dict names, names its special
tokens, says which official sampler decodes it, and lists its aliases (Hugging Face repositories).
``models/registry.py`` finds the family files and picks the one that claims a config; nothing else in
``models/`` or ``engine/`` names a family. Each family also describes a tiny checkpoint of its own
shape (:meth:`Family.tiny_config`, tokenizer specials, chat template) that the tests and
``models/synthetic.py`` write in its exact official layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from .spec import ConfigReader, ModelSpec


@dataclass(frozen=True)
class Alias:
    """A short name for a public checkpoint: its Hugging Face ``repo``, its parameter count ``params``
    (from the official config.json, for ``ecache models`` before anything is downloaded), what it is
    (``kind``: e.g. "Instruct"), for a mixture of experts the parameters one token uses (``active``; 0 =
    all), and the embedding and LM head's parameters (``outer``: what ``--quantize`` leaves in the compute
    dtype; 0 = unknown)."""

    repo: str
    params: int
    kind: str = ""
    active: int = 0
    outer: int = 0


class Family:
    """One model family (subclass per file of ``models/families/``).

    Class attributes:
        name: the registry name, also ``ModelSpec.family`` (``llada-moe``).
        title: one line for people (``ecache models``), e.g. "LLaDA-MoE (OLMoE-style MoE, bidirectional)".
        sampler: the official sampler whose rules decode it (``ModelSpec.sampler``: "llada" | "dream").
        model_class: the ``DiffusionLM`` subclass built under the official tensor names.
        aliases: short name -> :class:`Alias`.
        mask_token, eot_token: token strings looked up in the tokenizer (a mask id in config.json wins;
            the end-of-turn id comes from the tokenizer alone); None = none.
        stop_tokens: further token strings that end an answer when the tokenizer has them.
        fixture_specials, fixture_tokenizer_config: the tiny checkpoint's special tokens (in id order from
            0) and tokenizer_config.json entries (``chat_template`` included); fixture_mask and fixture_eos
            name its mask and EOS tokens among them.
        field_names: (spec field, config.json name) pairs for error messages (``ModelSpec.field_names``).
        decode_defaults: decode settings of the family's official loop (``DecodeConfig`` names) that replace
            ecache's defaults for its models, below any profile and flag (block diffusion: the block
            the models were trained with and the official threshold).
        cache_default: the cache policy its models run without --cache or a profile's (None: ecache's).
        block_causal: its attention is block-causal (block diffusion), as its specs say.
    """

    name: ClassVar[str]
    title: ClassVar[str]
    sampler: ClassVar[str]
    model_class: ClassVar[type]
    aliases: ClassVar[dict[str, Alias]] = {}
    mask_token: ClassVar[str | None] = None
    eot_token: ClassVar[str | None] = None
    stop_tokens: ClassVar[tuple[str, ...]] = ()
    fixture_specials: ClassVar[list[str]] = []
    fixture_tokenizer_config: ClassVar[dict] = {}
    fixture_mask: ClassVar[str]
    fixture_eos: ClassVar[str]
    field_names: ClassVar[tuple[tuple[str, str], ...]] = ()
    block_causal: ClassVar[bool] = False  # block diffusion (``ModelSpec.block_causal``)
    decode_defaults: ClassVar[dict] = {}
    cache_default: ClassVar[str | None] = None

    @classmethod
    def short_title(cls) -> str:
        """The title without its parenthesis, e.g. "LLaDA-MoE", for messages."""
        return cls.title.split(" (")[0]

    @classmethod
    def claims(cls, cfg: dict) -> bool:  # pragma: no cover - abstract
        """Whether a parsed config.json is this family's (exactly one family claims any config)."""
        raise NotImplementedError

    @classmethod
    def read(cls, cfg: ConfigReader) -> ModelSpec:  # pragma: no cover - abstract
        """The :class:`ModelSpec` of a config this family claims (range checks follow in the registry).
        Raises ModelLoadError for a missing or wrongly typed field or a variant the family cannot run."""
        raise NotImplementedError

    @classmethod
    def tiny_config(cls, mask: int, eos: int, vocab_size: int = 128, d_model: int = 64, n_layers: int = 2,
                    n_heads: int = 4, n_kv_heads: int | None = None,
                    mlp_hidden: int = 128) -> dict:  # pragma: no cover - abstract
        """A config.json of this family's exact field names and shape, shrunk to the sizes given, with the
        mask and EOS ids ``mask`` and ``eos`` (the ids of ``fixture_mask`` and ``fixture_eos`` in the tiny
        tokenizer)."""
        raise NotImplementedError

    @classmethod
    def complete(cls, spec: ModelSpec, vocab: dict[str, int]) -> ModelSpec:
        """``spec`` with the ids only the tokenizer knows (``vocab``: token -> id, empty when no tokenizer
        is at hand): the end-of-turn id and further stop ids. A family whose config.json lacks some special
        ids (LLaDA-MoE: the mask and EOS) overrides this to take them from ``vocab``."""
        eot = vocab.get(cls.eot_token) if cls.eot_token else None
        stops = tuple(vocab[t] for t in cls.stop_tokens if t in vocab)
        return replace(spec, eot_id=eot, stop_ids=stops)
