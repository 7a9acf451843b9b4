"""Typer option declarations shared by the subcommands (one place for names, help and panels)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .config import GivenFloat, check_ranges, fitting_example, option_ranges, run_policies  # noqa: F401 (the flags' ranges: config.py)
from .contract.names import policy_names

M, D, C, O = "Model", "Decoding", "Cache", "Output"  # noqa: E741 (help panel names)

Model = Annotated[str, typer.Option("--model", "-m", help="Alias (tiny, llada-8b, ...), HF repo id or folder.", rich_help_panel=M)]
Device = Annotated[str, typer.Option(help="auto (CUDA when available), cpu, cuda, cuda:N.", rich_help_panel=M)]
Dtype = Annotated[str, typer.Option(help="auto (GPU bf16, CPU fp32), float32, bfloat16, float16", rich_help_panel=M)]
Threads = Annotated[Optional[int], typer.Option("--threads", envvar="ECACHE_THREADS", help="CPU threads (≤ the cores) \\[default: 1 for tiny]", rich_help_panel=M)]
Force = Annotated[bool, typer.Option("--force", help="Load even if the weights need more than the free memory.", rich_help_panel=M)]
Quantize = Annotated[Optional[str], typer.Option("--quantize", help="Weights: none, int8, int4, fp8 (torchao; README: Quantized weights) \\[default: profile, else none].", rich_help_panel=M)]
GroupSize = Annotated[Optional[int], typer.Option("--group-size", help="int4: input columns per scale, 32-256 \\[default: 128, lower where it does not divide].", rich_help_panel=M)]
Compile = Annotated[Optional[bool], typer.Option("--compile/--no-compile", help="Compiled forward (ecache help compile) \\[default: profile, else off].", rich_help_panel=M)]

GenLength = Annotated[Optional[int], typer.Option("--gen-length", help="Generated canvas positions \\[default: 256].", rich_help_panel=D)]
BlockLength = Annotated[Optional[int], typer.Option("--block-length", help="Semi-autoregressive block size \\[default: 32].", rich_help_panel=D)]
Steps = Annotated[Optional[int], typer.Option("--steps", help="Denoising steps in all (ecache help decoding) \\[default: gen-length].", rich_help_panel=D)]
Temperature = Annotated[Optional[float], typer.Option(help="0 = greedy; > 0 = Gumbel-max sampling \\[default: 0].", rich_help_panel=D)]
TopK = Annotated[Optional[int], typer.Option("--top-k", help="Sample from the k likeliest tokens \\[default: off].", rich_help_panel=D)]
TopP = Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling mass, in (0, 1] \\[default: off].", rich_help_panel=D)]
Remasking = Annotated[Optional[str], typer.Option(help="Which masks a step commits \\[default: low_confidence].", rich_help_panel=D)]
Threshold = Annotated[Optional[float], typer.Option(help="Fast-dLLM: commit tokens with confidence ≥ this \\[default: off].", rich_help_panel=D)]
Factor = Annotated[Optional[float], typer.Option(help="Fast-dLLM factor-based parallel decoding \\[default: off].", rich_help_panel=D)]
BanEos = Annotated[Optional[bool], typer.Option("--ban-eos/--allow-eos", help="Never commit EOS/EOT \\[default: allow].", rich_help_panel=D)]
LowEos = Annotated[Optional[bool], typer.Option("--low-eos-confidence/--no-low-eos-confidence", help="Give EOS/EOT confidence 0 \\[default: off].", rich_help_panel=D)]
EarlyExit = Annotated[Optional[bool], typer.Option("--early-exit/--no-early-exit", help="Stop a row once its answer ended \\[default: on].", rich_help_panel=D)]
Schedule = Annotated[Optional[str], typer.Option("--schedule", help="Commits per step: llada, dream or block \\[default: the model's].", rich_help_panel=D)]
AlgTemp = Annotated[Optional[float], typer.Option("--alg-temp", help="Dream's alg_temp (dream schedule) \\[default: 0].", rich_help_panel=D)]
EditThreshold = Annotated[Optional[float], typer.Option("--edit-threshold", help="LLaDA2.1 token editing threshold \\[default: off].", rich_help_panel=D)]
Compat = Annotated[Optional[str], typer.Option("--compat", help="fastdllm: Fast-dLLM's Dream block sampler \\[default: off].", rich_help_panel=D)]

Cache = Annotated[Optional[str], typer.Option("--cache", help=", ".join(policy_names()) + " \\[default: profile, else entropy].", rich_help_panel=C)]
Tau = Annotated[Optional[float], typer.Option(help="entropy: refresh when the signal exceeds τ \\[default: profile, else 1].", rich_help_panel=C)]
RecentK = Annotated[Optional[int], typer.Option("--recent-k", help="entropy: recompute the k latest commits \\[default: profile, else 64].", rich_help_panel=C)]
Signal = Annotated[Optional[str], typer.Option(help="entropy signal (help cache) \\[default: profile, else max-entropy].", rich_help_panel=C)]
BlockRefresh = Annotated[Optional[bool], typer.Option("--block-refresh/--no-block-refresh", help="entropy: also refresh at block starts \\[default: profile, else off].", rich_help_panel=C)]
RefreshEvery = Annotated[Optional[int], typer.Option("--refresh-every", help="A full refresh every N steps (ecache help cache) \\[default: 0; dkv 8].", rich_help_panel=C)]
Profile = Annotated[Optional[str], typer.Option("--profile", help="Settings from a YAML file or NAME (ecache help profiles).", rich_help_panel=C)]

Chat = Annotated[Optional[bool], typer.Option("--chat/--no-chat", help="Apply the chat template \\[default: if the model has one].", rich_help_panel=D)]
BatchSize = Annotated[int, typer.Option("--batch-size", "-b", help="Prompts decoded together (left padded).", rich_help_panel=D)]
Seed = Annotated[int, typer.Option(help="Random seed (sampling, remasking, task samples).", rich_help_panel=D)]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Stderr: only warnings, notes, errors.", rich_help_panel=O)]
Watch = Annotated[bool, typer.Option("--watch", help="Live view: the canvas, each refresh, the signal vs τ (a terminal).", rich_help_panel=O)]
WatchDelay = Annotated[float, typer.Option("--watch-delay", help="Seconds to wait after each --watch step (demos).", rich_help_panel=O)]
#: ``readable=False``: the parser does not check the file (its error would be a usage error, exit 2);
#: ``runs.inputs.check_input_file`` does, with the runtime exit code of an unreadable file (1).
InputFile = Annotated[Optional[Path], typer.Option("--input", "-i", help="JSONL records, - = stdin (ecache help input).", readable=False, rich_help_panel=O)]


def decode_flags(gen_length, block_length, steps, temperature, top_k, top_p, remasking, threshold, factor,
                 ban_eos, low_eos_confidence, early_exit, schedule=None, compat=None, alg_temp=None,
                 edit_threshold=None) -> dict:
    """Collect the decoding flags into a dict (None = not given)."""
    return dict(gen_length=gen_length, block_length=block_length, steps=steps, temperature=temperature, top_k=top_k,
                top_p=top_p, remasking=remasking, threshold=threshold, factor=factor, ban_eos=ban_eos,
                low_eos_confidence=low_eos_confidence, early_exit=early_exit, schedule=schedule, compat=compat,
                alg_temp=alg_temp, edit_threshold=edit_threshold)


def cache_flags(cache, tau, recent_k, signal, block_refresh, refresh_every) -> dict:
    """Collect the cache flags into a dict (None = not given)."""
    return dict(policy=cache, tau=tau, recent_k=recent_k, signal=signal, block_refresh=block_refresh,
                refresh_every=refresh_every)


Wide = Annotated[bool, typer.Option("--wide", help="Show every table column (stacked tables where they do not fit).", rich_help_panel=O)]


def table_console(console, wide: bool):
    """The console a table is printed on: ``console`` itself (the terminal's width, ``$COLUMNS``, or 80
    for a pipe), with ``wide`` as without it: a table with more columns than fit is printed as stacked
    tables of the same rows (``terminal.Fitted``), so every table fits the width and no cell is cut."""
    return console


R = "Scale-out (Ray)"  # the `ray` extra: serve/ray_serve.py
CoresPerReplica = Annotated[int, typer.Option("--cores-per-replica", help="With --ray: CPU cores each replica reserves (and its torch threads unless --threads); a CUDA --device reserves one GPU per replica instead.", rich_help_panel=R)]


#: A flag one command takes under another's name (``profile --cache`` means ``--policies``), each with the
#: flags meant, in order; :func:`suggested_flags` names the first the command takes.
ALIASES = {"--cache": ("--policies", "--taus"), "--policy": ("--cache", "--policies"), "--policies": ("--cache",),
           "--tau": ("--taus",), "--taus": ("--tau",), "--input": ("--data",), "--data": ("--input",),
           "--output": ("--jsonl", "--json", "--out"), "--out": ("--output", "--json"), "--json": ("--jsonl",),
           "--jsonl": ("--json", "--output")}


def suggested_flags(given: str, flags: list[str]) -> list[str]:
    """The flags of a command (``flags``) to suggest for ``given``, a flag it does not take: the one
    :data:`ALIASES` names, else the close spellings (difflib ratio ≥ 0.75, so ``--tempreature`` finds
    ``--temperature`` but ``--task`` finds no ``--tau``); [] for none."""
    from difflib import get_close_matches

    alias = next((f for f in ALIASES.get(given, ()) if f in flags), None)
    return [alias] if alias else get_close_matches(given, flags, cutoff=0.75)
