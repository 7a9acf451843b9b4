"""Progress of ``ecache generate`` on stderr: records done, rate and ETA over the whole input.

- stderr is a terminal: one line redrawn in place and removed at the end (``terminal.ProgressLine``:
  records done of the total with a bar, then, as far as the terminal's width allows, the ETA, the
  current batch's block and step, the rate and the elapsed time);
- stderr is not a terminal (a batch job's log): one plain line every ``$ECACHE_PROGRESS_INTERVAL``
  seconds (default 30; ``ProgressLine``'s rule for every command), e.g. ``generate: 120/500 records
  (24%), 2.1 records/min, elapsed 57:10, ETA 3:01:02``, so the log shows the run is alive and how long
  it has left;
- ``--quiet``: nothing.

The rate is the run's records over its elapsed time (steady for a long run); the ETA is the records
left at that rate. The clock is read once per denoising step (no sync, no thread).
"""

from __future__ import annotations

import time

from ..terminal import DEFAULT_INTERVAL, INTERVAL_ENV, ProgressLine, clock, interval  # noqa: F401 (re-exported)


def rate_text(done: int, elapsed: float) -> str:
    """Records per second, per minute or per hour, whichever reads as a number ≥ 1."""
    if done <= 0 or elapsed <= 0:
        return "rate unknown"
    r = done / elapsed
    for unit, f in (("s", 1), ("min", 60), ("h", 3600)):
        if r * f >= 1 or unit == "h":
            return f"{r * f:.1f} records/{unit}"
    return "rate unknown"


class Reporter:
    """Progress over ``total`` records (None: unknown, a stream). ``console``: stderr's rich Console."""

    def __init__(self, console, total: int | None, quiet: bool, stream: bool = False, what: str = "generate"):
        self.console, self.total, self.what = console, total, what
        self.bar = ProgressLine(console, quiet or stream)  # the shared rule: in place, periodic lines, or off
        self.mode = {"live": "bar"}.get(self.bar.mode, self.bar.mode)
        self.done = 0
        self.t0 = self.bar.t0
        self.where = ""

    def __enter__(self):
        self.bar.__enter__()
        if self.mode == "bar":
            self._tick(force=True)
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
        self._tick()

    def advance(self, k: int) -> None:
        """``k`` more records done."""
        self.done += k
        if self.mode != "off":
            self._tick()

    def _tick(self, force: bool = False) -> None:
        now = time.monotonic()
        el = now - self.t0
        head = f"{self.what} {self.done}" + (f"/{self.total}" if self.total else "")
        fields = [self._eta(el), self.where, rate_text(self.done, el), f"elapsed {clock(el)}"]
        self.bar.show(head, *[f for f in fields if f], done=self.done, total=self.total,
                      force=force or self.done == self.total, plain=lambda: self.line(now))

    def _eta(self, el: float) -> str:
        """``ETA 1:02`` from the rate so far; "" before the first record or without a total."""
        if not (self.total and self.done):
            return ""
        return f"ETA {clock((self.total - self.done) * el / self.done)}"

    def line(self, now: float | None = None) -> str:
        """The plain progress line (non-terminal stderr)."""
        now = time.monotonic() if now is None else now
        el = now - self.t0
        if self.total:
            head = f"{self.what}: {self.done}/{self.total} records ({100 * self.done / self.total:.0f}%)"
        else:
            head = f"{self.what}: {self.done} records"
        eta = self._eta(el) or "ETA unknown"
        parts = [head, rate_text(self.done, el), f"elapsed {clock(el)}"]
        if self.total:
            parts.append(eta)
        if self.where:
            parts.append(f"now {self.where}")
        return ", ".join(parts)
