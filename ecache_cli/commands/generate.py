"""``ecache generate``: cached generation (the main job)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import options as o
from ..errors import interrupted_exit_code


def generate(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompts; none = read stdin (one per line) or --input.")] = None,
    model: o.Model = "tiny", device: o.Device = "auto", dtype: o.Dtype = "auto", threads: o.Threads = None, compile_step: o.Compile = None, force: o.Force = False,
    quantize: o.Quantize = None, group_size: o.GroupSize = None,
    input_file: o.InputFile = None,
    chat: o.Chat = None,
    gen_length: o.GenLength = None, block_length: o.BlockLength = None, steps: o.Steps = None,
    temperature: o.Temperature = None, top_k: o.TopK = None, top_p: o.TopP = None, remasking: o.Remasking = None,
    threshold: o.Threshold = None, factor: o.Factor = None, ban_eos: o.BanEos = None, low_eos_confidence: o.LowEos = None,
    early_exit: o.EarlyExit = None, schedule: o.Schedule = None, compat: o.Compat = None,
    alg_temp: o.AlgTemp = None,
    edit_threshold: o.EditThreshold = None,
    cache: o.Cache = None, tau: o.Tau = None, recent_k: o.RecentK = None, signal: o.Signal = None,
    block_refresh: o.BlockRefresh = None, refresh_every: o.RefreshEvery = None, profile: o.Profile = None,
    task: Annotated[Optional[str], typer.Option(help="Use the calibrated profile <model>/<task>.yaml (ecache help profiles).", rich_help_panel=o.C)] = None,
    jsonl: Annotated[bool, typer.Option("--jsonl", help="One JSON record per prompt (text, token ids, stats), not plain text.", rich_help_panel=o.O)] = False,
    batch_size: o.BatchSize = 1,
    seed: o.Seed = 0,
    stream: Annotated[bool, typer.Option("--stream", help="Show the canvas filling in live on stderr.", rich_help_panel=o.O)] = False,
    quiet: o.Quiet = False,
    watch: o.Watch = False,
    watch_delay: o.WatchDelay = 0.0,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the JSONL records (as --jsonl prints them) to FILE, each flushed as it is done, in input order; stdout then gets nothing. An existing FILE needs --resume \\[default: none: stdout].", rich_help_panel=o.O)] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue --output FILE: decode only the records it lacks (same input, model and settings; a torn last line is dropped) \\[default: off].", rich_help_panel=o.O)] = False,
    skip_invalid: Annotated[bool, typer.Option("--skip-invalid", help="--input records that cannot be decoded (bad JSON, no prompt, too long for the canvas) get an error record and the others are decoded \\[default: off: one error names every bad line, nothing is decoded].", rich_help_panel=o.O)] = False,
    print0: Annotated[bool, typer.Option("--print0", help="Plain text: end each answer with a NUL byte, not a newline, so answers with newlines split exactly (xargs -0) \\[default: off].", rich_help_panel=o.O)] = False,
    ray: Annotated[Optional[int], typer.Option("--ray", help="Decode --input on N Ray actors of --threads cores each \\[default: off].", rich_help_panel=o.M)] = None,
):
    """Generate text with a cached denoising loop: results on stdout, progress on stderr.

    Examples: [cyan]ecache generate "Sort: 9 3 7 1"[/] · [cyan]echo "Reverse: 1 2 3" | ecache generate --jsonl[/]
    """
    from ..console import announce, err, hold_warnings, info, read_alone, warn
    from ..outputs import check_file
    from ..runs.confidence import warn_untrained
    from ..runs.generate import GenerateOptions, check_options, check_task, read_first, require_task_profile, run
    from ..runs.inputs import check_input_file
    from ..runs.settings import not_used_by, resolve_settings, warn_model_rules, warn_unused_cache_flags
    from ..runs.watch import watch_available
    from ..runtime import compile_line, load_for_command

    hold_warnings()  # after the "using model" line (console.announce)
    opts = GenerateOptions(prompts=list(prompts or []), input_file=input_file, chat=chat, jsonl=jsonl,
                           batch_size=batch_size, seed=seed, stream=stream, quiet=quiet, output=output,
                           resume=resume, skip_invalid=skip_invalid, print0=print0,
                           watch=watch, watch_delay=watch_delay)
    ranks = check_options(opts)
    if ray is not None:
        from ..runs.ray_batch import check_ray_options

        check_ray_options(opts, ray, ranks)
    check_task(task, profile)
    flags = o.cache_flags(cache, tau, recent_k, signal, block_refresh, refresh_every)
    from ..runs.models import check_quantize, check_start, prompt_lengths

    check_start(model, device, dtype, prompts, quantize=quantize)  # refused alone, before the first line and the settings
    check_input_file(input_file)  # a folder or a missing file: exit 1, as for an unreadable file (errors.py)
    settings = resolve_settings(
        model, o.decode_flags(gen_length, block_length, steps, temperature, top_k, top_p, remasking, threshold, factor,
                              ban_eos, low_eos_confidence, early_exit, schedule, compat, alg_temp, edit_threshold),
        flags, profile=profile, task=task, compile=compile_step, quantize=quantize, group_size=group_size,
        prompt_tokens=prompt_lengths(model, prompts, chat))
    check_quantize(settings, device, dtype)  # a profile's format this machine cannot run, named with the file
    require_task_profile(settings, model, task)
    warn_unused_cache_flags([settings.cache], flags, not_used_by(settings))
    if quiet and stream:  # --quiet wins: no output on stderr at all
        warn("--stream is ignored under --quiet (no output on stderr); drop --quiet to see the canvas")
    if watch and not watch_available(err):
        warn("--watch needs a terminal (stderr is not one); decoding without the live view")
        opts.watch = False
    if output is None and sys.stdout is None:  # `>&-`: nowhere to put the answers; say so before decoding
        from ..errors import DataError

        raise DataError("cannot write the output: stdout is closed; redirect it (> answers.txt) or use --output FILE")
    if output is not None:
        from ..runs.gen_output import check_new_output

        check_file(output, "--output")  # before the model loads
        check_new_output(output, resume)  # an existing file without --resume: before the first line
    opts.items = read_alone(read_first, opts)  # the input in full: its error alone, before the load
    announce(settings.describe(model) if not quiet and ranks.is_main else None)  # before the (maybe long) load
    lm, dist = load_for_command(model, device, dtype, threads, ranks=True, compile=settings.compile, force=force, quantize=settings.quantization,
                                chat=chat)  # torchrun: this rank's share
    if task is not None and dist.is_main:
        warn_untrained(lm, task)
    if dist.is_main:
        warn_model_rules(settings, lm.spec.sampler)
    try:
        if ray is None:
            run(lm, settings, opts, sys.stdout, err, dist=dist)
        else:
            from functools import partial

            from ..runs import ray_batch

            load = partial(load_for_command, model, ray_batch.replica_device(device), dtype, threads,
                           compile=settings.compile, force=force, quantize=settings.quantization)
            ray_batch.run(lm, settings, opts, sys.stdout, err, load, ray, ray_batch.resources(device, threads or 1))
        if (line := compile_line(lm.model)) and not quiet and dist.is_main:
            err.print(line, markup=False, highlight=False)
        if output is not None and dist.is_main:  # the status line every command ends with when it wrote a file
            with open(output, "rb") as fh:
                info(f"wrote {output} ({sum(1 for _ in fh)} record(s))", style="dim")
    except KeyboardInterrupt:
        if output is None:
            raise
        from ..console import error

        if Path(output).is_file() and Path(output).stat().st_size > 0:
            error(f"interrupted; --output {output} keeps every record written so far; rerun the same command with "
                  "--resume to decode only the rest")
        else:  # stopped before the first record: there is nothing to resume
            error(f"interrupted before the first record; --output {output} holds none; rerun the same command")
        raise typer.Exit(code=interrupted_exit_code()) from None
