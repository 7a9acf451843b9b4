"""Training-step throughput of the embedded model's recipe: the answer-region loss against full logits.

The training loop (``scripts/tiny_training/loop.py``, ``batch_loss``) computes logits only for the last
``canvas`` columns of a batch (every masked position lies there) instead of for every position. This
runs both on the same batches of a training data stream, interleaved (A, B, A, B, ...) so a busy
machine slows both alike, each step a forward, backward and AdamW update on its own copy of the model,
and reports training tokens per second (prompt + canvas tokens of the batch) and their ratio.

The stream and weights are those of ``--state`` (a training state file) when given, else the default
``TrainConfig``'s stream and the shipped model's weights (the same shape).

Prints a table, then one JSON line (the last stdout line).

    python bench/train_step.py                  # 40 batches, 3 rounds, 1 thread
    python bench/train_step.py --batches 80 --rounds 5 --state scripts/tiny_train_state.pt
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent


def training_package():
    """Import ``scripts/tiny_training`` (the training code; not part of the installed package)."""
    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    import tiny_training.config
    import tiny_training.data
    import tiny_training.evaluate
    import tiny_training.loop

    return tiny_training


def full_logits_loss(model, noisy, clean, key_mask, weights, canvas: int) -> torch.Tensor:
    """The reference: logits for every position, then the same masked CE (``canvas`` unused)."""
    logits = model(noisy, model.new_store(key_mask))  # (B, T, V)
    sel = weights > 0
    return (F.cross_entropy(logits[sel].float(), clean[sel], reduction="none") * weights[sel]).sum() / noisy.shape[0]


def main(argv=None) -> None:
    from rich.table import Table

    from ecache_cli.console import out

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=40, help="batches per round (default 40)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the median is reported (default 3)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--state", type=Path, default=None,
                    help="a training state file: its settings and weights (default: the default settings and "
                         "the shipped model's weights)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    tt = training_package()
    data, loop = tt.data, tt.loop
    tiny = REPO / "ecache_cli" / "data" / "tiny"
    if args.state is not None:
        st = loop.load_state(args.state)
        cfg, weights, step = tt.config.config_from_dict(st["cfg"]), st["model"], st["step"]
    else:
        from safetensors.torch import load_file

        cfg, step = tt.config.TrainConfig(), None
        weights = {k: v.float() for k, v in load_file(str(tiny / "model.safetensors")).items()}
    tok = data.Tok(tiny)
    stream = data.Stream(cfg, tok, data.load_tasks(cfg.domains))
    batches = []
    for i in range(args.batches):
        items = stream.next()
        batches.append((*data.make_batch(items, tok, cfg, torch.Generator().manual_seed(i)),
                        max(it.canvas for it in items)))
    base = loop.build_model(loop.model_config(cfg, tok), cfg.seed)
    base.load_state_dict(weights)
    variants = {"full logits": full_logits_loss, "answer region (batch_loss)": loop.batch_loss}
    models = {name: copy.deepcopy(base) for name in variants}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-5) for name, m in models.items()}
    ntok = sum(int(b[2].sum()) for b in batches)

    def one_step(name, b):
        loss = variants[name](models[name], *b)
        opts[name].zero_grad(set_to_none=True)
        loss.backward()
        opts[name].step()

    for name in variants:  # warm-up
        one_step(name, batches[0])
    secs = {name: [] for name in variants}
    for _ in range(args.rounds):
        spent = dict.fromkeys(variants, 0.0)
        for b in batches:
            for name in variants:  # interleaved: both see the same load
                t0 = time.perf_counter()
                one_step(name, b)
                spent[name] += time.perf_counter() - t0
        for name in variants:
            secs[name].append(spent[name])
    tok_s = {name: ntok / statistics.median(v) for name, v in secs.items()}
    ref = tok_s["full logits"]

    table = Table(title=f"training step, embedded model recipe ({args.batches} batches, {ntok} tokens, "
                        f"{args.threads} thread(s), median of {args.rounds})")
    for col in ("loss", "tokens/s", "vs full logits"):
        table.add_column(col, justify="right" if col != "loss" else "left")
    for name, v in tok_s.items():
        table.add_row(name, f"{v:,.0f}", f"{v / ref:.2f}x")
    out.print(table)
    print(json.dumps({"bench": "train_step", "step": step, "batches": args.batches, "tokens": ntok,
                      "threads": args.threads, "tokens_per_s": {k: round(v) for k, v in tok_s.items()},
                      "speedup": round(tok_s["answer region (batch_loss)"] / ref, 3)}), flush=True)


if __name__ == "__main__":
    main()
