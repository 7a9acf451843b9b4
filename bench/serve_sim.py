"""Continuous vs static batching inside one process: the engine thread of ``ecache serve`` fed Poisson
arrivals directly, without HTTP.

``bench/serve_load.py`` measures the server as a client sees it, HTTP, SSE and the client's own CPU
time included. This bench keeps only the scheduler and the engine (``serve/scheduler.py``), so that a
difference between the batching modes is the scheduling's: each request is a greedy chat completion
of a test prompt of ``--domain`` (``max_tokens`` ``--max-tokens``), built by the server's own request
resolver with the server's settings (``--profile``), and submitted on a seeded Poisson schedule; both
batching modes get the same schedule, in alternating order over ``--repeats``. Per mode and rate:

- latency p50 / p95 (arrival → the result handed back), throughput (requests / (last done − first
  arrival)); a first pass of 8 requests, not kept, warms up;
- the engine's steps: how many, rows per step (mean), busy seconds (the sum of the steps' wall
  times) and ms per step, which show how a step's time grows with its rows. When it grows in
  proportion (a CPU thread at these widths), sharing steps slows the running rows by about what it
  saves a joining one, and continuous batching behaves like processor sharing: for requests of
  similar size its median and tail latency are higher than serving batches one after another.

Prints a table, then one JSON line.

    python bench/serve_sim.py --shots 4 --profile list --rates 4,8      # ~2 min, one thread
    python bench/serve_sim.py --policy none --rates 2,3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * len(xs) + 0.5) - 1))]


def build(args):
    """The loaded model, the server's settings and the requests' bodies (chat messages)."""
    from ecache_cli.models.loader import load_model
    from ecache_cli.runs.settings import resolve_settings
    from ecache_cli.tasks import get_task

    settings = resolve_settings(args.model, {"gen_length": args.max_tokens}, {}, profile=args.profile)
    lm = load_model(args.model, device="cpu", dtype="float32")
    task = get_task(args.domain)
    prompts = [task.prompt(ex, args.shots, args.seed) for ex in task.examples("test", 64, args.seed)]
    return lm, settings, prompts


def one_pass(lm, settings, prompts, args, mode: str, rate: float, seed: int, n: int) -> dict:
    """``n`` requests at ``rate``/s through a fresh scheduler in ``mode``; the measures (module docstring)."""
    from ecache_cli.serve.metrics import ServeMetrics
    from ecache_cli.serve.protocol import ChatRequest, Limits, Resolver, parse
    from ecache_cli.serve.scheduler import Scheduler

    sched = Scheduler(lm, ServeMetrics(), args.max_batch, 100000, mode)
    resolver = Resolver(sched.engine, lm, settings, Limits(max_prompt_tokens=4096, model_name=args.model))
    steps: list[tuple[float, int]] = []  # (seconds, rows) per engine step
    done_at: dict[int, float] = {}  # id(job) -> when its result was handed back
    all_done = threading.Event()
    step, finish = sched._step, sched._finish

    def timed_step(group) -> None:
        rows = int(group.run.state.batch)
        t0 = time.perf_counter()
        step(group)
        steps.append((time.perf_counter() - t0, rows))

    def timed_finish(job, *a, **k) -> None:
        finish(job, *a, **k)
        done_at.setdefault(id(job), time.monotonic())
        if len(done_at) == n:
            all_done.set()

    sched._step, sched._finish = timed_step, timed_finish
    sched.start()
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        time.sleep(rng.expovariate(rate))
        messages = [{"role": "user", "content": prompts[i % len(prompts)]}]
        req = parse(ChatRequest, {"model": args.model, "messages": messages, "max_tokens": args.max_tokens,
                                  "temperature": 0, "policy": args.policy})
        job = resolver.job(req, "chat", resolver.chat_ids(req))
        jobs.append(job)
        sched.submit(job)
    all_done.wait()
    sched.stop()
    lat = [done_at[id(j)] - j.arrived for j in jobs]
    span = max(done_at.values()) - min(j.arrived for j in jobs)
    busy = sum(s for s, _ in steps)
    return {"mode": mode, "rate": rate, "p50": pct(lat, 0.5), "p95": pct(lat, 0.95), "throughput": n / span,
            "steps": len(steps), "rows_per_step": statistics.mean(r for _, r in steps), "busy_s": busy,
            "ms_per_step": 1000 * busy / len(steps)}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``error: <message>`` on stderr, exit 2 (no usage block)."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


def parse(argv=None) -> argparse.Namespace:
    """The options, checked (one-line error and exit 2 for a bad value, before the model loads);
    ``rates`` comes back as a list of floats."""
    ap = _Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--profile", default=None, help="the server's profile (default: the model's default profile)")
    ap.add_argument("--policy", default="entropy", help="the requests' cache policy (default entropy)")
    ap.add_argument("--domain", default="list", help="task domain of the prompts (default list)")
    ap.add_argument("--shots", type=int, default=4, help="solved examples before each prompt (default 4)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    ap.add_argument("--rates", default="4,8", help="arrival rates, requests/s (default 4,8)")
    ap.add_argument("--n", type=int, default=40, help="requests per pass (default 40)")
    ap.add_argument("--repeats", type=int, default=2, help="passes per mode and rate, order alternating (default 2)")
    ap.add_argument("--max-batch", type=int, default=16, help="the server's --max-batch (default 16)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--seed", type=int, default=1, help="prompt sample and arrival schedule (default 1)")
    args = ap.parse_args(argv)
    try:
        args.rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        ap.error(f"--rates {args.rates!r} is not a list of numbers; give requests/s, e.g. --rates 4,8")
    if not all(r > 0 for r in args.rates):
        ap.error(f"--rates {','.join(f'{r:g}' for r in args.rates)}: every rate must be > 0 requests/s")
    from ecache_cli.cache import POLICIES

    if args.policy not in POLICIES:
        ap.error(f"--policy {args.policy!r} is not a cache policy; use one of {', '.join(POLICIES)}")
    for name, low in (("n", 2), ("repeats", 1), ("max_batch", 1), ("threads", 1), ("max_tokens", 1), ("shots", 0)):
        if getattr(args, name) < low:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be ≥ {low}")
    return args


def main() -> None:
    args = parse()
    rates = args.rates
    import torch

    from ecache_cli.errors import EcacheError

    torch.set_num_threads(args.threads)
    try:
        lm, settings, prompts = build(args)
    except EcacheError as e:
        print(f"serve_sim.py: {e}", file=sys.stderr)
        sys.exit(2)
    t_start = time.time()
    one_pass(lm, settings, prompts, args, "static", rates[0], args.seed, min(args.n, 8))  # warm-up, not kept
    rows = []
    for i, rate in enumerate(rates):
        for rep in range(args.repeats):
            for mode in ("static", "continuous") if rep % 2 == 0 else ("continuous", "static"):
                r = one_pass(lm, settings, prompts, args, mode, rate, args.seed * 1000 + i, args.n)
                r["repeat"] = rep
                rows.append(r)
                print(f"{mode:>10} rate {rate:g}/s pass {rep}: p50 {r['p50']:.3f} s, p95 {r['p95']:.3f} s, "
                      f"{r['throughput']:.2f} req/s, {r['steps']} steps, {r['rows_per_step']:.2f} rows/step, "
                      f"{r['ms_per_step']:.2f} ms/step", file=sys.stderr, flush=True)
    print(f"\n{'batching':>10} {'rate/s':>6} {'pass':>4} {'p50 s':>6} {'p95 s':>6} {'req/s':>6} {'steps':>5} "
          f"{'rows':>5} {'busy s':>6} {'ms/step':>7}")
    for r in rows:
        print(f"{r['mode']:>10} {r['rate']:6g} {r['repeat']:4d} {r['p50']:6.3f} {r['p95']:6.3f} {r['throughput']:6.2f} "
              f"{r['steps']:5d} {r['rows_per_step']:5.2f} {r['busy_s']:6.2f} {r['ms_per_step']:7.2f}")
    print(json.dumps({"bench": "serve_sim", "date": time.strftime("%Y-%m-%d"), "model": args.model,
                      "profile": args.profile, "policy": args.policy, "domain": args.domain, "shots": args.shots,
                      "max_tokens": args.max_tokens, "n": args.n, "threads": args.threads,
                      "max_batch": args.max_batch, "wall_s": time.time() - t_start, "rows": rows}))


if __name__ == "__main__":
    main()
