"""Serving load benchmark: Poisson arrivals against ``ecache serve``; the admission modes side by side,
``none`` vs ``entropy``.

For each admission mode (``--admission``: ``fcfs`` = static batching, ``always`` = every queued
request joins at the next step, ``auto`` = the step-cost model decides; ``serve/admission.py``) the
script starts ``ecache serve`` on a free loopback port (``--max-batch``, one torch thread by
default), and for each cache policy (the request's ``policy`` field) measures:

- the unloaded latency: ``--unloaded`` requests sent one at a time (median seconds);
- at every arrival rate of ``--rates`` (requests/s): ``--duration`` seconds of Poisson arrivals
  (exponential gaps, seeded), each request a streamed chat completion of a test prompt of
  ``--domains`` (``list`` by default: short answers of one block; ``arith`` answers take 2-4 blocks,
  so rows of one batch end at different steps; several domains are interleaved), ``max_tokens``
  ``--max-tokens``, greedy; throughput = requests done / (last done − first sent), generated tokens/s,
  p50/p95 latency (sent → last chunk) overall and per domain, p50/p95 time to the first streamed
  text, and the share of
  answers identical to ``none``'s answer to the same prompt (the fidelity the policy's speed costs;
  greedy answers do not depend on the batch, so ``none``'s are its answers alone), and ``joined``, the
  requests that joined rows already running (the server's ``ecache_admissions_total``: none under
  ``fcfs``, most under ``always``; under ``auto`` it shows whose schedule ``auto`` kept).

The server's EntropyCache setting is its profile's (``--profile``: the embedded model's default
profile unless given; ``--profile list`` is what a server of ``list`` prompts runs) unless ``--tau`` /
``--recent-k`` set it (requests name only the policy).

Then the targets: R* is the lowest rate at which ``fcfs``'s (static batching's) p95 latency exceeds
3× its unloaded latency (``--policy-for-batching``, default entropy); at R*, ``auto``'s p50 and p95
must be ≤ 1.05× the better of ``always``'s and ``fcfs``'s, with several domains the first domain's
(the short requests') p95 under ``auto`` ≤ 0.8× its p95 under ``fcfs``, and under ``always``
``entropy`` must serve ≥ 2× ``none``'s throughput. Prints a table and, last, one JSON line.

    python bench/serve_load.py --policies entropy --profile list --rates 2,4,8,16     # 0-shot list
    python bench/serve_load.py --policies entropy --profile list --shots 4 --rates 3,4,6,8,12   # 4-shot list
    python bench/serve_load.py --policies entropy --domains list,arith --max-tokens 128 --rates 1,2,3,4,6
    python bench/serve_load.py --rates 4,8,16 --duration 5 --admission auto
    python bench/serve_load.py --domains arith --max-tokens 128 --tau 3 --recent-k 16   # rows of mixed length
    python bench/serve_load.py --url http://127.0.0.1:8000 --modes external   # a server already running
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0-1) of xs, nearest rank; NaN for none."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * len(xs) + 0.5) - 1))]


def start_server(args, mode: str):
    """``ecache serve`` on a free loopback port; returns (process, base URL)."""
    cmd = [sys.executable, "-m", "ecache_cli", "serve", "--model", args.model, "--port", "0", "--admission", mode,
           "--max-batch", str(args.max_batch), "--max-queue", "100000", "--threads", str(args.threads),
           "--gen-length", str(args.max_tokens), *(["--profile", args.profile] if args.profile else [])]
    entropy = [*(["--tau", str(args.tau)] if args.tau is not None else []),
               *(["--recent-k", str(args.recent_k)] if args.recent_k is not None else [])]
    if entropy:  # the server's EntropyCache setting (requests name only the policy)
        cmd += ["--cache", "entropy", *entropy]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    url = None
    for line in proc.stderr:
        m = re.search(r"listening on (http://\S+?:\d+)", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        raise SystemExit(f"ecache serve did not start: {proc.wait()}")
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # drain its stderr
    return proc, url


async def one(client, url: str, model: str, prompt: str, policy: str, max_tokens: int) -> dict:
    """One streamed chat completion; returns sent time, first-text time, done time, tokens, reason."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "policy": policy}
    t0 = time.perf_counter()
    first = None
    tokens, reason, text = 0, None, []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices", []):
                if ch["delta"].get("content"):
                    text.append(ch["delta"]["content"])
                    if first is None:
                        first = time.perf_counter()
                reason = ch.get("finish_reason") or reason
    t1 = time.perf_counter()
    return {"sent": t0, "first": first if first is not None else t1, "done": t1, "tokens": tokens, "reason": reason,
            "prompt": prompt, "text": "".join(text)}


def by_domain(res: list[dict], domain_of: dict[str, str]) -> dict[str, float]:
    """p95 latency of each domain's requests (``domain_of``: prompt -> domain)."""
    out: dict[str, list[float]] = {}
    for r in res:
        out.setdefault(domain_of.get(r["prompt"], "?"), []).append(r["done"] - r["sent"])
    return {d: pct(xs, 0.95) for d, xs in out.items()}


async def unloaded(url: str, args, prompts: list[str], policy: str) -> tuple[float, dict[str, str]]:
    """The median latency of ``--unloaded`` requests sent one at a time, and their answers by prompt."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, url, args.model, prompts[0], policy, args.max_tokens)  # warm-up
        res = [await one(client, url, args.model, prompts[i % len(prompts)], policy, args.max_tokens)
               for i in range(args.unloaded)]
    return statistics.median(r["done"] - r["sent"] for r in res), {r["prompt"]: r["text"] for r in res}


def admissions(url: str) -> dict[str, float]:
    """The server's ``ecache_admissions_total`` by decision (``started``, ``joined``, ``held``), from
    /metrics; {} where the server exports none (an external server without the metric)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "ecache_admissions_total":
                out[sample.labels["decision"]] = sample.value
    return out


async def load(url: str, args, prompts: list[str], policy: str, rate: float, seed: int) -> dict:
    """``--duration`` seconds of Poisson arrivals at ``rate``/s (at least 8 requests); the measures, with
    ``joined``: the requests that joined rows already running (the server's admission counter over the
    pass: none under ``fcfs``, most under ``always``, under ``auto`` the joins its model approved)."""
    import httpx

    before = admissions(url)
    rng = random.Random(seed)
    n = max(8, round(rate * args.duration))
    gaps = [rng.expovariate(rate) for _ in range(n)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        tasks = []
        for i, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(client, url, args.model, prompts[i % len(prompts)], policy,
                                                 args.max_tokens)))
        res = await asyncio.gather(*tasks)
    after = admissions(url)
    start, end = min(r["sent"] for r in res), max(r["done"] for r in res)
    lat = [r["done"] - r["sent"] for r in res]
    ttft = [r["first"] - r["sent"] for r in res]
    return {"n": n, "throughput": n / (end - start), "tokens_per_s": sum(r["tokens"] for r in res) / (end - start),
            "p50": pct(lat, 0.5), "p95": pct(lat, 0.95), "p95_by_domain": by_domain(res, args.domain_of),
            "ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95),
            "reasons": sorted({r["reason"] for r in res}), "answers": {r["prompt"]: r["text"] for r in res},
            "joined": int(after.get("joined", 0) - before.get("joined", 0)) if after else None}


def identical_share(answers: dict[str, str], reference: dict[str, str]) -> float | None:
    """The share of ``answers`` (prompt -> text) equal to ``reference``'s answer to the same prompt (the
    reference policy's; greedy answers do not depend on what else runs in the batch); None when no
    prompt is shared."""
    shared = [p for p in answers if p in reference]
    return sum(answers[p] == reference[p] for p in shared) / len(shared) if shared else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rates", default="2,4,8,16,32", help="arrival rates, requests/s (default 2,4,8,16,32)")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds of arrivals per rate (default 6)")
    ap.add_argument("--policies", default="none,entropy")
    ap.add_argument("--admission", "--modes", dest="modes", default="fcfs,always,auto",
                    help="admission modes to start servers for (default fcfs,always,auto; static = fcfs, "
                    "continuous = always), or 'external' with --url")
    ap.add_argument("--url", default=None, help="a running server (with --modes external)")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--unloaded", type=int, default=8, help="sequential requests for the unloaded latency")
    ap.add_argument("--policy-for-batching", default="entropy", help="the policy of the static/continuous target")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--domains", default="list", help="task domains of the prompts, interleaved (default list)")
    ap.add_argument("--shots", type=int, default=0, help="solved examples before each prompt (default 0; 4 gives "
                    "the long prompts that few-shot and system-prompted traffic sends)")
    ap.add_argument("--profile", default=None, help="the server's profile (a name such as list, or a YAML file; "
                    "default: the model's default profile)")
    ap.add_argument("--tau", type=float, default=None, help="the server's EntropyCache τ (default: its profile's)")
    ap.add_argument("--recent-k", type=int, default=None, help="the server's EntropyCache recent_k (default: its "
                    "profile's)")
    args = ap.parse_args()
    from bench_args import check_domains  # bench/, the script's folder

    check_domains(ap, args.domains)

    sys.path.insert(0, str(REPO))
    from ecache_cli.tasks import get_task

    domains = args.domains.split(",")
    if args.shots < 0:
        print(f"serve_load.py: --shots must be >= 0 (solved examples per prompt), got {args.shots}", file=sys.stderr)
        sys.exit(2)
    from ecache_cli.errors import UsageError

    try:
        tasks = [get_task(d) for d in domains]
    except UsageError as e:
        print(f"serve_load.py: --domains: {e}", file=sys.stderr)
        sys.exit(2)
    per_domain = [[t.prompt(ex, args.shots, args.seed) for ex in t.examples("test", 64, args.seed)] for t in tasks]
    prompts = [p for group in zip(*per_domain) for p in group]  # one of each domain in turn
    args.domain_of = {p: d for d, group in zip(domains, per_domain) for p in group}
    rates = [float(r) for r in args.rates.split(",")]
    policies = args.policies.split(",")
    modes = [{"static": "fcfs", "continuous": "always"}.get(m, m) for m in args.modes.split(",")]
    bad = [m for m in modes if m not in ("fcfs", "always", "auto", "external")]
    if bad:
        print(f"serve_load.py: --admission {bad[0]!r} is not an admission rule; use one of fcfs, always, auto, "
              "external", file=sys.stderr)
        sys.exit(2)
    rows: list[dict] = []
    t_start = time.time()
    import httpx

    for mode in modes:
        proc, url = (None, args.url) if mode == "external" else start_server(args, mode)
        try:
            for policy in policies:
                try:
                    base, answers = asyncio.run(unloaded(url, args, prompts, policy))
                except httpx.TransportError as e:  # no server at the URL
                    print(f"serve_load.py: cannot reach {url} ({e}); start `ecache serve` or fix --url",
                          file=sys.stderr)
                    sys.exit(1)
                for i, rate in enumerate(rates):
                    m = asyncio.run(load(url, args, prompts, policy, rate, args.seed * 1000 + i))
                    row = {"mode": mode, "policy": policy, "rate": rate, "unloaded": base,
                           "unloaded_answers": answers, **m}
                    rows.append(row)
                    print(f"{mode:>10} {policy:>8} rate {rate:5g}/s: {m['throughput']:6.2f} req/s, "
                          f"p50 {m['p50']:.3f} s, "
                          f"p95 {m['p95']:.3f} s, ttft p50 {m['ttft_p50']:.3f} s (unloaded {base:.3f} s)",
                          file=sys.stderr, flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)

    reference: dict[str, str] = {}  # none's answer per prompt, from every none measurement
    for r in rows:
        if r["policy"] == "none":
            reference.update(r["unloaded_answers"])
            reference.update(r["answers"])
    for r in rows:
        r["identical"] = identical_share(r.pop("answers"), reference)
        r.pop("unloaded_answers")

    split = len(domains) > 1  # a p95 column per domain
    print(f"\n{'admission':>10} {'policy':>8} {'rate/s':>7} {'n':>4} {'req/s':>7} {'tok/s':>7} {'p50 s':>7} "
          f"{'p95 s':>7}" + "".join(f" {'p95 ' + d:>10}" for d in domains if split)
          + f" {'ttft50':>7} {'ttft95':>7} {'unl. s':>7} {'same':>5} {'joined':>6}")
    for r in rows:
        same = "-" if r["identical"] is None else f"{100 * r['identical']:.0f}%"
        per = "".join(f" {r['p95_by_domain'].get(d, float('nan')):10.3f}" for d in domains if split)
        print(f"{r['mode']:>10} {r['policy']:>8} {r['rate']:7g} {r['n']:4d} {r['throughput']:7.2f} "
              f"{r['tokens_per_s']:7.1f} {r['p50']:7.3f} {r['p95']:7.3f}{per} {r['ttft_p50']:7.3f} "
              f"{r['ttft_p95']:7.3f} {r['unloaded']:7.3f} {same:>5} {'-' if r['joined'] is None else r['joined']:>6}")

    def at(mode, policy, rate):
        return next((r for r in rows if r["mode"] == mode and r["policy"] == policy and r["rate"] == rate), None)

    targets: dict = {}
    pol = args.policy_for_batching
    static = [r for r in rows if r["mode"] == "fcfs" and r["policy"] == pol]
    r_star = next((r["rate"] for r in static if r["p95"] > 3 * r["unloaded"]), None)
    targets["r_star"] = r_star
    if r_star is not None:
        s, c, a = at("fcfs", pol, r_star), at("always", pol, r_star), at("auto", pol, r_star)
        if c is not None:
            targets["always_p95_over_fcfs"] = c["p95"] / s["p95"]
            targets["always_throughput_over_fcfs"] = c["throughput"] / s["throughput"]
        if a is not None and c is not None:
            for k in ("p50", "p95"):
                targets[f"auto_{k}_over_best"] = a[k] / min(s[k], c[k])
            met = targets["auto_p50_over_best"] <= 1.05 and targets["auto_p95_over_best"] <= 1.05
            if len(domains) > 1:
                short = domains[0]
                targets["auto_short_p95_over_fcfs"] = a["p95_by_domain"][short] / s["p95_by_domain"][short]
                met = met and targets["auto_short_p95_over_fcfs"] <= 0.8
            targets["admission_met"] = met
        e, n_ = at("always", "entropy", r_star), at("always", "none", r_star)
        if e is not None and n_ is not None:
            targets["entropy_throughput_over_none"] = e["throughput"] / n_["throughput"]
            targets["entropy_met"] = e["throughput"] >= 2 * n_["throughput"]
    print("\ntargets:", json.dumps(targets))
    from ecache_cli.runs.manifest import cpu_name

    print(json.dumps({"bench": "serve_load", "date": datetime.date.today().isoformat(), "machine": platform.machine(),
                      "cpu": cpu_name(), "threads": args.threads, "model": args.model, "max_batch": args.max_batch,
                      "max_tokens": args.max_tokens, "duration_s": args.duration, "domains": domains,
                      "shots": args.shots,
                      "profile": args.profile, "tau": args.tau, "recent_k": args.recent_k,
                      "wall_s": time.time() - t_start, "rows": rows, "targets": targets}))


if __name__ == "__main__":
    main()
