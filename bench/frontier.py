"""Frontier benchmark: every cache policy swept over its own knobs, speed against fidelity, on held-out prompts.

For each workload (a task domain at a number of shots: arith, code, list at 0 and 4 shots by default;
gsm8k as the out-of-distribution stress case) and each decoding mode (``plain``: one token committed per
step; ``threshold``: Fast-dLLM threshold decoding, ``--threshold``), every point of every policy's knob
grid decodes the same ``--n`` held-out test prompts (``held_out``: drawn with ``--seed``, which must
differ from every shipped profile's calibration seed, and never a question of a calibration sample).
The points of one workload and mode go through one ``ecache_cli.runs.profile.measure`` call (the code
behind ``ecache profile``: warm-up excluded, policy order rotated per prompt and pass), so they share
``none``'s baseline; a point's speedup is the median over ``--passes`` passes of its tokens/s over
``none``'s in the same pass; its fidelity is the token agreement and identical share with ``none``
and the task score (``ecache_cli/metrics``).

Grids (``GRIDS``; ``--grid small|full``): entropy sweeps τ × recent_k × block_refresh (and the other
signals in ``full``), τ × recent_steps (its variant, also with block refresh) and, in ``small``, τ with
recent_steps 1 and block_tau at the workload's high τ (``HIGH_TAU``; with and without refresh_prompt),
its τ values placed at quantiles of ``none``'s own per-step signal on the workload
(``runs/tau_search.coarse_grid``: τ at the (1 − r) quantile refreshes about a share r of the steps;
τ = 0, which decodes as ``none``, only as a fixed point);
the shipped profiles' settings for the model (the workload's domain and ``default``) are extra entropy
points (label ``profile:<task>``).
Prefix and dual sweep ``refresh_every``; dLLM-Cache kr (and kp, rho); dKV-Cache its refresh period;
d2Cache rollout_p and current_k; Elastic-Cache gamma and window; ES-dLLM its block update period
(and proportions). A ``--policies`` entry ``name:key=value...`` is one fixed point instead of a grid.

Verdicts (``verdicts``), per workload and mode, on (speedup, token agreement):
- the Pareto frontier of each policy (``pareto``: no other point of the policy at least as fast and
  as faithful, better in one);
- entropy dominates a peer when every peer point is matched by an entropy point with speedup ≥
  ``--slack`` (0.97) × the peer's and agreement ≥ the peer's (``dominates``);
- entropy has a point ≥ ``--margin`` (1.10) × as fast as dual's fastest point at ≥ that point's
  agreement (``beats_fastest``);
- each shipped domain profile point lies within ``--slack`` of the entropy frontier at its agreement
  (its speedup ≥ 0.97 × the fastest entropy point at ≥ its agreement) and is not slower than ``none``;
  the ``default`` profile (one setting for every domain) need only be not slower than ``none``.
Prints each frontier, the verdict tables and a last stdout line of JSON; ``--markdown`` writes the
tables for BENCHMARKS.md, ``--plot`` one panel per workload and mode (PNG), ``--json`` every point;
``--merge a.json b.json ...`` combines runs made side by side (one per domain) without measuring.
With ``--json``, every finished workload is saved there at once; ``--resume`` then measures only the
workloads that file lacks (same settings required; a grid that only grew since: the saved workloads get
the added points, ``grow_workload``), so a run of many hours can stop and go on;
``--chunk N`` saves inside a workload too: N settings at a time, each chunk with its own ``none``
passes (speedups are per-pass ratios within a chunk), so a workload of hours resumes from its last chunk.
``--refine N`` then bisects entropy's τ (``refine_workload``): a grid places τ at a few quantiles, so
a peer point may fall between two of them; each round measures, per arm (recent_k, block refresh,
recent_steps), the τ between the last one that keeps the unmatched peer point's agreement and the next
(``tau_between``), also toward dual's fastest point while the margin is missed. The added points are
listed in the workload's ``refined``; with ``--resume`` a saved workload gets the rounds it lacks.
``--confirm N`` then times the close calls again (``confirm_workload``): points measured in different
calls (grid, refine rounds, a grown grid) carry each call's own timing drift of a few percent, so each
unmatched or narrowly matched peer point, dual's fastest while the margin is missed and each profile off
the frontier is measured once more in one call beside the entropy points nearest to it, every point's
passes pooled.

    python bench/frontier.py --n 48 --passes 3 --markdown docs/frontier.md --plot docs/frontier.png
    python bench/frontier.py --domains list --shots 0 --n 2 --passes 1 --modes plain --grid small  # a quick look
    python bench/frontier.py --model /path/to/LLaDA-8B-Instruct --device cuda --dtype bfloat16 --n 48
    python bench/frontier.py --json runs_out/all.json --resume   # stop at any time; the same line goes on
    python bench/frontier.py --domains list --json runs_out/list.json   # one per domain, side by side, then:
    python bench/frontier.py --merge runs_out/{arith,code,list,gsm8k}.json --markdown docs/frontier.md \
        --plot docs/frontier.png
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import statistics
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ecache_cli.metrics.throughput import pass_speedups

REPO = Path(__file__).resolve().parent.parent
GSM8K_CANDIDATES = [REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl",
                    REPO.parent.parent / "shared" / "data" / "gsm8k" / "test.jsonl"]
ENTROPY = "entropy"
BASELINE = "none"
SLACK = 0.97  # a peer point is matched by an entropy point at >= 0.97x its speedup (the issue's tolerance)
MARGIN = 1.10  # entropy's point >= 10 % faster than dual's fastest point, at >= its agreement
PEER_ORDER = ("prefix", "dual", "dllm-cache", "dkv", "d2cache", "elastic", "es-dllm", "es-dllm-conf")

#: a grid's ``block_tau`` value that stands for the workload's high τ: the largest τ grid value below the
#: maximum signal (the quantile at which about 2 % of ``none``'s steps would refresh)
HIGH_TAU = "high"

# Knob grids per policy (values inside each policy's declared ``ranges``; settings equal to the policy's
# forced refresh, which decode as ``none``, are left out of the peers' grids). Entropy's τ comes from the
# workload's signal (``TAU_QUANTILES``), so its entries list its other knobs: a list of families, each
# swept as a product with τ (the paper's rule with recent_k and block refresh; the recent_steps variant).
GRIDS: dict[str, dict] = {
    "small": {
        "prefix": {"refresh_every": [0, 4]},
        "dual": {"refresh_every": [0, 2, 4, 8]},
        # each peer at its paper's default and on both sides of it (a faster and a more faithful point)
        "dllm-cache": {"kr": [4, 7, 14]},
        "dkv": {"refresh_every": [4, 8, 16]},
        "d2cache": {"rollout_p": [0.05, 0.1, 0.3]},
        "elastic": {"gamma": [0.8, 0.9, 0.95]},
        "es-dllm": {"block_update_freq": [0, 4, 16]},
        "es-dllm-conf": {"block_update_freq": [0, 4, 16]},
        ENTROPY: [{"recent_k": [16, 64], "block_refresh": [False, True], "signal": ["max-entropy"]},
                  # the recent_steps variant: commits recomputed while young, by age instead of count
                  {"recent_k": [0], "recent_steps": [4, 8], "signal": ["max-entropy"]},
                  # and with a refresh at each block start (cheap partial steps, exact at block boundaries)
                  {"recent_k": [0], "recent_steps": [4], "block_refresh": [True], "signal": ["max-entropy"]},
                  # the previous step's commits only, a block start refreshing only after a block whose
                  # signal reached the workload's high τ; with triggered refreshes of the canvas alone
                  {"recent_k": [0], "recent_steps": [1], "block_tau": [HIGH_TAU], "refresh_prompt": [False],
                   "signal": ["max-entropy"]},
                  {"recent_k": [0], "recent_steps": [1], "block_tau": [HIGH_TAU], "signal": ["max-entropy"]}],
    },
    "full": {
        "prefix": {"refresh_every": [0, 2, 4, 8, 16]},
        "dual": {"refresh_every": [0, 2, 3, 4, 6, 8, 16]},
        "dllm-cache": {"kp": [25, 50], "kr": [2, 4, 7, 14], "rho": [0.1, 0.25, 0.5]},
        "dkv": {"refresh_every": [2, 4, 8, 16]},
        "d2cache": {"rollout_p": [0.05, 0.1, 0.2, 0.4], "current_k": [16, 32]},
        "elastic": {"gamma": [0.8, 0.9, 0.95, 0.99], "window": [8, 16, 32]},
        "es-dllm": {"block_update_freq": [0, 4, 8, 16], "proportions": ["1,0.5,0.25", "1,0.75,0.5"]},
        "es-dllm-conf": {"block_update_freq": [0, 4, 8, 16], "proportions": ["1,0.5,0.25", "1,0.75,0.5"]},
        ENTROPY: [{"recent_k": [0, 8, 16, 32, 64, 128], "block_refresh": [False, True], "signal": ["max-entropy"]},
                  {"recent_k": [16, 64], "signal": ["sum-entropy", "max-confidence"]},
                  {"recent_k": [0, 16], "recent_steps": [2, 4, 8, 16], "signal": ["max-entropy"]},
                  {"recent_k": [0], "recent_steps": [4, 8], "block_refresh": [True], "signal": ["max-entropy"]}],
    },
}
#: coarse_grid size per grid: n - 1 quantile points (refresh shares 0.5 .. 0.02) plus the largest signal
TAU_QUANTILES = {"small": 4, "full": 8}


# --- pure parts: grids, points, frontiers, verdicts ------------------------------------------------------


def spec(name: str, params: dict) -> str:
    """The ``--policies`` entry of policy ``name`` with ``params`` (``runs/profile.parse_policy_spec``
    reads it back): ``entropy:tau=0.5:recent_k=16:block_refresh=false``; keys in the given order."""
    def text(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return repr(v) if isinstance(v, float) else str(v)

    return ":".join([name, *(f"{k}={text(v)}" for k, v in params.items())])


def expand(name: str, axes: dict[str, list]) -> list[str]:
    """Every combination of the values in ``axes`` (name → list of values, in order) as specs of policy
    ``name``, the last axis varying fastest; ``[name]`` when ``axes`` is empty. Raises ValueError for an
    axis without values."""
    for k, vs in axes.items():
        if not vs:
            raise ValueError(f"{name}: knob {k} has no values")
    keys = list(axes)
    return [spec(name, dict(zip(keys, combo))) for combo in itertools.product(*(axes[k] for k in keys))] or [name]


def entropy_axes(families: list[dict[str, list]], taus_by_signal: dict[str, list[float]]) -> list[str]:
    """Entropy's specs: for each family (knob → values) and each of its signals, τ from
    ``taus_by_signal[signal]`` × every other knob of the family; a ``block_tau`` of ``HIGH_TAU`` becomes
    the signal's largest τ below its maximum (its only τ when it has one); duplicates dropped, order kept."""
    out = []
    for knobs in families:
        others = {k: v for k, v in knobs.items() if k != "signal"}
        for sig in knobs.get("signal", ["max-entropy"]):
            taus = sorted(set(taus_by_signal[sig]))
            high = taus[-2] if len(taus) > 1 else taus[-1]
            axes = {k: [high if v == HIGH_TAU else v for v in vs] for k, vs in others.items()}
            out += expand(ENTROPY, {"tau": taus, **axes, "signal": [sig]})
    return list(dict.fromkeys(out))


def tau_grid(signals: list[float], n: int) -> list[float]:
    """τ values for one signal: ``tau_search.coarse_grid(signals, n)``, quantiles of ``none``'s per-step
    signal (a τ at the (1 − r) quantile refreshes about a share r of the steps, r from 0.5 down to 0.02)
    and the largest signal rounded up. Signals that are None or not finite (steps that committed
    nothing) are ignored; [1.0] (the policy's default) when none is left. τ = 0 (a refresh every step,
    decoding as ``none`` at its cost) is left out; ``--policies entropy:tau=0`` adds it."""
    from ecache_cli.runs.tau_search import coarse_grid

    vals = [s for s in signals if s is not None and math.isfinite(s)]
    return coarse_grid(vals, n) if vals else [1.0]


@dataclass
class Point:
    """One measured setting of one workload and mode. speedup: median over passes of tokens/s over
    ``none``'s in the same pass (``speedups`` per pass); agreement, identical: 0–1 shares against
    ``none``; score: mean task score (None when unscored); work: computed positions over none's.
    ``label``: ``profile:<task>`` for a shipped profile's setting, else the spec."""

    policy: str
    spec: str
    speedup: float
    agreement: float
    identical: float | None = None
    score: float | None = None
    speedups: list[float] = field(default_factory=list)
    work: float | None = None
    label: str = ""
    own_speedup: float | None = None
    pooled: int = 1

    def name(self) -> str:
        return self.label or self.spec


def arm_of(spec_text: str) -> tuple:
    """The arm of an entropy spec: its (knob, value) pairs but τ, in the spec's order."""
    from ecache_cli.runs.profile import parse_policy_spec

    return tuple((k, v) for k, v in parse_policy_spec(spec_text)[1].items() if k != "tau")


def pool_equivalent(points: list[Point]) -> list[Point]:
    """The points with the passes of equivalent entropy settings pooled. τ only decides when a row
    refreshes, so entropy settings of one arm (every knob but τ equal) whose runs computed the same work
    and gave the same fidelity (token agreement, identical share, score) made the same refresh decisions:
    one computation timed several times, whose speedups differ by timing noise alone. Each such point's
    ``speedup`` becomes the median of the group's per-pass speedups together (``pooled``: the group's
    size; ``own_speedup``: the median of its own passes). Other points keep their own median. Idempotent:
    it reads the per-pass ``speedups`` only."""

    def key(p: Point):
        if p.policy != ENTROPY or p.work is None or not p.speedups:
            return None
        return (tuple(sorted(arm_of(p.spec))), round(p.work, 9), p.agreement, p.identical, p.score)

    keys = [key(p) for p in points]
    groups: dict = {}
    for p, k in zip(points, keys):
        if k is not None:
            groups.setdefault(k, []).append(p)
    out = []
    for p, k in zip(points, keys):
        own = statistics.median(p.speedups) if p.speedups else p.speedup
        group = groups.get(k, [p])
        sp = statistics.median([x for q in group for x in q.speedups]) if len(group) > 1 else own
        out.append(replace(p, speedup=sp, own_speedup=own, pooled=len(group)))
    return out


def pareto(points: list[Point]) -> list[Point]:
    """The points no other point dominates in (speedup, agreement): none at least as fast and at least as
    faithful and strictly better in one. Exact duplicates both stay. Sorted by speedup, then agreement."""
    front = [p for p in points
             if not any(q.speedup >= p.speedup and q.agreement >= p.agreement
                        and (q.speedup > p.speedup or q.agreement > p.agreement) for q in points)]
    return sorted(front, key=lambda p: (p.speedup, p.agreement))


def match(entropy: list[Point], peer: Point, slack: float = SLACK) -> Point | None:
    """The fastest entropy point with speedup ≥ ``slack`` × the peer's and agreement ≥ the peer's, or None."""
    ok = [e for e in entropy if e.speedup >= slack * peer.speedup and e.agreement >= peer.agreement]
    return max(ok, key=lambda e: (e.speedup, e.agreement)) if ok else None


def dominates(entropy: list[Point], peer: list[Point], slack: float = SLACK) -> dict:
    """Whether every ``peer`` point is matched (:func:`match`) by an entropy point. Returns {dominated,
    points (peer points checked), unmatched (their specs)}; dominated is None (no verdict) when either
    side has no points."""
    unmatched = [p.name() for p in peer if match(entropy, p, slack) is None]
    return {"dominated": (not unmatched) if peer and entropy else None, "points": len(peer),
            "unmatched": unmatched if entropy else []}


def beats_fastest(entropy: list[Point], dual: list[Point], margin: float = MARGIN) -> dict:
    """Whether an entropy point is ≥ ``margin`` × as fast as dual's fastest point at ≥ that point's
    agreement. Returns {ok, dual_fastest: (spec, speedup, agreement) or None, entropy: the fastest such
    entropy point's (spec, speedup, agreement) or None, ratio: its speedup over dual's fastest}; ok is None
    (no verdict) when either side has no points."""
    if not dual or not entropy:
        return {"ok": None, "dual_fastest": None, "entropy": None, "ratio": None}
    d = max(dual, key=lambda p: (p.speedup, p.agreement))
    ok = [e for e in entropy if e.agreement >= d.agreement]
    best = max(ok, key=lambda e: (e.speedup, e.agreement)) if ok else None
    ratio = best.speedup / d.speedup if best is not None and d.speedup > 0 else None
    return {"ok": ratio is not None and ratio >= margin, "dual_fastest": (d.name(), d.speedup, d.agreement),
            "entropy": None if best is None else (best.name(), best.speedup, best.agreement), "ratio": ratio}


def frontier_gap(point: Point, entropy: list[Point], slack: float = SLACK) -> dict:
    """How far ``point`` (a shipped profile's setting) lies from the entropy frontier at its agreement:
    ratio = its speedup over the fastest entropy point with agreement ≥ its own (itself included, so
    ≤ 1). A domain profile (a label other than ``profile:default`` among its labels) is ok when ratio ≥
    ``slack`` and it is not slower than ``none`` (speedup ≥ 1); the ``default`` profile alone, one
    setting for every domain (its τ is the one the most sensitive domain allows), only needs the latter,
    its ratio being informational (``domain`` False)."""
    ok = [e for e in entropy if e.agreement >= point.agreement]
    best = max(ok, key=lambda e: e.speedup) if ok else point
    ratio = point.speedup / best.speedup if best.speedup > 0 else 1.0
    domain = any(lab != "profile:default" for lab in point.name().split(","))
    return {"label": point.name(), "speedup": point.speedup, "agreement": point.agreement, "ratio": ratio,
            "frontier_point": best.name(), "frontier_speedup": best.speedup, "domain": domain,
            "ok": (ratio >= slack or not domain) and point.speedup >= 1.0}


def verdicts(points: list[Point], slack: float = SLACK, margin: float = MARGIN) -> dict:
    """Frontiers and checks of one workload and mode: {frontiers: {policy: [spec]}, dominance: {peer:
    :func:`dominates`}, beats_dual_fastest: :func:`beats_fastest`, profiles: [:func:`frontier_gap`]}.
    Entropy's points include the profile points."""
    by: dict[str, list[Point]] = {}
    for p in points:
        by.setdefault(p.policy, []).append(p)
    ent = by.get(ENTROPY, [])
    peers = [q for q in by if q not in (ENTROPY, BASELINE)]
    return {"frontiers": {q: [p.name() for p in pareto(ps)] for q, ps in by.items() if q != BASELINE},
            "dominance": {q: dominates(ent, by[q], slack) for q in sorted(peers, key=_peer_rank)},
            "beats_dual_fastest": beats_fastest(ent, by.get("dual", []), margin),
            "profiles": [frontier_gap(p, ent, slack) for p in ent if p.label.startswith("profile:")]}


def refine_targets(points: list[Point], v: dict) -> list[Point]:
    """The points entropy has yet to reach in one workload and mode (``verdicts`` ``v`` of ``points``):
    every peer point no entropy point matches, and dual's fastest point while the margin over it is
    missed. Each at most once, in the order of ``points``."""
    unmatched = {name for d in v["dominance"].values() for name in d["unmatched"]}
    beat = v["beats_dual_fastest"]
    fastest = beat["dual_fastest"][0] if beat["ok"] is False and beat["dual_fastest"] else None
    return [p for p in points if p.policy not in (ENTROPY, BASELINE) and (p.name() in unmatched or p.name() == fastest)]


def _best_per_arm(entropy: list[Point], agreement: float, arms: int = 2) -> list[Point]:
    """The fastest entropy point at ≥ ``agreement`` within each arm (every knob but τ), for the ``arms``
    fastest arms."""
    best: dict[tuple, Point] = {}
    for e in entropy:
        if e.agreement < agreement:
            continue
        arm = arm_of(e.spec)
        if arm not in best or e.speedup > best[arm].speedup:
            best[arm] = e
    return sorted(best.values(), key=lambda e: -e.speedup)[:arms]


def confirm_targets(points: list[Point], v: dict, slack: float = SLACK) -> list[Point]:
    """The close calls of one workload and mode (``verdicts`` ``v`` of ``points``), each side to be timed
    again: every peer point no entropy point matches, and every one matched narrowly (its best match
    less than 1 / ``slack`` × as fast: inside the timing noise band above the slack's floor), with the
    fastest entropy point at ≥ its agreement of the two fastest arms; dual's fastest point with the same
    while the margin is missed; and every domain profile point off the frontier (ratio < ``slack``)
    with the same at ≥ its agreement. Each point at most once, in the order found."""
    ent = [p for p in points if p.policy == ENTROPY]
    named = {p.name(): p for p in points}
    targets = refine_targets(points, v)
    for p in points:
        best = match(ent, p, slack) if p.policy not in (ENTROPY, BASELINE) else None
        if best is not None and best.speedup * slack < p.speedup and p not in targets:
            targets.append(p)
    out: list[Point] = []
    for p in targets:
        out += [p, *_best_per_arm(ent, p.agreement)]
    for g in v["profiles"]:
        if g["domain"] and g["ratio"] < slack:
            prof = named[g["label"]]
            out += [prof, *_best_per_arm(ent, prof.agreement)]
    return list({p.spec: p for p in out}.values())


def confirm_workload(doc: dict, key: str, engine, settings, requests, args, chat: bool, log) -> None:
    """Up to ``args.confirm`` rounds (counting the workload's earlier ones) of timing the close calls
    again (``confirm_targets``): both sides of each comparison in one ``measure_workload`` call with its
    own ``none`` passes, whose per-pass speedups join each point's earlier ones (its speedup: the median
    of all its passes), so a verdict decided by a few percent between points timed in different calls
    rests on more passes of both sides. Token agreement and score are deterministic and kept (a point
    whose fidelity differs when timed again is not the same decoding: logged, its new passes dropped).
    The re-timed specs are listed in ``confirmed``, the rounds in ``confirm_rounds``; saved each round."""
    wl = doc["workloads"][key]
    pts = [Point(**p) for p in wl["points"]]
    while wl.get("confirm_rounds", 0) < args.confirm:
        targets = confirm_targets(pts, wl["verdicts"], args.slack)
        if not targets:
            break
        log(f"{key}: timing {len(targets)} setting(s) of close calls again, round {wl.get('confirm_rounds', 0) + 1}")
        again = {q.spec: q for q in measure_workload(engine, settings, requests, [t.spec for t in targets], {},
                                                     args, chat, log)}
        for i, p in enumerate(pts):
            q = again.get(p.spec)
            if q is None:
                continue
            if (q.agreement, q.identical, q.score) != (p.agreement, p.identical, p.score):  # not the same decoding
                log(f"{key}: {p.spec} decoded differently when timed again (agreement {p.agreement:.4f}, then "
                    f"{q.agreement:.4f}); its earlier passes stand alone")
                continue
            pts[i] = replace(p, speedups=[*p.speedups, *q.speedups])
        pts = pool_equivalent(pts)
        wl["points"] = [asdict(p) for p in pts]
        wl["confirmed"] = [*wl.get("confirmed", []), *again]
        wl["confirm_rounds"] = wl.get("confirm_rounds", 0) + 1
        wl["verdicts"] = verdicts(pts, args.slack, args.margin)
        _print_workload(key, pts, wl["verdicts"], log)
        if args.json is not None:
            save_progress(doc, args.json)


def tau_between(entropy: list[Point], target: Point, arms: int = 2) -> list[str]:
    """Entropy specs to measure next for ``target`` (a peer point): within each arm (one setting of every
    knob but τ), the τ halfway on a log scale between the largest τ that keeps ≥ the target's agreement
    and the next larger τ measured (faster, less faithful), for the ``arms`` arms whose faithful end is
    fastest. Where ``tau = 0`` keeps the agreement, the next τ's quarter. [] when no arm brackets it."""
    from ecache_cli.runs.profile import parse_policy_spec

    by_arm: dict[tuple, list[tuple[float, Point]]] = {}
    for e in entropy:
        params = dict(parse_policy_spec(e.spec)[1])
        tau = float(params.pop("tau", 1.0))
        by_arm.setdefault(tuple(params.items()), []).append((tau, e))
    found = []
    for arm, pts in by_arm.items():
        pts.sort(key=lambda tp: tp[0])
        faithful = [tp for tp in pts if tp[1].agreement >= target.agreement]
        if not faithful:
            continue
        lo_tau, lo = faithful[-1]
        above = [tp for tp in pts if tp[0] > lo_tau]
        if not above:
            continue
        hi_tau = above[0][0]
        tau = math.sqrt(lo_tau * hi_tau) if lo_tau > 0 else hi_tau / 4
        found.append((lo.speedup, spec(ENTROPY, {"tau": float(f"{tau:.3g}"), **dict(arm)})))
    found.sort(key=lambda sp: -sp[0])
    return list(dict.fromkeys(s for _, s in found[:arms]))


def _peer_rank(name: str) -> tuple:
    return (PEER_ORDER.index(name) if name in PEER_ORDER else len(PEER_ORDER), name)


def summary_table(points: list[Point]) -> list[str]:
    """Markdown rows (header included) of ``points``: policy, setting, speedup (with the pooling of
    :func:`pool_equivalent` when it applied), agreement, identical, score."""
    def pct(x):
        return "–" if x is None else f"{100 * x:.1f}"

    lines = ["| policy | setting | speedup (median) | token agree % | identical % | score |",
             "|---|---|---:|---:|---:|---:|"]
    for p in points:
        pooled = f" (pooled ×{p.pooled}; own {p.own_speedup:.2f}x)" if p.pooled > 1 and p.own_speedup else ""
        lines.append(f"| {p.policy} | `{p.name()}` | {p.speedup:.2f}x{pooled} | {pct(p.agreement)} | "
                     f"{pct(p.identical)} | {'–' if p.score is None else f'{p.score:.2f}'} |")
    return lines


def markdown(doc: dict) -> str:
    """The benchmark's frontiers and verdicts as Markdown (for BENCHMARKS.md)."""
    lines = [f"Model {doc['model']} · {doc['n']} held-out prompts per workload (seed {doc['seed']}) · "
             f"{doc['passes']} passes (speedup: median) · grid {doc['grid']} · gen {doc['gen_length']} "
             f"block {doc['block_length']} · threshold {doc['threshold']}", ""]
    if doc.get("incomplete"):
        lines += ["**Incomplete run** (interrupted): only the workloads below were measured.", ""]
    lines += ["| workload | mode | peer | peer points | dominated by entropy | unmatched peer points |",
              "|---|---|---|---:|---|---|"]
    for key, wl in doc["workloads"].items():
        w, mode = key.split("|")
        for peer, d in wl["verdicts"]["dominance"].items():
            lines.append(f"| {w} | {mode} | {peer} | {d['points']} | {_word(d['dominated'])} | "
                         f"{', '.join(f'`{u}`' for u in d['unmatched']) or '–'} |")
    lines += ["", f"| workload | mode | dual's fastest | entropy's fastest at >= its agreement | ratio | "
              f">= {doc['margin']:.2f}x |", "|---|---|---|---|---:|---|"]
    for key, wl in doc["workloads"].items():
        w, mode = key.split("|")
        b = wl["verdicts"]["beats_dual_fastest"]
        if b["dual_fastest"] is None:
            continue
        d, e = b["dual_fastest"], b["entropy"]
        lines.append(f"| {w} | {mode} | `{d[0]}` {d[1]:.2f}x at {100 * d[2]:.1f}% | "
                     + ("–" if e is None else f"`{e[0]}` {e[1]:.2f}x at {100 * e[2]:.1f}%")
                     + f" | {_ratio(b['ratio'])} | {_word(b['ok'])} |")
    prof = [(k, g) for k, wl in doc["workloads"].items() for g in wl["verdicts"]["profiles"]]
    if prof:
        lines += ["", "| workload | mode | profile | speedup | token agree % | entropy frontier at >= its agreement "
                  "| ratio | ok |", "|---|---|---|---:|---:|---|---:|---|"]
        for key, g in prof:
            w, mode = key.split("|")
            lines.append(f"| {w} | {mode} | {g['label']} | {g['speedup']:.2f}x | {100 * g['agreement']:.1f} | "
                         f"`{g['frontier_point']}` {g['frontier_speedup']:.2f}x | {g['ratio']:.3f} | "
                         f"{'yes' if g['ok'] else 'NO'}{'' if g.get('domain', True) else ' (not slower than none)'} |")
    for key, wl in doc["workloads"].items():
        w, mode = key.split("|")
        pts = [Point(**p) for p in wl["points"]]
        front = {s for ss in wl["verdicts"]["frontiers"].values() for s in ss}
        refined = (f"; {len(wl['refined'])} entropy settings added by {wl['refine_rounds']} round(s) of τ "
                   "bisection (--refine)") if wl.get("refined") else ""
        if wl.get("confirm_rounds"):
            refined += (f"; {len(set(wl['confirmed']))} settings of close calls timed again in "
                        f"{wl['confirm_rounds']} round(s), their passes pooled (--confirm)")
        if wl.get("grid_added"):
            refined += f"; {len(wl['grid_added'])} settings measured later, when the grid or a profile changed"
        lines += ["", f"**{w} · {mode}** (Pareto frontier of each policy; every point is in the JSON{refined})", ""]
        lines += summary_table([p for p in pts if p.name() in front])
    return "\n".join(lines) + "\n"


def _ratio(x) -> str:
    return "–" if x is None else f"{x:.2f}x"


def plot(doc: dict, path: Path) -> None:
    """One panel per workload (rows) and mode (columns): each policy's points (speedup over none vs
    token agreement) and its Pareto frontier as a line; entropy drawn last and thicker; shipped
    profile points starred. matplotlib (Agg), written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = list(dict.fromkeys(k.split("|")[0] for k in doc["workloads"]))
    modes = list(dict.fromkeys(k.split("|")[1] for k in doc["workloads"]))
    fig, axes = plt.subplots(len(wls), len(modes), figsize=(5.2 * len(modes), 3.6 * len(wls)), dpi=100,
                             squeeze=False)
    colors = dict(zip([ENTROPY, *PEER_ORDER], plt.get_cmap("tab10").colors))
    for i, w in enumerate(wls):
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            wl = doc["workloads"].get(f"{w}|{mode}")
            ax.set_title(f"{w} · {mode}", fontsize=9)
            if wl is None:
                ax.axis("off")
                continue
            pts = [Point(**p) for p in wl["points"]]
            names = sorted({p.policy for p in pts if p.policy != BASELINE}, key=lambda q: (q == ENTROPY, _peer_rank(q)))
            for q in names:
                mine = [p for p in pts if p.policy == q]
                c = colors.get(q, "gray")
                ax.scatter([p.speedup for p in mine], [100 * p.agreement for p in mine], s=12, color=c, alpha=0.5)
                fr = pareto(mine)
                ax.plot([p.speedup for p in fr], [100 * p.agreement for p in fr], marker="o", ms=3, color=c,
                        lw=2.2 if q == ENTROPY else 1.0, label=q)
            prof = [p for p in pts if p.label.startswith("profile:")]
            if prof:
                ax.scatter([p.speedup for p in prof], [100 * p.agreement for p in prof], marker="*", s=120,
                           color=colors[ENTROPY], edgecolor="black", zorder=5, label="shipped profile")
            ax.axvline(1.0, color="black", lw=0.6, ls=":")
            ax.set_xlabel("speedup over none (tok/s, median of passes)", fontsize=8)
            ax.set_ylabel("token agreement with none (%)", fontsize=8)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
            if i == 0 and j == 0:
                ax.legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# --- measurement --------------------------------------------------------------------------------------


def held_out(task, n: int, seed: int, exclude: set[str]) -> list:
    """``n`` test examples of ``task`` drawn with ``seed`` whose question is not in ``exclude`` (the
    calibration samples' questions). Raises UsageError when the split cannot supply ``n`` of them."""
    from ecache_cli.errors import UsageError

    want = n + len(exclude)
    exs = [ex for ex in task.examples("test", want, seed) if ex.question not in exclude][:n]
    if len(exs) < n:
        raise UsageError(f"--n {n}: {task.name} has only {len(exs)} test examples outside its calibration samples; "
                         "lower --n")
    return exs


def calibration_samples(model: str, domains: list[str], get_task) -> tuple[set[int], dict[str, set[str]]]:
    """The seeds and the questions of every calibration sample behind the model's shipped profiles
    (``measured.seed``, ``measured.n`` and ``measured.shots`` of ``<model>/<domain>.yaml``), per domain."""
    from ecache_cli.config import find_profile, load_profile

    seeds, questions = set(), {}
    for d in domains:
        path = find_profile(model, d)
        m = (load_profile(path).get("measured") or {}) if path else {}
        if isinstance(m, dict) and m.get("seed") is not None and m.get("n"):
            seeds.add(int(m["seed"]))
            questions[d] = {ex.question for ex in get_task(d).examples("test", int(m["n"]), int(m["seed"]))}
    return seeds, questions


def profile_points(model: str, domain: str, parallel: bool = False) -> dict[str, str]:
    """``{label: entropy spec}`` of the shipped profiles that apply to ``domain`` (its own and the model's
    ``default``) as ``ecache generate`` finds them for plain or ``parallel`` decoding (the
    ``-parallel`` profiles first, ``config.find_mode_profile``), when they exist and use entropy; the
    label names the file (``profile:list-parallel``)."""
    from ecache_cli.cache.entropy import EntropyCache
    from ecache_cli.config import find_mode_profile, load_profile

    out = {}
    for task in (domain, "default"):
        path = find_mode_profile(model, task, parallel)
        if path is None:
            continue
        cache = load_profile(path).get("cache") or {}
        if cache.get("policy", ENTROPY) != ENTROPY or cache.get("tau") is None:
            continue
        knob = {k: cache[k] if cache.get(k) is not None else getattr(EntropyCache, k)
                for k in ("recent_k", "block_refresh", "recent_steps", "signal")}
        # every knob in the order of the grid's families, so the spec equals a grid point's
        params = {"tau": float(cache["tau"]), "recent_k": knob["recent_k"]}
        if knob["recent_steps"]:  # the recent_steps variant's family
            params["recent_steps"] = int(knob["recent_steps"])
        if not knob["recent_steps"] or knob["block_refresh"]:
            params["block_refresh"] = knob["block_refresh"]
        if cache.get("refresh_prompt") is False:  # the variant's own knob, named only when off
            params["refresh_prompt"] = False
        params["signal"] = knob["signal"]
        out[f"profile:{path.stem}"] = spec(ENTROPY, params)
    return out


def none_signals(engine, settings, ids: list[list[int]], kinds: list[str], seed: int) -> dict[str, list[float]]:
    """Per signal kind, ``none``'s per-step signal over the prompts ``ids`` (one row at a time, the
    streams of ``measure``), the distribution entropy's τ grid is drawn from."""
    out: dict[str, list[float]] = {k: [] for k in kinds}
    for i, row in enumerate(ids):
        run = engine.start([row], settings.decode, settings.policy(BASELINE), seed=seed, row_ids=[i])
        for step in run:
            for k in kinds:
                out[k] += step.signal(k).tolist()
    return out


def policy_specs(policies: list[str], grid: str, taus_by_signal: dict[str, list[float]]) -> list[str]:
    """The measured specs: each ``policies`` entry with ``:`` as given, each bare name expanded by ``grid``."""
    out = []
    for p in policies:
        if ":" in p or p == BASELINE:
            out.append(p)
        elif p == ENTROPY:
            out += entropy_axes(GRIDS[grid][ENTROPY], taus_by_signal)
        else:
            out += expand(p, GRIDS[grid].get(p, {}))
    return list(dict.fromkeys(out))


def measure_workload(engine, settings, requests, specs: list[str], labels: dict[str, str], args, chat: bool,
                     log) -> list[Point]:
    """Decode ``requests`` under ``none`` and every spec (``runs.profile.measure``, ``args.passes``
    passes) and return one :class:`Point` per spec (``labels``: spec → profile label)."""
    from ecache_cli.runs.profile import ProfileOptions, measure

    names = [BASELINE, *[s for s in specs if s != BASELINE]]
    opts = ProfileOptions(policies=names, warmup=args.warmup, repeats=args.passes, seed=args.seed,
                          batch_size=args.batch_size)
    rep = measure(engine, settings, requests, opts, chat=chat,
                  on_run=(lambda kind, p: log(f"  {kind} {p}")) if args.verbose else None)
    out = []
    for s in names[1:]:
        summ = rep.summaries[s]
        sp = pass_speedups(rep.runs[s], rep.runs[BASELINE])
        out.append(Point(policy=s.split(":")[0], spec=s, speedup=statistics.median(sp) if sp else math.nan,
                         agreement=summ["fidelity_token_agreement"], identical=summ["fidelity_identical_share"],
                         score=summ.get("score"), speedups=sp, work=summ.get("work_share_vs_none"),
                         label=labels.get(s, "")))
    return out


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``error: <message>`` on stderr, exit 2 (no usage block)."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Help with every option's default; the description as written."""


def parser() -> argparse.ArgumentParser:
    """The command line of the benchmark (every option with its default in ``--help``)."""
    ap = _Parser(description=textwrap.fill(__doc__.split("\n\n")[0], 79), formatter_class=_Formatter)
    ap.add_argument("--model", default="tiny", help="tiny (embedded), random-tiny (random weights) or a checkpoint")
    ap.add_argument("--device", default="cpu", help="torch device")
    ap.add_argument("--dtype", default="float32", help="model dtype")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (≥ 1; None: torch's default)")
    ap.add_argument("--domains", default="arith,code,list,gsm8k",
                    help="comma list of task domains (gsm8k: the out-of-distribution stress case, --data)")
    ap.add_argument("--shots", default="0,4", help="comma list: solved examples per prompt (each a workload)")
    ap.add_argument("--gsm8k-shots", default="4", help="comma list: the shots of the gsm8k workload(s)")
    ap.add_argument("--n", type=int, default=48, help="held-out test prompts per workload (≥ 1)")
    ap.add_argument("--passes", type=int, default=3, help="measured passes (≥ 1; speedup: their median)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up passes left out of the times (≥ 0)")
    ap.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (≥ 1)")
    ap.add_argument("--modes", default="plain,threshold", help="comma list of decoding modes: plain, threshold")
    ap.add_argument("--policies", default=",".join([*PEER_ORDER, ENTROPY]),
                    help="comma list of policies to sweep (bare names: their --grid; name:key=value: one fixed point)")
    ap.add_argument("--grid", default="small", choices=sorted(GRIDS), help="knob grid size")
    ap.add_argument("--no-profiles", action="store_true", help="leave out the shipped profiles' points")
    ap.add_argument("--seed", type=int, default=20261203,
                    help="draws the prompts; must differ from every shipped profile's calibration seed")
    ap.add_argument("--data", default=None, help="GSM8K test.jsonl (None: shared/data/gsm8k/test.jsonl)")
    ap.add_argument("--allow-code-execution", action="store_true", help="score the code domain (runs its code)")
    ap.add_argument("--gen-length", type=int, default=256, help="generated tokens per prompt (≥ 1)")
    ap.add_argument("--block-length", type=int, default=32, help="semi-autoregressive block (divides --gen-length)")
    ap.add_argument("--threshold", type=float, default=0.9, help="confidence threshold of the threshold mode, (0, 1]")
    ap.add_argument("--slack", type=float, default=SLACK, help="dominance tolerance on speedup, (0, 1]")
    ap.add_argument("--margin", type=float, default=MARGIN, help="entropy's required ratio over dual's fastest (> 0)")
    ap.add_argument("--markdown", type=Path, default=None, help="write the tables (Markdown) here")
    ap.add_argument("--plot", type=Path, default=None, help="PNG: one panel per workload and mode")
    ap.add_argument("--json", type=Path, default=None, help="write the JSON document (every point) here")
    ap.add_argument("--merge", type=Path, nargs="+", default=None,
                    help="measure nothing: combine the --json files of several runs (e.g. one per domain) into one "
                         "set of tables, plot and JSON")
    ap.add_argument("--resume", action="store_true",
                    help="with --json: keep the workloads an earlier run of the same settings saved there and measure "
                         "only the others (every finished workload is saved to --json at once)")
    ap.add_argument("--chunk", type=int, default=0,
                    help="measure a workload N settings at a time, each chunk with its own none passes, saving to "
                         "--json after each (--resume goes on from the last one); 0: all settings against one none")
    ap.add_argument("--refine", type=int, default=0,
                    help="rounds of τ bisection per workload toward the peer points entropy does not yet match and "
                         "dual's fastest point while the margin is missed (≥ 0; with --resume, saved workloads get "
                         "the rounds they lack)")
    ap.add_argument("--confirm", type=int, default=0,
                    help="rounds of timing the close calls again (unmatched peer points, a missed margin, a profile "
                         "off the frontier: both sides in one call, the passes added to each point's); after "
                         "--refine; with --resume, saved workloads get the rounds they lack")
    ap.add_argument("--verbose", "-v", action="store_true", help="log every run")
    return ap


def main(argv=None) -> int:
    """Parse ``argv``, check every option and output path before any measurement (one-line error, exit 2
    via ``SystemExit``), run; returns 0, 1 (runtime error), 2 (usage error found later) or 130 (Ctrl-C)."""
    from ecache_cli.errors import EcacheError, UsageError
    from ecache_cli.outputs import release_all

    ap = parser()
    args = ap.parse_args(argv)
    try:
        args.checked = _check_args(args)
    except UsageError as e:
        ap.error(str(e))
    except EcacheError as e:  # an output that cannot be written
        print(f"error: {e}", file=sys.stderr)
        release_all()
        return 1
    try:
        return run(args)
    except KeyboardInterrupt:  # before any workload finished (or while writing): nothing to keep
        print("interrupted (Ctrl-C) before any workload finished; nothing written", file=sys.stderr)
        return 130
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EcacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        release_all()


_EXAMPLES = {"--domains": "arith,list", "--modes": "plain,threshold", "--policies": "dual,entropy",
             "--shots": "0,4", "--gsm8k-shots": "4"}


def _items(text: str, flag: str) -> list[str]:
    """The entries of comma list ``text``: ``ecache_cli.runs.comma_lists.parse_list`` (UsageError for a
    list naming nothing, an empty entry or an entry given twice), as the CLI's list options."""
    from ecache_cli.runs.comma_lists import parse_list

    return parse_list(text, flag, example=_EXAMPLES.get(flag, "a,b"))


def _shot_list(text: str, flag: str) -> list[int]:
    """A comma list of distinct whole numbers ≥ 0 (``--shots``, ``--gsm8k-shots``)."""
    from ecache_cli.errors import UsageError
    from ecache_cli.runs.comma_lists import parse_list

    out = parse_list(text, flag, int, what="a whole number", example=_EXAMPLES.get(flag, "0,4"))
    if min(out) < 0:
        raise UsageError(f"{flag} {text!r}: give whole numbers ≥ 0 separated by commas, e.g. 0,4")
    return out


def _check_args(args) -> tuple[list[str], list[int], list[int], list[str], list[str]]:
    """Every check that needs no model: list entries, ranges, the decode schedule
    (``runs.settings.validate_decode``: gen length ≥ 1, a multiple of the block length) and the output
    paths (``ecache_cli.outputs``: parent folder, writable, no two outputs on one file, none the
    ``--merge`` input). Raises UsageError (exit 2) or DataError."""
    from ecache_cli.cache import POLICIES, unknown_policy
    from ecache_cli.errors import UsageError
    from ecache_cli.outputs import check_distinct, check_file, check_plot_name
    from ecache_cli.runs.profile import parse_policy_spec
    from ecache_cli.runs.settings import validate_decode

    domains = _items(args.domains, "--domains")
    shots, gsm8k_shots = _shot_list(args.shots, "--shots"), _shot_list(args.gsm8k_shots, "--gsm8k-shots")
    modes = _items(args.modes, "--modes")
    policies = _items(args.policies, "--policies")
    for flag, v, lo in (("--n", args.n, 1), ("--passes", args.passes, 1), ("--warmup", args.warmup, 0),
                        ("--refine", args.refine, 0), ("--chunk", args.chunk, 0), ("--confirm", args.confirm, 0),
                        ("--batch-size", args.batch_size, 1), ("--threads", args.threads, 1)):
        if v is not None and v < lo:
            raise UsageError(f"{flag} {v} must be ≥ {lo}")
    bad = [m for m in modes if m not in ("plain", "threshold")]
    if bad:
        raise UsageError(f"--modes {bad[0]!r} is not a mode; use plain, threshold")
    for p in policies:
        if ":" in p:
            parse_policy_spec(p)
        elif p not in POLICIES:
            raise unknown_policy(p, "--policies")
    if not (math.isfinite(args.slack) and 0 < args.slack <= 1) or not (math.isfinite(args.margin) and args.margin > 0):
        raise UsageError(f"--slack {args.slack} must be in (0, 1] and --margin {args.margin} > 0")
    validate_decode({"gen_length": args.gen_length, "block_length": args.block_length,
                     "threshold": args.threshold if "threshold" in modes else None})
    if args.resume and (args.json is None or args.merge):
        raise UsageError("--resume continues the run saved in --json FILE; add --json FILE (and no --merge)")
    if args.plot is not None:
        check_plot_name(args.plot)
    outputs = [(args.json, "--json"), (args.markdown, "--markdown"), (args.plot, "--plot")]
    check_distinct(outputs, [(m, "--merge") for m in args.merge or []])
    for path, flag in outputs:
        check_file(path, flag)
    return domains, shots, gsm8k_shots, modes, policies


def run(args) -> int:
    """The benchmark (module docstring); returns the exit status."""
    domains, shots, gsm8k_shots, modes, policies = getattr(args, "checked", None) or _check_args(args)
    import torch
    from rich.console import Console

    log = Console(stderr=True, width=240).print
    if args.merge:
        return finish(merge(args.merge), args, log)

    from ecache_cli.engine.core import Engine
    from ecache_cli.errors import UsageError
    from ecache_cli.models.loader import load_model
    from ecache_cli.runs.manifest import manifest
    from ecache_cli.runs.profile import parse_policy_spec
    from ecache_cli.tasks import check_task_name, get_task

    data = args.data or next((str(p) for p in GSM8K_CANDIDATES if p.is_file()), str(GSM8K_CANDIDATES[0]))

    def task_of(d):
        check_task_name(d, "--domains")  # named as this script's flag
        return get_task(d, data=data if d == "gsm8k" else None, allow_code_execution=args.allow_code_execution)

    tasks = {d: task_of(d) for d in domains}  # unknown domain: UsageError here, before the model loads
    model_key = "random-tiny" if args.model == "random-tiny" else args.model
    seeds, calib_questions = calibration_samples(model_key, [d for d in domains if d != "gsm8k"], task_of)
    if args.seed in seeds:
        raise UsageError(f"--seed {args.seed} is a seed the shipped profiles were calibrated with ({sorted(seeds)}); "
                         "pick another so the prompts are held out")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.model == "random-tiny":
        import tempfile

        sys.path.insert(0, str(REPO / "bench"))
        from speed import random_tiny

        lm = load_model(random_tiny(Path(tempfile.mkdtemp(prefix="ecache-random-tiny-"))), args.device, args.dtype)
    else:
        lm = load_model(args.model, args.device, args.dtype)
    engine, chat = Engine.from_loaded(lm), lm.chat
    grid_signals = [s for fam in GRIDS[args.grid][ENTROPY] for s in fam.get("signal", ["max-entropy"])]
    kinds = sorted({*grid_signals, *(parse_policy_spec(p)[1].get("signal", "max-entropy") for p in policies
                                      if p.startswith(ENTROPY + ":"))})
    doc = {"command": "bench/frontier.py", "date": datetime.date.today().isoformat(), "model": args.model,
           "n": args.n, "seed": args.seed, "passes": args.passes, "grid": args.grid, "gen_length": args.gen_length,
           "block_length": args.block_length, "threshold": args.threshold, "slack": args.slack, "margin": args.margin,
           "grids": GRIDS[args.grid], "args": _native_args(args),
           "manifest": manifest(lm, None, args.seed, {"omp_num_threads": os.environ.get("OMP_NUM_THREADS")}),
           "workloads": {}, "partial": {}}
    if args.resume:
        doc["workloads"], doc["partial"] = resumed_workloads(doc, args.json)
        if doc["workloads"]:
            log(f"--resume: {len(doc['workloads'])} workload(s) kept from {args.json}: "
                + ", ".join(doc["workloads"]))
        for key, part in doc["partial"].items():
            log(f"--resume: {key} goes on after its {len(part['points'])} measured setting(s)")
    t_all = time.perf_counter()
    try:
        _measure_all(doc, args, engine, chat, tasks, domains, shots, gsm8k_shots, modes, policies, kinds,
                     model_key, calib_questions, log)
    except KeyboardInterrupt:  # keep the finished workloads: write what they give, then exit 130
        if not doc["workloads"] and not doc["partial"]:
            raise
        doc["incomplete"] = True
        doc["total_s"] = time.perf_counter() - t_all
        finish(doc, args, log)
        written = ", ".join(str(p) for p in (args.json, args.markdown, args.plot) if p is not None)
        half = f" and {len(doc['partial'])} half-measured one(s) (--resume goes on)" if doc["partial"] else ""
        print(f"interrupted (Ctrl-C): kept the {len(doc['workloads'])} finished workload(s){half}"
              + (f", written to {written}" if written else " (JSON line on stdout)") + " marked incomplete",
              file=sys.stderr)
        return 130
    doc["total_s"] = time.perf_counter() - t_all
    return finish(doc, args, log)


def _native_args(args) -> dict:
    """The options as JSON values: paths as strings, everything else (ints, floats, None, lists) as is."""
    def native(v):
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, list):
            return [native(x) for x in v]
        return v

    out = {k: native(v) for k, v in vars(args).items() if k != "checked"}
    if getattr(args, "checked", None):  # the comma lists as parsed: lists of names and of shot counts
        out.update(zip(("domains", "shots", "gsm8k_shots", "modes", "policies"), args.checked))
    return out


def _measure_all(doc, args, engine, chat, tasks, domains, shots, gsm8k_shots, modes, policies, kinds, model_key,
                 calib_questions, log) -> None:
    """Measure every workload and mode into ``doc["workloads"]``, one at a time (a Ctrl-C keeps the
    finished ones)."""
    from ecache_cli.runs.profile import Request
    from ecache_cli.runs.settings import resolve_settings

    for d in domains:
        exs = held_out(tasks[d], args.n, args.seed, calib_questions.get(d, set()))
        for k in gsm8k_shots if d == "gsm8k" else shots:
            reqs = [Request(tasks[d].prompt(ex, k, args.seed), ex, tasks[d]) for ex in exs]
            for mode in modes:
                flags = dict(gen_length=args.gen_length, block_length=args.block_length,
                             threshold=args.threshold if mode == "threshold" else None)
                settings = resolve_settings(model_key, flags, {})
                key = f"{d}@{k}shot|{mode}"
                labels = profile_labels(policies, {} if args.no_profiles or d == "gsm8k"
                                        else profile_points(model_key, d, mode == "threshold"))
                if key in doc["workloads"]:  # kept by --resume: the points a grown grid adds, then more --refine
                    grow_workload(doc, key, engine, settings, reqs, policies, labels, args, chat, log)
                    if doc["workloads"][key].get("refine_rounds", 0) < args.refine:
                        refine_workload(doc, key, engine, settings, reqs, args, chat, log)
                    confirm_workload(doc, key, engine, settings, reqs, args, chat, log)
                    continue
                part = doc["partial"].get(key)  # a workload an earlier run left half measured (--chunk)
                if part is None:
                    part = plan_workload(engine, settings, reqs, chat, kinds, policies, args, labels)
                measure_in_chunks(doc, key, part, engine, settings, reqs, args, chat, log)
                pts = pool_equivalent([Point(**p) for p in part["points"]])
                v = verdicts(pts, args.slack, args.margin)
                del doc["partial"][key]
                doc["workloads"][key] = {"taus": part["taus"], "points": [asdict(p) for p in pts], "verdicts": v,
                                         "seconds": part["seconds"], "chunks": part["chunks"],
                                         "date": datetime.date.today().isoformat(),
                                         "git_commit": doc["manifest"].get("git_commit")}  # per workload: --resume
                _print_workload(key, pts, v, log)
                if args.json is not None:  # saved at once: a killed run keeps it (--resume)
                    save_progress(doc, args.json)
                if args.refine:
                    refine_workload(doc, key, engine, settings, reqs, args, chat, log)
                confirm_workload(doc, key, engine, settings, reqs, args, chat, log)


def profile_labels(policies: list[str], labels_of: dict[str, str]) -> dict[str, str]:
    """Spec → label of the profile points (``labels_of``: label → spec, from ``profile_points``), which
    join only when entropy is swept; profiles sharing a spec share a point (labels joined by commas)."""
    labels: dict[str, str] = {}
    if any(p.split(":")[0] == ENTROPY for p in policies):
        for label, s in labels_of.items():
            labels[s] = f"{labels[s]},{label}" if s in labels else label
    return labels


def plan_workload(engine, settings, requests, chat: bool, kinds: list[str], policies: list[str], args,
                  labels: dict[str, str]) -> dict:
    """What one workload and mode will measure: entropy's τ grid from ``none``'s per-step signals on
    ``requests`` (``tau_grid``), the specs of ``policies`` under ``args.grid`` plus the profile points
    (``labels``: spec → label, ``profile_labels``). Returns the workload's progress record: taus, specs,
    labels, points so far (none), seconds, chunks."""
    t0 = time.perf_counter()
    ids = engine.encode([r.prompt for r in requests], chat)
    taus = {s: tau_grid(v, TAU_QUANTILES[args.grid])
            for s, v in none_signals(engine, settings, ids, kinds, args.seed).items()}
    specs = policy_specs(policies, args.grid, taus)
    return {"taus": taus, "specs": list(dict.fromkeys([*specs, *labels])), "labels": labels, "points": [],
            "seconds": time.perf_counter() - t0, "chunks": 0}


def measure_in_chunks(doc: dict, key: str, part: dict, engine, settings, requests, args, chat: bool, log) -> None:
    """Measure the specs of progress record ``part`` (``plan_workload``) that it has no point for yet:
    all in one ``measure_workload`` call (one ``none`` baseline for every point), or with ``--chunk N``
    N at a time, each chunk with its own ``none`` passes (as a ``--refine`` round), ``part`` saved to
    ``--json`` under ``doc["partial"][key]`` after each, so ``--resume`` goes on from the last chunk."""
    done = {p["spec"] for p in part["points"]}
    todo = [s for s in part["specs"] if s not in done]
    size = args.chunk or len(todo) or 1
    log(f"{key}: {len(requests)} prompts × {len(part['specs'])} settings × {args.passes} passes"
        + (f" ({len(done)} measured by an earlier run)" if done else "")
        + (f", {size} settings per chunk" if args.chunk else ""))
    for i in range(0, len(todo), size):
        t0 = time.perf_counter()
        new = measure_workload(engine, settings, requests, todo[i:i + size], part["labels"], args, chat, log)
        part["points"] += [asdict(p) for p in new]
        part["seconds"] += time.perf_counter() - t0
        part["chunks"] += 1
        doc["partial"][key] = part
        if args.json is not None and args.chunk and i + size < len(todo):  # the last chunk: saved as finished
            save_progress(doc, args.json)


def grow_workload(doc: dict, key: str, engine, settings, requests, policies: list[str], labels: dict[str, str],
                  args, chat: bool, log) -> None:
    """Bring saved workload ``key`` up to this run's grid and profiles: measure the grid points it lacks
    because the grid grew since (``grid_grew``: ``policy_specs`` over the workload's own saved τ values)
    and the shipped profiles' settings it lacks because a profile changed (``labels``: spec → label,
    ``profile_labels``), and move the profile labels to the settings the profiles have now. One
    ``measure_workload`` call with its own ``none`` passes (as a ``--refine`` round); the new points are
    listed in the workload's ``grid_added``, the verdicts recomputed, the file saved when anything changed."""
    wl = doc["workloads"][key]
    have = {p["spec"] for p in wl["points"]}
    specs = [s for s in dict.fromkeys([*policy_specs(policies, args.grid, wl["taus"]), *labels]) if s not in have]
    old = [Point(**p) for p in wl["points"]]
    kept = old if args.no_profiles else [replace(p, label=labels.get(p.spec, "")) for p in old]
    if not specs and kept == old:
        return
    new = []
    if specs:
        log(f"{key}: {len(specs)} setting(s) the grid or the profiles gained since it was measured")
        new = measure_workload(engine, settings, requests, specs, labels, args, chat, log)
    pts = pool_equivalent(kept + new)
    wl["points"] = [asdict(p) for p in pts]
    wl["grid_added"] = [*wl.get("grid_added", []), *(p.spec for p in new)]
    wl["verdicts"] = verdicts(pts, args.slack, args.margin)
    _print_workload(key, pts, wl["verdicts"], log)
    if args.json is not None:
        save_progress(doc, args.json)


def grid_grew(old: dict, new: dict) -> bool:
    """Whether knob grids ``new`` (``GRIDS[name]``) hold every point of ``old`` and more: every policy of
    ``old`` with the same knobs in the same order, each knob's values a subset of the new ones, and for
    entropy every old family among the new families. Then ``--resume`` keeps the saved workloads and
    measures only the added points (``grow_workload``)."""
    if old == new or set(old) - set(new):
        return False
    for name, axes in old.items():
        if name == ENTROPY:
            if any(family not in new[name] for family in axes):
                return False
        elif list(axes) != list(new[name]) or any(not set(v) <= set(new[name][k]) for k, v in axes.items()):
            return False
    return True


def refine_workload(doc: dict, key: str, engine, settings, requests, args, chat: bool, log) -> None:
    """Up to ``args.refine`` rounds (counting the workload's earlier ones) of τ bisection on workload
    ``key``: each round measures, in one ``measure_workload`` call with its own ``none`` passes, the
    entropy specs :func:`tau_between` proposes for every point :func:`refine_targets` names, and
    recomputes the verdicts; it stops early when nothing is left to reach or to try. The new points are
    listed in the workload's ``refined`` and the rounds run in ``refine_rounds``; saved after each round."""
    wl = doc["workloads"][key]
    pts = [Point(**p) for p in wl["points"]]
    while wl.get("refine_rounds", 0) < args.refine:
        ent = [p for p in pts if p.policy == ENTROPY]
        have = {p.spec for p in pts}
        specs = list(dict.fromkeys(s for t in refine_targets(pts, wl["verdicts"]) for s in tau_between(ent, t)
                                   if s not in have))
        if not specs:
            break
        log(f"{key}: refining τ, round {wl.get('refine_rounds', 0) + 1}: {len(specs)} settings")
        new = measure_workload(engine, settings, requests, specs, {}, args, chat, log)
        pts = pool_equivalent(pts + new)
        wl["points"] = [asdict(p) for p in pts]
        wl["refined"] = [*wl.get("refined", []), *(p.spec for p in new)]
        wl["refine_rounds"] = wl.get("refine_rounds", 0) + 1
        wl["verdicts"] = verdicts(pts, args.slack, args.margin)
        _print_workload(key, pts, wl["verdicts"], log)
        if args.json is not None:
            save_progress(doc, args.json)


#: the settings two runs must share for their workloads to be comparable (--merge, --resume)
SAME_SETTINGS = ("model", "n", "seed", "passes", "grid", "grids", "gen_length", "block_length", "threshold", "slack",
                 "margin")


def save_progress(doc: dict, path: Path) -> None:
    """Write ``doc`` (its finished workloads, marked incomplete) to ``path`` as one JSON line, so an
    interrupted run leaves every finished workload saved. Written in place: the file is the one this
    run claimed (``ecache_cli.outputs.check_file``), and its lock stays on it."""
    from ecache_cli.runs.profile import json_line

    path.write_text(json_line({**doc, "incomplete": True}) + "\n")


def resumed_workloads(doc: dict, path: Path) -> tuple[dict, dict]:
    """The finished workloads and the half-measured ones' progress records (``--chunk``) saved in ``path``
    (a ``--json`` file) by an earlier run with ``doc``'s settings (and its policies): ({}, {}) when the
    file does not exist or is empty. Raises UsageError when it is not such a file or was made with other
    settings (naming the first difference)."""
    from ecache_cli.errors import UsageError

    text = path.read_text().strip() if path.exists() else ""
    if not text:  # no earlier run (the file this run claimed for --json is still empty)
        return {}, {}
    try:
        old = json.loads(text.splitlines()[-1])
        workloads = old["workloads"]
    except (OSError, ValueError, IndexError, KeyError, TypeError) as e:
        raise UsageError(f"--resume: {path} is not a bench/frontier.py --json file ({e}); pass another --json "
                         "path or delete it") from None
    grew = grid_grew(old.get("grids", {}), doc["grids"])  # saved workloads get the added points
    pairs = [(k, old.get(k), doc.get(k)) for k in SAME_SETTINGS if not (k == "grids" and grew)]
    pairs.append(("policies", old.get("args", {}).get("policies"), doc["args"].get("policies")))
    diff = next(((k, a, b) for k, a, b in pairs if a != b), None)
    if diff is not None and diff[0] == "grids":  # the knob values behind the same --grid name changed
        raise UsageError(f"--resume: {path} was made with other knob values for --grid {doc.get('grid')} than this "
                         "bench/frontier.py's GRIDS; measure into a new --json path")
    if diff is not None:
        raise UsageError(f"--resume: {path} was made with {diff[0]}={diff[1]!r}, this run has {diff[2]!r}; rerun with "
                         "the same settings or a new --json path")
    return workloads, old.get("partial", {})


def merge(paths: list[Path]) -> dict:
    """One document from the ``--json`` files of several runs (e.g. one per domain, run side by side):
    their workloads together (a workload in two files: UsageError), equivalent settings' passes pooled
    (:func:`pool_equivalent`) and the verdicts recomputed from the points, the first file's settings,
    every run's ``total_s`` summed. The runs must agree on model, n, seed, passes, grid (and its knob
    values), gen/block length, threshold, slack and margin (UsageError naming the first difference)."""
    from ecache_cli.errors import UsageError

    same = SAME_SETTINGS
    docs = []
    for p in paths:
        try:
            docs.append(json.loads(Path(p).read_text().strip().splitlines()[-1]))
        except (OSError, ValueError, IndexError) as e:
            raise UsageError(f"--merge {p}: not a bench/frontier.py --json file ({e})") from None
    out = {**docs[0], "workloads": {}, "partial": {}, "total_s": 0.0, "merged": [str(p) for p in paths]}
    out.pop("incomplete", None)
    if any(d.get("incomplete") or d.get("partial") for d in docs):  # an interrupted run's workloads stay marked
        out["incomplete"] = True
    for p, d in zip(paths, docs):
        diff = next((k for k in same if d.get(k) != docs[0].get(k)), None)
        if diff is not None:
            raise UsageError(f"--merge {p}: {diff}={d.get(diff)!r} differs from {paths[0]}'s {docs[0].get(diff)!r}")
        for key, wl in d["workloads"].items():
            if key in out["workloads"]:
                raise UsageError(f"--merge {p}: workload {key} is in two files")
            pts = pool_equivalent([Point(**q) for q in wl["points"]])  # this file's rules, from the passes
            out["workloads"][key] = {**wl, "points": [asdict(q) for q in pts],
                                     "verdicts": verdicts(pts, out["slack"], out["margin"])}
        out["total_s"] += d.get("total_s", 0.0)
    return out


def finish(doc: dict, args, log) -> int:
    """Summary lines on stderr, then ``--markdown``, ``--plot``, ``--json`` and the JSON line on stdout."""
    from ecache_cli.runs.profile import json_line

    doc["summary"] = summary(doc)
    for line in _summary_lines(doc["summary"]):
        log(line, markup=False, highlight=False)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(doc))
    if args.plot:
        plot(doc, args.plot)
    line = json_line(doc)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(line + "\n")
    sys.stdout.write(line + "\n")
    return 0


def summary(doc: dict) -> dict:
    """The issue's targets over all workloads: per mode, the domains where entropy dominates every peer
    (at every shots setting), the domains where it beats dual's fastest point by the margin, and whether
    every profile point holds (within the slack of the frontier, not slower than none). A verdict without
    the points to decide it (no entropy point, no peer, no dual, no profile point) is None, never True."""
    out: dict = {}
    for key, wl in doc["workloads"].items():
        w, mode = key.split("|")
        domain = w.split("@")[0]
        m = out.setdefault(mode, {"dominates_all": {}, "beats_dual_fastest": {}, "profiles_ok": None})
        v = wl["verdicts"]
        doms = [d["dominated"] for d in v["dominance"].values()]
        dom = None if not doms or None in doms else all(doms)
        m["dominates_all"][domain] = _both(m["dominates_all"].get(domain), dom)
        m["beats_dual_fastest"][domain] = _both(m["beats_dual_fastest"].get(domain), v["beats_dual_fastest"]["ok"])
        if v["profiles"]:
            m["profiles_ok"] = _both(m["profiles_ok"], all(g["ok"] for g in v["profiles"]))
    for m in out.values():
        m["beats_dual_fastest_domains"] = sum(1 for ok in m["beats_dual_fastest"].values() if ok is True)
    return out


def _both(a: bool | None, b: bool | None) -> bool | None:
    """Two verdicts together: False when either fails, None when neither was decided, else True."""
    if a is False or b is False:
        return False
    return None if a is None and b is None else True


def _word(ok: bool | None, no: str = "NO", why: str = "no entropy points") -> str:
    """A verdict as text: yes, ``no`` (NO or no), or ``n/a (<why>)`` when it was not decided."""
    return f"n/a ({why})" if ok is None else "yes" if ok else no


def _summary_lines(s: dict) -> list[str]:
    out = []
    for mode, m in s.items():
        dom = ", ".join(f"{d} {_word(ok, why='no entropy or no peer points')}"
                        for d, ok in m["dominates_all"].items())
        beat = ", ".join(f"{d} {_word(ok, 'no', 'no entropy or no dual points')}"
                         for d, ok in m["beats_dual_fastest"].items())
        out.append(f"{mode}: entropy dominates every peer: {dom}; >= margin over dual's fastest: {beat} "
                   f"({m['beats_dual_fastest_domains']} domains); profiles within the frontier slack and not slower "
                   f"than none: {_word(m['profiles_ok'], why='no profile points')}")
    return out


def _print_workload(key: str, pts: list[Point], v: dict, log) -> None:
    for q, names in v["frontiers"].items():
        front = [p for p in pts if p.policy == q and p.name() in names]
        log(f"{key} {q} frontier: " + "; ".join(f"{p.name()} {p.speedup:.2f}x {100 * p.agreement:.1f}%"
                                                for p in sorted(front, key=lambda p: p.speedup)),
            markup=False, highlight=False)
    for q, d in v["dominance"].items():
        log(f"{key} entropy dominates {q}: {_word(d['dominated'])}"
            + (f" (unmatched: {', '.join(d['unmatched'])})" if d["unmatched"] else ""), markup=False, highlight=False)


if __name__ == "__main__":
    sys.exit(main())
