"""Training data of the embedded model: tokens, drills, the stream of batches and their masks.

- ``Tok``: the tokenizer with LLaDA's special ids and the chat template, plus the positions of the
  computed results in an ``arith`` answer;
- ``arith_drill``: training-only arithmetic drills;
- ``Stream``: a deterministic stream of length-sorted batches drawn from ``ecache_cli.tasks`` (batch
  ``k`` is a pure function of the seed, the pool and the domain weights), optionally built ahead in
  worker processes;
- ``make_batch``: one batch's clean and masked tokens and loss weights, LLaDA's SFT forward process
  (Nie et al. 2025, "Large Language Diffusion Models", sec. 2.3 and eq. 5): the prompt is never masked,
  each answer-region token is masked with probability t ~ U(t_min, 1); some rows get a structured mask
  instead (semi-autoregressive block, left to right, cut at a computed result).

Every random draw comes from a seeded ``random.Random`` or ``torch.Generator``, so a resumed run sees
the batches an uninterrupted one would.
"""

from __future__ import annotations

import math
import os
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .config import TrainConfig, config_from_dict

# --- tokenizer and prompts ------------------------------------------------------------------------


class Tok:
    """The tokenizer of a model directory plus LLaDA's special ids and chat template.

    ``path``: a directory with tokenizer.json, tokenizer_config.json and special_tokens_map.json
    (``ecache_cli/data/tiny``). Ids are Python ints; ``vocab`` is the tokenizer's size (the model's
    embedding may have more rows).

    Raises:
        ValueError: the tokenizer lacks one of LLaDA's special tokens, or its mask id equals its EOS id.
    """

    def __init__(self, path: Path):
        import transformers

        transformers.utils.logging.set_verbosity_error()  # config.json's model_type is unknown to transformers
        self.hf = transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        ids = self.hf.convert_tokens_to_ids
        self.bos, self.eos, self.mask = ids("<|startoftext|>"), ids("<|endoftext|>"), ids("<|mdm_mask|>")
        self.eot = ids("<|eot_id|>")
        if None in (self.bos, self.eos, self.mask, self.eot):
            raise ValueError(f"{path}: the tokenizer lacks LLaDA's special tokens (<|startoftext|>, "
                             "<|endoftext|>, <|mdm_mask|>, <|eot_id|>)")
        if self.mask == self.eos:  # the EOS padding of the canvas must stay distinguishable from masks
            raise ValueError(f"{path}: the mask id equals the EOS/pad id ({self.mask})")
        self.vocab = len(self.hf)
        v = self.hf.get_vocab()  # the tokens result_positions / result_copies look for
        self._digits = {v[str(d)] for d in range(10) if str(d) in v}
        self._eq, self._lead = v.get(" ="), {v.get(" "), v.get(" $")}

    def prompt_ids(self, text: str) -> list[int]:
        """Chat-template ``text`` as one user turn and tokenize (the BOS comes from the template)."""
        s = self.hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                        add_generation_prompt=True)
        return self.hf(s, add_special_tokens=False)["input_ids"]

    def answer_ids(self, text: str) -> list[int]:
        """Tokenize an answer and end it with ``<|eot_id|>`` (the end of an assistant turn)."""
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

    def result_copies(self, ids: list[int],
                      results: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
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


def arith_drill(rng: random.Random, op_weights=None, div_max: int = 20) -> tuple[str, str]:
    """A training-only arithmetic drill ``(question, answer)``: 3-6 expressions in the prompt, the answer
    restates each with its result (``14 * 4 = 56``), one per line, in the ``arith`` solutions' notation.

    ``op_weights``: 4 floats for ``DRILL_OPS`` (None: uniform) setting how often each operation is drawn.
    ``div_max`` > 20 makes half of the divisions have a 21-``div_max`` quotient (dividend at most 250
    while ``div_max`` <= 125); at 20 no extra draw is made (the stream equals a drill without the option).

    The operand ranges cover the computations of the ``arith`` templates (ecache_cli/tasks/arith.py):
    products of a 2-12 factor and a 2-80 factor, sums up to 250 + 100, differences with a positive
    result and exact divisions with a 2-20 quotient (the teams template's quotients reach 89, bakery's
    36: ``div_max`` 90). A worked ``arith`` solution spends most of its tokens copying the problem; the
    drills put the loss on the results.
    """
    lines = []
    for _ in range(rng.randint(3, 6)):
        op = rng.choice(DRILL_OPS) if op_weights is None else rng.choices(DRILL_OPS, weights=op_weights)[0]
        if op == "*":
            a, b = rng.randint(2, 12), rng.randint(2, 80)
            if rng.random() < 0.5:
                a, b = b, a
            r = a * b
        elif op == "+":
            a, b = rng.randint(1, 250), rng.randint(1, 100)
            if rng.random() < 0.3:
                a, b = b, a
            r = a + b
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


FACT_OP = re.compile(r"\d+ ([-+*/]) \$?\d+ = \$?\d+")  # the computations of drills and arith solutions, in order


def list_op_weights(specs) -> dict[str, float]:
    """Parse ``--list-op-weights`` items ("Op=w", Op one of ecache_cli/tasks/listops.py's OPS, w >= 0)
    into {op: w}.

    Raises:
        SystemExit: a bad item, named with the fix (the command line's one-line error).
    """
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
    """{name: task} of ``ecache_cli.tasks`` for ``domains`` (code execution allowed: ``code`` is scored
    by running its tests in the sandbox)."""
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
    """One training example as token ids: prompt (chat-templated), answer and its canvas length."""

    prompt: list[int]
    answer: list[int]  # answer tokens + eot
    canvas: int  # answer-region length (answer + eot + EOS padding)
    results: tuple[int, ...] = ()  # answer indices of computed result digits (result_positions)
    copies: tuple = ()  # per result: (its digit indices, indices of its later copies) (result_copies)

    @property
    def length(self) -> int:
        return len(self.prompt) + self.canvas


class Stream:
    """Deterministic stream of batches (lists of ``Item``) under a token budget.

    Pool ``p`` is drawn from ``random.Random(f"pool:{seed}:{p}")`` with the domain weights current
    when it starts (``weights``, which the curriculum replaces): ``pool_batches * batch_tokens`` tokens
    of examples, sorted by length, cut greedily into batches of at most ``batch_tokens`` padded tokens
    (longest * count), shuffled. ``state()``/``restore()`` save and rebuild the position, so a resumed
    run continues the same stream.
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
        """Continue from ``state()``'s position: the current pool is rebuilt from its seed and weights."""
        self.weights = tuple(st["weights"])
        if st["pool_idx"] >= 0:
            self.pool_idx = st["pool_idx"]
            self.pool_weights = tuple(st["pool_weights"])
            self.batches, self.pos = self._build_pool(self.pool_idx, self.pool_weights), st["pos"]

    def item(self, rng: random.Random, weights) -> Item:
        """One example drawn with ``rng``: a domain by ``weights`` (drills ride on ``arith``'s weight
        times ``drill_frac``), a train-split problem, 0 or 1..max_shots shots, and a canvas: one of
        ``canvas_choices`` for ``full_canvas_frac`` of the examples, else answer + eot + k EOS with k
        log-uniform in 1..``extra_eos`` (so the canvas length does not give the answer's away).
        Examples whose prompt exceeds ``max_prompt_tokens`` or whose answer does not fit ``canvas`` are
        drawn again."""
        cfg = self.cfg
        names, w = list(cfg.domains), list(weights)
        if cfg.drill_frac > 0 and "arith" in names:  # arithmetic drills ride on arith's weight
            names.append("drill")
            w.append(cfg.drill_frac * w[names.index("arith")])
        while True:
            name = rng.choices(names, weights=w)[0]
            if name == "drill":
                question, target = arith_drill(rng, self.drill_ops, cfg.drill_div_max)
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
            else:  # log-uniform trailing EOS count: the canvas length must not reveal the answer's
                extra = int(math.exp(rng.uniform(0.0, math.log(cfg.extra_eos + 1))))
                canvas = min(cfg.canvas, len(answer) + max(1, extra))
            results = self.tok.result_positions(answer) if name in ("arith", "drill") else ()
            copies = self.tok.result_copies(answer, results) if cfg.copy_mask > 0 and results else ()
            return Item(prompt, answer, canvas, results, copies)

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
        """The next batch, starting a new pool (with the current ``weights``) when one runs out."""
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
        """Stop the worker processes, if any."""
        if self._mp is not None:
            self._mp.terminate()
            self._mp = None


_WORKER: Stream | None = None


def _worker_init(cfg: dict, tok_dir: str) -> None:
    global _WORKER
    import torch as _torch

    _torch.set_num_threads(1)
    c = config_from_dict(cfg)
    _WORKER = Stream(c, Tok(Path(tok_dir)), load_tasks(c.domains))


def _worker_pool(idx: int, weights) -> list[list[Item]]:
    return _WORKER._build_pool(idx, weights)


def make_batch(items: list[Item], tok: Tok, cfg: TrainConfig, gen: torch.Generator):
    """One batch for LLaDA's SFT loss: ``(noisy, clean, key_mask, weights)``, each of shape (B, T), T the
    longest item's prompt + canvas, rows left padded with EOS.

    - ``clean`` (int64): prompt + answer + EOS padding up to the item's canvas;
    - ``noisy`` (int64): ``clean`` with the masked answer-region positions set to ``tok.mask``;
    - ``key_mask`` (bool): True on each row's own positions (False on the left padding);
    - ``weights`` (float32): the loss weight of each masked position, 0 elsewhere: 1 / (t_b * canvas_b)
      with ``cfg.loss_norm == "t"`` (LLaDA eq. 5), 1 / n_masked_b with "masked" and on rows given a
      structured mask (block, left to right, result cut), times ``cfg.result_weight`` on the digits of
      computed results; so sum(weights * CE) / B is the batch's loss (``loop.batch_loss``).

    ``gen``: the batch's generator (the training loop seeds it with seed * 1_000_003 + step). The draws
    a setting switches on (``copy_mask``, ``result_cut_frac``) happen only when it is > 0, so a run
    without it keeps its batches.
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
    if cfg.result_weight != 1.0:  # after the normalisation above: the computed results' digits
        for b, it in enumerate(items):
            if it.results:
                weights[b, torch.tensor(it.results) + (T - it.canvas)] *= cfg.result_weight
    noisy = torch.where(masked, torch.full_like(clean, tok.mask), clean)
    return noisy, clean, key_mask, weights


