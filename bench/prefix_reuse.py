"""Prefix reuse across requests (``ecache serve --prefix-cache``) side by side with no reuse, inside one
process: the engine thread of ``ecache serve`` (``serve/scheduler.py``) fed the same requests twice per
repeat, once with a prefix store and once without, in alternating order.

Workloads (each request a greedy chat completion built by the server's own request resolver):

- ``bidirectional``: the ``--model`` (default the embedded tiny LLaDA, ``--profile list``) on the 4-shot
  list workload of ``bench/serve_sim.py`` (``--shots 4``: the shots, chosen by the seed alone, are the
  same for every question, so every prompt starts with the same chat header and shots). Reuse is the
  approximation of docs/SERVING.md "Prefix reuse" (a shared prefix's keys and values come from the
  first request's canvas and stay frozen), so the answers are compared with no reuse: the share of
  identical answers and the token agreement (answer positions holding the same token, over the longer
  answer of each pair).
  Two rules side by side: ``frozen`` (the server's: reused positions are never recomputed) and ``first``
  (only a request's first forward skips them; its later refreshes recompute them in its own canvas).
  A third row, ``ceiling``, bounds what any reuse can give here: ``frozen`` with a store that an untimed
  pass of the same requests filled, so every prompt finds all of itself but its last partial chunk
  (as if each question had been asked before). Not a target row.
- ``block``: a random-weight SDAR-shaped model of the tiny model's size (``models/synthetic.py``, block
  length 4, its character tokenizer), same prompts. Reuse is exact there: the answers must be identical.
  Rows ``frozen`` and ``ceiling``.

All ``--n`` requests are queued at once (``--admission always``, ``--max-batch`` rows), so throughput
is requests over the seconds from the first submission to the last answer. The first ``--max-batch``
requests are admitted together: the first computes the shots, the others join its run after its first
step, which stored them, and reuse them; the later ones join as rows finish and reuse the shots.
Columns: ``speedup`` the throughput ratio (wall time without over with reuse), ``busy`` the ratio of the
engine steps' summed seconds, ``cpu`` the ratio of the process's CPU seconds over the pass (less
moved than wall time by other processes' load), ``work`` the ratio of positions the steps computed (independent of the
machine's load: on a shared machine the times of two passes of one setting can differ by more than the
effect), ``identical`` / ``tokens`` the answers against no reuse, ``hit rate`` reused over prompt tokens.
Prints a table, the target (throughput ≥ 1.3× at ≥ 99% identical answers on the 4-shot workload), then
one JSON line.

    python bench/prefix_reuse.py                          # both workloads, 32 requests, 2 repeats
    python bench/prefix_reuse.py --n 16 --repeats 1       # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_args import OneLineParser, check_at_least, require_serve_extra  # noqa: E402  (bench/, the script's folder)

#: The target on the 4-shot workload (docs issue 53, part 5).
TARGET_SPEEDUP, TARGET_IDENTICAL = 1.3, 0.99


def prompts(args) -> list[str]:
    """The 4-shot list prompts (``--shots`` shared examples, then each question)."""
    from ecache_cli.tasks import get_task

    task = get_task("list")
    return [task.prompt(ex, args.shots, args.seed) for ex in task.examples("test", args.n, args.seed)]


def block_model(out: Path) -> Path:
    """A random-weight SDAR checkpoint of the embedded tiny model's shape in ``out``."""
    from ecache_cli.models.synthetic import write_random_checkpoint

    return write_random_checkpoint(out / "sdar", "sdar", seed=0, d_model=128, n_layers=4, n_heads=4,
                                   n_kv_heads=4, mlp_hidden=384)


def one_pass(lm, settings, texts: list[str], args, rule: str, store=None) -> dict:
    """Every request of ``texts`` queued at once through a fresh scheduler, without a prefix store
    (``rule`` ``off``) or with one, reused positions frozen for the whole request (``frozen``) or
    skipped by the first forward only (``first``); ``ceiling``: ``frozen`` with a store that an untimed
    pass of the same requests filled, so each prompt finds itself (all but its last partial chunk): the
    most any prefix reuse can save on these requests. Returns the wall seconds, each answer's text and
    token ids, the store's counts over the timed pass."""
    from ecache_cli.prefixstore import PrefixStore
    from ecache_cli.serve.handling import ServeOptions
    from ecache_cli.serve.metrics import ServeMetrics
    from ecache_cli.serve.protocol import ChatRequest, Limits, Resolver, parse
    from ecache_cli.serve.scheduler import Scheduler

    if rule != "off" and store is None:
        store = PrefixStore(ServeOptions.prefix_chunk, args.prefix_cache_mb << 20)
    if rule == "ceiling":
        one_pass(lm, settings, texts, args, "frozen", store)
    before = (store.stats.reused_tokens, store.stats.prompt_tokens) if store is not None else (0, 0)
    sched = Scheduler(lm, ServeMetrics(), args.max_batch, 100000, "always", prefix=store)
    sched.prefix_frozen = rule != "first"
    resolver = Resolver(sched.engine, lm, settings, Limits(max_prompt_tokens=4096, model_name="m"))

    def request(i: int, text: str):
        req = parse(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": text}],
                                  "max_tokens": args.max_tokens, "temperature": 0, "seed": i})
        job = resolver.job(req, "chat", resolver.chat_ids(req))
        update = job.update

        def record(ids, *a):  # the answer's final token ids, as the scheduler reads them
            job.ids = list(ids)
            update(ids, *a)

        job.update, job.ids = record, []
        return job

    jobs = [request(i, t) for i, t in enumerate(texts)]
    work = [0.0, 0.0]  # positions computed and busy seconds of the steps after the warm-up
    observe = sched._observe

    def counted(seconds, rows, positions, *a, **k):
        if sched.ready.is_set():
            work[0] += positions
            work[1] += seconds
        observe(seconds, rows, positions, *a, **k)

    sched._observe = counted
    sched.start([request(i, texts[i]) for i in range(min(4, args.max_batch, len(texts)))])  # as the server
    sched.ready.wait()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for job in jobs:
        sched.submit(job)
    while not all(j.done for j in jobs):
        time.sleep(0.002)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    sched.stop()
    st = store.stats if store is not None else None
    return {"seconds": seconds, "cpu_s": cpu, "positions": work[0], "busy_s": work[1],
            "texts": [j.text for j in jobs],
            "ids": [j.ids[:j.n_answer] for j in jobs],
            "hit_rate": (st.reused_tokens - before[0]) / max(st.prompt_tokens - before[1], 1) if st else 0.0,
            "store_mb": store.bytes / 2**20 if store is not None else 0.0,
            "prompt_tokens": statistics.mean(len(j.prompt_ids) for j in jobs)}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Answer positions holding the same token, over the longer answer of each pair, all pairs together."""
    same = sum(sum(x == y for x, y in zip(p, q)) for p, q in zip(a, b))
    return same / max(sum(max(len(p), len(q)) for p, q in zip(a, b)), 1)


def workload(name: str, lm, settings, texts: list[str], args, rules: list[str]) -> list[dict]:
    """The passes of one workload (no reuse and each of ``rules``, the order rotating over ``--repeats``)
    and its rows of the table, one per rule against no reuse."""
    order = ["off"] + rules
    times, busy, cpu, last = {r: [] for r in order}, {r: [] for r in order}, {r: [] for r in order}, {}
    for rep in range(args.repeats):
        for rule in order[rep % len(order):] + order[:rep % len(order)]:
            r = one_pass(lm, settings, texts, args, rule)
            times[rule].append(r["seconds"])
            busy[rule].append(r["busy_s"])
            cpu[rule].append(r["cpu_s"])
            last[rule] = r
            print(f"{name:>13} {rule:>6} pass {rep}: {r['seconds']:.2f} s, steps' busy {r['busy_s']:.2f} s, "
                  f"CPU {r['cpu_s']:.2f} s, "
                  f"{r['positions']:.0f} positions computed", file=sys.stderr, flush=True)
    base, off = last["off"], statistics.median(times["off"])
    rows = []
    for rule in rules:
        got, on = last[rule], statistics.median(times[rule])
        same = sum(x == y for x, y in zip(base["texts"], got["texts"])) / len(texts)
        rows.append({"workload": name, "rule": rule, "n": len(texts), "prompt_tokens": got["prompt_tokens"],
                     "s_off": off, "s_on": on, "req_s_off": len(texts) / off, "req_s_on": len(texts) / on,
                     "speedup": off / on, "identical": same,
                     "busy_speedup": statistics.median(busy["off"]) / statistics.median(busy[rule]),
                     "cpu_speedup": statistics.median(cpu["off"]) / statistics.median(cpu[rule]),
                     "work_ratio": base["positions"] / max(got["positions"], 1.0),
                     "token_agreement": agreement(base["ids"], got["ids"]), "hit_rate": got["hit_rate"],
                     "store_mb": got["store_mb"]})
    return rows


def parse(argv=None) -> argparse.Namespace:
    """The options, checked (one-line error and exit 2 for a bad value, before any model loads)."""
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="the bidirectional workload's model (default tiny)")
    ap.add_argument("--profile", default="list", help="its profile (default list)")
    ap.add_argument("--workloads", default="bidirectional,block", help="which to run (default both)")
    ap.add_argument("--shots", type=int, default=4, help="solved examples before each question (default 4)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    ap.add_argument("--n", type=int, default=32, help="requests per pass (default 32)")
    ap.add_argument("--repeats", type=int, default=2, help="passes per setting, order alternating (default 2)")
    ap.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch (default 8)")
    ap.add_argument("--prefix-cache-mb", type=int, default=1024, help="the store's bound (default 1024)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--seed", type=int, default=1, help="prompt sample and shots (default 1)")
    args = ap.parse_args(argv)
    args.workloads = args.workloads.split(",")
    bad = [w for w in args.workloads if w not in ("bidirectional", "block")]
    if bad:
        ap.error(f"--workloads {bad[0]!r} is not a workload; use one of bidirectional, block, both (comma-separated)")
    check_at_least(ap, args, dict(n=1, repeats=1, max_batch=1, threads=1, max_tokens=1, shots=0, prefix_cache_mb=1))
    return args


def main() -> None:
    args = parse()
    require_serve_extra("prefix_reuse.py")
    import torch

    from ecache_cli.errors import EcacheError
    from ecache_cli.models.loader import load_model
    from ecache_cli.runs.settings import resolve_settings

    torch.set_num_threads(args.threads)
    t_start = time.time()
    texts = prompts(args)
    rows = []
    try:
        if "bidirectional" in args.workloads:
            settings = resolve_settings(args.model, {"gen_length": args.max_tokens}, {}, profile=args.profile)
            lm = load_model(args.model, device="cpu", dtype="float32")
            rows += workload("bidirectional", lm, settings, texts, args, ["frozen", "first", "ceiling"])
        if "block" in args.workloads:
            with tempfile.TemporaryDirectory() as tmp:
                path = str(block_model(Path(tmp)))
                settings = resolve_settings(path, {"gen_length": args.max_tokens, "block_length": 4}, {})
                lm = load_model(path, device="cpu", dtype="float32")
                rows += workload("block", lm, settings, texts, args, ["frozen", "ceiling"])  # "first": frozen's plans
    except EcacheError as e:
        print(f"prefix_reuse.py: {e}", file=sys.stderr)
        sys.exit(2)
    head = ("workload", "rule", "n", "prompt", "off s", "on s", "req/s off", "req/s on", "speedup", "busy",
            "cpu", "work", "identical", "tokens", "hit rate", "store MB")
    widths = (13, 6, 3, 6, 6, 6, 9, 8, 7, 6, 6, 6, 9, 6, 8, 8)
    print("\n" + " ".join(f"{h:>{w}}" for h, w in zip(head, widths)))
    for r in rows:
        cells = (r["workload"], r["rule"], r["n"], f"{r['prompt_tokens']:.0f}", f"{r['s_off']:.2f}",
                 f"{r['s_on']:.2f}", f"{r['req_s_off']:.2f}", f"{r['req_s_on']:.2f}", f"{r['speedup']:.2f}x",
                 f"{r['busy_speedup']:.2f}x", f"{r['cpu_speedup']:.2f}x", f"{r['work_ratio']:.2f}x",
                 f"{100 * r['identical']:.1f}%",
                 f"{100 * r['token_agreement']:.1f}%", f"{100 * r['hit_rate']:.1f}%", f"{r['store_mb']:.2f}")
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    target = {f"{r['workload']}/{r['rule']}": {"speedup": r["speedup"], "identical": r["identical"],
                              "met": r["speedup"] >= TARGET_SPEEDUP and r["identical"] >= TARGET_IDENTICAL}
              for r in rows if r["rule"] != "ceiling"}
    print("\ntarget (throughput ≥ 1.3× at ≥ 99% identical answers):", json.dumps(target))
    print(json.dumps({"bench": "prefix_reuse", "date": time.strftime("%Y-%m-%d"), "model": args.model,
                      "profile": args.profile, "shots": args.shots, "max_tokens": args.max_tokens, "n": args.n,
                      "repeats": args.repeats, "max_batch": args.max_batch, "threads": args.threads,
                      "wall_s": time.time() - t_start, "rows": rows, "target": target}))


if __name__ == "__main__":
    main()
