"""Draw the README's picture of ``ecache generate --watch``: frames of the live view on the embedded model.

Decodes PROMPT with the embedded model (``tiny``, no download) at the settings below, draws every
step's frame exactly as ``--watch`` does (``ecache_cli/runs/watch.py``, at 80 columns), and writes a few
of them, one under the other, as one SVG through rich's ``Console(record=True).save_svg``:

    python scripts/watch_picture.py                  # writes docs/watch.svg (a few seconds on 1 CPU thread)
    python scripts/watch_picture.py --out /tmp/w.svg --frames 1,3,6,9,-1

The command it pictures: ``ecache generate "Sort descending: 4 9 2 7 5 1" --gen-length 32
--block-length 8 --tau 0.001 --watch``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "Sort descending: 4 9 2 7 5 1"
FLAGS = {"gen_length": 32, "block_length": 8}
TAU = 0.001  # refreshes and partial steps both happen on this prompt (the shipped profile's τ refreshes less)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "watch.svg", help="the SVG to write")
    ap.add_argument("--frames", default="1,4,8,12,-1",
                    help="the steps whose frames are drawn, 1-based, comma-separated (-1: the last)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from rich.console import Console

    from ecache_cli.engine.core import Engine
    from ecache_cli.models.loader import load_model
    from ecache_cli.runs.settings import resolve_settings
    from ecache_cli.runs.watch import WatchView, stats_line

    settings = resolve_settings("tiny", FLAGS, {"tau": TAU})
    lm = load_model("tiny", device="cpu", dtype="float32")
    engine = Engine.from_loaded(lm)
    run = engine.start(engine.encode([PROMPT], True), settings.decode, settings.policy(), seed=0)
    console = Console(record=True, width=80, height=24, force_terminal=True, color_system="truecolor",
                      file=open(os.devnull, "w"))
    view = WatchView(console, run, title=f"tiny · cache {settings.cache}", keep_frames=True)
    it = iter(run)
    while True:  # as WatchView.follow, without the live display: the decoding time alone counts in tokens/s
        t0 = time.perf_counter()
        rec = next(it, None)
        if rec is None:
            break
        view.busy += time.perf_counter() - t0
        view.observe(rec)
    res = run.results()[0]
    wanted = [int(k) for k in args.frames.split(",")]
    picks = sorted({(k - 1) % len(view.frames) if k > 0 else len(view.frames) + k for k in wanted})
    console.print(f'$ ecache generate "{PROMPT}" --gen-length 32 --block-length 8 --tau {TAU} --watch',
                  style="bold", highlight=False)
    for i in picks:
        console.print()
        console.print(view.frames[i])
    console.print()
    console.print(stats_line(res.stats), highlight=False, markup=False)
    console.print(res.text, highlight=False, markup=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    console.save_svg(str(args.out), title="ecache generate --watch")
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KB; steps {', '.join(str(i + 1) for i in picks)} "
          f"of {len(view.frames)}; answer {res.text!r})")


if __name__ == "__main__":
    main()
