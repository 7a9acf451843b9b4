"""Where a denoising step's time goes: full and partial steps, batch 1 and 8, 1 and 2 threads.

For each thread count and batch size, 4-shot test prompts of the embedded model's domains (a seed no
other benchmark uses) are decoded twice with each policy (``none`` and, by default,
``entropy:tau=3:recent_k=16``):

- a timing pass: every step's total (between two yields of the run), its model forwards, its
  sampling and commit, and the policy's plan and observe (the engine's own ``StepRecord`` times); the
  rest is the loop's bookkeeping;
- a profiled pass (``torch.profiler``, operators' own CPU time) that splits the forwards into
  attention (SDPA), projections and MLP (linear layers and their activations), KV-store writes
  (scatter / index copies) and the remaining operators; the shares are applied to the timing
  pass's forward time, so the profiler's own overhead does not inflate the figures.

Steps are grouped as *full* (every row refreshed) or *partial*; ``positions`` is what the step's
forwards computed per row (``StepRecord.computed``). Prints a table and a last stdout line of JSON.

    OMP_NUM_THREADS=1 python bench/step_cost.py                       # threads 1,2 × batch 1,8
    python bench/step_cost.py --threads 1 --batch-sizes 1 --n 4      # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CATEGORIES = {  # operator name fragments → forward section
    "attention": ("scaled_dot_product", "_flash_attention", "_efficient_attention", "softmax", "bmm", "baddbmm"),
    "proj_mlp": ("linear", "addmm", "aten::mm", "matmul", "silu", "aten::mul"),
    "kv_write": ("scatter", "index_copy", "index_put"),
}


def category(op: str) -> str:
    for cat, keys in CATEGORIES.items():
        if any(k in op for k in keys):
            return cat
    return "other_ops"


def prompts(engine, domains: list[str], n: int, shots: int, seed: int) -> list[list[int]]:
    from ecache_cli.tasks import get_task

    out = []
    for d in domains:
        task = get_task(d)
        out += [task.prompt(ex, shots, seed) for ex in task.examples("test", n, seed)]
    return engine.encode(out, chat=True)


def make(policy_spec: str):
    """A fresh policy from ``name`` or ``name:key=value:...`` (``ecache profile --policies`` syntax)."""
    from ecache_cli.cache import make_policy
    from ecache_cli.runs.profile import parse_policy_spec

    name, params = parse_policy_spec(policy_spec)
    return make_policy(name, **params)


def timing_pass(engine, ids, cfg, policy_spec, batch: int) -> list[dict]:
    """One decode of ``ids`` in batches of ``batch``: a dict per step (kind, seconds by section, positions)."""
    steps = []
    for s in range(0, len(ids), batch):
        run = engine.start(ids[s:s + batch], cfg, make(policy_spec))
        last = time.perf_counter()
        for rec in run:
            now = time.perf_counter()
            steps.append(dict(kind="full" if rec.full else "partial", step_s=now - last, forward_s=rec.forward_s,
                              sampling_s=rec.sampling_s, policy_s=rec.decision_s, rows=len(rec.rows),
                              positions=float(rec.computed.float().mean())))
            last = time.perf_counter()
    return steps


def forward_shares(engine, ids, cfg, policy_spec, batch: int) -> dict[str, dict[str, float]]:
    """{kind: {section: share of the forward's operator time}} from a profiled decode."""
    import torch

    kinds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in range(0, len(ids), batch):
        run = engine.start(ids[s:s + batch], cfg, make(policy_spec))
        run.ranges = True
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in run:
                pass
        events = prof.events()
        for ev in events:  # the forward ranges, and the operators inside them
            if ev.name in ("ecache.forward.full", "ecache.forward.partial"):
                kind = ev.name.rsplit(".", 1)[1]
                for child in _descendants(ev):
                    if child.name.startswith("aten::"):
                        kinds[kind][category(child.name)] += child.self_cpu_time_total
    out = {}
    for kind, cats in kinds.items():
        total = sum(cats.values()) or 1.0
        out[kind] = {c: cats.get(c, 0.0) / total for c in ("attention", "proj_mlp", "kv_write", "other_ops")}
    return out


def _descendants(ev):
    stack = list(ev.cpu_children)
    while stack:
        e = stack.pop()
        yield e
        stack.extend(e.cpu_children)


def summarise(steps: list[dict], shares: dict) -> dict[str, dict]:
    """{kind: mean ms per step by section, positions, count}."""
    out = {}
    for kind in ("full", "partial"):
        rows = [s for s in steps if s["kind"] == kind]
        if not rows:
            continue
        def mean(key: str, rows=rows) -> float:
            return 1e3 * statistics.fmean(r[key] for r in rows)

        fwd = mean("forward_s")
        d = dict(count=len(rows), step_ms=mean("step_s"), forward_ms=fwd, sampling_commit_ms=mean("sampling_s"),
                 policy_ms=mean("policy_s"), positions=statistics.fmean(r["positions"] for r in rows))
        d["rest_ms"] = d["step_ms"] - fwd - d["sampling_commit_ms"] - d["policy_ms"]
        for cat, share in shares.get(kind, {}).items():
            d[f"{cat}_ms"] = fwd * share
        out[kind] = d
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--policies", default="none,entropy:tau=3:recent_k=16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--domains", default="arith,list")
    ap.add_argument("--n", type=int, default=4, help="prompts per domain")
    ap.add_argument("--shots", type=int, default=4)
    ap.add_argument("--seed", type=int, default=9091, help="a seed no calibration or other benchmark uses")
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--block-length", type=int, default=32)
    args = ap.parse_args(argv)
    from bench_args import check_domains  # bench/, the script's folder

    check_domains(ap, args.domains)

    import torch
    from rich.console import Console
    from rich.table import Table

    from ecache_cli.engine import DecodeConfig, Engine
    from ecache_cli.models.loader import load_model

    lm = load_model(args.model, device="cpu", dtype="float32")
    engine = Engine.from_loaded(lm)
    ids = prompts(engine, args.domains.split(","), args.n, args.shots, args.seed)
    cfg = DecodeConfig(gen_length=args.gen_length, block_length=args.block_length)
    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            for pol in args.policies.split(","):
                timing_pass(engine, ids[:bs], cfg, pol, bs)  # warm-up
                steps = timing_pass(engine, ids, cfg, pol, bs)
                shares = forward_shares(engine, ids[:bs], cfg, pol, bs)
                for kind, d in summarise(steps, shares).items():
                    results.append(dict(threads=threads, batch=bs, policy=pol, kind=kind, **d))
    cols = ["threads", "batch", "policy", "kind", "count", "positions", "step_ms", "forward_ms", "attention_ms",
            "proj_mlp_ms", "kv_write_ms", "other_ops_ms", "sampling_commit_ms", "policy_ms", "rest_ms"]
    t = Table(title=f"step cost · {args.model} · {len(ids)} prompts, {args.shots} shots · gen {args.gen_length} "
                    f"block {args.block_length} · ms per step (means)")
    for c in cols:
        t.add_column(c.replace("_ms", ""), justify="left" if c in ("policy", "kind") else "right")
    for r in results:
        t.add_row(*[f"{r.get(c, 0):.2f}" if isinstance(r.get(c), float) else str(r.get(c, "–")) for c in cols])
    Console(stderr=True, width=250).print(t)
    print(json.dumps({"command": "bench/step_cost.py", "args": vars(args), "rows": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
