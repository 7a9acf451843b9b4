"""What ``ecache calibrate`` sweeps: EntropyCache's τ, or a block-diffusion decoder's threshold.

On the bidirectional families calibrate searches τ (``runs/calibrate.py``): each τ decodes under the
``entropy`` cache, against ``none``. On a block-diffusion model (SDAR, LLaDA2.x: ``ModelSpec.block_causal``)
the ``block`` cache is exact (docs/METHOD.md §5), so there is no τ; what trades speed against quality
there is the decoder's confidence threshold (SDAR's ``low_confidence_dynamic``, LLaDA2's threshold
rule: every mask above it is committed when there are at least the step's scheduled count). So
calibrate sweeps that threshold instead (:class:`ThresholdSweep`):

- the reference is the same model with the ``block`` cache at one token per step (threshold and
  factor off, steps = gen length): what ``none`` is to τ (score, fidelity and speedup are against it);
- the values are :data:`DEFAULT_THRESHOLDS` or ``--thresholds``, then up to ``--refine`` midpoints
  between the chosen threshold and the next lower one (``tau_search.refine_threshold``); each decodes
  with the ``block`` cache and the run's other decode settings (its ``--steps``, LLaDA2.1's
  ``--edit-threshold``);
- the choice rule, the cost proxy and the acceptance (``--max-drop``, ``--min-fidelity``, ``--metric``)
  are τ's (``tau_search.choose``): the lowest threshold that meets them has the most tokens per forward;
- the wall-clock check times each candidate against the reference (:class:`ReferenceClock`);
- the profile gets ``decode: {threshold: X}`` and ``cache: {policy: block}``.

Records of a threshold sweep keep the swept value in the run file's ``tau`` field (None: the reference).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from .speed_guard import SpeedGuard, Timed, Verdict
from .tau_search import KNOBS, Point, coarse_grid, refine_next, refine_threshold

#: The thresholds a block-diffusion calibration tries without ``--thresholds``: from SDAR's and
#: LLaDA2's defaults (0.85, 0.95) up to nearly one token per step and down to half the confidence.
DEFAULT_THRESHOLDS = (0.99, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5)


@dataclass(frozen=True)
class TauSweep:
    """EntropyCache's τ against ``none`` (``runs/calibrate.py``'s module docstring)."""

    knob: str = "tau"
    reuses: bool = True  # a batch whose decisions provably equal an evaluated τ's is copied (``Evaluator``)

    @property
    def name(self) -> str:
        return KNOBS[self.knob].name

    def values(self, signals: list[float], opts) -> list[float]:
        """The coarse grid over ``none``'s signals (``tau_search.coarse_grid``), or ``--taus``, ascending."""
        return sorted(set(opts.taus)) if opts.taus else coarse_grid(signals, opts.grid)

    def refine(self, points: list[Point], base: Point, signals: list[float], opts) -> float | None:
        return refine_next(points, base, signals[0], opts.metric, *opts.fractions())

    def setting(self, settings, value: float | None, arm):
        """(policy, DecodeConfig) of ``value`` (None: ``none``) under ``arm`` (a ``calib_store.Arm`` or None)."""
        if value is None:
            return settings.policy("none"), settings.decode
        return settings.policy("entropy", tau=value, **({} if arm is None else arm.params())), settings.decode

    def order(self, value: float) -> float:
        """The table's order of the swept values: ascending τ (more skipped work further down)."""
        return value


@dataclass(frozen=True)
class ThresholdSweep(TauSweep):
    """A block-diffusion decoder's threshold against one token per step (module docstring)."""

    knob: str = "threshold"
    reuses: bool = False  # no exact rule says two thresholds commit alike: every batch is decoded

    def values(self, signals: list[float], opts) -> list[float]:
        """``--thresholds``, or :data:`DEFAULT_THRESHOLDS`, highest (safest) first."""
        return sorted(set(opts.taus or DEFAULT_THRESHOLDS), reverse=True)

    def refine(self, points: list[Point], base: Point, signals: list[float], opts) -> float | None:
        return refine_threshold(points, base, opts.metric, *opts.fractions())

    def setting(self, settings, value: float | None, arm):
        """(the run's ``block`` policy, its decode settings at ``value``), or at one token per step (None)."""
        return settings.policy("block"), threshold_decode(settings.decode, value)

    def order(self, value: float) -> float:
        """Descending threshold: more tokens per forward further down, as τ's table."""
        return -value


SWEEPS = {"tau": TauSweep(), "threshold": ThresholdSweep()}


def threshold_decode(decode, threshold: float | None):
    """``decode`` at ``threshold`` (the factor rule off), or for None the reference: one token per step
    (no threshold, no factor, steps = gen length)."""
    if threshold is None:
        return replace(decode, threshold=None, factor=None, steps=decode.gen_length)
    return replace(decode, threshold=threshold, factor=None)


def check_thresholds(values: list[float] | None) -> None:
    """``--thresholds``: confidences in (0, 1] (``DecodeConfig.ranges``); UsageError naming the bad one in
    ``--threshold``'s words (``config.check_setting``: ``--thresholds 1.5 must be in (0, 1] (a confidence; e.g.
    0.9)``)."""
    from ..config import check_setting

    for t in values or []:
        check_setting("threshold", t, "--thresholds")


def ignored_flags(given: dict[str, bool]) -> str | None:
    """The one warning for calibrate's flags that do not apply to a block-diffusion model (``given``:
    flag -> whether it was given), or None when none was given."""
    names = [flag for flag, on in given.items() if on]
    if not names:
        return None
    verb = "does" if len(names) == 1 else "do"
    return (f"{', '.join(names)} {verb} not apply to a block-diffusion model: its cache (block) is exact, so "
            "calibrate searches the decoder's --threshold (list the values with --thresholds); ignored")


class ReferenceGuard(SpeedGuard):
    """The speed check of a threshold sweep: one mode, the candidate's own decoding against the
    reference's (``Timed.plain`` = ``Timed.threshold`` = that speedup)."""

    against = "the reference"

    def speeds(self, t: Timed) -> str:
        return (f"{t.plain:.2f}× (tokens/s over the reference, median of {self.passes} passes on {self.examples} "
                f"example{'s' if self.examples != 1 else ''})")

    def no_choice_reason(self, verdict: Verdict) -> str:
        timed = "; ".join(f"{t.point.label()} {t.plain:.2f}×" for t in verdict.timed)
        return (f"no qualifying threshold runs at least as fast as the reference (one token per step) in wall-clock "
                f"time (speed check: tokens/s over the reference, median of {self.passes} passes on {self.examples} "
                f"examples): {timed}")

    def document(self, verdict: Verdict | None, batch_size: int) -> dict:
        doc = super().document(verdict, batch_size)
        doc.update(mode="reference", threshold=None, basis="tokens/s over the reference's in the same pass, median of "
                   "the passes")
        if doc["chosen"] is not None:
            doc["chosen"] = {"speedup": doc["chosen"]["plain"]}
        doc["timed"] = [{"setting": t["setting"], "threshold": t["tau"], "speedup": t["plain"], "passed": t["passed"]}
                        for t in doc["timed"]]
        return doc


class ReferenceClock:
    """The timing function of a threshold sweep's speed check: ``clock(point)`` -> (speedup, speedup),
    the candidate's tokens/s over the reference's (one token per step), each pass timing both on every
    batch in alternating order after one warm-up run of each; the median over ``guard.passes`` passes.
    Several ranks: each times its share of the batches and a pass's speed is the total tokens over the
    slowest rank's seconds (``distributed.aggregate_speed``); every rank gets the same figure."""

    def __init__(self, engine, settings, prompt_ids: list[list[int]], guard: ReferenceGuard, batch_size: int,
                 seed: int, dist=None):
        from ..distributed import DistEnv

        self.engine, self.settings, self.guard, self.seed = engine, settings, guard, seed
        self.dist = dist or DistEnv()
        order = sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), i))
        batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
        self.batches = self.dist.shard([[(i, prompt_ids[i]) for i in b] for b in batches])

    def _run(self, value: float | None, batch) -> tuple[int, float]:
        """Decode ``batch`` at threshold ``value`` (None: the reference): (generated tokens, wall seconds)."""
        policy, decode = SWEEPS["threshold"].setting(self.settings, value, None)
        run = self.engine.start([ids for _, ids in batch], decode, policy, seed=self.seed,
                                row_ids=[i for i, _ in batch])
        for _ in run:
            pass
        return sum(r.stats["generated_tokens"] for r in run.results()), run.wall_s

    def __call__(self, point: Point) -> tuple[float, float]:
        from ..distributed import aggregate_speed

        settings = [None, point.tau]
        for value in settings:  # warm-up, not timed
            if self.batches:
                self._run(value, self.batches[0])
        ratios = []
        for k in range(self.guard.passes):
            mine = {v: {"generated_tokens": 0, "wall_s": 0.0} for v in settings}
            for b, batch in enumerate(self.batches):
                for v in (settings if (b + k) % 2 == 0 else settings[::-1]):
                    tokens, wall = self._run(v, batch)
                    mine[v]["generated_tokens"] += tokens
                    mine[v]["wall_s"] += wall
            ranks = self.dist.all_gather_object(mine, "the speed check")
            ref, cand = (aggregate_speed([r[v] for r in ranks])["tokens_per_s"] for v in settings)
            ratios.append(cand / ref if ref > 0 else 0.0)
        value = statistics.median(ratios)
        return value, value
