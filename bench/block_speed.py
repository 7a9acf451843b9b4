"""Block diffusion on the CPU: SDAR- and LLaDA2-shaped random checkpoints, each decoder with the exact block
cache (``block``) beside recomputing everything (``none``), and what a cached step costs.

For each family a random checkpoint of ``--size`` is written in its official layout
(``write_random_checkpoint``) and decoded through ``ecache_cli.runs.profile.measure`` (the code behind
``ecache profile``: warm-up excluded, policies in rotated order) at each batch size, with each of the
family's decoders: the scheduled count (one token a step) and the official threshold rule (SDAR 0.85,
LLaDA2 0.95, and 0.5). The table gives tokens/s, tokens per forward (TPF), forwards per request, the
work share (positions × layers computed over ``none``'s) and the answers identical to ``none``'s (the
cache is exact: 100% expected).

First, per family, how far ``block``'s logits are from ``none``'s on one prompt (:func:`logit_gap`: 0 in
float32 on this CPU, where the tests hold the two token for token; on CUDA in bfloat16 the answers
differed). Then the step cost of ``block`` (batch 1): the mean time of a step that computes only the current block
(between two yields of the run: forward, sampling, commit, the policy and the loop), beside a bare model
forward over the same block against the same cached prefix (``model(...)`` alone, timed the same way).
Target (issue: block diffusion): the step within 1.3× of the bare forward.

Random weights: the distributions are flat, so the threshold rules rarely commit more than the
scheduled count (TPF near 1); the table measures the cost of the steps, not a decoder's accuracy.
Prints the tables and a last stdout line of JSON.

    OMP_NUM_THREADS=1 python bench/block_speed.py --size tiny                 # seconds
    OMP_NUM_THREADS=1 python bench/block_speed.py --size 1b --prompt-len 48 --gen-length 32
    python bench/block_speed.py --size 1b --device cuda --dtype bfloat16   # bench/gpu_check.sh step 7
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from gpu_speed import prompt_text  # the same word-like prompts (this folder is on sys.path)

# tiny: the embedded model's scale. 1b: SDAR ~0.9B (hidden 1536, 28 layers, GQA 12/4 heads of 128, untied
# head); LLaDA2 ~0.8B, 0.2B active (hidden 1024, 16 layers, the first dense; 64 experts of 256 in 8 groups,
# 4 a token from the 4 best groups, one shared expert)
SIZES = {
    "tiny": {"sdar": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, intermediate_size=384, vocab_size=1472),
             "llada2": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, intermediate_size=384, vocab_size=1472, num_experts=16,
                            num_experts_per_tok=4, moe_intermediate_size=96, n_group=4, topk_group=2)},
    "1b": {"sdar": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=4,
                        head_dim=128, intermediate_size=4608, vocab_size=32000),
           "llada2": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=128, intermediate_size=2816, vocab_size=32000, num_experts=64,
                          num_experts_per_tok=4, moe_intermediate_size=256, n_group=8, topk_group=4)},
}
BLOCK = {"sdar": 4, "llada2": 32}
DECODERS = {"sdar": {"scheduled": None, "threshold 0.85": 0.85, "threshold 0.5": 0.5},
            "llada2": {"scheduled": None, "threshold 0.95": 0.95, "threshold 0.5": 0.5}}


def logit_gap(lm, prompt: str, cfg) -> dict:
    """How far ``block``'s logits are from ``none``'s on one prompt (batch 1): the largest |difference| over
    the steps while both have committed the same tokens (after the first step whose commits differ, the
    canvases differ and so may the logits), and how many of the steps that is. Exact arithmetic gives 0;
    a cached step's forward covers only its block's positions, so a kernel that rounds a row by the
    number of rows it is given can move the logits by the dtype's rounding."""
    from ecache_cli.cache import make_policy
    from ecache_cli.engine import Engine

    engine = Engine.from_loaded(lm)
    ids = engine.encode([prompt], chat=False)
    seen = {}
    for policy in ("none", "block"):
        run = engine.start(ids, cfg, make_policy(policy))
        steps = seen[policy] = []
        run.on_forward = lambda r, plan, q, sources, logits, steps=steps: steps.append(
            [logits.float().cpu().clone(), None])
        for _ in run:
            steps[-1][1] = run.state.tokens.cpu().clone()  # the canvas after the step's commits
    gap, same, differ = 0.0, 0, None
    for (a, ta), (b, tb) in zip(seen["none"], seen["block"]):
        if a.shape != b.shape:
            break
        gap = max(gap, float((a - b).abs().max()))
        same += 1
        if not torch.equal(ta, tb):
            differ = same  # 1-based: the step whose commits differ
            break
    return {"max_abs_logit_diff": gap, "steps_compared": same, "steps": len(seen["none"]),
            "first_differing_step": differ}


def step_cost(lm, prompt: str, cfg, repeats: int) -> dict:
    """Mean ms of a ``block`` step that computes only the current block (a row's later steps in a block), and
    of a bare forward over that block against the cached prefix; their ratio."""
    from ecache_cli.cache import make_policy
    from ecache_cli.engine import Engine

    engine = Engine.from_loaded(lm)
    ids = engine.encode([prompt], chat=False)
    steps, bare = [], []
    sync = torch.cuda.synchronize if lm.device.type == "cuda" else (lambda: None)
    for _ in range(repeats):
        run = engine.start(ids, cfg, make_policy("block"))
        last = time.perf_counter()
        for rec in run:
            sync()
            now = time.perf_counter()
            if int(rec.step_in_block[0]) > 0 and int(rec.query_width) == cfg.block_length:
                steps.append(now - last)
                st = run.state
                if st.batch:  # the same forward alone: the block's positions against the store as it is
                    query = st.span(st.block_start, st.block_end).nonzero()[:, 1][None]
                    store = run.store.clone()
                    with torch.inference_mode():
                        sync()
                        t0 = time.perf_counter()
                        lm.model(st.tokens, store, query_pos=query, logits_pos=query)
                        sync()
                        bare.append(time.perf_counter() - t0)
            last = time.perf_counter()
    step_ms, bare_ms = 1e3 * statistics.fmean(steps), 1e3 * statistics.fmean(bare)
    return {"steps": len(steps), "step_ms": step_ms, "bare_forward_ms": bare_ms, "ratio": step_ms / bare_ms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--families", default="sdar,llada2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU [default 1]")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="decodes timed for the step cost")
    ap.add_argument("--decoders", default=None, help="comma-separated names of DECODERS' entries [default: all]")
    ap.add_argument("--scale", type=float, default=4.0, help="random init scale (larger = more peaked distributions)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)

    from rich.console import Console

    from ecache_cli.decoding.config import DecodeConfig
    from ecache_cli.engine import Engine
    from ecache_cli.models.loader import load_model
    from ecache_cli.models.synthetic import write_random_checkpoint
    from ecache_cli.runs.profile import ProfileOptions, Request, json_line, measure, render_table
    from ecache_cli.runs.settings import Settings

    tmp = Path(tempfile.mkdtemp(prefix="ecache-block-speed-"))
    requests = [Request(prompt_text(args.prompt_len, i)) for i in range(args.prompts)]
    con = Console(width=200)
    doc = {"bench": "block_speed", "size": args.size, "device": args.device, "dtype": args.dtype,
           "threads": torch.get_num_threads(), "prompts": args.prompts,
           "prompt_len": args.prompt_len, "gen_length": args.gen_length, "families": {}}
    for fam in args.families.split(","):
        shape = SIZES[args.size][fam]
        stored = torch.bfloat16 if args.size == "1b" else torch.float32
        d = write_random_checkpoint(tmp / fam, fam, seed=0, scale=args.scale, dtype=stored, **shape)
        lm = load_model(d, device=args.device, dtype=args.dtype)
        spec, bl = lm.spec, BLOCK[fam]
        entry = {"params": spec.n_params, "active_params": spec.n_active_params, "block_length": bl, "runs": {}}
        cfg = DecodeConfig(gen_length=args.gen_length, block_length=bl, steps=args.gen_length)
        entry["logit_gap"] = gap = logit_gap(lm, requests[0].prompt, cfg)
        where = ("the commits never differ" if gap["first_differing_step"] is None else
                 f"the commits differ from step {gap['first_differing_step']} on")
        con.print(f"{fam} block vs none logits (batch 1, one prompt, {args.dtype}): max |Δlogit| "
                  f"{gap['max_abs_logit_diff']:.3g} over {gap['steps_compared']} of {gap['steps']} steps ({where})")
        chosen = DECODERS[fam] if args.decoders is None else {
            n: t for n, t in DECODERS[fam].items() if n in args.decoders.split(",")}
        for name, threshold in chosen.items():
            cfg = DecodeConfig(gen_length=args.gen_length, block_length=bl, threshold=threshold,
                               steps=None if threshold is not None else args.gen_length)
            settings = Settings(decode=cfg, cache="block", cache_params={})
            for bs in [int(b) for b in args.batch_sizes.split(",")]:
                t0 = time.perf_counter()
                rep = measure(Engine.from_loaded(lm), settings, requests,
                              ProfileOptions(policies=["none", "block"], warmup=1, batch_size=bs), chat=False)
                title = (f"{fam} ({spec.n_params / 1e9:.3f}B parameters, {spec.n_active_params / 1e9:.3f}B active; "
                         f"random weights) · {name} · batch {bs} · {torch.get_num_threads()} thread(s) · "
                         f"{args.prompts} prompts x {args.prompt_len} tokens · gen {args.gen_length} block {bl} · "
                         f"{time.perf_counter() - t0:.0f} s")
                con.print(render_table(rep, title, wide=True))
                entry["runs"][f"{name} · batch {bs}"] = {
                    p: {k: s.get(k) for k in ("tokens_per_s", "tokens_per_forward", "nfe_per_request",
                                              "speedup_vs_none", "work_share_vs_none", "fidelity_identical_share")}
                    for p, s in rep.summaries.items()}
        cfg = DecodeConfig(gen_length=args.gen_length, block_length=bl, steps=args.gen_length)
        entry["step_cost"] = sc = step_cost(lm, requests[0].prompt, cfg, args.repeats)
        con.print(f"{fam} block step (current block only, batch 1): {sc['step_ms']:.2f} ms over {sc['steps']} steps; "
                  f"a bare forward over the block against the cached prefix {sc['bare_forward_ms']:.2f} ms: "
                  f"{sc['ratio']:.2f}x (target ≤ 1.3x)")
        doc["families"][fam] = entry
        del lm
        shutil.rmtree(tmp / fam, ignore_errors=True)  # a 1B checkpoint takes gigabytes
    print(json_line(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
