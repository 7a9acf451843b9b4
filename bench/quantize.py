"""Quantized weights (``--quantize``) on CPU: weight bytes, load and run memory, tokens/s and fidelity.

Each (model, dtype, format) runs in a fresh process (so its peak RSS is its own): load the model with
``load_model(..., quantize=...)``, record the stored weight bytes (``models/quantize.weight_bytes``) and the
load's peak RSS growth (``ru_maxrss`` minus the RSS before loading), then ``runs.profile.measure`` (the code
behind ``ecache profile``) with ``none`` and ``entropy`` (the model's profile τ) on

- the embedded model: ``--limit`` test examples of each task domain (arith, code, list), scored, with each
  answer compared to float32's under the same policy (identical answers, per domain);
- ``--big``: a LLaDA-shaped random checkpoint of ``bench/gpu_speed.py`` ``SIZES["1b"]`` (written once under
  ``--work``), ``--prompts`` prompts of ``--prompt-len`` characters, gen length ``--big-gen`` (random
  weights: speed and memory only).

A table on stdout, then one JSON line with every number.

    python bench/quantize.py --limit 20 --threads 1            # embedded model only
    python bench/quantize.py --limit 20 --threads 1 --big      # and the 1B shape (minutes, ~5 GB RAM)
    python bench/quantize.py --device cuda --no-tiny --big --big-gen 64 --prompts 4 --prompt-len 512 \
        --configs bfloat16:none,bfloat16:int8,bfloat16:int4,bfloat16:fp8    # bench/gpu_check.sh step 6
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = [("float32", "none"), ("bfloat16", "none"), ("float32", "int8"), ("bfloat16", "int8"),
           ("bfloat16", "int4")]
DOMAINS = ("arith", "code", "list")


def rss() -> int:
    from ecache_cli.metrics.memory import current_rss

    return current_rss() or 0


def one(args) -> dict:
    """One (model, dtype, format) in this process; returns its numbers."""
    import torch

    torch.set_num_threads(args.threads)
    from ecache_cli.engine.core import Engine
    from ecache_cli.models.loader import load_model
    from ecache_cli.models.quantize import weight_bytes
    from ecache_cli.runs.profile import ProfileOptions, Request, measure, task_requests
    from ecache_cli.runs.settings import resolve_settings
    from ecache_cli.tasks import get_task

    if args.fmt != "none":  # torchao's import (~85 MB RSS) is not the load's: measured apart
        t_rss = rss()
        from ecache_cli.models.quantize import Quantization, require_torchao

        require_torchao(Quantization(args.fmt))
        import_bytes = rss() - t_rss
    else:
        import_bytes = 0
    from ecache_cli.metrics.memory import _CLEAR_REFS, _read_hwm

    _CLEAR_REFS.write_text("5")  # VmHWM := RSS now (ru_maxrss would hold the parent's peak across exec)
    before = rss()
    t0 = time.perf_counter()
    lm = load_model(args.model, args.device, args.dtype, quantize=None if args.fmt == "none" else args.fmt)
    load_s = time.perf_counter() - t0
    if lm.device.type == "cuda":  # CUDA: the load's peak allocated bytes
        growth = torch.cuda.max_memory_allocated(lm.device)
    else:  # CPU: the load's peak RSS (VmHWM, reset just before) minus the RSS before loading
        growth = _read_hwm() - before
    out = {"model": args.label, "device": lm.device.type, "dtype": args.dtype, "quantize": args.fmt,
           "weight_bytes": weight_bytes(lm.model), "load_s": round(load_s, 2), "load_peak_growth_bytes": growth,
           "rss_after_load_growth_bytes": rss() - before, "torchao_import_bytes": import_bytes, "domains": {}}
    engine = Engine.from_loaded(lm)
    opts = ProfileOptions(policies=["none", "entropy"], warmup=args.warmup)
    if args.label == "tiny":
        settings = resolve_settings("tiny", {"gen_length": args.gen, "block_length": args.block}, {})
        tasks = {d: get_task(d, allow_code_execution=True) for d in DOMAINS}
        work = {d: task_requests(t, args.limit, t.default_shots, 0) for d, t in tasks.items()}
    else:
        settings = resolve_settings(args.model, {"gen_length": args.gen, "block_length": args.block}, {"tau": 1.0})
        import random
        import string

        rng = random.Random(0)
        text = ["".join(rng.choice(string.ascii_lowercase + " ") for _ in range(args.prompt_len))
                for _ in range(args.prompts)]
        work = {"random": [Request(prompt=t) for t in text]}
    for name, reqs in work.items():
        rep = measure(engine, settings, reqs, opts, chat=lm.chat)
        out["domains"][name] = {p: {"tokens_per_s": s["tokens_per_s"], "score": s["score"],
                                    "peak_memory_bytes": s["peak_memory_bytes"],
                                    "peak_growth_bytes": s.get("peak_growth_bytes"),
                                    "texts": [r.text for run in rep.runs[p] for r in run.rows]}
                                for p, s in rep.summaries.items()}
    return out


def run_child(model: str, label: str, dtype: str, fmt: str, args) -> dict | None:
    cmd = [sys.executable, __file__, "--one", "--model", model, "--label", label, "--dtype", dtype, "--fmt", fmt,
           "--device", args.device,
           "--threads", str(args.threads), "--limit", str(args.limit), "--warmup", str(args.warmup),
           "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len),
           "--gen", str(args.gen if label == "tiny" else args.big_gen),
           "--block", str(args.block if label == "tiny" else args.big_gen)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        line = (p.stderr.strip().splitlines() or ["?"])[-1]
        print(f"{label} {dtype} {fmt}: skipped ({line})", file=sys.stderr, flush=True)
        return None
    result = json.loads(p.stdout.strip().splitlines()[-1])
    print(progress_line(result), file=sys.stderr, flush=True)  # a run cut short keeps the configs done
    return result


def progress_line(r: dict) -> str:
    """One finished (model, dtype, format): weight MiB, load peak growth MiB, and tokens/s of none and entropy
    (the mean over its domains)."""
    doms = r["domains"].values()
    tps = {p: sum(d[p]["tokens_per_s"] for d in doms) / max(1, len(doms)) for p in ("none", "entropy")}
    return (f"{r['model']} {r['dtype']} {r['quantize']}: weights {r['weight_bytes'] / 2**20:.1f} MiB, load peak "
            f"+{r['load_peak_growth_bytes'] / 2**20:.1f} MiB, {r['load_s']} s; tok/s none {tps['none']:.1f}, "
            f"entropy {tps['entropy']:.1f}")


def table(results: list[dict]) -> str:
    mib = lambda b: f"{b / 2**20:.1f}" if b is not None else "–"  # noqa: E731
    rows = ["| model | dtype | weights | weight MiB | load peak +MiB | after load +MiB | run peak +MiB (none) | "
            "tok/s none | tok/s entropy | score none (arith/code/list) | score entropy | "
            "identical vs float32 (none / entropy) |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    ref = {r["model"]: r for r in results if r["dtype"] == "float32" and r["quantize"] == "none"}
    for r in results:
        doms = r["domains"]
        tps = {p: sum(d[p]["tokens_per_s"] for d in doms.values()) / len(doms) for p in ("none", "entropy")}
        score = {p: "/".join("–" if d[p]["score"] is None else f"{100 * d[p]['score']:.0f}" for d in doms.values())
                 for p in ("none", "entropy")}
        base = ref.get(r["model"])
        ident = {}
        for p in ("none", "entropy"):
            if base is None or r["model"] != "tiny":
                ident[p] = "–"
                continue
            pairs = [(a, b) for name in doms for a, b in zip(doms[name][p]["texts"], base["domains"][name][p]["texts"])]
            ident[p] = f"{100 * sum(a == b for a, b in pairs) / max(1, len(pairs)):.1f}%"
        growth = max((d["none"]["peak_growth_bytes"] or 0) for d in doms.values())
        rows.append(f"| {r['model']} | {r['dtype']} | {r['quantize']} | {mib(r['weight_bytes'])} | "
                    f"{mib(r['load_peak_growth_bytes'])} | {mib(r.get('rss_after_load_growth_bytes'))} | "
                    f"{mib(growth)} | {tps['none']:.1f} | {tps['entropy']:.1f} | "
                    f"{score['none'] if r['model'] == 'tiny' else '–'} | "
                    f"{score['entropy'] if r['model'] == 'tiny' else '–'} | {ident['none']} / {ident['entropy']} |")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--label", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--fmt", default="none")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--configs", default=",".join(f"{d}:{f}" for d, f in CONFIGS),
                    help="dtype:format pairs, e.g. bfloat16:none,bfloat16:int8,bfloat16:int4,bfloat16:fp8")
    ap.add_argument("--no-tiny", action="store_true", help="skip the embedded model (the GPU check)")
    ap.add_argument("--limit", type=int, default=20, help="examples per domain (embedded model)")
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--big", action="store_true", help="also the 1B LLaDA-shaped random checkpoint")
    ap.add_argument("--big-gen", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ecache-bench-quantize"))
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args)))
        return
    configs = [tuple(c.split(":")) for c in args.configs.split(",")]
    results = [] if args.no_tiny else [r for dt, fmt in configs if (r := run_child("tiny", "tiny", dt, fmt, args))]
    if args.big:
        sys.path.insert(0, str(Path(__file__).parent))
        from gpu_speed import SIZES

        from ecache_cli.models.synthetic import write_random_checkpoint

        ckpt = args.work / "llada-1b"
        if not (ckpt / "config.json").exists():
            import torch

            write_random_checkpoint(ckpt, "llada", dtype=torch.bfloat16, scale=4.0, **SIZES["1b"])
        results += [r for dt, fmt in configs if (r := run_child(str(ckpt), "llada-1b", dt, fmt, args)) is not None]
    print(table(results))
    for r in results:
        for d in r["domains"].values():
            for p in d.values():
                p.pop("texts")
    print(json.dumps({"bench": "quantize", "device": args.device, "threads": args.threads, "limit": args.limit,
                      "results": results}))


if __name__ == "__main__":
    main()
