"""A ``tokenizer.json`` tokenizer that starts without importing transformers (a fast first answer).

Importing transformers takes 0.4-1.3 s of a cold ``ecache generate`` on a 2-core machine, while the
``tokenizers`` library it wraps loads the embedded 1,452-token vocabulary in milliseconds. For a
checkpoint whose ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` (the embedded model,
LLaDA), :class:`FastTokenizer` serves the calls the engine makes on every run straight from
``tokenizers.Tokenizer``:

- ``tok(text, add_special_tokens=...)["input_ids"]``, ``encode``, ``decode(ids, skip_special_tokens=...)``,
  ``len(tok)``, ``get_vocab``, ``convert_tokens_to_ids``: the same backend calls transformers'
  ``PreTrainedTokenizerFast`` makes (it is a wrapper of this very object);
- ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)``: the template rendered
  with jinja2 configured as transformers does (``chat_template_utils``: sandboxed environment,
  ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the ``tojson`` filter, ``raise_exception`` and
  ``strftime_now``, the special-token strings as variables).

Anything else (other attributes, extra keyword arguments, templates jinja2 cannot compile without
transformers' extensions) goes to the real transformers tokenizer, built on first use, so callers
may treat this as a ``PreTrainedTokenizerFast``. ``tests/test_fast_tokenizer.py`` checks that both
give the same ids, texts and templates. Directories with ``clean_up_tokenization_spaces`` set (a
decode rule of transformers, not of the backend) are not served by this class (see ``usable``).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Encoding(dict):
    """``{"input_ids": [...]}`` that also answers ``.input_ids`` (like transformers' BatchEncoding)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _content(tok) -> str | None:
    """A special token given as a string or as an AddedToken dict ({"content": ...})."""
    return tok.get("content") if isinstance(tok, dict) else tok


def usable(path: Path) -> bool:
    """Whether :class:`FastTokenizer` can serve ``path``: a PreTrainedTokenizerFast config, a
    tokenizer.json, and no transformers-side decode clean-up."""
    try:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(cfg, dict) and cfg.get("tokenizer_class") == "PreTrainedTokenizerFast"
            and (path / "tokenizer.json").is_file() and not cfg.get("clean_up_tokenization_spaces", False))


class FastTokenizer:
    """The transformers tokenizer API subset the engine uses, on ``tokenizers.Tokenizer`` (module docstring).

    Raises whatever ``tokenizers`` raises for an unreadable tokenizer.json (the loader turns it into a
    ModelLoadError).
    """

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self._path = Path(path)
        self._tk = Tokenizer.from_file(str(self._path / "tokenizer.json"))
        cfg = json.loads((self._path / "tokenizer_config.json").read_text())
        smap = {}
        if (self._path / "special_tokens_map.json").is_file():
            smap = json.loads((self._path / "special_tokens_map.json").read_text())
        self._specials = {k: _content(cfg.get(k, smap.get(k))) for k in SPECIAL_KEYS}
        self.chat_template = cfg.get("chat_template")
        self._template = None
        self._hf_tok = None

    # --- the hot path: backend calls

    def __call__(self, text: str, add_special_tokens: bool = True, **kwargs):
        if kwargs or not isinstance(text, str):
            return self._hf()(text, add_special_tokens=add_special_tokens, **kwargs)
        return Encoding(input_ids=self._tk.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self._hf().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs:
            return self._hf().decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tk.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            i = self._tk.token_to_id(tokens)
            return i if i is not None else self._hf().convert_tokens_to_ids(tokens)
        return [self.convert_tokens_to_ids(t) for t in tokens]

    # --- chat template

    def apply_chat_template(self, conversation, tokenize: bool = True, add_generation_prompt: bool = False, **kwargs):
        """Render ``conversation`` (a list of {role, content} dicts) as transformers does; token ids
        (no special tokens added, transformers' rule) when ``tokenize``."""
        simple = (not kwargs and self.chat_template and isinstance(conversation, list)
                  and all(isinstance(m, dict) for m in conversation))
        template = self._compiled() if simple else None
        if template is None:
            return self._hf().apply_chat_template(conversation, tokenize=tokenize,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)
        specials = {k: v for k, v in self._specials.items() if v is not None}
        text = template.render(messages=[dict(m) for m in conversation], add_generation_prompt=add_generation_prompt,
                               **specials)
        return self._tk.encode(text, add_special_tokens=False).ids if tokenize else text

    def _compiled(self):
        """The chat template compiled in transformers' jinja2 environment, or None when it needs more."""
        if self._template is None:
            import datetime

            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.exceptions.TemplateError:  # e.g. transformers' {% generation %} tag
                self._template = False
        return self._template or None

    def __getstate__(self) -> dict:
        """Picklable (worker processes): the compiled jinja2 template is rebuilt on demand."""
        return {**self.__dict__, "_template": None}

    # --- everything else: the real transformers tokenizer

    def _hf(self):
        if self._hf_tok is None:
            import transformers

            transformers.utils.logging.set_verbosity_error()
            with quiet_transformers():
                self._hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(self._path))
        return self._hf_tok

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._hf(), name)


@contextlib.contextmanager
def quiet_transformers():
    """Drop the ``FutureWarning`` and ``DeprecationWarning`` that transformers raises while it loads a
    checkpoint's tokenizer (AutoTokenizer reads config.json, and transformers' config class warns that
    its ``rope_scaling`` key, null in these checkpoints, is deprecated): library noise, not something the
    user can act on. Only warnings from transformers' own modules, only inside the block
    (``warnings.catch_warnings``); ecache's warnings and any other library's are untouched."""
    with warnings.catch_warnings():
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=r"transformers(\.|$)")
        yield
