"""The settings of a training run (``TrainConfig``) and loading the settings a state was saved with.

Every field is a command-line flag of ``scripts/train_tiny.py`` (``d_model`` -> ``--d-model``) and is
saved in the training state, so a resumed run continues with the settings it was saved with; flags
given on the command line override them from the resumed step on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent


@dataclass
class TrainConfig:
    # model (LLaDA architecture; vocab rows = tokenizer vocab rounded up to a multiple of 64)
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_hidden: int = 384
    rope_theta: float = 500000.0  # LLaDA's value (GSAI-ML/LLaDA-8B-Instruct config.json)
    # optimisation: linear warmup, then a constant LR (a run extends by any number of steps; the export
    # is the EMA of the weights); ``steps`` is only an upper bound: runs stop by --minutes / --max-new-steps
    steps: int = 1_000_000
    lr: float = 1e-3
    min_lr_frac: float = 0.1  # the --cooldown decay ends at lr * min_lr_frac
    # warmup-stable-decay: LR falls linearly to lr * min_lr_frac over this many steps from cooldown_start
    # (set to the resumed step when --cooldown is given); 0: no decay phase (--cooldown 0 on a decayed
    # state warms the LR up again to the stable value, so the run stays extendable)
    cooldown: int = 0
    cooldown_start: int = 0
    warmup: int = 300
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    ema: float = 0.999  # exponential moving average of the weights; the export uses it (0: raw weights)
    batch_tokens: int = 2048  # padded tokens per step (prompt + canvas)
    # data
    seed: int = 1
    domains: tuple[str, ...] = ("list", "code", "arith")
    domain_weights: tuple[float, ...] = (3.0, 1.0, 3.0)  # start; --adapt-every-min replaces them
    fewshot_frac: float = 0.15  # examples with a 1..max_shots few-shot prompt (long prompts, costly)
    max_shots: int = 4
    max_prompt_tokens: int = 1024
    canvas: int = 256  # evaluation gen length (answers must fit)
    full_canvas_frac: float = 0.06  # examples whose canvas is one of canvas_choices (EOS filler teaches the end)
    canvas_choices: tuple[int, ...] = (64, 128, 256, 512)
    extra_eos: int = 128  # the rest: answer + eot + k EOS, k log-uniform in 1..extra_eos (median ~11)
    block: int = 32  # evaluation block length (for block-structured masks)
    block_mask_frac: float = 0.15
    prefix_mask_frac: float = 0.25  # examples with a left-to-right mask: answer[:c] clean, answer[c:] masked
    # arith solutions and drills (with results; not given a block or prefix mask) given the left-to-right
    # mask cut at the first digit of a random computed result: the state in which a confidence-ordered
    # decode fixes the result's digit count (drawn only when > 0, so runs without it keep their stream)
    result_cut_frac: float = 0.0
    t_min: float = 1e-3
    # "t": CE / (t * L) (LLaDA eq. 5); "masked": CE / n_masked (same expectation, low variance)
    loss_norm: str = "masked"
    pool_batches: int = 16  # batches built per length-sorted pool
    # curriculum: every adapt_every_min minutes, a held-out greedy eval sets domain weights to
    # adapt_floor + error (mean over eval_shots); 0 keeps domain_weights fixed
    adapt_every_min: float = 15.0
    adapt_floor: float = 0.2
    # "examples": floor + error is each domain's share of examples; "tokens": its share of tokens
    # (weights divided by the domain's mean example length, drills counted with arith)
    adapt_by: str = "examples"
    drill_frac: float = 0.5  # arithmetic drills (arith_drill) drawn at this fraction of arith's weight
    # loss weight of the result digits of ``a op b = r`` in arith solutions and drills (result_positions);
    # 1.0 is the plain objective
    result_weight: float = 1.0
    # fraction of examples in which every later copy of a masked result (``42 - 18 = 24 ... 24 / 4``,
    # ``#### 24``) is masked too, so the result must be computed from its operands, not copied from
    # where the solution reuses it (Tok.result_copies); 0 is plain independent masking
    copy_mask: float = 0.0
    # training-only sampling weights of list operations, "Op=w" (ecache_cli/tasks/listops.py OPS names;
    # unnamed ops weigh 1): list examples are drawn by rejection so op frequencies follow them
    list_op_weights: tuple[str, ...] = ()
    drill_op_weights: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)  # drill operations * + - / (arith_drill)
    drill_div_max: int = 20  # largest quotient of the drills' divisions (arith_drill's div_max)
    # bookkeeping
    log_every: int = 50
    eval_n: int = 24  # held-out examples per domain per shot setting (curriculum eval)
    eval_shots: tuple[int, ...] = (0, 4)
    save_every_min: float = 5.0
    threads: int = 1


# Settings that states saved by earlier versions of this code carry, with the value at which they
# changed nothing (the code they switched on is gone: experiments the model card describes, which did
# not beat the run without them). A saved value equal to this loads; any other cannot be continued.
RETIRED = {
    "schedule": "const",  # "cosine" decayed to steps; --cooldown is the decay now
    "eos_dist": "loguniform",  # "uniform" 1..extra_eos EOS (the canvas then gave the answer length away)
    "drill_arith_frac": 0.0,  # drills made of arith train problems' computations
    "drill_chain_frac": 0.0,  # drills whose lines chain as arith solutions do
    "drill_small_frac": 0.0,  # drill lines with small results
    "final_cut_frac": 0.0,  # left-to-right mask cut at the final ``#### N``
    "result_end_weight": 1.0,  # loss weight of the token after each computed result
}


def config_from_dict(saved: dict, note=None) -> TrainConfig:
    """``TrainConfig`` from a saved ``asdict(cfg)`` (lists back to tuples; missing fields take their
    defaults, which are the values under which a field's code draws nothing, so older states keep
    their data stream).

    ``RETIRED`` keys at their inert value are dropped; keys this version does not know are dropped
    with a line to ``note`` (a callable taking a string; None: silent).

    Raises:
        ValueError: a retired setting is at a value that changed the run (its code is gone), naming it.
    """
    known = {f.name for f in fields(TrainConfig)}
    kept, unknown = {}, []
    for k, v in saved.items():
        v = tuple(v) if isinstance(v, list) else v
        if k in known:
            kept[k] = v
        elif k in RETIRED:
            if v != RETIRED[k]:
                flag = "--" + k.replace("_", "-")
                raise ValueError(f"the state was trained with {flag} {v}, which this version no longer has; "
                                 f"continue it with the commit that wrote it, or start a new run (--fresh)")
        else:
            unknown.append(k)
    if unknown and note is not None:
        note(f"ignored saved settings this version does not know: {', '.join(sorted(unknown))}")
    return TrainConfig(**kept)


def log(msg: str) -> None:
    """One timestamped progress line on stdout (flushed, for logs tee'd from long runs)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
