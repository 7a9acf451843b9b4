"""Train the embedded default model (``ecache_cli/data/tiny``): a small LLaDA on checkable task domains.

The model is a LLaDA-architecture masked diffusion LM written in the official on-disk format
(config.json field names, ``model.safetensors`` tensor names, LLaDA special tokens and chat template),
so the loader and engine treat it exactly like GSAI-ML/LLaDA-8B-Instruct. It is trained from scratch
with LLaDA's SFT objective (GUIDELINES.md, paper eq. 5) on the synthetic domains ``arith``, ``code`` and
``list`` (``ecache_cli.tasks``):

- input = chat-templated prompt, then the answer region: answer tokens, ``<|eot_id|>``, ``<|endoftext|>``
  padding up to the canvas length;
- t ~ U(t_min, 1) per example; each answer-region token is replaced by ``<|mdm_mask|>`` with
  probability t; the prompt is never masked;
- loss = sum over masked tokens of CE / t, divided by the answer-region length, averaged over the batch
  (``--loss-norm t``, LLaDA eq. 5); or, with ``--loss-norm masked``, divided by the number of masked
  tokens instead (t * length in expectation, so the same objective up to that estimate) with at least one
  token masked per example: the 1/t weights of the first form make a batch's gradient hinge on the few
  examples drawn with small t, which at batch sizes of ~50 examples kept the model from learning to read
  the prompt (see the model card).

A fraction of examples (``--block-mask-frac``) uses a block-structured mask instead, the pattern seen in
semi-autoregressive decoding (earlier blocks clean, the current block masked with probability t, later
blocks all masks); its loss is the mean CE over masked tokens (same expectation as 1/t weighting).

A fraction ``--prefix-mask-frac`` uses a left-to-right mask instead: the answer up to a uniform cut
is clean, everything after it masked (the order confidence-based remasking tends to decode in), so the
next answer token can be found from the previous one and the prompt.

Canvas lengths are sampled: ``--full-canvas-frac`` of the examples use one of ``--canvas-choices``
(64/128/256/512, the gen lengths an answer must not depend on), the rest answer + eot + k EOS with k
log-uniform in 1..``--extra-eos`` (128), so the canvas length does not reveal the answer's length and
little compute goes to EOS padding. Batches are built from a pool sorted by length under a token budget.

Curriculum: every ``--adapt-every-min`` minutes the EMA model is evaluated greedily on held-out
examples (their own seed, never bench/quality.py's) and the domain weights become
``--adapt-floor`` + that domain's error: its share of examples, or with ``--adapt-by tokens`` its
share of training tokens (a cheap ``list`` example is ~60 tokens, an ``arith`` one ~140, so by
examples ``list`` got ~10% of the compute at 18% of the examples). ``--drill-frac`` adds training-only arithmetic drills
(``arith_drill``) at that fraction of ``arith``'s weight, their operations drawn by ``--drill-op-weights``;
``--result-weight`` scales the loss weight of every computed result's digits in ``arith`` solutions
and drills (``Tok.result_positions``); ``--copy-mask`` masks the later copies of a masked result
(``Tok.result_copies``), so a solution's reuse of a result cannot stand in for computing it;
``--result-cut-frac`` gives a fraction of the examples with results the left-to-right mask cut at the
first digit of one of them, the state in which a confidence-ordered decode fixes a result's digit count;
``--final-cut-frac`` cuts a fraction of the other ``arith`` solutions at the final ``#### N``'s first
digit, so the loss lands on copying the last result into the answer;
``--list-op-weights`` draws ``list`` operations by rejection so
the ones the model fails come more often. The curriculum eval also logs ``drill_fact_accuracy`` (the
results of held-out drills, computed from a clean context) and ``facts_ltr`` (the results of held-out
``arith`` solutions, each from a correct prefix with everything after it masked), the cheap measures of
the arithmetic itself.

Schedule: linear warmup, then a constant LR (``--schedule const``), so a run can be extended by any
number of steps; the exported model is the EMA of the weights (``--ema``), which plays the part of an
LR decay without ending the schedule. ``--cooldown N`` adds the decay phase of warmup-stable-decay
(Hu et al. 2024, MiniCPM sec. 4): from the step the call resumes at, the LR falls linearly to
``lr * min_lr_frac`` over N steps (10 minutes of it from step 101432 cut the loss on the same batches
from 0.30 to 0.21); ``--cooldown 0`` later returns to the stable LR through a fresh warmup.

State: ONE file, ``--state`` (default ``scripts/tiny_train_state.pt``, tracked in git, under 20 MB):
weights, EMA, AdamW moments, step, data-stream position, RNG states, config, evaluation history. A run
resumes from it when it exists (flags given on the command line override the saved config from that
step on; the model shape cannot change), saves it every ``--save-every-min`` minutes and when it stops
(``--minutes``, ``--max-new-steps``), and overwrites it in place. ``scripts/train_gpu.sh`` does the same
on a lent GPU and writes the new state under ``$OUT``.

    python scripts/train_tiny.py --minutes 60 --export        # continue the committed run for an hour
    python scripts/train_tiny.py --export-only                # write ecache_cli/data/tiny from the state
    python scripts/train_tiny.py --fresh --init-from DIR      # a new run from exported weights
    OUT=/tmp/o bash scripts/train_gpu.sh                      # on a GPU (see that script)

The current state began with ``--fresh --init-from ecache_cli/data/tiny`` from the export of the
previous run (22500 steps, 40.6M tokens; its optimizer state was not kept), then resumed with the
settings in its saved config (the model card lists the overrides and when they began).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass
class TrainConfig:
    # model (LLaDA architecture; vocab rows = tokenizer vocab rounded up to a multiple of 64)
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_hidden: int = 384
    rope_theta: float = 500000.0  # LLaDA's value
    # optimisation
    steps: int = 1_000_000  # an upper bound: runs are stopped by --minutes and resumed (schedule "const")
    schedule: str = "const"  # "const": warmup then constant LR (extendable; export the EMA); "cosine"
    lr: float = 1e-3
    min_lr_frac: float = 0.1  # cosine (and --cooldown) decay to lr * min_lr_frac
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
    extra_eos: int = 128  # the rest: answer + eot + 1..extra_eos EOS
    eos_dist: str = "loguniform"  # how that EOS count is drawn: "loguniform" (median ~11) or "uniform"
    block: int = 32  # evaluation block length (for block-structured masks)
    block_mask_frac: float = 0.15
    prefix_mask_frac: float = 0.25  # examples with a left-to-right mask: answer[:c] clean, answer[c:] masked
    # arith solutions and drills (with results; not given a block or prefix mask) given the left-to-right
    # mask cut at the first digit of a random computed result: the state in which a confidence-ordered
    # decode fixes the result's digit count (drawn only when > 0, so runs without it keep their stream)
    result_cut_frac: float = 0.0
    # arith solutions (not given a block, prefix or result-cut mask) given the left-to-right mask cut at
    # the first digit of the final ``#### N``: the solution clean, the answer copied from its last result
    # (drawn only when > 0, so runs without it keep their stream)
    final_cut_frac: float = 0.0
    t_min: float = 1e-3
    loss_norm: str = "masked"  # "t": CE / (t * L) (LLaDA eq. 5); "masked": CE / n_masked (same expectation, low variance)
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
    # loss weight of the token right after each such result (``.``, `` left``, a newline): a confidence-
    # ordered decode often commits it before the digits, which fixes the result's digit count
    result_end_weight: float = 1.0
    # fraction of examples in which every later copy of a masked result (``42 - 18 = 24 ... 24 / 4``,
    # ``#### 24``) is masked too, so the result must be computed from its operands, not copied from
    # where the solution reuses it (Tok.result_copies); 0 is plain independent masking
    copy_mask: float = 0.0
    # training-only sampling weights of list operations, "Op=w" (ecache_cli/tasks/listops.py OPS names;
    # unnamed ops weigh 1): list examples are drawn by rejection so op frequencies follow them
    list_op_weights: tuple[str, ...] = ()
    drill_op_weights: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)  # drill operations * + - / (arith_drill)
    drill_div_max: int = 20  # largest quotient of the drills' divisions (arith_drill's div_max)
    # fraction of drills made of computations taken from arith train problems (arith_fact_drill)
    drill_arith_frac: float = 0.0
    # fraction of drills whose lines chain as arith solutions do (arith_chain_drill)
    drill_chain_frac: float = 0.0
    # fraction of the drills' - and * lines drawn with a small result (arith_drill's small_frac)
    drill_small_frac: float = 0.0
    # bookkeeping
    log_every: int = 50
    eval_n: int = 24  # held-out examples per domain per shot setting (curriculum eval)
    eval_shots: tuple[int, ...] = (0, 4)
    save_every_min: float = 5.0
    threads: int = 1


# --- tokenizer and prompts ------------------------------------------------------------------------


class Tok:
    """The tokenizer plus the LLaDA special ids and a cached chat-template renderer."""

    def __init__(self, path: Path):
        import transformers

        transformers.utils.logging.set_verbosity_error()  # config.json's model_type is unknown to transformers
        self.hf = transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        ids = self.hf.convert_tokens_to_ids
        self.bos, self.eos, self.mask = ids("<|startoftext|>"), ids("<|endoftext|>"), ids("<|mdm_mask|>")
        self.eot = ids("<|eot_id|>")
        assert None not in (self.bos, self.eos, self.mask, self.eot), "tokenizer lacks LLaDA special tokens"
        assert self.mask != self.eos, "mask id must differ from the EOS/pad id (spec D.8)"
        self.vocab = len(self.hf)
        v = self.hf.get_vocab()  # the tokens result_positions / result_copies look for
        self._digits = {v[str(d)] for d in range(10) if str(d) in v}
        self._eq, self._lead = v.get(" ="), {v.get(" "), v.get(" $")}
        self._final = v.get("####")

    def prompt_ids(self, text: str) -> list[int]:
        """Chat-template ``text`` as one user turn and tokenize (the BOS comes from the template)."""
        s = self.hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                        add_generation_prompt=True)
        return self.hf(s, add_special_tokens=False)["input_ids"]

    def answer_ids(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"] + [self.eot]

    def result_positions(self, ids: list[int]) -> tuple[int, ...]:
        """Indices of the digits of each computed result in answer ``ids``: the digit run after
        ``" ="`` and ``" "`` or ``" $"`` (``14 * 4 = 56``, ``12 - 5 = $7``). The tokenizer splits numbers
        into one token per digit (scripts/build_tokenizer.py)."""
        out, i = [], 0
        while i < len(ids):
            if ids[i] == self._eq and i + 1 < len(ids) and ids[i + 1] in self._lead:
                j = i + 2
                while j < len(ids) and ids[j] in self._digits:
                    out.append(j)
                    j += 1
                i = j
            else:
                i += 1
        return tuple(out)

    def final_position(self, ids: list[int]) -> int:
        """Index of the first digit of the final answer in answer ``ids`` (the digit after the last
        ``####`` and ``" "``, arith.py's ``#### <number>`` line), or -1 when there is none."""
        for i in range(len(ids) - 2, -1, -1):
            if ids[i] == self._final:
                j = i + 1 + (ids[i + 1] in self._lead)
                return j if j < len(ids) and ids[j] in self._digits else -1
        return -1

    @staticmethod
    def result_runs(results: tuple[int, ...]) -> list[tuple[int, ...]]:
        """``result_positions`` grouped into one tuple of consecutive digit indices per result."""
        runs: list[list[int]] = []
        for i in results:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        return [tuple(r) for r in runs]

    def result_copies(self, ids: list[int], results: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        """For each computed result in answer ``ids`` (its digit indices, ``result_runs(results)``): the
        indices of every later occurrence of the same number (the same digit run, not part of a longer
        number), e.g. the ``24`` of ``24 / 4 = 6`` and of ``#### 24``."""
        out = []
        for run in self.result_runs(results):
            digits, n, later = [ids[i] for i in run], len(run), []
            for j in range(run[-1] + 1, len(ids) - n + 1):
                if (ids[j:j + n] == digits and ids[j - 1] not in self._digits
                        and (j + n == len(ids) or ids[j + n] not in self._digits)):
                    later.extend(range(j, j + n))
            out.append((run, tuple(later)))
        return tuple(out)

    def decode_completion(self, ids: list[int]) -> str:
        """Text of a generated span up to its first eot/EOS (the engine's convention)."""
        out = []
        for i in ids:
            if i in (self.eot, self.eos):
                break
            out.append(i)
        return self.hf.decode(out, skip_special_tokens=True)


DRILL_OPS = "*+-/"


def arith_drill(rng: random.Random, op_weights=None, div_max: int = 20, small_frac: float = 0.0) -> tuple[str, str]:
    """A training-only arithmetic drill: 3-6 expressions in the prompt, the answer restates each with
    its result (``14 * 4 = 56``), one per line, in the ``arith`` solutions' notation. ``op_weights``
    (4 floats for ``DRILL_OPS``; None: uniform) sets how often each operation is drawn. ``div_max`` > 20
    makes half of the divisions have a 21-``div_max`` quotient (dividend at most 250 while ``div_max`` <=
    125); at 20 the stream of drills is the one from before the argument. ``small_frac`` > 0 draws that
    fraction of the ``-`` and ``*`` lines with a small result: half of such differences are 1-20 (``56 - 53
    = 3``), half are taken from a round 10-200 (``100 - 40 = 60``), and such products are at most 20
    (``2 * 4 = 8``); these are the digit counts the model got wrong (a one-digit result written with two,
    ``56 - 53 = $83``). At 0 the stream is the one from before the argument.

    The operand ranges cover the computations of the ``arith`` templates (tasks/arith.py): products of
    a 2-12 factor and a 2-80 factor, sums up to 250 + 100, differences with a positive result and exact
    divisions with a 2-20 quotient (teams' quotients reach 89, bakery's 36: ``div_max`` 90). A worked
    ``arith`` solution spends most of its tokens copying the problem; these put the loss on the
    results, which is what the model got wrong.
    """
    lines = []
    for _ in range(rng.randint(3, 6)):
        op = rng.choice(DRILL_OPS) if op_weights is None else rng.choices(DRILL_OPS, weights=op_weights)[0]
        small = small_frac > 0 and op in "-*" and rng.random() < small_frac
        if op == "*" and small:
            a = rng.randint(2, 10)
            b = rng.randint(2, 20 // a)
            r = a * b
        elif op == "*":
            a, b = rng.randint(2, 12), rng.randint(2, 80)
            if rng.random() < 0.5:
                a, b = b, a
            r = a * b
        elif op == "+":
            a, b = rng.randint(1, 250), rng.randint(1, 100)
            if rng.random() < 0.3:
                a, b = b, a
            r = a + b
        elif op == "-" and small:
            if rng.random() < 0.5:
                a = rng.randint(2, 250)
                r = rng.randint(1, min(a - 1, 20))
                b = a - r
            else:
                a = 10 * rng.randint(1, 20)
                b = rng.randint(1, a - 1)
                r = a - b
        elif op == "-":
            a = rng.randint(2, 250)
            b = rng.randint(1, a - 1)
            r = a - b
        else:
            b, r = rng.randint(2, 10), rng.randint(2, 20)
            if div_max > 20 and rng.random() < 0.5:  # arith's teams/bakery quotients reach 89 and 36
                r = rng.randint(21, div_max)
                b = rng.randint(2, max(2, min(10, 250 // r)))
            a = b * r
        lines.append((f"{a} {op} {b}", r))
    question = "Compute:\n" + "\n".join(e for e, _ in lines)
    return question, "\n".join(f"{e} = {r}" for e, r in lines)


CHAIN_STEPS = ("B-_", "_-c", "_+c", "c+_", "_/k", "_*k")  # arith_chain_drill's steps, drawn by CHAIN_WEIGHTS
CHAIN_WEIGHTS = (0.3, 0.3, 0.1, 0.1, 0.1, 0.1)


def arith_chain_drill(rng: random.Random) -> tuple[str, str]:
    """A training-only drill in ``arith_drill``'s answer format whose lines chain as ``arith`` solutions
    do: 2 chains of 2-3 lines, each line after a chain's first using the previous result (``_`` in the
    question) as an operand, and the answer restating it (``6 * 7 = $42``, ``50 - 42 = $8``); in half of
    the drills every result has the solutions' ``$``. A chain starts with a 2-12 by 2-30 product or a
    sum; its steps (``CHAIN_STEPS``) are the templates' (tasks/arith.py): a bill of 20, 50 or 100 minus
    the result (change), the result minus 1..result-1 (savings, orchard, boxes, teams, bakery), plus
    1-40 either way round (boxes, reading, times), an exact division by 2-10 with a quotient above 1
    (teams, bakery, share) and a product of a result up to 60 with 2-5 (orchard); a step that does not
    apply to the result is drawn again. Built for what the step-164745 model got wrong in worked
    solutions: it wrote the previous result again (``100 - 40 = $40``) and two digits for one
    (``56 - 53 = $13``), which drills of independent lines never show it."""
    money = "$" if rng.random() < 0.5 else ""
    q_lines, a_lines = [], []
    for _ in range(2):
        if rng.random() < 0.75:
            a, b = rng.randint(2, 12), rng.randint(2, 30)
            expr, r = (f"{a} * {b}", a * b) if rng.random() < 0.5 else (f"{b} * {a}", a * b)
        else:
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            expr, r = f"{a} + {b}", a + b
        q_lines.append(expr)
        a_lines.append(f"{expr} = {money}{r}")
        for _ in range(rng.randint(1, 2)):
            bills = [x for x in (20, 50, 100) if x > r]
            ks = [k for k in range(2, 11) if r % k == 0 and r // k > 1]
            while True:
                step = rng.choices(CHAIN_STEPS, weights=CHAIN_WEIGHTS)[0]
                if step == "B-_" and bills:
                    x = rng.choice(bills)
                    q, e, r = f"{x} - _", f"{x} - {r}", x - r
                elif step == "_-c" and r >= 2:
                    c = rng.randint(1, r - 1)
                    q, e, r = f"_ - {c}", f"{r} - {c}", r - c
                elif step == "_+c":
                    c = rng.randint(1, 40)
                    q, e, r = f"_ + {c}", f"{r} + {c}", r + c
                elif step == "c+_":
                    c = rng.randint(1, 40)
                    q, e, r = f"{c} + _", f"{c} + {r}", c + r
                elif step == "_/k" and ks:
                    k = rng.choice(ks)
                    q, e, r = f"_ / {k}", f"{r} / {k}", r // k
                elif step == "_*k" and r <= 60:
                    k = rng.randint(2, 5)
                    q, e, r = f"_ * {k}", f"{r} * {k}", r * k
                else:
                    continue
                break
            q_lines.append(q)
            a_lines.append(f"{e} = {money}{r}")
    return "Compute, _ being the line before's result:\n" + "\n".join(q_lines), "\n".join(a_lines)


FACT_OP = re.compile(r"\d+ ([-+*/]) \$?\d+ = \$?\d+")  # the computations of drills and arith solutions, in order


def arith_fact_drill(rng: random.Random, task) -> tuple[str, str]:
    """A drill in ``arith_drill``'s format whose 3-6 lines are computations of ``arith`` *train*
    problems as their worked solutions write them (``50 - 33 = $17``), one random computation from each
    of 3-6 random problems: the operand distribution, the ``$`` and the borrows of the templates
    themselves, with none of a problem's results shown in another line's operands. ``task``: the
    ``arith`` task (ecache_cli/tasks/arith.py)."""
    facts = []
    for _ in range(rng.randint(3, 6)):
        ex = task.examples("train", 1, rng.randrange(1 << 40))[0]
        facts.append(rng.choice([m.group(0) for m in FACT_OP.finditer(task.target(ex))]))
    return "Compute:\n" + "\n".join(f.split(" = ")[0] for f in facts), "\n".join(facts)


def drill_fact_accuracy(model, tok: Tok, drills: list[tuple[str, str]], mode: str = "clean") -> dict[str, list[int]]:
    """{op: [right, total]} (and ``"all"``) over every computed result in ``drills`` ((question, answer)
    pairs: ``arith_drill`` drills or ``arith`` problems with their worked solutions; results located by
    ``Tok.result_positions``, their operations read off ``a op b = r`` in order). One full forward per
    result on prompt + answer + eot + 16 EOS with that result's digits masked; right when the argmax at
    every masked digit is the true digit. ``mode``:

    - ``"clean"``: everything else clean, so the text after the result gives away its length (and in a
      worked solution, where results are reused, ``24 / 4`` and ``#### 24`` give the result itself:
      use it on drills, whose results are independent);
    - ``"ltr"``: the result and everything after it masked, as in left-to-right decoding: the model
      must also decide how many digits the result has, and copies come later.

    bench/arith_facts.py prints both side by side for several models.
    """
    if mode not in ("clean", "ltr"):
        raise ValueError(f"mode {mode!r}: use clean or ltr")
    device = next(model.parameters()).device
    out: dict[str, list[int]] = {}
    was_training = model.training
    model.eval()
    for question, answer in drills:
        prompt, full = tok.prompt_ids(question), tok.answer_ids(answer)
        ops = FACT_OP.findall(answer)
        runs = tok.result_runs(tok.result_positions(full))
        assert len(ops) == len(runs), (answer, ops)
        for op, run in zip(ops, runs):
            x = prompt + full + [tok.eos] * 16
            hide = range(run[0], len(x) - len(prompt)) if mode == "ltr" else run
            for i in hide:
                x[len(prompt) + i] = tok.mask
            xt = torch.tensor([x], device=device)
            pos = torch.tensor([[len(prompt) + i for i in run]], device=device)
            with torch.no_grad():
                logits = model(xt, model.new_store(torch.ones_like(xt, dtype=torch.bool)), logits_pos=pos)
            right = logits[0].argmax(-1).tolist() == [full[i] for i in run]
            for key in (op, "all"):
                c = out.setdefault(key, [0, 0])
                c[0] += right
                c[1] += 1
    model.train(was_training)
    return out


def _rates(counts: dict[str, list[int]]) -> dict[str, float]:
    """{op: right / total} of drill_fact_accuracy's counts, rounded for the log."""
    return {op: round(c[0] / c[1], 3) for op, c in sorted(counts.items())}


def list_op_weights(specs) -> dict[str, float]:
    """Parse ``--list-op-weights`` ("Op=w" items) into {op: w}; SystemExit names a bad item."""
    from ecache_cli.tasks.listops import OPS

    out = {}
    for item in specs:
        op, sep, w = item.rpartition("=")
        try:
            weight = float(w)
        except ValueError:
            weight = -1.0
        if not sep or op not in OPS or weight < 0:
            raise SystemExit(f"--list-op-weights: bad item {item!r}; use Op=weight with Op one of {sorted(OPS)}")
        out[op] = weight
    return out


def load_tasks(domains) -> dict:
    from ecache_cli.tasks import get_task

    tasks = {}
    for d in domains:
        try:
            tasks[d] = get_task(d, allow_code_execution=True)
        except TypeError:
            tasks[d] = get_task(d)
    return tasks


# --- data ------------------------------------------------------------------------------------------


@dataclass
class Item:
    prompt: list[int]
    answer: list[int]  # answer tokens + eot
    canvas: int  # answer-region length (answer + eot + EOS padding)
    results: tuple[int, ...] = ()  # answer indices of computed result digits (result_positions)
    copies: tuple = ()  # per result: (its digit indices, indices of its later copies) (result_copies)
    final: int = -1  # answer index of the final answer's first digit (Tok.final_position; -1: none)

    @property
    def length(self) -> int:
        return len(self.prompt) + self.canvas


class Stream:
    """Deterministic stream of batches: batch ``step`` is a pure function of (seed, step).

    Pools of ``pool_batches`` batches are drawn from ``random.Random(f"pool:{seed}:{pool}")``, sorted by
    length, cut into batches under the token budget, and shuffled; a step maps to (pool, index) through
    the per-pool batch counts, which are recomputed on resume.
    """

    def __init__(self, cfg: TrainConfig, tok: Tok, tasks: dict):
        self.cfg, self.tok, self.tasks = cfg, tok, tasks
        self.pool_idx, self.batches, self.pos = -1, [], 0
        self.weights = tuple(cfg.domain_weights)  # the weights of the next pool built
        self.pool_weights = self.weights  # the weights the current pool was built with
        self.workers, self._mp, self._ahead = 0, None, []  # start_workers: pools built ahead elsewhere
        self.op_weights = list_op_weights(cfg.list_op_weights)
        self.op_wmax = max([1.0, *self.op_weights.values()])
        ow = tuple(cfg.drill_op_weights)  # uniform weights: rng.choice, the stream of runs before the flag
        self.drill_ops = None if len(set(ow)) == 1 else ow

    def state(self) -> dict:
        """Position in the stream: enough to rebuild the current pool and continue after batch ``pos``."""
        return {"pool_idx": self.pool_idx, "pos": self.pos, "pool_weights": list(self.pool_weights),
                "weights": list(self.weights)}

    def restore(self, st: dict) -> None:
        self.weights = tuple(st["weights"])
        if st["pool_idx"] >= 0:
            self.pool_idx = st["pool_idx"]
            self.pool_weights = tuple(st["pool_weights"])
            self.batches, self.pos = self._build_pool(self.pool_idx, self.pool_weights), st["pos"]

    def item(self, rng: random.Random, weights) -> Item:
        cfg = self.cfg
        names, w = list(cfg.domains), list(weights)
        if cfg.drill_frac > 0 and "arith" in names:  # arithmetic drills ride on arith's weight
            names.append("drill")
            w.append(cfg.drill_frac * w[names.index("arith")])
        while True:
            name = rng.choices(names, weights=w)[0]
            if name == "drill":
                if cfg.drill_arith_frac > 0 and rng.random() < cfg.drill_arith_frac:
                    question, target = arith_fact_drill(rng, self.tasks["arith"])
                elif cfg.drill_chain_frac > 0 and rng.random() < cfg.drill_chain_frac:
                    question, target = arith_chain_drill(rng)
                else:
                    question, target = arith_drill(rng, self.drill_ops, cfg.drill_div_max, cfg.drill_small_frac)
                prompt, answer = self.tok.prompt_ids(question), self.tok.answer_ids(target)
            else:
                task = self.tasks[name]
                ex = task.examples("train", 1, rng.randrange(1 << 40))[0]
                if name == "list" and self.op_weights:  # rejection: op frequencies follow list_op_weights
                    while rng.random() * self.op_wmax >= self.op_weights.get(ex.meta["op"], 1.0):
                        ex = task.examples("train", 1, rng.randrange(1 << 40))[0]
                shots = rng.randint(1, cfg.max_shots) if rng.random() < cfg.fewshot_frac else 0
                prompt = self.tok.prompt_ids(task.prompt(ex, shots, rng.randrange(1 << 30)))
                answer = self.tok.answer_ids(task.target(ex))
            if len(prompt) > cfg.max_prompt_tokens or len(answer) + 1 > cfg.canvas:
                continue  # too long for evaluation settings; redraw
            fits = [c for c in cfg.canvas_choices if c > len(answer)]
            if fits and rng.random() < cfg.full_canvas_frac:
                canvas = rng.choice(fits)
            elif cfg.eos_dist == "loguniform":  # trailing EOS count must not reveal the answer's length
                extra = int(math.exp(rng.uniform(0.0, math.log(cfg.extra_eos + 1))))
                canvas = min(cfg.canvas, len(answer) + max(1, extra))
            else:
                canvas = min(cfg.canvas, len(answer) + rng.randint(1, cfg.extra_eos))
            results = self.tok.result_positions(answer) if name in ("arith", "drill") else ()
            copies = self.tok.result_copies(answer, results) if cfg.copy_mask > 0 and results else ()
            final = self.tok.final_position(answer) if cfg.final_cut_frac > 0 and name == "arith" else -1
            return Item(prompt, answer, canvas, results, copies, final)

    def _build_pool(self, pool: int, weights) -> list[list[Item]]:
        cfg = self.cfg
        rng = random.Random(f"pool:{cfg.seed}:{pool}")
        items, budget = [], cfg.pool_batches * cfg.batch_tokens
        while sum(it.length for it in items) < budget:
            items.append(self.item(rng, weights))
        items.sort(key=lambda it: it.length)
        batches, cur = [], []
        for it in items:  # greedy: a batch costs len(longest) * count padded tokens
            if cur and it.length * (len(cur) + 1) > cfg.batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(it)
        if cur:
            batches.append(cur)
        rng.shuffle(batches)
        return batches

    def next(self) -> list[Item]:
        while self.pos >= len(self.batches):
            self.pool_idx += 1
            self.pool_weights = self.weights
            self.batches, self.pos = self._pool(self.pool_idx, self.pool_weights), 0
        self.pos += 1
        return self.batches[self.pos - 1]

    # -- optional worker processes (a GPU consumes batches faster than one process can tokenize) ---------

    def start_workers(self, n: int, tok_dir: Path) -> None:
        """Build pools in ``n`` spawned processes, ``2n`` pools ahead. Pool ``p`` is the same pure function
        of (seed, p, weights) as without workers, so the batches and a resumed run are unchanged."""
        import multiprocessing as mp

        if n <= 0:
            return
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.workers, self._ahead = n, []
        self._mp = mp.get_context("spawn").Pool(n, initializer=_worker_init, initargs=(asdict(self.cfg), str(tok_dir)))

    def _pool(self, idx: int, weights) -> list[list[Item]]:
        if not self.workers:
            return self._build_pool(idx, weights)
        if not self._ahead or self._ahead[0][:2] != (idx, tuple(weights)):
            self._ahead = []  # weights changed (curriculum) or first call: prefetch anew from idx
        nxt = self._ahead[-1][0] + 1 if self._ahead else idx
        while len(self._ahead) < 2 * self.workers:
            self._ahead.append((nxt, tuple(weights), self._mp.apply_async(_worker_pool, (nxt, tuple(weights)))))
            nxt += 1
        return self._ahead.pop(0)[2].get()

    def close(self) -> None:
        if self._mp is not None:
            self._mp.terminate()
            self._mp = None


_WORKER: Stream | None = None


def _worker_init(cfg: dict, tok_dir: str) -> None:
    global _WORKER
    import torch as _torch

    _torch.set_num_threads(1)
    c = TrainConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()})
    _WORKER = Stream(c, Tok(Path(tok_dir)), load_tasks(c.domains))


def _worker_pool(idx: int, weights) -> list[list[Item]]:
    return _WORKER._build_pool(idx, weights)


def make_batch(items: list[Item], tok: Tok, cfg: TrainConfig, gen: torch.Generator):
    """Build (noisy tokens, clean tokens, key_mask, loss weights) for one batch, all (B, T).

    weights[b, i] = 1 / (t_b * canvas_b) on masked answer-region tokens (block-structured examples:
    1 / n_masked), 0 elsewhere, so sum(weights * CE) / B is the LLaDA SFT loss.
    """
    B, T = len(items), max(it.length for it in items)
    clean = torch.full((B, T), tok.eos, dtype=torch.long)
    key_mask = torch.zeros(B, T, dtype=torch.bool)
    region = torch.zeros(B, T, dtype=torch.bool)
    for b, it in enumerate(items):
        seq = it.prompt + it.answer + [tok.eos] * (it.canvas - len(it.answer))
        clean[b, T - len(seq):] = torch.tensor(seq)
        key_mask[b, T - len(seq):] = True
        region[b, T - it.canvas:] = True
    t = torch.rand(B, generator=gen) * (1 - cfg.t_min) + cfg.t_min  # (B,)
    u = torch.rand(B, T, generator=gen)
    masked = region & (u < t[:, None])
    if cfg.loss_norm == "masked":
        # every example masks at least one answer-region token: its lowest-u one
        first = torch.where(region, u, torch.full_like(u, 2.0)).argmin(1)  # (B,)
        masked[torch.arange(B), first] = True
    if cfg.copy_mask > 0:  # drawn only when set: batches without it stay what they were
        hide = torch.rand(B, generator=gen) < cfg.copy_mask
        for b in torch.nonzero(hide).flatten().tolist():
            off = T - items[b].canvas
            for run, later in items[b].copies:
                if later and masked[b, [off + i for i in run]].any():
                    masked[b, [off + i for i in later]] = True
    if cfg.loss_norm == "masked":
        weights = masked.float() / masked.sum(1, keepdim=True).float()
    else:
        weights = masked.float() / (t[:, None] * region.sum(1, keepdim=True).float())

    def structured(b: int, m: torch.Tensor) -> None:
        # row b's mask replaced by a structured one (block, left to right), each masked token 1 / n_masked
        masked[b] = m
        weights[b] = m.float() / m.sum()

    def ltr(b: int, c: int) -> None:
        # left-to-right order: row b clean before column c, masked from c on
        m = torch.zeros(T, dtype=torch.bool)
        m[c:] = True
        structured(b, m)

    blocky = torch.rand(B, generator=gen) < cfg.block_mask_frac
    for b in torch.nonzero(blocky).flatten().tolist():
        start, n = T - items[b].canvas, items[b].canvas
        nblocks = -(-n // cfg.block)
        k = int(torch.randint(0, nblocks, (1,), generator=gen))
        lo, hi = start + k * cfg.block, min(T, start + (k + 1) * cfg.block)
        m = torch.zeros(T, dtype=torch.bool)
        m[lo:hi] = u[b, lo:hi] < t[b]
        m[hi:] = True
        if not m.any():
            m[hi - 1] = True
        structured(b, m)
    prefix = (torch.rand(B, generator=gen) < cfg.prefix_mask_frac) & ~blocky
    for b in torch.nonzero(prefix).flatten().tolist():
        # left-to-right order (what confidence-ordered decoding approaches): a clean answer prefix,
        # everything after the cut masked; the cut is uniform over the answer and its eot
        start, n = T - items[b].canvas, len(items[b].answer)
        ltr(b, start + int(torch.randint(0, n, (1,), generator=gen)))
    cut = torch.zeros(B, dtype=torch.bool)
    if cfg.result_cut_frac > 0:
        # a left-to-right mask cut where a computed result starts: its operands clean, its digits and
        # everything after them masked, so the loss lands on how many digits it has (the token after it)
        cut = (torch.rand(B, generator=gen) < cfg.result_cut_frac) & ~blocky & ~prefix
        for b in torch.nonzero(cut).flatten().tolist():
            runs = Tok.result_runs(items[b].results)
            if not runs:
                continue
            run = runs[int(torch.randint(0, len(runs), (1,), generator=gen))]
            ltr(b, T - items[b].canvas + run[0])
    if cfg.final_cut_frac > 0:
        # a left-to-right mask cut at the final answer: the worked solution clean, ``#### N``'s digits
        # and what follows masked, so the loss lands on copying the last result
        fin = (torch.rand(B, generator=gen) < cfg.final_cut_frac) & ~blocky & ~prefix & ~cut
        for b in torch.nonzero(fin).flatten().tolist():
            if items[b].final >= 0:
                ltr(b, T - items[b].canvas + items[b].final)
    if cfg.result_weight != 1.0 or cfg.result_end_weight != 1.0:  # after the normalisation above
        for b, it in enumerate(items):
            if it.results:  # the computed results' digits, and the token after each (where its digit
                off = T - it.canvas  # count shows; the answer's eot follows its last line)
                weights[b, torch.tensor(it.results) + off] *= cfg.result_weight
                ends = [run[-1] + 1 for run in Tok.result_runs(it.results)]
                weights[b, torch.tensor(ends) + off] *= cfg.result_end_weight
    noisy = torch.where(masked, torch.full_like(clean, tok.mask), clean)
    return noisy, clean, key_mask, weights


def batch_loss(model, noisy, clean, key_mask, weights, canvas: int) -> torch.Tensor:
    """The batch's LLaDA SFT loss: sum(weights * CE over masked tokens) / B (make_batch's weights).

    Every masked position lies in its row's answer region, the last ``canvas_b <= canvas`` columns
    (rows are left padded), so logits are computed for the last ``canvas`` columns only, not over the
    prompts (1.04x the tokens/s, bench/train_step.py); the value equals the full-logits loss.
    """
    B, T = noisy.shape
    pos = torch.arange(T - canvas, T, device=noisy.device).expand(B, canvas)
    logits = model(noisy, model.new_store(key_mask), logits_pos=pos)  # (B, canvas, V)
    w = weights[:, T - canvas:]
    sel = w > 0
    ce = F.cross_entropy(logits[sel].float(), clean[:, T - canvas:][sel], reduction="none")  # (N,)
    return (ce * w[sel]).sum() / B


# --- model -----------------------------------------------------------------------------------------


def model_config(cfg: TrainConfig, tok: Tok) -> dict:
    """Official LLaDA config.json for this run (synthetic.tiny_config plus the remaining official fields)."""
    from ecache_cli.models.synthetic import tiny_config

    rows = -(-tok.vocab // 64) * 64
    c = tiny_config("llada", vocab_size=rows, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                    mlp_hidden=cfg.mlp_hidden, mask=tok.mask, eos=tok.eos)
    c["rope_theta"] = cfg.rope_theta
    c.update({
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                     "AutoModel": "modeling_llada.LLaDAModelLM",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
        "mlp_ratio": cfg.mlp_hidden // cfg.d_model, "multi_query_attention": None,
        "layer_norm_with_affine": True, "bias_for_layer_norm": False, "attention_layer_norm": False,
        "scale_logits": False, "input_emb_norm": False, "flash_attention": False,
        "attention_dropout": 0.0, "residual_dropout": 0.0, "embedding_dropout": 0.0,
        "block_group_size": 1, "use_cache": False, "precision": "fp32",
        "bos_token_id": tok.bos, "init_fn": "mitchell", "init_std": 0.02,
    })
    return c


def build_model(mcfg: dict, seed: int):
    from ecache_cli.models.llada import LLaDA
    from ecache_cli.models.spec import spec_from_config

    torch.manual_seed(seed)
    model = LLaDA(spec_from_config(mcfg))
    for name, p in model.named_parameters():  # GPT-2 style init; residual outputs scaled by depth
        if p.dim() == 1:
            torch.nn.init.ones_(p)
        else:
            std = 0.02
            if name.endswith("attn_out.weight") or (".blocks." in name and name.endswith("ff_out.weight")):
                std = 0.02 / math.sqrt(2 * mcfg["n_layers"])
            torch.nn.init.normal_(p, 0.0, std)
    return model


def lr_at(step: int, cfg: TrainConfig, start: int = 0) -> float:
    """Learning rate at ``step``: linear warmup over ``cfg.warmup`` steps from ``start`` (the step this
    schedule began, e.g. a warm start from exported weights), then constant or cosine to ``cfg.steps``;
    with ``cfg.cooldown`` > 0, times a linear decay from 1 to ``min_lr_frac`` over ``cfg.cooldown`` steps
    from ``cfg.cooldown_start`` (the warmup-stable-decay schedule of Hu et al. 2024, MiniCPM sec. 4)."""
    if step - start < cfg.warmup:
        return cfg.lr * (step - start + 1) / cfg.warmup
    if cfg.schedule == "const":
        lr = cfg.lr
    else:
        p = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        lr = cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))
    if cfg.cooldown > 0 and step >= cfg.cooldown_start:
        frac = min(1.0, (step - cfg.cooldown_start) / cfg.cooldown)
        lr *= 1.0 - frac * (1.0 - cfg.min_lr_frac)
    return lr


# --- evaluation ------------------------------------------------------------------------------------


@torch.inference_mode()
def greedy_generate(model, tok: Tok, prompts: list[list[int]], gen_length=256, block_length=32, steps=256):
    """LLaDA generate.py semantics at temperature 0 with low-confidence remasking (fallback decoder).

    Left-padded batch; blocks decoded left to right; each step commits the most confident masked
    positions of the current block (schedule: base count plus the remainder on the first steps).
    """
    B, P = len(prompts), max(len(p) for p in prompts)
    T = P + gen_length
    x = torch.full((B, T), tok.eos, dtype=torch.long)
    key_mask = torch.zeros(B, T, dtype=torch.bool)
    for b, p in enumerate(prompts):
        x[b, P - len(p):P] = torch.tensor(p)
        key_mask[b, P - len(p):] = True
    x[:, P:] = tok.mask
    nblocks = gen_length // block_length
    spb = steps // nblocks
    for k in range(nblocks):
        lo, hi = P + k * block_length, P + (k + 1) * block_length
        n_mask = (x[:, lo:hi] == tok.mask).sum(1)  # (B,)
        base, rem = n_mask // spb, n_mask % spb
        for s in range(spb):
            quota = base + (s < rem).long()  # (B,)
            logits = model(x, model.new_store(key_mask)).float()  # (B, T, V)
            p = logits.softmax(-1)
            conf, x0 = p.max(-1)  # (B, T)
            cand = x == tok.mask
            cand[:, :lo] = False
            cand[:, hi:] = False
            conf = torch.where(cand, conf, torch.full_like(conf, -math.inf))
            for b in range(B):
                q = int(quota[b])
                if q > 0:
                    idx = conf[b].topk(q).indices
                    x[b, idx] = x0[b, idx]
        done = (x[:, P:hi] == tok.eot) | (x[:, P:hi] == tok.eos)
        if bool(done.any(1).all()):  # every answer has ended: later blocks cannot change the text
            break
    return [tok.decode_completion(row[P:].tolist()) for row in x]


def generate_texts(model, tok: Tok, texts: list[str], batch: int = 24) -> list[str]:
    """Greedy gen 256 / block 32 / steps 256, policy none: the engine when it imports, else the fallback."""
    out: list[str] = []
    for i in range(0, len(texts), batch):
        chunk = texts[i:i + batch]
        try:
            from ecache_cli.engine import DecodeConfig, Engine

            eng = Engine(model, tok.hf, model.spec)
            res = eng.generate(chunk, DecodeConfig(gen_length=256, block_length=32, steps=256, temperature=0.0),
                               policy="none", chat=True, seed=0)
            out += [r.text for r in res]
        except Exception as e:  # noqa: BLE001 - the engine is optional here; never kill a training run
            log(f"engine unavailable ({type(e).__name__}: {e}); using the built-in greedy decoder")
            out += greedy_generate(model, tok, [tok.prompt_ids(t) for t in chunk])
    return out


def evaluate(model, tok: Tok, tasks: dict, n: int, shots_list, seed: int = 0) -> dict[str, float]:
    """Held-out (test split) greedy accuracy per (domain, shots) on ``n`` examples each."""
    model.eval()
    jobs = []
    for d, task in tasks.items():
        for shots in shots_list:
            for ex in task.examples("test", n, seed):
                jobs.append((d, shots, task, ex, task.prompt(ex, shots, seed)))
    jobs.sort(key=lambda j: len(j[4]))  # similar lengths batch together
    texts = generate_texts(model, tok, [j[4] for j in jobs])
    acc: dict[str, list[float]] = {}
    for (d, shots, task, ex, _), text in zip(jobs, texts):
        acc.setdefault(f"{d}/{shots}shot", []).append(task.score(ex, text))
    model.train()
    return {k: sum(v) / len(v) for k, v in sorted(acc.items())}


# --- training state (one file) and export ----------------------------------------------------------

STATE_FORMAT = "ecache-tiny-train-state/1"
FACT_DRILLS = 60  # drills (3-6 results each), and arith problems (ltr), in the curriculum eval's drill_fact_accuracy
EVAL_SEED = 1000  # the curriculum eval draws its own test examples: bench/quality.py (seed 0) stays untouched


def file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def tokenizer_sha256(tok_dir: Path) -> str:
    """SHA-256 over the tokenizer files (the ids a state was trained with must not change under it)."""
    import hashlib

    h = hashlib.sha256()
    for f in TOKENIZER_FILES:
        if (tok_dir / f).exists():
            h.update(f.encode() + b"\0" + (tok_dir / f).read_bytes())
    return h.hexdigest()


def save_state(path: Path, run: dict) -> None:
    """Write the whole training state to one file, atomically (a temporary file, then ``os.replace``).

    ``run`` holds: model, ema (state dicts, float32), opt (AdamW state dict), step, schedule_start, cfg,
    stats (train_seconds, tokens, cpu_seconds), stream (``Stream.state``), history (evals and sparse
    training logs), tokenizer_sha256; the torch and Python RNG states are added here.
    """
    state = {"format": STATE_FORMAT, **run, "torch_rng": torch.get_rng_state(), "py_rng": random.getstate()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_state(path: Path) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != STATE_FORMAT:
        raise SystemExit(f"{path}: not an {STATE_FORMAT} file (format {state.get('format')!r})")
    return state


def export(state_dict: dict, mcfg: dict, tok_dir: Path, out: Path, dtype: torch.dtype) -> None:
    """Write config.json, model.safetensors (official names) and the tokenizer files into ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(mcfg, torch_dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    state = {k: v.detach().to(dtype).contiguous() for k, v in state_dict.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # package data: readable by everyone
    for f in TOKENIZER_FILES:
        src = tok_dir / f
        if src.exists() and src.resolve() != (out / f).resolve():
            shutil.copyfile(src, out / f)


# --- main ------------------------------------------------------------------------------------------


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
    "drill_arith_frac": "fraction of drills made of computations of arith train problems, as their solutions write them",
    "drill_chain_frac": "fraction of drills whose lines use the line before's result, as arith solutions do",
    "drill_small_frac": "fraction of the drills' - and * lines with a small result: 1-20 differences, "
                        "differences from a round 10-200, products up to 20",
    "result_end_weight": "loss weight of the token right after each computed result (where its digit count shows)",
    "result_cut_frac": "fraction of the arith solutions and drills without a block or prefix mask that are masked "
                       "from the first digit of a random computed result on (its operands clean, its digit count to predict)",
    "final_cut_frac": "fraction of the arith solutions without a block, prefix or result-cut mask that are masked "
                      "from the first digit of the final '#### N' on (the solution clean, the answer to copy)",
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ap.add_argument("--state", type=Path, default=REPO / "scripts/tiny_train_state.pt",
                    help="the training state file (tracked; resumed when it exists)")
    ap.add_argument("--fresh", action="store_true", help="start a new run even if --state exists (overwrites it)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="new run only: start from the weights of an exported model directory")
    ap.add_argument("--minutes", type=float, default=0.0, help="stop after this much training wall time (0: --steps)")
    ap.add_argument("--max-new-steps", type=int, default=0, help="stop after this many steps in this call (0: no limit)")
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
    args.given = {k for k in asdict(d) if any(w.split("=")[0] == "--" + k.replace("_", "-") for w in words)}
    return args, cfg


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv=None) -> None:
    args, cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    device = torch.device(args.device)
    tok_dir = args.tokenizer
    tok = Tok(tok_dir)
    state = None
    if args.state.exists() and not args.fresh:
        state = load_state(args.state)
        if state["tokenizer_sha256"] != tokenizer_sha256(tok_dir):
            raise SystemExit(f"{tok_dir}: tokenizer differs from the one {args.state} was trained with")
        # the saved run's settings, except flags given now (a resumed run may change its schedule, data
        # mix or bookkeeping from the resumed step on; the model shape must not change)
        override = {k: getattr(cfg, k) for k in args.given}
        for k in ("d_model", "n_layers", "n_heads", "mlp_hidden", "rope_theta"):
            if k in override and override[k] != state["cfg"][k]:
                raise SystemExit(f"--{k.replace('_', '-')} cannot change on resume (state has {state['cfg'][k]})")
        saved = {k: tuple(v) if isinstance(v, list) else v for k, v in state["cfg"].items()}
        cfg = TrainConfig(**{**asdict(TrainConfig()), **saved, **override})
        torch.set_num_threads(cfg.threads)
        if override:
            log(f"resume overrides from step {state['step']}: {json.dumps(override)}")
    elif args.export_only:
        raise SystemExit(f"{args.state}: no training state to export")
    if cfg.adapt_by not in ("examples", "tokens"):
        raise SystemExit(f"--adapt-by {cfg.adapt_by!r}: use examples or tokens")
    tasks = load_tasks(cfg.domains)
    mcfg = model_config(cfg, tok)
    model = build_model(mcfg, cfg.seed)
    run = {"step": 0, "schedule_start": 0, "stats": {"train_seconds": 0.0, "cpu_seconds": 0.0, "tokens": 0},
           "history": [], "stream": None, "tokenizer_sha256": tokenizer_sha256(tok_dir), "opt": None,
           "init_from": None}
    if state is not None:
        model.load_state_dict(state["model"])
        run.update({k: state[k] for k in run if k in state})
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["py_rng"])
    if "cooldown" in args.given and "cooldown_start" not in args.given:
        if cfg.cooldown > 0:
            cfg.cooldown_start = run["step"]  # the decay phase starts where this call resumes
            log(f"cooldown: LR decays linearly to {cfg.lr * cfg.min_lr_frac:g} over steps "
                f"{cfg.cooldown_start}..{cfg.cooldown_start + cfg.cooldown}")
        elif state is not None and state["cfg"].get("cooldown", 0) > 0:
            run["schedule_start"] = run["step"]  # back to the stable LR through a fresh warmup
            log(f"cooldown off: LR warms up again to {cfg.lr:g} over {cfg.warmup} steps")
    if state is None and args.init_from is not None:
        from safetensors.torch import load_file

        sd = load_file(str(args.init_from / "model.safetensors"))
        model.load_state_dict({k: v.float() for k, v in sd.items()})
        run["init_from"] = {"dir": str(args.init_from), "sha256": file_sha256(args.init_from / "model.safetensors")}
        log(f"new run from the weights in {args.init_from}")
    model.to(device)
    ema_model = None
    if cfg.ema > 0:
        ema_model = build_model(mcfg, cfg.seed).to(device)
        ema_model.load_state_dict(state["ema"] if state is not None and state.get("ema") else model.state_dict())
        ema_model.requires_grad_(False)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)
    if run["opt"] is not None:
        opt.load_state_dict(run["opt"])
    log(f"config {json.dumps(asdict(cfg))}")
    log(f"model {n_params:,} params ({n_params / 1e6:.2f}M), vocab {tok.vocab} -> {mcfg['vocab_size']} rows; "
        f"step {run['step']}; {run['stats']['tokens'] / 1e6:.1f}M tokens, "
        f"{run['stats']['cpu_seconds'] / 3600:.2f} CPU-hours so far")

    if not args.export_only:
        train(model, ema_model, opt, tok, tasks, cfg, run, args)
    final = ema_model if ema_model is not None else model
    if args.export or args.export_only:
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        export({k: v.cpu() for k, v in final.state_dict().items()}, mcfg, tok_dir, args.out, dtype)
        log(f"exported step {run['step']} ({'EMA' if ema_model is not None else 'raw'} weights) to {args.out} "
            f"({sum(f.stat().st_size for f in args.out.iterdir()) / 1e6:.1f} MB)")
    if args.final_eval_n > 0:
        t0 = time.time()
        acc = evaluate(final, tok, tasks, args.final_eval_n, cfg.eval_shots)
        log(f"final eval ({args.final_eval_n}/setting, {time.time() - t0:.0f}s): {json.dumps(acc)}")


def _adapt(acc: dict[str, float], cfg: TrainConfig, costs: tuple[float, ...] | None = None) -> tuple[float, ...]:
    """Domain weights (per-example sampling weights) from held-out accuracy: floor + mean error over
    the evaluated shot settings. With ``cfg.adapt_by == "tokens"`` that target is each domain's share
    of tokens: the weights are divided by ``costs`` (mean tokens per example of each domain,
    :func:`domain_costs`) and rescaled to the same mean."""
    out = []
    for d in cfg.domains:
        errs = [1.0 - v for k, v in acc.items() if k.split("/")[0] == d]
        out.append(cfg.adapt_floor + (sum(errs) / len(errs) if errs else 1.0))
    if cfg.adapt_by == "tokens":
        if costs is None:
            raise ValueError("adapt_by tokens needs the domains' costs")
        mean_cost = sum(costs) / len(costs)
        out = [w * mean_cost / c for w, c in zip(out, costs)]
    return tuple(round(w, 3) for w in out)


def domain_costs(cfg: TrainConfig, tok: Tok, tasks: dict, n: int = 256) -> tuple[float, ...]:
    """Mean tokens (prompt + canvas) of one example of each of ``cfg.domains`` as the stream draws them
    (few-shot prompts, canvases; ``arith`` includes its share of drills), from ``n`` draws each with a
    fixed seed."""
    stream = Stream(cfg, tok, tasks)
    rng = random.Random(f"cost:{cfg.seed}")
    out = []
    for i in range(len(cfg.domains)):
        onehot = [float(j == i) for j in range(len(cfg.domains))]
        out.append(sum(stream.item(rng, onehot).length for _ in range(n)) / n)
    return tuple(round(c, 1) for c in out)


def train(model, ema_model, opt, tok, tasks, cfg: TrainConfig, run: dict, args) -> None:
    """Train until ``cfg.steps``, ``--minutes`` or ``--max-new-steps``; save ``run`` to ``--state`` every
    ``cfg.save_every_min`` minutes and at the end. Steps/s, tokens/s and CPU-hours go to the log."""
    device = next(model.parameters()).device
    stream = Stream(cfg, tok, tasks)
    stream.start_workers(args.data_workers, args.tokenizer)
    if run["stream"] is not None:
        stream.restore(run["stream"])
    logf = open(args.log, "a")
    stats, history = run["stats"], run["history"]

    def record(rec: dict) -> None:
        logf.write(json.dumps(rec) + "\n")
        logf.flush()

    costs = domain_costs(cfg, tok, tasks) if cfg.adapt_by == "tokens" else None
    if costs is not None:
        log(f"mean tokens per example ({', '.join(cfg.domains)}): {costs}")
    last = next((h for h in reversed(history) if "eval" in h), None)
    if cfg.adapt_every_min > 0 and last is not None and last.get("adapt_by", "examples") != cfg.adapt_by:
        stream.weights = _adapt(last["eval"], cfg, costs)  # a resumed run switched --adapt-by: apply it now
        log(f"--adapt-by {cfg.adapt_by}: weights {stream.weights} from the eval at step {last['step']}")

    def do_eval() -> None:
        t0 = time.time()
        judged = ema_model if ema_model is not None else model  # the weights an export would ship
        acc = evaluate(judged, tok, tasks, cfg.eval_n, cfg.eval_shots, seed=EVAL_SEED)
        drng = random.Random(f"facts:{EVAL_SEED}")  # held-out drills: computation alone (drill_fact_accuracy)
        facts = drill_fact_accuracy(judged, tok, [arith_drill(drng) for _ in range(FACT_DRILLS)])
        rec = {"step": run["step"], "eval": acc, "n": cfg.eval_n, "tokens": stats["tokens"],
               "cpu_h": round(stats["cpu_seconds"] / 3600, 3), "eval_s": round(time.time() - t0),
               "facts": _rates(facts)}
        if "arith" in tasks:  # the benchmark's own computations, each from a correct prefix
            probs = [(ex.question, ex.answer) for ex in tasks["arith"].examples("test", FACT_DRILLS, EVAL_SEED)]
            rec["facts_ltr"] = _rates(drill_fact_accuracy(judged, tok, probs, mode="ltr"))
        if cfg.adapt_every_min > 0:
            stream.weights = _adapt(acc, cfg, costs)
            rec["next_weights"], rec["adapt_by"] = list(stream.weights), cfg.adapt_by
        history.append(rec)
        record(rec)
        log(f"eval step {run['step']} ({cfg.eval_n}/setting, {rec['eval_s']}s): {json.dumps(acc)}; facts {rec['facts']}"
            + (f"; arith facts ltr {rec['facts_ltr']}" if "facts_ltr" in rec else "")
            + (f" -> weights {stream.weights}" if cfg.adapt_every_min > 0 else ""))

    def save() -> None:
        run["model"] = model.state_dict()
        run["ema"] = ema_model.state_dict() if ema_model is not None else None
        run["opt"] = opt.state_dict()
        run["cfg"] = asdict(cfg)
        run["stream"] = stream.state()
        save_state(args.state, run)

    if cfg.adapt_every_min > 0 and not any("eval" in h for h in history):
        do_eval()  # a new run: set the first domain weights from the starting model's errors
    model.train()
    t_start = last_save = last_eval = time.time()
    start_step = run["step"]
    win_loss, win_tok, win_steps, win_t0 = 0.0, 0, 0, time.time()
    while run["step"] < cfg.steps:
        if args.minutes and time.time() - t_start > args.minutes * 60:
            break
        if args.max_new_steps and run["step"] - start_step >= args.max_new_steps:
            break
        step = run["step"]
        items = stream.next()
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        noisy, clean, key_mask, weights = (t.to(device) for t in make_batch(items, tok, cfg, gen))
        lr = lr_at(step, cfg, run["schedule_start"])
        for g in opt.param_groups:
            g["lr"] = lr
        loss = batch_loss(model, noisy, clean, key_mask, weights, max(it.canvas for it in items))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if ema_model is not None:
            with torch.no_grad():
                torch._foreach_lerp_(list(ema_model.parameters()), list(model.parameters()), 1.0 - cfg.ema)
        run["step"] = step = step + 1
        ntok = int(key_mask.sum())
        win_loss += loss.item()
        win_tok += ntok
        win_steps += 1
        stats["tokens"] += ntok
        if step % cfg.log_every == 0:
            dt = time.time() - win_t0
            stats["train_seconds"] += dt
            stats["cpu_seconds"] += dt * cfg.threads
            rec = {"step": step, "loss": win_loss / win_steps, "lr": lr, "gnorm": float(gnorm),
                   "tok_s": win_tok / dt, "tokens": stats["tokens"], "cpu_h": round(stats["cpu_seconds"] / 3600, 3)}
            log(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()))
            record(rec)
            if step % (cfg.log_every * 20) == 0:
                history.append(rec)
            stats["last_loss"] = rec["loss"]
            win_loss, win_tok, win_steps, win_t0 = 0.0, 0, 0, time.time()
        if cfg.adapt_every_min > 0 and time.time() - last_eval > cfg.adapt_every_min * 60:
            do_eval()
            model.train()
            last_eval = win_t0 = time.time()
        if time.time() - last_save > cfg.save_every_min * 60:
            save()
            last_save = time.time()
    save()
    stream.close()
    log(f"saved step {run['step']} to {args.state} ({args.state.stat().st_size / 1e6:.1f} MB)")
    logf.close()


if __name__ == "__main__":
    sys.exit(main())
