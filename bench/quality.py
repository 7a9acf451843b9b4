"""Held-out quality of a model on the synthetic domains: greedy accuracy per (domain, shots).

The reference setting for the embedded model: test split (seed 0), policy ``none``, gen length 256,
block length 32, 256 steps, temperature 0, chat template on. Scoring ``code`` runs the completions
in the sandbox (tasks/sandbox.py), so this script builds the code task with code execution allowed.

Output: a rich table on stdout, then the very last line of stdout is one compact JSON document
(nanochat ``infer_bench`` convention). Progress goes to stderr. On a 2-core CPU the full run
(200 examples x 3 domains x 2 shot settings) takes a long while; ``--limit`` shortens it.

    python bench/quality.py                      # tiny, 200 per domain, 0 and 4 shots
    python bench/quality.py --limit 30 --shots 0
    python bench/quality.py --model /path/to/llada --domains list
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="model name or checkpoint directory (default tiny)")
    ap.add_argument("--limit", type=int, default=200, help="held-out examples per domain (default 200)")
    ap.add_argument("--shots", default="0,4", help="comma-separated shot counts (default 0,4)")
    ap.add_argument("--domains", default="arith,code,list", help="comma-separated domains")
    ap.add_argument("--seed", type=int, default=0, help="test-split and shot seed (default 0)")
    ap.add_argument("--batch", type=int, default=32, help="prompts per engine call (default 32)")
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--policy", default="none", help="cache policy (default none: the reference)")
    ap.add_argument("--device", default=None, help="auto | cpu | cuda (default auto)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default torch's)")
    ap.add_argument("--lengths", default="64,128,512",
                    help="gen lengths whose answers must equal the --gen-length answer (steps = length; '' skips)")
    ap.add_argument("--length-limit", type=int, default=50,
                    help="held-out 0-shot prompts per domain for the length check (default 50)")
    args = ap.parse_args(argv)
    from bench_args import check_domains  # bench/, the script's folder

    check_domains(ap, args.domains)
    return args


def main(argv=None) -> None:
    from rich.table import Table

    from ecache_cli.cache import make_policy
    from ecache_cli.console import err, out
    from ecache_cli.engine import DecodeConfig, Engine
    from ecache_cli.models.loader import load_model
    from ecache_cli.tasks import get_task

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shots_list = [int(s) for s in args.shots.split(",")]
    domains = args.domains.split(",")
    lm = load_model(args.model, device=args.device)
    engine = Engine.from_loaded(lm)
    cfg = DecodeConfig(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps, temperature=0.0)
    err.print(f"model {lm.name} ({lm.spec.n_params / 1e6:.2f}M params) on {lm.device}; {cfg.as_dict()}")

    results: dict[str, dict] = {}
    answers: dict[str, tuple[list[str], list[str]]] = {}  # key -> (prompts, completions at --gen-length)
    t_all = time.perf_counter()
    for d in domains:
        task = get_task(d, allow_code_execution=True)
        examples = task.examples("test", args.limit, args.seed)
        for shots in shots_list:
            t0 = time.perf_counter()
            prompts = [task.prompt(ex, shots, args.seed) for ex in examples]
            order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch together
            texts: list[str] = [""] * len(prompts)
            for s in range(0, len(order), args.batch):
                idx = order[s:s + args.batch]
                res = engine.generate([prompts[i] for i in idx], cfg, policy=make_policy(args.policy), chat=lm.chat,
                                      seed=args.seed, row_ids=idx)
                for i, r in zip(idx, res):
                    texts[i] = r.text
                err.print(f"  {d} {shots}-shot: {min(s + args.batch, len(order))}/{len(order)}", end="\r")
            scores = [task.score(ex, text) for ex, text in zip(examples, texts)]
            key = f"{d}/{shots}shot"
            answers[key] = (prompts, texts)
            results[key] = {"accuracy": sum(scores) / max(1, len(scores)), "n": len(scores),
                            "seconds": round(time.perf_counter() - t0, 1)}
            err.print(f"  {key}: {results[key]['accuracy']:.3f} ({results[key]['seconds']}s)          ")

    table = Table(title=f"held-out greedy accuracy: {lm.name}, policy {args.policy}, "
                        f"gen {cfg.gen_length} / block {cfg.block_length} / steps {cfg.steps}")
    table.add_column("domain")
    for shots in shots_list:
        table.add_column(f"{shots}-shot", justify="right")
    for d in domains:
        table.add_row(d, *[f"{results[f'{d}/{s}shot']['accuracy']:.1%}" for s in shots_list])
    out.print(table)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    agreement = length_agreement(engine, lm, args, answers, domains, lengths, cfg) if lengths else {}
    if agreement:
        lt = Table(title=f"answer equals the gen-{cfg.gen_length} answer (0-shot, {args.length_limit} per domain)")
        lt.add_column("gen length", justify="right")
        for d in domains:
            lt.add_column(d, justify="right")
        lt.add_column("all", justify="right")
        lt.add_column("target", justify="right")
        for L, row in agreement.items():
            lt.add_row(str(L), *[f"{row[d]:.1%}" for d in domains], f"{row['all']:.1%}", "95%")
        out.print(lt)
    doc = {"model": lm.name, "params": lm.spec.n_params, "policy": args.policy, "limit": args.limit,
           "seed": args.seed, "decode": cfg.as_dict(), "seconds": round(time.perf_counter() - t_all, 1),
           "accuracy": {k: round(v["accuracy"], 4) for k, v in results.items()},
           "length_agreement": {str(L): {k: round(v, 4) for k, v in row.items()} for L, row in agreement.items()}}
    print(json.dumps(doc, separators=(",", ":")), flush=True)


def length_agreement(engine, lm, args, answers, domains, lengths, cfg) -> dict[int, dict[str, float]]:
    """Share of held-out 0-shot prompts whose completion at each gen length equals the one at
    ``cfg.gen_length`` (block ``cfg.block_length``, one token per step: steps = gen length).

    Answers must not depend on how much canvas is appended; an answer longer than a short canvas
    cannot fit and counts as a disagreement. Returns {length: {domain: share, "all": share}}.
    """
    from dataclasses import replace

    from ecache_cli.cache import make_policy
    from ecache_cli.console import err

    out: dict[int, dict[str, float]] = {}
    for L in lengths:
        c = replace(cfg, gen_length=L, steps=L)
        row, hits, total = {}, 0, 0
        for d in domains:
            key = f"{d}/0shot"
            if key not in answers:
                continue
            prompts, ref = (x[:args.length_limit] for x in answers[key])
            got: list[str] = []
            for s in range(0, len(prompts), args.batch):
                res = engine.generate(prompts[s:s + args.batch], c, policy=make_policy(args.policy), chat=lm.chat,
                                      seed=args.seed)
                got += [r.text for r in res]
            same = sum(a == b for a, b in zip(got, ref))
            row[d] = same / max(1, len(ref))
            hits, total = hits + same, total + len(ref)
            err.print(f"  length {L} {d}: {same}/{len(ref)} equal to gen {cfg.gen_length}")
        row["all"] = hits / max(1, total)
        out[L] = row
    return out


if __name__ == "__main__":
    main()
