"""Output paths, checked before any decoding: one rule for every command.

Rule: a missing parent folder of an output file (``--json runs_out/p.json``) or a missing output
folder (``--trace-dir``, ``--tensorboard``) is created and named on stderr, except a new folder
directly under the filesystem root (``--json /resuts/p.json`` is far more often a typo than a wish).
A path that is a folder where a file is wanted, lies under a file, or cannot be written is a one-line
error naming it, raised before the model loads, so a long run never fails at its last write.
Trade-off: the check writes and removes a probe file, so the folders exist even if the run later
fails; that is cheaper than losing a run's results.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import DataError, UsageError


def _make_folder(folder: Path, flag: str, path, announce: bool = True) -> None:
    """Create ``folder`` and its missing parents (not a new top-level folder); say so on stderr
    unless ``announce`` is off (ecache's own default places, e.g. ``profiles/<model>/``)."""
    if folder.is_dir():
        return
    missing = folder
    while not missing.parent.exists() and missing.parent != missing:
        missing = missing.parent
    if missing.parent.exists() and not missing.parent.is_dir():
        raise UsageError(f"{flag} {path}: {missing.parent} is a file, not a folder; choose another path")
    if missing.exists() and not missing.is_dir():
        raise UsageError(f"{flag} {path}: {missing} is a file, not a folder; choose another path")
    top = Path(os.path.abspath(missing))  # a relative "runs_out" has parent "." and anchor "": compare absolutes
    if top.parent == Path(top.anchor):
        raise UsageError(f"{flag} {path}: folder {missing} does not exist and ecache creates no folder at the "
                         f"filesystem root; create it first (mkdir -p {folder}) or choose another path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{flag} {path}: cannot create folder {folder} ({e.strerror}); choose another path") from None
    if announce:
        from .console import err

        err.print(f"note: created folder {folder} for {flag}", markup=False, highlight=False)


def _probe(folder: Path, flag: str, path) -> None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise DataError(f"{flag} {path}: cannot write in {folder} ({e.strerror}); choose another path") from None


#: The file name suggested when an output flag is given a folder: each flag's expected suffix.
EXAMPLE_NAMES = {"--plot": "plot.png", "--jsonl": "trace.jsonl", "--run-file": "run.jsonl", "--out": "profile.yaml"}


def check_file(path, flag: str, announce: bool = True) -> Path | None:
    """Make sure output file ``path`` can be written (``None`` and ``-``, stdout, pass); returns it.
    ``announce``: name a created folder on stderr (off for ecache's default locations)."""
    if path is None or str(path) == "-":
        return path
    p = Path(path).expanduser()
    if p.is_dir():
        raise UsageError(f"{flag} {path} is a folder; give a file name (e.g. {p / EXAMPLE_NAMES.get(flag, 'out.json')})")
    _make_folder(p.parent, flag, path, announce)
    if p.exists():
        if not os.access(p, os.W_OK):
            raise DataError(f"{flag} {path}: the file is not writable; choose another path")
    else:
        _probe(p.parent, flag, path)
    return p


def check_dir(path, flag: str) -> Path | None:
    """Make sure output folder ``path`` exists (created if needed) and can be written in; returns it."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {path} is a file; give a folder name")
    _make_folder(p, flag, path)
    _probe(p, flag, path)
    return p
