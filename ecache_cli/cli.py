"""The ``ecache`` command line: four subcommands over one engine core.

This module is thin: each subcommand lives in ``ecache_cli/commands/<name>.py``, parses flags, and
calls its ``runs/`` module. ``handle_errors`` is the only place that turns an :class:`EcacheError`
into a one-line message and an exit code (2 usage, 1 runtime); heavy imports (torch, models) happen
inside command bodies so ``ecache --help`` stays fast.
"""

from __future__ import annotations

import functools

import typer

from . import __version__

app = typer.Typer(
    name="ecache", no_args_is_help=True, rich_markup_mode="rich", pretty_exceptions_show_locals=False,
    help="Fast approximate KV caching for diffusion language models (LLaDA, Dream): "
         "[bold]generate[/], [bold]profile[/], [bold]calibrate[/], [bold]trace-drift[/].",
)


def handle_errors(fn):
    """Run a command body; EcacheError → one red line on stderr and its exit code; Ctrl-C → exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from .console import error
        from .errors import EcacheError

        try:
            return fn(*args, **kwargs)
        except EcacheError as e:
            error(str(e))
            raise typer.Exit(code=e.exit_code) from None
        except KeyboardInterrupt:
            error("interrupted; records written so far are kept")
            raise typer.Exit(code=130) from None
        except BrokenPipeError:
            raise typer.Exit(code=0) from None

    return wrapper


def _version(value: bool):
    if value:
        typer.echo(f"ecache {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version.")):
    """ecache: EntropyCache and peer KV caches for diffusion LMs."""


from .commands import calibrate, generate, profile, trace_drift  # noqa: E402,F401  (registers the commands)
