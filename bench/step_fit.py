"""What the step-cost model of ``--admission auto`` was given, and what it made of it, from a
``bench/serve_sim.py --steps-log`` file (``bench/gpu_check.sh`` step 8 writes ``serve_steps.jsonl``).

For each pass (a line of the log: its mode, rate and repeat, then ``[seconds, rows, positions, mixed,
joins seconds]`` per step, the scheduler's warm-up steps first): per row count, the steps in step and the
mixed ones (rows at different steps of their blocks), each with their count, mean and largest ms and mean
positions; then the fit replayed step by step through ``serve/admission.py``'s ``StepCost`` (the same
model the scheduler ran): its ``base``, ``per_row`` and ``per_position`` after the warm-up, at the middle
of the pass and at its end, and the step it predicts at 1, 4, 8 and 16 rows beside the measured means.
A fit far from the means shows which steps moved it (a slow first step at a count, say).

    python bench/step_fit.py runs_out/gpu/serve_steps.jsonl
    python bench/step_fit.py serve_steps.jsonl --mode auto --rate 5.58
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_args import OneLineParser  # noqa: E402  (bench/, the script's folder)

from ecache_cli.serve.admission import StepCost  # noqa: E402

#: Steps of the scheduler's warm-up at the head of each pass's log (runs of 1, 2 and 4 rows, 8 steps each;
#: ``serve/scheduler.py`` ``_warm_up`` with serve_sim's four warm-up requests).
WARMUP = 24
WIDTHS = (1, 4, 8, 16)


def by_count(steps: list[list]) -> dict[tuple[int, bool], dict]:
    """(rows, mixed) -> n, mean and largest ms, mean positions, over ``steps``."""
    out: dict[tuple[int, bool], list] = {}
    for seconds, rows, positions, mixed, _ in steps:
        out.setdefault((rows, bool(mixed)), []).append((seconds, positions))
    return {k: {"n": len(v), "mean_ms": 1e3 * statistics.fmean(s for s, _ in v),
                "max_ms": 1e3 * max(s for s, _ in v), "positions": statistics.fmean(p for _, p in v)}
            for k, v in sorted(out.items())}


def replay(steps: list[list]) -> list[tuple[str, list[float], list[float]]]:
    """The fit after the warm-up, at the pass's middle and at its end: (when, [base, per_row,
    per_position] in seconds, predicted seconds at :data:`WIDTHS`)."""
    cost, marks, out = StepCost(), {WARMUP: "after warm-up", WARMUP + (len(steps) - WARMUP) // 2: "middle",
                                    len(steps): "end"}, []
    for i, (seconds, rows, positions, mixed, joins) in enumerate(steps, 1):
        cost.observe(seconds, rows, positions, "g", joins, bool(mixed))
        if i in marks:
            out.append((marks[i], [cost.base, cost.per_row, cost.per_position], [cost.step(n) for n in WIDTHS]))
    return out


def report(entry: dict) -> str:
    """The text for one pass of the log (module docstring)."""
    steps = entry["steps"]
    lines = [f"{entry['mode']} at {entry['rate']:g}/s, pass {entry['repeat']}: {len(steps)} steps "
             f"({min(WARMUP, len(steps))} of the warm-up)",
             f"{'rows':>4} {'kind':>7} {'steps':>5} {'mean ms':>8} {'max ms':>8} {'positions':>9}"]
    counts = by_count(steps)
    for (rows, mixed), c in counts.items():
        lines.append(f"{rows:4d} {'mixed' if mixed else 'in step':>7} {c['n']:5d} {c['mean_ms']:8.2f} "
                     f"{c['max_ms']:8.2f} {c['positions']:9.0f}")
    for when, (base, per_row, per_position), predicted in replay(steps):
        measured = ", ".join(f"{n}: {1e3 * p:.1f}" + (f" (measured {counts[(n, False)]['mean_ms']:.1f})"
                                                     if (n, False) in counts else "")
                             for n, p in zip(WIDTHS, predicted))
        lines.append(f"fit {when}: base {1e3 * base:.2f} ms, per row {1e3 * per_row:.2f} ms, per 1024 positions "
                     f"{1024e3 * per_position:.2f} ms; predicted ms at rows {measured}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path, help="a bench/serve_sim.py --steps-log file")
    ap.add_argument("--mode", default=None, help="only the passes of this admission mode")
    ap.add_argument("--rate", type=float, default=None, help="only the passes at this rate (requests/s)")
    args = ap.parse_args(argv)
    try:
        text = args.log.read_text(encoding="utf-8")
    except OSError as e:
        ap.error(f"{args.log}: {e.strerror}; give a bench/serve_sim.py --steps-log file")
    entries = []
    for i, line in enumerate(text.splitlines(), 1):
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            ap.error(f"{args.log}:{i}: not a JSON line; give a bench/serve_sim.py --steps-log file")
    chosen = [e for e in entries if (args.mode is None or e["mode"] == args.mode)
              and (args.rate is None or abs(e["rate"] - args.rate) < 1e-9)]
    if not chosen:
        ap.error(f"{args.log}: no pass of mode {args.mode or 'any'} at rate {args.rate or 'any'}")
    print("\n\n".join(report(e) for e in chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
