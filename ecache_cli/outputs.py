"""Output paths, checked before any decoding: one rule for every command.

Rule: a missing parent folder of an output file (``--json runs_out/p.json``) or a missing output
folder (``--trace-dir``, ``--tensorboard``) is created and named on stderr, except a new folder
directly under the filesystem root (``--json /resuts/p.json`` is far more often a typo than a wish).
A path that is a folder where a file is wanted, lies under a file, or cannot be written is a one-line
error naming it, raised before the model loads, so a long run never fails at its last write.
Every command checks its output paths once its flags and settings are resolved and before it reads
its input (a run refused on its settings creates no folder, in every command). The check writes and
removes a probe file, so the folders exist while the run goes on; a folder it created that is still
empty when the command ends (the run failed on its input or the model before writing) is removed then,
as an output file it created and left empty is (:func:`release_all`).

One writer per file: the check also takes an advisory lock on the output file (:func:`claim`), held
until the command ends, so a second ecache process given the same output fails at once (exit 1,
naming the path and the other process) instead of interleaving its lines with the first one's.
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
    _check_creatable(folder, flag, path)
    new, level = [], folder
    while not level.exists() and level.parent != level:
        new.append(level)
        level = level.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{flag} {path}: cannot create folder {folder} ({e.strerror}); choose another path") from None
    _NEW_FOLDERS.extend(os.path.abspath(f) for f in new)  # deepest first
    if announce:
        from .console import note

        note(f"created folder {folder} for {flag}")


def _check_creatable(folder: Path, flag: str, path) -> None:
    """UsageError (naming ``flag`` and ``path``) when missing ``folder`` is one :func:`_make_folder` does not
    create: under a file, or a new folder directly under the filesystem root."""
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


def _probe(folder: Path, flag: str, path) -> None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise DataError(f"{flag} {path}: cannot write in {folder} ({e.strerror}); choose another path") from None


#: The file name suggested when an output flag is given a folder: each flag's expected suffix.
EXAMPLE_NAMES = {"--plot": "plot.png", "--jsonl": "trace.jsonl", "--run-file": "run.jsonl", "--out": "profile.yaml",
                 "--output": "out.jsonl", "/save": "chat.jsonl"}


def _names_folder(p: Path) -> bool:
    """Whether output path ``p`` names a folder: one that exists, or by its form (``out/x/..`` names a
    folder even before ``out/x`` exists)."""
    return p.is_dir() or p.name in ("", ".", "..")


def check_file(path, flag: str, announce: bool = True, lock: bool = True) -> Path | None:
    """Make sure output file ``path`` can be written (``None`` and ``-``, stdout, pass); returns it.
    ``announce``: name a created folder on stderr (off for ecache's default locations). ``lock``: also
    :func:`claim` it, so no other ecache process writes it until this command ends."""
    if path is None or str(path) == "-":
        return path
    p = Path(path).expanduser()
    if _names_folder(p):
        folder = Path(os.path.normpath(p))
        if not folder.is_dir():  # the example must be a file this command takes: its folder one it creates
            _check_creatable(folder, flag, path)
        raise UsageError(f"{flag} {path} is a folder; "
                         f"give a file name (e.g. {folder / EXAMPLE_NAMES.get(flag, 'out.json')})")
    _make_folder(p.parent, flag, path, announce)
    if p.exists():
        if not os.access(p, os.W_OK):
            raise DataError(f"{flag} {path}: the file is not writable; choose another path")
    else:
        _probe(p.parent, flag, path)
    if lock:
        claim(p, flag)
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


# --- one writer per output file --------------------------------------------------------------------------

#: The output files this process holds locked: resolved path → open file descriptor.
_LOCKS: dict[str, int] = {}


def claim(path, flag: str) -> None:
    """Take an advisory lock on output file ``path`` (``fcntl.flock``, exclusive, non-blocking), held
    until :func:`release_all` (the end of the command) or the process ends, so two ecache processes
    never write one file at once and interleave their lines.

    The lock is on the file itself (opened without truncating, created if missing; a file this process
    created is removed at release when still empty, so a failed run leaves nothing). Raises DataError
    (exit 1) when another process holds it, naming the path and that process (pid and command line,
    from /proc/locks on Linux). Without ``fcntl`` (Windows) it does nothing. ``-`` (stdout) is not locked,
    nor anything on ranks other than 0 of a launcher (``$RANK``; rank 0 writes every file).
    """
    if path is None or str(path) == "-" or os.environ.get("RANK", "0") != "0":  # ranks > 0 write nothing
        return
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no advisory locks on this platform
        return
    p = Path(path).expanduser()
    key = os.path.realpath(p)
    if key in _LOCKS:
        return
    existed = p.exists()
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o666)
    except OSError as e:
        raise DataError(f"{flag} {path}: cannot open for writing ({e.strerror}); choose another path") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        who = _lock_holder(fd)
        os.close(fd)
        raise DataError(f"{flag} {path} is being written by another process ({who}); wait for it to finish or "
                        "choose another path") from None
    _LOCKS[key] = fd
    if not existed:
        _CREATED.add(key)


_CREATED: set[str] = set()
#: The folders :func:`_make_folder` created for this command's outputs, each new level, deepest first.
_NEW_FOLDERS: list[str] = []


def release_all() -> None:
    """Release every lock :func:`claim` took, remove the files it created that are still empty, then the
    folders the output checks created that are still empty (a run that failed before writing leaves none)."""
    for key, fd in list(_LOCKS.items()):
        try:
            if key in _CREATED and os.fstat(fd).st_size == 0 and os.path.exists(key):
                os.unlink(key)
        except OSError:
            pass
        os.close(fd)  # closing the descriptor drops the flock
        del _LOCKS[key]
        _CREATED.discard(key)
    for folder in sorted(_NEW_FOLDERS, key=lambda f: f.count(os.sep), reverse=True):
        try:
            os.rmdir(folder)  # only an empty folder goes
        except OSError:
            pass
    _NEW_FOLDERS.clear()


def _lock_holder(fd: int) -> str:
    """Who holds the flock on ``fd``'s file: ``pid 123: ecache profile --json p.json`` from /proc/locks
    (Linux), else ``another ecache run``."""
    try:
        st = os.fstat(fd)
        dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            pids = [line.split()[4] for line in fh if line.split()[1:2] == ["FLOCK"] and dev in line.split()]
        pid = next(p for p in pids if p != str(os.getpid()))
    except (OSError, StopIteration, IndexError, AttributeError):
        return "another ecache run"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = " ".join(a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a)
    except OSError:
        cmd = ""
    return f"pid {pid}" + (f": {cmd[:120]}" if cmd else "")


# --- outputs that are inputs or each other ---------------------------------------------------------------

def check_distinct(outputs, inputs=()) -> None:
    """Refuse, before any file is opened for writing, an output file that is also an input file or
    another output of the same command (the same file after resolving ``~``, ``..`` and symbolic links).

    ``outputs`` and ``inputs``: ``(path, flag)`` pairs; ``None`` and ``-`` (stdout/stdin) are skipped.
    Raises UsageError (exit 2) naming both flags and the path: writing would destroy the input (or one
    output would overwrite the other) and lose data silently.
    """
    def key(path):
        if path is None or str(path) in ("-", ""):
            return None
        return os.path.realpath(Path(path).expanduser())

    seen: dict[str, str] = {}
    for path, flag in inputs:  # an input that does not exist (a profile or task name) cannot be destroyed
        if (k := key(path)) is not None and os.path.exists(k):
            seen.setdefault(k, flag)
    n_inputs = dict(seen)
    for path, flag in outputs:
        k = key(path)
        if k is None:
            continue
        if k in seen:
            what = "the input" if k in n_inputs else "another output"
            raise UsageError(f"{flag} {path} is the same file as {seen[k]} ({what}); writing it would "
                             f"{'destroy the input' if k in n_inputs else 'overwrite that output'}: "
                             f"choose another path for {flag}")
        seen[k] = flag


def pyplot():
    """matplotlib's ``pyplot`` on the Agg backend (files only, no display) for the ``--plot`` PNGs, with its
    font lookups quiet: a font family matplotlib asks for and does not find (the STIX fonts of its math
    text, where a system lacks them) is a ``findfont`` warning line per family on stderr, which says nothing
    about the run (with ``-q`` or without); matplotlib falls back to a font it has."""
    import logging

    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    import matplotlib.pyplot as plt

    return plt


def check_plot_name(path, flag: str = "--plot") -> None:
    """A plot file must end in ``.png`` (matplotlib picks the format from the suffix; the plots are
    PNG only; ``-``, stdout elsewhere, is refused too). Checked before any decoding, so a typo never fails
    after a long run (UsageError).
    A folder passes here: :func:`check_file` names the fix for it."""
    if path is not None and str(path) == "-":  # stdout is for the run's text, not an image
        raise UsageError(f"{flag} -: a plot is written to a file, not to stdout; give a .png file name (e.g. plot.png)")
    if path is not None and Path(path).suffix.lower() != ".png" and not _names_folder(Path(path)):
        raise UsageError(f"{flag} {path}: give a .png file name (e.g. {Path(path).with_suffix('.png')})")


def write_json(doc: dict, path, flag: str = "--json") -> None:
    """A command's ``--json`` document (profile, calibrate, trace-drift: one rule): to stdout when ``path`` is
    ``-``, as one line (the last line of stdout, so ``| tail -1 | jq`` reads it), flushed; else to the file,
    indented by 2, its folder made. Values JSON has no type for are written as their text. Raises DataError
    (exit 1) naming ``flag`` and the path when the file cannot be written."""
    import json
    import sys

    if str(path) == "-":
        sys.stdout.write(json.dumps(doc, ensure_ascii=False, default=str) + "\n")
        sys.stdout.flush()
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    except OSError as e:
        raise DataError(f"{flag} {path}: cannot write ({e.strerror or e})") from None
