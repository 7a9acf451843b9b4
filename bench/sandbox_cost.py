"""Sandbox start-up cost: wall time of one ``run_program`` per isolation, and the extra over the guard.

Every configuration runs the same small program (a function and three asserts, the shape of an MBPP
item) ``--runs`` times, interleaved (each round runs every configuration once, in a new random order),
so machine load hits them alike. Configurations: ``before`` (the guard with the previous
``Popen.wait(timeout)``, which polls with sleeps growing to 50 ms), ``guard`` (no kernel layer: the
in-process guard and limits), each
kernel layer alone, Landlock + seccomp (a machine without namespaces), and all three (what ``auto``
and ``strict`` run here). The extra cost of a configuration is the median of its per-round
differences to ``guard``. Target: the full isolation adds ≤ 50 ms a program.
Prints a table and a last stdout line of JSON.

    python bench/sandbox_cost.py              # 30 rounds
    python bench/sandbox_cost.py --runs 60
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

from ecache_cli.tasks import sandbox

PROGRAM = """def add(a, b):
    return a + b

assert add(1, 2) == 3
assert add(-1, 1) == 0
assert add(2, 2) == 4
"""
TARGET_MS = 50.0
CONFIGS = {  # name: (mode, layers, use the previous polling wait)
    "before": ("guard", (), True),
    "guard": ("guard", (), False),
    "namespaces": ("auto", ("namespaces",), False),
    "landlock": ("auto", ("landlock",), False),
    "seccomp": ("auto", ("seccomp",), False),
    "landlock+seccomp": ("auto", ("landlock", "seccomp"), False),
    "namespaces+landlock+seccomp": ("auto", sandbox.KERNEL_LAYERS, False),
}


def polling_wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    """The previous wait: ``Popen.wait(timeout)`` (polls, sleeping up to 50 ms between looks)."""
    try:
        proc.wait(timeout=timeout_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def run_once(name: str) -> tuple[float, str]:
    mode, layers, polling = CONFIGS[name]
    fast_wait = sandbox._wait
    if polling:
        sandbox._wait = polling_wait
    try:
        t0 = time.perf_counter()
        r = sandbox.run_program(PROGRAM, mode=mode, layers=layers)
        dt = time.perf_counter() - t0
    finally:
        sandbox._wait = fast_wait
    if not r.passed:
        sys.exit(f"{name}: the program did not pass ({r.status}): {r.stderr_tail.strip()[-300:]}")
    return dt, r.isolation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()

    for name in CONFIGS:  # warm the file cache; not timed
        run_once(name)
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {n: [] for n in CONFIGS}
    isolation: dict[str, str] = {}
    rng = random.Random(0)
    for _ in range(args.runs):
        for name in rng.sample(list(CONFIGS), len(CONFIGS)):  # a new order each round: no position bias
            dt, isolation[name] = run_once(name)
            times[name].append(dt)
    load_after = os.getloadavg()

    rows = {}
    for name, ts in times.items():
        extra = statistics.median(t - g for t, g in zip(ts, times["guard"]))
        rows[name] = {"isolation": isolation[name], "median_ms": 1e3 * statistics.median(ts),
                      "min_ms": 1e3 * min(ts), "extra_ms": 1e3 * extra}
    print(f"sandbox start-up, {args.runs} interleaved rounds, program: 3 asserts; {os.cpu_count()} CPUs, "
          f"load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(f"{'configuration':<28} | {'isolation reported':<28} | median ms | min ms | extra over guard ms")
    for name, row in rows.items():
        print(f"{name:<28} | {row['isolation']:<28} | {row['median_ms']:9.1f} | {row['min_ms']:6.1f} | "
              f"{row['extra_ms']:+8.1f}")
    full = rows["namespaces+landlock+seccomp"]["extra_ms"]
    met = full <= TARGET_MS
    print(f"full isolation adds {full:.1f} ms a program (target ≤ {TARGET_MS:.0f} ms: {'met' if met else 'NOT met'})")
    print(json.dumps({"bench": "sandbox_cost", "runs": args.runs, "configs": rows, "full_extra_ms": full,
                      "target_ms": TARGET_MS, "met": met, "python": platform.python_version(),
                      "kernel": platform.release(), "cpus": os.cpu_count(), "loadavg_before": load_before,
                      "loadavg_after": load_after}))


if __name__ == "__main__":
    main()
