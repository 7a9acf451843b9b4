"""One pair of rich consoles: ``out`` for results (stdout), ``err`` for progress, tables and errors (stderr).

Every console of the command line is a :class:`PipeConsole` (``make``): a closed stdout pipe raises
:class:`BrokenPipeError`, which ``cli.handle_errors`` turns into a quiet exit 0 in every subcommand
(rich's own console exits 1 there); a closed stderr only silences stderr, and the run goes on. On a
terminal a line longer than the terminal wraps at words within its width; in a pipe or a file every
message stays one line (``soft_wrap`` left to :class:`PipeConsole`)."""

from __future__ import annotations

from rich.console import Console


class PipeConsole(Console):
    """A rich console whose closed pipe (``ecache ... | head -1``) raises BrokenPipeError instead of rich's
    ``SystemExit(1)``, so the exit status of a closed stdout is decided in one place (``cli.handle_errors``)."""

    @property
    def soft_wrap(self) -> bool:
        """Whether ``print`` leaves long lines unwrapped: as set, or when left None (``make``'s default),
        only off a terminal (a log keeps one line per message; a terminal gets words wrapped within its
        width, never a line wider than it)."""
        return self._soft_wrap if self._soft_wrap is not None else not self.is_terminal

    @soft_wrap.setter
    def soft_wrap(self, value: bool | None) -> None:
        self._soft_wrap = value

    def on_broken_pipe(self) -> None:
        """A closed stdout ends the command (the reader has what it wanted: BrokenPipeError, exit 0); a
        closed stderr does not: the run's records may go to a file (``--output out.jsonl 2>&1 | head -2``),
        which must still be written in full, so stderr goes quiet (fd 2 to /dev/null, for every other writer
        too) and the run carries on."""
        self.quiet = True  # nothing more is written to the closed stream
        if not self.stderr:
            raise BrokenPipeError(32, "Broken pipe")
        _silence_fd(2)


def _silence_fd(fd: int) -> None:
    """Point file descriptor ``fd`` at /dev/null (a closed pipe's later writes then go nowhere)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:
        pass


def make(**kwargs) -> Console:
    """A console for the command line's output (the keyword arguments of :class:`rich.console.Console`;
    ``soft_wrap`` left out: lines wrap at words on a terminal only)."""
    kwargs.setdefault("soft_wrap", None)
    return PipeConsole(**kwargs)


out = make()
err = make(stderr=True)


#: Warnings and notes (their printing functions and texts) waiting for the command's first stderr line
#: (:func:`hold_warnings`); None: print at once.
_held: list[tuple] | None = None


def hold_warnings() -> None:
    """Keep the warnings from now on until :func:`announce`: a command's first stderr line is what it
    uses (README: "using model …"), so the warnings of checking its flags come after it."""
    global _held
    _held = []


def announce(line: str | None) -> None:
    """Print a command's first stderr line (None: none, e.g. under ``-q``), then the warnings held
    since :func:`hold_warnings`; later warnings print at once."""
    global _held
    if line is not None:
        err.print(line, markup=False, highlight=False)
    held, _held = _held or [], None
    for show, message in held:
        show(message)


def read_alone(read, *args):
    """``read(*args)``, a command's read of its whole input before the model loads; when it raises, the
    warnings and notes held so far (:func:`hold_warnings`) are dropped, so the input's error is the run's
    only output (README: an input error comes first and alone)."""
    global _held
    try:
        return read(*args)
    except Exception:
        if _held is not None:
            _held = []
        raise


#: A function every warning and note passes through before it prints (:func:`rewriting`); None: as given.
_rewrite = None


class rewriting:
    """Within ``with rewriting(fn):`` every warning and note prints as ``fn(message)`` (lm-eval's model
    names its settings as model_args keys, not as the command line's flags)."""

    def __init__(self, fn):
        self.fn = fn

    def __enter__(self):
        global _rewrite
        self.before, _rewrite = _rewrite, self.fn
        return self

    def __exit__(self, *exc):
        global _rewrite
        _rewrite = self.before
        return False


def error(message: str) -> None:
    """Print a one-line error on stderr (no markup interpretation of the message), after any held
    warnings."""
    announce(None)
    err.print("error: " + message, style="bold red", markup=False, highlight=False)


def warn(message: str) -> None:
    """Print a one-line warning on stderr (callers print each warning once); held until the command's
    first line while :func:`hold_warnings` is in effect."""
    if _rewrite is not None:
        message = _rewrite(message)
    if _held is not None:
        _held.append((warn, message))
        return
    err.print("warning: " + message, style="yellow", markup=False, highlight=False)


#: ``-q`` of the running command (set by ``cli.handle_errors`` from the command's ``quiet`` flag):
#: :func:`info` prints nothing then. Warnings, notes and errors print under ``-q`` too.
quiet = False


def info(message: str, style: str | None = None) -> None:
    """Print a status line on stderr (what the command did or uses: files written, traces made, a setting
    changed, compile seconds); nothing under ``-q``. README's rule: ``-q`` leaves stderr only warnings,
    notes and errors."""
    if not quiet:
        err.print(message, style=style, markup=False, highlight=False)


def note(message: str) -> None:
    """Print a one-line note on stderr (what a run will not measure); held as :func:`warn` is."""
    if _rewrite is not None:
        message = _rewrite(message)
    if _held is not None:
        _held.append((note, message))
        return
    err.print("note: " + message, markup=False, highlight=False)
