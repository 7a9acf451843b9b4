"""The pure side of ``ecache calibrate``: fidelity to ``none``, per-τ aggregates, the τ grid, the
refinement step, the Pareto frontier and the choice rule. No torch, no model: plain numbers in, plain
numbers out, so every rule here is unit-tested on hand-made sweeps.

Definitions (each one is ours; the paper gives no τ, docs/METHOD.md §2.3):

- score: the task's 0–1 score (mean over the sample; ``metric="task"``), or, with
  ``metric="fidelity"``, the token agreement with ``none`` (no labels needed; ``none`` scores 1).
- fidelity: token agreement with ``none`` as ``ecache profile`` measures it (``metrics/fidelity.py``):
  over the generated positions of each pair (the longer answer plus its end marker, capped at the
  gen length), the share holding the same token, pooled over examples. ``identical``: the share of
  examples whose answer ids equal ``none``'s.
- cost: the deterministic cost proxy, canvas positions computed summed over every forward of every
  example (a full forward counts the row's own prompt + gen length; a partial one its computed
  positions). Every layer computes the same positions, so this is token-layer computations / depth.
  ``speedup = cost(none) / cost(τ)`` over the same examples drives the choice (exact, so a resumed
  run reaches the same answer); ``speedup_wall = wall(none) / wall(τ)`` is reported beside it.
- choice: among the τ with ``speedup > 1`` whose score drop ``score(none) − score(τ)`` is at most
  ``max_drop`` (a 0–1 fraction; the CLI takes points, 1 point = 0.01) and, optionally, whose
  fidelity is at least ``min_fidelity``, the one with the highest speedup; equal speedups go to the
  lower (safer) τ. ``ranking`` lists every qualifying τ in that order: calibrate's wall-clock speed
  check (``runs/speed_guard.py``) then passes over those that run slower than ``none``.
- joint search (``recent_k``, ``block_refresh``, ``recent_steps``, ``block_tau`` and ``refresh_prompt``
  searched with τ): a point also carries them; the rule is the same over every point (the highest
  cost-proxy speedup is the least planned work), equal speedups going to the lower τ, then the larger
  ``recent_k``, then ``block_refresh`` off (the paper's rule), then the larger ``recent_steps``, then
  the prompt refreshed too.
- groups (several task domains, or several shot counts, calibrated as one setting): a point also
  carries one point per group (``parts``), and qualifies only when every group's part qualifies
  against ``none``'s part of that group, so the setting meets the tolerance on every group.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple, Sequence

from ..metrics.fidelity import fidelity
from ..metrics.throughput import RowMeasure, ratio, tokens_per_s

EPS = 1e-9  # slack of the drop / fidelity comparisons (scores are k/n fractions)
REL_TIE = 1e-9  # speedups within this relative difference are a tie (the safer setting wins)


class Knob(NamedTuple):
    """What a calibration sweeps, as its messages name it: ``name`` (``τ``), the baseline's label in
    tables (``base``) and in sentences (``base_phrase``), the option listing the values (``flag``)."""

    name: str
    base: str
    base_phrase: str
    flag: str


#: The swept settings by ``Point.knob``: EntropyCache's τ against ``none`` (bidirectional models), or a
#: block-diffusion decoder's confidence threshold against its one-token-per-step schedule (the ``block``
#: cache, exact on those models: docs/METHOD.md §5).
KNOBS = {"tau": Knob("τ", "none", "none", "--taus"),
         "threshold": Knob("threshold", "reference", "the reference (one token per step)", "--thresholds")}


@dataclass
class Point:
    """One setting measured over the sample (``tau=None`` is the baseline: ``none``, or for a threshold
    sweep the one-token-per-step reference).

    ``knob``: what ``tau`` holds (:data:`KNOBS`): EntropyCache's τ (nats), or with ``"threshold"`` a
    block-diffusion decoder's confidence threshold (0–1), the cache being the exact ``block`` one.

    Fractions are 0–1. score: mean task score (None when the task is not scored). fidelity,
    identical: agreement with ``none`` (see module docstring). speedup: cost proxy ratio;
    speedup_wall: wall-clock ratio. tokens_per_s: generated tokens / wall seconds. refresh_rate:
    full forwards / NFE. nfe: mean forwards per example. cost: Σ computed positions. wall_s: Σ
    seconds. lost / gained: examples scoring lower than under ``none`` / higher (None when unscored).
    delta_ci: 95% normal interval of the paired per-example score difference (τ − none), or None.
    copied: examples whose record was copied from another τ with provably the same decisions (their
    wall time is that τ's measurement). tpf: tokens per forward (generated tokens / forwards, pooled).
    """

    tau: float | None
    n: int
    score: float | None
    fidelity: float
    identical: float
    speedup: float
    speedup_wall: float
    tokens_per_s: float
    refresh_rate: float
    nfe: float
    cost: int
    wall_s: float
    lost: int | None = None
    gained: int | None = None
    delta_ci: tuple[float, float] | None = None
    copied: int = 0
    recent_k: int | None = None
    block_refresh: bool | None = None
    recent_steps: int | None = None
    block_tau: float | None = None
    refresh_prompt: bool | None = None
    parts: dict[str, "Point"] | None = None
    tpf: float = 0.0
    knob: str = "tau"

    def metric_score(self, metric: str) -> float | None:
        """The number the choice constrains: the task score, or the fidelity."""
        return self.fidelity if metric == "fidelity" else self.score

    def label(self) -> str:
        """``τ=0.5``, with ``k=16``, ``block-refresh`` and ``steps=4`` (recent_steps) after it in a joint
        search; ``none`` for the baseline."""
        if self.tau is None:
            return KNOBS[self.knob].base
        out = f"{KNOBS[self.knob].name}={self.tau:g}"
        if self.recent_k is not None:
            out += f" k={self.recent_k}"
        if self.block_refresh:
            out += " block-refresh"
        if self.recent_steps:
            out += f" steps={self.recent_steps}"
        if self.block_tau is not None:
            out += f" block-τ={self.block_tau:g}"
        if self.refresh_prompt is False:
            out += " canvas-refresh"
        return out

    def safety(self) -> tuple:
        """Sort key of equally fast settings, safest first: lower τ (higher threshold: fewer tokens per
        forward), larger recent_k, block refresh off, larger recent_steps, the prompt refreshed too."""
        value = -self.tau if self.knob == "threshold" else self.tau
        return (value, -(self.recent_k or 0), bool(self.block_refresh), -(self.recent_steps or 0),
                self.refresh_prompt is False)

    def arm(self) -> tuple:
        """(recent_k, block_refresh, recent_steps, block_tau, refresh_prompt): the point's other knobs
        (None each outside a joint search)."""
        return (self.recent_k, self.block_refresh, self.recent_steps, self.block_tau, self.refresh_prompt)

    def as_dict(self) -> dict:
        """Every field; a threshold sweep's point names its value ``threshold`` and leaves out τ's knobs."""
        d = asdict(self)
        if self.knob == "threshold":
            d = {"threshold": d.pop("tau"), **{k: v for k, v in d.items() if k not in _TAU_ONLY}}
            d["parts"] = None if self.parts is None else {g: p.as_dict() for g, p in self.parts.items()}
        return d


#: Point fields of EntropyCache's joint search, left out of a threshold sweep's JSON.
_TAU_ONLY = ("recent_k", "block_refresh", "recent_steps", "block_tau", "refresh_prompt", "refresh_rate")


@dataclass
class Choice:
    """The outcome of :func:`choose`: ``point`` (None when no τ qualifies), a one-line ``reason`` and,
    without a point, what rejected the τs (``cause``: a key of :data:`HINTS`)."""

    point: Point | None
    reason: str
    qualifying: list[float]
    cause: str | None = None


# --- per-example comparison with none ----------------------------------------------------------------


def row_measure(rec: dict) -> RowMeasure:
    """A run-file record as the :class:`RowMeasure` that ``metrics/`` (shared with ``ecache profile``)
    works on; ``cost`` stands in for tokens_computed (padding excluded), the example index for the prompt."""
    ids = rec["token_ids"]
    return RowMeasure(prompt=rec["index"], repeat=0, generated_tokens=rec["generated_tokens"], latency_s=rec["wall_s"],
                      nfe=rec["nfe"], full_forwards=rec["full_forwards"], partial_forwards=rec["partial_forwards"],
                      tokens_computed=rec["cost"], canvas=rec.get("prompt_tokens", 0) + len(ids), token_ids=ids,
                      answer_ids=ids[:rec["answer_len"]], text=rec.get("text", ""), score=rec.get("score"))


def aggregate(tau: float | None, recs: Sequence[dict], base: Sequence[dict]) -> Point:
    """Aggregate per-example records of one setting against the ``none`` records ``base`` (same order).

    A record has: index, token_ids (list, gen_length ids), answer_len, score (float or None), nfe,
    full_forwards, partial_forwards, cost, generated_tokens, wall_s. Records pair by index. Raises
    ValueError when the two lists differ in length or are empty.
    """
    if len(recs) != len(base) or not recs:
        raise ValueError(f"{len(recs)} records against {len(base)} baseline records")
    n = len(recs)
    fid = fidelity([row_measure(r) for r in recs], [row_measure(b) for b in base])
    scored = all(r.get("score") is not None for r in recs) and all(b.get("score") is not None for b in base)
    score = lost = gained = None
    ci = None
    if scored:
        score = sum(r["score"] for r in recs) / n
        diffs = [r["score"] - b["score"] for r, b in zip(recs, base)]
        lost = sum(1 for d in diffs if d < 0)
        gained = sum(1 for d in diffs if d > 0)
        ci = mean_ci(diffs)
    cost, base_cost = sum(r["cost"] for r in recs), sum(b["cost"] for b in base)
    wall, base_wall = sum(r["wall_s"] for r in recs), sum(b["wall_s"] for b in base)
    nfe = sum(r["nfe"] for r in recs)
    gen = sum(r["generated_tokens"] for r in recs)
    return Point(
        tau=tau, n=n, score=score, fidelity=fid["token_agreement"], identical=fid["identical_share"],
        speedup=ratio(base_cost, cost) or 0.0, speedup_wall=ratio(base_wall, wall) or 0.0,
        tokens_per_s=tokens_per_s(gen, wall),
        refresh_rate=sum(r["full_forwards"] for r in recs) / nfe if nfe else 0.0, nfe=nfe / n, cost=cost,
        wall_s=wall, lost=lost, gained=gained, delta_ci=ci, copied=sum(1 for r in recs if "reused_from" in r),
        tpf=gen / nfe if nfe else 0.0)


def mean_ci(diffs: Sequence[float]) -> tuple[float, float]:
    """95% normal-approximation interval (mean ± 1.96 · sd / √n) of paired differences; (0, 0) for n < 2."""
    n = len(diffs)
    if n < 2:
        return (0.0, 0.0)
    m = sum(diffs) / n
    sd = math.sqrt(sum((d - m) ** 2 for d in diffs) / (n - 1))
    half = 1.96 * sd / math.sqrt(n)
    return (m - half, m + half)


# --- the τ grid ---------------------------------------------------------------------------------------


def round_sig(x: float, digits: int = 3, up: bool = False) -> float:
    """``x`` rounded to ``digits`` significant digits (``up``: towards +inf, so the result is ≥ x)."""
    if x == 0 or not math.isfinite(x):
        return float(x)
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(abs(x))))
    v = (math.ceil(x * scale) if up else round(x * scale)) / scale
    return float(f"{v:.{digits}g}")


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of an ascending list, q in [0, 1]."""
    n = len(sorted_values)
    pos = q * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (pos - lo) * (sorted_values[hi] - sorted_values[lo])


def coarse_grid(signals: Sequence[float], n: int = 8, r_max: float = 0.5, r_min: float = 0.02) -> list[float]:
    """The coarse τ grid over the observed signal distribution (the ``none`` run's per-step signals).

    A τ at the (1 − r) quantile refreshes about a share r of the steps (on ``none``'s trajectory).
    The grid takes ``n − 1`` refresh-rate targets r spaced geometrically from ``r_max`` down to
    ``r_min`` plus the maximum signal (rounded up: no step of ``none`` would refresh), each rounded to
    3 significant digits; duplicates are dropped. Returns ascending τs (same unit as the signal, nats
    for the entropy signals). Raises ValueError without finite signals or for n < 1.
    """
    vals = sorted(v for v in signals if math.isfinite(v))
    if not vals:
        raise ValueError("no finite signal values to build a grid from")
    if n < 1:
        raise ValueError(f"grid size must be >= 1, got {n}")
    taus = {round_sig(vals[-1], up=True)}
    k = n - 1
    for i in range(k):
        r = r_max if k == 1 else r_max * (r_min / r_max) ** (i / (k - 1))
        taus.add(round_sig(quantile(vals, 1.0 - r)))
    return sorted(taus)


def high_tau(signals: Sequence[float], r_min: float = 0.02) -> float:
    """The high τ of a signal distribution: its (1 − ``r_min``) quantile (about a share ``r_min`` of the
    steps exceed it), rounded to 3 significant digits as the grid's τs are; with the default ``r_min``
    and ``n`` ≥ 3, ``coarse_grid``'s largest τ below the maximum. Raises ValueError without finite
    signals."""
    vals = sorted(v for v in signals if math.isfinite(v))
    if not vals:
        raise ValueError("no finite signal values to take the high τ of")
    return round_sig(quantile(vals, 1.0 - r_min))


def refine_next(points: Sequence[Point], base: Point, floor: float, metric: str, max_drop: float,
                min_fidelity: float | None = None) -> float | None:
    """The next τ to evaluate around the frontier, or None when the search cannot narrow further.

    The bracket is (chosen τ, the smallest evaluated τ above it): the boundary between qualifying and
    failing lies inside. With no qualifying τ it is (``floor``, the smallest evaluated τ), ``floor``
    being the smallest observed signal (below it, τ behaves exactly like ``none``). The next τ is
    the bracket's geometric midpoint (arithmetic when the lower end is ≤ 0) at 3, else 4, significant
    digits; None when it would repeat an evaluated τ or the bracket has no upper end.
    """
    taus = sorted(p.tau for p in points)
    if not taus:
        return None
    choice = choose(points, base, metric, max_drop, min_fidelity)
    lo = choice.point.tau if choice.point is not None else floor
    above = [t for t in taus if t > lo]
    if not above:
        return None
    hi = above[0]
    mid = math.sqrt(lo * hi) if lo > 0 else (lo + hi) / 2
    for digits in (3, 4):
        t = round_sig(mid, digits)
        if lo < t < hi and t not in taus:
            return t
    return None


def same_decisions(signals: Sequence[float | None], tau_a: float, tau_b: float) -> bool:
    """True when EntropyCache at ``tau_a`` and at ``tau_b`` decide alike on every step of a run whose
    per-step signals are ``signals`` (None = -inf, never a refresh): the decision is ``signal > τ``
    (cache/entropy.py), so they differ exactly for a signal in (min(τa, τb), max(τa, τb)]."""
    lo, hi = min(tau_a, tau_b), max(tau_a, tau_b)
    return not any(s is not None and lo < s <= hi for s in signals)


# --- frontier and choice ------------------------------------------------------------------------------


def pareto_frontier(points: Sequence[Point], metric: str) -> list[Point]:
    """Points not dominated in (speedup, score): no other point is at least as fast and as good and
    better in one. Points without a score are left out. Sorted by speedup ascending."""
    scored = [p for p in points if p.metric_score(metric) is not None]
    front = []
    for p in scored:
        s = p.metric_score(metric)
        dominated = any(
            q is not p and q.speedup >= p.speedup and q.metric_score(metric) >= s
            and (q.speedup > p.speedup or q.metric_score(metric) > s) for q in scored)
        if not dominated:
            front.append(p)
    return sorted(front, key=lambda p: (p.speedup, -math.inf if p.tau is None else p.safety()[0]))


def qualifies(p: Point, base: Point, metric: str, max_drop: float, min_fidelity: float | None = None) -> bool:
    """True when ``p`` is faster than ``none`` (proxy speedup > 1), drops at most ``max_drop`` (0–1)
    of the metric's score, and, with ``min_fidelity`` (0–1), agrees with ``none`` at least that much;
    with groups (``base.parts``), every group's part must qualify against ``none``'s part too."""
    if not _qualifies_one(p, base, metric, max_drop, min_fidelity):
        return False
    return not base.parts or failing_groups(p, base, metric, max_drop, min_fidelity) == []


def _qualifies_one(p: Point, base: Point, metric: str, max_drop: float, min_fidelity: float | None) -> bool:
    s, s0 = p.metric_score(metric), base.metric_score(metric)
    if s is None or s0 is None or p.speedup <= 1.0:
        return False
    if s0 - s > max_drop + EPS:
        return False
    return min_fidelity is None or p.fidelity >= min_fidelity - EPS


def failing_groups(p: Point, base: Point, metric: str, max_drop: float, min_fidelity: float | None = None) -> list[str]:
    """The groups (``base.parts`` names, in order) where ``p``'s part does not qualify against ``none``'s
    (a group ``p`` has no part for counts as failing); [] without groups."""
    if not base.parts:
        return []
    mine = p.parts or {}
    return [g for g, b in base.parts.items()
            if g not in mine or not _qualifies_one(mine[g], b, metric, max_drop, min_fidelity)]


def choose(points: Sequence[Point], base: Point, metric: str, max_drop: float,
           min_fidelity: float | None = None) -> Choice:
    """The τ with the highest speedup among the qualifying ones (:func:`qualifies`); ties → lower τ.

    ``base`` is the ``none`` point (its metric score is the reference). Returns a :class:`Choice`;
    ``point`` is None when nothing qualifies, with a reason naming the closest candidate.
    """
    ok = _qualifying(points, base, metric, max_drop, min_fidelity)
    if not ok:
        reason, cause = _why_none(points, base, metric, max_drop, min_fidelity)
        return Choice(None, reason, [], cause)
    best = _best(ok)
    return Choice(best, chosen_reason(best, base, metric, max_drop), sorted({p.tau for p in ok}))


def ranking(points: Sequence[Point], base: Point, metric: str, max_drop: float,
            min_fidelity: float | None = None) -> list[Point]:
    """Every qualifying point in the choice rule's order: :func:`choose`'s pick first, then its pick
    among the rest, and so on (highest cost-proxy speedup first, ties to the safer setting). [] when
    nothing qualifies. The wall-clock speed check (``runs/speed_guard.py``) walks this list."""
    rest = _qualifying(points, base, metric, max_drop, min_fidelity)
    out = []
    while rest:
        best = _best(rest)
        out.append(best)
        rest = [p for p in rest if p is not best]
    return out


def _qualifying(points: Sequence[Point], base: Point, metric: str, max_drop: float,
                min_fidelity: float | None) -> list[Point]:
    """The searched points (τ set) that meet the tolerance (:func:`qualifies`), in ``points``' order."""
    return [p for p in points if p.tau is not None and qualifies(p, base, metric, max_drop, min_fidelity)]


def _best(ok: Sequence[Point]) -> Point:
    """The highest speedup of ``ok`` (non-empty); speedups within ``REL_TIE`` go to the safer point."""
    best = ok[0]
    for p in ok[1:]:
        tie = abs(p.speedup - best.speedup) <= REL_TIE * max(abs(best.speedup), 1.0)
        if (tie and p.safety() < best.safety()) or (not tie and p.speedup > best.speedup):
            best = p
    return best


def chosen_reason(best: Point, base: Point, metric: str, max_drop: float) -> str:
    """The one-line reason of choosing ``best``: its cost-proxy speedup and score against ``none``'s."""
    s, s0 = best.metric_score(metric), base.metric_score(metric)
    tpf = f", {best.tpf:.2f} tokens per forward" if best.knob == "threshold" else ""
    reason = (f"{best.label()}: {best.speedup:.2f}× (cost proxy){tpf}, {metric} score {100 * s:.1f}% vs "
              f"{100 * s0:.1f}% for {KNOBS[base.knob].base_phrase} (drop {100 * (s0 - s):.1f} ≤ {100 * max_drop:g} "
              "points)")
    if base.parts:
        reason += f"; within the tolerance on every group ({', '.join(base.parts)})"
    return reason


def _why_none(points, base, metric, max_drop, min_fidelity) -> str:
    s0, knob = base.metric_score(metric), KNOBS[base.knob]
    cands = [p for p in points if p.tau is not None and p.metric_score(metric) is not None]
    if s0 is None or not cands:
        return f"no {knob.name} has a {metric} score to compare", "score"
    best = min(cands, key=lambda p: (-p.metric_score(metric), p.safety()))
    groups = f" on every group ({', '.join(base.parts)})" if base.parts else ""
    kept = [p for p in cands if _keeps(p, base, metric, max_drop, min_fidelity)]
    faster = [p for p in cands if p.speedup > 1.0]
    cause = "speed" if kept and not faster else "score" if faster and not kept else "both"
    if base.knob == "tau" and base.nfe <= 1.0:  # every answer in one forward: no step can read the cache
        cause = "one_forward"
    msg = (f"no {knob.name} keeps the {metric} score within {100 * max_drop:g} points of {knob.base_phrase} "
           f"({100 * s0:.1f}%)"
           f"{f' with fidelity ≥ {100 * min_fidelity:g}%' if min_fidelity is not None else ''}{groups} and runs "
           f"faster; closest: {best.label()} at {100 * best.metric_score(metric):.1f}%, "
           f"fidelity {100 * best.fidelity:.1f}%, {best.speedup:.2f}×")
    failing = failing_groups(best, base, metric, max_drop, min_fidelity)
    if failing:
        msg += f" (fails on {', '.join(failing)})"
    return msg, cause


#: What to change, by what rejected the τs: ``speed`` (those that keep the score save no work: the cost
#: proxy), ``score`` (those that save work lose too much score or fidelity), ``both``, ``wall`` (the
#: wall-clock speed check found the qualifying ones slower than none), ``one_forward`` (``none`` itself
#: answers in one forward, as threshold decoding of a short answer can: there is no later step to cache).
HINTS = {
    "speed": "every τ that keeps the score computes as much as none: try larger τ (--taus), a smaller --recent-k "
             "or --joint (block refresh, recent_steps)",
    "score": "every τ that saves work loses too much: raise --max-drop, lower --min-fidelity if given, or try "
             "smaller τ (--taus)",
    "both": "the τs that keep the score save no work and those that save work lose too much: try τ between them "
            "(--taus), raise --max-drop or search --joint",
    "wall": "rerun on an idle machine, let settings that refresh less qualify (larger τ with --max-drop, a smaller "
            "--recent-k, --joint), or pass --no-speed-check to keep the cost proxy's choice",
    "one_forward": "none answers every example in one forward (NFE 1.0), so no step reads the cache and no τ can "
                   "run faster: calibrate decoding that takes more steps (without --threshold, or a higher one)",
}


#: :data:`HINTS` for a threshold sweep (block diffusion, ``KNOBS["threshold"]``); ``{lower}`` and
#: ``{higher}``: thresholds beyond the swept ones (:func:`hint`).
THRESHOLD_HINTS = {
    "speed": "every threshold that keeps the score commits no more tokens per forward than the reference: "
             "{lower}",
    "score": "every threshold that commits more tokens per forward loses too much: raise --max-drop or lower "
             "--min-fidelity if given{higher}",
    "both": "the thresholds that keep the score commit no more tokens per forward and those that do lose too much: "
            "try thresholds between them (--thresholds) or raise --max-drop",
    "wall": "rerun on an idle machine, or pass --no-speed-check to keep the cost proxy's choice",
}


def hint(knob: str, cause: str | None, tried: Sequence[float] = ()) -> str:
    """What to change when nothing qualified, by ``cause`` (a key of :data:`HINTS`; None: ``both``) and
    the swept ``knob`` (a key of :data:`KNOBS`). ``tried``: the values the sweep evaluated, so a threshold
    sweep suggests only values beyond them (or says none is left: a threshold lies in (0, 1))."""
    table = THRESHOLD_HINTS if knob == "threshold" else HINTS
    text = table.get(cause or "both", table["both"])
    if knob != "threshold":
        return text
    low, high = min(tried, default=1.0), max(tried, default=0.96)
    lower = [round_sig(low * f, 2) for f in (0.8, 0.6, 0.4)] if tried else [0.7, 0.5, 0.3]
    higher = [round_sig(1 - (1 - high) * f, 4) for f in (0.5, 0.25, 0.1)] if tried else [0.97, 0.98, 0.99]
    return text.format(
        lower=f"try lower thresholds (--thresholds {','.join(f'{t:g}' for t in lower)})" if low > 0.05 else
        f"no lower threshold is left to try (the sweep went down to {low:g}): on this model and task the "
        "threshold rule gains nothing over the reference",
        higher=f", or try higher thresholds (--thresholds {','.join(f'{t:g}' for t in higher)})" if high < 0.999
        else f" (no higher threshold is left to try: the sweep went up to {high:g})")


def refine_threshold(points: Sequence[Point], base: Point, metric: str, max_drop: float,
                     min_fidelity: float | None = None) -> float | None:
    """The next threshold to evaluate, or None when the search cannot narrow further (a threshold
    sweep's :func:`refine_next`): the bracket is (the largest evaluated threshold below the chosen one,
    the chosen one), with no qualifying threshold (the largest evaluated one, 1.0: above every
    confidence, one token per step); the next is its midpoint at 3, else 4, significant digits; None
    when it would repeat an evaluated threshold or the bracket has no lower end."""
    values = sorted(p.tau for p in points)
    if not values:
        return None
    choice = choose(points, base, metric, max_drop, min_fidelity)
    hi = choice.point.tau if choice.point is not None else 1.0
    below = [t for t in values if t < hi]
    if not below:
        return None
    lo = below[-1]
    for digits in (3, 4):
        t = round_sig((lo + hi) / 2, digits)
        if lo < t < hi and t not in values:
            return t
    return None


def _keeps(p: Point, base: Point, metric: str, max_drop: float, min_fidelity: float | None) -> bool:
    """``p`` keeps the score (and fidelity) of :func:`qualifies`, whatever its speed."""
    return qualifies(_with_speedup(p, 2.0), base, metric, max_drop, min_fidelity)


def _with_speedup(p: Point, speedup: float) -> Point:
    from dataclasses import replace

    return replace(p, speedup=speedup, parts={g: replace(q, speedup=speedup) for g, q in (p.parts or {}).items()}
                   or p.parts)
