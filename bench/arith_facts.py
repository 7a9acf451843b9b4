"""Arithmetic facts of the embedded model: how often it computes a result, given everything before it.

``arith`` problems fail almost only on computation (copying the numbers from the problem is right;
see the model card), and a whole problem needs 2-3 results right, so its accuracy moves late and
noisily. This measures the computation itself (``drill_fact_accuracy`` in scripts/tiny_training/evaluate.py): one
result's digits are masked, one full forward, and the result counts as right when the argmax at every
masked digit is the true digit. Three measures, one row each per model:

- ``drills, clean``: held-out arithmetic drills (``arith_drill``, 3-6 lines ``a op b = r``, a seed of
  their own), the rest of the answer clean, so the text after the result gives its length away (the
  measure logged as ``facts`` at every curriculum eval);
- ``drills, ltr``: the same drills with the result and everything after it masked, as in left-to-right
  decoding: the model must also decide how many digits the result has;
- ``arith, ltr``: the worked solutions of held-out ``arith`` problems (test split, seed 0, as
  bench/quality.py), each result and everything after it masked: the computations of the benchmark
  itself, in context, each from a correct prefix (logged as ``facts_ltr``).

Several models (``--model a,b``) run on the same items, side by side: a recipe change is compared on
the same items at equal training steps (exported with ``scripts/train_tiny.py --export-only --state COPY --out DIR``).

Prints a table (accuracy per operation), then one JSON line (the last stdout line).

    python bench/arith_facts.py                           # the shipped model, 100 drills, 100 problems
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
    ap.add_argument("--problems", type=int, default=100,
                    help="held-out arith problems (test split, seed 0); default 100")
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    from rich.table import Table

    from ecache_cli.console import err, out
    from ecache_cli.errors import EcacheError
    from ecache_cli.models.loader import load_model

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from train_step import (
        training_package,  # bench/ is on sys.path when run as a script
    )

    tt = training_package()
    rng = random.Random(f"facts:{args.seed}")
    drills = [tt.data.arith_drill(rng) for _ in range(args.drills)]
    from ecache_cli.tasks import get_task

    problems = [(ex.question, ex.answer) for ex in get_task("arith").examples("test", args.problems, 0)]
    measures = {"drills, clean": (drills, "clean"), "drills, ltr": (drills, "ltr"), "arith, ltr": (problems, "ltr")}
    models = [m for m in args.model.split(",") if m]
    res: dict[str, dict[str, dict]] = {}
    secs = {}
    for name in models:
        t0 = time.perf_counter()
        try:
            lm = load_model(name, device="cpu", dtype="float32")
        except EcacheError as e:  # one line, the CLI's exit codes
            err.print(f"error: {e}")
            raise SystemExit(e.exit_code) from None
        tok = tt.data.Tok(lm.path)
        res[name] = {m: tt.evaluate.drill_fact_accuracy(lm.model, tok, items, mode)
                     for m, (items, mode) in measures.items()}
        secs[name] = round(time.perf_counter() - t0, 1)
    ops = ["+", "-", "*", "/", "all"]
    table = Table(title=f"result digits right ({args.drills} drills seed {args.seed}; "
                        f"{args.problems} arith test problems)")
    table.add_column("model")
    table.add_column("measure")
    for op in ops:
        table.add_column(op, justify="right")
    for name in models:
        for m, r in res[name].items():
            table.add_row(name, m, *[f"{r[op][0] / r[op][1]:.1%} ({r[op][1]})" if op in r else "-" for op in ops])
    out.print(table)
    doc = {"drills": args.drills, "seed": args.seed, "problems": args.problems, "seconds": secs,
           "accuracy": {n: {m: {op: round(c[0] / c[1], 4) for op, c in r.items()} for m, r in rs.items()}
                        for n, rs in res.items()},
           "counts": res}
    print(json.dumps(doc, separators=(",", ":")), flush=True)


if __name__ == "__main__":
    main()
