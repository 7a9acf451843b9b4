"""Caching on a mixture-of-experts model: LLaDA-MoE-shaped random checkpoints beside dense ones of the same
active size.

For each ``--size`` two random checkpoints of the LLaDA-MoE family are written
(``write_random_checkpoint``): the MoE one (every layer ``n_experts`` SwiGLU experts, top-``k``), and a dense
twin identical but for its feed-forward (every layer dense, width k × expert width: the same active
parameters a token uses). Each is decoded with ``none``, ``dual`` and ``entropy`` through
``ecache_cli.runs.profile.measure`` (the code behind ``ecache profile``: warm-up excluded, rotated order), one
token per step, and the table gives tokens/s, the speedup over ``none`` of the same model, the work share
(positions × layers computed over ``none``'s) and the fidelity (token agreement with ``none``). Then the
share of a step spent in the experts (router, grouped experts, weighted sum: the MoE modules' time, by
forward hooks) for a full forward and for a partial forward of one block, and the partial forward's cost
as a share of the full one's (on the dense twin too, for comparison).

Random weights: the outputs are meaningless and EntropyCache's refresh rate depends on how peaked the
random distributions are (``--scale``), so the table measures the cost of full and partial forwards on
each architecture, not a policy's accuracy. Prints the tables and a last stdout line of JSON.

    OMP_NUM_THREADS=1 python bench/moe_speed.py --size tiny            # the embedded model's scale (~1 min)
    OMP_NUM_THREADS=1 python bench/moe_speed.py --size 1b --prompts 1 --prompt-len 96 --gen-length 32
    python bench/moe_speed.py --size 1b --device cuda --dtype bfloat16   # bench/gpu_check.sh step 5
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from gpu_speed import prompt_text  # the same word-like prompts (this folder is on sys.path)

# tiny: the embedded model's scale (d 128, 4 layers, dense width 384 = 4 experts x 96 active);
# 1b: about 1.0B parameters, 0.33B active (16 x (4 d^2 + 32 x 3 d e) + 2 x vocab x d, d 1024, e 512, k 4)
SIZES = {
    "tiny": dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=1472, experts=16, top_k=4,
                 expert_hidden=96),
    "1b": dict(d_model=1024, n_layers=16, n_heads=16, n_kv_heads=16, vocab_size=32000, experts=32, top_k=4,
               expert_hidden=512),
}


def checkpoint(out: Path, size: dict, moe: bool, scale: float, dtype: torch.dtype) -> Path:
    """A random LLaDA-MoE-family checkpoint of ``size``: MoE in every layer, or dense at k × expert width."""
    from ecache_cli.models.synthetic import write_random_checkpoint

    L = size["n_layers"]
    return write_random_checkpoint(
        out, "llada-moe", seed=0, scale=scale, dtype=dtype, hidden_size=size["d_model"], num_hidden_layers=L,
        num_attention_heads=size["n_heads"], num_key_value_heads=size["n_kv_heads"], vocab_size=size["vocab_size"],
        num_experts=size["experts"], num_experts_per_tok=size["top_k"], expert_intermediate_size=size["expert_hidden"],
        dense_intermediate_size=size["top_k"] * size["expert_hidden"], moe_layer_freq=[1 if moe else 0] * L)


def expert_share(lm, prompt: str, block: int, repeats: int = 3) -> dict:
    """Seconds of a full forward and of a partial forward over one block's positions, and the share of each
    spent inside the MoE modules (forward pre/post hooks on every layer's MoE block; synced on CUDA)."""
    m, dev = lm.model, lm.device
    ids = torch.tensor([lm.tokenizer(prompt, add_special_tokens=False)["input_ids"] + [lm.spec.mask_id] * block],
                       device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    spent, opened = [0.0], []
    mods = [m.parts(i).moe for i in range(lm.spec.n_layers) if m.parts(i).moe is not None]

    def enter(mod, args):
        sync()
        opened.append(time.perf_counter())

    def leave(mod, args, out):
        sync()
        spent[0] += time.perf_counter() - opened.pop()

    handles = [h for mod in mods for h in (mod.register_forward_pre_hook(enter), mod.register_forward_hook(leave))]
    T = ids.shape[1]
    query = torch.arange(T - block, T, device=dev)[None]
    out = {}
    try:
        with torch.inference_mode():
            store = m.new_store(torch.ones_like(ids, dtype=torch.bool))
            for name, kw in (("full", {}), ("partial", {"query_pos": query})):
                m(ids, store, **kw)  # warm-up
                spent[0], total = 0.0, 0.0
                for _ in range(repeats):
                    sync()
                    t0 = time.perf_counter()
                    m(ids, store, **kw)
                    sync()
                    total += time.perf_counter() - t0
                out[name] = {"ms": 1e3 * total / repeats, "expert_pct": 100.0 * spent[0] / total,
                             "positions": T if name == "full" else block}
    finally:
        for h in handles:
            h.remove()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU [default 1]")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--policies", default="none,dual,entropy,entropy:tau=3",
                    help="entropy:tau=3 refreshes less on random weights, whose entropies run high")
    ap.add_argument("--tau", type=float, default=1.0)
    ap.add_argument("--scale", type=float, default=4.0, help="random init scale (larger = more peaked distributions)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)

    from rich.console import Console

    from ecache_cli.decoding.config import DecodeConfig
    from ecache_cli.engine import Engine
    from ecache_cli.models.loader import load_model
    from ecache_cli.runs.profile import ProfileOptions, Request, json_line, measure, render_table
    from ecache_cli.runs.settings import Settings

    size = SIZES[args.size]
    tmp = Path(tempfile.mkdtemp(prefix="ecache-moe-speed-"))
    cfg = DecodeConfig(gen_length=args.gen_length, block_length=args.block_length)
    settings = Settings(decode=cfg, cache="entropy", cache_params={"tau": args.tau}, all_cache_params={"tau": args.tau})
    requests = [Request(prompt_text(args.prompt_len, i)) for i in range(args.prompts)]
    con = Console(width=200)
    doc = {"bench": "moe_speed", "size": args.size, "shape": size, "device": args.device, "dtype": args.dtype,
           "threads": torch.get_num_threads(), "models": {}}
    for kind in ("moe", "dense"):
        t0 = time.perf_counter()
        stored = torch.bfloat16 if args.size == "1b" else torch.float32  # the 1B checkpoint: half the disk
        d = checkpoint(tmp / kind, size, kind == "moe", args.scale, stored)
        lm = load_model(d, device=args.device, dtype=args.dtype)
        spec = lm.spec
        rep = measure(Engine.from_loaded(lm), settings, requests,
                      ProfileOptions(policies=args.policies.split(","), warmup=1), chat=False)
        title = (f"{kind} ({spec.n_params / 1e9:.3f}B parameters, {spec.n_active_params / 1e9:.3f}B active; random "
                 f"weights) · {args.device} {args.dtype} · {torch.get_num_threads()} thread(s) · {args.prompts} "
                 f"prompts x {args.prompt_len} tokens · gen {args.gen_length} block {args.block_length} · "
                 f"{time.perf_counter() - t0:.0f} s")
        con.print(render_table(rep, title, wide=True))
        entry = {"params": spec.n_params, "active_params": spec.n_active_params,
                 "policies": {p: {k: s.get(k) for k in ("tokens_per_s", "speedup_vs_none", "work_share_vs_none",
                                                        "fidelity_token_agreement", "fidelity_identical_share")}
                              for p, s in rep.summaries.items()}}
        entry["step"] = s = expert_share(lm, requests[0].prompt, args.block_length)
        con.print(f"a step ({kind}): full forward over {s['full']['positions']} positions {s['full']['ms']:.1f} ms, "
                  f"{s['full']['expert_pct']:.1f}% in the MoE blocks; partial forward over {s['partial']['positions']} "
                  f"positions {s['partial']['ms']:.1f} ms ({100 * s['partial']['ms'] / s['full']['ms']:.0f}% of the "
                  f"full one), {s['partial']['expert_pct']:.1f}% in the MoE blocks")
        doc["models"][kind] = entry
        del lm
    moe, dense = doc["models"]["moe"]["policies"], doc["models"]["dense"]["policies"]
    con.print("policy     moe tok/s  dense tok/s  moe speedup  dense speedup")
    for p in moe:
        sp = lambda s: "–" if s["speedup_vs_none"] is None else f"{s['speedup_vs_none']:.2f}x"  # noqa: E731
        con.print(f"{p:10s} {moe[p]['tokens_per_s']:9.1f}  {dense[p]['tokens_per_s']:11.1f}  {sp(moe[p]):>11s}  "
                  f"{sp(dense[p]):>13s}")
    print(json_line(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
