"""The wall-clock speed check of ``ecache calibrate``: the chosen setting must not run slower than ``none``.

The choice rule (``tau_search.choose``) ranks settings by planned work (the cost proxy), which ignores
the fixed cost of each denoising step and of a partial forward's gathers; on a small model a setting
that refreshes at most of its steps can run slower than ``none`` though it plans less work, above all under
threshold decoding (few steps, several commits each). So after the proxy ranking calibrate times
its candidates against ``none`` (:meth:`SpeedGuard.run`):

- candidates: the qualifying settings in the choice rule's order (``tau_search.ranking``); at most
  ``tries`` of them are timed;
- each is timed on ``limit`` examples of the calibration sample (evenly spaced over it, so every
  group of a multi-domain run has some; :func:`spread`) in two modes (:func:`check_modes`):
  ``plain``, the run's own decoding without a parallel rule (its ``--threshold`` / ``--factor``
  dropped; for the usual run, exactly its decoding), and ``threshold``, the same settings with
  Fast-dLLM threshold decoding (what ``generate --threshold`` sets) at the run's ``--threshold``, or
  0.9 (Fast-dLLM's value, bench/speed.py's mode) when it has none;
- per mode, one ``runs.profile.measure`` call over ``none`` and the candidate (the code behind
  ``ecache profile``: one warm-up run per policy excluded, then ``PASSES`` passes with the policy
  order rotated per batch and per pass, so ``none`` and the candidate alternate in one process and a
  slow drift of the machine hits both); the mode's speedup is the median over the passes of the
  candidate's tokens/s over ``none``'s in the same pass (``metrics.throughput.pass_speedups``,
  bench/frontier.py's speedup);
- a candidate below ``MIN_SPEEDUP`` (1.0) in the mode its profile serves (``own``: ``plain`` for a
  run without a parallel rule, ``threshold`` for a run under parallel decoding, whose profile is the
  ``-parallel`` one, ``config.mode_task``) is rejected with a stderr line, and the next one is timed;
  a plain run's choice that is slower than ``none`` under threshold decoding is kept with a warning
  naming the fix (a ``-parallel`` profile, which such runs then use: τ means something else when a
  step commits several tokens); a candidate that provably decides exactly as a rejected one on every
  example (``same``: the run's records say so) is skipped untimed, as it runs the same forwards;
- the first candidate that passes is the choice; when none passes there is no choice, and the
  reason names every timed setting's speedups.

Determinism: the check is timing-dependent by nature (machine load, CPU frequency), so a rerun may
pass over a different candidate. It runs after the proxy ranking, which depends only on the run
file's records and the exact cost proxy, and it writes nothing to the run file: ``--resume`` reaches
the same ranking; only this check's verdict is measured anew. ``--no-speed-check`` skips it and keeps
the proxy's choice.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from ..errors import UsageError
from .tau_search import Point

PASSES = 3  # alternated passes per mode; the speedup is their median
MIN_SPEEDUP = 1.0  # below this in its own mode the candidate is slower than none: rejected
DEFAULT_LIMIT = 8  # examples timed: per mode 2 × 3 passes × 8 runs + 2 warm-ups, about one τ of a 50-example search
DEFAULT_THRESHOLD = 0.9  # Fast-dLLM's confidence threshold: the threshold mode of a run without --threshold
DEFAULT_TRIES = 3  # candidates timed at most before the check gives up


@dataclass
class Timed:
    """One candidate's wall-clock speedups over ``none`` (tokens/s ratios, median of the passes):
    ``plain`` under the run's decoding without a parallel rule, ``threshold`` under threshold decoding;
    ``own`` the mode the candidate's profile serves (the one it must not be slower in)."""

    point: Point
    plain: float
    threshold: float
    own: str = "plain"

    @property
    def passed(self) -> bool:
        """True when the candidate is at least as fast as ``none`` in its own mode."""
        return getattr(self, self.own) >= MIN_SPEEDUP

    def as_dict(self) -> dict:
        p = self.point
        return {"setting": p.label(), "tau": p.tau, "recent_k": p.recent_k, "block_refresh": p.block_refresh,
                "recent_steps": p.recent_steps, "block_tau": p.block_tau, "refresh_prompt": p.refresh_prompt,
                "plain": self.plain, "threshold": self.threshold, "mode": self.own, "passed": self.passed}


@dataclass
class Verdict:
    """What :meth:`SpeedGuard.run` found: the chosen ``point`` (None when every timed candidate was
    slower than ``none``, or there was none), every ``timed`` candidate in order, and the ``skipped``
    ones as (skipped, the rejected candidate it decides like)."""

    point: Point | None
    timed: list[Timed] = field(default_factory=list)
    skipped: list[tuple[Point, Point]] = field(default_factory=list)

    @property
    def chosen(self) -> Timed | None:
        return next((t for t in self.timed if t.passed), None)


@dataclass
class SpeedGuard:
    """The check's settings: ``threshold`` of the threshold mode (a confidence in (0, 1]), ``examples``
    timed, at most ``tries`` candidates timed, ``passes`` per mode, ``own`` the mode the profile serves
    (``plain`` or ``threshold``: a run under parallel decoding)."""

    threshold: float = DEFAULT_THRESHOLD
    examples: int = DEFAULT_LIMIT
    tries: int = DEFAULT_TRIES
    passes: int = PASSES
    own: str = "plain"
    against = "none"  # what the candidates are timed against, in messages (a subclass names its reference)

    def run(self, candidates: Sequence[Point], time_fn: Callable[[Point], tuple[float, float]],
            same: Callable[[Point, Point], bool] | None = None, warn: Callable[[str], None] | None = None) -> Verdict:
        """Walk ``candidates`` (the choice rule's order) and return the first one that is not slower than
        ``none`` in the guard's own mode (module docstring).

        ``time_fn(point)`` -> (plain speedup, threshold speedup); ``same(a, b)``: True when ``a`` provably
        decides as ``b`` on every example (None: never assumed); ``warn``: receives one line per rejected
        or skipped candidate (stderr). Raises nothing of its own (``time_fn``'s errors pass through).
        """
        out = Verdict(None)
        say = warn or (lambda line: None)
        for i, p in enumerate(candidates):
            if len(out.timed) >= self.tries:
                break
            twin = next((t.point for t in out.timed if same is not None and same(p, t.point)), None)
            if twin is not None:
                out.skipped.append((p, twin))
                say(f"speed check: skipped {p.label()}: it decides exactly as the rejected {twin.label()} on every "
                    "example, so it runs the same forwards")
                continue
            plain, thr = time_fn(p)
            t = Timed(p, plain, thr, self.own)
            out.timed.append(t)
            if t.passed:
                out.point = p
                if self.own == "plain" and thr < MIN_SPEEDUP:
                    say(self._threshold_note(p, thr, getattr(time_fn, "reference_nfe", {}).get("threshold")))
                return out
            if i + 1 == len(candidates):
                then = "no other setting qualifies"
            elif len(out.timed) < self.tries:
                then = "trying the next qualifying setting"
            else:
                then = f"{self.tries} setting(s) timed (--speed-check-tries), giving up"
            say(f"speed check: rejected {p.label()}: {self.speeds(t)}, slower than {self.against}; {then}")
        return out

    def _threshold_note(self, p: Point, thr: float, none_nfe: float | None) -> str:
        """The line for a chosen setting slower than none under threshold decoding (``thr`` its speedup
        there): calibrate a parallel profile too, unless ``none_nfe`` (none's forwards per example under
        threshold decoding) is 1: then no step there reads a cache, and no profile can run faster."""
        if none_nfe is not None and none_nfe <= 1.0:
            return (f"speed check: warning: under threshold decoding at {self.threshold:g} none answers every "
                    f"example in one forward (NFE {none_nfe:.1f}), so no step there reads a cache: {p.label()} "
                    f"cannot run faster there ({thr:.2f}×), nor could a parallel profile")
        return (f"speed check: warning: {p.label()} is slower than none under threshold decoding ({thr:.2f}× at "
                f"{self.threshold:g}); for such runs calibrate a parallel profile too (the same command with "
                f"--threshold {self.threshold:g}), which they then use")

    def speeds(self, t: Timed) -> str:
        """``1.80× plain, 0.93× at threshold 0.9 (tokens/s over none, median of 3 passes on 8 examples)``."""
        return (f"{t.plain:.2f}× plain, {t.threshold:.2f}× at threshold {self.threshold:g} (tokens/s over none, "
                f"median of {self.passes} passes on {self.examples} example{'s' if self.examples != 1 else ''})")

    def no_choice_reason(self, verdict: Verdict) -> str:
        """The reason when no candidate passed: each timed setting with its two speedups."""
        timed = "; ".join(f"{t.point.label()} {t.plain:.2f}× plain, {t.threshold:.2f}× at threshold "
                          f"{self.threshold:g}" for t in verdict.timed)
        mode = "plain decoding" if self.own == "plain" else f"threshold decoding at {self.threshold:g}"
        return (f"no qualifying setting runs at least as fast as none under {mode} in wall-clock time (speed "
                f"check: tokens/s over none, median of {self.passes} passes on {self.examples} examples): {timed}")

    def document(self, verdict: Verdict | None, batch_size: int) -> dict:
        """The ``speed_check`` entry of calibrate's JSON: the check's settings, every timed candidate,
        the skipped ones, and the chosen setting's speedups (``chosen``; None when none passed or the
        check did not run: ``verdict`` None means no candidate qualified by the proxy)."""
        chosen = None if verdict is None else verdict.chosen
        return {"enabled": True, "mode": self.own, "threshold": self.threshold, "examples": self.examples,
                "passes": self.passes,
                "tries": self.tries, "batch_size": batch_size, "min_speedup": MIN_SPEEDUP,
                "basis": "tokens/s over none's in the same pass, median of the passes (ecache profile's measure)",
                "timed": [] if verdict is None else [t.as_dict() for t in verdict.timed],
                "skipped": [] if verdict is None else [{"setting": a.label(), "as": b.label()}
                                                       for a, b in verdict.skipped],
                "chosen": None if chosen is None else {"plain": chosen.plain, "threshold": chosen.threshold}}


def spread(n: int, k: int) -> list[int]:
    """``min(k, n)`` indices of ``range(n)`` evenly spaced from 0 (all of them when k ≥ n)."""
    if k >= n:
        return list(range(n))
    return [i * n // k for i in range(k)]


def mode_threshold(decode, threshold: float | None = None) -> float:
    """The confidence threshold of the check's threshold mode: ``threshold`` when given, else the run's
    own (``decode.threshold``), else :data:`DEFAULT_THRESHOLD`."""
    if threshold is not None:
        return threshold
    return decode.threshold if decode.threshold is not None else DEFAULT_THRESHOLD


def check_modes(decode, threshold: float) -> dict:
    """{"plain": ``decode`` (a ``DecodeConfig``) without a parallel rule (threshold and factor None),
    "threshold": ``decode`` with Fast-dLLM threshold decoding at ``threshold`` and no factor rule (what
    ``generate --threshold`` sets), or ``decode`` itself when it decodes by the factor rule (a run's
    own parallel decoding)}. Raises UsageError (one line, naming ``--no-speed-check``) when a
    mode cannot run with the other decode settings (``settings.validate_decode``)."""
    from .settings import validate_decode

    parallel = decode if decode.factor is not None else replace(decode, threshold=threshold, factor=None)
    out = {"plain": replace(decode, threshold=None, factor=None), "threshold": parallel}
    for mode, cfg in out.items():
        try:
            validate_decode(cfg.as_dict())
        except UsageError as e:
            raise UsageError(f"the speed check's {mode_name(mode, threshold)}: {e} (or pass --no-speed-check)") \
                from None
    return out


def mode_name(mode: str, threshold: float) -> str:
    return "plain decoding" if mode == "plain" else f"threshold decoding at {threshold:g}"


def policy_spec(point: Point) -> str:
    """The ``--policies`` entry of ``point`` for ``runs.profile.measure``: ``entropy:tau=…`` with the
    point's recent_k, block_refresh, recent_steps, block_tau and refresh_prompt when it has them (a joint
    search); what it leaves out, ``measure`` takes from the run's resolved settings. A joint search's
    arm without ``block_tau`` says ``block_tau=none``, so a base profile's ``block_tau`` never reaches
    the timed policy; a one-arm search's point (τ alone) keeps the base profile's."""
    spec = f"entropy:tau={float(point.tau)!r}"
    if point.recent_k is not None:
        spec += f":recent_k={int(point.recent_k)}"
    if point.block_refresh is not None:
        spec += f":block_refresh={'true' if point.block_refresh else 'false'}"
    if point.recent_steps is not None:
        spec += f":recent_steps={int(point.recent_steps)}"
    if point.block_tau is not None:
        spec += f":block_tau={float(point.block_tau)!r}"
    elif point.recent_k is not None:
        spec += ":block_tau=none"
    if point.refresh_prompt is not None:
        spec += f":refresh_prompt={'true' if point.refresh_prompt else 'false'}"
    return spec


class WallClock:
    """The timing function of :meth:`SpeedGuard.run` on a loaded model: ``clock(point)`` -> (plain,
    threshold) speedups over ``none`` (module docstring for the protocol).

    ``engine``: the calibration's Engine; ``settings``: its resolved Settings (:func:`check_modes`
    derives both modes from its decode settings and ``guard.threshold``);
    ``prompt_ids``: the token ids of the examples to time (chat template already applied);
    ``batch_size``: examples decoded together (calibrate's ``--batch-size``); ``seed``: the random
    stream seed; ``dist``: several ranks share the batches (``measure``) and every rank gets rank 0's
    figures. Raises UsageError for a mode the decode settings cannot run (checked at construction,
    before any decoding) and EcacheError subclasses from decoding. ``reference_nfe``: per mode, none's
    forwards per example as last timed (rank 0), which :meth:`SpeedGuard.run` reads to tell a mode
    where none answers in one forward.
    """

    def __init__(self, engine, settings, prompt_ids: list[list[int]], guard: SpeedGuard, batch_size: int,
                 seed: int, dist=None):
        from ..decoding.step import StepDecoder
        from ..distributed import DistEnv

        self.engine, self.guard, self.batch_size, self.seed = engine, guard, batch_size, seed
        self.dist = dist or DistEnv()
        modes = check_modes(settings.decode, guard.threshold)
        for mode, cfg in modes.items():  # the rules the engine resolves at a run's start (e.g. Dream's quota)
            try:
                StepDecoder.build(cfg, engine.spec, engine.banned, engine.end_ids)
            except UsageError as e:
                raise UsageError(f"the speed check's {mode_name(mode, guard.threshold)}: {e} "
                                 "(or pass --no-speed-check)") from None
        self.modes = {mode: replace(settings, decode=cfg) for mode, cfg in modes.items()}
        self.reference_nfe: dict[str, float] = {}  # mode -> none's forwards per example, as last timed (rank 0)
        order = sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), i)) if batch_size > 1 else None
        self.prompt_ids = prompt_ids if order is None else [prompt_ids[i] for i in order]  # batches of like lengths

    def __call__(self, point: Point) -> tuple[float, float]:
        return self._mode("plain", point), self._mode("threshold", point)

    def _mode(self, mode: str, point: Point) -> float:
        """The median pass speedup of ``point`` over ``none`` under ``mode``'s settings (rank 0's figure on
        every rank)."""
        from ..metrics.throughput import pass_speedups
        from .profile import BASELINE, ProfileOptions, Request, measure

        spec = policy_spec(point)
        opts = ProfileOptions(policies=[BASELINE, spec], warmup=1, repeats=self.guard.passes,
                              batch_size=self.batch_size, seed=self.seed)
        requests = [Request(ids) for ids in self.prompt_ids]
        report = measure(self.engine, self.modes[mode], requests, opts, chat=False, dist=self.dist)
        if report is not None and report.incomplete:  # a Ctrl-C: profile keeps the passes it finished, a
            raise KeyboardInterrupt                    # speed check has no verdict from part of its passes
        value = None
        if report is not None:  # rank 0
            sp = pass_speedups(report.runs[spec], report.runs[BASELINE])
            value = statistics.median(sp) if sp else 0.0
            self.reference_nfe[mode] = report.summaries[BASELINE]["nfe_per_request"]
        return self.dist.all_gather_object(value, "the speed check")[0]
