"""Reading a line-based input source in full: the one reader behind ``--input`` (prompts), ``--data``
(a benchmark's JSONL) and piped stdin, so every command opens, decodes and names lines the same way.

A source is ``-`` (stdin) or any readable path: a file, a named pipe, ``/dev/stdin``, a shell's
``<(...)`` (README: "``--input`` takes any readable path ... and so does ``--data``"). It is read to
its end before any line is used; gzip data (``.gz``) is decompressed. Lines are decoded one by one, so a
line that is not UTF-8 is reported by its number (for the caller to name with the others, exit 2)
instead of failing the whole read; a UTF-8 BOM at the start and CRLF line ends are dropped. Only a
source that cannot be opened or read at all is a :class:`DataError` (exit 1, README's exit codes: an
unreadable input is a runtime error).
"""

from __future__ import annotations

import errno
import gzip
import os
import sys
from pathlib import Path

from .errors import DataError

_GZIP_MAGIC = b"\x1f\x8b"


def is_stdin(path: Path | str | None) -> bool:
    """``-``: the source is stdin."""
    return path is not None and str(path) == "-"


def check_readable(path: Path | str | None, flag: str, fix: str) -> None:
    """Before the model loads: ``path`` must be ``-`` or an existing, readable path that is not a
    folder; else a DataError (exit 1) naming ``flag`` and ``path`` with ``fix`` (what to pass instead).
    A named pipe or ``/dev/stdin`` is not opened here (that would take its writer's data); only a
    regular file is opened to try it."""
    if path is None or is_stdin(path):
        return
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{flag} {path} is a folder; {fix}")
    if not path.exists():
        raise DataError(f"{flag} {path}: no such file; {fix}")
    try:
        if path.is_file():
            os.close(os.open(path, os.O_RDONLY))
        elif not os.access(path, os.R_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as e:
        raise DataError(f"{flag} {path}: cannot read ({e.strerror}); make it readable (chmod +r) or pass "
                        "another file") from None


def read_bytes(path: Path | str, flag: str) -> bytes:
    """The whole content of ``path`` (``-``: stdin's bytes), gzip data decompressed. DataError (exit 1)
    naming ``flag`` when it cannot be opened or read, or is damaged gzip."""
    name = "stdin" if is_stdin(path) else str(path)
    try:
        if is_stdin(path):
            if sys.stdin is None:
                raise DataError(f"{flag} -: stdin is closed; pipe the lines or pass a file")
            stream = getattr(sys.stdin, "buffer", None)
            data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8", "surrogateescape")
        else:
            with open(path, "rb") as fh:
                data = fh.read()
    except FileNotFoundError:
        raise DataError(f"{flag} {name}: no such file; check the path") from None
    except OSError as e:  # opened but not read to its end (a device, /proc's unreadable files, an I/O error)
        raise DataError(f"{flag} {name}: cannot read ({e.strerror}); pass a file that can be read to its end") \
            from None
    if data[:2] == _GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise DataError(f"{flag} {name}: damaged gzip data ({e}); download or copy it again") from None
    return data


def split_lines(data: bytes) -> list[tuple[int, str]]:
    """(1-based line number, text) of every line of ``data``. A byte that is not UTF-8 reads as a lone
    surrogate U+DC80–U+DCFF (``surrogateescape``), which the readers refuse naming the byte and where it is
    (``contract.text.not_text_words``: ``not UTF-8 text (byte 0xe9 at character 4)``); UTF-8 text never
    decodes to one. A BOM on the first line and a CR before each newline are dropped; a final newline ends
    the last line (it does not start an empty one)."""
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()
    return [(n, b.decode("utf-8-sig" if n == 1 else "utf-8", "surrogateescape").removesuffix("\r"))
            for n, b in enumerate(raw, 1)]


def read_lines(path: Path | str, flag: str) -> list[tuple[int, str]]:
    """Every line of the source ``path`` (``-``: stdin), read in full first (:func:`read_bytes`,
    :func:`split_lines`)."""
    return split_lines(read_bytes(path, flag))
