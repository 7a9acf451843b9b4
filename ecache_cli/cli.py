"""The ``ecache`` command line: generate, chat, profile, calibrate, trace-drift and serve over one engine core,
``ecache models`` (list, ``show``, ``pull``) and ``ecache help TOPIC``.

This module is thin and is the one place that registers the subcommands: each lives in
``ecache_cli/commands/<name>.py`` as a plain function (which never imports this module), parses
flags, and calls its ``runs/`` module. ``handle_errors`` is the only place that turns an
:class:`EcacheError` into a one-line message and an exit code (2 usage, 1 runtime); the option
parser's own usage errors are printed the same way (``EcacheGroup``). Heavy imports (torch, models)
happen inside command bodies so ``ecache --help`` stays fast.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading

import typer
from typer.core import TyperCommand, TyperGroup

from . import __version__

try:  # typer ≥ 0.20 ships its own copy of click
    from typer._click.exceptions import BadParameter as _BadParameter
    from typer._click.exceptions import UsageError as _ClickUsageError
except ImportError:  # pragma: no cover - older typer on top of click
    from click.exceptions import BadParameter as _BadParameter
    from click.exceptions import UsageError as _ClickUsageError


_GIVEN_OPTIONS = "ecache.given_options"  # ctx.meta key: a subcommand's options as typed (name → text)


def _given_value(err: _BadParameter) -> str | None:
    """The text the user gave for the parameter of a BadParameter (the parser does not keep it)."""
    if getattr(err, "given_text", None) is not None:  # raised by _whole_numbers_as_typed
        return err.given_text
    cause = err.__cause__
    if cause is not None and hasattr(cause, "errors"):  # typer's pydantic coercion keeps the input
        try:
            return str(cause.errors()[0]["input"])
        except (LookupError, TypeError, AttributeError):
            pass
    return None


def _range_words(err: _BadParameter, value: str | None) -> str | None:
    """A number option's text that is no number (``--tau abc``) in the words of its range check, the one
    message of a value that is no finite number (``config.check_setting``: ``--tau abc must be a finite
    number ≥ 0 (an entropy in nats; e.g. 0.5)``), as ``--tau nan`` gets it; None for other options."""
    param = getattr(err, "param", None)
    if value is None or param is None or not getattr(param, "name", None):
        return None
    import dataclasses

    from .errors import UsageError
    from .options import fitting_example, option_ranges, run_policies

    given = _given_options(err.ctx)
    rng = option_ranges(run_policies(given)).get(param.name)
    flags = [o for o in getattr(param, "opts", []) if o.startswith("--")]
    if rng is None or not flags:
        return None
    whole = {k: int(v) for k, v in given.items() if isinstance(v, str) and v.strip().isdigit()}
    rng = dataclasses.replace(rng, example=fitting_example(param.name, whole, rng.example))  # as a range error's
    try:
        rng.check_given(value)
    except ValueError as e:
        shown = value if value and value.strip() == value else repr(value)
        return str(UsageError(f"{flags[0]} {shown} {e}"))
    return None


def _given_options(ctx) -> dict:
    """The options of the command line being parsed, as typed (parameter name → text; {} when unknown),
    so that a value that is no number is worded as an out-of-range one: in the range of the policies it
    names (``--cache dkv --refresh-every abc``: dkv's ≥ 1, ``config.run_policies``) with an example that
    fits the other options (``--gen-length 32 --steps abc``: e.g. 32), whichever option the parser met
    first. Parsed once per command, by :meth:`EcacheCommand.parse_args`."""
    return (ctx.meta.get(_GIVEN_OPTIONS) if ctx is not None else None) or {}


def _typed_options(parser, args: list) -> dict:
    """``args`` parsed into option texts by parameter name, before any type conversion; {} when the
    parser refuses them (the conversion that follows reports that error)."""
    try:
        raw, _, _ = parser.parse_args(args=list(args))
    except _ClickUsageError:
        return {}
    return raw


def usage_line(err: _ClickUsageError, where: str = "ecache") -> str:
    """One line for an option-parser error: what was wrong, the value given, which help to read
    (``where``: the command path when the error does not carry the subcommand's context)."""
    if getattr(err, "option_name", None) and getattr(err, "ctx", None) is not None:  # no such option
        from .options import suggested_flags

        flags = [o for p in err.ctx.command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]
        err.possibilities = suggested_flags(err.option_name, flags)
    msg = " ".join(err.format_message().split()).rstrip(".")
    if isinstance(err, _BadParameter):
        value = _given_value(err)
        if (shared := _range_words(err, value)) is not None:
            return shared
        if value is not None and repr(value) not in msg:
            msg = f"{msg} (got {value!r})"
    return f"{msg[:1].lower()}{msg[1:]}; see `{where} --help`"


def _bare_flags(params: list) -> list:
    """Flags take no value, so ``--help`` shows none (``--jsonl``, not ``--jsonl <bool>``)."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


def _help(ctx, formatter, command) -> None:
    """Write ``command``'s help (``ecache_cli/help.py``: the terminal's width, no option name cut)."""
    from .help import render

    formatter.write(render(command, ctx))


class EcacheCommand(TyperCommand):
    """A subcommand whose flags show no value placeholder in ``--help``, and whose help is rendered at
    the terminal's width without cutting an option name (``help.render``)."""

    def get_params(self, ctx):
        return _bare_flags(super().get_params(ctx))

    def parse_args(self, ctx, args):
        ctx.meta[_GIVEN_OPTIONS] = _typed_options(self.make_parser(ctx), args)
        rest = super().parse_args(ctx, args)
        _whole_numbers_as_typed(ctx, self.params, ctx.meta[_GIVEN_OPTIONS])
        _keep_typed_text(ctx, ctx.meta[_GIVEN_OPTIONS])
        return rest

    def format_help(self, ctx, formatter):
        _help(ctx, formatter, self)


def _whole_numbers_as_typed(ctx, params, typed: dict) -> None:
    """A whole-number option typed as a text ``int()`` does not read (``--gen-length 32.0``, which typer's
    coercion takes as 32): refused as chat's ``/gen-length 32.0``, a request's ``"max_tokens": 32.0`` and
    ``DecodeConfig(gen_length=32.0)`` are, in its range's words (:func:`usage_line`)."""
    for param in params:
        value, text = ctx.params.get(param.name), typed.get(param.name)
        if isinstance(value, bool) or not isinstance(value, int) or not isinstance(text, str):
            continue
        try:
            int(text.strip())
        except ValueError:
            err = _BadParameter(f"{text!r} is not a whole number", ctx=ctx, param=param)
            err.given_text = text
            raise err from None


def _keep_typed_text(ctx, typed: dict) -> None:
    """Each float option keeps the text it was typed as (``contract.fields.GivenFloat``) until its range
    check (:func:`handle_errors`), so that the range message names the value as typed: ``--tau 1e400 must
    be a finite number ≥ 0 …`` (not ``inf``), ``--request-timeout 0 must be > 0 …`` (not ``0.0``)."""
    from .options import GivenFloat

    for name in [n for n, v in ctx.params.items() if isinstance(v, float)]:
        text = typed.get(name)
        if isinstance(text, str):
            ctx.params[name] = GivenFloat(text)


class EcacheGroup(TyperGroup):
    """The top-level group: the option parser's usage errors become one ``error:`` line (exit 2),
    like every other ecache error, instead of typer's boxed panel."""

    def _one_line(self, ctx, call, *args):
        try:
            return call(*args)
        except BrokenPipeError:  # `ecache generate -h | head -1`: the reader has what it wanted
            _quiet_stdout()
            raise typer.Exit(code=0) from None
        except _ClickUsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `ecache` alone: the help (usage and commands), exit 2
                typer.echo(e.ctx.get_help())
                raise typer.Exit(code=2) from None
            from .console import error

            where = e.ctx.command_path if e.ctx is not None and e.ctx is not ctx else ctx.command_path
            if (e.ctx is None or e.ctx is ctx) and ctx.invoked_subcommand:
                where = f"{ctx.command_path} {ctx.invoked_subcommand}"
            error(usage_line(e, where))
            raise typer.Exit(code=e.exit_code) from None

    def parse_args(self, ctx, args):
        return self._one_line(ctx, super().parse_args, ctx, args)

    def invoke(self, ctx):
        return self._one_line(ctx, super().invoke, ctx)

    def get_params(self, ctx):
        return _bare_flags(super().get_params(ctx))

    def list_commands(self, ctx):
        """The subcommands in the order they were registered, ``help`` last (typer lists groups after
        commands: ``models`` would follow ``help``)."""
        names = super().list_commands(ctx)
        return [n for n in names if n != "help"] + [n for n in names if n == "help"]

    def format_help(self, ctx, formatter):
        _help(ctx, formatter, self)


app = typer.Typer(
    name="ecache", cls=EcacheGroup, no_args_is_help=True, rich_markup_mode="rich", pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Fast approximate KV caching for diffusion language models (LLaDA, Dream): "
         "[bold]generate[/], [bold]chat[/], [bold]profile[/], [bold]calibrate[/], [bold]trace-drift[/], "
         "[bold]serve[/], [bold]models[/]; "
         "[bold]help[/] TOPIC for details.",
)


def _quiet_stdout() -> None:
    """After a closed pipe (``ecache generate ... | head -1``): point stdout at /dev/null so the
    interpreter's final flush does not print a second BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (e.g. a test runner's buffer)
        pass


#: What Ctrl-C leaves behind: records already written stay, except where a command says otherwise.
KEPT = "interrupted; records written so far are kept"
INTERRUPTED = {"profile": "interrupted before every policy finished a batch; the table and --json were not written "
                          "(they cover the batches every policy finished)",
               "serve": "interrupted; the server stopped at once (SIGTERM stops it after --shutdown-grace)",
               "chat": "interrupted; the session ended (the answers so far were printed; files /save wrote are kept)",
               "models": "interrupted", "help": "interrupted",  # commands that write no records
               "models pull": "interrupted; the files downloaded so far are kept (pull again to finish)"}


def _on_signal(signum, handler):
    """Install ``handler`` for ``signum`` and return the previous one; None off the main thread, where
    Python cannot set signal handlers (an in-process caller running a command from a worker thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signum, handler)


def handle_errors(fn, interrupted: str = KEPT):
    """Run a command body; EcacheError → one red line on stderr and its exit code; Ctrl-C → exit 130
    with ``interrupted`` (what the command has written by then), SIGTERM the same with exit 143, also when
    the interrupt surfaced as another error (``errors.interrupt_pending``); a closed stdout pipe → quiet
    exit 0; an unwritable stdout (full device) → one line, exit 1. The command's ``quiet`` flag (``-q``)
    is set for :func:`console.info` while it runs."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import errno

        from . import console, errors, interrupts
        from .console import error
        from .errors import EcacheError

        early, interrupts.early = interrupts.early, None  # an interrupt before the command, swallowed
        errors.terminated, errors.interrupt_pending = early == signal.SIGTERM, early is not None
        console.quiet = bool(kwargs.get("quiet"))
        previous = _on_signal(signal.SIGTERM, interrupts.raise_interrupt)
        previous_int = _on_signal(signal.SIGINT, interrupts.raise_interrupt)
        try:
            if early is not None and not interrupts.resending:  # else the signal sent again ends the command
                raise KeyboardInterrupt
            from .options import check_ranges

            check_ranges(kwargs)  # every numeric option in its range before the command starts
            result = fn(*args, **_plain_floats(kwargs))
            if errors.interrupt_pending and not interrupts.resending:  # one a library swallowed ends it too
                raise KeyboardInterrupt
            return result
        except (typer.Exit, typer.Abort):  # the command's own exit status (it has said why)
            raise
        except KeyboardInterrupt:
            error(interrupted)
            raise typer.Exit(code=errors.interrupted_exit_code()) from None
        except Exception as e:
            if errors.interrupt_pending:  # the interrupt, turned into another error on its way up
                error(interrupted)
                raise typer.Exit(code=errors.interrupted_exit_code()) from None
            if isinstance(e, EcacheError):
                error(str(e))
                raise typer.Exit(code=e.exit_code) from None
            if isinstance(e, BrokenPipeError):
                _quiet_stdout()
                raise typer.Exit(code=0) from None
            if not isinstance(e, OSError) or e.errno not in (errno.ENOSPC, errno.EIO, errno.EDQUOT):
                raise
            error(f"cannot write the output ({e.strerror}); free space on the device or write elsewhere")
            _quiet_stdout()
            raise typer.Exit(code=1) from None
        finally:
            from .console import announce
            from .outputs import release_all

            announce(None)  # warnings held for a first line that never came
            release_all()  # the output locks end with the command (in-process callers run several)
            interrupts.resending = 0  # a signal still on its way meets the handler in place when it arrives
            console.quiet = False
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if previous_int is not None:
                signal.signal(signal.SIGINT, previous_int)

    return wrapper


def _plain_floats(values: dict) -> dict:
    """``values`` with each typed float (``GivenFloat``, kept for the range message) a plain float again, so
    that a command body, and the files it writes (YAML, JSON), see ordinary numbers."""
    from .options import GivenFloat

    return {k: float(v) if isinstance(v, GivenFloat) else v for k, v in values.items()}


def _version(value: bool):
    if value:
        typer.echo(f"ecache {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version.")):
    """ecache: EntropyCache and peer KV caches for diffusion LMs."""
    import warnings

    from .errors import IgnoredSetting

    warnings.simplefilter("ignore", IgnoredSetting)  # the commands warn these rules on their own stderr lines


def _register() -> None:
    """Every subcommand, registered here and only here (the command modules never import ``app``)."""
    from .commands import calibrate, chat, generate, help, models, profile, serve, trace_drift

    for name, fn in (("generate", generate.generate), ("chat", chat.chat_cmd), ("profile", profile.profile_cmd),
                     ("calibrate", calibrate.calibrate_cmd), ("trace-drift", trace_drift.trace_drift_cmd),
                     ("serve", serve.serve_cmd)):
        app.command(name, cls=EcacheCommand)(handle_errors(fn, INTERRUPTED.get(name, KEPT)))
    group = typer.Typer(cls=EcacheGroup, invoke_without_command=True, rich_markup_mode="rich",
                        short_help=models.SHORT_HELP, context_settings={"help_option_names": ["-h", "--help"]})
    group.callback()(handle_errors(models.models_cmd, INTERRUPTED["models"]))  # `ecache models` alone: the list
    for name, fn in (("show", models.show_cmd), ("pull", models.pull_cmd)):
        group.command(name, cls=EcacheCommand)(handle_errors(fn, INTERRUPTED.get(f"models {name}", "interrupted")))
    app.add_typer(group, name="models")
    app.command("help", cls=EcacheCommand)(handle_errors(help.help_cmd, INTERRUPTED["help"]))


_register()
