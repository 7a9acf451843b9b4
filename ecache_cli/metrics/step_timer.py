"""Timing a denoising step's sections without slowing it down.

On CPU a mark is ``time.perf_counter()``; on CUDA it is an event recorded on the current stream, and
the events are read in one sync when the pending steps are resolved (at the end of a run, every 256
steps, or after each step when a consumer needs the times at once), never per section.

Seconds the model spent compiling (``--compile``: ``paused()``, a running total) are left out of every
time: each mark carries the total at that moment and a section's time is its span less their growth.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    """Marks per step and the run's totals: forward_s, decision_s, sampling_s (seconds)."""

    def __init__(self, cuda: bool, paused=None):
        self.cuda = cuda
        self.paused = paused  # () -> seconds not spent decoding so far (compiling), or None: never paused
        self.pending: list = []  # (record, marks) not yet turned into seconds
        self.forward_s = self.decision_s = self.sampling_s = 0.0

    def mark(self):
        """Now, as (CUDA event or ``time.perf_counter()``, seconds paused so far)."""
        paused = self.paused
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev, 0.0 if paused is None else paused()
        return time.perf_counter(), 0.0 if paused is None else paused()

    def clock(self) -> float:
        """Seconds on the run's clock: ``time.perf_counter()`` (after a CUDA sync) less the seconds paused."""
        if self.cuda and torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - (0.0 if self.paused is None else self.paused())

    def add(self, rec, marks: tuple, now: bool) -> None:
        """Queue step ``rec``'s marks (t0 plan t1 forward t2 outputs t2b sampling t3 observe t4); ``now``
        resolves at once (always on CPU)."""
        self.pending.append((rec, marks))
        if not self.cuda or now or len(self.pending) >= 256:
            self.resolve()

    def resolve(self) -> None:
        """Set the pending records' ``forward_s`` / ``sampling_s`` / ``decision_s`` (plan, observe and the
        extra outputs the policy asked for) and add them to the totals."""
        if not self.pending:
            return
        if self.cuda:
            self.pending[-1][1][-1][0].synchronize()
            span = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731  (milliseconds between events)
        else:
            span = lambda a, b: b - a  # noqa: E731

        def dt(a, b):  # the time between marks a and b, less what was paused between them
            return max(span(a[0], b[0]) - (b[1] - a[1]), 0.0)

        for rec, (t0, t1, t2, t2b, t3, t4) in self.pending:
            rec.forward_s, rec.sampling_s = dt(t1, t2), dt(t2b, t3)
            rec.decision_s = dt(t0, t1) + dt(t3, t4) + (dt(t2, t2b) if t2b is not t2 else 0.0)
            self.forward_s += rec.forward_s
            self.sampling_s += rec.sampling_s
            self.decision_s += rec.decision_s
        self.pending.clear()
