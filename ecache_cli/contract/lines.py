"""How a JSONL source's bad lines are worded: the reasons a line is no JSON record (not UTF-8, not
JSON) and the one-line summary that names every bad line, grouped by reason (``FILE:3: …``, ``FILE lines
1-3, 7: …``). ``--input`` records (every prompt command) and ``--data`` lines (the benchmarks) both use
it, so a bad line reads the same whichever flag read it. This module imports nothing of ecache beyond
``contract``."""

from __future__ import annotations

import json

from .text import not_text_words

#: The fix of a JSONL line that is not UTF-8, read from a file and from stdin (``-``).
SAVE_JSONL = "save the file as UTF-8 JSONL"
PIPE_JSONL = "pipe UTF-8 JSONL"


def json_kind(value) -> str:
    """The JSON name of a parsed value's type, as an error names what a line holds instead of an object:
    ``array``, ``string``, ``number``, ``true``/``false``, ``null`` (``object`` for a dict)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    names = {dict: "object", list: "array", str: "string", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def not_an_object(value) -> str:
    """``a JSON array, not an object``: what a JSONL line or a JSON file holds where an object was wanted."""
    return f"a JSON {json_kind(value)}, not an object"


def parse_json_line(line: str, where: str, piped: bool = False) -> tuple[object, str | None]:
    """(the JSON value of ``line``, None), or (None, why it is none) in the shared words: ``where: not
    UTF-8 text (byte 0xe9 at character 4); save the file as UTF-8 JSONL`` (``piped``: the line came from
    stdin, ``pipe UTF-8 JSONL``) for a line holding a byte that is not UTF-8 (read as a lone surrogate:
    ``sources.split_lines``) and ``where: not valid JSON (Expecting value); each line must be one JSON
    object`` for one that does not parse. ``where`` is ``FILE:LINE`` (``stdin:LINE``)."""
    words = not_text_words(line)
    if words is not None:
        return None, f"{where}: {words}; {PIPE_JSONL if piped else SAVE_JSONL}"
    try:
        return json.loads(line), None
    except json.JSONDecodeError as e:
        return None, f"{where}: not valid JSON ({e.msg}); each line must be one JSON object"


def bad_lines_summary(bad: list[tuple[int, str]], total: int, head: str, what: str, shown: int = 10) -> str:
    """``HEAD: 4 of 5 WHAT(s) invalid, nothing decoded: …``: each reason of ``bad`` ((line, error) in
    line order, an error worded ``NAME:LINE: reason``) once, with the lines that have it (``NAME:3:
    reason`` for one line, ``NAME lines 1-3, 7: reason`` for several); the first ``shown`` reasons, the
    other lines by number. ``total``: the source's records; ``what``: ``record`` or ``line``."""
    groups: dict[str, tuple[str, list[int]]] = {}  # reason -> (where the lines are, the lines)
    for line, error in bad:
        name, sep, reason = error.partition(f":{line}: ")
        name, reason = (name, reason) if sep else (head, error)
        groups.setdefault(reason, (name, []))[1].append(line)
    parts = [f"{name}:{lines[0]}: {reason}" if len(lines) == 1 else f"{name} lines {line_ranges(lines)}: {reason}"
             for reason, (name, lines) in list(groups.items())[:shown]]
    reasons = "; ".join(parts)
    if len(groups) > shown:
        rest = sorted(line for _, (_, lines) in list(groups.items())[shown:] for line in lines)
        reasons += f"; and {len(rest)} more at line{'s' if len(rest) > 1 else ''} {line_ranges(rest)}"
    return f"{head}: {len(bad)} of {total} {what}(s) invalid, nothing decoded: {reasons}"


def line_ranges(lines: list[int]) -> str:
    """Ascending line numbers as ranges: [1, 2, 3, 7] -> ``1-3, 7``."""
    out, start = [], None
    for i, n in enumerate(lines):
        if start is None:
            start = n
        if i + 1 == len(lines) or lines[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)
