"""The run file of ``ecache calibrate``: every evaluated (setting, example) as one JSONL line, written
and flushed the moment it exists, so an interrupted calibration loses nothing and ``--resume``
continues from it.

Layout: line 1 is a header ``{"kind": "header", "format": 1, "key": {...}}``; every later line is an
example record ``{"kind": "example", "tau": <float or null for none>, "index": i, ...}``; in a joint
search a record of a setting whose recent_k / block_refresh differ from the run's own also holds
``"arm": [recent_k, block_refresh]``. The key holds
everything that changes what a record would contain (model fingerprint, task, prompts hash, decode
settings, signal, recent_k, ...); resuming with a different key is a one-line error naming the first
differing field. A last line cut short by a crash (no trailing newline, or not JSON) is dropped and
cut from the file before appending.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import DataError, UsageError
from .streams import write_jsonl

FORMAT = 1


def arm_of(rec: dict) -> tuple | None:
    """A record's arm: (recent_k, block_refresh) when it names one, else None (the run's own settings)."""
    arm = rec.get("arm")
    return None if arm is None else tuple(arm)


class RunFile:
    """Records of one calibration, keyed by (τ or None, example index, arm: None or (recent_k, block_refresh)).

    ``resume``: load an existing file (its key must equal ``key``). Without it an existing file is an
    error (nothing is ever overwritten). ``dry_run``: never write (an existing file is read only when
    resuming). ``loaded`` counts the records read back.
    """

    def __init__(self, path: Path, key: dict, resume: bool = False, dry_run: bool = False):
        self.path, self.dry_run = Path(path), dry_run
        self.key = json.loads(json.dumps(key))  # as it reads back (tuples -> lists)
        self.records: dict[tuple[float | None, int, tuple | None], dict] = {}
        self.loaded = 0
        self.dropped_partial = False
        self._fh = None
        exists = self.path.is_file() and self.path.stat().st_size > 0  # empty: made by the output lock
        if exists and not resume and not dry_run:
            raise UsageError(f"run file {self.path} already exists; pass --resume to continue it, "
                             "or delete it (or pass another --run-file) to start over")
        if exists and resume:
            self._load()
        if not dry_run:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not self.path.is_file() or self.path.stat().st_size == 0
            self._fh = open(self.path, "a", encoding="utf-8")
            if fresh:
                write_jsonl(self._fh, {"kind": "header", "format": FORMAT, "key": self.key})

    def _load(self) -> None:
        raw = self.path.read_bytes()
        text = raw.decode("utf-8", errors="replace")
        lines = text.split("\n")
        tail = lines.pop()  # "" when the file ends in a newline, else a line cut short
        if tail.strip():
            self.dropped_partial = True
        good: list[str] = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines):  # the last complete-looking line may still be a torn write
                    self.dropped_partial = True
                    break
                raise DataError(f"{self.path}:{n}: not valid JSON; the run file is damaged "
                                "(delete it to start over)") from None
            if not good:
                self._check_header(rec)
            elif rec.get("kind") == "example":
                self.records[(rec["tau"], rec["index"], arm_of(rec))] = rec
            good.append(line)
        if not good:
            raise DataError(f"{self.path}: no header line; the run file is damaged (delete it to start over)")
        self.loaded = len(self.records)
        if self.dropped_partial and not self.dry_run:  # cut the torn tail so appends start on a clean line
            self.path.write_text("".join(g + "\n" for g in good), encoding="utf-8")

    def _check_header(self, rec: dict) -> None:
        if not isinstance(rec, dict) or rec.get("kind") != "header":
            raise DataError(f"{self.path}: first line is not a calibrate run header (delete the file to start over)")
        if rec.get("format") != FORMAT:
            raise UsageError(f"{self.path}: run file format {rec.get('format')} is not {FORMAT}; "
                             "delete it to start over")
        diff = first_difference(rec.get("key") or {}, self.key)
        if diff is not None:
            name, old, new = diff
            raise UsageError(f"run file {self.path} was made with {name}={old!r}, this run has {name}={new!r}; "
                             "rerun with the same settings, pass another --run-file, or delete it")

    def get(self, tau: float | None, index: int, arm: tuple | None = None) -> dict | None:
        """The record of (τ, example index, arm), or None."""
        return self.records.get((tau, index, None if arm is None else tuple(arm)))

    def add(self, rec: dict) -> None:
        """Keep ``rec`` (which has ``tau``, ``index`` and maybe ``arm``) and append it to the file at once."""
        self.records[(rec["tau"], rec["index"], arm_of(rec))] = rec
        if self._fh is not None:
            write_jsonl(self._fh, {"kind": "example", **rec})

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def first_difference(old: dict, new: dict, prefix: str = "") -> tuple[str, object, object] | None:
    """The first (dotted name, old value, new value) where two nested dicts differ, in ``new``'s key
    order (then keys only ``old`` has), or None."""
    for k in [*new, *(k for k in old if k not in new)]:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            d = first_difference(a, b, f"{prefix}{k}.")
            if d is not None:
                return d
        elif a != b:
            return (f"{prefix}{k}", a, b)
    return None
