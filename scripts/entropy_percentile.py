"""Compute the embedded model's confidence reference and store it beside the model.

Decodes ``--limit`` examples of each trained domain's test split (arith, code, list; 0-shot prompts,
the chat template, each domain's shipped profile: what ``ecache generate --task T`` runs), takes each
answer's ``mean_entropy`` (``ecache_cli/runs/confidence.py``: mean entropy in nats of the committed
tokens' distributions over the answer and its end marker), and writes the 99th percentile of all of
them (numpy's default linear interpolation) as ``mean_entropy_p99`` into
``ecache_cli/data/tiny/ecache_model.json``, with how it was made. ``ecache generate`` warns when an
answer's figure lies above it.

    python scripts/entropy_percentile.py --limit 200          # ~10 min on 1 CPU thread
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    import numpy as np
    import torch

    from ecache_cli.engine.core import Engine
    from ecache_cli.models.loader import embedded_dir, load_model
    from ecache_cli.runs.confidence import MODEL_CARD_FILE, measure_run
    from ecache_cli.runs.settings import resolve_settings
    from ecache_cli.tasks import get_task

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=200, help="test examples per domain")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", type=Path, default=embedded_dir() / MODEL_CARD_FILE)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_model("tiny", device="cpu", dtype="float32")
    engine = Engine.from_loaded(lm)
    domains = ["arith", "code", "list"]
    per_domain, figures = {}, []
    for name in domains:
        task = get_task(name)
        settings = resolve_settings("tiny", {}, {}, task=name)
        exs = task.examples("test", args.limit, args.seed)
        ids = engine.encode([task.prompt(ex, 0, args.seed) for ex in exs], lm.chat)
        got = []
        for s in range(0, len(ids), args.batch_size):
            run = engine.start(ids[s:s + args.batch_size], settings.decode, settings.policy(), seed=args.seed,
                               row_ids=range(s, s + len(ids[s:s + args.batch_size])))
            got += [m for m in measure_run(run) if m is not None]
        per_domain[name] = {"n": len(got), "p50": float(np.percentile(got, 50)), "p99": float(np.percentile(got, 99)),
                            "max": float(max(got))}
        figures += got
        print(name, per_domain[name], flush=True)
    card = json.loads(args.out.read_text()) if args.out.is_file() else {}
    card.update({
        "trained_tasks": domains,
        "mean_entropy_p99": round(float(np.percentile(figures, 99)), 4),
        "mean_entropy_reference": {
            "what": "99th percentile of mean_entropy (nats) over the answers to the trained domains' test split",
            "made_by": f"python scripts/entropy_percentile.py --limit {args.limit} --seed {args.seed}",
            "prompts": "0-shot, chat template; each domain's shipped profile (ecache generate --task T)",
            "n": len(figures), "per_domain": per_domain, "date": datetime.date.today().isoformat(),
        },
    })
    args.out.write_text(json.dumps(card, indent=2) + "\n")
    print(f"wrote {args.out}: mean_entropy_p99 = {card['mean_entropy_p99']}")


if __name__ == "__main__":
    main()
