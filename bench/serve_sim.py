"""The admission modes inside one process: the engine thread of ``ecache serve`` fed Poisson arrivals
directly, without HTTP.

``bench/serve_load.py`` measures the server as a client sees it, HTTP, SSE and the client's own CPU
time included. This bench keeps only the scheduler and the engine (``serve/scheduler.py``), so that a
difference between the admission modes (``--admission``: ``always``, ``fcfs`` = static batching,
``auto``; ``serve/admission.py``) is the scheduling's: each request is a greedy chat completion of a
test prompt of ``--domains`` (interleaved; ``list,arith`` with ``--max-tokens 128`` gives answers of
one to four blocks), built by the server's own request resolver with the server's settings
(``--profile``), and submitted on a seeded Poisson schedule; every mode gets the same schedule, in
rotating order over ``--repeats``. Per mode and rate:

- latency p50 / p95 (arrival → the result handed back), and p95 per domain (the first domain's
  requests are the short ones of a mixed workload), throughput (requests / (last done − first
  arrival)); each scheduler warms up as the server does, and a first pass of 8 requests, not kept,
  warms the process;
- the engine's steps: how many, rows per step (mean), busy seconds (the sum of the steps' wall
  times) and ms per step, which show how a step's time grows with its rows. When it grows in
  proportion (a CPU thread at these widths), sharing steps slows the running rows by about what it
  saves a joining one, and continuous batching behaves like processor sharing: for requests of
  similar size its median and tail latency are higher than serving batches one after another.

- ``two_forward``: the share of steps that ran two model forwards or more (counted by a forward pre-hook
  on the model): with ``entropy``, the steps where some rows refresh and others do not (a joining row's
  first step is a refresh), run as a partial forward plus a full forward of the refreshing rows unless
  ``--merge-refresh`` (``engine/forward.py``'s ``MERGE_REFRESH``: one forward) — a clock-free count of
  what continuous batching adds to a step;
- ``joined``: requests that joined rows already running (``fcfs``: none; ``always``: most; ``auto``: the
  joins its model approved), so a mode's schedule can be told from another's apart from the clock;
- the step-cost model ``auto`` fitted (``base``, ``per_row``, ``per_position`` seconds).

With ``--repeats`` > 1 the run also reports, per mode, the slowest over the fastest of its passes' p50
and p95 (``spread``): the passes of one mode get the same requests on the same schedule, so this is the
machine's noise, the resolution a comparison of the modes has in this run. ``--schedules`` K > 1 serves
K seeded Poisson schedules per rate (each with the prompts rotated on by ``--n``; every mode serves each):
one schedule of 60 requests is one draw of the arrivals, whose p95 is its 3rd-largest latency, and which
mode is better on it can be that draw's. The targets read each mode's latencies pooled over all its
passes, and the run reports the targets of each schedule alone beside them (``by_schedule``).

``--clock`` (the clock every time is read on: arrivals, latencies, step times, the step-cost model
``auto`` fits, timeouts; ``Scheduler(clock=...)``). ``wall`` (default): the engine thread serves as the
server's does, fed by a thread that sleeps the Poisson gaps, on ``time.monotonic``; on a shared machine
another process that preempts the engine thread, or slows the core it shares, moves the passes apart
(passes of one mode differ by 14-39 % in p50 at a load of 1.5-2 on 2 cores). ``cpu``: a discrete-event
run on one torch thread, on the CPU seconds of the thread that runs the steps (``time.thread_time``): a
request is submitted, with its seeded arrival time as ``arrived``, at the first turn of the scheduler's
loop (``Scheduler.iterate``, called here instead of its thread) that finds the clock past it; an idle
engine's clock jumps to the next arrival; a latency is virtual finish minus virtual arrival, and the
scheduler's own decisions count, as they would on a dedicated core. The passes of a rate (every mode,
every repeat) run together, the one whose clock is furthest behind taking the next turn, so that the
core's speed, which moves with what the other processes do to the caches and memory it shares, meets
them all at once (passes of one mode within 0.5-3 % of each other at the same load). It reads the
latency a request would see on a dedicated core of this machine, the quantity the targets are about.

A rate given as ``<f>x`` (``--rates 0.6x,0.9x``) is that fraction of the static capacity measured first:
``--max-batch`` requests queued before a ``fcfs`` scheduler starts, so that they run as one full batch;
their count over the time from ready to the last one done (requests/s). ``--size 1b`` (or ``tiny``)
serves a random-weight LLaDA-shaped checkpoint of ``bench/gpu_speed.py``'s ``SIZES`` instead of
``--model``, written as the other GPU benches write theirs (``write_random_checkpoint``, bfloat16, scale
4) but with the embedded model's tokenizer, so that the same prompts encode to the same tokens (its
vocabulary at least the tokenizer's); its settings are the defaults (no profile: ``--profile`` names
one), and its answers are random, so every request runs to ``--max-tokens`` unless it samples an end
marker. With ``--size`` the run also reports the ratio of continuous (``always``) to static (``fcfs``)
batching's p95 at each rate (``gpu_expectation``): on a GPU, whose step time grows sub-linearly with
its rows, it is expected to be ≤ 0.6 near capacity (``bench/gpu_check.sh`` step 8).

``--unloaded`` (``--clock cpu``) first serves schedule 0's requests one at a time and reports, at each
rate, static batching's pooled p95 over their p50 and p95 (``load``: how loaded the rate is;
``bench/serve_load.py``'s R* is the lowest rate where the first exceeds 3). A fixed rate is a heavier
load on a machine that runs slower, and on the CPU clock a core slowed by another process's use of the
caches and memory it shares runs slower too: static batching's p95 at 3 requests/s of mixed lengths was
0.43 s on a quiet machine (4.0× the unloaded p50) and 1.22 s in a run beside the test suite.

The targets, per rate: ``auto``'s p50 and p95 ≤ 1.05× the better of ``always`` and ``fcfs`` (each
mode's latencies pooled over its passes), and with several domains the first domain's p95 under ``auto`` ≤ 0.8× its
p95 under ``fcfs``. Prints a table, the targets, then one JSON line.

    python bench/serve_sim.py --shots 0 --profile list --rates 8          # 0-shot list
    python bench/serve_sim.py --shots 4 --profile list --rates 4,8        # 4-shot list, ~3 min, one thread
    python bench/serve_sim.py --shots 0 --domains list,arith --max-tokens 128 --rates 3   # mixed lengths
    python bench/serve_sim.py --clock cpu --shots 0 --profile list --rates 8 --n 60 --repeats 3   # no preemption
    python bench/serve_sim.py --clock cpu --shots 0 --profile list --rates 8 --n 60 --repeats 1 --schedules 6
    python bench/serve_sim.py --clock cpu --shots 0 --domains list,arith --max-tokens 128 --rates 2,3,4,5,6 --n 60 \
        --repeats 1 --schedules 6 --unloaded   # a sweep of the load
    python bench/serve_sim.py --size 1b --device cuda --dtype bfloat16 --rates 0.6x,0.9x --n 24 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_args import OneLineParser, check_at_least, check_domains, require_serve_extra  # noqa: E402  (bench/, the script's folder)


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * len(xs) + 0.5) - 1))]


def random_checkpoint(size: str, out: Path) -> Path:
    """A random-weight LLaDA-shaped checkpoint of ``bench/gpu_speed.py``'s ``SIZES[size]`` written in
    ``out`` (``llada-<size>-random``, stored in bfloat16, init scale 4: as the other GPU benches write
    theirs), with the embedded model's tokenizer in place of the character one, so the prompts encode to
    the same tokens as on the embedded model; the vocabulary is at least the embedded model's."""
    import torch
    from gpu_speed import SIZES

    from ecache_cli.models.loader import embedded_dir
    from ecache_cli.models.synthetic import write_random_checkpoint

    emb = embedded_dir()
    shape = dict(SIZES[size])
    shape["vocab_size"] = max(shape["vocab_size"], json.loads((emb / "config.json").read_text())["vocab_size"])
    ckpt = write_random_checkpoint(out / f"llada-{size}-random", "llada", seed=0, scale=4.0, dtype=torch.bfloat16,
                                   **shape)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):  # the same special ids
        shutil.copy(emb / name, ckpt / name)
    return ckpt


def build(args, work: Path | None = None):
    """The loaded model, the server's settings and the requests' (domain, prompt), domains interleaved.
    With ``args.size`` the model is :func:`random_checkpoint` written under ``work`` (default: a new
    temporary folder) and ``args.model`` becomes its path (the name the requests give)."""
    from ecache_cli.errors import EcacheError
    from ecache_cli.models.loader import load_model
    from ecache_cli.runs.settings import resolve_settings
    from ecache_cli.tasks import get_task

    if args.size is not None:
        args.model = str(random_checkpoint(args.size, work or Path(tempfile.mkdtemp(prefix="ecache-serve-sim-"))))
    try:  # --max-tokens is the server's --gen-length here: a refusal names it as this script's flag
        settings = resolve_settings(args.model, {"gen_length": args.max_tokens}, {}, profile=args.profile)
    except EcacheError as e:
        raise type(e)(f"--max-tokens {args.max_tokens} (the server's --gen-length): {e}") from None
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    per_domain = []
    for name in args.domains:
        task = get_task(name)
        examples = task.examples("test", 64, args.seed)
        per_domain.append([(name, task.prompt(ex, args.shots, args.seed)) for ex in examples])
    return lm, settings, [p for group in zip(*per_domain) for p in group]


class CpuClock:
    """Seconds of a virtual clock: the CPU time (``time.thread_time``) its thread spent while the clock
    ran (from :meth:`resume` to :meth:`pause`), plus the idle gaps :meth:`skip_to` jumped. Time the
    thread is preempted by other processes, or spends on another pass's scheduler, does not pass on it,
    so on one torch thread it reads what a dedicated core would take."""

    def __init__(self):
        self.base, self._since = 0.0, None

    def __call__(self) -> float:
        return self.base + (time.thread_time() - self._since if self._since is not None else 0.0)

    def resume(self) -> None:
        self._since = time.thread_time()

    def pause(self) -> None:
        self.base, self._since = self(), None

    def skip_to(self, t: float) -> None:
        """Move the clock on to ``t`` (an idle engine waiting for the next arrival); never back."""
        self.base += max(t - self(), 0.0)


def forward_counter(model) -> list[int]:
    """[calls]: the model's forward calls so far, counted by one forward pre-hook per model."""
    found = model.__dict__.get("_serve_sim_calls")
    if found is None:
        found = model.__dict__["_serve_sim_calls"] = [0]
        model.register_forward_pre_hook(lambda m, a: found.__setitem__(0, found[0] + 1))
    return found


def check_requests(lm, settings, prompts, args) -> None:
    """Resolve the request of every prompt as the passes will (the server's own resolver), so that one the
    server would refuse (``--policy`` a family does not take, ``--shots`` or ``--max-tokens`` past the
    model's positions) ends the run with one line, exit 2, before any pass."""
    from ecache_cli.serve.protocol import ApiError

    i = 0
    try:
        p = Pass(lm, settings, prompts, args, "fcfs", len(prompts), time.monotonic)  # its warm-up: the first few
        for i in range(len(prompts)):
            p.request(i)
    except ApiError as e:
        # the passes' prompt limit is fixed (Pass), not a flag of this script's: its fix is fewer shots
        why = e.message.replace(" (--max-prompt-tokens)", "; use fewer --shots")
        print(f"serve_sim.py: a request of --domains {prompts[i][0]} (--shots {args.shots}, --max-tokens "
              f"{args.max_tokens}, --policy {args.policy}) is one the server refuses: {why}", file=sys.stderr)
        sys.exit(2)


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """``n`` seeded Poisson arrival times at ``rate``/s, seconds from the start (the gaps a wall-clock
    pass sleeps)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


class Pass:
    """One pass: ``n`` requests (``prompts`` in turn) through a fresh scheduler in ``mode`` on ``clock``
    (a :class:`CpuClock`, or ``time.monotonic``), each step and each result timed on it; :meth:`result`
    gives its measures (module docstring)."""

    def __init__(self, lm, settings, prompts, args, mode: str, n: int, clock, offset: int = 0):
        from ecache_cli.serve.metrics import ServeMetrics
        from ecache_cli.serve.protocol import ChatRequest, Limits, Resolver, parse
        from ecache_cli.serve.scheduler import Scheduler

        self.mode, self.n, self.clock = mode, n, clock
        self.domains = [prompts[(offset + i) % len(prompts)][0] for i in range(n)]  # request i's domain
        self.sched = sched = Scheduler(lm, ServeMetrics(), args.max_batch, 100000, mode, clock=clock)
        resolver = Resolver(sched.engine, lm, settings, Limits(max_prompt_tokens=4096, model_name=args.model))

        def request(i: int):
            messages = [{"role": "user", "content": prompts[(offset + i) % len(prompts)][1]}]
            req = parse(ChatRequest, {"model": args.model, "messages": messages, "max_tokens": args.max_tokens,
                                      "temperature": 0, "policy": args.policy, "seed": i})
            return resolver.job(req, "chat", resolver.chat_ids(req))

        self.request = request
        self.warmup = [request(i) for i in range(min(4, args.max_batch))]  # as the server
        self.jobs: list = []  # in request order
        self.steps: list[tuple[float, int]] = []  # (seconds, rows) per engine step
        self.forwards: list[int] = []  # model forwards per engine step
        calls = forward_counter(lm.model)
        self.done_at: dict[int, float] = {}  # id(job) -> when its result was handed back
        self.all_done = threading.Event()
        step, finish = sched._step, sched._finish

        def timed_step(group) -> None:
            rows = int(group.run.state.batch)
            t0, c0 = clock(), calls[0]
            step(group)
            if group in sched._groups:  # a step ran (a call that finds the run ended removes its group)
                self.steps.append((clock() - t0, rows))
                self.forwards.append(calls[0] - c0)

        def timed_finish(job, *a, **k) -> None:
            finish(job, *a, **k)
            self.done_at.setdefault(id(job), clock())
            if len(self.done_at) == n:
                self.all_done.set()

        sched._step, sched._finish = timed_step, timed_finish
        # every step the step-cost model was given, the warm-up's included (--steps-log)
        self.observed: list[list] = []
        observe = sched.cost.observe

        def logged_observe(seconds, rows, positions, group=None, joins=0.0, mixed=False) -> None:
            self.observed.append([seconds, rows, positions, bool(mixed), joins])
            observe(seconds, rows, positions, group, joins, mixed)

        sched.cost.observe = logged_observe

    def result(self, rate: float) -> dict:
        """The pass's measures at ``rate`` (module docstring)."""
        sched, jobs, n = self.sched, self.jobs, self.n
        # requests that joined rows already running (fcfs: none; always: most; auto: the joins its model approved)
        joined = sched.metrics.registry.get_sample_value("ecache_admissions_total", {"decision": "joined"}) or 0.0
        lat = [self.done_at[id(j)] - j.arrived for j in jobs]
        span = max(self.done_at.values()) - min(j.arrived for j in jobs)
        busy = sum(s for s, _ in self.steps)
        by_domain = {d: pct([x for x, dom in zip(lat, self.domains) if dom == d], 0.95)
                     for d in dict.fromkeys(self.domains)}
        return {"mode": self.mode, "rate": rate, "p50": pct(lat, 0.5), "p95": pct(lat, 0.95),
                "p95_by_domain": by_domain, "throughput": n / span, "steps": len(self.steps),
                "rows_per_step": statistics.mean(r for _, r in self.steps), "busy_s": busy,
                "ms_per_step": 1000 * busy / len(self.steps), "joined_running": int(joined),
                "two_forward": sum(f >= 2 for f in self.forwards) / len(self.forwards),
                "cost": {"base": sched.cost.base, "per_row": sched.cost.per_row,
                         "per_position": sched.cost.per_position},
                "observed": self.observed, "latencies": list(zip(lat, self.domains))}


def drive(passes: list[Pass], times: list[float]) -> None:
    """Serve the passes on the calling thread, a discrete-event run on each pass's :class:`CpuClock`.
    Each pass warms up (``Scheduler.prepare``) and builds its requests (not on its clock), then the pass
    whose clock is furthest behind takes its next turn: its requests whose arrival time (``times``,
    seconds after its warm-up) the clock has passed are submitted with that time as ``arrived``, and its
    loop runs once (``Scheduler.iterate``); an idle pass moves its clock on to its next arrival. The
    passes advance together, so a drift in the machine's speed (other processes' use of the caches and
    memory the core shares) meets them all at about the same virtual time. Returns when every request
    has been served."""
    import torch

    with torch.inference_mode():
        live = []
        for p in passes:
            p.clock.resume()
            p.sched.prepare(p.warmup)
            p.clock.pause()
            p.jobs = [p.request(i) for i in range(len(times))]
            live.append((p, p.clock(), list(zip(times, p.jobs))[::-1]))  # pending: the next arrival last
        while live:
            p, start, pending = entry = min(live, key=lambda e: e[0].clock())
            p.clock.resume()
            while pending and start + pending[-1][0] <= p.clock():
                t, job = pending.pop()
                job.arrived = start + t
                p.sched.submit(job)
            if not p.sched.iterate():
                if pending:
                    p.clock.skip_to(start + pending[-1][0])
                else:
                    live.remove(entry)
            p.clock.pause()


def serve_wall(p: Pass, rate: float, seed: int, burst: bool) -> None:
    """Serve ``p`` on the wall clock: its engine thread runs as the server's, fed from this thread, which
    sleeps the seeded Poisson gaps between requests (``burst``: all queued before the scheduler starts,
    arriving when it is ready)."""
    sched = p.sched
    p.jobs = [p.request(i) for i in range(p.n)] if burst else []
    for job in p.jobs:
        sched.submit(job)
    sched.start(p.warmup)
    sched.ready.wait()
    ready = time.monotonic()
    for job in p.jobs:
        job.arrived = ready
    rng = random.Random(seed)
    for i in range(0 if burst else p.n):
        time.sleep(rng.expovariate(rate))
        job = p.request(i)
        job.arrived = time.monotonic()
        p.jobs.append(job)
        sched.submit(job)
    p.all_done.wait()
    sched.stop()


def passes_at(lm, settings, prompts, args, modes: list[str], rate: float, seed: int, n: int,
              burst: bool = False, times: list[float] | None = None, offset: int = 0) -> list[dict]:
    """One pass per entry of ``modes`` (a mode may repeat), ``n`` requests at ``rate``/s on the seeded
    Poisson schedule of ``seed`` (``times``: these arrival times instead, seconds after ready), request
    ``i`` asking ``prompts[(offset + i) % len(prompts)]``; their measures (:meth:`Pass.result`), in order.
    ``burst``: the ``n`` requests arrive together when the scheduler is ready (its first batch takes
    ``max_batch`` of them at once; ``rate`` unused).
    ``args.clock`` ``wall``: the passes one after another, each served by its engine thread as the
    real time passes; ``cpu``: all of them together on this thread, by :func:`drive`."""
    if args.clock == "cpu":
        passes = [Pass(lm, settings, prompts, args, mode, n, CpuClock(), offset) for mode in modes]
        drive(passes, [0.0] * n if burst else times if times is not None else arrival_times(n, rate, seed))
    else:
        passes = []
        for mode in modes:
            passes.append(Pass(lm, settings, prompts, args, mode, n, time.monotonic, offset))
            serve_wall(passes[-1], rate, seed, burst)
    return [p.result(rate) for p in passes]


def one_pass(lm, settings, prompts, args, mode: str, rate: float, seed: int, n: int, burst: bool = False,
             times: list[float] | None = None, offset: int = 0) -> dict:
    """The measures of one pass of ``mode`` (:func:`passes_at`)."""
    return passes_at(lm, settings, prompts, args, [mode], rate, seed, n, burst, times, offset)[0]


def parse(argv=None) -> argparse.Namespace:
    """The options, checked (one-line error and exit 2 for a bad value, before the model loads);
    ``rates`` comes back as a list of (value, True when a fraction of the measured capacity)."""
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="a model name or folder (default tiny; ignored with --size)")
    ap.add_argument("--size", default=None, help="serve a random-weight LLaDA-shaped checkpoint of "
                    "bench/gpu_speed.py's SIZES (1b, tiny) instead of --model (module docstring)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    ap.add_argument("--dtype", default="float32", help="the weights' dtype (default float32)")
    ap.add_argument("--profile", default=None, help="the server's profile (default: the model's default profile)")
    ap.add_argument("--policy", default="entropy", help="the requests' cache policy (default entropy)")
    ap.add_argument("--domains", default="list", help="task domains of the prompts, interleaved (default list)")
    ap.add_argument("--admission", default="always,fcfs,auto", help="admission modes to compare (default "
                    "always,fcfs,auto; fcfs is static batching)")
    ap.add_argument("--shots", type=int, default=4, help="solved examples before each prompt (default 4)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    ap.add_argument("--rates", default="4,8", help="arrival rates, requests/s, or <f>x: that fraction of the "
                    "static capacity measured first (default 4,8)")
    ap.add_argument("--unloaded", action="store_true", help="first serve schedule 0's requests one at a time, and "
                    "report static batching's p95 at each rate over their latencies (the load; --clock cpu)")
    ap.add_argument("--n", type=int, default=40, help="requests per pass (default 40)")
    ap.add_argument("--repeats", type=int, default=2, help="passes per mode, rate and schedule, order alternating "
                    "(default 2)")
    ap.add_argument("--schedules", type=int, default=1, help="seeded Poisson arrival schedules per rate, each with "
                    "the prompts rotated on by --n; every mode serves each, and the targets read the latencies "
                    "of all its passes pooled (default 1)")
    ap.add_argument("--max-batch", type=int, default=16, help="the server's --max-batch (default 16)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--seed", type=int, default=1, help="prompt sample and arrival schedule (default 1)")
    ap.add_argument("--steps-log", type=Path, default=None, help="write each pass's steps as the step-cost model "
                    "saw them, one JSON line a pass: mode, rate, repeat and [seconds, rows, positions, mixed, "
                    "joins seconds] per step, the warm-up's first (default: none)")
    ap.add_argument("--merge-refresh", action="store_true", help="run a step whose rows refresh in part as one "
                    "forward (engine/forward.py's MERGE_REFRESH; default: its default)")
    ap.add_argument("--clock", default="wall", help="wall: real time; cpu: a discrete-event run on the engine "
                    "thread's CPU seconds, which other processes' preemption does not move (module docstring; "
                    "--threads 1, --device cpu) (default wall)")
    args = ap.parse_args(argv)
    check_domains(ap, args.domains)
    try:
        args.rates = [(float(r[:-1]), True) if r.endswith("x") else (float(r), False) for r in args.rates.split(",")]
    except ValueError:
        ap.error(f"--rates {args.rates!r} is not a list of numbers; give requests/s, e.g. --rates 4,8, or "
                 "fractions of the measured capacity, e.g. --rates 0.6x,0.9x")
    if args.unloaded and args.clock != "cpu":
        ap.error("--unloaded serves the requests one at a time, long apart, which on the wall clock waits the "
                 "time between them: use --clock cpu")
    args.domains = args.domains.split(",")
    args.admission = args.admission.split(",")
    bad = [m for m in args.admission if m not in ("always", "fcfs", "auto")]
    if bad:
        ap.error(f"--admission {bad[0]!r} is not an admission rule; use one of always, fcfs, auto (comma-separated)")
    if not all(0 < r < math.inf for r, _ in args.rates):  # NaN fails both
        shown = ",".join(f"{r:g}" + "x" * frac for r, frac in args.rates)
        ap.error(f"--rates {shown}: every rate must be a finite number > 0 requests/s")
    from gpu_speed import SIZES

    if args.size is not None and args.size not in SIZES:
        ap.error(f"--size {args.size!r} is not a size; use one of {', '.join(sorted(SIZES))}")
    from ecache_cli.cache import POLICIES
    from ecache_cli.errors import EcacheError
    from ecache_cli.models.loader import resolve_device, resolve_dtype

    try:
        resolve_dtype(args.dtype, resolve_device(args.device))
    except EcacheError as e:
        ap.error(str(e))

    if args.policy not in POLICIES:
        ap.error(f"--policy {args.policy!r} is not a cache policy; use one of {', '.join(POLICIES)}")
    check_at_least(ap, args, dict(n=2, repeats=1, schedules=1, max_batch=1, threads=1, max_tokens=1, shots=0))
    if args.steps_log is not None and args.steps_log.is_dir():
        ap.error(f"--steps-log {args.steps_log} is a folder; name a file in it, e.g. {args.steps_log / 'steps.jsonl'}")
    if args.steps_log is not None and not args.steps_log.parent.is_dir():
        ap.error(f"--steps-log {args.steps_log}: no folder {args.steps_log.parent}; create it or name another file")
    if args.clock not in ("wall", "cpu"):
        ap.error(f"--clock {args.clock!r} is not a clock; use one of wall, cpu")
    if args.clock == "cpu" and args.threads != 1:
        ap.error(f"--clock cpu counts one thread's CPU time; --threads {args.threads} would leave the others' "
                 "out: use --threads 1")
    if args.clock == "cpu" and args.device != "cpu":
        ap.error(f"--clock cpu counts the CPU time of the engine thread, not a device's; --device {args.device!r} "
                 "needs --clock wall")
    return args


def main() -> None:
    args = parse()
    require_serve_extra("serve_sim.py")
    import torch

    from ecache_cli.errors import EcacheError

    torch.set_num_threads(args.threads)
    if args.merge_refresh:
        from ecache_cli.engine import forward

        forward.MERGE_REFRESH = True
    work = Path(tempfile.mkdtemp(prefix="ecache-serve-sim-")) if args.size else None
    try:
        lm, settings, prompts = build(args, work)
    except EcacheError as e:
        print(f"serve_sim.py: {e}", file=sys.stderr)
        sys.exit(2)
    finally:  # the weights are loaded: the random checkpoint (2 GB at 1b) is not needed any more
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    check_requests(lm, settings, prompts, args)
    t_start = time.time()
    about = {}  # what the JSON line adds beyond a default run's keys
    if args.merge_refresh:
        about["merge_refresh"] = True
    if args.device != "cpu" or args.dtype != "float32":
        about.update(device=args.device, dtype=args.dtype)
    if args.size:
        about.update(model=f"llada-{args.size}-random", size=args.size,
                     params=sum(p.numel() for p in lm.model.parameters()))
    capacity = None
    if any(frac for _, frac in args.rates):
        c = one_pass(lm, settings, prompts, args, "fcfs", 1.0, args.seed, args.max_batch, burst=True)
        capacity = about["capacity"] = c["throughput"]
        print(f"static capacity: {capacity:.2f} req/s ({args.max_batch} requests as one fcfs batch, "
              f"{c['steps']} steps of {c['ms_per_step']:.1f} ms)", file=sys.stderr, flush=True)
    rates = [round(r * capacity, 2) if frac else r for r, frac in args.rates]
    one_pass(lm, settings, prompts, args, "fcfs", rates[0], args.seed, min(args.n, 8))  # warm-up, not kept
    if args.unloaded:
        about["unloaded"] = unloaded_latency(lm, settings, prompts, args)
        print(f"unloaded latency: p50 {about['unloaded']['p50']:.3f} s, p95 {about['unloaded']['p95']:.3f} s "
              f"({args.n} requests served one at a time)", file=sys.stderr, flush=True)
    modes = args.admission
    rows = []
    steps_log = open(args.steps_log, "w", encoding="utf-8") if args.steps_log else None  # noqa: SIM115
    latencies = {}  # (mode, rate) -> [(seconds, domain)] over every schedule and repeat
    per_schedule = {}  # schedule -> the same, that schedule's passes only
    for i, rate in enumerate(rates):
        # rotating order: each mode goes first once (with --clock cpu the passes of a schedule run together)
        order = [(rep, mode) for rep in range(args.repeats)
                 for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]]
        for sch in range(args.schedules):
            seed, offset = args.seed * 1000 + i + 7919 * sch, sch * args.n  # schedule 0: the one-schedule run's
            if args.clock == "cpu":
                done = passes_at(lm, settings, prompts, args, [m for _, m in order], rate, seed, args.n, offset=offset)
            else:
                done = (one_pass(lm, settings, prompts, args, m, rate, seed, args.n, offset=offset) for _, m in order)
            for (rep, mode), r in zip(order, done):
                r["repeat"], r["schedule"] = rep, sch
                observed = r.pop("observed")
                mine = r.pop("latencies")
                latencies.setdefault((mode, rate), []).extend(mine)
                per_schedule.setdefault(sch, {}).setdefault((mode, rate), []).extend(mine)
                if steps_log is not None:  # a pass a line, flushed, so a run cut short keeps the passes done
                    steps_log.write(json.dumps({"mode": mode, "rate": rate, "repeat": rep, "schedule": sch,
                                                "steps": observed}) + "\n")
                    steps_log.flush()
                rows.append(r)
                print(f"{mode:>6} rate {rate:g}/s schedule {sch} pass {rep}: p50 {r['p50']:.3f} s, "
                      f"p95 {r['p95']:.3f} s, {r['throughput']:.2f} req/s, {r['steps']} steps, "
                      f"{r['rows_per_step']:.2f} rows/step, {r['ms_per_step']:.2f} ms/step, "
                      f"{r['two_forward']:.2f} two-forward", file=sys.stderr, flush=True)
    domains = list(dict.fromkeys(args.domains))
    extra = "".join(f" {'p95 ' + d:>10}" for d in domains) if len(domains) > 1 else ""
    print(f"\n{'admission':>9} {'rate/s':>6} {'pass':>4} {'p50 s':>6} {'p95 s':>6}{extra} {'req/s':>6} {'steps':>5} "
          f"{'rows':>5} {'busy s':>6} {'ms/step':>7} {'joined':>6} {'2-fwd':>5}")
    for r in rows:
        extra = "".join(f" {r['p95_by_domain'].get(d, float('nan')):10.3f}" for d in domains if len(domains) > 1)
        print(f"{r['mode']:>9} {r['rate']:6g} {r['repeat']:4d} {r['p50']:6.3f} {r['p95']:6.3f}{extra} "
              f"{r['throughput']:6.2f} {r['steps']:5d} {r['rows_per_step']:5.2f} {r['busy_s']:6.2f} "
              f"{r['ms_per_step']:7.2f} {r['joined_running']:6d} {r['two_forward']:5.2f}")
    spread = {f"{rate:g}": spread_at(rows, rate) for rate in rates}
    if args.repeats > 1:
        print("\npasses of one mode, slowest over fastest (the run's noise):", json.dumps(spread))
    targets = {f"{rate:g}": targets_at(latencies, rate, domains) for rate in rates}
    if args.unloaded and "fcfs" in modes:
        about["load"] = {f"{rate:g}": load_at(latencies, rate, about["unloaded"]) for rate in rates}
        print("static p95 over the unloaded latency (the load):", json.dumps(about["load"]))
    if args.schedules > 1:
        about["by_schedule"] = {f"{rate:g}": by_schedule(per_schedule, rate, domains) for rate in rates}
        print("\neach schedule alone:", json.dumps(about["by_schedule"]))
    print("\ntargets (every pass pooled):", json.dumps(targets))
    if args.size:
        about["gpu_expectation"] = {f"{rate:g}": continuous_over_static(latencies, rate) for rate in rates}
        print("expectation on a GPU, continuous p95 ≤ 0.6× static's:", json.dumps(about["gpu_expectation"]))
    print(json.dumps({"bench": "serve_sim", "date": time.strftime("%Y-%m-%d"), "model": args.model,
                      "clock": args.clock, "profile": args.profile, "policy": args.policy, "domains": args.domains,
                      "shots": args.shots,
                      "max_tokens": args.max_tokens, "n": args.n, "threads": args.threads,
                      "max_batch": args.max_batch, "schedules": args.schedules, "wall_s": time.time() - t_start,
                      "rows": rows,
                      "targets": targets, "spread": spread, **about}))
    if steps_log is not None:
        steps_log.close()


def spread_at(rows: list[dict], rate: float) -> dict:
    """Per mode at ``rate``: the slowest over the fastest of its passes' p50 and p95 on one schedule, the
    largest over the schedules (1.0 with one pass a schedule). Passes of one mode on one schedule get the
    same requests at the same times, so this is the machine's noise, the resolution a comparison of the
    modes has in this run."""
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode and r["rate"] == rate]
        schedules = [[r for r in mine if r.get("schedule", 0) == s]
                     for s in dict.fromkeys(r.get("schedule", 0) for r in mine)]
        out[mode] = {k: max(max(r[k] for r in one) / min(r[k] for r in one) for one in schedules)
                     for k in ("p50", "p95")}
    return out


def unloaded_latency(lm, settings, prompts, args) -> dict:
    """The unloaded latency: schedule 0's ``--n`` requests served one at a time, each arriving long after
    the one before has left (on the CPU clock an idle engine's wait takes no time), as
    ``bench/serve_load.py --unloaded`` sends them. Returns {"p50", "p95"} (seconds)."""
    times = [1e4 * i for i in range(args.n)]
    r = one_pass(lm, settings, prompts, args, "fcfs", 1.0, args.seed, args.n, times=times)
    return {"p50": r["p50"], "p95": r["p95"]}


def load_at(latencies: dict, rate: float, unloaded: dict) -> dict:
    """How loaded ``rate`` is: static batching's (``fcfs``'s) pooled p95 there over the unloaded p50 and
    over the unloaded p95 (:func:`unloaded_latency`). ``bench/serve_load.py`` reads its targets at R*,
    the lowest rate where the first exceeds 3; on mixed lengths the unloaded p50 is a short request's
    and the p95 a long one's, about 3× apart with no queue at all, so the second says more there."""
    p95 = pooled(latencies, "fcfs", rate, 0.95)
    return {"over_unloaded_p50": p95 / unloaded["p50"], "over_unloaded_p95": p95 / unloaded["p95"]}


def pooled(latencies: dict, mode: str, rate: float, q: float, domain: str | None = None) -> float | None:
    """The ``q`` quantile of every latency of ``mode``'s passes at ``rate`` (all schedules and repeats;
    ``domain``: its requests only); None when the mode has none. ``latencies``: (mode, rate) ->
    [(seconds, domain)]. One quantile over the pooled requests (60 × 5 schedules: the p95 is the 15th
    largest of 300) varies far less between runs than one over a pass (the 3rd largest of 60)."""
    xs = [t for t, d in latencies.get((mode, rate), []) if domain is None or d == domain]
    return pct(xs, q) if xs else None


def continuous_over_static(latencies: dict, rate: float) -> dict:
    """Continuous (``always``) over static (``fcfs``) batching's p95 at ``rate``, pooled over their passes
    (:func:`pooled`), and ``met`` when it is ≤ 0.6 (the expectation on a GPU, issue 53); {} when a mode
    is missing."""
    always, fcfs = pooled(latencies, "always", rate, 0.95), pooled(latencies, "fcfs", rate, 0.95)
    if always is None or fcfs is None:
        return {}
    return {"always_p95_over_fcfs": always / fcfs, "met": always / fcfs <= 0.6}


def targets_at(latencies: dict, rate: float, domains: list[str]) -> dict:
    """The admission targets at ``rate`` from each mode's latencies pooled over its passes (:func:`pooled`;
    module docstring): ratios of ``auto``'s p50 and p95 to the better of ``always`` and ``fcfs``, and of
    the first domain's p95 under ``auto`` to ``fcfs``'s; ``met`` when every ratio holds. {} when a mode is
    missing."""
    if any(pooled(latencies, m, rate, 0.5) is None for m in ("always", "fcfs", "auto")):
        return {}
    out = {}
    for k, q in (("p50", 0.5), ("p95", 0.95)):
        best = min(pooled(latencies, "always", rate, q), pooled(latencies, "fcfs", rate, q))
        out[f"auto_{k}_over_best"] = pooled(latencies, "auto", rate, q) / best
    ok = all(v <= 1.05 for v in out.values())
    if len(domains) > 1:
        short = domains[0]
        out["auto_short_p95_over_fcfs"] = (pooled(latencies, "auto", rate, 0.95, short)
                                           / pooled(latencies, "fcfs", rate, 0.95, short))
        ok = ok and out["auto_short_p95_over_fcfs"] <= 0.8
    out["met"] = ok
    return out


def by_schedule(latencies_of: dict, rate: float, domains: list[str]) -> list[dict]:
    """The targets of each schedule alone (:func:`targets_at` over that schedule's passes):
    ``latencies_of`` maps a schedule to its (mode, rate) -> [(seconds, domain)]. How far they spread is
    how much one schedule of ``--n`` requests can say."""
    return [targets_at(lat, rate, domains) for _, lat in sorted(latencies_of.items())]


if __name__ == "__main__":
    main()
