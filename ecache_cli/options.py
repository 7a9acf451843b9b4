"""Typer option declarations shared by the subcommands (one place for names, help and panels)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

M, D, C, O = "Model", "Decoding", "Cache", "Output"

Model = Annotated[str, typer.Option("--model", "-m", help="Alias (tiny, llada-8b, llada-8b-base, llada-1.5, dream-7b, dream-7b-base), HF repo id in the local cache, or a checkpoint directory.", rich_help_panel=M)]
Device = Annotated[str, typer.Option(help="auto (CUDA when available), cpu, cuda, cuda:N.", rich_help_panel=M)]
Dtype = Annotated[str, typer.Option(help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16.", rich_help_panel=M)]

GenLength = Annotated[Optional[int], typer.Option("--gen-length", help="Generated canvas positions \\[default: 256].", rich_help_panel=D)]
BlockLength = Annotated[Optional[int], typer.Option("--block-length", help="Semi-autoregressive block size \\[default: 32].", rich_help_panel=D)]
Steps = Annotated[Optional[int], typer.Option("--steps", help="Total denoising steps over all blocks \\[default: gen-length].", rich_help_panel=D)]
Temperature = Annotated[Optional[float], typer.Option(help="0 = greedy; > 0 = Gumbel-max sampling in float64 \\[default: 0].", rich_help_panel=D)]
TopK = Annotated[Optional[int], typer.Option("--top-k", help="Keep the k most likely tokens when sampling.", rich_help_panel=D)]
TopP = Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling mass (Dream's rule).", rich_help_panel=D)]
Remasking = Annotated[Optional[str], typer.Option(help="low_confidence, random, topk_margin or entropy \\[default: low_confidence].", rich_help_panel=D)]
Threshold = Annotated[Optional[float], typer.Option(help="Fast-dLLM parallel decoding: commit every block token with confidence ≥ this (e.g. 0.9).", rich_help_panel=D)]
Factor = Annotated[Optional[float], typer.Option(help="Fast-dLLM factor-based parallel decoding (e.g. 1.0).", rich_help_panel=D)]
BanEos = Annotated[Optional[bool], typer.Option("--ban-eos/--allow-eos", help="Never commit EOS/EOT (LLaDA logits_eos_inf).", rich_help_panel=D)]
LowEos = Annotated[Optional[bool], typer.Option("--low-eos-confidence/--no-low-eos-confidence", help="Give EOS/EOT confidence 0 (LLaDA confidence_eos_eot_inf).", rich_help_panel=D)]
EarlyExit = Annotated[Optional[bool], typer.Option("--early-exit/--no-early-exit", help="Stop a row once its answer has ended \\[default: on].", rich_help_panel=D)]

Cache = Annotated[Optional[str], typer.Option("--cache", help="Cache policy: none, prefix, dual, entropy, dllm-cache, dkv, d2cache, elastic \\[default: entropy].", rich_help_panel=C)]
Tau = Annotated[Optional[float], typer.Option(help="EntropyCache threshold τ in nats: refresh when the signal exceeds it \\[default: profile, else 1.0].", rich_help_panel=C)]
RecentK = Annotated[Optional[int], typer.Option("--recent-k", help="EntropyCache: recompute the k most recently committed tokens \\[default: 64].", rich_help_panel=C)]
Signal = Annotated[Optional[str], typer.Option(help="EntropyCache signal: max-entropy, sum-entropy, max-confidence.", rich_help_panel=C)]
BlockRefresh = Annotated[Optional[bool], typer.Option("--block-refresh/--no-block-refresh", help="EntropyCache: also refresh at every block start.", rich_help_panel=C)]
RefreshEvery = Annotated[Optional[int], typer.Option("--refresh-every", help="prefix/dual: also refresh every N steps inside a block (1 = always).", rich_help_panel=C)]
Profile = Annotated[Optional[str], typer.Option("--profile", help="Settings from a profile: NAME in profiles/ or a YAML file (flags override).", rich_help_panel=C)]

Chat = Annotated[Optional[bool], typer.Option("--chat/--no-chat", help="Apply the chat template \\[default: when the checkpoint has one].", rich_help_panel=D)]
BatchSize = Annotated[int, typer.Option("--batch-size", "-b", help="Prompts decoded together (left padded).", rich_help_panel=D)]
Seed = Annotated[int, typer.Option(help="Random seed (sampling and remasking).", rich_help_panel=D)]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output on stderr.", rich_help_panel=O)]
InputFile = Annotated[Optional[Path], typer.Option("--input", "-i", help="JSONL file with a 'prompt' (or 'messages') field per line.", rich_help_panel=O)]


def decode_flags(gen_length, block_length, steps, temperature, top_k, top_p, remasking, threshold, factor,
                 ban_eos, low_eos_confidence, early_exit) -> dict:
    """Collect the decoding flags into a dict (None = not given)."""
    return dict(gen_length=gen_length, block_length=block_length, steps=steps, temperature=temperature, top_k=top_k,
                top_p=top_p, remasking=remasking, threshold=threshold, factor=factor, ban_eos=ban_eos,
                low_eos_confidence=low_eos_confidence, early_exit=early_exit)


def cache_flags(cache, tau, recent_k, signal, block_refresh, refresh_every) -> dict:
    """Collect the cache flags into a dict (None = not given)."""
    return dict(policy=cache, tau=tau, recent_k=recent_k, signal=signal, block_refresh=block_refresh,
                refresh_every=refresh_every)
