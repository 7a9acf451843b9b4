"""Speed benchmark: EntropyCache vs no cache and Fast-dLLM's caches on the embedded model (CPU targets).

Workloads (``--model tiny`` by default, float32 on CPU unless ``--device``/``--dtype`` say otherwise):
- ``domains``: few-shot prompts of the embedded model's own task domains (arith, code, list), each
  question given as many solved examples as bring its chat-templated prompt to 600-1000 tokens
  (``--shots N``: exactly N each instead, e.g. 4, inside the 0-4 the embedded model was trained on);
- ``gsm8k``: real GSM8K test questions (``--data``), few-shot the same way: the out-of-distribution
  stress case (the tiny model never saw GSM8K's wording).
Each workload runs with one token committed per step (``steps = gen_length``, no parallel decoding) and
with Fast-dLLM threshold decoding (``--threshold``, 0.9), gen length 256, block 32. All measurements
go through ``ecache_cli.runs.profile.measure`` (the code behind ``ecache profile``: warm-up excluded,
rotated policy order, CUDA synced before clock reads); this script only builds prompts, checks the
targets and prints. Targets (ratios within this one process):
- entropy >= 8x tokens/s over none without parallel decoding;
- entropy with threshold decoding >= 20x over plain none (no cache, no parallel decoding);
- entropy faster than dual at equal or better fidelity (token agreement with none);
- entropy's decision overhead <= 0.5 % of run time;
- with ``--batch-sizes`` including 1 and 8: each entropy entry's speedup over none at batch 8 >= 90 % of
  its speedup at batch 1 (each speedup over none at the same batch size, on the same prompts).
Prints one table per (workload, mode, batch size), a batch-size table, the target checks, and a last
stdout line of JSON (``batch``: per workload/mode and batch size, each policy's tokens/s, speedup,
latency and work).

    OMP_NUM_THREADS=2 python bench/speed.py                      # the trained embedded model
    OMP_NUM_THREADS=2 python bench/speed.py --shots 4 --gsm8k-n 0  # prompts in the model's trained range (0-4 shots)
    python bench/speed.py --model random-tiny --n 1 --gsm8k-n 1   # random weights of the same shape
    OMP_NUM_THREADS=1 python bench/speed.py --threads 1 --domains list --n 16 --gsm8k-n 0 --modes plain \
        --batch-sizes 1,8,16 --policies none,dual,entropy,entropy:tau=2.1   # the batch-size table
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
TARGETS = {"plain_speedup": 8.0, "threshold_speedup": 20.0, "decision_overhead_pct": 0.5}


def random_tiny(out: Path) -> Path:
    """A random-weight checkpoint with the embedded model's shape and tokenizer (for development)."""
    import shutil

    from ecache_cli.models.synthetic import write_random_checkpoint

    cfg = json.loads((REPO / "ecache_cli/data/tiny/config.json").read_text()) if (
        REPO / "ecache_cli/data/tiny/config.json").exists() else {}
    write_random_checkpoint(out, "llada", d_model=cfg.get("d_model", 192), n_layers=cfg.get("n_layers", 6),
                            n_heads=cfg.get("n_heads", 4), mlp_hidden=cfg.get("mlp_hidden_size", 576),
                            vocab_size=cfg.get("vocab_size", 1472))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (REPO / "ecache_cli/data/tiny" / f).exists():
            shutil.copyfile(REPO / "ecache_cli/data/tiny" / f, out / f)
    return out


def fewshot_requests(engine, task, n: int, lo: int, hi: int, seed: int, chat: bool, max_shots: int = 48,
                     fixed_shots: int | None = None) -> list:
    """``n`` test questions of ``task``, each with the fewest shots that make its prompt ``lo``..``hi``
    tokens (questions that cannot land in the range are skipped); ``fixed_shots`` given: exactly that many
    solved examples each, whatever the length (the embedded model was trained on 0-4)."""
    from ecache_cli.runs.profile import Request

    out = []
    for ex in task.examples("test", 20 * n + 20, seed):
        if len(out) == n:
            break
        if fixed_shots is not None:
            out.append(Request(task.prompt(ex, fixed_shots, seed), ex, task))
            continue
        for shots in range(1, max_shots + 1):
            prompt = task.prompt(ex, shots, seed)
            length = len(engine.encode([prompt], chat)[0])
            if length > hi:
                break
            if length >= lo:
                out.append(Request(prompt, ex, task))
                break
    return out


def checks(results: dict) -> list[dict]:
    """Target checks from the summaries of each (workload, mode)."""
    rows = []
    for wl in sorted({k[0] for k in results}):
        plain, thr = results.get((wl, "plain")), results.get((wl, "threshold"))
        if plain and "entropy" in plain and "none" in plain:
            e, d = plain["entropy"], plain.get("dual")
            rows.append(dict(workload=wl, target="entropy tok/s over none, no parallel decoding",
                             want=f">= {TARGETS['plain_speedup']}x", got=e["speedup_vs_none"],
                             ok=(e["speedup_vs_none"] or 0) >= TARGETS["plain_speedup"],
                             note=_note(e)))
            if d:
                rows.append(_vs_dual(wl, "plain", e, d))
        if thr and plain and "entropy" in thr and "none" in plain:
            e = thr["entropy"]
            x = e["tokens_per_s"] / plain["none"]["tokens_per_s"]
            rows.append(dict(workload=wl, target="entropy + threshold tok/s over plain none",
                             want=f">= {TARGETS['threshold_speedup']}x", got=x, ok=x >= TARGETS["threshold_speedup"],
                             note=f"{e['speedup_vs_none']:.2f}x over none with the same threshold decoding"))
            if thr.get("dual"):
                rows.append(_vs_dual(wl, "threshold", e, thr["dual"]))
        for mode, summ in (("plain", plain), ("threshold", thr)):
            if summ and "entropy" in summ:
                v = summ["entropy"]["decision_overhead_pct"]
                rows.append(dict(workload=wl, target=f"entropy decision overhead ({mode})",
                                 want=f"<= {TARGETS['decision_overhead_pct']}%", got=v,
                                 ok=v <= TARGETS["decision_overhead_pct"]))
    return rows


def _note(e: dict) -> str:
    lat = e.get("latency_speedup_vs_none")
    return (f"latency speedup {lat:.2f}x; " if lat else "") + (
        f"{e['full_forwards_per_request']:.1f} full / {e['nfe_per_request']:.1f} forwards per request")


def _vs_dual(wl: str, mode: str, e: dict, d: dict) -> dict:
    """Faster = more generated tokens/s and a lower mean latency (they differ when answer lengths do)."""
    fe, fd = e["fidelity_token_agreement"], d["fidelity_token_agreement"]
    x = e["tokens_per_s"] / d["tokens_per_s"]
    lat = d["mean_ms"] / e["mean_ms"]
    return dict(workload=wl, target=f"entropy vs dual ({mode}): faster at >= fidelity",
                want="> 1x tok/s and latency, agree >= dual", got=x,
                ok=x > 1 and lat > 1 and fe is not None and fd is not None and fe >= fd,
                note=f"latency ratio {lat:.2f}x; token agreement with none: "
                     f"entropy {100 * fe:.1f}% vs dual {100 * fd:.1f}%")


# entropy's speedup over none at batch 8 >= 90 % of its speedup at batch 1 (BENCHMARKS.md, Batch sizes)
BATCH_TARGET = 0.9
BATCH_COLUMNS = [("tok/s", "tokens_per_s", "{:.1f}"), ("speedup vs none", "speedup_vs_none", "{:.2f}x"),
                 ("latency mean ms", "mean_ms", "{:.0f}"), ("p95 ms", "p95_ms", "{:.0f}"),
                 ("full/req", "full_forwards_per_request", "{:.1f}"), ("work % of none", "work_share_vs_none", "pct"),
                 ("planned work %", "planned_work_share_vs_none", "pct"),
                 ("token agree %", "fidelity_token_agreement", "pct")]


def batch_checks(by_batch: dict) -> list[dict]:
    """For each entropy entry: its speedup over none at batch 8 against its speedup at batch 1."""
    rows = []
    for wl, mode, bs in sorted(by_batch):
        if bs != 8 or (wl, mode, 1) not in by_batch:
            continue
        one, eight = by_batch[(wl, mode, 1)], by_batch[(wl, mode, 8)]
        for p, s in eight.items():
            if not p.startswith("entropy") or p not in one:
                continue
            a, b = one[p]["speedup_vs_none"], s["speedup_vs_none"]
            if a is None or b is None:
                continue
            rows.append(dict(workload=f"{wl}/{mode}", target=f"{p} speedup at batch 8 over its speedup at batch 1",
                             want=f">= {BATCH_TARGET:.2f}", got=b / a, ok=b / a >= BATCH_TARGET,
                             note=f"{b:.2f}x at batch 8 vs {a:.2f}x at batch 1 over none at the same batch size"))
    return rows


def batch_summary(by_batch: dict) -> dict:
    """JSON: {"workload/mode": {batch size: {policy: {tokens_per_s, speedup_vs_none, mean_ms, ...}}}}."""
    out: dict = {}
    for (wl, mode, bs), summ in sorted(by_batch.items()):
        out.setdefault(f"{wl}/{mode}", {})[str(bs)] = {p: {k: s.get(k) for _, k, _ in BATCH_COLUMNS}
                                                       for p, s in summ.items()}
    return out


def batch_table(by_batch: dict, title: str):
    """A rich Table: one row per (workload/mode, batch size, policy)."""
    from rich.table import Table

    from ecache_cli.runs.profile import cell

    t = Table(title=title)
    for c in ["workload", "batch", "policy"] + [c[0] for c in BATCH_COLUMNS]:
        t.add_column(c, justify="left" if c in ("workload", "policy") else "right")
    for (wl, mode, bs), summ in sorted(by_batch.items()):
        for p, s in summ.items():
            t.add_row(f"{wl}/{mode}", str(bs), p, *[cell(s.get(k), f) for _, k, f in BATCH_COLUMNS])
    return t


def batch_markdown(summary: dict) -> list[str]:
    """The batch-size table (``batch_summary``'s dict) as Markdown lines (none with a single batch size)."""
    from ecache_cli.runs.profile import cell

    if all(len(by_bs) < 2 for by_bs in summary.values()):
        return []
    lines = ["| workload | batch | policy | " + " | ".join(c[0] for c in BATCH_COLUMNS) + " |",
             "|---|---:|---|" + "---:|" * len(BATCH_COLUMNS)]
    for wl, by_bs in summary.items():
        for bs, summ in sorted(by_bs.items(), key=lambda kv: int(kv[0])):
            for p, s in summ.items():
                lines.append(f"| {wl} | {bs} | {p} | " + " | ".join(cell(s.get(k), f) for _, k, f in BATCH_COLUMNS)
                             + " |")
    return lines + [""]


MD_COLUMNS = [("tok/s", "tokens_per_s", "{:.1f}"), ("speedup", "speedup_vs_none", "{:.2f}x"),
              ("latency speedup", "latency_speedup_vs_none", "{:.2f}x"), ("latency mean ms", "mean_ms", "{:.0f}"),
              ("p95 ms", "p95_ms", "{:.0f}"), ("NFE/req", "nfe_per_request", "{:.1f}"),
              ("full/req", "full_forwards_per_request", "{:.1f}"), ("work % of none", "work_share_vs_none", "pct"),
              ("decision %", "decision_overhead_pct", "{:.3f}"), ("identical %", "fidelity_identical_share", "pct"),
              ("token agree %", "fidelity_token_agreement", "pct"), ("score", "score", "{:.2f}")]


def markdown(doc: dict) -> str:
    """The bench's tables and checks as Markdown (for BENCHMARKS.md)."""
    from ecache_cli.runs.profile import cell

    lines = []
    for name, wl in doc["workloads"].items():
        lines += [f"**{name}** ({len(wl['requests']) // max(len(wl['policies']), 1)} prompts, "
                  f"{doc['prompt_tokens'][name.split('/')[0]]} prompt tokens)", "",
                  "| policy | " + " | ".join(c[0] for c in MD_COLUMNS) + " |",
                  "|---|" + "---:|" * len(MD_COLUMNS)]
        for p, s in wl["policies"].items():
            lines.append(f"| {p} | " + " | ".join(cell(s.get(k), f) for _, k, f in MD_COLUMNS) + " |")
        lines.append("")
    lines += batch_markdown(doc.get("batch", {}))
    lines += ["| workload | target | want | got | met | note |", "|---|---|---|---|---|---|"]
    for r in doc["checks"]:
        got = "–" if r["got"] is None else f"{r['got']:.2f}" + ("%" if "overhead" in r["target"] else "x")
        lines.append(f"| {r['workload']} | {r['target']} | {r['want']} | {got} | {'yes' if r['ok'] else 'no'} | "
                     f"{r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny",
                    help="tiny (embedded), random-tiny (random weights, same shape) or a directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads [default: OMP_NUM_THREADS or torch's]")
    ap.add_argument("--n", type=int, default=2, help="prompts per task domain (arith, code, list)")
    ap.add_argument("--domains", default="arith,code,list", help="task domains of the domains workload")
    ap.add_argument("--batch-sizes", default="1", help="comma list: measure every workload at each batch size "
                                                         "(e.g. 1,8,16; speedups are over none at the same size)")
    ap.add_argument("--gsm8k-n", type=int, default=3, help="GSM8K questions (0 skips the workload)")
    ap.add_argument("--data", default=str(DEFAULT_GSM8K), help="GSM8K test.jsonl")
    ap.add_argument("--min-prompt", type=int, default=600)
    ap.add_argument("--max-prompt", type=int, default=1000)
    ap.add_argument("--shots", type=int, default=None,
                    help="exactly this many solved examples per prompt instead of filling --min/--max-prompt tokens "
                         "(e.g. 4: the embedded model's trained range, so its score means something)")
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--modes", default="plain,threshold")
    ap.add_argument("--policies", default="none,prefix,dual,entropy")
    ap.add_argument("--tau", type=float, default=None, help="EntropyCache tau [default: the model's profile, else 1.0]")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-dir", type=Path, default=None, help="also write torch.profiler traces per workload/mode")
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON document to this file")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the tables as Markdown to this file")
    args = ap.parse_args(argv)
    from bench_args import check_domains  # bench/, the script's folder

    check_domains(ap, args.domains)

    import torch
    from rich.console import Console

    from ecache_cli.engine.core import Engine
    from ecache_cli.models.loader import load_model
    from ecache_cli.runs.manifest import manifest
    from ecache_cli.runs.profile import ProfileOptions, json_line, measure, render_table
    from ecache_cli.runs.settings import resolve_settings
    from ecache_cli.tasks import get_task

    if args.threads:
        torch.set_num_threads(args.threads)
    con = Console(file=sys.stdout, width=240)
    log = Console(stderr=True)
    model_label = args.model
    if args.model == "random-tiny":
        path = random_tiny(Path(tempfile.mkdtemp(prefix="ecache-random-tiny-")))
        lm = load_model(path, args.device, args.dtype)
        model_label = "random-tiny (RANDOM WEIGHTS: speed only, outputs meaningless)"
    else:
        lm = load_model(args.model, args.device, args.dtype)
    engine = Engine.from_loaded(lm)
    chat = lm.chat
    workloads = {"domains": [], "gsm8k": []}
    for name in args.domains.split(","):
        workloads["domains"] += fewshot_requests(engine, get_task(name), args.n, args.min_prompt, args.max_prompt,
                                                 args.seed, chat, fixed_shots=args.shots)
    if args.gsm8k_n > 0:
        workloads["gsm8k"] = fewshot_requests(engine, get_task("gsm8k", data=args.data), args.gsm8k_n,
                                              args.min_prompt, args.max_prompt, args.seed, chat, fixed_shots=args.shots)
    workloads = {k: v for k, v in workloads.items() if v}
    lengths = {k: [len(x) for x in engine.encode([r.prompt for r in v], chat)] for k, v in workloads.items()}
    log.print(f"model {model_label} · {lm.device} {lm.dtype} · threads {torch.get_num_threads()} · "
              f"prompt tokens {lengths}")

    policies = args.policies.split(",")
    results, docs = {}, {}
    t_all = time.perf_counter()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    by_batch: dict[tuple, dict] = {}  # (workload, mode, batch size) -> summaries
    for wl, reqs in workloads.items():
        for mode in args.modes.split(","):
            flags = dict(gen_length=args.gen_length, block_length=args.block_length,
                         threshold=args.threshold if mode == "threshold" else None)
            settings = resolve_settings(args.model if args.model != "random-tiny" else "random-tiny", flags,
                                        {"tau": args.tau})
            for bs in batch_sizes:
                name = f"{wl}/{mode}" + (f"/batch{bs}" if bs != 1 else "")
                opts = ProfileOptions(policies=policies, warmup=args.warmup, repeats=args.repeats, seed=args.seed,
                                      batch_size=bs, trace_dir=args.trace_dir / name.replace("/", "-")
                                      if args.trace_dir and bs == batch_sizes[0] else None)
                t0 = time.perf_counter()
                rep = measure(engine, settings, reqs, opts, chat=chat,
                              on_run=lambda kind, p, name=name: log.print(f"{name}: {kind} {p}", highlight=False))
                log.print(f"{name} took {time.perf_counter() - t0:.0f} s")
                con.print(render_table(rep, wide=True, title=f"{wl} · {mode} · batch {bs} · {len(reqs)} prompts "
                                            f"({min(lengths[wl])}-{max(lengths[wl])} tokens) · gen {args.gen_length} "
                                            f"block {args.block_length}"
                                            + (f" threshold {args.threshold}" if mode == "threshold" else "")))
                if bs == batch_sizes[0]:
                    results[(wl, mode)] = rep.summaries
                by_batch[(wl, mode, bs)] = rep.summaries
                docs[name] = rep.to_dict(None)
                if rep.trace:
                    for p, info in rep.trace["policies"].items():
                        log.print(f"{name} {p} traced forwards (ms): {json.dumps(info['forward_breakdown'])}",
                                  highlight=False, markup=False)
    total_s = time.perf_counter() - t_all

    from rich.table import Table

    rows = checks(results) + batch_checks(by_batch)
    if len(batch_sizes) > 1:
        con.print(batch_table(by_batch, f"batch sizes · {model_label} · speedup over none at the same batch size"))
    t = Table(title=f"targets · {model_label}")
    for c in ("workload", "target", "want", "got", "ok", "note"):
        t.add_column(c)
    for r in rows:
        got = f"{r['got']:.2f}" + ("%" if "overhead" in r["target"] else "x") if r["got"] is not None else "–"
        t.add_row(r["workload"], r["target"], r["want"], got, "yes" if r["ok"] else "NO", r.get("note", ""))
    con.print(t)
    doc = {"command": "bench/speed.py", "date": datetime.date.today().isoformat(), "model_label": model_label,
           "total_s": total_s, "prompt_tokens": lengths, "targets": TARGETS, "checks": rows,
           "args": {k: str(v) for k, v in vars(args).items()},
           "manifest": manifest(lm, None, args.seed, {"omp_num_threads": os.environ.get("OMP_NUM_THREADS")}),
           "workloads": docs, "batch": batch_summary(by_batch)}
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(doc))
    line = json_line(doc)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(line + "\n")
    sys.stdout.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
