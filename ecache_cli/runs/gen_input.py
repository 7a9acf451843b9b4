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
import re
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
    """The one-line error for the invalid records of ``items`` (None when all are valid): each reason
    once with the lines that have it (``file:3: …`` for one line, ``file lines 1-3, 7: …`` for several;
    the first ``shown`` reasons, the other lines by number), and the way out."""
    bad = [it for it in items if it.error is not None]
    if not bad:
        return None
    groups: dict[str, tuple[str, list[int]]] = {}  # reason -> (where the lines are, the lines)
    for it in bad:
        m = re.match(rf"(.*):{it.line}: (.*)", it.error, re.S)  # "file:line: reason"
        name, reason = (m.group(1), m.group(2)) if m else (str(input_file), it.error)
        groups.setdefault(reason, (name, []))[1].append(it.line)
    parts = [f"{name}:{lines[0]}: {reason}" if len(lines) == 1 else f"{name} lines {_line_ranges(lines)}: {reason}"
             for reason, (name, lines) in list(groups.items())[:shown]]
    reasons = "; ".join(parts)
    if len(groups) > shown:
        rest = sorted(line for _, (_, lines) in list(groups.items())[shown:] for line in lines)
        reasons += f"; and {len(rest)} more at line{'s' if len(rest) > 1 else ''} {_line_ranges(rest)}"
    return UsageError(f"--input {input_file}: {len(bad)} of {len(items)} record(s) invalid, nothing decoded: "
                      f"{reasons}; "
                      "fix them, or pass --skip-invalid to decode the others (each invalid line gets an error record)")


def _line_ranges(lines: list[int]) -> str:
    """Ascending line numbers as ranges: [1, 2, 3, 7] -> ``1-3, 7``."""
    out, start = [], None
    for i, n in enumerate(lines):
        if start is None:
            start = n
        if i + 1 == len(lines) or lines[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)
