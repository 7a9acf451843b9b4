"""One pair of rich consoles: ``out`` for results (stdout), ``err`` for progress, tables and errors (stderr)."""

from __future__ import annotations

from rich.console import Console

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def error(message: str) -> None:
    """Print a one-line error on stderr (no markup interpretation of the message)."""
    err.print("error: " + message, style="bold red", markup=False, highlight=False)
