"""`ecache calibrate`: not implemented yet (tracked in the project's issues)."""

from __future__ import annotations

from ..cli import app, handle_errors


@app.command("calibrate")
@handle_errors
def calibrate_cmd():
    """Not implemented yet."""
    from ..errors import EcacheError

    raise EcacheError("ecache calibrate is not implemented yet")
