"""Threads benchmark: decoding wall time of the embedded model with 1 vs 2 (or more) torch threads.

The measurement behind ``--threads``' default (``ecache_cli.runtime.DEFAULT_THREADS``): ``--n`` list
prompts of the embedded model's own ``list`` domain (test split, seed 0), decoded as ``ecache
generate`` does by default (EntropyCache, default decode settings, batch ``-b``), once per thread
count per repeat, in an order that alternates between repeats, after one untimed warm-up per count.
The load average before and after is printed beside the result: on a shared machine another busy
process changes the answer (torch's OpenMP threads spin-wait for each other), so read the numbers
with it. Prints a table on stderr-free stdout and a last line of JSON.

    OMP_NUM_THREADS=1 python bench/threads.py                # 8 prompts, 1 vs 2 threads, 3 repeats
    python bench/threads.py --threads 1,2,4 --repeats 5 -b 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--n", type=int, default=8, help="list prompts (default 8)")
    ap.add_argument("--threads", default="1,2", help="thread counts to compare (default 1,2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-b", "--batch-size", type=int, default=1)
    args = ap.parse_args()

    import torch

    from ecache_cli.cache import make_policy
    from ecache_cli.engine import DecodeConfig, Engine
    from ecache_cli.models.loader import load_model
    from ecache_cli.tasks import get_task

    lm = load_model(args.model, device="cpu", dtype="float32")
    engine = Engine.from_loaded(lm)
    task = get_task("list")
    prompts = [task.prompt(ex, 0, 0) for ex in task.examples("test", args.n, 0)]
    ids = engine.encode(prompts, lm.chat)
    cfg = DecodeConfig()
    counts = [int(t) for t in args.threads.split(",")]

    def decode_all(n_threads: int) -> float:
        torch.set_num_threads(n_threads)
        t0 = time.perf_counter()
        for i in range(0, len(ids), args.batch_size):
            run = engine.start(ids[i:i + args.batch_size], cfg, make_policy("entropy", tau=1.0))
            for _ in run:
                pass
        return time.perf_counter() - t0

    load_before = os.getloadavg()
    for c in counts:  # warm-up: thread pools started, caches filled
        decode_all(c)
    times: dict[int, list[float]] = {c: [] for c in counts}
    for r in range(args.repeats):
        for c in (counts if r % 2 == 0 else counts[::-1]):
            times[c].append(decode_all(c))
    load_after = os.getloadavg()

    med = {c: statistics.median(v) for c, v in times.items()}
    best = min(med, key=med.get)
    print(f"{'threads':>7} | {'median s':>8} | runs (s)")
    for c in counts:
        print(f"{c:>7} | {med[c]:8.2f} | " + ", ".join(f"{t:.2f}" for t in times[c]))
    print(f"fastest: {best} thread(s); load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
          f"{os.cpu_count()} CPUs")
    print(json.dumps({"bench": "threads", "model": args.model, "prompts": args.n, "batch_size": args.batch_size,
                      "repeats": args.repeats, "median_s": med, "runs_s": times, "fastest": best,
                      "loadavg_before": load_before, "loadavg_after": load_after, "cpus": os.cpu_count(),
                      "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}))


if __name__ == "__main__":
    main()
