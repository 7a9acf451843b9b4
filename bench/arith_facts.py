"""Arithmetic facts of the embedded model: how often it computes a result, given everything else.

``arith`` problems fail almost only on computation (copying the numbers from the problem is right;
see the model card), and a whole problem needs 2-3 results right, so its accuracy moves late and
noisily. This measures the computation itself: for held-out arithmetic drills (``arith_drill`` of
scripts/train_tiny.py, 3-6 lines ``a op b = r``, drawn with a seed of their own) the answer is put on
the canvas clean except the digits of one result, which are masked; one full forward, and the result
counts as right when the argmax at every masked digit is the true digit (``drill_fact_accuracy`` in
scripts/train_tiny.py, which also logs it at every curriculum eval, on drills of its own seed).

Several models (``--model a,b``) run on the same drills, side by side: a recipe change is compared on
the same items at equal training steps (exported with ``train_tiny.py --export-only --state COPY``).

Prints a table (accuracy per operation), then one JSON line (the last stdout line).

    python bench/arith_facts.py                           # the shipped model, 100 drills
    python bench/arith_facts.py --model tiny,/tmp/ft --drills 200
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="comma-separated models (name or directory); default tiny")
    ap.add_argument("--drills", type=int, default=100, help="drills (3-6 results each); default 100")
    ap.add_argument("--seed", type=int, default=123, help="drill seed (the training stream never uses it)")
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    from rich.table import Table

    from ecache_cli.console import err, out
    from ecache_cli.errors import EcacheError
    from ecache_cli.models.loader import load_model

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from train_step import _train_module  # bench/ is on sys.path when run as a script

    tt = _train_module()
    rng = random.Random(f"facts:{args.seed}")
    drills = [tt.arith_drill(rng) for _ in range(args.drills)]
    models = [m for m in args.model.split(",") if m]
    res, secs = {}, {}
    for name in models:
        t0 = time.perf_counter()
        try:
            lm = load_model(name, device="cpu", dtype="float32")
        except EcacheError as e:  # one line, the CLI's exit codes
            err.print(f"error: {e}")
            raise SystemExit(e.exit_code) from None
        res[name] = tt.drill_fact_accuracy(lm.model, tt.Tok(lm.path), drills)
        secs[name] = round(time.perf_counter() - t0, 1)
    ops = ["+", "-", "*", "/", "all"]
    table = Table(title=f"result digits right, clean context ({args.drills} drills, seed {args.seed})")
    table.add_column("model")
    for op in ops:
        table.add_column(op, justify="right")
    for name in models:
        table.add_row(name, *[f"{res[name][op][0] / res[name][op][1]:.1%} ({res[name][op][1]})"
                              if op in res[name] else "-" for op in ops])
    out.print(table)
    doc = {"drills": args.drills, "seed": args.seed, "seconds": secs,
           "accuracy": {n: {op: round(c[0] / c[1], 4) for op, c in r.items()} for n, r in res.items()},
           "counts": res}
    print(json.dumps(doc, separators=(",", ":")), flush=True)


if __name__ == "__main__":
    main()
