"""``python -m ecache_cli`` and the ``ecache`` script: the command line (``cli.app``).

Importing it loads typer, rich and the subcommands' modules, and typer then builds the command group (a
few tenths of a second): a Ctrl-C in that time ends as every interrupt does (README's exit codes: one line,
130), not with a traceback; once a command runs, ``cli.handle_errors`` handles interrupts."""

import sys


def main() -> None:
    """Run the command line; exit 130 with one line when interrupted before a command starts."""
    try:
        from .cli import app

        app()  # typer builds the command group first (signatures, options): a Ctrl-C there too
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
