"""Where a run's prompts come from: prompt arguments, an ``--input`` JSONL file (``-``: stdin) or
plain lines on stdin, each checked with a one-line error naming the bad argument or ``file:line``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import IO, Iterator

from ..errors import DataError, UsageError


def read_prompts(args: list[str] | None, input_file: Path | None, stdin: IO | None,
                 lines: bool = False) -> Iterator[tuple]:
    """Yield (prompt, record) pairs: arguments first, else ``--input`` JSONL (``prompt``, ``messages``
    or ``prompt_ids`` field: a list of ints, yielded as that list), else stdin (one prompt per line,
    blank lines skipped). Raises DataError naming the file and line of a malformed record, after every
    earlier prompt has been yielded (token ids are checked against the model when they are encoded).

    With ``lines`` the tuples are (prompt, record, line): ``line`` is the 1-based line number in the
    ``--input`` file or on stdin (blank lines are skipped but still counted, so it always points at
    the line the prompt came from), or the 1-based position of a prompt argument."""
    if args:
        for n, a in enumerate(args, 1):  # every argument checked before the first is yielded
            _check_utf8(a, f"prompt argument {n}", UsageError, "pass UTF-8 text (check the shell's encoding)")
            if not a.strip():  # the chat template would otherwise turn it into a non-empty prompt
                raise UsageError(f"prompt argument {n} {a!r}: a prompt is empty; give at least one token of text")
        for n, a in enumerate(args, 1):
            yield (a, {"prompt": a}, n) if lines else (a, {"prompt": a})
        return
    if input_file is not None:
        name = "stdin" if is_stdin(input_file) else input_file  # where a bad record is: file:line
        for n, line in jsonl_lines(input_file):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{name}:{n}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            prompt = prompt_of(rec, f"{name}:{n}")
            yield (prompt, rec, n) if lines else (prompt, rec)
        return
    if stdin is not None:
        warned = False
        try:
            for n, line in enumerate(stdin, 1):
                line = line.rstrip("\n").removesuffix("\r")  # CRLF files piped in
                if n == 1:
                    line = line.removeprefix("\ufeff")  # a UTF-8 BOM, as --input files accept it
                _check_utf8(line, f"stdin line {n}", DataError, "pipe UTF-8 prompts, one per line")
                if not warned and line.lstrip().startswith("{") and _looks_like_record(line):
                    warned = True  # once per input
                    _warn_jsonl_stdin(n)
                if line.strip():
                    yield (line, {"prompt": line}, n) if lines else (line, {"prompt": line})
        except UnicodeDecodeError:
            raise DataError("stdin: not UTF-8 text; pipe UTF-8 prompts, one per line") from None
        return
    raise UsageError("no prompt given: pass it as an argument, pipe prompts on stdin (one per line) "
                     "or use --input FILE.jsonl")


def _looks_like_record(line: str) -> bool:
    """A stdin line that parses as a JSON object with a prompt field (``prompt``, ``messages`` or
    ``prompt_ids``): a JSONL record, piped without ``--input -``."""
    try:
        rec = json.loads(line)
    except ValueError:
        return False
    return isinstance(rec, dict) and any(k in rec for k in ("prompt", "messages", "prompt_ids"))


def _warn_jsonl_stdin(n: int) -> None:
    """Warn that stdin line ``n`` looks like a JSONL record but is decoded as a plain prompt."""
    from ..console import warn

    warn(f"stdin line {n} looks like a JSONL record, but without --input - each stdin line is a plain prompt "
         "(the braces and quotes included); pass --input - to read JSONL records from stdin")


def piped_stdin() -> IO | None:
    """stdin when prompts may come from it: not a terminal and not closed (``<&-`` leaves
    ``sys.stdin`` None, read as no stdin at all); else None."""
    stdin = sys.stdin
    if stdin is None:
        return None
    try:
        return None if stdin.isatty() else stdin
    except (ValueError, OSError):  # a closed or detached stream
        return None


def is_stdin(input_file: Path | str | None) -> bool:
    """``--input -``: JSONL records read from stdin."""
    return input_file is not None and str(input_file) == "-"


def check_input_file(input_file: Path | None) -> None:
    """Before the model loads: ``--input`` must be ``-`` (stdin) or an existing file (DataError, exit 1).
    Anything readable that is not a folder counts: a named pipe, ``/dev/stdin``, a shell's ``<(...)``
    (the records are read once, as a stream)."""
    if input_file is None or is_stdin(input_file) or (input_file.exists() and not input_file.is_dir()):
        return
    if input_file.is_dir():
        raise DataError(f"--input {input_file} is a folder; give a JSONL file (one JSON object with a 'prompt' "
                        "field per line), or - for stdin")
    raise DataError(f"--input {input_file}: no such file; pass a JSONL file with a 'prompt' field per line")


def jsonl_lines(input_file: Path, lenient: bool = False) -> Iterator[tuple[int, str | None]]:
    """(1-based line number, text) of each line of an ``--input`` file (``-``: stdin), decoded line by
    line so a bad byte fails at its line, after earlier ones; a UTF-8 BOM at the start is accepted
    (``utf-8-sig``) and a CRLF line end is dropped. ``lenient``: a line that is not UTF-8 is yielded
    as (n, None) instead of raising DataError."""
    if is_stdin(input_file):
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:  # a text stream without bytes underneath (e.g. a test runner's)
            for n, line in enumerate(sys.stdin, 1):
                yield n, (line.removeprefix("\ufeff") if n == 1 else line).rstrip("\r\n")
            return
        fh = stream
    else:
        try:
            fh = open(input_file, "rb")
        except OSError as e:
            raise DataError(f"--input {input_file}: cannot read ({e.strerror})") from None
    try:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError:
                if lenient:
                    yield n, None
                    continue
                where = "stdin" if is_stdin(input_file) else input_file
                raise DataError(f"{where}:{n}: not UTF-8 text; save the file as UTF-8 JSONL") from None
            yield n, line.rstrip("\r\n")
    finally:
        if fh is not getattr(sys.stdin, "buffer", None):
            fh.close()


def no_prompts(input_file: Path | None):
    """The error for a prompt source that gave nothing: an empty ``--input`` file (DataError, naming
    it) or empty stdin (UsageError)."""
    if input_file is not None:
        return DataError(f"--input {input_file} holds no record (the file is empty or blank); write one JSON "
                         "object with a 'prompt' field per line")
    return UsageError("no prompt given: stdin was empty; pipe prompts one per line, pass them as arguments or use "
                      "--input FILE.jsonl")


def _check_utf8(text: str, where: str, error: type, fix: str) -> None:
    """Python hands undecodable argv bytes (and stdin bytes under a C locale) over as lone surrogates,
    which the tokenizer rejects with a TypeError; name the culprit instead."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f" (byte 0x{ord(bad) - 0xDC00:02x})" if 0xDC80 <= ord(bad) <= 0xDCFF else ""
        raise error(f"{where}: not UTF-8 text{byte} at character {e.start + 1}; {fix}") from None


#: The roles a chat message may have: those of the LLaDA and Dream chat templates (tokenizer_config.json
#: ``chat_template``; the Hugging Face chat format).
CHAT_ROLES = ("system", "user", "assistant")


def prompt_of(rec, where: str) -> str | list:
    given = [k for k in ("prompt", "messages", "prompt_ids") if isinstance(rec, dict) and k in rec]
    if len(given) > 1:
        raise DataError(f"{where}: the record has {' and '.join(repr(k) for k in given)}; give one of prompt, "
                        "messages, prompt_ids")
    if isinstance(rec, dict) and "prompt_ids" in rec:
        ids = rec["prompt_ids"]
        if not isinstance(ids, list) or not ids:
            raise DataError(f"{where}: 'prompt_ids' must be a non-empty list of int token ids")
        bad = next((i for i, t in enumerate(ids) if not isinstance(t, int) or isinstance(t, bool)), None)
        if bad is not None:
            raise DataError(f"{where}: prompt_ids[{bad}] = {json.dumps(ids[bad])} is not an int token id")
        return list(ids)
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
        if not rec["prompt"].strip():
            raise DataError(f"{where}: 'prompt' is empty; give at least one token of text")
        return rec["prompt"]
    if isinstance(rec, dict) and rec.get("messages") == []:
        raise DataError(f"{where}: 'messages' is empty; give at least one {{role, content}} message")
    if isinstance(rec, dict) and isinstance(rec.get("messages"), list) and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in rec["messages"]):
        for i, m in enumerate(rec["messages"]):
            if m["role"] not in CHAT_ROLES:
                raise DataError(f"{where}: messages[{i}] has role {m['role']!r}; use one of {', '.join(CHAT_ROLES)}")
            if not isinstance(m["content"], str):
                raise DataError(f"{where}: messages[{i}] 'content' must be a string, not {json.dumps(m['content'])}")
        return rec["messages"]
    raise DataError(f"{where}: a record needs a string 'prompt', a 'messages' list of {{role, content}} "
                    "or a 'prompt_ids' list of token ids")
