"""``ecache trace-drift``: per-step entropy signal beside the KV cosine drift it is meant to track."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import options as o


def trace_drift_cmd(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompts; none = --task, --input or stdin (one per line).")] = None,
    model: o.Model = "tiny", device: o.Device = "auto", dtype: o.Dtype = "auto", threads: o.Threads = None, compile_step: o.Compile = None, force: o.Force = False,
    quantize: o.Quantize = None, group_size: o.GroupSize = None,
    input_file: o.InputFile = None,
    task: Annotated[Optional[str], typer.Option(help="Prompts from a task's test split; also picks its profile.", rich_help_panel=o.O)] = None,
    data: Annotated[Optional[str], typer.Option(help="Data file or folder of a real benchmark task.", rich_help_panel=o.O)] = None,
    limit: Annotated[int, typer.Option(help="Number of --task examples.", rich_help_panel=o.O)] = 4,
    shots: Annotated[Optional[int], typer.Option(help="Solved examples before each question \\[default: the task's].", rich_help_panel=o.O)] = None,
    chat: o.Chat = None,
    gen_length: o.GenLength = None, block_length: o.BlockLength = None, steps: o.Steps = None,
    temperature: o.Temperature = None, top_k: o.TopK = None, top_p: o.TopP = None, remasking: o.Remasking = None,
    threshold: o.Threshold = None, factor: o.Factor = None, ban_eos: o.BanEos = None, low_eos_confidence: o.LowEos = None,
    early_exit: o.EarlyExit = None, schedule: o.Schedule = None, compat: o.Compat = None,
    alg_temp: o.AlgTemp = None,
    edit_threshold: o.EditThreshold = None,
    cache: o.Cache = None, tau: o.Tau = None, recent_k: o.RecentK = None, signal: o.Signal = None,
    block_refresh: o.BlockRefresh = None, refresh_every: o.RefreshEvery = None, profile: o.Profile = None,
    batch_size: o.BatchSize = 1,
    seed: o.Seed = 0,
    jsonl: Annotated[Optional[Path], typer.Option("--jsonl", help="One JSON record per step and prompt to FILE (- = stdout).", rich_help_panel=o.O)] = None,
    tensorboard: Annotated[Optional[Path], typer.Option("--tensorboard", help="TensorBoard scalars and histograms under DIR.", rich_help_panel=o.O)] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="A PNG of signal, drift and volatility.", rich_help_panel=o.O)] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", help="The summary as one JSON document to FILE (- = stdout).", rich_help_panel=o.O)] = None,
    rows: Annotated[int, typer.Option("--rows", help="About this many table rows per prompt (0 = every step).", rich_help_panel=o.O)] = 24,
    volatility_level: Annotated[float, typer.Option("--volatility-level", help="Settle level of a committed token's K change (1 − cos).", rich_help_panel=o.O)] = 1e-3,
    wide: o.Wide = False,
    quiet: o.Quiet = False,
):
    """Per step: the entropy signal beside the KV drift of the cache against a shadow full forward.

    Example: [cyan]ecache trace-drift "Sort: 9 3 7 1" --plot drift.png[/] (tables on stderr; same tokens as generate)
    """
    from ..console import announce, err, hold_warnings, info, read_alone
    from ..outputs import check_dir, check_distinct, check_file, write_json
    from ..runs import drift_report as rep
    from ..runs.confidence import warn_untrained
    from ..runs.settings import not_used_by, resolve_settings, warn_model_rules, warn_unused_cache_flags
    from ..runs.trace_drift import TraceOptions, check_flags, read_first, signal_kind, summary_document, trace
    from ..runtime import compile_line, load_for_command

    hold_warnings()  # after the "using model" line (console.announce)
    check_flags(prompts, input_file, task, data, shots, limit, batch_size, signal, plot, jsonl, json_out, volatility_level,
                rows)
    flags = o.cache_flags(cache, tau, recent_k, signal, block_refresh, refresh_every)
    from ..runs.models import check_quantize, check_start, prompt_lengths, task_prompt_lengths

    check_start(model, device, dtype, prompts, quantize=quantize)  # refused alone, before the first line and the settings
    settings = resolve_settings(
        model, o.decode_flags(gen_length, block_length, steps, temperature, top_k, top_p, remasking, threshold, factor,
                              ban_eos, low_eos_confidence, early_exit, schedule, compat, alg_temp, edit_threshold),
        flags, profile=profile, task=task, compile=compile_step, quantize=quantize, group_size=group_size,
        prompt_tokens=prompt_lengths(model, prompts, chat) if task is None else task_prompt_lengths(
            model, task, limit, shots, seed, chat, data))  # read_first's task prompts
    check_quantize(settings, device, dtype)  # a profile's format this machine cannot run, named with the file
    traced = {k: v for k, v in flags.items() if k != "signal"}  # --signal is also what the trace plots: used
    warn_unused_cache_flags([settings.cache], traced, not_used_by(settings))
    check_distinct([(jsonl, "--jsonl"), (plot, "--plot"), (json_out, "--json"), (tensorboard, "--tensorboard")],
                   [(input_file, "--input"), (data, "--data"), (profile, "--profile")])
    for path, flag in ((jsonl, "--jsonl"), (plot, "--plot"), (json_out, "--json")):  # before any decoding
        check_file(path, flag)
    check_dir(tensorboard, "--tensorboard")
    opts = TraceOptions(prompts=list(prompts or []), input_file=input_file, task=task, data=data, limit=limit, shots=shots,
                        chat=chat, batch_size=batch_size, seed=seed, signal=signal_kind(signal, settings),
                        volatility_level=volatility_level)
    opts.read = read_alone(read_first, opts)  # the input in full: its error alone, before the load
    announce(None if quiet else settings.describe(model))  # what this run uses, before the (maybe long) load
    lm, _ = load_for_command(model, device, dtype, threads, compile=settings.compile, force=force, quantize=settings.quantization,
                             chat=chat)  # one process: no ranks
    warn_untrained(lm, task)
    warn_model_rules(settings, lm.spec.sampler)
    sinks = rep.make_sinks(jsonl, tensorboard, lm, settings, seed)
    from ..interrupts import HeldInterrupts
    from ..terminal import Counter, ProgressLine

    hold, report = HeldInterrupts(), None
    try:
        with hold:  # an interrupt after the trace's loop waits until --json is written, then arrives here
            with ProgressLine(err, quiet) as line:
                count = Counter(line, "trace-drift", None, "prompts")  # the total: once the prompts are read
                count.update(0, force=True)
                report = trace(lm, settings, opts, sinks, hold=hold, progress=None if not line.active else
                               lambda done, total, now: count.update(done, now, total=total))
            if json_out is not None:  # the summary first: an interrupt while drawing the tables or the plot keeps it
                write_json(summary_document(lm, settings, opts, report), json_out)
        # -q leaves stderr to warnings and errors; the tables stay when they are the run's only result
        if not quiet or all(p is None for p in (jsonl, json_out, plot, tensorboard)):
            rep.render_steps(o.table_console(err, wide), report, rows, wide=wide)
            rep.render_summary(err, report)
        if plot is not None:
            rep.plot(report, plot, rep.figure_title(lm, settings), tau=rep.plot_tau(settings))
    except KeyboardInterrupt:  # after the trace's loop: --json is written, whole or "incomplete"
        if report is None or json_out in (None, "-"):
            raise
        from ..console import error
        from ..errors import interrupted_exit_code

        error(_interrupted_line(report, json_out) if report.incomplete else
              f"interrupted; --json {json_out} holds the whole trace's summary (tables and plot not drawn)")
        raise typer.Exit(code=interrupted_exit_code()) from None
    records = sum(getattr(s, "records", 0) for s in sinks)  # a --jsonl file is opened at its first record
    written = [f"{label} {p}" for label, p in (("JSONL", jsonl if records else None), ("TensorBoard", tensorboard),
                                                ("plot", plot), ("summary", json_out)) if p is not None and str(p) != "-"]
    if written:
        info("wrote " + ", ".join(written), style="dim")
    if (line := compile_line(lm.model)) and not quiet:  # --compile: graphs and compile seconds, apart
        err.print(line, markup=False, highlight=False)
    if report.incomplete:  # Ctrl-C / SIGTERM: what was measured is shown and written; exit as interrupted
        from ..console import error
        from ..errors import interrupted_exit_code

        error(_interrupted_line(report, json_out))
        raise typer.Exit(code=interrupted_exit_code())


def _interrupted_line(report, json_out: str | None) -> str:
    """The error line of a trace cut short: what the report covers and where its summary went."""
    wrote = f"; --json {json_out} holds them (\"incomplete\": true)" if json_out not in (None, "-") else ""
    return (f"interrupted; the report covers {len(report.results)} finished prompt(s) and "
            f"{len(report.records)} measured step(s){wrote}")
