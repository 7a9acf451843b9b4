"""``ecache calibrate``: search τ per task domain, score it against ``none``, write it to a profile; on a
block-diffusion model the decoder's threshold instead, against one token per step (``runs/calib_sweep.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import options as o
from ..errors import interrupted_exit_code
from ..runs.speed_guard import DEFAULT_LIMIT

K = "Calibration"


def _taus(value: Optional[str], block: bool = False) -> Optional[list[float]]:
    """``--taus`` (``--thresholds`` on a block-diffusion model, ``block``): a comma list of distinct numbers,
    each in the range of ``--tau`` (``--threshold``), refused in its words (``config.setting_ranges``)."""
    if value is None:
        return None
    from ..config import setting_ranges
    from ..runs.comma_lists import parse_list

    if block:
        return parse_list(value, "--thresholds", float, what="a number", example="0.95,0.9,0.8",
                          rng=setting_ranges()["threshold"])
    return parse_list(value, "--taus", float, what="a number", example="0.1,0.5,1", rng=setting_ranges()["tau"])


def _block_model(model: str) -> bool:
    """True when ``--model`` is known before loading to be a block-diffusion model (``Family.block_causal``)."""
    from ..runs.settings import model_family

    return bool(getattr(model_family(model), "block_causal", False))


def _counts(value: Optional[str], flag: str, example: str) -> Optional[list[int]]:
    """``--recent-k`` / ``--recent-steps``: one whole number, or a comma list of distinct ones searched
    jointly with τ; each in the setting's range, refused in its words (``config.setting_ranges``)."""
    if value is None:
        return None
    from ..config import setting_ranges
    from ..runs.comma_lists import parse_list

    rng = setting_ranges()[flag.removeprefix("--").replace("-", "_")]
    return parse_list(value, flag, int, what="a whole number", example=example, rng=rng)


def _one_or_list(values: Optional[list[int]]) -> tuple[Optional[int], Optional[list[int]]]:
    """(the fixed value, the searched list): one value is a fixed setting, several are searched."""
    if values is not None and len(values) == 1:
        return values[0], None
    return None, values


def calibrate_cmd(
    ctx: typer.Context,
    task: Annotated[Optional[str], typer.Option("--task", "-t", help="arith|code|list|gsm8k|math500|humaneval|mbpp; a,b: default. \\[required]", rich_help_panel=K)] = None,
    model: o.Model = "tiny", device: o.Device = "auto", dtype: o.Dtype = "auto", threads: o.Threads = None, compile_step: o.Compile = None, force: o.Force = False,
    quantize: o.Quantize = None, group_size: o.GroupSize = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Data file or folder of a real benchmark (official JSONL).", rich_help_panel=K)] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", help="Examples of the test split (seeded sample).", rich_help_panel=K)] = 50,
    shots: Annotated[Optional[str], typer.Option("--shots", help="Solved examples per prompt; 0,4: both qualify \\[default: the task's].", rich_help_panel=K)] = None,
    chat: Annotated[Optional[bool], typer.Option("--chat/--no-chat", help="Apply the chat template \\[default: if the model has one].", rich_help_panel=K)] = None,
    metric: Annotated[str, typer.Option("--metric", help="task (its score) or fidelity (agreement with none).", rich_help_panel=K)] = "task",
    max_drop: Annotated[float, typer.Option("--max-drop", help="Allowed score drop below none, in points of 100.", rich_help_panel=K)] = 1.0,
    min_fidelity: Annotated[Optional[float], typer.Option("--min-fidelity", help="Also require token agreement with none ≥ this percent.", rich_help_panel=K)] = None,
    grid: Annotated[Optional[int], typer.Option("--grid", help="Coarse τ grid size (quantiles of none's signal) \\[default: 8].", rich_help_panel=K)] = None,
    refine: Annotated[int, typer.Option("--refine", help="Bisection steps around the choice after the grid.", rich_help_panel=K)] = 3,
    taus: Annotated[Optional[str], typer.Option("--taus", "--thresholds", help="Explicit τs (0.1,0.5,1) or block-diffusion thresholds (0.95,0.9,0.8).", rich_help_panel=K)] = None,
    joint: Annotated[bool, typer.Option("--joint", help="Also search block refresh × k 16,32,64 and the recent_steps arms.", rich_help_panel=K)] = False,
    allow_code_execution: Annotated[bool, typer.Option("--allow-code-execution", help="Score code tasks by running model-written code (sandbox).", rich_help_panel=K)] = False,
    sandbox: Annotated[Optional[str], typer.Option("--sandbox", help="Isolation of model-written code: strict, auto, guard \\[default: auto].", rich_help_panel=K)] = None,
    speed_check: Annotated[bool, typer.Option("--speed-check/--no-speed-check", help="Time the choice vs none, plain and threshold decoding \\[default: on].", rich_help_panel=K)] = True,
    speed_check_limit: Annotated[int, typer.Option("--speed-check-limit", help="Examples the speed check times (spread over the sample).", rich_help_panel=K)] = DEFAULT_LIMIT,
    gen_length: o.GenLength = None, block_length: o.BlockLength = None, steps: o.Steps = None,
    temperature: o.Temperature = None, top_k: o.TopK = None, top_p: o.TopP = None, remasking: o.Remasking = None,
    threshold: o.Threshold = None, factor: o.Factor = None, ban_eos: o.BanEos = None, low_eos_confidence: o.LowEos = None,
    early_exit: o.EarlyExit = None, schedule: o.Schedule = None, compat: o.Compat = None,
    alg_temp: o.AlgTemp = None,
    recent_k: Annotated[Optional[str], typer.Option("--recent-k", help="entropy: recompute the k last commits; 16,64: searched \\[default: 64].", rich_help_panel=o.C)] = None,
    recent_steps: Annotated[Optional[str], typer.Option("--recent-steps", help="entropy: recompute commits ≤ n steps old; 0,4: searched \\[default: 0].", rich_help_panel=o.C)] = None,
    signal: o.Signal = None, block_refresh: o.BlockRefresh = None,
    profile: Annotated[Optional[str], typer.Option("--profile", help="Base settings from a profile (its τ is ignored).", rich_help_panel=o.C)] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="Examples decoded together.", rich_help_panel=o.D)] = 1,
    seed: o.Seed = 0,
    out: Annotated[Optional[Path], typer.Option("--out", help="Profile to write \\[default: ./profiles/<model>/<task>.yaml].", rich_help_panel=o.O)] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Points, frontier, choice and manifest as JSON ('-': stdout).", rich_help_panel=o.O)] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="The score-vs-speedup frontier as a PNG.", rich_help_panel=o.O)] = None,
    run_file: Annotated[Optional[Path], typer.Option("--run-file", help="Per-example JSONL records \\[default: beside the profile].", rich_help_panel=o.O)] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run file (same settings required).", rich_help_panel=o.O)] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Search and report; no profile, no run file.", rich_help_panel=o.O)] = False,
    wide: o.Wide = False,
    quiet: o.Quiet = False,
):
    """Find the fastest τ (block diffusion: --threshold) within --max-drop of [bold]none[/]; write a profile.

    Example: [cyan]ecache calibrate --task list --limit 50[/] (exit 1 when no τ qualifies)
    """
    from ..console import announce, err, hold_warnings, read_alone
    from ..console import out as out_console
    from ..errors import EcacheError
    from ..outputs import write_json
    from ..runs.calib_groups import TaskGroups, parse_list, parse_shots
    from ..runs.calib_report import (
        calibrate_document,
        frontier_table,
        plot_frontier,
        sweep_table,
        wall_warnings,
    )
    from ..runs.calib_store import JOINT_BLOCK_REFRESHES, JOINT_RECENT_KS, JOINT_STEP_ARMS
    from ..runs.calibrate import (
        CalibrateOptions,
        Interrupted,
        calibrate,
        check_outputs,
        preflight,
        validate,
    )
    from ..runs.settings import quantize_flag, resolve_settings
    from ..runtime import compile_line, load_for_command
    from ..tasks import get_task
    from ..tasks import sandbox as code_sandbox

    if task is None:  # --data or --shots alone: the words of every command that takes --task
        from ..errors import UsageError
        from ..runs.inputs import check_prompt_sources

        check_prompt_sources(None, None, None, data, shots)
        raise UsageError("missing option '--task' / '-t' (the task domain to calibrate, e.g. --task list); see "
                         f"`{ctx.command_path} --help`")  # the parser's words for a missing option
    hold_warnings()  # after the "using model" line (console.announce)
    names, shot_list = parse_list(task, "--task"), parse_shots(shots)
    block = _block_model(model)  # the decoder's threshold is searched, not τ (runs/calib_sweep.py)
    if block:
        _warn_block_flags(recent_k=recent_k, recent_steps=recent_steps, signal=signal, block_refresh=block_refresh,
                          joint=joint or None, grid=grid, threshold=threshold, factor=factor)
        recent_k = recent_steps = signal = block_refresh = threshold = factor = None
        joint = False
    one_k, ks = _one_or_list(_counts(recent_k, "--recent-k", "16,32,64"))
    one_steps, step_list = _one_or_list(_counts(recent_steps, "--recent-steps", "0,4,8"))
    brs, extra = None, None
    if joint:  # a --recent-k list is searched as given, one value stays fixed, none: the joint default list
        ks = ks if ks is not None else [one_k] if one_k is not None else list(JOINT_RECENT_KS)
        brs = list(JOINT_BLOCK_REFRESHES)
        if recent_steps is None:  # the paper's arms are the paper's rule, whatever the base profile says
            step_list = [0]
            if recent_k is None:  # the recent_steps variant's arms beside them
                extra = list(JOINT_STEP_ARMS)
    grouped = len(names) > 1 or (shot_list is not None and len(shot_list) > 1)
    opts = CalibrateOptions(task=",".join(names), data=data, limit=limit, seed=seed,
                            shots=None if grouped or shot_list is None else shot_list[0], chat=chat, metric=metric,
                            recent_ks=ks, block_refreshes=brs, recent_steps=step_list, extra_arms=extra,
                            max_drop=max_drop, min_fidelity=min_fidelity, grid=8 if grid is None else grid, refine=refine,
                            taus=_taus(taus, block), sweep="threshold" if block else "tau",
                            batch_size=batch_size, allow_code_execution=allow_code_execution, out=out,
                            json_path=json_path, plot_path=plot, run_file=run_file, resume=resume, dry_run=dry_run,
                            quiet=quiet, speed_check=speed_check, speed_check_limit=speed_check_limit,
                            quantize=quantize_flag(quantize, group_size))
    if grouped:
        task_obj = TaskGroups.build(names, shot_list, lambda n: get_task(n, data, allow_code_execution=allow_code_execution))
    else:
        task_obj = get_task(names[0], data, allow_code_execution=allow_code_execution)
    validate(opts)  # option ranges: exit 2 before anything is read
    if sandbox is not None:
        code_sandbox.check_mode(sandbox)
    read_alone(task_obj.examples, "test", limit, seed)  # a missing dataset fails here, before consent and model loading
    preflight(task_obj, opts)  # consent for code tasks: exit 2 before loading anything
    from ..runs.models import check_quantize, check_start, task_prompt_lengths

    check_start(model, device, dtype, quantize=quantize)  # the model flags before the outputs, as generate's
    settings = resolve_settings(
        model, o.decode_flags(gen_length, block_length, steps, temperature, top_k, top_p, remasking, threshold, factor,
                              ban_eos, low_eos_confidence, early_exit, schedule, compat, alg_temp),
        {**o.cache_flags("block" if block else "entropy", None, one_k, signal, block_refresh, None),
         "recent_steps": one_steps},
        profile=profile, compile=compile_step, quantize=quantize, group_size=group_size, tau_searched=True,
        prompt_tokens=task_prompt_lengths(model, task_obj, limit, opts.shots, seed, chat))  # the sample's prompts
    check_quantize(settings, device, dtype)  # a profile's format this machine cannot run, named with the file
    settings.tau_source = "search"  # τ is what calibrate searches; a profile's τ is not used
    if block:
        from ..runs.calibrate import sweep_base

        settings = sweep_base(settings)
    # output paths once the settings stand (a run refused on them leaves no folder behind), before any decoding
    # (--dry-run: the --json and --plot reports only)
    check_outputs(opts)
    from ..runs.calib_store import check_new_run_file
    from ..runs.calibrate import run_file_path

    check_new_run_file(run_file_path(model, opts), resume, dry_run)  # refused before the first line, as --output is
    opts.quantize = settings.quantize  # --profile's quantize key when no flag: the profile written says which
    from ..distributed import from_environment

    base = f"; base settings from profile {settings.profile}" if settings.profile else ""
    searched = f"searched on --task {task} (calibrate){f' on {settings.quantize} weights' if settings.quantize else ''}{base}"
    announce(settings.describe(model, tau=searched, searched="threshold" if block else "τ")
             if not quiet and from_environment().is_main else None)  # what this run uses, before the load
    code_sandbox.configure(sandbox, settings.sandbox, metric == "task" and task_obj.needs_code_execution)
    lm, dist = load_for_command(model, device, dtype, threads, ranks=True, compile=settings.compile, force=force, quantize=settings.quantization,
                                chat=chat)  # the ranks share the batches
    if dist.is_main:
        from ..runs.confidence import warn_untrained
        from ..runs.settings import warn_model_rules

        for name in names:
            warn_untrained(lm, name)
        warn_model_rules(settings, lm.spec.sampler)
    try:
        outcome = calibrate(lm, settings, task_obj, opts, err if dist.is_main else None, dist=dist)
    except Interrupted as e:  # Ctrl-C: the run file keeps the records; --json gets what finished
        from ..console import error

        wrote = ""
        if e.outcome is not None and json_path is not None and dist.is_main:
            write_json(calibrate_document(e.outcome, lm, settings, opts, incomplete=True), json_path)
            what = ("reference and the {} finished threshold(s)" if e.outcome.sweep == "threshold" else
                    "none baseline and the {} finished τ(s)").format(len(e.outcome.points))
            wrote = f"; --json {json_path} holds the {what} (\"incomplete\": true)"
        kept = "dry run: no run file kept" if dry_run else "finished records are kept in the run file (rerun with --resume)"
        error(f"interrupted; no profile written; {kept}{wrote}")
        raise typer.Exit(code=interrupted_exit_code()) from None
    if not dist.is_main:  # rank 0 prints and writes every file; the others exit with its status
        if outcome.choice.point is None:
            raise typer.Exit(code=1)
        return
    max_frac, min_frac = opts.fractions()
    written = [f"profile {outcome.profile}"] if outcome.profile is not None else []  # files this run wrote
    try:
        if json_path is not None and str(json_path) == "-":  # stdout carries the JSON: tables go to stderr
            out_console = err
        tables = o.table_console(out_console, wide)
        if not (quiet and out_console is err):  # -q: stderr keeps no table when the JSON holds the results
            tables.print(sweep_table(outcome, metric, max_frac, min_frac, wide=wide), soft_wrap=False)  # captions wrap
            tables.print(frontier_table(outcome, metric), soft_wrap=False)
        for line in wall_warnings(outcome):
            err.print(line, markup=False, highlight=False)
        if json_path is not None:
            write_json(calibrate_document(outcome, lm, settings, opts, incomplete=False), json_path)
            written.append(f"--json {json_path}")
        if plot is not None:
            plot_frontier(outcome, metric, max_frac, plot)
            written.append(f"--plot {plot}")
    except KeyboardInterrupt:  # Ctrl-C after the search: the results are whole, so keep what is cheap to write
        from ..console import error

        if json_path is not None and f"--json {json_path}" not in written:
            write_json(calibrate_document(outcome, lm, settings, opts, incomplete=False), json_path)
            written.append(f"--json {json_path}")
        lost = "" if plot is None or f"--plot {plot}" in written else f"; --plot {plot} not written"
        error(f"interrupted after the search finished; wrote {', '.join(written) or 'no file'}{lost} "
              "(rerun with --resume to redo the rest from the run file)")
        raise typer.Exit(code=interrupted_exit_code()) from None
    choice = outcome.choice
    if choice.point is None:
        from ..runs.tau_search import hint

        # the hint names what the run measured as the cause: speed (the proxy or the wall clock) or score
        tried = [p.tau for p in outcome.points]  # the swept values (thresholds in a threshold sweep)
        raise EcacheError(f"{choice.reason}; no profile written ({hint(outcome.sweep, choice.cause, tried)})")
    where = "dry run: no profile written" if dry_run else f"wrote {outcome.profile}"
    if not (quiet and out_console is err):  # -q: nothing on stderr when the JSON on stdout holds the choice
        out_console.print(f"chosen {choice.reason}; {where}", markup=False, highlight=False)
    if (line := compile_line(lm.model)) and not quiet:  # --compile: graphs and compile seconds, apart
        err.print(line, markup=False, highlight=False)



def _warn_block_flags(**given) -> None:
    """One warning naming the flags given (not None) that do not apply when a block-diffusion model's
    threshold is calibrated (``runs.calib_sweep.ignored_flags``)."""
    from ..console import warn
    from ..runs.calib_sweep import ignored_flags

    line = ignored_flags({f"--{k.replace('_', '-')}": v is not None for k, v in given.items()})
    if line is not None:
        warn(line)
