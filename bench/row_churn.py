"""Rows joining and leaving vs a fixed batch: the engine's per-step cost of continuous batching, in-process.

Two runs of the embedded ``tiny`` model over the same number of rows (``--batch``) and steps:

- ``fixed``: the rows start together and run ``--steps`` denoising steps; no row joins or leaves.
- ``churn``: the same batch, but every ``--every`` steps the ``--swap`` oldest rows leave (their
  ``record.finished`` set, as ``ecache serve`` does) and as many new rows join (``Run.add``), so the
  batch keeps its size while rows come and go, as under continuous batching at capacity.

Rows never end on their own before the last measured step (``early_exit`` off, one step per
generated position), so both runs step the same batch size throughout. The time of a step is that of
one ``next()`` of the run (its joins and leaves included), wall clock and the thread's CPU time
(less disturbed by other jobs on a shared machine). Prints, per cache policy, the mean and median ms
per step of each run and the churn/fixed ratios; each run's step split into its sections (forward,
sampling, the policy's decisions, the rest: joins, leaves, grouping, clocks), its full-forward rows
per step, target width R and partial-forward query width; and the CPU time of one swap's joins and
leaves (``Run._admit`` + ``Run._retire``). ``none``: every step a full forward, so the two runs
compute the same positions; ``entropy``: joining rows add their own full forwards, which a fixed
batch does not have. Under churn the rows are at different steps of their blocks, so the step's
target width R (the most masked positions any row has left in its block) stays near the block
length, where a fixed batch's shrinks as its block fills.

    python bench/row_churn.py                            # ~2 min, one thread
    python bench/row_churn.py --policies none --profile  # top operators
    python bench/row_churn.py --policies entropy --pack-below 0  # never packed
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import textwrap
import time

import torch


def build(args):
    from ecache_cli.cache import make_policy
    from ecache_cli.decoding.config import DecodeConfig
    from ecache_cli.engine.core import Engine
    from ecache_cli.models.loader import load_model

    lm = load_model("tiny", device="cpu", dtype="float32")
    eng = Engine.from_loaded(lm)
    cfg = DecodeConfig(gen_length=args.gen_length, block_length=args.block_length, steps=args.gen_length,
                       early_exit=False)
    words = "apple pear plum fig kiwi lime date melon grape peach".split()
    prompts = [eng.encode([f"list {i}: " + " ".join(words[(i + j) % 10] for j in range(3 + i % 5))], chat=False)[0]
               for i in range(64)]
    params = {"none": {}, "entropy": {"tau": 0.00271, "recent_k": 64, "signal": "max-entropy"}}
    return eng, cfg, prompts, lambda name: make_policy(name, **params.get(name, {}))


def one_run(eng, cfg, prompts, policy, args, churn: bool) -> tuple[list[float], list[float], dict]:
    """One run: per-step wall seconds and thread CPU seconds (the first ``--warmup`` steps left out), and
    sums over those steps: ``full`` rows that ran a full forward, ``forward`` / ``sampling`` / ``decision``
    seconds (the run's own step sections), ``targets`` the steps' target widths R, ``width`` their
    partial forwards' query widths (T for an all-full step), ``moves`` thread CPU seconds of the joins
    and leaves."""
    B = args.batch
    run = eng.start(prompts[:B], cfg, policy, prompt_width=args.prompt_width)
    moves = [0.0]  # thread CPU seconds in the run's joins and leaves (Run._admit, Run._retire)

    def timed(f):
        def call(*a):
            c = time.thread_time()
            f(*a)
            moves[0] += time.thread_time() - c
        return call

    run._admit, run._retire = timed(run._admit), timed(run._retire)
    it = iter(run)
    nxt, times, cpu = B, [], []
    sums = dict.fromkeys(("full", "forward", "sampling", "decision", "targets", "width", "moves"), 0.0)
    order = list(range(B))  # run row indices, oldest first
    for i in range(args.steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        rec = next(it)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        if i == args.warmup - 1:
            moves[0] = 0.0
        if i >= args.warmup:
            for k, v in (("full", int(rec.refresh.sum())), ("forward", rec.forward_s), ("sampling", rec.sampling_s),
                         ("decision", rec.decision_s), ("targets", rec.targets.shape[1]), ("width", rec.query_width)):
                sums[k] += v
        if churn and i % args.every == args.every - 1:
            leaving = set(order[:args.swap])
            order = order[args.swap:]
            rec.finished = rec.finished | torch.tensor([r in leaving for r in rec.rows.tolist()])
            for _ in range(args.swap):
                order.append(run.add(prompts[nxt % len(prompts)]))
                nxt += 1
    sums["moves"] = moves[0]
    return times[args.warmup:], cpu[args.warmup:], sums


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``error: <message>`` on stderr, exit 2 (no usage block)."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Help with every option's default; the description as :func:`_wrapped` laid it out."""


def _wrapped(doc: str, width: int = 79) -> str:
    """``doc`` wrapped to ``width`` columns: each paragraph and ``- `` item refilled, indented lines
    (the examples) kept as they are."""
    out = []
    for para in doc.strip().split("\n\n"):
        lines = para.split("\n")
        if lines[0].startswith("    "):
            out.append(para)
            continue
        items, cur = [], []
        for ln in lines:
            if ln.startswith("- ") and cur:
                items.append(cur)
                cur = []
            cur.append(ln.strip())
        items.append(cur)
        out.append("\n".join(textwrap.fill(" ".join(it), width, subsequent_indent="  " if it[0].startswith("- ")
                                             else "") for it in items))
    return "\n\n".join(out)


def parse(argv=None) -> argparse.Namespace:
    """The options, checked (one-line error and exit 2 for a bad value, before the model loads).
    ``steps`` comes back as the warm-up plus the measured steps (the run's total)."""
    from ecache_cli.cache import POLICIES, unknown_policy
    from ecache_cli.engine import forward
    from ecache_cli.errors import UsageError
    from ecache_cli.runs.settings import validate_decode

    ap = _Parser(description=_wrapped(__doc__), formatter_class=_Formatter)
    ap.add_argument("--batch", type=int, default=16, help="rows in the batch (serve's --max-batch)")
    ap.add_argument("--steps", type=int, default=56, help="steps measured per run, after the warm-up (≥ 1)")
    ap.add_argument("--warmup", type=int, default=8, help="first steps left out of the times (≥ 0)")
    ap.add_argument("--every", type=int, default=3, help="churn: rows swap every this many steps (1..--steps)")
    ap.add_argument("--swap", type=int, default=1,
                    help="churn: rows leaving (and joining) at each swap (1..--batch - 1)")
    ap.add_argument("--gen-length", type=int, default=64,
                    help="canvas gen length, one step per position: at least --steps + --warmup")
    ap.add_argument("--block-length", type=int, default=32, help="semi-autoregressive block (divides --gen-length)")
    ap.add_argument("--prompt-width", type=int, default=64, help="canvas prompt positions (serve's bucket)")
    ap.add_argument("--policies", default="none,entropy", help="comma list of cache policies")
    ap.add_argument("--repeats", type=int, default=5, help="alternating fixed/churn runs per policy")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of one churn run")
    ap.add_argument("--pack-below", type=float, default=forward.PACK_BELOW,
                    help="pack a partial forward's real query entries when they are at most this share of its "
                         "padded layout (engine/forward.py PACK_BELOW; 0: never pack)")
    args = ap.parse_args(argv)
    if not 0 <= args.pack_below <= 1:
        ap.error(f"--pack-below {args.pack_below} must be in [0, 1] (0: never pack)")
    for flag, v, lo in (("--batch", args.batch, 2), ("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                        ("--every", args.every, 1), ("--swap", args.swap, 1), ("--prompt-width", args.prompt_width, 1),
                        ("--repeats", args.repeats, 1), ("--threads", args.threads, 1)):
        if v < lo:
            ap.error(f"{flag} {v} must be ≥ {lo}" + (" (a swap needs a row that stays)" if flag == "--batch" else ""))
    if args.swap >= args.batch:
        ap.error(f"--swap {args.swap} must be < --batch {args.batch}: at least one row stays; lower --swap")
    if args.every > args.steps:
        ap.error(f"--every {args.every} must be ≤ --steps {args.steps}, so the measured steps hold a swap")
    try:
        validate_decode({"gen_length": args.gen_length, "block_length": args.block_length})
    except UsageError as e:
        ap.error(str(e))
    if args.steps + args.warmup > args.gen_length:
        need = -(-(args.steps + args.warmup) // args.block_length) * args.block_length
        ap.error(f"--steps {args.steps} + --warmup {args.warmup} exceed --gen-length {args.gen_length} (one step "
                 f"per position); raise --gen-length to {need} or lower --steps")
    from ecache_cli.runs.comma_lists import parse_list

    try:
        names = parse_list(args.policies, "--policies", example="none,entropy")
    except UsageError as e:
        ap.error(str(e))
    bad = next((name for name in names if name not in POLICIES), None)
    if bad is not None:
        ap.error(str(unknown_policy(bad, "--policies")))
    args.policies = names
    args.steps += args.warmup
    return args


def main(argv=None) -> int:
    """The benchmark (module docstring); returns 0, or 1/2 for an error found once the model is loaded."""
    from ecache_cli.errors import EcacheError

    args = parse(argv)
    try:
        _bench(args)
    except EcacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def _bench(args) -> None:
    from ecache_cli.engine import forward

    torch.set_num_threads(args.threads)
    forward.PACK_BELOW = args.pack_below
    eng, cfg, prompts, policy = build(args)
    with torch.inference_mode():
        for name in args.policies:
            if args.profile:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    one_run(eng, cfg, prompts, policy(name), args, churn=True)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
                continue
            wall = {"fixed": [], "churn": []}
            cpu = {"fixed": [], "churn": []}
            sums = {"fixed": collections.Counter(), "churn": collections.Counter()}
            for _ in range(args.repeats):
                for mode in ("fixed", "churn"):
                    w, c, s = one_run(eng, cfg, prompts, policy(name), args, churn=mode == "churn")
                    wall[mode] += w
                    cpu[mode] += c
                    sums[mode].update(s)
            steps = len(wall["fixed"])
            for label, res in (("wall", wall), ("cpu", cpu)):
                med = {m: statistics.median(t) * 1e3 for m, t in res.items()}
                mean = {m: statistics.fmean(t) * 1e3 for m, t in res.items()}
                print(f"{name:8s} batch {args.batch} {label:4s}: fixed {mean['fixed']:.2f} ms/step (median "
                      f"{med['fixed']:.2f}), churn {mean['churn']:.2f} (median {med['churn']:.2f}); churn/fixed "
                      f"mean {mean['churn'] / mean['fixed']:.3f}, median {med['churn'] / med['fixed']:.3f}")
            for mode in ("fixed", "churn"):
                m = {k: v / steps for k, v in sums[mode].items()}
                rest = statistics.fmean(wall[mode]) - m["forward"] - m["sampling"] - m["decision"]
                print(f"{name:8s} {mode}: per step forward {m['forward'] * 1e3:.2f} ms, sampling "
                      f"{m['sampling'] * 1e3:.2f}, decision {m['decision'] * 1e3:.2f}, rest (joins, leaves, grouping, "
                      f"clocks) {rest * 1e3:.2f}; full-forward rows {m['full']:.2f}, targets R {m['targets']:.1f}, "
                      f"query width {m['width']:.1f}", flush=True)
            swaps = args.repeats * len([i for i in range(args.warmup, args.steps) if i % args.every == args.every - 1])
            print(f"{name:8s} joins and leaves: {sums['churn']['moves'] / swaps * 1e3:.2f} ms CPU per swap "
                  f"({args.swap} leaving, {args.swap} joining)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
