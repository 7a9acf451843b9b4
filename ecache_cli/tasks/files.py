"""Shared loading for the file-backed benchmarks (gsm8k, math500, humaneval, mbpp).

Data is read from local files in the official JSONL formats (plain or ``.gz``), never downloaded:
``--data PATH`` (a file, or a folder holding the default file name), else
``~/.cache/ecache/data/<task>/<default file>``; ``--data`` also takes ``-`` (stdin), a named pipe,
``/dev/stdin`` or ``<(...)``, read by the reader ``--input`` uses (``ecache_cli/sources.py``). The Hugging
Face datasets cache stores Arrow files, not the official JSONL, so it is not searched. A missing or
unreadable source raises ``DataError`` naming the path (exit 1); malformed lines (not UTF-8, not JSON,
a field missing) a ``UsageError`` naming every one (exit 2), as ``--input`` does, and so does an empty
source.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

from ecache_cli.contract.lines import bad_lines_summary, not_an_object, parse_json_line
from ecache_cli.contract.text import json_text_error
from ecache_cli.errors import DataError, UsageError
from ecache_cli.sources import check_readable, is_stdin, read_lines
from ecache_cli.tasks.base import Example, Task, sample_indices

DEFAULT_DATA_DIR = Path.home() / ".cache" / "ecache" / "data"


def read_jsonl(path: Path, fields: tuple[str, ...] = (), task: str = "the task") -> list[tuple[str, dict]]:
    """Return the JSON objects of a ``--data`` source (``-``: stdin; any readable path: a file, a named
    pipe, ``/dev/stdin``, ``<(...)``; gzip data decompressed), each checked to hold ``fields``, each with
    where it was read (``FILE:LINE``, ``stdin:LINE``), in file order.

    The source is read in full by the reader ``--input`` uses (``sources.read_lines``) and every line
    checked before any is used: a line that is not UTF-8, not a JSON object or lacks a field is named,
    all of them in one ``UsageError`` (exit 2) with the fix, worded as ``--input``'s bad records are
    (``contract.lines``: ``FILE:3: not valid JSON (…)``), and so is a source with no record (empty
    or blank; README: empty input is a usage error in every command). Raises ``DataError`` (exit 1)
    only when the source cannot be read at all (missing, unreadable, damaged gzip).
    """
    piped = is_stdin(path)
    name = "stdin" if piped else str(path)
    rows, bad, total = [], [], 0
    for lineno, line in read_lines(path, "--data"):
        if line.strip():
            total += 1
            why = _bad_row(line, fields, rows, f"{name}:{lineno}", piped)
            if why:
                bad.append((lineno, why))
    need = f" with the fields {', '.join(fields)}" if fields else ""
    if bad:
        raise UsageError(f"{bad_lines_summary(bad, total, f'--data {path}', 'line', shown=5)}; each line must be "
                         f"one UTF-8 JSON object{need} (the official {task} format)")
    if not rows:
        raise UsageError(f"--data {path} holds no record (it is empty or blank); give the official {task} JSONL, "
                         f"one JSON object{need} per line")
    return rows


def _bad_row(line: str, fields: tuple[str, ...], rows: list[dict], where: str, piped: bool) -> str | None:
    """Append ``(where, the JSON object of line)`` to ``rows``; else say why it is not one, or which fields
    it lacks, in ``--input``'s words (``contract.lines``; ``where``: ``FILE:LINE``; ``piped``: read from stdin)."""
    row, error = parse_json_line(line, where, piped)
    if error is not None:
        return error
    if not isinstance(row, dict):
        return f"{where}: {not_an_object(row)}"
    missing = [k for k in fields if k not in row]
    if missing:
        return f"{where}: lacks {', '.join(missing)}"
    for key, value in row.items():  # "\ud800" is valid JSON but no UTF-8 text the tokenizer can take
        why = json_text_error(str(value), f"{where}: {key!r}")
        if why:
            return why
    rows.append((where, row))
    return None


class FileTask(Task):
    """A benchmark read from one local JSONL file; only the "test" split exists.

    Subclasses set ``filename`` and ``fields`` (required keys) and implement ``to_example``. The file is
    read on first use, so a task can be built (e.g. to score) without its data.
    """

    filename: str = ""
    alt_filenames: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()

    def __init__(self, data: str | None = None, allow_code_execution: bool = False) -> None:
        super().__init__(data, allow_code_execution)
        self._items: list[Example] | None = None

    def data_path(self) -> Path:
        """Return the file to read: ``--data`` (file or folder) or the default location; may not exist."""
        if self.data == "-":  # stdin (read_jsonl)
            return Path("-")
        base = Path(self.data).expanduser() if self.data is not None else DEFAULT_DATA_DIR / self.name
        if base.is_dir() or self.data is None:
            for fname in (self.filename, *self.alt_filenames):
                if (base / fname).is_file():
                    return base / fname
            return base / self.filename
        return base

    def items(self) -> list[Example]:
        """Return every example of the file in file order; raises ``DataError`` if missing or unreadable,
        ``UsageError`` naming every malformed line (``read_jsonl``)."""
        if self._items is None:
            path = self.data_path()
            if not is_stdin(path) and not path.exists() and self.data is not None:  # --data names nothing
                what = f"the folder has no {self.filename}" if path.parent.is_dir() and path.parent == \
                    Path(self.data).expanduser() else "no such file or folder"
                raise DataError(f"--data {self.data}: {what}; give the official {self.name} {self.filename} (or "
                                "the folder holding it)")
            if not is_stdin(path) and not path.exists():
                raise DataError(f"{self.name} data not found at {path}; put the official {self.filename} "
                                f"there or pass --data PATH")
            check_readable(path, "--data", f"give the official {self.name} JSONL file (or - for stdin)")
            rows = read_jsonl(path, self.fields, self.name)
            self._items = [replace(self.to_example(i, row), source=where) for i, (where, row) in enumerate(rows)]
        return self._items

    def to_example(self, index: int, row: dict) -> Example:
        """Convert one JSON row into an ``Example``."""
        raise NotImplementedError

    def test_items(self) -> list[Example]:
        """Return the examples of the test split (default: the whole file)."""
        return self.items()

    def examples(self, split: str, n: int | None, seed: int) -> list[Example]:
        """Return ``n`` test examples chosen by ``seed`` in file order (all if ``n`` is None or too large).

        Raises ``UsageError`` for a split other than "test" and ``DataError`` if the file is missing.
        """
        if split != "test":
            raise UsageError(f"{self.name} has only a 'test' split here (got {split!r})")
        pool = self.test_items()
        return [pool[i] for i in sample_indices(len(pool), n, seed)]

    def shot_examples(self, ex: Example, shots: int, seed: int) -> list[Example]:
        """Return ``shots`` other items of the same file, chosen by ``seed`` alone (never ``ex``)."""
        super().shot_examples(ex, shots, seed)
        if shots == 0:
            return []
        pool = self.items()
        order = random.Random(f"{self.name}-shots:{seed}").sample(range(len(pool)), len(pool))
        return [pool[i] for i in order if pool[i].id != ex.id][:shots]
