"""The admission rules on a modelled engine: no model, no clock, so the result does not move with the
machine's load.

``bench/serve_sim.py`` runs the real engine, whose step times on a shared CPU move by more than the
5 % the admission targets resolve. This bench keeps the rules (``serve/admission.py``: the
``StepCost`` fit, ``StepHistory``, ``admit``, and the scheduler's ``_take`` logic for ``always``,
``fcfs`` and ``auto`` (a held head, and the requests expected to end first passing it), deciding for a held
head at every step: a decision takes no time on its clock,
so it has no use for ``Scheduler._hold_key``) and replaces the engine by a step-cost table: a step of ``n`` rows in step
costs ``base + row·n`` seconds, ``× --mixed`` when its rows are at different steps of their blocks
(a row that joined mid-block), and each joining row's first full forward ``--join`` more. The
defaults are the embedded model's on one CPU thread (``bench/serve_sim.py`` mixed-length passes,
means over every step of an ``always`` and an ``fcfs`` pass on a quiet machine: 2.9 ms a row alone,
4.4-4.9 ms two in step, 5.6 ms two mixed, ~4 ms more for a join). A request runs a fixed number of
steps, drawn from ``--sizes`` (``32``: one block; ``32,64``: one or two blocks, equally likely, the
shape of the ``list,arith`` workload; the first size is the "short" one), arriving on a seeded
Poisson schedule. ``--noise σ`` multiplies each step's time by a log-normal factor (σ of its log), the
clock of a shared machine, which the scheduler's fit sees as the real engine's does. Per mode: p50 / p95
latency over ``--n`` requests, the short requests' p95, and the mean; the targets as
``bench/serve_sim.py`` prints them; one JSON line last.

    python bench/admission_model.py --sizes 32 --rate 8                    # one block (list)
    python bench/admission_model.py --sizes 32,64 --rate 3                 # mixed lengths
    python bench/admission_model.py --sizes 32 --rate 8 --base 0.02 --row 0.0002   # a GPU below its bound
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_args import OneLineParser, check_at_least  # noqa: E402  (bench/, the script's folder)

from ecache_cli.serve.admission import Row, StepCost, StepHistory, ends_first, joins  # noqa: E402

GROUP = "g"


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * len(xs) + 0.5) - 1))]


def simulate(mode: str, arrivals: list[tuple[float, int]], args) -> list[tuple[float, int]]:
    """(latency seconds, size) of each request of ``arrivals`` ((time, steps) each) under ``mode``."""
    per_block, positions, full = args.block, 40.0, 40.0 + args.join / args.per_position

    def step_seconds(n: int, mixed: bool, joins: int) -> float:
        return (args.base + args.row * n) * (args.mixed if mixed and n > 1 else 1.0) + args.join * joins

    cost, history = StepCost(), StepHistory()
    jitter = random.Random(args.noise_seed)

    def noisy(seconds: float) -> float:  # a shared machine's clock: each step's time times a log-normal factor
        return seconds * math.exp(jitter.gauss(0.0, args.noise)) if args.noise else seconds

    for n in (1, 2, 4, 8):  # the server's warm-up: 8 steps at each width, the first with its full forwards
        for i in range(8):
            cost.observe(step_seconds(n, False, n if i == 0 else 0), n, positions * n + (full - 40) * n * (i == 0))
    join_est = lambda: cost.per_position * max(full - cost.positions(1), 0.0)  # noqa: E731 (scheduler._join_cost)
    t, i, queue, rows, out = 0.0, 0, collections.deque(), [], []
    recent: collections.deque[float] = collections.deque(maxlen=16)
    while len(out) < len(arrivals):
        while i < len(arrivals) and arrivals[i][0] <= t:
            queue.append(arrivals[i])
            recent.append(arrivals[i][0])
            i += 1
        if not rows and not queue:
            t = arrivals[i][0]
            continue
        taken = []
        if mode == "fcfs":
            if not rows:
                while queue and len(taken) < args.max_batch:
                    taken.append(queue.popleft())
        else:
            running = [Row(history.remaining(GROUP, r[1], args.bound, per_block), GROUP, r[1] % per_block)
                       for r in rows] if mode == "auto" else []
            idle, held, k = not rows, None, 0
            while k < len(queue) and len(rows) + len(taken) < args.max_batch:
                if mode == "auto" and not idle:  # the scheduler's _take: a held head, and the requests that pass it
                    sizes = history.sizes(GROUP, args.bound)
                    rate = (len(recent) - 1) / max(t - recent[0], 1e-3) if len(recent) > 1 else 0.0
                    if not (ends_first(running, sizes) if held is not None else
                            joins(running, GROUP, sizes, join_est(), len(queue) - 1, cost, rate)):
                        held, k = (queue[k] if held is None else held), k + 1
                        continue
                    if held is not None:  # the held head starts with the request that passes it
                        running.append(Row(history.remaining(GROUP, 0, args.bound, per_block), GROUP, 0))
                        taken.append(held)
                        queue.remove(held)
                        held, k = None, k - 1
                        if len(rows) + len(taken) >= args.max_batch:
                            break
                    running.append(Row(history.remaining(GROUP, 0, args.bound, per_block), GROUP, 0))
                taken.append(queue[k])
                del queue[k]
        rows += [[arr, 0, size] for arr, size in taken]
        if not rows:
            continue
        n, fresh = len(rows), sum(r[1] == 0 for r in rows)
        mixed = len({r[1] % per_block for r in rows}) > 1
        dt = noisy(step_seconds(n, mixed, fresh))
        t += dt
        cost.observe(dt, n, positions * n + (full - 40) * fresh, GROUP, fresh * join_est(), mixed)
        for r in rows:
            r[1] += 1
        for r in [r for r in rows if r[1] >= r[2]]:
            history.finished(GROUP, r[1])
            out.append((t - r[0], r[2]))
            rows.remove(r)
    return out


def parse(argv=None) -> argparse.Namespace:
    """The options, checked (one-line error and exit 2 for a bad value); ``sizes`` comes back as a list."""
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="32", help="steps a request runs, equally likely (default 32)")
    ap.add_argument("--rate", type=float, default=8.0, help="arrivals per second (default 8)")
    ap.add_argument("--n", type=int, default=1000, help="requests per schedule (default 1000)")
    ap.add_argument("--seeds", type=int, default=2, help="arrival schedules, each mode on each (default 2)")
    ap.add_argument("--base", type=float, default=1.45e-3, help="seconds a step costs (default 1.45e-3)")
    ap.add_argument("--row", type=float, default=1.45e-3, help="seconds a row adds to a step (default 1.45e-3)")
    ap.add_argument("--mixed", type=float, default=1.27, help="a mixed step over one in step (default 1.27)")
    ap.add_argument("--join", type=float, default=4e-3, help="seconds a joining row's full forward adds (4e-3)")
    ap.add_argument("--per-position", type=float, default=25e-6,
                    help="seconds a computed position adds, for the fit's positions (default 25e-6)")
    ap.add_argument("--block", type=int, default=32, help="steps a block takes (default 32)")
    ap.add_argument("--bound", type=int, default=128, help="most steps a request can take (default 128)")
    ap.add_argument("--max-batch", type=int, default=16, help="the server's --max-batch (default 16)")
    ap.add_argument("--noise", type=float, default=0.0,
                    help="σ of a log-normal factor on each step's time, a shared machine's clock (default 0)")
    ap.add_argument("--noise-seed", type=int, default=0, help="the noise's seed (default 0)")
    args = ap.parse_args(argv)
    try:
        args.sizes = [int(x) for x in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes {args.sizes!r} is not a list of step counts; e.g. --sizes 32,64")
    if not all(x >= 1 for x in args.sizes):
        ap.error(f"--sizes {','.join(map(str, args.sizes))}: every size must be ≥ 1 step")
    if args.rate <= 0 or args.per_position <= 0:
        bad = "rate" if args.rate <= 0 else "per-position"
        ap.error(f"--{bad} {getattr(args, bad.replace('-', '_')):g} must be > 0")
    if args.mixed < 1:
        ap.error(f"--mixed {args.mixed:g} must be ≥ 1 (a mixed step costs at least one in step)")
    check_at_least(ap, args, dict(n=2, seeds=1, block=1, bound=1, max_batch=1))
    if args.noise < 0:
        ap.error(f"--noise {args.noise:g} must be ≥ 0 (the σ of a log-normal factor; 0 for none)")
    for name in ("base", "row", "join"):
        if getattr(args, name) < 0:
            ap.error(f"--{name} {getattr(args, name):g} must be ≥ 0 seconds")
    return args


def run(args) -> dict:
    """Every mode on the same ``--seeds`` schedules: ``modes`` ({mode: p50, p95, mean, short_p95 in
    seconds}) and ``targets`` (as ``bench/serve_sim.py`` computes them)."""
    sizes = args.sizes
    res: dict[str, list[tuple[float, int]]] = {m: [] for m in ("always", "fcfs", "auto")}
    for seed in range(args.seeds):
        rng, t, arrivals = random.Random(seed), 0.0, []
        for _ in range(args.n):
            t += rng.expovariate(args.rate)
            arrivals.append((t, rng.choice(sizes)))
        for mode in res:
            res[mode] += simulate(mode, arrivals, args)
    table = {}
    for mode, lat in res.items():
        xs = [x for x, _ in lat]
        short = [x for x, s in lat if s == sizes[0]]
        table[mode] = {"p50": pct(xs, 0.5), "p95": pct(xs, 0.95), "mean": statistics.mean(xs),
                       "short_p95": pct(short, 0.95)}
    best = {k: min(table["always"][k], table["fcfs"][k]) for k in ("p50", "p95")}
    targets = {f"auto_{k}_over_best": table["auto"][k] / best[k] for k in ("p50", "p95")}
    if len(set(sizes)) > 1:
        targets["auto_short_p95_over_fcfs"] = table["auto"]["short_p95"] / table["fcfs"]["short_p95"]
    return {"modes": table, "targets": targets}


def main() -> None:
    args = parse()
    out = run(args)
    print(f"{'admission':>9} {'p50 s':>7} {'p95 s':>7} {'mean s':>7} {'short p95':>9}")
    for mode, r in out["modes"].items():
        print(f"{mode:>9} {r['p50']:7.3f} {r['p95']:7.3f} {r['mean']:7.3f} {r['short_p95']:9.3f}")
    print("targets:", json.dumps(out["targets"]))
    print(json.dumps({"bench": "admission_model", "args": vars(args), **out}))


if __name__ == "__main__":
    main()
