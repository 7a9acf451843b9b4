"""Whether a string is UTF-8 text, and where it stops being so: the one rule every input path applies
(prompt arguments, piped lines, ``--input`` and ``--data`` records, the Python API). This module imports
nothing of ecache."""

from __future__ import annotations


def lone_surrogate(text: str) -> tuple[int, int] | None:
    """The first character of ``text`` that UTF-8 cannot encode (a lone surrogate, which the tokenizer
    rejects), as (1-based character position, code point), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start + 1, ord(text[e.start])
    return None


def read_byte_words(code: int) -> str:
    """Words for a lone surrogate in text that was read from bytes: Python hands an undecodable byte over
    (argv, stdin read with ``surrogateescape``) as U+DC80–U+DCFF, named by the byte it stands for
    (``byte 0xe9``); any other is named by its code point (``a lone surrogate U+D800``)."""
    return f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"


def not_text_words(text: str, from_bytes: bool = True) -> str | None:
    """``not UTF-8 text (byte 0xe9 at character 4)`` for ``text`` holding a character UTF-8 cannot encode,
    else None: the words every input path uses for such text. ``from_bytes``: ``text`` was decoded from
    bytes, so the character is named by :func:`read_byte_words`; else (a JSON string's escape) by its code
    point (``a lone surrogate U+DCE9``)."""
    bad = lone_surrogate(text)
    if bad is None:
        return None
    what = read_byte_words(bad[1]) if from_bytes else f"a lone surrogate U+{bad[1]:04X}"
    return f"not UTF-8 text ({what} at character {bad[0]})"


def json_text_error(text: str, where: str) -> str | None:
    """Why a JSON string is no text (None: it is UTF-8 text): one holding a lone surrogate (``"\\ud800"``:
    valid JSON, but no UTF-8 text the tokenizer can take), ``where is not UTF-8 text (a lone surrogate
    U+D800 at character 2); write the text itself, not a surrogate escape``. The words of an ``--input``
    record's field, a ``--data`` line's and a server request's."""
    words = not_text_words(text, from_bytes=False)
    return None if words is None else f"{where} is {words}; write the text itself, not a surrogate escape"


def yaml_text(value) -> str:
    """``value`` written as YAML, for a message about a profile's value: a text in single quotes
    (``'int2'``; a quote inside doubled, as YAML writes it), anything else in YAML's flow style (``null``,
    ``true``, ``5``, ``[int8]``, ``{a: 1}``), never a Python repr (``None``, ``['int8']``)."""
    import yaml

    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip()
    return text.removesuffix("\n...")  # the end-of-document mark after a scalar
