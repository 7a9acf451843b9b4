"""Shared loading for the file-backed benchmarks (gsm8k, math500, humaneval, mbpp).

Data is read from local files in the official JSONL formats (plain or ``.gz``), never downloaded:
``--data PATH`` (a file, or a folder holding the default file name), else
``~/.cache/ecache/data/<task>/<default file>``. The Hugging Face datasets cache stores Arrow files, not
the official JSONL, so it is not searched. A missing or unreadable file raises ``DataError`` naming the
path (exit 1); malformed lines a ``UsageError`` naming every one (exit 2), as ``--input`` does.
"""

from __future__ import annotations

import gzip
import json
import random
import sys
from pathlib import Path

from ecache_cli.errors import DataError, UsageError
from ecache_cli.tasks.base import Example, Task, sample_indices

DEFAULT_DATA_DIR = Path.home() / ".cache" / "ecache" / "data"


def read_jsonl(path: Path, fields: tuple[str, ...] = (), task: str = "the task") -> list[dict]:
    """Return the JSON objects of a ``.jsonl`` or ``.jsonl.gz`` file, each checked to hold ``fields``.

    Every line is checked before any is used, as ``--input`` records are: a line that is not a JSON object
    or lacks a field is named, all of them in one ``UsageError`` (exit 2) with the fix. Raises ``DataError``
    (exit 1) when the file cannot be read at all (missing, unreadable, not UTF-8 or not gzip).
    """
    opener = gzip.open if path.suffix == ".gz" else open
    rows, bad = [], []
    try:
        if str(path) == "-":  # ``--data -``: the JSONL on stdin (README: stdin, files, ``-``)
            if sys.stdin is None:
                raise DataError("--data -: stdin is closed; pipe the JSONL or pass --data FILE")
            raw_lines = getattr(sys.stdin, "buffer", sys.stdin).read().splitlines()
            raw_lines = [r.encode("utf-8", "surrogateescape") if isinstance(r, str) else r for r in raw_lines]
        else:
            with opener(path, "rb") as f:
                raw_lines = f.read().splitlines()
    except FileNotFoundError as e:
        raise DataError(f"data file not found: {path}") from e
    except OSError as e:
        raise DataError(f"cannot read {path}: {e}") from e
    for lineno, raw in enumerate(raw_lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"cannot read {path}:{lineno}: not UTF-8 text ({e.reason}); the file is damaged: "
                            "download or copy it again") from e
        if line.strip():
            why = _bad_row(line, fields, rows)
            if why:
                bad.append(f"line {lineno} {why}")
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        need = f" with the fields {', '.join(fields)}" if fields else ""
        raise UsageError(f"--data {path}: {shown}; each line must be one JSON object{need} (the official {task} "
                         "format)")
    return rows


def _bad_row(line: str, fields: tuple[str, ...], rows: list[dict]) -> str | None:
    """Append the JSON object of ``line`` to ``rows``; else say why it is not one, or which fields it lacks."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        return f"is not JSON ({e.msg})"
    if not isinstance(row, dict):
        return f"is a JSON {type(row).__name__}, not an object"
    missing = [k for k in fields if k not in row]
    if missing:
        return f"lacks {', '.join(missing)}"
    rows.append(row)
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
            if str(path) != "-" and not path.is_file():
                raise DataError(f"{self.name} data not found at {path}; put the official {self.filename} "
                                f"there or pass --data PATH")
            rows = read_jsonl(path, self.fields, self.name)
            self._items = [self.to_example(i, row) for i, row in enumerate(rows)]
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
