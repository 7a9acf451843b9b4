"""Progress of ``ecache generate`` on stderr: records done, rate and ETA over the whole input.

- stderr is a terminal: one line redrawn in place and removed at the end (``terminal.ProgressLine``:
  records done of the total with a bar, then, as far as the terminal's width allows, the ETA, the
  current batch's block and step, the rate and the elapsed time);
- stderr is not a terminal (a batch job's log): one plain line every ``$ECACHE_PROGRESS_INTERVAL``
  seconds (default 30; ``ProgressLine``'s rule for every command), e.g. ``generate: 120/500 records
  (24%), 2.1 records/min, elapsed 57:10, ETA 3:01:02``, so the log shows the run is alive and how long
  it has left;
- ``--quiet``: nothing.

The format is every command's (``terminal.Counter``): the rate is the run's records over its elapsed
time (steady for a long run); the ETA is the records left at that rate. The clock is read once per
denoising step (no sync, no thread).
"""

from __future__ import annotations

import time

from ..terminal import DEFAULT_INTERVAL, INTERVAL_ENV, Counter, ProgressLine, clock, interval, rate_text  # noqa: F401 (re-exported)


class Reporter:
    """Progress over ``total`` records (None: unknown, a stream). ``console``: stderr's rich Console."""

    def __init__(self, console, total: int | None, quiet: bool, stream: bool = False, what: str = "generate"):
        self.console, self.total, self.what = console, total, what
        self.bar = ProgressLine(console, quiet or stream)  # the shared rule: in place, periodic lines, or off
        self.count = Counter(self.bar, what, total, "records")
        self.mode = {"live": "bar"}.get(self.bar.mode, self.bar.mode)
        self.done = 0
        self.t0 = self.count.t0
        self.where = ""

    def __enter__(self):
        self.bar.__enter__()
        if self.mode == "bar":
            self.count.update(0, force=True)
        return self

    def __exit__(self, *exc):
        self.bar.__exit__(*exc)
        return False

    def stdout(self, out):
        """Where records go while the progress line is shown: above it when stdout is its terminal
        (``ProgressLine.stdout``), else ``out``."""
        return self.bar.stdout(out)

    def step(self, first: int, n: int, block, blocks: int, step: int) -> None:
        """A denoising step of the batch of records ``first`` .. ``first + n - 1`` (0-based); ``block``: the
        rows' blocks, (B,) long (the earliest is shown)."""
        if self.mode == "off":
            return
        block = int(block.min()) if hasattr(block, "min") else int(block)
        self.where = f"prompts {first + 1}-{first + n} · block {block + 1}/{blocks} · step {step + 1}"
        self.count.update(self.done, self.where)

    def advance(self, k: int) -> None:
        """``k`` more records done."""
        self.done += k
        if self.mode != "off":
            self.count.update(self.done, self.where)

    def line(self, now: float | None = None) -> str:
        """The plain progress line (non-terminal stderr)."""
        now = time.monotonic() if now is None else now
        return self.count.plain(now - self.t0)
