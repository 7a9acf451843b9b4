"""``ecache chat``: a multi-turn conversation in the terminal, with generate's flags and live commands."""

from __future__ import annotations

import sys

from .. import options as o


def chat_cmd(
    model: o.Model = "tiny", device: o.Device = "auto", dtype: o.Dtype = "auto", threads: o.Threads = None, compile_step: o.Compile = None, force: o.Force = False,
    quantize: o.Quantize = None, group_size: o.GroupSize = None,
    gen_length: o.GenLength = None, block_length: o.BlockLength = None, steps: o.Steps = None,
    temperature: o.Temperature = None, top_k: o.TopK = None, top_p: o.TopP = None, remasking: o.Remasking = None,
    threshold: o.Threshold = None, factor: o.Factor = None, ban_eos: o.BanEos = None, low_eos_confidence: o.LowEos = None,
    early_exit: o.EarlyExit = None, schedule: o.Schedule = None, compat: o.Compat = None,
    alg_temp: o.AlgTemp = None,
    edit_threshold: o.EditThreshold = None,
    cache: o.Cache = None, tau: o.Tau = None, recent_k: o.RecentK = None, signal: o.Signal = None,
    block_refresh: o.BlockRefresh = None, refresh_every: o.RefreshEvery = None, profile: o.Profile = None,
    seed: o.Seed = 0,
    quiet: o.Quiet = False,
    watch: o.Watch = False,
    watch_delay: o.WatchDelay = 0.0,
):
    """Chat with a model over its chat template: answers appear as their leading tokens become final.

    Commands: /cache POLICY[:k=v], /tau X, /threshold X, /gen-length N, /watch on|off, /stats, /save FILE,
    /clear, /help, /exit. Ctrl-C stops an answer (off a terminal it ends the session), Ctrl-D exits. -q drops the "using model" and start lines
    and the status lines of commands (answers, /stats and /help on stdout, warnings and errors stay). Piped
    lines exit 2 at the end when one failed. Example: [cyan]ecache chat --watch[/]
    """
    from ..console import announce, err, hold_warnings, read_alone, warn
    from ..runs.chat import ChatSession, SettingsSource, open_readline
    from ..runs.generate import check_watch
    from ..runs.inputs import piped_stdin
    from ..runs.models import check_quantize, check_start
    from ..runs.settings import check_settings_fit, not_used_by, warn_model_rules, warn_unused_cache_flags
    from ..runs.watch import watch_available
    from ..runtime import load_for_command

    hold_warnings()  # after the "using model" line (console.announce)
    check_start(model, device, dtype, quantize=quantize)  # refused alone, before the first line and the settings
    check_watch(watch, watch_delay, quiet=quiet)
    flags = o.cache_flags(cache, tau, recent_k, signal, block_refresh, refresh_every)
    source = SettingsSource(model, o.decode_flags(gen_length, block_length, steps, temperature, top_k, top_p, remasking,
                                                  threshold, factor, ban_eos, low_eos_confidence, early_exit, schedule,
                                                  compat, alg_temp, edit_threshold),
                            dict(flags), profile=profile, compile=compile_step, quantize=quantize, group_size=group_size)
    settings = source.resolve()
    check_quantize(settings, device, dtype)  # a profile's format this machine cannot run, named with the file
    warn_unused_cache_flags([settings.cache], flags, not_used_by(settings))
    if watch and not watch_available(err):
        warn("--watch needs a terminal (stderr is not one); answering without the live view")
        watch = False
    piped = piped_stdin()  # piped lines are read and checked in full first (README): their error comes alone
    lines = read_alone(_piped, piped) if piped is not None else None
    announce(None if quiet else settings.describe(model))  # before the (maybe long) load
    lm, _ = load_for_command(model, device, dtype, threads, compile=settings.compile, force=force,
                             quantize=settings.quantization)
    check_settings_fit(settings, lm.spec)  # what every answer's run would refuse: exit 2 before the session
    warn_model_rules(settings, lm.spec.sampler)
    session = ChatSession(lm, source, sys.stdout, err, seed=seed, watch=watch, watch_delay=watch_delay,
                          settings=settings)
    open_readline()
    if hasattr(sys.stdin, "reconfigure"):  # a line that is not UTF-8 reaches the session (one error line) intact
        sys.stdin.reconfigure(errors="surrogateescape")
    if not quiet and lines is None:  # a person at the keyboard; piped lines are a script and need no prompt
        err.print("ecache chat: type a message; /help lists the commands, Ctrl-D ends", markup=False, highlight=False)
    if lines is None:
        session.loop()
        return
    session.loop(read=lines_reader(lines))
    failure = session.failure()  # a script: a line that failed fails the run (exit 2), after every line ran
    if failure is not None:
        raise failure


def _piped(stdin) -> list[str]:
    """Every piped line (``inputs.piped_lines``); UsageError (exit 2) when none holds text, as every command
    refuses empty stdin."""
    from ..runs.inputs import no_prompts, piped_lines

    lines = piped_lines(stdin)
    if not any(line.strip() for line in lines):
        raise no_prompts(None, "pipe messages (and /commands) one per line, or run it in a terminal")
    return lines


def lines_reader(lines: list[str]):
    """``input()``'s stand-in over lines already read: each call returns the next, EOFError at the end."""
    it = iter(lines)

    def read(prompt: str = "") -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read
