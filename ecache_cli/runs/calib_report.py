"""What ``ecache calibrate`` shows and writes: the sweep and frontier tables, the frontier plot, the
JSON document and the profile's content. Scores are 0–1 fractions inside, percent on screen."""

from __future__ import annotations

import datetime
from pathlib import Path

from ..cache.entropy import EntropyCache
from ..decoding.config import DecodeConfig
from ..terminal import fit
from .tau_search import KNOBS, Point, failing_groups, qualifies


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def sweep_table(outcome, metric: str, max_drop: float, min_fidelity: float | None, wide: bool = False):
    """A rich Table: one row per setting (``none`` first, then ascending τ). Marks: ★ chosen,
    ◆ on the Pareto frontier, ✓ qualifies, ✗ qualifies but the wall-clock speed check found it (or a
    setting deciding exactly as it) slower than ``none``; ᶜ after the wall speedup: some examples
    were copied from a τ with the same decisions (wall time included). ``max_drop``/``min_fidelity`` are 0–1 fractions.

    The default view fits 80 columns: τ, the constrained metric and its change against none, the other
    metric, speedup (cost proxy), wall speedup, refresh share and the marks; ``wide`` adds the change's
    95% CI, examples lost/gained, identical answers, tokens/s and NFE (``--json`` keeps every number).
    A joint search shows each setting as ``τ k<recent_k>`` (`` B``: block refresh on; `` s<n>``:
    recent_steps n; `` b<x>``: block_tau x; `` C``: triggered refreshes of the canvas alone) and leaves
    the other metric to ``wide``; with groups, ``wide`` adds how many groups each setting qualifies on.
    A threshold sweep (block diffusion) names its values ``threshold``, its baseline ``reference``, and
    shows tokens per forward (TPF) where τ's table shows the refresh share."""
    from rich.table import Table

    base, chosen = outcome.base, outcome.choice.point
    front = {id(p) for p in outcome.frontier}
    slow = slower_than_none(getattr(outcome, "speed_check", None))
    fid = metric == "fidelity"
    unit = "fidelity-scored" if fid else "task-scored"
    joint = any(p.recent_k is not None for p in outcome.points)
    steps = any(p.recent_steps for p in outcome.points)
    arms = ("; k = recent_k, B = block refresh" + (", s = recent_steps" if steps else "")) if joint else ""
    arms += _variant_legend(outcome.points) if joint else ""
    knob, thr = KNOBS[base.knob], base.knob == "threshold"
    against = " over the reference (one token per step)" if thr else ""
    tpf = "; TPF = tokens per forward" if thr else ""
    t = Table(title=f"{knob.name} sweep ({unit}, n={base.n}; speedup = cost proxy{against}, wall beside it{arms}{tpf})",
              title_justify="left")
    # the metric the choice constrains comes first, with its change against none: fidelity under
    # --metric fidelity (the task score, if any, moves to fidelity's place)
    cols = [("τ k B" if joint else knob.name, True), ("fidelity %" if fid else "score %", True),
            ("Δ pts" if fid or not wide else "Δ pts [95% CI]", True), ("lost/gained", wide),
            ("score %" if fid else "fidelity %", wide or not joint), ("identical %", wide), ("speedup", True),
            ("wall ×", True), ("tok/s", wide), ("TPF" if thr else "refresh %", True), ("NFE", wide),
            ("groups ok", wide and bool(base.parts)), ("", True)]
    for name, shown in cols:
        if shown:
            t.add_column(name, justify="left" if name == "" else "right", no_wrap=True)
    for p in [base, *outcome.points]:
        mark = ("★" if p is chosen else "") + ("◆" if id(p) in front else "")
        if p.tau is not None and p is not chosen and qualifies(p, base, metric, max_drop, min_fidelity):
            mark += "✗" if p.label() in slow else "✓"
        cells = [short_setting(p, outcome.points), *_sweep_cells(p, base, metric, max_drop, min_fidelity, wide), mark]
        t.add_row(*[c for c, (_, shown) in zip(cells, cols) if shown])
    return fit(t)


def slower_than_none(speed_check: dict | None) -> set[str]:
    """The labels (``Point.label``) of the settings the speed check rejected, and of those it skipped
    as deciding exactly like a rejected one (``runs/speed_guard.py``); empty without a check."""
    sc = speed_check or {}
    return ({t["setting"] for t in sc.get("timed", []) if not t["passed"]}
            | {s["setting"] for s in sc.get("skipped", [])})


def _sweep_cells(p: Point, base: Point, metric: str, max_drop: float, min_fidelity: float | None,
                 wide: bool) -> list[str]:
    """The cells of ``p``'s sweep row after its setting and before the marks, in ``sweep_table``'s
    column order."""
    fid = metric == "fidelity"
    if fid:
        delta = "" if p.tau is None else f"{100 * (p.fidelity - base.fidelity):+.1f}"
    elif p.tau is None or p.score is None or base.score is None:
        delta = ""
    else:
        delta = f"{100 * (p.score - base.score):+.1f}"
        if wide and p.delta_ci is not None:
            lo, hi = p.delta_ci
            delta += f" [{100 * lo:+.1f}, {100 * hi:+.1f}]"
    lg = "" if p.tau is None or p.lost is None else f"{p.lost}/{p.gained}"
    wall = f"{p.speedup_wall:.2f}×" + ("ᶜ" if p.copied else "")  # ᶜ: some rows copied (their wall time too)
    first, other = (p.fidelity, p.score) if fid else (p.score, p.fidelity)
    groups_ok = ""
    if base.parts and p.tau is not None:
        bad = failing_groups(p, base, metric, max_drop, min_fidelity)
        groups_ok = f"{len(base.parts) - len(bad)}/{len(base.parts)}"
    work = f"{p.tpf:.2f}" if p.knob == "threshold" else f"{100 * p.refresh_rate:.0f}"
    return [_pct(first), delta, lg, _pct(other), _pct(p.identical), f"{p.speedup:.2f}×", wall,
            f"{p.tokens_per_s:.1f}", work, f"{p.nfe:.1f}", groups_ok]


def _block_taus(points) -> list[float]:
    return sorted({p.block_tau for p in points if p.block_tau is not None})


def _variant_legend(points) -> str:
    """The title's legend of the variant marks in ``short_setting``: b (block_tau, its value when the
    sweep has one) and C (canvas-only triggered refresh), each only when a point uses it."""
    bts = _block_taus(points)
    out = "" if not bts else f", b = block_tau {bts[0]:g}" if len(bts) == 1 else ", b<x> = block_tau x"
    return out + (", C = canvas-only refresh (a partial forward: not in refresh %)"
                  if any(p.refresh_prompt is False for p in points) else "")


def short_setting(p: Point, points) -> str:
    """``p``'s setting in a table cell: ``none``, ``τ``, or in a joint search ``τ k<recent_k>`` with
    `` B`` (block refresh), `` s<n>`` (recent_steps), `` b`` (block_tau: bare when every point of
    ``points`` that has one shares it, named in the legend) and `` C`` (canvas-only refresh)."""
    if p.tau is None:
        return p.label()
    out = f"{p.tau:g}"
    if p.recent_k is None:
        return out
    out += f" k{p.recent_k}" + (" B" if p.block_refresh else "") + (f" s{p.recent_steps}" if p.recent_steps else "")
    if p.block_tau is not None:
        out += " b" if len(_block_taus(points)) == 1 else f" b{p.block_tau:.3g}"
    return out + (" C" if p.refresh_prompt is False else "")


def wall_warnings(outcome, slack: float = 1.5) -> list[str]:
    """One warning line (or none) naming every τ whose wall-clock speedup disagrees with the cost proxy.

    The proxy counts the positions computed, so τ's real speedup is at most about the proxy's (the
    decision only adds work); a wall speedup above ``slack`` × the proxy, or a slowdown below
    1 / ``slack`` where the proxy saves work, means the timings were disturbed (other load on the
    machine, CPU frequency changes). Same rule as ``profile``'s ``timing_warnings``. A threshold sweep's
    points are checked for the slowdown alone: fewer forwards also save each forward's fixed cost, which
    the proxy (positions computed, the prompt's included) leaves out, so their wall speedup may well exceed it.
    """
    bad = [p for p in outcome.points if p.speedup > 0 and p.speedup_wall > 0
           and ((p.speedup_wall > slack * p.speedup and p.knob != "threshold")
                or (p.speedup > 1 and p.speedup_wall < 1 / slack))]
    if not bad:
        return []
    pts = ", ".join(f"{p.label().replace('=', ' ', 1)} ({p.speedup_wall:.2f}× wall vs {p.speedup:.2f}× proxy)"
                    for p in bad)
    return [f"warning: the wall-clock speedup disagrees with the cost proxy for {pts}: the timings look disturbed "
            "(other load on the machine, CPU frequency); the choice uses the proxy; rerun on an idle machine or pin "
            "--threads for trustworthy wall-clock numbers"]


def frontier_table(outcome, metric: str):
    """A rich Table of the Pareto frontier (score vs speedup), fastest last."""
    from rich.table import Table

    joint = any(p.recent_k is not None for p in outcome.points)
    legend = _variant_legend(outcome.points) if joint else ""
    t = Table(title=f"Pareto frontier ({'fidelity' if metric == 'fidelity' else 'task score'} vs speedup"
                    f"{'; ' + legend.removeprefix(', ') if legend else ''})", title_justify="left")
    for name in ("τ k B" if joint else "setting", "speedup", "score %", "fidelity %", *(
            ["TPF"] if outcome.base.knob == "threshold" else [])):
        t.add_column(name, justify="right", no_wrap=True)
    for p in outcome.frontier:
        t.add_row(short_setting(p, outcome.points), f"{p.speedup:.2f}×", _pct(p.metric_score(metric)),
                  _pct(p.fidelity), *([f"{p.tpf:.2f}"] if p.knob == "threshold" else []))
    return fit(t)


def plot_frontier(outcome, metric: str, max_drop: float, path: Path) -> None:
    """Write a PNG (matplotlib Agg): every setting's score vs speedup, the frontier as a line, the
    allowed score floor as a dashed line, the choice starred. ``max_drop`` is a 0–1 fraction."""
    from ..outputs import pyplot

    plt = pyplot()

    base, knob = outcome.base, KNOBS[outcome.base.knob]
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    pts = [p for p in outcome.points if p.metric_score(metric) is not None]
    ax.scatter([p.speedup for p in pts], [100 * p.metric_score(metric) for p in pts], color="tab:blue",
               label=knob.name)
    for p in pts:
        ax.annotate(p.label().removeprefix(f"{knob.name}="), (p.speedup, 100 * p.metric_score(metric)),
                    textcoords="offset points", xytext=(4, 3), fontsize=7)
    s0 = base.metric_score(metric)
    if s0 is not None:
        ax.scatter([1.0], [100 * s0], color="black", marker="s", label=knob.base)
        ax.axhline(100 * (s0 - max_drop), color="tab:red", ls="--", lw=1, label=f"{knob.base} − {100 * max_drop:g} pts")
    fr = outcome.frontier
    if fr:
        ax.plot([p.speedup for p in fr], [100 * p.metric_score(metric) for p in fr], color="tab:orange",
                lw=1.5, label="Pareto frontier")
    c = outcome.choice.point
    if c is not None:
        ax.scatter([c.speedup], [100 * c.metric_score(metric)], marker="*", s=220, color="tab:green",
                   zorder=5, label=f"chosen {c.label()}")
    ax.set_xlabel(f"speedup over {knob.base} (cost proxy: computed positions)")
    ax.set_ylabel(f"fidelity to {knob.base} (%)" if metric == "fidelity" else "task score (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def json_document(outcome, manifest: dict, opts) -> dict:
    """Everything measured: manifest, options, signal summary, ``none``, every τ point, frontier, choice.
    A threshold sweep (``outcome.sweep``, block diffusion): ``sweep: threshold``, its values under
    ``thresholds`` (``grid``: the values tried before refinement), its baseline under ``reference``, no
    signal summary, and points naming their value ``threshold`` with ``tpf`` (tokens per forward)."""
    from .calib_sweep import SWEEPS

    c, thr = outcome.choice, outcome.sweep == "threshold"
    grid = SWEEPS["threshold"].values([], opts) if thr else opts.grid
    return {
        "manifest": manifest,
        "calibrate": {"task": opts.task, "data": opts.data, "limit": opts.limit, "seed": opts.seed,
                      "sweep": outcome.sweep, "metric": opts.metric, "max_drop_points": opts.max_drop,
                      "min_fidelity_pct": opts.min_fidelity,
                      "grid": grid, "refine": opts.refine, "thresholds" if thr else "taus": opts.taus,
                      "batch_size": opts.batch_size,
                      "recent_ks": opts.recent_ks, "block_refreshes": opts.block_refreshes,
                      "recent_steps": opts.recent_steps,
                      "extra_arms": None if opts.extra_arms is None else [a.as_record() for a in opts.extra_arms],
                      "groups": list(outcome.base.parts or {}) or None,
                      "speed_check": opts.speed_check, "speed_check_limit": opts.speed_check_limit,
                      "speed_check_threshold": opts.speed_check_threshold,
                      "speed_check_tries": opts.speed_check_tries,
                      "run_file": str(outcome.run_file), "speedup_basis": "cost proxy (computed positions)"},
        "signal": outcome.signal_summary,
        "reference" if thr else "none": outcome.base.as_dict(),
        "points": [p.as_dict() for p in outcome.points],
        "frontier": [p.tau if p.recent_k is None else [p.tau, p.recent_k, p.block_refresh, p.recent_steps or 0,
                                                       p.block_tau, p.refresh_prompt is not False]
                     for p in outcome.frontier],
        "choice": None if c.point is None else c.point.as_dict(),
        "reason": c.reason,
        "speed_check": outcome.speed_check,
        "profile": None if outcome.profile is None else str(outcome.profile),
        "profile_data": outcome.profile_data,
    }


def calibrate_document(outcome, lm, settings, opts, incomplete: bool) -> dict:
    """The ``--json`` document of a calibration (:func:`json_document`, its manifest from
    ``runs/manifest.py``); ``incomplete``: Ctrl-C ended the search (``none`` and the finished τs)."""
    from .manifest import manifest

    return {"command": "calibrate",
            **json_document(outcome, manifest(lm, settings, opts.seed, {"command": "calibrate"}), opts),
            "incomplete": incomplete}


def _profile_cache(params: dict, chosen: Point) -> dict:
    """The profile's cache section: entropy with the chosen τ, and recent_k, block_refresh (when on),
    recent_steps (when on), block_tau (when set) and refresh_prompt (when off) from the chosen point (a
    joint search's arm) or else the run's ``params``."""
    joint = chosen.recent_k is not None
    recent_k = chosen.recent_k if joint else params.get("recent_k", EntropyCache.recent_k)
    block_refresh = chosen.block_refresh if chosen.block_refresh is not None else params.get("block_refresh", False)
    recent_steps = chosen.recent_steps if chosen.recent_steps is not None else params.get("recent_steps", 0)
    block_tau = chosen.block_tau if joint else params.get("block_tau")
    refresh_prompt = chosen.refresh_prompt if chosen.refresh_prompt is not None else params.get("refresh_prompt", True)
    cache = {"policy": EntropyCache.name, "tau": chosen.tau, "recent_k": recent_k,
             "signal": params.get("signal", EntropyCache.signal)}
    if block_refresh:
        cache["block_refresh"] = True
    if recent_steps:
        cache["recent_steps"] = int(recent_steps)
    if block_tau is not None:
        cache["block_tau"] = float(block_tau)
    if refresh_prompt is False:
        cache["refresh_prompt"] = False
    return cache


def profile_data(model: str, settings, opts, chosen: Point, base: Point, shots: int, run_file: str,
                 speed_check: dict | None = None) -> dict:
    """The profile written for the choice (config.py's sections). decode: gen/block length, steps
    (effective), threshold, plus every other decode setting that differs from the defaults; cache:
    entropy with τ, recent_k, signal (block_refresh and recent_steps when on, block_tau when set,
    refresh_prompt when off) and, from a joint search, recent_k, block_refresh, recent_steps, block_tau
    and refresh_prompt being the chosen point's; measured: informational (0–1
    scores; ``run_file`` as a bare name when it sits beside the profile; ``groups``: each group's
    numbers when several were calibrated; ``speed_check``: the chosen setting's wall-clock speedups
    over ``none``, plain and under threshold decoding, from ``speed_check``, the Outcome's entry, when
    the check ran and passed). A threshold sweep's choice (block diffusion): decode at the chosen
    threshold, cache ``{policy: block}``, and measured against the reference (``score_reference``,
    ``tpf`` and ``tpf_reference``: tokens per forward; ``speed_check.speedup``)."""
    from .calib_sweep import threshold_decode

    thr = chosen.knob == "threshold"
    d = (threshold_decode(settings.decode, chosen.tau) if thr else settings.decode).as_dict()
    defaults = DecodeConfig().as_dict()
    steps = d["steps"]
    if steps is None and d["threshold"] is None and d["factor"] is None:
        steps = d["gen_length"]
    decode = {"gen_length": d["gen_length"], "block_length": d["block_length"], "steps": steps,
              "threshold": d["threshold"]}
    decode.update({k: v for k, v in d.items() if k not in decode and v != defaults[k]})
    cache = {"policy": "block"} if thr else _profile_cache(settings.cache_params, chosen)
    measured = _measured(opts, chosen, base, shots, run_file, speed_check)
    note = "written by ecache calibrate; measured.* is informational (scores are 0-1 fractions)"
    if opts.profile_task != opts.task:
        note = (f"the one setting meeting the tolerance on every group of --task {opts.task} "
                f"(measured.groups); " + note)
    return {"model": model, "task": opts.profile_task, **({"quantize": settings.quantize} if settings.quantize else {}),
            "decode": decode, "cache": cache, "measured": measured, "note": note}


def _r4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _measured(opts, chosen: Point, base: Point, shots: int, run_file: str, speed_check: dict | None) -> dict:
    """The profile's ``measured`` section (:func:`profile_data`): against ``none``, or for a threshold
    sweep against the reference, with tokens per forward in place of the refresh share."""
    thr, r4 = chosen.knob == "threshold", _r4
    ref = "score_reference" if thr else "score_none"
    work = {"tpf": r4(chosen.tpf), "tpf_reference": r4(base.tpf)} if thr else {"refresh_rate": r4(chosen.refresh_rate)}
    measured = {"metric": opts.metric, "score": r4(chosen.score), ref: r4(base.score),
                "speedup": r4(chosen.speedup), "speedup_wall": r4(chosen.speedup_wall), "fidelity": r4(chosen.fidelity),
                "identical": r4(chosen.identical), **work,
                "max_drop_points": opts.max_drop, "date": datetime.date.today().isoformat(), "n": chosen.n,
                "seed": opts.seed, "shots": shots, "run_file": run_file}
    if opts.min_fidelity is not None:
        measured["min_fidelity_pct"] = opts.min_fidelity
    timed = (speed_check or {}).get("chosen")
    if timed is not None and thr:
        measured["speed_check"] = {"speedup": r4(timed["speedup"]), "mode": speed_check["mode"],
                                   "examples": speed_check["examples"], "passes": speed_check["passes"]}
    elif timed is not None:
        measured["speed_check"] = {"plain": r4(timed["plain"]), "threshold": r4(timed["threshold"]),
                                   "threshold_value": speed_check["threshold"], "mode": speed_check["mode"],
                                   "examples": speed_check["examples"], "passes": speed_check["passes"]}
    if chosen.parts and base.parts:
        measured["groups"] = {g: {"score": r4(p.score), ref: r4(base.parts[g].score),
                                  "speedup": r4(p.speedup), "fidelity": r4(p.fidelity)}
                              for g, p in chosen.parts.items()}
    return measured
