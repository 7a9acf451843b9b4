"""How Ctrl-C and SIGTERM end a command: the handlers every command runs under (``cli.handle_errors``) and
the one in place before a command starts (``__main__``), and interrupts held over a short stretch that must
finish.

A handler raises KeyboardInterrupt (SIGTERM: ``errors.Terminated``) and remembers it
(``errors.interrupt_pending``), except while an import runs: an exception raised in a module's top level
can be swallowed by that module (numpy's start-up: the command then ran to its end, exit 0) or thrown
through a C++ extension (torch.distributed's: ``terminate called``, exit 134), so the signal is held and
sent again 20 ms later, until the import has finished (:func:`held_in_import`).

Ctrl-C and SIGTERM held over a short stretch that must finish: the summary of a run, written after the run.

A command that reports what it measured when interrupted (``trace-drift``) catches the interrupt during
its loop; one that arrives after the loop, while the summary is computed and its ``--json`` written, would
otherwise end the command with nothing written. :class:`HeldInterrupts` holds it from the loop's end to
the write and then delivers it to the handlers that were in place (``cli.handle_errors``': Ctrl-C raises
KeyboardInterrupt, SIGTERM ``errors.Terminated``), so the exit status stays 130 / 143.

A thread that a command asked to stop but that did not end in time (``serve``'s engine thread inside a
``--compile`` call) is kept in :data:`outliving`: ``__main__`` then ends the process with ``os._exit`` after
the command's last line (:func:`exit_now_if_outlived`), since the interpreter's normal exit would tear down
torch's C++ threads under the running call (``terminate called without an active exception``, exit 134).
"""

from __future__ import annotations

import os
import signal
import threading

_SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: The signal that arrived before a command started (:func:`before_command`), not yet acted on; else None.
early: int | None = None
#: Signals held in an import and sent again by a timer that have not arrived yet (:func:`held_in_import`):
#: while one is on its way, it delivers the interrupt, and nothing else acts on the remembered one.
resending = 0
#: Threads asked to stop that were still running when their command gave up waiting (:func:`outlived`).
outliving: list[threading.Thread] = []


def raise_interrupt(signum, frame) -> None:
    """A command's handler of SIGINT and SIGTERM: KeyboardInterrupt for Ctrl-C, ``errors.Terminated`` (a
    KeyboardInterrupt) for SIGTERM, remembered in ``errors`` so that an error it turns into on its way up (a
    C extension's import failing with ``ImportError: initialization failed``), or a library that swallows
    it, still ends the command as an interrupt; held while an import runs (:func:`held_in_import`)."""
    global resending
    resending = max(0, resending - 1)  # the signal a timer sent again has arrived (or a new one: either acts)
    if held_in_import(signum, frame):  # the module being imported may be ecache's errors itself, half made
        return
    from . import errors

    errors.interrupt_pending = True
    errors.terminated = errors.terminated or signum == signal.SIGTERM
    raise errors.Terminated() if signum == signal.SIGTERM else KeyboardInterrupt


def before_command(signum, frame) -> None:
    """The handler of SIGINT and SIGTERM from the start of ``ecache`` until a command installs its own: as
    :func:`raise_interrupt`, and the signal kept in :data:`early`, so that an interrupt the option parser
    turns into a silent exit 130 (typer does), or one a library swallows, still ends ``ecache`` with one
    line, 130 or 143 (``__main__``, ``cli.handle_errors``)."""
    global early
    early = signum
    raise_interrupt(signum, frame)


def held_in_import(signum: int, frame) -> bool:
    """Whether the main thread is inside an import (an importlib frame on the stack from ``frame``); if so
    ``signum`` is sent to this process again 20 ms later, from a timer thread (counted in :data:`resending`
    until it arrives), and the caller holds it."""
    global resending
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            resending += 1
            timer = threading.Timer(0.02, os.kill, (os.getpid(), signum))
            timer.daemon = True
            timer.start()
            return True
        frame = frame.f_back
    return False


class HeldInterrupts:
    """Hold SIGINT and SIGTERM from :meth:`start` until the ``with`` block (or :meth:`release`) ends.

    Usage: ``with hold: ...; hold.start(); ...`` — outside the main thread (where Python cannot set
    handlers) nothing is held. At release the handlers are restored and the first held signal is raised
    again with :func:`signal.raise_signal`, so its own handler runs as if it had just arrived (when an
    exception is already leaving the block, that exception wins and the held signal is dropped).
    """

    def __init__(self) -> None:
        self._previous: dict[int, object] | None = None
        self.held: list[int] = []  # signal numbers that arrived while held, in order

    def start(self) -> None:
        """Begin holding (again: no effect)."""
        if self._previous is not None or threading.current_thread() is not threading.main_thread():
            return
        previous = {s: signal.getsignal(s) for s in _SIGNALS}
        self._previous = {s: h for s, h in previous.items() if h is not None}  # None: set outside Python
        for s in self._previous:
            signal.signal(s, self._hold)

    def _hold(self, signum, frame) -> None:
        self.held.append(signum)

    def release(self, deliver: bool = True) -> None:
        """Restore the handlers; ``deliver``: raise the first held signal again (its handler may raise)."""
        if self._previous is None:
            return
        previous, self._previous = self._previous, None
        for s, h in previous.items():
            signal.signal(s, h)
        if deliver and self.held:
            signal.raise_signal(self.held[0])

    def __enter__(self) -> HeldInterrupts:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release(deliver=exc_type is None)


def outlived(thread: threading.Thread) -> None:
    """Record ``thread``, asked to stop and still running after its command's wait: unless it ends before the
    command does, the process ends with ``os._exit`` (:func:`exit_now_if_outlived`)."""
    outliving.append(thread)


def exit_now_if_outlived(code: object) -> None:
    """(``__main__``, as the command's SystemExit leaves it.) If a thread of :data:`outliving` still runs,
    flush stdout and stderr and end the process at once with the exit status of ``code`` (a SystemExit's:
    None is 0, an int itself, anything else 1); else return."""
    import sys

    if not any(t.is_alive() for t in outliving):
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to write there
            pass
    os._exit(0 if code is None else code if isinstance(code, int) else 1)


#: The one line an interrupt ends ``ecache`` with where no command says more (``__main__``, :func:`at_shutdown`).
INTERRUPTED_LINE = "error: interrupted\n"


def at_shutdown(signum, frame) -> None:
    """The handler of SIGINT and SIGTERM once the command has ended, while the interpreter shuts down
    (``__main__``): the command's outputs are written and closed, so the process ends at once, as an
    interrupt does everywhere else: one line on stderr, exit 130 (143 for SIGTERM), without running
    what shutdown had left (a library's atexit callback could otherwise print a traceback, or hang)."""
    try:
        os.write(2, INTERRUPTED_LINE.encode())
    except OSError:  # stderr closed: the exit status still says it
        pass
    os._exit(143 if signum == signal.SIGTERM else 130)
