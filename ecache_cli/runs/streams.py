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
    """Write one JSON record and flush it at once (nothing is lost if a later record fails)."""
    fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    fh.flush()
