"""A command run on a pseudo-terminal of a given size (stdlib ``pty``), for the tests of ``--watch`` and
``ecache chat``: what the user sees, read back with the terminal's control sequences removed."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: CSI and OSC control sequences, and the other escapes rich and readline write.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)|\x1b[=>()][0-9A-Za-z]?")


def plain(raw: str) -> str:
    """``raw`` terminal output without control sequences and carriage returns."""
    return _ESCAPES.sub("", raw).replace("\r", "")


class PtySession:
    """``python -m ecache_cli ARGS`` on a new pseudo-terminal of ``cols`` × ``rows`` (stdin, stdout and
    stderr all on it, as in a terminal). ``env``: variables added to this process's environment (one torch
    thread, ``$COLUMNS`` / ``$LINES`` removed so the size comes from the terminal)."""

    def __init__(self, args: list[str], env: dict | None = None, cols: int = 80, rows: int = 24):
        full = {**os.environ, "OMP_NUM_THREADS": "1", "TERM": "xterm-256color", "PYTHONPATH": str(REPO),
                **(env or {})}
        for k in ("COLUMNS", "LINES", "FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
            full.pop(k, None)
        argv = [sys.executable, "-m", "ecache_cli", *map(str, args)]
        pid, fd = pty.fork()
        if pid == 0:  # the child: the terminal's size set before the command starts, then the command
            try:
                fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
                os.chdir(full.get("ECACHE_TEST_CWD", os.getcwd()))
                os.execve(sys.executable, argv, full)
            finally:
                os._exit(127)
        self.pid, self.fd, self.raw, self.pos, self.code = pid, fd, b"", 0, None

    @property
    def text(self) -> str:
        """Everything the terminal received so far, control sequences removed."""
        return plain(self.raw.decode("utf-8", errors="replace"))

    def _read(self, timeout: float) -> bool:
        """Read what is there within ``timeout`` seconds; False at the end of the output."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        if not chunk:
            return False
        self.raw += chunk
        return True

    def expect(self, pattern: str, timeout: float = 120.0) -> re.Match:
        """Read until ``pattern`` (a regular expression) matches the plain text after the last match; return
        the match. AssertionError with the text seen when it does not come within ``timeout`` seconds."""
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        while True:
            m = rx.search(self.text, self.pos)
            if m:
                self.pos = m.end()
                return m
            if time.monotonic() > end or not self._read(min(0.5, max(end - time.monotonic(), 0.01))):
                m = rx.search(self.text, self.pos)
                if m:
                    self.pos = m.end()
                    return m
                raise AssertionError(f"{pattern!r} not seen; the terminal shows:\n{self.text[-3000:]}")

    def send(self, text: str) -> None:
        """Type ``text`` (``\\x03`` is Ctrl-C, ``\\x04`` Ctrl-D)."""
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 120.0) -> int:
        """Read to the end of the output and return the exit status (killed after ``timeout`` seconds)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and self._read(0.5):
            pass
        if self.code is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done == 0:
                os.kill(self.pid, signal.SIGKILL)
                done, status = os.waitpid(self.pid, 0)
            self.code = os.waitstatus_to_exitcode(status)
            os.close(self.fd)
        return self.code
