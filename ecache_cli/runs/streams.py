"""Streams of records: inputs grouped into batches, JSONL records written as each one is done."""

from __future__ import annotations

import json
from typing import IO, Iterable, Iterator


def batched(items: Iterable, size: int) -> Iterator[list]:
    """Group an iterable into lists of ``size``; an exception from the source is raised only after the
    items read before it have been yielded (so their results get written)."""
    batch = []
    try:
        for x in items:
            batch.append(x)
            if len(batch) == size:
                yield batch
                batch = []
    except Exception:
        if batch:
            yield batch
        raise
    if batch:
        yield batch


def write_jsonl(fh: IO, record: dict) -> None:
    """Write one JSON record and flush it at once (nothing is lost if a later record fails). A record holding a
    lone surrogate (an invalid input line's ``"\\ud800"``, echoed in its error record) is written with JSON's
    escapes, as it was read, since UTF-8 cannot hold it."""
    line = json.dumps(record, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(record)
    fh.write(line + "\n")
    fh.flush()
