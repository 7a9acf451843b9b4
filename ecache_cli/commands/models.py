"""``ecache models``: the models ecache knows (list), ``show NAME`` (one model's facts) and ``pull NAME``
(fetch an alias into the Hugging Face cache). The rows and facts come from ``runs/models.py``."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from ..options import Quiet

Json = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of the table.")]
Name = Annotated[str, typer.Argument(metavar="NAME", show_default=False, help="An alias (ecache models lists them), "
                                      "tiny, a Hugging Face repo id or a checkpoint folder.")]
Repo = Annotated[str, typer.Argument(metavar="NAME", show_default=False,
                                     help="An alias (ecache models lists them) or a Hugging Face repo id (org/name).")]
#: The one line of ``ecache --help``'s command list.
SHORT_HELP = "The models ecache knows, their sizes and memory; show NAME: one model; pull NAME: download it."


def _console():
    """A console at the terminal's width (``$COLUMNS`` when set, 80 for a pipe), read when the command runs."""
    from rich.console import Console

    return Console(highlight=False)


def _write(renderable, console=None) -> None:
    """Print ``renderable`` on stdout as one write: a closed pipe (``| head``) is then handle_errors' quiet
    exit 0. Lines lose the trailing spaces rich pads them to the console's width with."""
    console = console or _console()
    with console.capture() as shown:
        console.print(renderable)
    sys.stdout.write("\n".join(line.rstrip(" ") for line in shown.get().split("\n")))
    sys.stdout.flush()


def _json(data) -> None:
    """``--json``: the document on stdout as one line, as every command's ``--json -`` (``outputs.write_json``)."""
    sys.stdout.write(json.dumps(data, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def models_cmd(ctx: typer.Context, as_json: Json = False, quiet: Quiet = False):
    """The models ecache knows: every alias and the embedded tiny, with family, kind, parameters, the memory
    their weights need in bfloat16 and float32, and whether each is in the local Hugging Face cache (no
    network). [bold]show[/] NAME: one model's facts; [bold]pull[/] NAME: download one.

    Examples: [cyan]ecache models[/] · [cyan]ecache models show dream-7b[/] · [cyan]ecache models pull llada-moe[/]
    """
    ctx.obj = {"quiet": quiet}  # `ecache models -q show NAME`: the subcommand's -q too (every command takes -q)
    if ctx.invoked_subcommand is not None:
        if as_json:
            from ..errors import UsageError

            raise UsageError(f"--json goes after the subcommand: ecache models {ctx.invoked_subcommand} ... --json"
                             if ctx.invoked_subcommand == "show" else
                             f"--json is for the list and `ecache models show`, not {ctx.invoked_subcommand}")
        return
    from ..runs.models import catalogue, table

    rows = catalogue()
    if as_json:
        _json(rows)
    else:
        console = _console()
        _write(table(rows, console.width), console)


def _quiet(ctx: typer.Context, quiet: bool) -> bool:
    """-q given to the subcommand or to ``ecache models`` before it."""
    return quiet or bool((ctx.obj or {}).get("quiet"))


def show_cmd(ctx: typer.Context, name: Name, as_json: Json = False, quiet: Quiet = False):
    """One model's facts: family, repository, sizes and weight memory, config summary, special tokens, chat
    template and default profile; for an alias not downloaded yet, what is known and how to get it. -q drops
    the notes on stderr."""
    from ..console import err
    from ..runs.models import describe, show_table

    info, notes = describe(name)
    for note in [] if _quiet(ctx, quiet) else notes:
        err.print(f"note: {note}", markup=False, highlight=False)
    if as_json:
        _json(info)
    else:
        _write(show_table(info))


def pull_cmd(ctx: typer.Context, name: Repo, quiet: Quiet = False):
    """Download an alias (or a Hugging Face repo id) into the Hugging Face cache with huggingface_hub, and
    print its folder; offline, one line says so and gives the command to run on a connected machine. -q
    drops the line saying what was done (the folder is still printed)."""
    from ..console import err
    from ..runs.models import pull

    path, how = pull(name)
    say = {"embedded": f"{name} is embedded in the package: nothing to download",
           "cached": f"{name} is already in the Hugging Face cache: nothing to download",
           "downloaded": f"downloaded {name}"}[how]
    if not _quiet(ctx, quiet):
        err.print(f"{say} ({path}); use it with --model {name}", markup=False, highlight=False)
    sys.stdout.write(f"{path}\n")
    sys.stdout.flush()
