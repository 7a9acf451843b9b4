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

Canvas lengths are sampled: ``--full-canvas-frac`` of the examples use the evaluation canvas (256),
the rest answer + eot + 1..``--extra-eos`` EOS, which saves the compute spent on EOS padding. Batches
are built from a pool sorted by length (little left padding) under a token budget.

Everything random derives from ``--seed`` and the step (data, masks), so a resumed run continues the
same data stream. Checkpoints (model, optimizer, step, RNG states) go to ``--ckpt`` every
``--save-every-min`` minutes; ``--resume`` continues, ``--export-only`` writes the model directory.

    # the shipped weights (defaults = that run's settings; ~61 min at ~13k tokens/s on 2 CPU cores):
    python scripts/train_tiny.py --ckpt scripts/_train_state_v3            # stopped at step 9214, then
    python scripts/train_tiny.py --ckpt scripts/_train_state_v3 --resume --steps 13000 --eval-every 0
    python scripts/train_tiny.py --ckpt scripts/_train_state_v3 --resume --steps 22500 --domain-weights 4,2,1.5 \
        --eval-every 0
    python scripts/train_tiny.py --ckpt DIR --resume    # continue after an interruption
    python scripts/train_tiny.py --ckpt DIR --export-only --final-eval-n 24
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
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
    steps: int = 20000
    lr: float = 2e-3
    min_lr_frac: float = 0.1  # cosine decays to lr * min_lr_frac
    warmup: int = 200
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    batch_tokens: int = 2048  # padded tokens per step (prompt + canvas)
    # data
    seed: int = 0
    domains: tuple[str, ...] = ("list", "code", "arith")
    domain_weights: tuple[float, ...] = (3.0, 2.0, 1.5)
    fewshot_frac: float = 0.08  # examples with a 1..max_shots few-shot prompt (long prompts, costly)
    max_shots: int = 4
    max_prompt_tokens: int = 1024
    canvas: int = 256  # evaluation gen length
    full_canvas_frac: float = 0.05
    extra_eos: int = 16
    block: int = 32  # evaluation block length (for block-structured masks)
    block_mask_frac: float = 0.15
    prefix_mask_frac: float = 0.2  # examples with a left-to-right mask: answer[:c] clean, answer[c:] masked
    t_min: float = 1e-3
    loss_norm: str = "masked"  # "t": CE / (t * L) (LLaDA eq. 5); "masked": CE / n_masked (same expectation, low variance)
    pool_batches: int = 16  # batches built per length-sorted pool
    # bookkeeping
    log_every: int = 20
    eval_every: int = 2500
    eval_n: int = 8  # held-out examples per domain per shot setting
    eval_shots: tuple[int, ...] = (0,)
    save_every_min: float = 3.0
    threads: int = 2


# --- tokenizer and prompts ------------------------------------------------------------------------


class Tok:
    """The tokenizer plus the LLaDA special ids and a cached chat-template renderer."""

    def __init__(self, path: Path):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        ids = self.hf.convert_tokens_to_ids
        self.bos, self.eos, self.mask = ids("<|startoftext|>"), ids("<|endoftext|>"), ids("<|mdm_mask|>")
        self.eot = ids("<|eot_id|>")
        assert None not in (self.bos, self.eos, self.mask, self.eot), "tokenizer lacks LLaDA special tokens"
        assert self.mask != self.eos, "mask id must differ from the EOS/pad id (spec D.8)"
        self.vocab = len(self.hf)

    def prompt_ids(self, text: str) -> list[int]:
        """Chat-template ``text`` as one user turn and tokenize (the BOS comes from the template)."""
        s = self.hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                        add_generation_prompt=True)
        return self.hf(s, add_special_tokens=False)["input_ids"]

    def answer_ids(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"] + [self.eot]

    def decode_completion(self, ids: list[int]) -> str:
        """Text of a generated span up to its first eot/EOS (the engine's convention)."""
        out = []
        for i in ids:
            if i in (self.eot, self.eos):
                break
            out.append(i)
        return self.hf.decode(out, skip_special_tokens=True)


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

    def item(self, rng: random.Random) -> Item:
        cfg = self.cfg
        while True:
            task = self.tasks[rng.choices(cfg.domains, weights=cfg.domain_weights)[0]]
            ex = task.examples("train", 1, rng.randrange(1 << 40))[0]
            shots = rng.randint(1, cfg.max_shots) if rng.random() < cfg.fewshot_frac else 0
            prompt = self.tok.prompt_ids(task.prompt(ex, shots, rng.randrange(1 << 30)))
            answer = self.tok.answer_ids(task.target(ex))
            if len(prompt) > cfg.max_prompt_tokens or len(answer) + 1 > cfg.canvas:
                continue  # too long for evaluation settings; redraw
            if rng.random() < cfg.full_canvas_frac:
                canvas = cfg.canvas
            else:
                canvas = min(cfg.canvas, len(answer) + rng.randint(1, cfg.extra_eos))
            return Item(prompt, answer, canvas)

    def _build_pool(self, pool: int) -> list[list[Item]]:
        cfg = self.cfg
        rng = random.Random(f"pool:{cfg.seed}:{pool}")
        items, budget = [], cfg.pool_batches * cfg.batch_tokens
        while sum(it.length for it in items) < budget:
            items.append(self.item(rng))
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
            self.batches, self.pos = self._build_pool(self.pool_idx), 0
        self.pos += 1
        return self.batches[self.pos - 1]

    def skip(self, n: int) -> None:
        """Advance past ``n`` batches (resume) by counting batches per pool."""
        for _ in range(n):
            self.next()


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
        weights = masked.float() / masked.sum(1, keepdim=True).float()
    else:
        weights = masked.float() / (t[:, None] * region.sum(1, keepdim=True).float())
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
        masked[b] = m
        weights[b] = m.float() / m.sum()
    prefix = (torch.rand(B, generator=gen) < cfg.prefix_mask_frac) & ~blocky
    for b in torch.nonzero(prefix).flatten().tolist():
        # left-to-right order (what confidence-ordered decoding approaches): a clean answer prefix,
        # everything after the cut masked; the cut is uniform over the answer and its eot
        start, n = T - items[b].canvas, len(items[b].answer)
        c = start + int(torch.randint(0, n, (1,), generator=gen))
        m = torch.zeros(T, dtype=torch.bool)
        m[c:] = True
        masked[b] = m
        weights[b] = m.float() / m.sum()
    noisy = torch.where(masked, torch.full_like(clean, tok.mask), clean)
    return noisy, clean, key_mask, weights


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


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


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


# --- checkpointing and export ----------------------------------------------------------------------


def save_state(path: Path, model, opt, step: int, cfg: TrainConfig, stats: dict) -> None:
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "cfg": asdict(cfg),
             "stats": stats, "torch_rng": torch.get_rng_state(), "py_rng": random.getstate()}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def export(model, mcfg: dict, tok_dir: Path, out: Path, dtype: torch.dtype) -> None:
    """Write config.json, model.safetensors (official names) and the tokenizer files into ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(mcfg, torch_dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # package data: readable by everyone
    for f in TOKENIZER_FILES:
        src = tok_dir / f
        if src.exists() and src.resolve() != (out / f).resolve():
            shutil.copyfile(src, out / f)


# --- main ------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    d = TrainConfig()
    for name, val in asdict(d).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(val, tuple):
            kind = type(val[0])
            ap.add_argument(flag, type=lambda s, k=kind: tuple(k(x) for x in s.split(",")), default=val,
                            help=f"comma-separated (default {','.join(map(str, val))})")
        else:
            ap.add_argument(flag, type=type(val), default=val, help=f"(default {val})")
    ap.add_argument("--tokenizer", type=Path, default=REPO / "ecache_cli/data/tiny", help="tokenizer directory")
    ap.add_argument("--out", type=Path, default=REPO / "ecache_cli/data/tiny", help="model directory to write")
    ap.add_argument("--ckpt", type=Path, default=REPO / "scripts/_train_state", help="training state directory")
    ap.add_argument("--resume", action="store_true", help="continue from --ckpt/state.pt")
    ap.add_argument("--export-only", action="store_true", help="export --ckpt/state.pt to --out (and evaluate)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="exported weight dtype")
    ap.add_argument("--final-eval-n", type=int, default=24, help="held-out examples per (domain, shots) at the end")
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
    ckpt = args.ckpt
    ckpt.mkdir(parents=True, exist_ok=True)
    state_path = ckpt / "state.pt"
    tok_dir = ckpt / "tokenizer"  # snapshot, so a tokenizer rebuilt mid-run cannot change the ids
    if not (args.resume or args.export_only) or not tok_dir.exists():
        tok_dir.mkdir(exist_ok=True)
        for f in TOKENIZER_FILES:
            if (args.tokenizer / f).exists():
                shutil.copyfile(args.tokenizer / f, tok_dir / f)
    tok = Tok(tok_dir)
    tasks = load_tasks(cfg.domains)
    state = None
    if args.resume or args.export_only:
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        # the saved run's settings, except flags given now (a resumed run may change its schedule,
        # data mix or bookkeeping from the resumed step on; the model shape must not change)
        override = {k: getattr(cfg, k) for k in args.given}
        for k in ("d_model", "n_layers", "n_heads", "mlp_hidden", "rope_theta"):
            assert k not in override or override[k] == state["cfg"][k], f"--{k} cannot change on resume"
        saved = {k: tuple(v) if isinstance(v, list) else v for k, v in state["cfg"].items()}
        cfg = TrainConfig(**{**asdict(TrainConfig()), **saved, **override})
        if override:
            log(f"resume overrides from step {state['step']}: {json.dumps(override)}")
    mcfg = model_config(cfg, tok)
    model = build_model(mcfg, cfg.seed)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)
    step, stats = 0, {"train_seconds": 0.0, "tokens": 0}
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, stats = state["step"], state["stats"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["py_rng"])
    log(f"config {json.dumps(asdict(cfg))}")
    log(f"model {n_params:,} params ({n_params / 1e6:.2f}M), vocab {tok.vocab} -> {mcfg['vocab_size']} rows; step {step}")

    if not args.export_only:
        train(model, opt, tok, tasks, cfg, step, stats, state_path, ckpt)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    export(model, mcfg, tok_dir, args.out, dtype)
    log(f"exported to {args.out} ({sum(f.stat().st_size for f in args.out.iterdir()) / 1e6:.1f} MB)")
    if args.final_eval_n > 0:
        t0 = time.time()
        acc = evaluate(model, tok, tasks, args.final_eval_n, cfg.eval_shots)
        log(f"final eval ({args.final_eval_n}/setting, {time.time() - t0:.0f}s): {json.dumps(acc)}")
        with open(ckpt / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"final_eval": acc, "n": args.final_eval_n}) + "\n")


def train(model, opt, tok, tasks, cfg: TrainConfig, step: int, stats: dict, state_path: Path, ckpt: Path) -> None:
    stream = Stream(cfg, tok, tasks)
    stream.skip(step)
    metrics = open(ckpt / "metrics.jsonl", "a")
    model.train()
    last_save = time.time()
    win_loss, win_tok, win_steps, win_t0 = 0.0, 0, 0, time.time()
    while step < cfg.steps:
        items = stream.next()
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        noisy, clean, key_mask, weights = make_batch(items, tok, cfg, gen)
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        logits = model(noisy, model.new_store(key_mask))  # (B, T, V)
        sel = weights > 0
        ce = F.cross_entropy(logits[sel].float(), clean[sel], reduction="none")  # (N,)
        loss = (ce * weights[sel]).sum() / len(items)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        ntok = int(key_mask.sum())
        win_loss += loss.item()
        win_tok += ntok
        win_steps += 1
        stats["tokens"] += ntok
        if step % cfg.log_every == 0 or step == cfg.steps:
            dt = time.time() - win_t0
            stats["train_seconds"] += dt
            rec = {"step": step, "loss": win_loss / win_steps, "lr": lr, "gnorm": float(gnorm),
                   "tok_s": win_tok / dt, "tokens": stats["tokens"], "train_s": round(stats["train_seconds"])}
            log(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()))
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
            stats["last_loss"] = rec["loss"]
            win_loss, win_tok, win_steps, win_t0 = 0.0, 0, 0, time.time()
        if cfg.eval_every > 0 and cfg.eval_n > 0 and (step % cfg.eval_every == 0 or step == cfg.steps):
            t0 = time.time()
            acc = evaluate(model, tok, tasks, cfg.eval_n, cfg.eval_shots)
            log(f"eval step {step} ({cfg.eval_n}/setting, {time.time() - t0:.0f}s): {json.dumps(acc)}")
            metrics.write(json.dumps({"step": step, "eval": acc}) + "\n")
            metrics.flush()
            win_t0 = time.time()
        if time.time() - last_save > cfg.save_every_min * 60 or step == cfg.steps:
            save_state(state_path, model, opt, step, cfg, stats)
            last_save = time.time()
    metrics.close()


if __name__ == "__main__":
    sys.exit(main())
