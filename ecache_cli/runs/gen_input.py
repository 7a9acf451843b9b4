"""``ecache generate --input``: every record read and checked before anything is decoded.

A record is invalid when its line is not UTF-8, not JSON, has no usable prompt field (``prompt``,
``messages`` or ``prompt_ids``: ``inputs.prompt_of``), holds token ids the model cannot take
(``Engine.check_prompt_ids``), cannot be templated or tokenized (``Engine.encode``), or does not fit
the canvas: its token count after the chat template plus ``--gen-length`` must not exceed the
model's positions (``ModelSpec.max_positions``; the engine's own rule, ``engine/core.py`` ``Run``).
Without ``--skip-invalid`` one error names every invalid line with its fix and nothing is decoded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError, EcacheError, UsageError
from .inputs import is_stdin, jsonl_lines, prompt_of


@dataclass
class Item:
    """One prompt of a generate run, in input order.

    ``index``: 0-based among the input's records (blank lines are not records; invalid records count,
    so a record's index and random stream do not depend on whether an earlier one is valid);
    ``line``: 1-based line in the file or stdin (the argument's position for prompt arguments);
    ``rec``: the parsed record (None when the line is not a JSON value); ``prompt``: what to encode
    (text, messages or token ids), None when invalid; ``error``: why it is invalid (a one-line
    reason naming ``file:line`` and the fix), else None; ``ids``: the prompt's token ids when
    :func:`read_input` already encoded it (the decode reuses them), else None.
    """

    index: int
    line: int
    rec: object
    prompt: object
    error: str | None = None
    ids: list[int] | None = None


def read_input(input_file: Path, engine, chat: bool, gen_length: int) -> list[Item]:
    """Every record of ``--input`` (``-``: stdin) as an :class:`Item`, each checked (module docstring).

    Raises DataError when the file cannot be read at all, or holds no record."""
    name = "stdin" if is_stdin(input_file) else str(input_file)
    limit = engine.spec.max_positions
    items: list[Item] = []
    for n, line in jsonl_lines(input_file, lenient=True):
        where = f"{name}:{n}"
        if line is not None and not line.strip():
            continue
        item = Item(index=len(items), line=n, rec=None, prompt=None)
        items.append(item)
        if line is None:
            item.error = f"{where}: not UTF-8 text; save the file as UTF-8 JSONL"
            continue
        try:
            item.rec = json.loads(line)
        except json.JSONDecodeError as e:
            item.error = f"{where}: not valid JSON ({e.msg}); each line must be one JSON object"
            continue
        try:
            prompt = prompt_of(item.rec, where)
        except DataError as e:
            item.error = str(e)
            continue
        if isinstance(item.rec.get("prompt_ids"), list):
            why = engine.check_prompt_ids(prompt)
            if why:
                item.error = f"{where}: {why}; give ids of the model's tokenizer"
                continue
        try:
            (ids,) = engine.encode([prompt], chat)
        except EcacheError as e:
            item.error = f"{where}: {e}"
            continue
        if len(ids) + gen_length > limit:
            templated = isinstance(item.rec.get("messages"), list) or (chat and "prompt_ids" not in item.rec)
            templ = " after the chat template" if templated else ""
            fit = limit - gen_length
            fix = (f"shorten it to at most {fit} tokens or lower --gen-length to at most {limit - len(ids)}"
                   if limit - len(ids) > 0 else f"shorten it to at most {fit} tokens" if fit > 0
                   else "lower --gen-length")
            item.error = (f"{where}: the prompt ({len(ids)} tokens{templ}) + --gen-length {gen_length} exceeds the "
                          f"model's {limit} positions; {fix}")
            continue
        item.prompt, item.ids = prompt, ids
    return items


def invalid_error(items: list[Item], input_file: Path, shown: int = 10) -> UsageError | None:
    """The one-line error for the invalid records of ``items`` (None when all are valid): each bad
    line with its reason (the first ``shown``; the rest by line number), and the way out."""
    bad = [it for it in items if it.error is not None]
    if not bad:
        return None
    reasons = "; ".join(it.error for it in bad[:shown])
    if len(bad) > shown:
        rest = [str(it.line) for it in bad[shown:]]
        reasons += f"; and {len(rest)} more at line{'s' if len(rest) > 1 else ''} {', '.join(rest)}"
    return UsageError(f"--input {input_file}: {len(bad)} of {len(items)} record(s) invalid, nothing decoded: "
                      f"{reasons}; "
                      "fix them, or pass --skip-invalid to decode the others (each invalid line gets an error record)")
