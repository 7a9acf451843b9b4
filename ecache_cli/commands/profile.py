"""``ecache profile``: cache policies side by side on the same prompts (speed, work, fidelity, traces)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import options as o
from ..errors import interrupted_exit_code

T = "Task"


def profile_cmd(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompts; none = --task, --input or stdin (one per line).")] = None,
    model: o.Model = "tiny", device: o.Device = "auto", dtype: o.Dtype = "auto", threads: o.Threads = None, compile_step: o.Compile = None, force: o.Force = False,
    quantize: o.Quantize = None, group_size: o.GroupSize = None,
    compare_quantize: Annotated[bool, typer.Option("--compare-quantize", help="Also run every policy on the unquantized weights and compare (needs --quantize).", rich_help_panel=o.M)] = False,
    input_file: o.InputFile = None,
    task: Annotated[Optional[str], typer.Option(help="Prompts from a task's test split, scored: arith, code, list, gsm8k, ...", rich_help_panel=T)] = None,
    data: Annotated[Optional[str], typer.Option(help="Data file or folder of a real benchmark (gsm8k, math500, humaneval, mbpp).", rich_help_panel=T)] = None,
    shots: Annotated[Optional[int], typer.Option(help="Solved examples before each question \\[default: the task's].", rich_help_panel=T)] = None,
    limit: Annotated[Optional[int], typer.Option(help="Task examples, or at most this many prompts \\[default: 8 with --task].", rich_help_panel=T)] = None,
    allow_code_execution: Annotated[bool, typer.Option("--allow-code-execution", help="Score code tasks by running model-written code (sandbox).", rich_help_panel=T)] = False,
    sandbox: Annotated[Optional[str], typer.Option("--sandbox", help="Isolation of model-written code: strict, auto, guard \\[default: auto].", rich_help_panel=T)] = None,
    chat: o.Chat = None,
    gen_length: o.GenLength = None, block_length: o.BlockLength = None, steps: o.Steps = None,
    temperature: o.Temperature = None, top_k: o.TopK = None, top_p: o.TopP = None, remasking: o.Remasking = None,
    threshold: o.Threshold = None, factor: o.Factor = None, ban_eos: o.BanEos = None, low_eos_confidence: o.LowEos = None,
    early_exit: o.EarlyExit = None, schedule: o.Schedule = None, compat: o.Compat = None,
    alg_temp: o.AlgTemp = None,
    edit_threshold: o.EditThreshold = None,
    policies: Annotated[Optional[str], typer.Option("--policies", help="Policies to compare, e.g. none,dual,entropy:tau=2.5 \\[default: all].", rich_help_panel=o.C)] = None,
    tau: o.Tau = None, recent_k: o.RecentK = None, signal: o.Signal = None,
    block_refresh: o.BlockRefresh = None, refresh_every: o.RefreshEvery = None, profile: o.Profile = None,
    warmup: Annotated[int, typer.Option(help="Untimed warm-up runs per policy.", rich_help_panel=o.O)] = 1,
    repeats: Annotated[int, typer.Option(help="Timed passes over all prompts.", rich_help_panel=o.O)] = 1,
    batch_size: o.BatchSize = 1,
    seed: o.Seed = 0,
    trace_dir: Annotated[Optional[Path], typer.Option("--trace-dir", help="Write torch.profiler traces of one request per policy here.", rich_help_panel=o.O)] = None,
    trace_steps: Annotated[Optional[int], typer.Option("--trace-steps", help="Denoising steps per trace (~0.4 MB a step; with --trace-dir) \\[default: 32].", rich_help_panel=o.O)] = None,
    wide: o.Wide = False,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Every number and a manifest as JSON to FILE (- = stdout).", rich_help_panel=o.O)] = None,
    quiet: o.Quiet = False,
):
    """Compare cache policies on the same prompts: tokens/s, speedup and work vs [bold]none[/], fidelity, score.

    Example: [cyan]ecache profile --task arith --limit 8 --policies none,dual,entropy[/]
    """
    from ..console import announce, err, hold_warnings, info, note, out, read_alone, warn
    from ..outputs import check_dir, check_distinct, check_file, write_json
    from ..runs.inputs import check_input_file
    from ..runs.profile import (
        ProfileOptions,
        check_sources,
        empty_answers,
        input_requests,
        parse_policy_spec,
        policy_names,
        profile_document,
        render_table,
        run_profile,
        task_setup,
        timing_warnings,
    )
    from ..runs.settings import model_family, resolve_settings, warn_unused_cache_flags
    from ..runtime import compile_line, load_for_command, resolve_threads
    from ..tasks import sandbox as code_sandbox

    hold_warnings()  # after the "using model" line (console.announce)
    names = policy_names(policies, model)
    opts = ProfileOptions(policies=names, warmup=warmup, repeats=repeats, batch_size=batch_size, seed=seed,
                          chat=chat, trace_dir=trace_dir, input_file=input_file, quiet=quiet, family=model_family(model))
    if trace_steps is not None:
        opts.trace_steps = trace_steps
    opts.validate()
    if trace_steps is not None and trace_dir is None:
        warn("--trace-steps is used only with --trace-dir; ignored")
    resolve_threads(threads, model)  # a bad --threads fails before anything loads (set before the model loads)
    check_sources(prompts, input_file, task, data, shots, limit)
    check_distinct([(json_out, "--json")], [(input_file, "--input"), (data, "--data"), (profile, "--profile")])
    check_input_file(input_file)
    if sandbox is not None:
        code_sandbox.check_mode(sandbox)  # a flag's bad value before the first line (the profile's: when read)
    flags = o.cache_flags(None, tau, recent_k, signal, block_refresh, refresh_every)
    from ..runs.models import check_quantize, check_start, prompt_lengths, task_prompt_lengths

    check_start(model, device, dtype, prompts, quantize=quantize)  # refused alone, before the first line and the settings
    settings = resolve_settings(
        model, o.decode_flags(gen_length, block_length, steps, temperature, top_k, top_p, remasking, threshold, factor,
                              ban_eos, low_eos_confidence, early_exit, schedule, compat, alg_temp, edit_threshold),
        flags, profile=profile, task=task, compile=compile_step, quantize=quantize, group_size=group_size,
        prompt_tokens=prompt_lengths(model, prompts, chat) if task is None else task_prompt_lengths(
            model, task, 8 if limit is None else limit, shots, seed, chat, data))  # task_setup's requests
    check_quantize(settings, device, dtype)  # a profile's format this machine cannot run, named with the file
    settings.policies = names  # the run's policies: its records report τ when one of them takes it
    warn_unused_cache_flags([parse_policy_spec(n)[0] for n in names], flags,
                            f"used by none of --policies {','.join(names)}")
    if compare_quantize and not settings.quantize:
        from ..errors import UsageError

        raise UsageError("--compare-quantize compares quantized weights with unquantized ones: add --quantize "
                         "int8 (or int4 with --dtype bfloat16)")
    # output paths once the settings stand (a run refused on them leaves no folder behind), before any decoding
    check_file(json_out, "--json")
    check_dir(trace_dir, "--trace-dir")
    task_obj, task_info = None, None  # the input read in full: its error alone, before the load
    if task is not None:
        task_obj, requests, task_info = read_alone(task_setup, task, data, shots, limit, seed, allow_code_execution)
        if not task_info["scored"]:
            note(f"task {task} is not scored without --allow-code-execution (its scorer runs the code)")
    else:
        requests = read_alone(input_requests, prompts, input_file, limit)
    if "none" not in names:
        note("--policies has no 'none': speedup, work share and fidelity vs none are not measured")
    from ..distributed import from_environment
    announce(settings.describe(model, policies=names) if not quiet and from_environment().is_main else None)
    code_sandbox.configure(sandbox, settings.sandbox,  # its warning after the line above, before the load
                           bool(task_info and task_info["scored"] and task_obj.needs_code_execution))
    lm, dist = load_for_command(model, device, dtype, threads, ranks=True, compile=settings.compile, force=force, quantize=settings.quantization,
                                chat=chat)  # this rank's share, rank 0 reports
    if dist.is_main:
        from ..runs.confidence import warn_untrained
        from ..runs.settings import warn_model_rules

        warn_untrained(lm, task)
        warn_model_rules(settings, lm.spec.sampler)
    from ..interrupts import HeldInterrupts
    from ..terminal import ProgressLine

    # an interrupt after the timed runs waits until --json is written (not with --compare-quantize: its
    # second set of runs, before the write, must stop at once)
    hold = None if compare_quantize else HeldInterrupts()
    with ProgressLine(err, quiet or not dist.is_main) as line:
        on_run = _progress(line, opts, len(requests))
        report, use_chat = run_profile(lm, settings, requests, opts, on_run, dist, task_info, hold=hold)
        if on_run is not None and report is not None and not report.incomplete:
            on_run.finish()
    if report is None:  # another rank than 0: its runs went to rank 0, which prints and writes
        return

    to_stdout = json_out == "-"
    table_console = o.table_console(err if to_stdout else out, wide)
    n = len(requests)
    shown = f"{report.prompts_done} of {n} prompts (interrupted)" if report.incomplete else \
        f"{n} prompt{'' if n == 1 else 's'}"
    title = (f"ecache profile · {lm.name} · {shown} · batch {opts.batch_size} · "
             f"{lm.device} {str(lm.dtype).replace('torch.', '')}")
    if not (quiet and to_stdout):  # -q: stderr keeps no table when the JSON on stdout holds the results
        table_console.print(render_table(report, title, wide=wide), soft_wrap=False)  # title and caption wrap at words
    if (line := compile_line(lm.model)) and not quiet:
        err.print(line, markup=False, highlight=False)
    for line in timing_warnings(report):
        err.print(line, markup=False, highlight=False)
    n_empty, why = empty_answers(report)
    if n_empty:
        warn(f"every answer is empty ({n_empty} runs of {report.prompts_done} prompts): {why}, so the scores and "
             "speedups measure nothing useful; check --model, --task and --chat")
    if report.trace:
        info(f"traces in {report.trace['dir']}: tensorboard --logdir {report.trace['dir']} (PyTorch Profiler tab), "
             f"or open *.chrome_trace.json in ui.perfetto.dev / chrome://tracing")  # a status line: not under -q
    comparison = _compare_quantized(report, lm, settings, requests, opts, table_console) if compare_quantize else None
    if json_out is not None:
        doc = profile_document(report, lm, settings, opts, use_chat, task_info, len(requests))
        if comparison is not None:
            doc["quantize_comparison"] = comparison
        write_json(doc, json_out)
    held = False
    if hold is not None:
        try:
            hold.release()  # an interrupt held since the timed runs ended arrives now
        except KeyboardInterrupt:
            held = True
    if report.incomplete or held:  # Ctrl-C: what every policy finished was reported and written; exit as interrupted
        from ..console import error

        if report.incomplete:
            wrote = f"; --json {json_out} holds them (\"incomplete\": true)" if json_out not in (None, "-") else ""
            error(f"interrupted; the table covers the {report.prompts_done} of {len(requests)} prompts every "
                  f"policy finished{wrote}")
        else:
            wrote = f"; --json {json_out} holds them" if json_out not in (None, "-") else ""
            error(f"interrupted after every policy finished; the results cover all {len(requests)} prompts{wrote}")
        raise typer.Exit(code=interrupted_exit_code())


def _compare_quantized(report, lm, settings, requests, opts, console) -> dict:
    """``--compare-quantize``: the same policies, prompts and seed on the unquantized weights, then one
    table of the quantized runs against them; returns the numbers."""
    from ..runs.profile import compare_with_unquantized, render_comparison

    comparison = compare_with_unquantized(report, lm, settings, requests, opts)
    console.print(render_comparison(comparison, str(lm.model.quantization)), soft_wrap=False)
    return comparison


def _progress(line, opts, n_requests: int):
    """An ``on_run`` callback showing, before each run, the runs done of all and the run's kind and policy
    on ``line`` (a ``terminal.ProgressLine`` in the ``terminal.Counter`` format: redrawn in place on a
    terminal, no display thread to compete with the timed runs; periodic plain lines off a terminal;
    None when it shows nothing); its ``finish()`` shows the last run done (N/N)."""
    if not line.active:
        return None
    from ..terminal import Counter

    batches = -(-n_requests // opts.batch_size)
    total = len(opts.policies) * (opts.warmup + opts.repeats * batches + (1 if opts.trace_dir else 0))
    count = Counter(line, "profile", total, "runs")
    done = [0]

    def on_run(kind: str, policy: str) -> None:
        count.update(done[0], f"{kind} {policy}", force=True)
        done[0] += 1

    on_run.finish = lambda: count.update(done[0], force=True)  # the last run done: the line ends at N/N
    return on_run
