"""Speed arithmetic for ``ecache profile``: tokens/s, latency percentiles, speedup, overhead, work share.

Everything here is plain arithmetic on measurements that the profile run collects from the engine (a
:class:`RunMeasure` per engine run, a :class:`RowMeasure` per request), so it is tested on synthetic
numbers without a model. Units: seconds in, tokens/s, milliseconds and percent out.

Definitions (the column headers of the profile table say the same):
- tokens/s counts generated tokens only (the answer plus its end marker; prompt and EOS filler are
  excluded, as ``GenerationResult.stats["generated_tokens"]``), divided by the engine's wall time of
  the runs (warm-up runs excluded by the caller).
- latency is per request: the time from the start of its run until its row finished.
- speedup is tokens/s of a policy over tokens/s of ``none`` measured in the same process.
- decision overhead is the time spent in the policy's ``plan`` + ``observe`` over the total wall time.
- work share vs ``none``: positions computed (summed over forwards) over what ``none`` computes on the
  same request (its NFE x canvas length). Positions computed are what the forwards computed for the
  row, padding included (``StepRecord.computed``): in a batch a row pays its forward's padded width.
  Layer-selective forwards count layer-averaged positions, so positions x layers over positions x
  layers reduces to positions over positions. Per-forward share: positions computed over (own NFE x
  canvas length). Planned work share: the plans' own positions (``tokens_planned``, what the request
  would compute alone) over the same denominator.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence


@dataclass
class RowMeasure:
    """One request decoded under one policy.

    generated_tokens: answer tokens + end marker. latency_s: seconds from its run's start until the row
    finished. nfe / full_forwards / partial_forwards: forward passes this row took part in.
    tokens_computed: positions the forwards computed for this row, padding included, summed over its
    steps; tokens_planned: the plans' own positions (None: same as tokens_computed). canvas: canvas
    length T (prompt, left padding and gen_length) in tokens. token_ids: the gen_length generated ids
    (EOS filler after the end); answer_ids: up to the end marker. score: task score (1.0 / 0.0), None
    without a task.
    """

    prompt: int
    repeat: int
    generated_tokens: int
    latency_s: float
    nfe: int
    full_forwards: int
    partial_forwards: int
    tokens_computed: int
    canvas: int
    token_ids: list[int] = field(default_factory=list)
    answer_ids: list[int] = field(default_factory=list)
    text: str = ""
    score: float | None = None
    tokens_planned: int | None = None

    @property
    def key(self) -> tuple[int, int]:
        """(prompt, repeat): what pairs this request with the same request under another policy."""
        return self.prompt, self.repeat


@dataclass
class RunMeasure:
    """One engine run (a batch of requests) under one policy. Times in seconds: wall_s is the engine's
    whole loop (``Run.wall_s``); forward_s, decision_s, sampling_s are the step sections summed over
    the run's StepRecords. peak_memory_bytes: CUDA peak allocated, or peak RSS on CPU (None if unknown).
    batch_size: requests decoded together in this run."""

    policy: str
    wall_s: float
    forward_s: float
    decision_s: float
    sampling_s: float
    steps: int
    rows: list[RowMeasure]
    peak_memory_bytes: int | None = None
    batch_size: int = 1
    peak_growth_bytes: int | None = None  # the peak minus the bytes in use before the run (metrics/memory.py)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 ≤ q ≤ 100) with linear interpolation between closest ranks (numpy's
    default ``method="linear"``): rank = q/100 * (n - 1). NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} must be in [0, 100]")
    xs = sorted(values)
    if not xs:
        return math.nan
    rank = q / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def latency_ms(latencies_s: Sequence[float]) -> dict:
    """{mean_ms, p50_ms, p95_ms} of per-request latencies given in seconds (NaN when empty)."""
    if not latencies_s:
        return {"mean_ms": math.nan, "p50_ms": math.nan, "p95_ms": math.nan}
    return {"mean_ms": 1e3 * sum(latencies_s) / len(latencies_s), "p50_ms": 1e3 * percentile(latencies_s, 50),
            "p95_ms": 1e3 * percentile(latencies_s, 95)}


def tokens_per_s(generated_tokens: int, seconds: float) -> float:
    """Generated tokens per second (0 when no time was measured)."""
    return generated_tokens / seconds if seconds > 0 else 0.0


def ratio(value: float | None, baseline: float | None) -> float | None:
    """value / baseline, None when either is missing or the baseline is 0 (speedups, shares)."""
    if value is None or baseline is None or baseline == 0:
        return None
    return value / baseline


def percent(part: float, total: float) -> float:
    """100 * part / total (0 when total is 0): decision overhead and other time shares."""
    return 100.0 * part / total if total > 0 else 0.0


def summarize(runs: Sequence[RunMeasure], baseline: Sequence[RunMeasure] | None = None) -> dict:
    """Every per-policy number of the profile table from the policy's measured runs.

    ``baseline`` are the runs of ``none`` in the same process (None: speedup and work share vs none are
    None). Requests are paired with the baseline by (prompt, repeat). Returns a flat dict (units in the
    key names; see the module docstring for the definitions).
    """
    rows = [r for run in runs for r in run.rows]
    wall = sum(r.wall_s for r in runs)
    gen = sum(r.generated_tokens for r in rows)
    decision = sum(r.decision_s for r in runs)
    forward = sum(r.forward_s for r in runs)
    sampling = sum(r.sampling_s for r in runs)
    n = max(len(rows), 1)
    out = {
        "requests": len(rows), "runs": len(runs), "steps": sum(r.steps for r in runs),
        "generated_tokens": gen, "wall_s": wall, "tokens_per_s": tokens_per_s(gen, wall),
        **latency_ms([r.latency_s for r in rows]),
        "nfe_per_request": sum(r.nfe for r in rows) / n,
        "tokens_per_forward": ratio(gen, sum(r.nfe for r in rows)),  # TPF: generated tokens per forward
        "full_forwards_per_request": sum(r.full_forwards for r in rows) / n,
        "partial_forwards_per_request": sum(r.partial_forwards for r in rows) / n,
        "nfe_total": sum(r.nfe for r in rows),
        "full_forwards_total": sum(r.full_forwards for r in rows),
        "partial_forwards_total": sum(r.partial_forwards for r in rows),
        "work_share_per_forward": ratio(sum(r.tokens_computed for r in rows), sum(r.nfe * r.canvas for r in rows)),
        "decision_s": decision, "forward_s": forward, "sampling_s": sampling,
        "decision_overhead_pct": percent(decision, wall), "forward_pct": percent(forward, wall),
        "sampling_pct": percent(sampling, wall), "other_pct": percent(wall - decision - forward - sampling, wall),
        "peak_memory_bytes": max((r.peak_memory_bytes for r in runs if r.peak_memory_bytes is not None), default=None),
        "peak_growth_bytes": max((r.peak_growth_bytes for r in runs if r.peak_growth_bytes is not None), default=None),
        "score": _mean([r.score for r in rows if r.score is not None]),
        "batch_size": max((r.batch_size for r in runs), default=1),
        "speedup_vs_none": None, "latency_speedup_vs_none": None, "work_share_vs_none": None,
        "planned_work_share_vs_none": None, "work_efficiency": None,
    }
    if baseline:
        base = summarize(baseline)
        out["speedup_vs_none"] = ratio(out["tokens_per_s"], base["tokens_per_s"])
        out["latency_speedup_vs_none"] = ratio(base["mean_ms"], out["mean_ms"])
        ref = {r.key: r for run in baseline for r in run.rows}
        paired = [(r, ref[r.key]) for r in rows if r.key in ref]
        out["work_share_vs_none"] = ratio(sum(r.tokens_computed for r, _ in paired),
                                          sum(b.nfe * b.canvas for _, b in paired))
        out["planned_work_share_vs_none"] = ratio(sum(_planned(r) for r, _ in paired),
                                                  sum(b.nfe * b.canvas for _, b in paired))
        out["work_efficiency"] = work_efficiency(out)
    return out


def pass_speedups(runs: Sequence[RunMeasure], base_runs: Sequence[RunMeasure]) -> list[float]:
    """Per pass (``RowMeasure.repeat``), a policy's tokens/s over ``none``'s in the same pass: generated
    tokens over the wall seconds of the runs of that pass (the definitions above), ascending by pass.
    ``runs``, ``base_runs``: the :class:`RunMeasure` lists of the policy and of ``none`` (a run's rows
    share one pass); passes missing in either, or where ``none`` measured no speed, are skipped."""

    def per_pass(rs) -> dict[int, float]:
        acc: dict[int, list[float]] = {}
        for r in rs:
            a = acc.setdefault(r.rows[0].repeat, [0, 0.0])
            a[0] += sum(row.generated_tokens for row in r.rows)
            a[1] += r.wall_s
        return {k: tokens_per_s(g, w) for k, (g, w) in acc.items()}

    mine, base = per_pass(runs), per_pass(base_runs)
    return [mine[k] / base[k] for k in sorted(mine) if k in base and base[k] > 0]


def work_efficiency(summary: dict) -> float | None:
    """Speedup over ``none`` × the planned work share of ``none``: 1.0 when every position × layer a
    policy's plans skip becomes time saved, lower when fixed per-step costs eat the saving (None without
    both figures)."""
    speedup, share = summary.get("speedup_vs_none"), summary.get("planned_work_share_vs_none")
    return None if speedup is None or share is None else speedup * share


def _planned(row: RowMeasure) -> int:
    return row.tokens_computed if row.tokens_planned is None else row.tokens_planned


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def row_record(policy: str, row: RowMeasure) -> dict:
    """A JSON-ready record of one request (token ids left out; the answer ids are kept)."""
    d = asdict(row)
    d.pop("token_ids")
    return {"policy": policy, **d}
