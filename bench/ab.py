"""Before/after speed: ``bench/speed.py`` from two source trees, side by side in one run.

Runs ``bench/speed.py`` of tree A and of tree B in alternation (A, B, A, B, ...: ``--passes`` each), every
pass in a fresh process importing that tree's ``ecache_cli`` (PYTHONPATH), with the same arguments and
pinned threads, so both see the same machine load. Prints, per workload/mode and policy, the median
tokens/s and speedup over ``none`` of each tree and B/A, then a last stdout line of JSON.

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


def one_pass(tree: Path, speed_args: list[str], out: Path) -> dict:
    """Run ``tree``'s bench/speed.py once; returns its JSON document's ``batch`` section."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "bench" / "speed.py"), *speed_args, "--json", str(out)]
    subprocess.run(cmd, env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["batch"]


def medians(passes: list[dict]) -> dict:
    """{(workload/mode, batch, policy): {tokens_per_s, speedup_vs_none}} medians over the passes."""
    keys = {(wm, bs, p) for doc in passes for wm, by_bs in doc.items() for bs, pol in by_bs.items() for p in pol}
    out = {}
    for wm, bs, p in sorted(keys):
        vals = [doc[wm][bs][p] for doc in passes if p in doc.get(wm, {}).get(bs, {})]
        out[(wm, bs, p)] = {k: statistics.median(v[k] for v in vals if v.get(k) is not None)
                            for k in ("tokens_per_s", "speedup_vs_none")}
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
    for c in ("workload", "batch", "policy", "A tok/s", "B tok/s", "B/A", "A speedup", "B speedup"):
        t.add_column(c, justify="left" if c in ("workload", "policy") else "right")
    rows = []
    for key in sorted(set(a) | set(b)):
        ra, rb = a.get(key, {}), b.get(key, {})
        ratio = rb["tokens_per_s"] / ra["tokens_per_s"] if ra.get("tokens_per_s") and rb.get("tokens_per_s") else None
        rows.append({"workload": key[0], "batch": key[1], "policy": key[2], "a": ra, "b": rb, "b_over_a": ratio})
        t.add_row(key[0], key[1], key[2], f"{ra.get('tokens_per_s', 0):.1f}", f"{rb.get('tokens_per_s', 0):.1f}",
                  "–" if ratio is None else f"{ratio:.2f}", f"{ra.get('speedup_vs_none', 0):.2f}x",
                  f"{rb.get('speedup_vs_none', 0):.2f}x")
    Console(stderr=True).print(t)
    print(json.dumps({"command": "bench/ab.py", "a": str(args.a), "b": str(args.b), "passes": args.passes,
                      "speed_args": speed_args, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
