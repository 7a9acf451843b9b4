"""Speed comparison on a larger random-weight LLaDA-shaped model (about 1B parameters) on a GPU.

Writes a random checkpoint with ``write_random_checkpoint(..., dtype=torch.bfloat16, d_model=...)`` (the
sizes of ``SIZES[--size]``), loads it on ``--device`` and runs ``ecache_cli.runs.profile.measure`` (the
code behind ``ecache profile``) on prompts of ``--prompt-len`` tokens (the checkpoint's tokenizer is
character-level: one token per character) with gen length 256, block 32, without and with threshold
decoding. Random weights: the outputs are meaningless and EntropyCache's refresh rate depends on how
peaked the random distributions are (``--scale``), so the table measures the cost of full and partial
forwards and of the decisions, not a policy's accuracy. Writes the tables as text and the numbers as
JSON under ``--out``.

    python bench/gpu_speed.py --size 1b --out runs_out/gpu            # on a CUDA machine
    python bench/gpu_speed.py --size tiny --device cpu --dtype float32 --out /tmp/g   # dry run
    python bench/gpu_speed.py --size 1b --modes plain --batch-sizes 1,8,16 --prompts 16 --prompt-len 512 \
        --gen-length 128 --policies none,dual,entropy --out runs_out/gpu/batch   # batch sizes (gpu_check.sh step 3)

With several ``--batch-sizes`` it also prints, per (mode, batch size, policy), tokens/s, the speedup
over ``none`` at the same batch size, mean latency and the share of wall time spent outside forwards.
"""

from __future__ import annotations

import argparse
import random
import string
import sys
import tempfile
import time
from pathlib import Path

import torch

# about 1.06B parameters: 18 x (4 d^2 + 3 d m) + 2 x vocab x d with d 2048, m 5632, vocab 32000
SIZES = {
    "1b": dict(d_model=2048, n_layers=18, n_heads=16, mlp_hidden=5632, vocab_size=32000),
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, mlp_hidden=128, vocab_size=128),
}


def prompt_text(n: int, seed: int) -> str:
    """``n`` characters of word-like text (the character tokenizer makes it ``n`` tokens)."""
    rng = random.Random(seed)
    words = []
    while sum(len(w) + 1 for w in words) < n:
        words.append("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8))))
    return " ".join(words)[:n]


def outside_forwards(s: dict) -> dict:
    """A policy's batch numbers: tokens/s, speedup over none (same batch size), mean latency (ms) and the
    share of the run's wall time spent outside the model's forwards (%: decision, sampling/commit and
    the engine's own bookkeeping and syncs)."""
    return {"tokens_per_s": s["tokens_per_s"], "speedup_vs_none": s["speedup_vs_none"], "mean_ms": s["mean_ms"],
            "outside_forward_pct": 100.0 - s["forward_pct"], "decision_pct": s["decision_overhead_pct"],
            "work_share_vs_none": s["work_share_vs_none"]}


def batch_lines(batch: dict) -> str:
    """The batch-size summary as plain text, one line per (mode, batch size, policy)."""
    out = ["mode       batch  policy          tok/s  speedup  mean ms  outside forwards %  decision %"]
    for mode, by_bs in batch.items():
        for bs, pols in by_bs.items():
            for p, v in pols.items():
                sp = "–" if v["speedup_vs_none"] is None else f"{v['speedup_vs_none']:.2f}x"
                out.append(f"{mode:10s} {bs:>5s}  {p:14s} {v['tokens_per_s']:7.1f}  {sp:>7s}  {v['mean_ms']:7.0f}  "
                           f"{v['outside_forward_pct']:18.1f}  {v['decision_pct']:10.2f}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--policies", default="none,prefix,dual,entropy")
    ap.add_argument("--tau", type=float, default=1.0)
    ap.add_argument("--scale", type=float, default=4.0, help="random init scale (larger = more peaked distributions)")
    ap.add_argument("--modes", default="plain,threshold", help="plain (one token per step) and/or threshold")
    ap.add_argument("--batch-sizes", default="1", help="comma list of batch sizes, e.g. 1,8,16 (speedups are over "
                                                       "none at the same batch size)")
    ap.add_argument("--out", type=Path, default=Path("runs_out/gpu"))
    args = ap.parse_args(argv)

    from rich.console import Console

    from ecache_cli.decoding.config import DecodeConfig
    from ecache_cli.engine import Engine
    from ecache_cli.models.loader import load_model
    from ecache_cli.models.synthetic import write_random_checkpoint
    from ecache_cli.runs.manifest import manifest
    from ecache_cli.runs.profile import (
        ProfileOptions,
        Request,
        json_line,
        measure,
        render_table,
    )
    from ecache_cli.runs.settings import Settings

    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ckpt = write_random_checkpoint(Path(tempfile.mkdtemp(prefix="ecache-gpu-speed-")) / args.size, "llada", seed=0,
                                   scale=args.scale, dtype=torch.bfloat16, **SIZES[args.size])
    lm = load_model(ckpt, device=args.device, dtype=args.dtype)
    n_params = sum(p.numel() for p in lm.model.parameters())
    print(f"checkpoint {args.size}: {n_params / 1e9:.3f}B parameters, "
          f"written and loaded in {time.perf_counter() - t0:.0f} s", flush=True)
    engine = Engine.from_loaded(lm)
    requests = [Request(prompt_text(args.prompt_len, i)) for i in range(args.prompts)]
    table_file = args.out / "gpu_speed_table.txt"
    con = Console(file=table_file.open("w"), width=240)
    echo = Console(width=240)
    docs, batch = {}, {}
    thresholds = {"plain": None, "threshold": args.threshold}
    for mode in args.modes.split(","):
        threshold = thresholds[mode]
        cfg = DecodeConfig(gen_length=args.gen_length, block_length=args.block_length, threshold=threshold)
        settings = Settings(decode=cfg, cache="entropy", cache_params={"tau": args.tau},
                            all_cache_params={"tau": args.tau})
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            t1 = time.perf_counter()
            rep = measure(engine, settings, requests,
                          ProfileOptions(policies=args.policies.split(","), warmup=1, batch_size=bs), chat=False)
            title = (f"{args.size} ({n_params / 1e9:.2f}B, random weights) · {lm.device} {args.dtype} · {mode} · "
                     f"batch {bs} · {args.prompts} prompts x {args.prompt_len} tokens · gen {args.gen_length} block "
                     f"{args.block_length}" + (f" threshold {threshold}" if threshold else "")
                     + f" · {time.perf_counter() - t1:.0f} s")
            for c in (con, echo):
                c.print(render_table(rep, title, wide=True))
            docs[mode if bs == 1 else f"{mode}/batch{bs}"] = rep.to_dict(None)
            batch.setdefault(mode, {})[str(bs)] = {p: outside_forwards(s) for p, s in rep.summaries.items()}
    for c in (con, echo):
        c.print(batch_lines(batch))
    doc = {"bench": "gpu_speed", "size": args.size, "params": n_params,
           "args": {k: str(v) for k, v in vars(args).items()},
           "manifest": manifest(lm, None, 0), "modes": docs, "batch": batch, "total_s": time.perf_counter() - t0}
    (args.out / "gpu_speed.json").write_text(json_line(doc) + "\n")
    print(f"table: {table_file}; numbers: {args.out / 'gpu_speed.json'}; total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
