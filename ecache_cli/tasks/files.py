"""Shared loading for the file-backed benchmarks (gsm8k, math500, humaneval, mbpp).

Data is read from local files in the official JSONL formats (plain or ``.gz``), never downloaded:
``--data PATH`` (a file, or a folder holding the default file name), else
``~/.cache/ecache/data/<task>/<default file>``. The Hugging Face datasets cache stores Arrow files, not
the official JSONL, so it is not searched. A missing or malformed file raises ``DataError`` naming the
path.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from ecache_cli.errors import DataError, UsageError
from ecache_cli.tasks.base import Example, Task, sample_indices

DEFAULT_DATA_DIR = Path.home() / ".cache" / "ecache" / "data"


def read_jsonl(path: Path) -> list[dict]:
    """Return the JSON objects of a ``.jsonl`` or ``.jsonl.gz`` file; raises ``DataError`` if unreadable."""
    opener = gzip.open if path.suffix == ".gz" else open
    rows, lineno = [], 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):  # noqa: B007 (lineno names the bad line below)
                if line.strip():
                    rows.append(json.loads(line))
    except FileNotFoundError as e:
        raise DataError(f"data file not found: {path}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f"{path}:{lineno}" if lineno else str(path)
        raise DataError(f"cannot read {where}: {e}") from e
    return rows


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
        base = Path(self.data).expanduser() if self.data is not None else DEFAULT_DATA_DIR / self.name
        if base.is_dir() or self.data is None:
            for fname in (self.filename, *self.alt_filenames):
                if (base / fname).is_file():
                    return base / fname
            return base / self.filename
        return base

    def items(self) -> list[Example]:
        """Return every example of the file in file order; raises ``DataError`` if missing or malformed."""
        if self._items is None:
            path = self.data_path()
            if not path.is_file():
                raise DataError(f"{self.name} data not found at {path}; put the official {self.filename} "
                                f"there or pass --data PATH")
            rows = read_jsonl(path)
            for i, row in enumerate(rows):
                missing = [k for k in self.fields if k not in row]
                if missing:
                    raise DataError(f"{path}: item {i} lacks field(s) {', '.join(missing)} "
                                    f"(expected the official {self.name} format)")
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
