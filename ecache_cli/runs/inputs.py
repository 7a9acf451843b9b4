"""Where a run's prompts come from: prompt arguments, an ``--input`` JSONL file (``-``: stdin) or
plain lines on stdin, the same for every subcommand (generate, profile, trace-drift).

Every source is read and checked in full before its first prompt is handed out, so nothing is
decoded from an input that holds a bad line: one UsageError (exit 2, :func:`invalid_error`) names
every bad line (``file:3: …``, ``file lines 1-3, 7: …``) with its fix. A file that cannot be opened
at all is a DataError (exit 1), as README's exit-code table says of an unreadable input.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from ..contract.lines import bad_lines_summary, not_an_object, parse_json_line
from ..contract.text import json_text_error, not_text_words
from ..errors import DataError, UsageError
from ..models.prompting import check_messages, not_token_id
from ..sources import check_readable, is_stdin, read_lines, split_lines


def read_prompts(args: list[str] | None, input_file: Path | None, stdin: IO | None,
                 lines: bool = False) -> Iterator[tuple]:
    """Yield (prompt, record) pairs of :func:`read_items` (``prompt_ids`` records yield their list of
    ints), all read and checked before the first is yielded.

    With ``lines`` the tuples are (prompt, record, line): ``line`` is the 1-based line number in the
    ``--input`` file or on stdin (blank lines are skipped but still counted, so it always points at
    the line the prompt came from), or the 1-based position of a prompt argument."""
    for it in read_items(args, input_file, stdin):
        yield (it.prompt, it.rec, it.line) if lines else (it.prompt, it.rec)


def read_items(args: list[str] | None, input_file: Path | None, stdin: IO | None,
               raise_invalid: bool = True) -> list[Item]:
    """Every prompt of a run as an :class:`Item` (``source`` set): arguments first, else ``--input``
    JSONL (``prompt``, ``messages`` or ``prompt_ids`` field), else stdin (one prompt per line, blank
    lines skipped). The whole source is read and checked first: UsageError naming every bad argument
    or line (:func:`invalid_error`, exit 2), the error of :func:`no_prompts` for a source with no
    prompt, DataError for a file that cannot be opened. Token ids, templates and lengths are the
    model's checks (``gen_input.check_prompts``). Without ``raise_invalid`` the invalid lines keep
    their ``error`` and are returned, for the model's checks to name them all in one error. A lone
    ``-`` argument is stdin (README: stdin, files, ``-``), as ``--input -`` is: its lines are the
    prompts (:func:`dash_stdin`)."""
    if args and "-" in args:
        args, stdin = None, dash_stdin(args, stdin)
    if args:
        check_arguments(args)
        return [Item(index=n - 1, line=n, rec={"prompt": a}, prompt=a, source=ARGUMENT)
                for n, a in enumerate(args, 1)]
    if input_file is not None:
        items = read_records(input_file)
        _raise_invalid(items, f"--input {input_file}", "record", input_file, raise_invalid)
        return items
    if stdin is not None:
        items = stdin_items(stdin)
        _raise_invalid(items, "stdin", "line", None, raise_invalid)
        return items
    raise UsageError("no prompt given: pass it as an argument, pipe prompts on stdin (one per line) "
                     "or use --input FILE.jsonl")


def check_arguments(args: list[str]) -> None:
    """Every prompt argument checked before the first is used: UsageError for one that is not UTF-8 text or
    is empty (the chat template would otherwise turn it into a non-empty prompt); a lone ``-`` (stdin) is
    no prompt of its own and passes."""
    if "-" in args:
        return
    for n, a in enumerate(args, 1):
        _check_utf8(a, f"prompt argument {n}", UsageError, "pass UTF-8 text (check the shell's encoding)")
        if not a.strip():
            raise UsageError(f"prompt argument {n} {a!r}: a prompt is empty; give at least one token of text")


def dash_stdin(args: list[str], stdin: IO | None) -> IO:
    """The stream a ``-`` prompt argument reads: ``stdin`` (the caller's piped one), else ``sys.stdin``
    (a terminal too: one prompt a line until Ctrl-D). UsageError when ``-`` is not the only argument or
    stdin is closed (``<&-``)."""
    if args != ["-"]:
        raise UsageError(f"prompt arguments {' '.join(map(repr, args))}: - (stdin) must be the only prompt "
                         "argument; pipe every prompt on stdin or pass them all as arguments")
    stream = stdin if stdin is not None else sys.stdin
    if stream is None:
        raise UsageError("prompt argument - reads stdin, but stdin is closed; pipe the prompts (one per line) "
                         "or pass them as arguments")
    return stream


#: ``Item.source`` of a prompt argument (its ``line`` is the argument's position).
ARGUMENT = "prompt argument"


def source_head(items: list[Item], input_file: Path | None) -> tuple[str, str]:
    """What an error about ``items`` (from :func:`read_items`) names first, and what one item is:
    (``--input FILE``, ``record``), (``stdin``, ``line``) or (``prompt arguments``, ``argument``)."""
    if input_file is not None:
        return f"--input {input_file}", "record"
    if items and items[0].source == ARGUMENT:
        return "prompt arguments", "argument"
    return "stdin", "line"


def _raise_invalid(items: list[Item], source: str, what: str, input_file: Path | None,
                   raise_invalid: bool = True) -> None:
    """Raise :func:`invalid_error` for the invalid ``items`` (none, or not ``raise_invalid``: return);
    an empty source is :func:`no_prompts`'s error."""
    if not items:
        raise no_prompts(input_file)
    if not raise_invalid:
        return
    error = invalid_error(items, source, what=what, fix=FIX)
    if error is not None:
        raise error


@dataclass
class Item:
    """One prompt of a run, in input order.

    ``index``: 0-based among the input's records (blank lines are not records; invalid records count,
    so a record's index and random stream do not depend on whether an earlier one is valid);
    ``line``: 1-based line in the file or stdin (the argument's position for prompt arguments);
    ``rec``: the parsed record (None when the line is not a JSON value); ``prompt``: what to encode
    (text, messages or token ids), None when invalid; ``error``: why it is invalid (a one-line
    reason naming ``file:line`` and the fix), else None; ``ids``: the prompt's token ids when they
    were already encoded by a check (the decode reuses them), else None; ``source``: where ``line``
    counts (the file, ``stdin`` or :data:`ARGUMENT`), for the errors of later checks.
    """

    index: int
    line: int
    rec: object
    prompt: object
    error: str | None = None
    ids: list[int] | None = None
    source: str | None = None


def read_records(input_file: Path) -> list[Item]:
    """Every record of ``--input`` (``-``: stdin) as an :class:`Item`, the whole file read first and
    each line checked without the model: UTF-8, one JSON value, a usable prompt field
    (:func:`prompt_of`). Invalid lines get their ``error``; blank lines are skipped. Raises DataError
    only when the file cannot be opened."""
    piped = is_stdin(input_file)
    name = "stdin" if piped else str(input_file)
    items: list[Item] = []
    for n, line in jsonl_lines(input_file):
        if not line.strip():
            continue
        item = Item(index=len(items), line=n, rec=None, prompt=None, source=name)
        items.append(item)
        item.error = _record_error(item, line, f"{name}:{n}", piped)
    return items


def _record_error(item: Item, line: str, where: str, piped: bool) -> str | None:
    """Parse ``line`` into ``item`` (its ``rec`` and ``prompt``); return why it is invalid, else None
    (``piped``: the line came from stdin, whose fix is to pipe UTF-8, not to save a file)."""
    item.rec, error = parse_json_line(line, where, piped)
    if error is not None:
        return error
    try:
        item.prompt = prompt_of(item.rec, where)
    except DataError as e:
        return str(e)
    return None


def stdin_items(stdin: IO) -> list[Item]:
    """Every non-blank line of piped ``stdin`` as a plain-text prompt :class:`Item`, all of stdin read
    first (bytes decoded line by line, so a line that is not UTF-8 is named with its number and its first
    bad byte; a BOM on the first line and CRLF ends are dropped). Warns once when a line looks like a JSONL record."""
    items: list[Item] = []
    warned = False
    for n, line in _stdin_lines(stdin):
        if not line.strip():
            continue
        item = Item(index=len(items), line=n, rec=None, prompt=None, source="stdin")
        items.append(item)
        try:
            _check_utf8(line, f"stdin:{n}", DataError, PIPE_UTF8)
        except DataError as e:
            item.error = str(e)
            continue
        if not warned and line.lstrip().startswith("{") and _looks_like_record(line):
            warned = True  # once per input
            _warn_jsonl_stdin(n)
        item.prompt, item.rec = line, {"prompt": line}
    return items


#: The longest piped line (bytes, or characters of a text stream) read: far more than any prompt or chat
#: message a model's context holds, so that a line with no end (``< /dev/zero``) is refused at this length
#: instead of filling memory.
MAX_LINE = 1 << 20


def _stdin_lines(stdin: IO) -> list[tuple[int, str]]:
    """(1-based number, text) of every line of ``stdin``, read to its end line by line (``sources.split_lines``,
    the reader of every input: a byte that is not UTF-8 reads as a lone surrogate). DataError (exit 1) for a
    line longer than :data:`MAX_LINE` (:func:`_bounded_lines`)."""
    raw = getattr(stdin, "buffer", None)
    if raw is not None:
        return split_lines(b"".join(_bounded_lines(raw.readline)))
    try:  # a text stream without bytes underneath (e.g. a test runner's): undecodable bytes arrive as
        # surrogates (surrogateescape), which stdin_items names with their byte (_check_utf8)
        text = "".join(_bounded_lines(stdin.readline))
    except UnicodeDecodeError:
        raise UsageError(f"stdin: not UTF-8 text; {PIPE_UTF8}") from None
    lines = [(n, t.removeprefix("\ufeff") if n == 1 else t) for n, t in enumerate(text.split("\n"), 1)]
    return [(n, t.removesuffix("\r")) for n, t in lines]


def _bounded_lines(readline) -> list:
    """Every line ``readline(limit)`` gives (bytes or str, each with its newline) until the end; DataError
    (exit 1) as soon as one runs past :data:`MAX_LINE` without a newline, naming it and whether it is NUL
    bytes only (binary data such as ``/dev/zero``), so an endless line costs at most that much memory."""
    lines = []
    while line := readline(MAX_LINE + 1):
        newline, nul = ("\n", "\0") if isinstance(line, str) else (b"\n", b"\0")
        if len(line) > MAX_LINE and not line.endswith(newline):
            what = " and holds only NUL bytes (binary data such as /dev/zero, not text)" if not line.strip(nul) else ""
            raise DataError(f"stdin: line {len(lines) + 1} runs past {MAX_LINE >> 20} MiB without a newline{what}; "
                            f"pipe text, one prompt or message of at most {MAX_LINE >> 20} MiB per line")
        lines.append(line)
    return lines


def piped_lines(stdin: IO) -> list[str]:
    """Every line of piped ``stdin`` as text (``ecache chat``'s messages and commands), all read first;
    UsageError (exit 2, :func:`invalid_error`) naming every line that is not UTF-8, as the prompt
    commands name theirs, before anything is answered."""
    lines = _stdin_lines(stdin)
    items = [Item(index=i, line=n, rec=None, prompt=t, source="stdin",
                  error=None if (words := not_text_words(t)) is None else f"stdin:{n}: {words}; {PIPE_UTF8}")
             for i, (n, t) in enumerate(lines)]
    error = invalid_error(items, "stdin", what="line", fix=FIX)
    if error is not None:
        raise error
    return [t for _, t in lines]


#: The fix of stdin bytes that are not UTF-8, for prompts and chat lines alike.
PIPE_UTF8 = "pipe UTF-8 prompts, one per line"
#: The way out of invalid records for a command without ``--skip-invalid``.
FIX = "fix them (ecache help input) and run again"
#: ``generate``'s way out.
SKIP_FIX = "fix them, or pass --skip-invalid to decode the others (each invalid line gets an error record)"


def invalid_error(items: list[Item], source, shown: int = 10, what: str = "record",
                  fix: str = SKIP_FIX) -> UsageError | None:
    """The one-line error (exit 2) for the invalid ``items`` (None when all are valid): each reason once
    with the lines that have it (``file:3: …`` for one line, ``file lines 1-3, 7: …`` for several; the
    first ``shown`` reasons, the other lines by number), and the way out (``fix``). ``source``: what
    the head names (``--input FILE``, ``stdin``; a path is shown as ``--input PATH``); ``what``: a
    ``record`` or a ``line``."""
    bad = [(it.line, it.error) for it in items if it.error is not None]
    if not bad:
        return None
    if not isinstance(source, str):
        source = f"--input {source}"
    return UsageError(f"{bad_lines_summary(bad, len(items), source, what, shown)}; {fix}")


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


def warn_unread_stdin(prompts: list[str] | None, input_file: Path | str | None, task: str | None = None,
                      data: Path | str | None = None) -> None:
    """The rule of every prompt command (generate, profile, trace-drift): stdin is the prompt source only
    when no other is given (prompt arguments, ``--input``, profile's and trace-drift's ``--task``). Where
    ``--task`` chose the prompts and stdin holds piped data all the same (:func:`stdin_has_data`), a warning
    names it and the fix: ``stdin holds piped data, but the prompts come from --task list, so stdin is not
    read; drop --task list to decode the piped lines, or pipe nothing`` (a prompt argument beside ``--task``
    is refused; piped data is warned, since data still on its way down a pipe cannot be told from none).
    Prompt arguments and ``--input`` leave piped stdin unread without a word: a command run for each line of
    a ``while read`` loop inherits the loop's stdin. Nothing is said when stdin is read after all: ``--data``
    naming stdin (``-``, ``/dev/stdin``)."""
    if task is None or prompts or input_file is not None or _names_stdin(data):
        return
    if stdin_has_data():
        from ..console import warn

        source = f"--task {task}"
        warn(f"stdin holds piped data, but the prompts come from {source}, so stdin is not read; drop {source} "
             "to decode the piped lines, or pipe nothing")


def _names_stdin(path: Path | str | None) -> bool:
    """Whether input path ``path`` reads this process's stdin: ``-``, or the same file as descriptor 0
    (``/dev/stdin``, ``/proc/self/fd/0``)."""
    if path is None:
        return False
    if is_stdin(path):
        return True
    try:
        return os.path.samestat(os.stat(Path(path).expanduser()), os.fstat(0))
    except (OSError, ValueError):
        return False


def stdin_has_data() -> bool:
    """Whether piped stdin (:func:`piped_stdin`) holds data now, seen without reading it: bytes waiting in
    a pipe or socket (``FIONREAD``), bytes past the read position of a redirected file, or a seekable
    stream (an in-process caller's) with a byte to read. A terminal, ``/dev/null``, a closed stdin, an
    empty pipe and a pipe whose writer has not written yet hold none."""
    stream = piped_stdin()
    if stream is None:
        return False
    try:
        fd = stream.fileno()
    except (AttributeError, ValueError, OSError):  # no descriptor (io.UnsupportedOperation): an in-memory stream
        return _peek(getattr(stream, "buffer", stream))
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            return st.st_size > os.lseek(fd, 0, os.SEEK_CUR)
        if stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
            import array
            import fcntl
            import termios

            waiting = array.array("i", [0])
            fcntl.ioctl(fd, termios.FIONREAD, waiting, True)
            return waiting[0] > 0
    except (OSError, ValueError, ImportError):  # no FIONREAD (Windows): nothing said
        return False
    return False


def _peek(stream) -> bool:
    """Whether seekable ``stream`` has a character left, its position unchanged."""
    try:
        if not stream.seekable():
            return False
        pos = stream.tell()
        try:
            return bool(stream.read(1))
        finally:
            stream.seek(pos)
    except (AttributeError, ValueError, OSError):
        return False


def check_one_source(prompts: list[str] | None, input_file: Path | None) -> None:
    """Prompt arguments or ``--input``, not both: UsageError ``--input a.jsonl and 2 prompt argument(s) given:
    pass prompts one way, as arguments or in the file``."""
    if input_file is not None and prompts:
        raise UsageError(f"--input {input_file} and {len(prompts)} prompt argument(s) given: pass prompts one way, "
                         "as arguments or in the file")


def check_prompt_sources(prompts: list[str] | None, input_file: Path | None, task: str | None,
                         data: str | None = None, shots=None) -> None:
    """The prompts come one way, in every command that takes ``--task``: prompt arguments, ``--input`` (or
    stdin), or ``--task``, whose ``--data`` (its benchmark file) and ``--shots`` (its solved examples) mean
    nothing without it. UsageError (exit 2) naming the mix: ``--data needs --task NAME (the benchmark the
    file holds)``, ``--task chooses the prompts: pass either --task or prompts/--input, not both``. Stdin
    is the source only when none of these is given (:func:`warn_unread_stdin`: piped data beside ``--task``
    is a warning, not this error)."""
    check_one_source(prompts, input_file)
    if task is not None and (prompts or input_file is not None):
        raise UsageError("--task chooses the prompts: pass either --task or prompts/--input, not both")
    if task is None and data is not None:
        raise UsageError("--data needs --task NAME (the benchmark the file holds)")
    if task is None and shots is not None:
        raise UsageError("--shots needs --task NAME (the solved examples are that task's)")


def check_input_file(input_file: Path | None) -> None:
    """Before the model loads: ``--input`` must be ``-`` (stdin) or an existing, readable path that is
    not a folder (a file, a named pipe, ``/dev/stdin``, a shell's ``<(...)``); else a DataError (exit
    1, README's exit codes: an unreadable input is a runtime error). ``sources.check_readable``, as
    ``--data`` is checked. A regular file that is empty or blank is :func:`no_prompts`'s UsageError
    (exit 2), refused here rather than after the model's load."""
    check_readable(input_file, "--input", "give a JSONL file (one JSON object with a 'prompt' field per line), "
                   "or - for stdin")
    if _blank_file(input_file):  # refused before the first line, as every usage error (exit 2)
        raise no_prompts(input_file)


def _blank_file(path: Path | None) -> bool:
    """Whether ``path`` is a regular file holding nothing but whitespace (read until the first other byte;
    stdin, pipes and devices are not read here: their lines are read once, by the command)."""
    if path is None or str(path) == "-" or not Path(path).is_file():
        return False
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 16):
                if chunk.strip():
                    return False
    except OSError:  # unreadable: the reading names it
        return False
    return True


def jsonl_lines(input_file: Path) -> list[tuple[int, str]]:
    """(1-based line number, text: ``sources.split_lines``) of each line of an ``--input`` source
    (``-``: stdin), read in full first by the reader every input shares (``sources.read_lines``)."""
    return read_lines(input_file, "--input")


def no_prompts(input_file: Path | None, fix: str = "pipe prompts one per line, pass them as arguments or use "
               "--input FILE.jsonl") -> UsageError:
    """The error for a prompt source that gave nothing (README: empty input is a usage error, exit 2,
    in every command, as ``--data`` is: ``tasks.files.read_jsonl``): an empty or blank ``--input``
    source, naming it, or empty or blank stdin (``fix``: what the command takes instead; chat has no arguments)."""
    if input_file is not None:
        return UsageError(f"--input {input_file} holds no record (it is empty or blank); write one JSON "
                          "object with a 'prompt' field per line")
    return UsageError(f"no prompt given: stdin was empty or blank; {fix}")


def _check_utf8(text: str, where: str, error: type, fix: str) -> None:
    """Python hands undecodable argv bytes (and stdin bytes under a C locale) over as lone surrogates,
    which the tokenizer rejects with a TypeError; name the culprit instead."""
    words = not_text_words(text)
    if words:
        raise error(f"{where}: {words}; {fix}")


def _json_utf8(text: str, where: str) -> None:
    """DataError (``contract.text.json_text_error``) for a record's JSON string that is no text, found while the
    records are read, before the model loads."""
    why = json_text_error(text, where)
    if why:
        raise DataError(why)


def prompt_of(rec, where: str) -> str | list:
    """The prompt of one ``--input`` record: its ``prompt`` text, ``messages`` (checked by
    ``models.prompting.check_messages``, as the Python API checks them) or ``prompt_ids`` (ints; the
    model checks their range). DataError (``where: reason``) for a record with none or several of them."""
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
            raise DataError(f"{where}: {not_token_id(bad, ids[bad])}")
        return list(ids)
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
        if not rec["prompt"].strip():
            raise DataError(f"{where}: 'prompt' is empty; give at least one token of text")
        _json_utf8(rec["prompt"], f"{where}: 'prompt'")
        return rec["prompt"]
    if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
        why = check_messages(rec["messages"])  # the Python API's check too (engine.checks.check_prompts)
        if why:
            raise DataError(f"{where}: {why}")
        for i, m in enumerate(rec["messages"]):
            _json_utf8(m["content"], f"{where}: messages[{i}] 'content'")
        return rec["messages"]
    held = "" if isinstance(rec, dict) else f"{not_an_object(rec)}; "
    raise DataError(f"{where}: {held}a record needs a string 'prompt', a 'messages' list of {{role, content}} "
                    "or a 'prompt_ids' list of token ids")
