"""`ecache profile`: not implemented yet (tracked in the project's issues)."""

from __future__ import annotations

from ..cli import app, handle_errors


@app.command("profile")
@handle_errors
def profile_cmd():
    """Not implemented yet."""
    from ..errors import EcacheError

    raise EcacheError("ecache profile is not implemented yet")
