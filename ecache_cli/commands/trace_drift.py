"""`ecache trace-drift`: not implemented yet (tracked in the project's issues)."""

from __future__ import annotations

from ..cli import app, handle_errors


@app.command("trace-drift")
@handle_errors
def trace_drift_cmd():
    """Not implemented yet."""
    from ..errors import EcacheError

    raise EcacheError("ecache trace-drift is not implemented yet")
