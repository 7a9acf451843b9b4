"""``ecache help [TOPIC]``: what does not fit an option's one line of ``--help`` (``ecache_cli/help.py``)."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer


def help_cmd(
    ctx: typer.Context,
    topic: Annotated[Optional[str], typer.Argument(help="decoding, cache, profiles, input, outputs, or a command.")] = None,
):
    """Longer help on one topic; a command name shows that command's --help; no topic lists them."""
    from rich.console import Console

    from ..help import TOPICS, print_topic, topic_text

    group = ctx.parent.command if ctx.parent is not None else None
    sub = group.get_command(ctx.parent, topic) if group is not None and topic is not None else None
    if sub is not None and topic not in TOPICS:
        sub_ctx = typer.Context(sub, info_name=topic, parent=ctx.parent)
        typer.echo(sub.get_help(sub_ctx))
        return
    console = Console(highlight=False)
    with console.capture() as shown:  # written below, so a closed pipe (| head) is handle_errors' exit 0:
        print_topic(console, topic_text(topic))  # rich itself exits 1 on a broken pipe
    sys.stdout.write(shown.get())
    sys.stdout.flush()
