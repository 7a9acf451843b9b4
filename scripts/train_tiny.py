"""Train the embedded model (``ecache_cli/data/tiny``): a small LLaDA on the checkable task domains.

The model is a LLaDA-architecture masked diffusion LM written in the official on-disk format, trained
with LLaDA's SFT objective on the synthetic domains ``list``, ``code`` and ``arith``
(``ecache_cli.tasks``) plus training-only arithmetic drills. The code is the package
``scripts/tiny_training`` (data, loop, evaluate, export); this is its command line. Every
``TrainConfig`` field is a flag (``--d-model``, ``--copy-mask``, ...).

The whole run lives in one state file, ``--state`` (weights, EMA, AdamW moments, step, data-stream
position, RNG states, settings, evaluation history; about 20 MB at the default shape; never
committed). A call resumes it when it exists (flags given now override its saved settings from that
step on; the model shape cannot change) and starts a new run when it does not; it saves every
``--save-every-min`` minutes and when it stops (``--minutes``, ``--max-new-steps``).

    python scripts/train_tiny.py --minutes 60 --export       # new run (or resume --state) for an hour
    python scripts/train_tiny.py --state S.pt --minutes 60   # continue a state you have
    python scripts/train_tiny.py --state S.pt --export-only  # write ecache_cli/data/tiny from a state
    python scripts/train_tiny.py --fresh --init-from DIR     # a new run from exported weights
    OUT=/tmp/o bash scripts/train_gpu.sh                     # on a GPU (see that script)

The model card (ecache_cli/data/tiny/README.md) gives the shipped model's recipe, what training
costs, and where the state of the shipped model is kept.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tiny_training package next to this file

from tiny_training.config import REPO, TrainConfig
from tiny_training.loop import run_training

# what the recipe flags do (the other TrainConfig fields are described by their comments there)
FLAG_HELP = {
    "cooldown": "LR decay phase: the LR falls linearly to lr * min_lr_frac over this many steps from the "
                "step this call resumes at; 0 on a decayed state warms it up again to the stable LR",
    "cooldown_start": "first step of the decay (set by --cooldown)",
    "copy_mask": "fraction of examples in which the later copies of a masked arith result are masked too",
    "result_weight": "loss weight of the digits of computed results in arith solutions and drills",
    "list_op_weights": "training frequency of list operations, e.g. 'Sort=2,Unique=2' (others 1)",
    "drill_op_weights": "training frequency of the drills' operations * + - /",
    "drill_div_max": "largest quotient of the drills' divisions; above 20 half of them have a 21-N quotient",
    "result_cut_frac": "fraction of the arith solutions and drills without a block or prefix mask that are masked "
                       "from the first digit of a random computed result on "
                       "(its operands clean, its digit count to predict)",
    "loss_norm": "masked: each example's CE over its masked tokens divided by their number; "
                 "t: divided by t * canvas (LLaDA eq. 5)",
    "adapt_by": "the curriculum's target share per domain: examples or tokens",
}
DEFAULT_STATE = REPO / "scripts" / "tiny_train_state.pt"  # git-ignored: a state is never committed


def parse_args(argv=None) -> tuple[argparse.Namespace, TrainConfig, set[str]]:
    """(options, the ``TrainConfig`` of the flags, the names of the ``TrainConfig`` fields given)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = TrainConfig()
    for name, val in asdict(d).items():
        flag = "--" + name.replace("_", "-")
        what = FLAG_HELP[name] + " " if name in FLAG_HELP else ""
        if isinstance(val, tuple):
            kind = type(val[0]) if val else str
            ap.add_argument(flag, type=lambda s, k=kind: tuple(k(x) for x in s.split(",")), default=val,
                            help=f"{what}comma-separated (default {','.join(map(str, val))})")
        else:
            ap.add_argument(flag, type=type(val), default=val, help=f"{what}(default {val})")
    ap.add_argument("--tokenizer", type=Path, default=REPO / "ecache_cli/data/tiny", help="tokenizer directory")
    ap.add_argument("--out", type=Path, default=REPO / "ecache_cli/data/tiny", help="model directory to write")
    ap.add_argument("--state", type=Path, default=DEFAULT_STATE,
                    help="the training state file: resumed when it exists, else a new run writes it "
                         f"(default {DEFAULT_STATE.relative_to(REPO)}, git-ignored)")
    ap.add_argument("--fresh", action="store_true", help="start a new run even if --state exists (overwrites it)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="new run only: start from the weights of an exported model directory")
    ap.add_argument("--minutes", type=float, default=0.0, help="stop after this much training wall time (0: --steps)")
    ap.add_argument("--max-new-steps", type=int, default=0,
                    help="stop after this many steps in this call (0: no limit)")
    ap.add_argument("--export", action="store_true", help="write the (EMA) model to --out when training stops")
    ap.add_argument("--export-only", action="store_true", help="export the state's (EMA) model to --out, no training")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    ap.add_argument("--data-workers", type=int, default=0,
                    help="processes that build batches ahead (GPU runs; 0: in the training process)")
    ap.add_argument("--log", type=Path, default=REPO / "scripts/_train_state.log", help="JSONL log (appended)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="exported weight dtype")
    ap.add_argument("--final-eval-n", type=int, default=0, help="held-out examples per (domain, shots) after export")
    args = ap.parse_args(argv)
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(d)})
    words = sys.argv[1:] if argv is None else list(argv)
    given = {k for k in asdict(d) if any(w.split("=")[0] == "--" + k.replace("_", "-") for w in words)}
    return args, cfg, given


def main(argv=None) -> None:
    """Parse ``argv`` (default: the command line) and run: see the module docstring."""
    args, cfg, given = parse_args(argv)
    run_training(args, cfg, given)


if __name__ == "__main__":
    sys.exit(main())
