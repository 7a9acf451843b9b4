"""Model, learning-rate schedule, loss, training loop and the one-file training state.

- ``model_config`` / ``build_model``: an official-format LLaDA config.json and a freshly initialised
  ``ecache_cli.models.families.llada.LLaDA`` for a ``TrainConfig``;
- ``lr_at``: linear warmup, a constant LR, and an optional linear decay phase (warmup-stable-decay,
  Hu et al. 2024, "MiniCPM", sec. 4);
- ``batch_loss``: LLaDA's SFT loss of one ``make_batch`` batch (Nie et al. 2025, eq. 5);
- ``save_state`` / ``load_state``: everything a run needs to continue bit for bit, in one file;
- ``run_training``: start a new run or resume a state, train, save, export (``scripts/train_tiny.py``'s body);
- ``train``: the loop itself, with the curriculum's held-out evaluations.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from .config import TrainConfig, config_from_dict, log
from .data import Stream, Tok, arith_drill, load_tasks, make_batch
from .evaluate import (
    EVAL_SEED,
    FACT_DRILLS,
    adapt_weights,
    domain_costs,
    drill_fact_accuracy,
    evaluate,
    rates,
)
from .export import export, file_sha256, tokenizer_sha256

STATE_FORMAT = "ecache-tiny-train-state/1"
SHAPE = ("d_model", "n_layers", "n_heads", "mlp_hidden", "rope_theta")  # cannot change on resume


# --- model -----------------------------------------------------------------------------------------


def model_config(cfg: TrainConfig, tok: Tok) -> dict:
    """The run's config.json: ``ecache_cli.models.synthetic.tiny_config`` for LLaDA plus the remaining
    fields of GSAI-ML/LLaDA-8B-Instruct's config.json; embedding rows = the tokenizer's size rounded up
    to a multiple of 64."""
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
    """A float32 ``LLaDA`` for config ``mcfg``, initialised from ``seed``: norm weights 1, matrices
    N(0, 0.02), the residual output projections N(0, 0.02 / sqrt(2 * n_layers)) (GPT-2's init, Radford
    et al. 2019, sec. 2.3)."""
    from ecache_cli.models.families.llada import LLaDA
    from ecache_cli.models.registry import spec_from_config

    torch.manual_seed(seed)
    model = LLaDA(spec_from_config(mcfg))
    for name, p in model.named_parameters():
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
    schedule began: a new run, a warm start from exported weights, or ``--cooldown 0`` after a decay),
    then ``cfg.lr``; with ``cfg.cooldown`` > 0, times a linear decay from 1 to ``min_lr_frac`` over
    ``cfg.cooldown`` steps from ``cfg.cooldown_start`` (warmup-stable-decay, Hu et al. 2024, MiniCPM
    sec. 4), then ``lr * min_lr_frac``."""
    if step - start < cfg.warmup:
        return cfg.lr * (step - start + 1) / cfg.warmup
    lr = cfg.lr
    if cfg.cooldown > 0 and step >= cfg.cooldown_start:
        frac = min(1.0, (step - cfg.cooldown_start) / cfg.cooldown)
        lr *= 1.0 - frac * (1.0 - cfg.min_lr_frac)
    return lr


def batch_loss(model, noisy, clean, key_mask, weights, canvas: int) -> torch.Tensor:
    """The batch's LLaDA SFT loss, a float32 scalar: sum(weights * CE over masked tokens) / B, with
    ``make_batch``'s (B, T) tensors.

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


# --- training state (one file) ---------------------------------------------------------------------


def save_state(path: Path, run: dict) -> None:
    """Write the whole training state to one file, atomically (a temporary file, then ``os.replace``).

    ``run`` holds: model, ema (state dicts, float32), opt (AdamW state dict), step, schedule_start, cfg,
    stats (train_seconds, tokens, cpu_seconds), stream (``Stream.state``), history (evals and sparse
    training logs), tokenizer_sha256, init_from; the torch and Python RNG states are added here. With
    the default model shape the file is about 20 MB.
    """
    state = {"format": STATE_FORMAT, **run, "torch_rng": torch.get_rng_state(), "py_rng": random.getstate()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_state(path: Path) -> dict:
    """Read a state written by ``save_state``.

    Raises:
        SystemExit: the file cannot be read or is not a training state (one line naming the file).
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - torch.load raises many kinds (OSError, UnpicklingError, RuntimeError, ...)
        raise SystemExit(f"{path}: cannot read a training state ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise SystemExit(f"{path}: not an {STATE_FORMAT} file (format {found!r})")
    return state


# --- a run: new or resumed, trained, saved, exported ---------------------------------------------


def run_training(args, cfg: TrainConfig, given: set[str]) -> None:
    """``scripts/train_tiny.py``'s body. ``args``: its parsed options (state, fresh, init_from, minutes,
    max_new_steps, export, export_only, out, tokenizer, device, data_workers, log, dtype, final_eval_n);
    ``cfg``: the settings from the command line; ``given``: the ``TrainConfig`` fields given there.

    When ``args.state`` exists (and not ``--fresh``) the run resumes it: its saved settings, except the
    ``given`` ones, which apply from the resumed step on (the model shape cannot change). Otherwise a
    new run starts (from ``--init-from``'s weights when given) and writes ``args.state``.

    Raises:
        SystemExit: one line for a state that cannot be resumed (unreadable, another tokenizer, a shape
            change, a setting this version no longer has) or ``--export-only`` without a state.
    """
    torch.set_num_threads(cfg.threads)
    device = torch.device(args.device)
    tok_dir = args.tokenizer
    tok = Tok(tok_dir)
    state = None
    if args.state.exists() and not args.fresh:
        state = load_state(args.state)
        if state["tokenizer_sha256"] != tokenizer_sha256(tok_dir):
            raise SystemExit(f"{tok_dir}: tokenizer differs from the one {args.state} was trained with")
        override = {k: getattr(cfg, k) for k in given}
        for k in SHAPE:
            if k in override and override[k] != state["cfg"][k]:
                raise SystemExit(f"--{k.replace('_', '-')} cannot change on resume (state has {state['cfg'][k]})")
        try:
            saved = config_from_dict(state["cfg"], note=log)
        except ValueError as e:
            raise SystemExit(f"{args.state}: {e}") from None
        cfg = replace(saved, **override)
        torch.set_num_threads(cfg.threads)
        log(f"resuming {args.state} at step {state['step']}"
            + (f"; overrides from this step on: {json.dumps(override)}" if override else ""))
    elif args.export_only:
        raise SystemExit(f"{args.state}: no training state to export (give --state FILE)")
    else:
        log(f"new run; the state goes to {args.state}")
    if cfg.adapt_by not in ("examples", "tokens"):
        raise SystemExit(f"--adapt-by {cfg.adapt_by!r}: use examples or tokens")
    if cfg.loss_norm not in ("masked", "t"):
        raise SystemExit(f"--loss-norm {cfg.loss_norm!r}: use masked or t")
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
    if "cooldown" in given and "cooldown_start" not in given:
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


def train(model, ema_model, opt, tok, tasks, cfg: TrainConfig, run: dict, args) -> None:
    """Train until ``cfg.steps``, ``args.minutes`` or ``args.max_new_steps``; save ``run`` to
    ``args.state`` every ``cfg.save_every_min`` minutes and at the end. Every ``cfg.log_every`` steps
    the loss, LR, gradient norm, tokens/s and CPU-hours go to stdout and ``args.log`` (JSONL); every
    ``cfg.adapt_every_min`` minutes (0: never) the EMA model is evaluated on held-out problems and the
    domain weights of the next pools become ``adapt_weights`` of its errors."""
    device = next(model.parameters()).device
    stream = Stream(cfg, tok, tasks)
    stream.start_workers(args.data_workers, args.tokenizer)
    if run["stream"] is not None:
        stream.restore(run["stream"])
    args.log.parent.mkdir(parents=True, exist_ok=True)
    logf = open(args.log, "a")  # noqa: SIM115 - closed when the loop ends
    stats, history = run["stats"], run["history"]

    def record(rec: dict) -> None:
        logf.write(json.dumps(rec) + "\n")
        logf.flush()

    costs = domain_costs(cfg, tok, tasks) if cfg.adapt_by == "tokens" else None
    if costs is not None:
        log(f"mean tokens per example ({', '.join(cfg.domains)}): {costs}")
    last = next((h for h in reversed(history) if "eval" in h), None)
    if cfg.adapt_every_min > 0 and last is not None and last.get("adapt_by", "examples") != cfg.adapt_by:
        stream.weights = adapt_weights(last["eval"], cfg, costs)  # a resumed run switched --adapt-by: apply it now
        log(f"--adapt-by {cfg.adapt_by}: weights {stream.weights} from the eval at step {last['step']}")

    def do_eval() -> None:
        t0 = time.time()
        judged = ema_model if ema_model is not None else model  # the weights an export would ship
        acc = evaluate(judged, tok, tasks, cfg.eval_n, cfg.eval_shots, seed=EVAL_SEED)
        drng = random.Random(f"facts:{EVAL_SEED}")  # held-out drills: computation alone (drill_fact_accuracy)
        facts = drill_fact_accuracy(judged, tok, [arith_drill(drng) for _ in range(FACT_DRILLS)])
        rec = {"step": run["step"], "eval": acc, "n": cfg.eval_n, "tokens": stats["tokens"],
               "cpu_h": round(stats["cpu_seconds"] / 3600, 3), "eval_s": round(time.time() - t0),
               "facts": rates(facts)}
        if "arith" in tasks:  # the benchmark's own computations, each from a correct prefix
            probs = [(ex.question, ex.answer) for ex in tasks["arith"].examples("test", FACT_DRILLS, EVAL_SEED)]
            rec["facts_ltr"] = rates(drill_fact_accuracy(judged, tok, probs, mode="ltr"))
        if cfg.adapt_every_min > 0:
            stream.weights = adapt_weights(acc, cfg, costs)
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
