"""Ctrl-C and SIGTERM held over a short stretch that must finish: the summary of a run, written after the run.

A command that reports what it measured when interrupted (``trace-drift``) catches the interrupt during
its loop; one that arrives after the loop, while the summary is computed and its ``--json`` written, would
otherwise end the command with nothing written. :class:`HeldInterrupts` holds it from the loop's end to
the write and then delivers it to the handlers that were in place (``cli.handle_errors``': Ctrl-C raises
KeyboardInterrupt, SIGTERM ``errors.Terminated``), so the exit status stays 130 / 143.
"""

from __future__ import annotations

import signal
import threading

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
