"""Option parsing shared by the benchmarks: one-line errors with exit 2 (the serving benchmarks'
parser), the "at least" checks of their counts, the task domains of ``--domains``, and the check that
the server's extra is installed."""

from __future__ import annotations

import argparse
import importlib.util
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``error: <message>`` on stderr, exit 2 (no usage block)."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


def check_at_least(ap: argparse.ArgumentParser, args: argparse.Namespace, minimums: dict[str, int]) -> None:
    """Refuse (``ap.error``: one line, exit 2) the first option of ``minimums`` (``dest`` name → lowest
    allowed value) whose value in ``args`` is below its minimum, naming it as its flag (``--max-batch``)."""
    for name, low in minimums.items():
        if getattr(args, name) < low:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be ≥ {low}")


def check_domains(ap: argparse.ArgumentParser, domains: str) -> None:
    """Refuse (``ap.error``: one line, exit 2) the first entry of the comma-separated ``--domains`` that is
    not a task, in the words every command uses for a task name (``tasks.check_task_name``), before the
    model loads."""
    from ecache_cli.errors import UsageError
    from ecache_cli.tasks import check_task_name

    for name in domains.split(","):
        try:
            check_task_name(name, "--domains")
        except UsageError as e:
            ap.error(str(e))


def require_serve_extra(script: str) -> None:
    """Exit 1 with one line (``serve_sim.py: needs the 'serve' extra (fastapi is missing): pip install -e
    ".[serve]"``) when a module of the server's extra is not installed: the benches that run the server's
    scheduler import it, as ``ecache serve`` does."""
    missing = [m for m in ("fastapi", "prometheus_client", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"{script}: needs the 'serve' extra ({missing[0]} is missing): pip install -e \".[serve]\"")
