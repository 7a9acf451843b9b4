"""``ecache generate --output FILE [--resume]``: records written to a file one by one, and continued.

The file holds one JSON record per input record, in input order (``index`` 0, 1, 2, ...), each
written and flushed as soon as it is known, so a killed run leaves a prefix of the final file,
at worst followed by one partly written line. ``--resume`` reads the file back, drops that torn
last line (a line without its newline that is no whole record; truncated away before anything is
written; a whole record that lost only its newline is kept and the newline put back), checks that
every record was written by the same model, settings and seed for the same input (the record's
``line`` and prompt fields against the input's; else a one-line error and nothing is touched), and
decodes only the records the file lacks. A record that lies after a gap (a file not written by one
ecache run) is kept in memory and written again at its place, so the final file holds each record
once, in input order, as an uninterrupted run writes it. An invalid input line's error record
(``--skip-invalid``) counts as done only while that line is still invalid.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import DataError, UsageError


def check_new_output(path: Path, resume: bool) -> bool:
    """Whether ``--output`` ``path`` holds records to resume (an existing non-empty file). Raises
    UsageError for one without ``resume``: checked by the command before its first line, and again when
    the file is opened."""
    path = Path(path)
    if not (path.is_file() and path.stat().st_size > 0):
        return False
    if not resume:
        raise UsageError(f"--output {path} already exists; pass --resume to decode only the records it lacks, "
                         "or remove it (or choose another file) to start over")
    return True


def _differs(a, b, path: str = "") -> str | None:
    """The first key path where two JSON values differ (``settings.cache``), or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            d = _differs(a.get(k), b.get(k), f"{path}.{k}" if path else k)
            if d:
                return d
        return None
    return None if a == b else (path or "value")


def _at(doc, path: str):
    """The value at a dotted key path of ``_differs`` in ``doc`` (None where a key is missing)."""
    for part in path.split("."):
        doc = doc.get(part) if isinstance(doc, dict) else None
    return doc


class OutputFile:
    """The ``--output`` file of a generate run (module docstring).

    ``expect``: the fields every record of this run carries that must match on ``--resume``
    (``settings``, ``seed``, ``model``). Raises UsageError for an existing non-empty file without
    ``--resume`` and for a file written by another run; DataError for a file that is not JSONL.
    """

    def __init__(self, path: Path, resume: bool, expect: dict):
        self.path, self.resume, self.expect = Path(path), resume, expect
        self.records: list[tuple[int, dict]] = []  # (byte offset after the record's line, record)
        self.torn = False
        self.cut = 0
        self.fh = None
        if check_new_output(self.path, resume):
            self._read()

    def _read(self) -> None:
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise DataError(f"--output {self.path}: cannot read it to resume ({e.strerror})") from None
        pos, n = 0, 0
        while pos < len(data):
            end = data.find(b"\n", pos)
            n += 1
            if end == -1:  # a last line without its newline: the run was killed while writing it, unless
                rec = _whole_record(data[pos:])  # it is a whole record (an editor dropped the newline)
                if rec is None:
                    self.torn = True
                else:  # kept; open() puts the newline back before the next record
                    self.records.append((len(data), rec))
                break
            raw = data[pos:end]
            if raw.strip():
                try:
                    rec = json.loads(raw)
                except ValueError:
                    rec = None
                if not isinstance(rec, dict) or not isinstance(rec.get("index"), int):
                    raise DataError(f"--output {self.path}:{n}: not an ecache generate record; resume only a file "
                                    "that generate --output wrote, or choose another --output")
                self.records.append((end + 1, rec))
            pos = end + 1
        for _, rec in self.records:
            d = _differs({k: rec.get(k) for k in self.expect}, self.expect)
            if d:
                raise UsageError(f"--output {self.path} was written with other settings ({d} "
                                 f"{json.dumps(_at(rec, d))}, this run {json.dumps(_at(self.expect, d))}); resume "
                                 "with the same model and flags, or choose another --output")

    def plan(self, items: list, fields) -> tuple[set[int], dict[int, dict]]:
        """Compare the file with the input ``items`` (``gen_input.Item``; ``fields(item)``: the record
        fields that join a record to its input). Returns (indices of the file's in-order prefix: done,
        not written again; records after it that are reused: index → record, written at their turn).
        Raises UsageError when a record belongs to another input."""
        first: dict[int, dict] = {}
        for _, r in self.records:
            first.setdefault(r["index"], r)
        usable: dict[int, dict] = {}
        for i, r in first.items():
            if not 0 <= i < len(items):
                raise UsageError(f"--output {self.path}: record index {i} is beyond the input's {len(items)} records; "
                                 "the file belongs to another input: choose another --output")
            it = items[i]
            if ("error" in r) != (it.error is not None):  # a line fixed since (or broken): decoded again
                if r.get("line") != it.line:
                    raise UsageError(f"--output {self.path}: the record of index {i} is from line {r.get('line')}, the "
                                     f"input's is line {it.line}; the file belongs to another input: choose "
                                     "another --output")
                continue
            want = {"line": it.line, **fields(it)}
            d = _differs({k: r.get(k) for k in want}, want)
            if d:
                raise UsageError(f"--output {self.path}: the record of index {i} (line {r.get('line')}) does not match "
                                 f"input line {it.line} ({d} differs); the file belongs to another input: choose "
                                 "another --output")
            usable[i] = r
        k = 0
        for end, r in self.records:
            if r["index"] != k or usable.get(k) is not r:
                break
            k, self.cut = k + 1, end
        return set(range(k)), {i: r for i, r in usable.items() if i >= k}

    def open(self) -> None:
        """Open for writing: after the kept prefix (the torn line and anything out of order cut away),
        or a new file."""
        try:
            if self.resume and self.path.is_file():
                self.fh = open(self.path, "r+b")
                self.fh.truncate(self.cut)
                if self.cut:
                    self.fh.seek(self.cut - 1)
                    if self.fh.read(1) != b"\n":  # a kept last record without its newline
                        self.fh.write(b"\n")
                        self.cut += 1
                self.fh.seek(self.cut)
            else:
                self.fh = open(self.path, "wb")
        except OSError as e:
            raise DataError(f"--output {self.path}: cannot write ({e.strerror}); choose another path") from None

    def write(self, record: dict) -> None:
        """Append one record and flush it (a kill loses at most the line being written)."""
        self.fh.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self.fh.flush()

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None


def _whole_record(raw: bytes) -> dict | None:
    """The record of a last line that lacks only its newline (a JSON object with an int ``index``), else
    None: a line cut while it was written does not parse."""
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("index"), int) else None
