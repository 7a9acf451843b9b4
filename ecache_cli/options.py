"""Typer option declarations shared by the subcommands (one place for names, help and panels)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

M, D, C, O = "Model", "Decoding", "Cache", "Output"

Model = Annotated[str, typer.Option("--model", "-m", help="Alias (tiny, llada-8b, llada-8b-base, llada-1.5, dream-7b, dream-7b-base), HF repo id in the local cache, or a checkpoint directory.", rich_help_panel=M)]
Device = Annotated[str, typer.Option(help="auto (CUDA when available), cpu, cuda, cuda:N.", rich_help_panel=M)]
Dtype = Annotated[str, typer.Option(help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16.", rich_help_panel=M)]
Threads = Annotated[Optional[int], typer.Option("--threads", envvar="ECACHE_THREADS", help="CPU threads for torch (≥ 1) \\[default: 1 for the embedded model, whose decoding one thread runs fastest (bench/threads.py); torch's default for others].", rich_help_panel=M)]

GenLength = Annotated[Optional[int], typer.Option("--gen-length", help="Generated canvas positions \\[default: 256].", rich_help_panel=D)]
BlockLength = Annotated[Optional[int], typer.Option("--block-length", help="Semi-autoregressive block size \\[default: 32].", rich_help_panel=D)]
Steps = Annotated[Optional[int], typer.Option("--steps", help="Total denoising steps; each block gets steps / blocks \\[default: gen-length, one token a step]. Under --threshold or --factor a block runs until it has no masks: with the llada schedule --steps is then only checked (a multiple of the blocks, as Fast-dLLM does) and does not set the step count; with the dream schedule it sets the per-step quota (block masks / steps, Fast-dLLM's Dream rule).", rich_help_panel=D)]
Temperature = Annotated[Optional[float], typer.Option(help="0 = greedy; > 0 = Gumbel-max sampling in float64 \\[default: 0].", rich_help_panel=D)]
TopK = Annotated[Optional[int], typer.Option("--top-k", help="Keep the k most likely tokens when sampling (temperature > 0) \\[default: off].", rich_help_panel=D)]
TopP = Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling mass (Dream's rule; temperature > 0) \\[default: off].", rich_help_panel=D)]
Remasking = Annotated[Optional[str], typer.Option(help="low_confidence, random, topk_margin, entropy, maskgit_plus or origin (Dream's algs: maskgit_plus, topk_margin, entropy; origin reveals each mask at random, dream schedule only) \\[default: low_confidence].", rich_help_panel=D)]
Threshold = Annotated[Optional[float], typer.Option(help="Fast-dLLM parallel decoding: commit every block token with confidence ≥ this (e.g. 0.9); a block then runs until it has no masks (Dream with --steps: at most block-length/steps-per-block per step plus deferred ones, Fast-dLLM's Dream rule) \\[default: off].", rich_help_panel=D)]
Factor = Annotated[Optional[float], typer.Option(help="Fast-dLLM factor-based parallel decoding (e.g. 1.0); a block then runs until it has no masks \\[default: off].", rich_help_panel=D)]
BanEos = Annotated[Optional[bool], typer.Option("--ban-eos/--allow-eos", help="Never commit EOS/EOT (LLaDA logits_eos_inf) \\[default: allow].", rich_help_panel=D)]
LowEos = Annotated[Optional[bool], typer.Option("--low-eos-confidence/--no-low-eos-confidence", help="Give EOS/EOT confidence 0 (LLaDA confidence_eos_eot_inf) \\[default: off].", rich_help_panel=D)]
EarlyExit = Annotated[Optional[bool], typer.Option("--early-exit/--no-early-exit", help="Stop a row once its answer has ended \\[default: on].", rich_help_panel=D)]
Schedule = Annotated[Optional[str], typer.Option("--schedule", help="Tokens committed per step: llada (even split; Fast-dLLM's uncapped threshold rule) or dream (Dream's timesteps; Fast-dLLM's Dream threshold quota) \\[default: the model family's].", rich_help_panel=D)]
AlgTemp = Annotated[Optional[float], typer.Option("--alg-temp", help="Dream's alg_temp: > 0 draws each step's positions from softmax(confidence / alg-temp) instead of taking the top-scoring ones (dream schedule, fixed steps only) \\[default: 0].", rich_help_panel=D)]
Compat = Annotated[Optional[str], typer.Option("--compat", help="fastdllm: Fast-dLLM's Dream block sampler (commits each block's first token unchecked at its first step; Dream only, not a default) \\[default: off].", rich_help_panel=D)]

Cache = Annotated[Optional[str], typer.Option("--cache", help="Cache policy: none, prefix, dual, entropy, dllm-cache, dkv, d2cache, elastic \\[default: entropy].", rich_help_panel=C)]
Tau = Annotated[Optional[float], typer.Option(help="EntropyCache threshold τ in nats: refresh when the signal exceeds it \\[default: profile, else 1.0].", rich_help_panel=C)]
RecentK = Annotated[Optional[int], typer.Option("--recent-k", help="EntropyCache: recompute the k most recently committed tokens \\[default: 64].", rich_help_panel=C)]
Signal = Annotated[Optional[str], typer.Option(help="EntropyCache signal: max-entropy, sum-entropy, max-confidence \\[default: max-entropy].", rich_help_panel=C)]
BlockRefresh = Annotated[Optional[bool], typer.Option("--block-refresh/--no-block-refresh", help="EntropyCache: also refresh at every block start \\[default: off].", rich_help_panel=C)]
RefreshEvery = Annotated[Optional[int], typer.Option("--refresh-every", help="A full refresh every N steps. prefix, dual: inside each block, besides its start (0 = block starts only, 1 = every step) \\[default: 0]; dkv: every N steps of a block (≥ 1) \\[default: 8]; d2cache, elastic: every N steps of the run (0 = never, the papers' rule) \\[default: 0]. Steps are those actually run, so under --threshold a block may end before its next refresh. Not used by none, entropy, dllm-cache.", rich_help_panel=C)]
Profile = Annotated[Optional[str], typer.Option("--profile", help="Settings from a profile: a YAML file, or NAME looked up in ./profiles, the user's config folder, the package (flags override) \\[default: none; the model's default.yaml if present].", rich_help_panel=C)]

Chat = Annotated[Optional[bool], typer.Option("--chat/--no-chat", help="Apply the chat template \\[default: when the checkpoint has one].", rich_help_panel=D)]
BatchSize = Annotated[int, typer.Option("--batch-size", "-b", help="Prompts decoded together (left padded).", rich_help_panel=D)]
Seed = Annotated[int, typer.Option(help="Random seed (sampling and remasking).", rich_help_panel=D)]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output on stderr \\[default: off].", rich_help_panel=O)]
InputFile = Annotated[Optional[Path], typer.Option("--input", "-i", help="JSONL file with a 'prompt' (or 'messages', or 'prompt_ids': token ids used as they are) field per line; - reads the records from stdin \\[default: none: prompt arguments or stdin].", rich_help_panel=O)]


def decode_flags(gen_length, block_length, steps, temperature, top_k, top_p, remasking, threshold, factor,
                 ban_eos, low_eos_confidence, early_exit, schedule=None, compat=None, alg_temp=None) -> dict:
    """Collect the decoding flags into a dict (None = not given)."""
    return dict(gen_length=gen_length, block_length=block_length, steps=steps, temperature=temperature, top_k=top_k,
                top_p=top_p, remasking=remasking, threshold=threshold, factor=factor, ban_eos=ban_eos,
                low_eos_confidence=low_eos_confidence, early_exit=early_exit, schedule=schedule, compat=compat,
                alg_temp=alg_temp)


def cache_flags(cache, tau, recent_k, signal, block_refresh, refresh_every) -> dict:
    """Collect the cache flags into a dict (None = not given)."""
    return dict(policy=cache, tau=tau, recent_k=recent_k, signal=signal, block_refresh=block_refresh,
                refresh_every=refresh_every)
