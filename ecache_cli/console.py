"""One pair of rich consoles: ``out`` for results (stdout), ``err`` for progress, tables and errors (stderr)."""

from __future__ import annotations

from rich.console import Console

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def error(message: str) -> None:
    """Print a one-line error on stderr (no markup interpretation of the message)."""
    err.print("error: " + message, style="bold red", markup=False, highlight=False)


def warn(message: str) -> None:
    """Print a one-line warning on stderr (callers print each warning once)."""
    err.print("warning: " + message, style="yellow", markup=False, highlight=False)
