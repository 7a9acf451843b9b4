"""Mixed steps as one forward or two: ``engine/forward.py``'s ``MERGE_REFRESH`` side by side.

A step whose rows refresh only in part (some rows a full forward, the others a partial one) runs either a
partial forward of every row plus a full forward of the refreshing rows (*split*, two forwards), or one
partial forward in which the refreshing rows compute every position (*merged*). This bench decodes one
batch of test prompts (``--domains``, ``--shots``; a seed no other benchmark uses) with ``--policy``
(default EntropyCache at a tau where part of the rows refresh at a step) both ways, alternating which
goes first over ``--repeats``, in one process, and reports per path:

- ``run_s`` / ``run_cpu_s``: the decode's wall time and its thread's CPU time (``time.thread_time``: on one
  torch thread, what a dedicated core would take, whatever other processes do), medians over the repeats;
- per kind of step (``mixed``: 0 < refreshing rows < batch; ``full``: every row; ``partial``: none):
  how many, the model forwards per step (counted by a forward pre-hook on the model), the refreshing
  rows' share, and the median ms per step (between two yields of the run; wall and the thread's CPU
  time) and of its forwards (``StepRecord.forward_s``), medians over every step of that kind in every
  repeat;
- the ratios merged / split of the mixed steps' median times and of the runs' times;
- ``same_tokens``: whether both paths decoded the same tokens (they must: the merge is exact).

One torch thread by default (``--threads``). Prints a table (stderr) and a last stdout line of JSON.

    OMP_NUM_THREADS=1 python bench/merge_refresh.py                          # tiny, 8 prompts
    python bench/merge_refresh.py --policy entropy:tau=0.5:recent_k=16 --repeats 5
    python bench/merge_refresh.py --size 1b --device cuda --dtype bfloat16   # a GPU (bench/gpu_speed.py's sizes)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def decode(engine, ids, cfg, policy_spec: str, merge: bool, sync) -> tuple[tuple, list[dict], list[list[int]]]:
    """One decode of ``ids`` as one batch with ``MERGE_REFRESH = merge``: ((wall seconds, the thread's CPU
    seconds), a dict per step, the answers' token ids)."""
    from serve_sim import forward_counter
    from step_cost import make

    from ecache_cli.engine import forward

    forward.MERGE_REFRESH = merge
    calls = forward_counter(engine.model)
    counted = calls[0]
    steps = []
    run = engine.start(ids, cfg, make(policy_spec))
    sync()
    t0 = last = time.perf_counter()
    c0 = cpu_last = time.thread_time()
    for rec in run:
        sync()
        now, cpu = time.perf_counter(), time.thread_time()
        B, n = len(rec.rows), int(rec.refresh.sum())
        kind = "full" if n == B else "partial" if n == 0 else "mixed"
        steps.append(dict(kind=kind, step_s=now - last, cpu_s=cpu - cpu_last, forward_s=rec.forward_s,
                          forwards=calls[0] - counted, rows=B, refresh=n))
        counted = calls[0]
        last, cpu_last = time.perf_counter(), time.thread_time()
    wall = (time.perf_counter() - t0, time.thread_time() - c0)
    return wall, steps, [r.token_ids for r in run.results()]


def summarise(steps: list[dict]) -> dict[str, dict]:
    """{kind: count, forwards per step, refreshing share, median step and forward ms}."""
    out = {}
    for kind in ("mixed", "full", "partial"):
        rows = [s for s in steps if s["kind"] == kind]
        if rows:
            out[kind] = dict(count=len(rows), forwards=statistics.fmean(s["forwards"] for s in rows),
                             refresh_share=statistics.fmean(s["refresh"] / s["rows"] for s in rows),
                             rows=statistics.fmean(s["rows"] for s in rows),
                             step_ms=1e3 * statistics.median(s["step_s"] for s in rows),
                             cpu_ms=1e3 * statistics.median(s["cpu_s"] for s in rows),
                             forward_ms=1e3 * statistics.median(s["forward_s"] for s in rows))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="a model name or folder (default tiny; ignored with --size)")
    ap.add_argument("--size", default=None, help="a random-weight LLaDA-shaped checkpoint of bench/gpu_speed.py's "
                    "SIZES instead of --model (as bench/serve_sim.py writes it)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--policy", default="entropy:tau=0.3:recent_k=16",
                    help="policy spec, ecache profile --policies syntax (default entropy:tau=0.3:recent_k=16)")
    ap.add_argument("--domains", default="list")
    ap.add_argument("--batch", type=int, default=8, help="prompts, decoded as one batch (default 8)")
    ap.add_argument("--shots", type=int, default=0)
    ap.add_argument("--seed", type=int, default=5353, help="a seed no other benchmark uses")
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="decodes per path, alternating which goes first")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    from bench_args import check_domains  # bench/, the script's folder

    check_domains(ap, args.domains)

    import torch
    from rich.console import Console
    from rich.table import Table
    from serve_sim import random_checkpoint
    from step_cost import prompts

    from ecache_cli.engine import DecodeConfig, Engine
    from ecache_cli.models.loader import load_model

    torch.set_num_threads(args.threads)
    model = args.model
    work = Path(tempfile.mkdtemp(prefix="ecache-merge-")) if args.size else None
    try:
        if work is not None:
            model = str(random_checkpoint(args.size, work))
        lm = load_model(model, device=args.device, dtype=args.dtype)
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    engine = Engine.from_loaded(lm)
    domains = args.domains.split(",")
    ids = prompts(engine, domains, -(-args.batch // len(domains)), args.shots, args.seed)[:args.batch]
    cfg = DecodeConfig(gen_length=args.gen_length, block_length=args.block_length)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for merge in (False, True):  # warm-up, not kept
        decode(engine, ids[:2], cfg, args.policy, merge, sync)
    walls: dict[bool, list[float]] = {False: [], True: []}
    steps: dict[bool, list[dict]] = {False: [], True: []}
    tokens: dict[bool, list] = {}
    for rep in range(args.repeats):
        for merge in ((False, True) if rep % 2 == 0 else (True, False)):
            wall, st, tok = decode(engine, ids, cfg, args.policy, merge, sync)
            walls[merge].append(wall)
            steps[merge] += st
            tokens[merge] = tok
    from ecache_cli.engine import forward

    forward.MERGE_REFRESH = False
    paths = {name: dict(run_s=statistics.median(w for w, _ in walls[m]),
                        run_cpu_s=statistics.median(c for _, c in walls[m]), runs_s=walls[m], **summarise(steps[m]))
             for name, m in (("split", False), ("merged", True))}
    sp, mg = paths["split"], paths["merged"]
    ratios = {"run": mg["run_s"] / sp["run_s"], "run_cpu": mg["run_cpu_s"] / sp["run_cpu_s"]}
    if "mixed" in sp and "mixed" in mg:
        ratios.update({f"mixed_{k}": mg["mixed"][f"{k}_ms"] / sp["mixed"][f"{k}_ms"]
                       for k in ("step", "cpu", "forward")})
    t = Table(title=f"mixed steps, split vs merged · {args.size or args.model} {args.device} {args.dtype} · "
                    f"{len(ids)} prompts · {args.policy} · gen {args.gen_length} block {args.block_length} · "
                    f"{args.threads} thread(s) · medians over {args.repeats} repeats")
    for c in ("path", "kind", "steps", "rows", "refresh share", "forwards/step", "ms/step", "cpu ms/step",
              "forward ms"):
        t.add_column(c, justify="left" if c in ("path", "kind") else "right")
    for name, p in paths.items():
        for kind in ("mixed", "full", "partial"):
            if kind in p:
                k = p[kind]
                t.add_row(name, kind, str(k["count"]), f"{k['rows']:.1f}", f"{k['refresh_share']:.2f}",
                          f"{k['forwards']:.2f}", f"{k['step_ms']:.2f}", f"{k['cpu_ms']:.2f}", f"{k['forward_ms']:.2f}")
        t.add_row(name, "whole run", "", "", "", "", f"{1e3 * p['run_s']:.1f}", f"{1e3 * p['run_cpu_s']:.1f}", "")
    console = Console(stderr=True, width=200)
    console.print(t)
    console.print("merged / split: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    print(json.dumps({"bench": "merge_refresh", "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                      "prompts": len(ids), "paths": paths, "ratios": ratios,
                      "same_tokens": tokens[False] == tokens[True]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
