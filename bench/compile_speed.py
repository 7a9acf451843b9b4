"""Eager vs compiled (``--compile``) decoding side by side: tokens/s, compile time apart, equivalence.

Models: the embedded one (``--model tiny``, default; few-shot prompts of its task domains, as
bench/speed.py's ``domains`` workload, shorter by default) or a random-weight LLaDA-shaped checkpoint
(``--size 1b`` or ``tiny``: bench/gpu_speed.py's ``SIZES``, character prompts of ``--prompt-len``).
Speed: ``ecache_cli.runs.profile.measure`` (the code behind ``ecache profile``: warm-up excluded) on the
eager model and on ``StaticStep`` (``ecache_cli/models/compiled.py``), per batch size and policy, in
``--rounds`` rounds that alternate which engine goes first, keeping each one's best (the machine may be
shared); the seconds spent compiling are reported apart and are in no tokens/s (the run's clock leaves
them out).
The eager runs keep their natural canvas; the compiled ones widen the prompt width to its bucket.
Equivalence (``--check``, float32 only): every prompt decoded eager and compiled in lockstep on the same
canvas; the logits of each step are compared while both canvases are still identical (max abs), and the
final answers token for token, every differing token listed.

    OMP_NUM_THREADS=1 python bench/compile_speed.py --threads 1                       # CPU, embedded model
    python bench/compile_speed.py --size 1b --device cuda --dtype bfloat16 --batch-sizes 1,8 --no-check
    python bench/compile_speed.py --size tiny --n 2 --gen-length 32 --no-check         # quick dry run
    python bench/compile_speed.py --domains arith,code,list --shots 4 --gen-length 256  # speed.py --shots 4's prompts

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))


def requests_for(args, engine) -> list:
    """The prompts: few-shot task prompts for the embedded model, character prompts for a random one."""
    from ecache_cli.runs.profile import Request

    if args.size is not None:
        from gpu_speed import prompt_text

        return [Request(prompt_text(args.prompt_len, i)) for i in range(args.n)]
    from speed import fewshot_requests

    from ecache_cli.tasks import get_task

    out = []
    for name in args.domains.split(","):
        out += fewshot_requests(engine, get_task(name), args.n, args.min_prompt, args.max_prompt, args.seed, False,
                                fixed_shots=args.shots)
    return out


def lockstep(eager, comp, ids: list, cfg, make, bs: int) -> dict:
    """Decode ``ids`` eager and compiled, batch by batch, in lockstep on the compiled canvas. Returns the
    largest logits difference while the canvases were identical, the steps compared, the answers' token
    agreement and every differing token (prompt, position in the answer, eager id, compiled id).
    ``make()``: a fresh policy."""
    worst, steps, same, total, diffs = 0.0, 0, 0, 0, []
    for lo in range(0, len(ids), bs):
        rows = list(range(lo, min(lo + bs, len(ids))))
        batch = [ids[i] for i in rows]
        width = comp.model.prompt_bucket(max(map(len, batch)), cfg.gen_length, comp.spec.max_positions)
        runs = [e.start(batch, cfg, make(), seed=0, row_ids=rows, prompt_width=width) for e in (eager, comp)]
        seen: list[list] = [[], []]
        for k, run in enumerate(runs):
            run.on_forward = lambda r, plan, q, s, logits, box=seen[k]: box.append(logits.clone())
        identical = True
        for _ in zip(*runs):
            a, b = seen[0].pop(), seen[1].pop()
            if identical and a.shape == b.shape:
                worst, steps = max(worst, (a.float() - b.float()).abs().max().item()), steps + 1
            identical = identical and torch.equal(runs[0].state.tokens, runs[1].state.tokens)
        for run in runs:  # one ran past the other: finish it
            for _ in run:
                pass
        for r_e, r_c in zip(runs[0].results(), runs[1].results()):
            a, b = r_e.token_ids, r_c.token_ids
            n = max(len(a), len(b))
            total += n
            for j in range(n):
                x, y = (a[j] if j < len(a) else None), (b[j] if j < len(b) else None)
                same += x == y
                if x != y:
                    diffs.append([rows[r_e.index], j, x, y])
    return {"logits_max_abs": worst, "steps_compared": steps, "token_agreement": same / total if total else 1.0,
            "tokens": total, "differing": diffs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="a model name or folder (ignored with --size)")
    ap.add_argument("--size", default=None, help="a random checkpoint of bench/gpu_speed.py's SIZES (1b, tiny)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n", type=int, default=2, help="prompts per task domain (random checkpoint: prompts)")
    ap.add_argument("--domains", default="arith,list")
    ap.add_argument("--min-prompt", type=int, default=100)
    ap.add_argument("--max-prompt", type=int, default=300)
    ap.add_argument("--shots", type=int, default=None, help="exactly this many solved examples per prompt instead of "
                    "--min/--max-prompt tokens (bench/speed.py --shots)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--policies", default="none,entropy")
    ap.add_argument("--tau", type=float, default=None, help="EntropyCache tau [default: the model's profile, else 1]")
    ap.add_argument("--recent-k", type=int, default=None, help="EntropyCache recent_k [default: the model's profile]")
    ap.add_argument("--max-graphs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds per engine, alternating; the best is kept")
    ap.add_argument("--pad", action=argparse.BooleanOptionalAction, default=None,
                    help="buckets and slots (StaticStep pad) [default: on CUDA only]")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                    help="the float32 equivalence check [default: on in float32]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON document here")
    args = ap.parse_args(argv)
    from bench_args import check_domains  # bench/, the script's folder

    check_domains(ap, args.domains)
    torch.set_num_threads(args.threads)

    from ecache_cli.engine import Engine
    from ecache_cli.models.compiled import StaticStep
    from ecache_cli.models.loader import load_model
    from ecache_cli.runs.manifest import manifest
    from ecache_cli.runs.profile import ProfileOptions, json_line, measure
    from ecache_cli.runs.settings import resolve_settings

    t0 = time.perf_counter()
    name = args.model
    if args.size is not None:
        from gpu_speed import SIZES

        from ecache_cli.models.synthetic import write_random_checkpoint

        name = write_random_checkpoint(Path(tempfile.mkdtemp(prefix="ecache-compile-")) / args.size, "llada", seed=0,
                                       scale=4.0, dtype=torch.bfloat16, **SIZES[args.size])
    lm = load_model(name, device=args.device, dtype=args.dtype)
    eager = Engine.from_loaded(lm)
    step = StaticStep(lm.model, max_graphs=args.max_graphs, pad=args.pad)
    comp = Engine(step, lm.tokenizer, lm.spec)
    cache = {k: v for k, v in (("tau", args.tau), ("recent_k", args.recent_k)) if v is not None}
    settings = resolve_settings(args.model if args.size is None else "random", {
        "gen_length": args.gen_length, "block_length": args.block_length}, cache)
    requests = requests_for(args, eager)
    ids = eager.encode([r.prompt for r in requests], False)
    policies = args.policies.split(",")
    check = args.check if args.check is not None else lm.dtype == torch.float32
    rows, equivalence = [], {}
    print(f"{len(requests)} prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, gen {args.gen_length}, "
          f"{lm.device} {args.dtype}, {torch.get_num_threads()} thread(s)", flush=True)
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        opts = ProfileOptions(policies=policies, warmup=1, batch_size=bs, seed=args.seed)
        before = step.stats.compile_s
        best: dict = {}  # (kind, policy) -> the fastest round's summary (a shared machine: best of rounds)
        for r in range(args.rounds):  # eager and compiled alternate, each going first in turn
            pair = [("eager", eager), ("compiled", comp)]
            for kind, engine in pair[::-1] if r % 2 else pair:
                rep = measure(engine, settings, requests, opts, chat=False)
                for p in policies:
                    if (kind, p) not in best or rep.summaries[p]["tokens_per_s"] > best[kind, p]["tokens_per_s"]:
                        best[kind, p] = rep.summaries[p]
        for p in policies:
            e, c = best["eager", p], best["compiled", p]
            rows.append({"batch": bs, "policy": p, "eager_tok_s": e["tokens_per_s"],
                         "compiled_tok_s": c["tokens_per_s"],
                         "ratio": c["tokens_per_s"] / e["tokens_per_s"] if e["tokens_per_s"] else None,
                         "eager_mean_ms": e["mean_ms"], "compiled_mean_ms": c["mean_ms"],
                         "compile_s": step.stats.compile_s - before if p == policies[0] else 0.0})
        if check:
            for p in policies:
                equivalence[f"{p}/batch{bs}"] = lockstep(eager, comp, ids, settings.decode,
                                                          lambda p=p: settings.policy(p), bs)
    print(f"{'batch':>5}  {'policy':<10} {'eager tok/s':>11} {'compiled tok/s':>14} {'ratio':>6}  "
          f"{'eager ms':>9} {'compiled ms':>11}")
    for r in rows:
        print(f"{r['batch']:>5}  {r['policy']:<10} {r['eager_tok_s']:>11.1f} {r['compiled_tok_s']:>14.1f} "
              f"{r['ratio']:>5.2f}x  {r['eager_mean_ms']:>9.0f} {r['compiled_mean_ms']:>11.0f}")
    s = step.stats
    print(f"compiled: {s.graphs} graph(s) ({s.traces} traced) in {s.compile_s:.1f} s, not in any tokens/s; "
          f"{s.compiled_calls} compiled and {s.eager_calls} eager forwards; buckets {s.buckets}")
    for key, eq in equivalence.items():
        print(f"equivalence {key}: logits max abs {eq['logits_max_abs']:.2e} over {eq['steps_compared']} steps, "
              f"tokens {100 * eq['token_agreement']:.2f}% of {eq['tokens']} agree"
              + (f"; differing (prompt, answer position, eager, compiled): {eq['differing']}"
                 if eq["differing"] else ""))
    doc = {"bench": "compile_speed", "rows": rows, "compile": s.as_dict(), "equivalence": equivalence,
           "args": {k: str(v) for k, v in vars(args).items()}, "manifest": manifest(lm, settings, args.seed),
           "total_s": time.perf_counter() - t0}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json_line(doc) + "\n")
    print(json.dumps(doc, default=str, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
