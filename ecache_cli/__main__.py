"""``python -m ecache_cli`` and the ``ecache`` script: the command line (``cli.app``).

Importing it loads typer, rich and the subcommands' modules, and typer then builds the command group (a
few tenths of a second): a Ctrl-C or SIGTERM in that time ends as every interrupt does (README's exit
codes: one line, 130 or 143), not with a traceback or typer's silent exit; once a command runs,
``cli.handle_errors`` handles interrupts."""

import signal
import sys
import threading


def main() -> None:
    """Run the command line; exit 130 (143 after SIGTERM) with one line when interrupted before a command
    starts (``interrupts.before_command``). A thread the command could not stop ends the process at once
    with the command's exit status (``interrupts.exit_now_if_outlived``)."""
    try:
        _run()
    except SystemExit as e:
        interrupts = sys.modules.get(__package__ + ".interrupts")
        if interrupts is not None:
            interrupts.exit_now_if_outlived(e.code)
        raise


def _run() -> None:
    try:
        from . import interrupts

        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, interrupts.before_command)
        from .cli import app

        app()  # typer builds the command group first (signatures, options): an interrupt there too
    except KeyboardInterrupt:
        _interrupted()
    except SystemExit as e:  # typer ends an interrupt that reaches it with a silent exit 130, from the interrupt
        if e.code == 130 and isinstance(getattr(e.__context__, "__cause__", None), KeyboardInterrupt):
            _interrupted()
        raise
    finally:  # the interpreter's shutdown (atexit callbacks): an interrupt ends it at once, with its one line
        if threading.current_thread() is threading.main_thread():
            from . import interrupts

            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, interrupts.at_shutdown)


def _interrupted() -> None:
    """One line, and exit 143 after SIGTERM (``errors.terminated``), else 130."""
    from .interrupts import INTERRUPTED_LINE

    errors = sys.modules.get(__package__ + ".errors")
    sys.stderr.write(INTERRUPTED_LINE)
    raise SystemExit(errors.interrupted_exit_code() if errors is not None else 130) from None


if __name__ == "__main__":
    main()
