"""Evaluation during training: held-out greedy accuracy, arithmetic-fact accuracy, curriculum weights.

- ``evaluate``: greedy accuracy per (domain, shots) on held-out test-split problems, decoded by the
  engine (``ecache_cli.engine``, policy ``none``) or, when it does not import, by ``greedy_generate``;
- ``drill_fact_accuracy``: how often the model computes each result of a drill or worked solution
  from one forward with that result's digits masked (also used by bench/arith_facts.py);
- ``adapt_weights`` / ``domain_costs``: the curriculum's domain weights from held-out error.
"""

from __future__ import annotations

import math
import random

import torch

from .config import TrainConfig, log
from .data import FACT_OP, Stream, Tok

FACT_DRILLS = 60  # drills (3-6 results each), and arith problems (ltr), in the curriculum eval's drill_fact_accuracy
EVAL_SEED = 1000  # the curriculum eval draws its own test examples: bench/quality.py (seed 0) stays untouched


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


def rates(counts: dict[str, list[int]]) -> dict[str, float]:
    """{op: right / total} of drill_fact_accuracy's counts, rounded for the log."""
    return {op: round(c[0] / c[1], 3) for op, c in sorted(counts.items())}


@torch.inference_mode()
def greedy_generate(model, tok: Tok, prompts: list[list[int]], gen_length=256, block_length=32, steps=256):
    """Greedy decoding of ``prompts`` (token-id lists) as LLaDA's generate.py does it at temperature 0
    with low-confidence remasking (github.com/ML-GSAI/LLaDA, generate.py); the fallback when the engine
    does not import. Returns each completion's text up to its first eot/EOS.

    Left-padded batch of shape (B, P + gen_length); blocks of ``block_length`` decoded left to right,
    ``steps // n_blocks`` denoising steps each; a step commits the most confident masked positions of
    the current block (base count per step plus the remainder on the first steps, generate.py's
    ``get_num_transfer_tokens``). Stops early once every row has an eot/EOS.
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
    """Completions of ``texts`` (chat-templated), greedy, gen length 256, block 32, 256 steps, no cache
    (policy ``none``): the engine when it imports, else ``greedy_generate``; ``batch`` prompts at a time."""
    out: list[str] = []
    for i in range(0, len(texts), batch):
        chunk = texts[i:i + batch]
        try:
            from ecache_cli.cache import make_policy
            from ecache_cli.engine import DecodeConfig, Engine

            eng = Engine(model, tok.hf, model.spec)
            res = eng.generate(chunk, DecodeConfig(gen_length=256, block_length=32, steps=256, temperature=0.0),
                               policy=make_policy("none"), chat=True, seed=0)
            out += [r.text for r in res]
        except Exception as e:  # noqa: BLE001 - the engine is optional here; never kill a training run
            log(f"engine unavailable ({type(e).__name__}: {e}); using the built-in greedy decoder")
            out += greedy_generate(model, tok, [tok.prompt_ids(t) for t in chunk])
    return out


def evaluate(model, tok: Tok, tasks: dict, n: int, shots_list, seed: int = 0) -> dict[str, float]:
    """Held-out greedy accuracy: {"<domain>/<shots>shot": mean score} over the first ``n`` test-split
    examples of each task (seed ``seed``) at each of ``shots_list``, scored by the task's own ``score``.
    Leaves the model in training mode."""
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


def adapt_weights(acc: dict[str, float], cfg: TrainConfig, costs: tuple[float, ...] | None = None) -> tuple[float, ...]:
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


