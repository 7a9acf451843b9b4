"""Full-forward latency of a model over a long canvas on one CPU core (the embedded model's size budget).

The embedded model may grow only while one full forward over a 1,000-token canvas (prompt + gen
length, batch 1, float32) takes at most 60 ms on one core of the 2-core development machine
(BENCHMARKS.md, Forward latency). This times ``model(tokens, store)`` exactly as the
engine's full forward calls it (a fresh KV store, every position computed, logits for all of them).

Prints a table, then one JSON line (the last stdout line).

    python bench/forward.py                     # tiny, 1000 tokens, 1 thread
    python bench/forward.py --tokens 1000,2000 --repeats 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

TARGET_MS = 60.0


def main(argv=None) -> None:
    from rich.table import Table

    from ecache_cli.console import out
    from ecache_cli.models.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", default="1000", help="comma-separated canvas lengths (default 1000)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the budget's one core)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, device="cpu", dtype="float32")
    model = lm.model
    rows = []
    with torch.inference_mode():
        for n in (int(x) for x in args.tokens.split(",")):
            g = torch.Generator().manual_seed(0)
            x = torch.randint(3, lm.spec.vocab_size, (1, n), generator=g)
            keep = torch.ones(1, n, dtype=torch.bool)
            times = []
            for i in range(args.warmup + args.repeats):
                t0 = time.perf_counter()
                model(x, model.new_store(keep))
                if i >= args.warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
            rows.append({"tokens": n, "median_ms": round(statistics.median(times), 2),
                         "min_ms": round(min(times), 2), "threads": args.threads})
    t = Table(title=f"full forward, {lm.name} ({lm.spec.n_params / 1e6:.2f}M params), float32, batch 1")
    for c in ("canvas tokens", "median ms", "min ms", "target ms (1000 tokens)"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["tokens"]), f"{r['median_ms']:.1f}", f"{r['min_ms']:.1f}",
                  f"{TARGET_MS:.0f}" if r["tokens"] == 1000 else "")
    out.print(t)
    at1000 = next((r for r in rows if r["tokens"] == 1000), None)
    print(json.dumps({"bench": "forward", "model": lm.name, "params": lm.spec.n_params, "rows": rows,
                      "target_ms": TARGET_MS,
                      "meets_target": None if at1000 is None else at1000["median_ms"] <= TARGET_MS}))


if __name__ == "__main__":
    main()
