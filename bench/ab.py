"""Before/after speed: ``bench/speed.py`` from two source trees, side by side in one run.

Runs ``bench/speed.py`` of tree A and of tree B in alternation (A, B, A, B, ...: ``--passes`` each), every
pass in a fresh process importing that tree's ``ecache_cli`` (PYTHONPATH), with the same arguments and
pinned threads, so both see the same machine load. Prints, per workload/mode (and batch size) and policy,
the median over the passes of each tree's tokens/s, speedup over ``none``, work efficiency (speedup ×
planned work share of ``none``), decision overhead and token agreement with ``none``, and B/A of tokens/s,
then a last stdout line of JSON.

    git worktree add /tmp/before HEAD~1
    OMP_NUM_THREADS=1 python bench/ab.py /tmp/before . --passes 3 -- --threads 1 --shots 4 --gsm8k-n 0 --n 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

KEYS = ("tokens_per_s", "speedup_vs_none", "work_efficiency", "decision_overhead_pct", "fidelity_token_agreement")


def one_pass(tree: Path, speed_args: list[str], out: Path) -> dict:
    """Run ``tree``'s bench/speed.py once; returns {workload name: {policy: summary}} from its JSON."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "bench" / "speed.py"), *speed_args, "--json", str(out)]
    subprocess.run(cmd, env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    return {name: wl["policies"] for name, wl in json.loads(out.read_text())["workloads"].items()}


def _value(summary: dict, key: str):
    """A summary's ``key``; work efficiency from speedup × planned work share where a tree lacks the key."""
    if key == "work_efficiency" and summary.get(key) is None:
        speedup, share = summary.get("speedup_vs_none"), summary.get("planned_work_share_vs_none")
        return None if speedup is None or share is None else speedup * share
    return summary.get(key)


def medians(passes: list[dict]) -> dict:
    """{(workload name, policy): {key: median over the passes}} for every key in :data:`KEYS`."""
    keys = {(name, p) for doc in passes for name, pol in doc.items() for p in pol}
    out = {}
    for name, p in sorted(keys):
        vals = [doc[name][p] for doc in passes if p in doc.get(name, {})]
        out[(name, p)] = {}
        for k in KEYS:
            got = [v for v in (_value(s, k) for s in vals) if v is not None]
            out[(name, p)][k] = statistics.median(got) if got else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path, help="tree A (before), a checkout holding bench/speed.py and ecache_cli/")
    ap.add_argument("b", type=Path, help="tree B (after)")
    ap.add_argument("--passes", type=int, default=3, help="passes per tree (median reported)")
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after --: the arguments for bench/speed.py
    args = ap.parse_args(argv[:cut])
    speed_args = argv[cut + 1:]
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.passes):
            for name in ("a", "b"):
                tree = getattr(args, name).resolve()
                runs[name].append(one_pass(tree, speed_args, Path(tmp) / f"{name}{i}.json"))
                print(f"pass {i + 1}/{args.passes} tree {name.upper()} done", file=sys.stderr)
    a, b = medians(runs["a"]), medians(runs["b"])
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"before (A) / after (B): median of {args.passes} passes each, alternated")
    for c in ("workload", "policy", "A tok/s", "B tok/s", "B/A", "A speedup", "B speedup", "A eff", "B eff",
              "A dec %", "B dec %", "A agree %", "B agree %"):
        t.add_column(c, justify="left" if c in ("workload", "policy") else "right")
    rows = []

    def fmt(v, spec: str) -> str:
        return "–" if v is None else spec.format(v)

    for key in sorted(set(a) | set(b)):
        ra, rb = a.get(key, {}), b.get(key, {})
        ratio = rb["tokens_per_s"] / ra["tokens_per_s"] if ra.get("tokens_per_s") and rb.get("tokens_per_s") else None
        rows.append({"workload": key[0], "policy": key[1], "a": ra, "b": rb, "b_over_a": ratio})
        t.add_row(key[0], key[1], fmt(ra.get("tokens_per_s"), "{:.1f}"), fmt(rb.get("tokens_per_s"), "{:.1f}"),
                  fmt(ratio, "{:.2f}"), fmt(ra.get("speedup_vs_none"), "{:.2f}x"),
                  fmt(rb.get("speedup_vs_none"), "{:.2f}x"), fmt(ra.get("work_efficiency"), "{:.2f}"),
                  fmt(rb.get("work_efficiency"), "{:.2f}"), fmt(ra.get("decision_overhead_pct"), "{:.2f}"),
                  fmt(rb.get("decision_overhead_pct"), "{:.2f}"),
                  fmt(None if ra.get("fidelity_token_agreement") is None else 100 * ra["fidelity_token_agreement"],
                      "{:.1f}"),
                  fmt(None if rb.get("fidelity_token_agreement") is None else 100 * rb["fidelity_token_agreement"],
                      "{:.1f}"))
    Console(stderr=True, width=200).print(t)
    print(json.dumps({"command": "bench/ab.py", "a": str(args.a), "b": str(args.b), "passes": args.passes,
                      "speed_args": speed_args, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
