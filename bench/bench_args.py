"""Option parsing shared by the serving benchmarks (``serve_sim.py``, ``prefix_reuse.py``,
``admission_model.py``): one-line errors with exit 2, and the "at least" checks of their counts."""

from __future__ import annotations

import argparse


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
