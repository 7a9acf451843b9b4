"""``ecache chat``: a multi-turn conversation over the model's chat template, in the terminal.

Each line typed is a user message; the conversation so far (``history``: user and assistant messages)
goes through the chat template (``models/prompting.py``) and the answer is decoded like ``ecache
generate``'s first prompt (the same settings, seed and random stream: row 0), printed as its leading
tokens become final (``runs/final_text.py``, what ``ecache serve`` streams) or, with ``/watch on``,
shown live (``runs/watch.py``). When the conversation no longer fits the model's positions beside the
canvas, its oldest turns are left out (one note says so).

Lines starting with ``/`` are commands (:data:`HELP`). The settings come from the command's flags
resolved as ``generate`` resolves them (``runs/settings.resolve_settings``: defaults < profile <
flags); ``/tau``, ``/threshold``, ``/gen-length`` and ``/cache`` change a flag and resolve again, so
``/tau 0.5`` is ``--tau 0.5``; a setting the chosen policy does not take (``/tau`` under ``dual``) is kept
for a later policy and warned ignored, as its flag is. A bad value is one ``error:`` line and changes
nothing; piped lines (a script) go on past it, and the command exits 2 at the end (:attr:`ChatSession.failed`
names the lines). ``/stats`` and ``/help`` answer on stdout, as the answers do (asked-for output, kept under
``-q``); the replies that confirm a change (``/tau``, ``/save``, ``/clear``, ``/watch``) are status lines on
stderr, dropped by ``-q``. Ctrl-C during an answer stops it (the turn is dropped from the history); Ctrl-C at
the prompt clears the line; Ctrl-D or ``/exit`` ends the session. ``/save FILE`` writes one JSON record
per answer, the fields of ``generate --jsonl`` with the conversation sent as ``messages``, so ``ecache
generate --input FILE`` decodes the same prompts again.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from .. import errors
from ..contract.text import not_text_words
from ..engine.core import Engine
from ..errors import EcacheError, UsageError
from .confidence import EntropyMeter
from .final_text import FinalText, unsettled
from .settings import (
    Settings,
    check_settings_fit,
    not_used_by,
    policies_for,
    policy_takes,
    resolve_settings,
    unused_cache_flags,
    unused_flags_message,
)

HELP = """commands:
  /cache POLICY[:k=v...]  cache policy and its parameters (e.g. /cache entropy:tau=0.5:recent_k=16)
  /tau X                  EntropyCache's τ (nats), as --tau
  /threshold X|off        parallel decoding: commit tokens with confidence ≥ X, as --threshold
  /gen-length N           canvas positions of an answer, as --gen-length
  /watch on|off           show the canvas live while the answer decodes
  /stats                  the last answer's NFE, refresh share, tokens/s and work share
  /save FILE              the conversation as JSONL records (as generate --jsonl writes them)
  /clear                  forget the conversation
  /help                   this list
  /exit                   end the session (Ctrl-D too); Ctrl-C stops an answer"""

PROMPT = "you> "


def help_text(width: int) -> str:
    """:data:`HELP` with each line longer than ``width`` columns wrapped under its description (the
    terminal's width; 80 off a terminal), so the list fits as every table does."""
    import textwrap

    out = []
    for line in HELP.splitlines():
        indent = " " * (len(line) - len(line.lstrip(" "))) if not line.startswith("  /") else " " * 26
        out += textwrap.wrap(line, max(width, 40), subsequent_indent=indent) or [line]
    return "\n".join(out)


@dataclass
class SettingsSource:
    """How the chat's settings are resolved (as ``generate``'s): the model name, the profile, compile and
    quantize flags, and the decode and cache flags (None = not given), which the commands change."""

    model: str
    decode_flags: dict
    cache_flags: dict
    profile: str | None = None
    task: str | None = None
    compile: bool | None = None
    quantize: str | None = None
    group_size: int | None = None
    overrides: dict = field(default_factory=dict)  # /cache NAME:k=v parameters beyond the flags
    threshold_off: bool = False  # /threshold off: no threshold, also over a profile's or the family's default

    def resolve(self) -> Settings:
        """The settings of these flags (``resolve_settings``), with the ``/cache`` parameters on top.
        Raises UsageError / ConfigError as the flags would."""
        s = resolve_settings(self.model, self.decode_flags, self.cache_flags, profile=self.profile, task=self.task,
                             compile=self.compile, quantize=self.quantize, group_size=self.group_size)
        for k, v in self.overrides.items():  # None: the policy's own default (as in --policies)
            for params in (s.cache_params, s.all_cache_params):
                if v is None:
                    params.pop(k, None)
                else:
                    params[k] = v
        if self.threshold_off and s.decode.threshold is not None:  # resolve() keeps a default under None
            s.decode = dataclasses.replace(s.decode, threshold=None)
        if self.overrides.get("tau") is not None:
            s.tau_source = "flag"  # given in the session, as a flag is
        s.policy()  # a bad combination fails here, before any answer
        return s


class ChatSession:
    """One conversation (module docstring). ``lm``: the loaded model; ``source``: its settings' flags;
    ``out``: where answers go (stdout); ``console``: stderr's rich console (notes, errors, the live view);
    ``settings``: ``source`` resolved (None: resolved here). Raises UsageError for a model without a chat
    template."""

    def __init__(self, lm, source: SettingsSource, out: IO, console, seed: int = 0, watch: bool = False,
                 watch_delay: float = 0.0, settings: Settings | None = None):
        if not getattr(lm.tokenizer, "chat_template", None):
            raise UsageError(f"ecache chat needs a model with a chat template; {lm.name} has none (use ecache "
                             "generate)")
        self.lm, self.source, self.out, self.console = lm, source, out, console
        self.engine = Engine.from_loaded(lm)
        self.settings = settings or source.resolve()
        self.seed, self.watch, self.delay = seed, watch, watch_delay
        self.history: list[dict] = []
        self.records: list[dict] = []  # one per answer, for /save
        self.last: dict | None = None  # the last answer's stats
        self.line = 0  # the number of the line being run (1-based, blank lines counted)
        self.failed: list[tuple[int, int]] = []  # (line, exit code) of each line that ended in an error

    # -- the loop ------------------------------------------------------------------------------------

    def loop(self, read=input) -> None:
        """Read lines until Ctrl-D or ``/exit``; answer messages and run commands."""
        prompt = PROMPT if _interactive() else ""
        n = 0
        while True:
            n += 1
            self.line = n
            try:
                line = read(prompt)
            except UnicodeDecodeError:  # a strict text stream: the byte is not known
                self.error(f"line {n}: not UTF-8 text; skipped (type or send UTF-8)")
                continue
            except EOFError:
                if prompt:
                    self.out.write("\n")
                return
            except KeyboardInterrupt as e:  # at the prompt: a fresh line, as a shell does
                if _ends_session(e):
                    raise
                errors.interrupt_pending = False  # handled: the session goes on
                self.out.write("\n")
                continue
            words = not_text_words(line)  # a byte that is no UTF-8 reads as a lone surrogate (surrogateescape)
            if words is not None:
                self.error(f"line {n}: {words}; skipped (type or send UTF-8)")
                continue
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return
            else:
                self.ask(line)

    def note(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def status(self, text: str) -> None:
        """A status line (a setting changed, a file saved, the stats after an answer): none under ``-q``
        (``console.quiet``, README's rule: -q leaves stderr to warnings, errors and what was asked for)."""
        from .. import console

        if not console.quiet:
            self.note(text)

    def reply(self, text: str) -> None:
        """Output the user asked for (``/stats``, ``/help``): on stdout beside the answers, under ``-q`` too."""
        self.out.write(text + "\n")
        self.out.flush()

    def warn(self, text: str) -> None:
        """A ``warning:`` line on stderr (kept under ``-q``, as every command's warnings)."""
        self.console.print("warning: " + text, style="yellow", markup=False, highlight=False)

    def error(self, text: str, code: int = 2) -> None:
        """One ``error:`` line on stderr; the line being run is remembered as failed (exit ``code``)."""
        self.failed.append((self.line, code))
        self.console.print("error: " + text, style="bold red", markup=False, highlight=False)

    def failure(self) -> EcacheError | None:
        """The error a script of piped lines ends with when some of its lines failed (exit 2, or 1 when
        every failure was a runtime one), naming those lines; None when none failed."""
        if not self.failed:
            return None
        lines = sorted({n for n, _ in self.failed})
        shown = ", ".join(map(str, lines[:10])) + (f" and {len(lines) - 10} more" if len(lines) > 10 else "")
        kind = UsageError if max(c for _, c in self.failed) == 2 else EcacheError
        return kind(f"piped line{'s' if len(lines) > 1 else ''} {shown} failed (the errors above); the other lines "
                    "ran; fix the script and pipe it again")

    # -- commands ------------------------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run a ``/`` command; False ends the session. A bad command or value prints one error line and
        leaves the settings as they were."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        handlers = {"/cache": self._cache, "/tau": self._tau, "/threshold": self._threshold,
                    "/gen-length": self._gen_length, "/watch": self._watch, "/stats": self._stats,
                    "/save": self._save, "/clear": self._clear, "/help": self._help}
        if name in ("/exit", "/quit"):
            return False
        if name not in handlers:
            self.error(f"unknown command {name}; /help lists the commands")
            return True
        before = copy.deepcopy(self.source)
        try:
            handlers[name](arg)
        except EcacheError as e:
            self.source = before
            msg = str(e).replace("; pass the flag to override", "; restart ecache chat with the flag to override it")
            self.error(msg if msg.startswith(name) else f"{name}: {msg}", e.exit_code)
        return True

    def _apply(self, lead: str | None = None) -> None:
        """Resolve the changed flags, check them against the loaded model (``check_settings_fit``: what
        the next answer's run would refuse) and say what the settings are now: :meth:`describe`'s line,
        after ``lead`` where the line names the change only among others (τ among the policy's parameters)."""
        settings = self.source.resolve()
        check_settings_fit(settings, self.lm.spec)
        was_unused = unused_cache_flags([self.settings.cache], self.source.cache_flags)
        self.settings = settings
        self.status(f"{lead} · {self.describe()}" if lead else self.describe())
        dropped = [f"/{f[2:]}" for f in unused_cache_flags([settings.cache], self.source.cache_flags)
                   if f not in was_unused]  # a setting the new policy does not take: as the flags, one warning
        if dropped:
            self.warn(unused_flags_message(dropped, not_used_by(settings).replace("--cache", "/cache")))

    def describe(self) -> str:
        """The settings an answer uses, in one line."""
        s, d = self.settings, self.settings.decode
        params = ", ".join(f"{k}={v}" for k, v in sorted(s.cache_params.items()))
        text = f"cache {s.cache}" + (f" ({params})" if params else "")
        text += f" · gen-length {d.gen_length}, block {d.block_length}"
        if d.threshold is not None:
            text += f", threshold {d.threshold:g}"
        return text

    def _cache(self, arg: str) -> None:
        from .profile import parse_policy_spec

        if not arg:
            raise UsageError("/cache needs a policy, e.g. /cache entropy:tau=0.5")
        name, params = parse_policy_spec(arg, where="/cache", family=self.lm.spec)
        _check_model(name, self.lm.spec)
        self.source.cache_flags["policy"] = name
        self.source.overrides = params
        self._apply()

    def _tau(self, arg: str) -> None:
        from ..cache import policy_params

        x = _number(arg, float, "/tau", "0.5", "tau")
        _check_range("tau", arg.strip(), "/tau")  # the value named as typed
        if "entropy" not in policies_for(self.lm.spec):  # as --tau on this family: warned, ignored
            self.warn(f"/tau is not used by the {self.lm.spec.family} model family (τ is EntropyCache's threshold; "
                      "block diffusion caches finished blocks exactly); ignored")
            return
        self.source.cache_flags["tau"] = x
        self.source.overrides.pop("tau", None)
        if "tau" not in policy_params(self.settings.cache):  # as --tau under this policy: warned, ignored
            self.settings = self.source.resolve()
            self.warn(f"/tau is not used by /cache {self.settings.cache} ({policy_takes(self.settings.cache)}); "
                      f"ignored (/cache entropy uses τ {x:g})")  # --tau's words, with the command for the flag
            return
        self._apply(f"τ {x:g}")

    def _threshold(self, arg: str) -> None:
        off = arg.lower() in ("off", "none")
        x = None if off else _number(arg, float, "/threshold", "0.9 or /threshold off", "threshold")
        if x is not None:
            _check_range("threshold", arg.strip(), "/threshold")
        self.source.decode_flags["threshold"] = x
        self.source.threshold_off = off
        if x is not None:
            self.source.decode_flags["factor"] = None  # as --threshold: the threshold rule, not the factor one
        self._apply("threshold off" if off else None)  # the settings line names a threshold only when one is set

    def _gen_length(self, arg: str) -> None:
        n = _number(arg, int, "/gen-length", "64", "gen_length")
        _check_range("gen_length", arg.strip(), "/gen-length")
        before = self.source.decode_flags.get("gen_length")
        self.source.decode_flags["gen_length"] = n
        try:
            self._apply()
        except UsageError as e:  # the flag's message (decoding/schedule.py), after the chat command's label
            self.source.decode_flags["gen_length"] = before  # a refused value leaves the session as it was
            if not str(e).startswith(f"--gen-length {n} "):
                raise
            raise UsageError(f"/gen-length{str(e).removeprefix('--gen-length')}") from None

    def _watch(self, arg: str) -> None:
        from .. import console
        from .watch import watch_available

        if not arg:
            raise UsageError("/watch needs on or off, e.g. /watch on")
        if arg not in ("on", "off"):
            raise UsageError(f"/watch {arg!r}: say /watch on or /watch off")
        if arg == "on" and console.quiet:  # as --watch with -q (generate.check_watch)
            raise UsageError("/watch on draws the canvas on stderr and -q silences stderr; start chat without -q "
                             "to watch")
        if arg == "on" and not watch_available(self.console):  # as --watch: a warning, the session goes on
            self.warn("/watch needs a terminal (stderr is not one); answering without the live view")
            return
        self.watch = arg == "on"
        self.status(f"watch {arg}")

    def _stats(self, arg: str) -> None:
        from .watch import stats_line

        width = shutil.get_terminal_size().columns  # as /help: the terminal's width, 80 off a terminal
        self.reply("no answer yet" if self.last is None else stats_line(self.last, width))

    def _save(self, arg: str) -> None:
        from ..outputs import check_file

        if not arg:
            raise UsageError("/save needs a file name, e.g. /save chat.jsonl")
        path = check_file(Path(arg), "/save", lock=False)
        try:
            with open(path, "w", encoding="utf-8") as fh:
                for rec in self.records:
                    fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        except OSError as e:
            raise UsageError(f"cannot write {arg} ({e.strerror}); choose another path") from None
        self.status(f"saved {len(self.records)} record(s) to {arg}")

    def _clear(self, arg: str) -> None:
        self.history.clear()
        self.status("conversation cleared")

    def _help(self, arg: str) -> None:
        self.reply(help_text(shutil.get_terminal_size().columns))

    # -- answers -------------------------------------------------------------------------------------

    def ask(self, text: str) -> None:
        """Answer user message ``text`` (streamed, or watched); Ctrl-C stops the answer and drops the turn."""
        self.history.append({"role": "user", "content": text})
        try:
            messages, ids = self._prompt()
            rec = self._decode(messages, ids)
        except KeyboardInterrupt as e:
            if _ends_session(e):
                raise
            errors.interrupt_pending = False  # handled: the session goes on
            self.history.pop()
            self.out.write("\n")
            self.out.flush()
            self.note("(answer stopped; not kept in the conversation)")
            return
        except EcacheError as e:
            self.history.pop()
            self.error(str(e), e.exit_code)
            return
        self.history.append({"role": "assistant", "content": rec["text"]})
        self.records.append({"index": len(self.records), "line": len(self.records) + 1, **rec})
        self.last = rec["stats"]

    def _prompt(self) -> tuple[list[dict], list[int]]:
        """The messages sent and their token ids: the whole conversation, less its oldest turns when
        prompt and canvas would not fit the model's positions."""
        limit = self.lm.spec.max_positions - self.settings.decode.gen_length
        messages = list(self.history)
        ids = self.engine.encode([messages], True)[0]
        dropped = 0
        while len(ids) > limit and len(messages) > 1:
            messages = messages[2:] if len(messages) > 2 else messages[1:]
            dropped += 1
            ids = self.engine.encode([messages], True)[0]
        if dropped:
            self.note(f"(the {dropped} oldest turn(s) are left out: the conversation no longer fits the model's "
                      f"{self.lm.spec.max_positions} positions beside --gen-length {self.settings.decode.gen_length})")
        return messages, ids

    def _decode(self, messages: list[dict], ids: list[int]) -> dict:
        """Decode one answer; print it (as it becomes final, or after the live view) and return its record."""
        s = self.settings
        run = self.engine.start([ids], s.decode, s.policy(), seed=self.seed, row_ids=[0])
        meter = EntropyMeter(run.B, run.P, run.G, run.state.tokens.device)
        if self.watch:
            from .watch import WatchView

            view = WatchView(self.console, run, row=0, title=f"{self.lm.name} · cache {s.cache}", delay=self.delay)
            for rec in view.follow():
                meter.observe(rec)
            res = run.results()[0]
            self.out.write(res.text + "\n")
        else:
            res = self._stream(run, meter)
        self.out.flush()
        if self.watch:
            from .watch import stats_line

            self.status(stats_line(res.stats, self.console.width))
        return {"messages": messages, "id": None, "input": {}, "text": res.text, "token_ids": res.answer_ids,
                "ended": res.ended, "mean_entropy": meter.means([res.stats["generated_tokens"]])[0],
                "stats": res.stats, "settings": json.loads(json.dumps(s.as_dict())), "seed": self.seed,
                "model": self.lm.name}

    def _stream(self, run, meter: EntropyMeter):
        """Iterate ``run``, writing the answer's text as it becomes final; return its result."""
        tok = self.engine.tokenizer
        final = FinalText(set(self.engine.end_ids.tolist()), lambda t: tok.decode(t, skip_special_tokens=True),
                          run.G)
        P = run.P
        for rec in run:
            meter.observe(rec)
            if int(rec.rows[0]) == 0:
                new = final.advance(run.state.tokens[0, P:], unsettled(run)[0, P:])
                if new:
                    self.out.write(new)
                    self.out.flush()
        res = run.results()[0]
        self.out.write(final.finish(res.token_ids) + "\n")
        return res


def _ends_session(interrupt: KeyboardInterrupt) -> bool:
    """Whether an interrupt ends the session (exit 130 / 143, as in every command) rather than only the answer
    or the line being typed: SIGTERM always; Ctrl-C off a terminal, where the lines are a script that no one
    is there to go on typing."""
    return isinstance(interrupt, errors.Terminated) or not _interactive()


def _interactive() -> bool:
    """stdin is a terminal (the prompt is shown; piped lines are answered without it)."""
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


def _number(arg: str, kind, command: str, example: str, setting: str | None = None):
    """``arg`` as an int or float; UsageError naming the command and an example otherwise. A value of
    decode setting or policy parameter ``setting`` that is no finite number (``/tau nan``, ``/tau abc``)
    or no whole number where one is due (``/gen-length abc``) gets the flag's message
    (``config.check_setting``: ``/tau abc must be a finite number ≥ 0 …``); no value at all is named as
    such (``/tau needs a value, e.g. /tau 0.5``)."""
    if not arg:  # as /cache and /save name what they need
        raise UsageError(f"{command} needs a value, e.g. {command} {example}")
    if setting is not None:
        try:
            value = kind(arg)
        except ValueError:
            value = arg
        if isinstance(value, str) or not math.isfinite(value):
            _check_range(setting, arg, command)
    try:
        value = kind(arg)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise UsageError(f"{command} {arg!r} is not {what} (e.g. {command} {example})") from None
    if kind is float and value != value:
        raise UsageError(f"{command} {arg} is not a number (e.g. {command} {example})")
    return value


def _check_model(name: str, spec) -> None:
    """UsageError when cache policy ``name`` does not apply to the loaded model (``CachePolicy.check_model``),
    after the command: ``/cache block does not apply to the llada model family (...); use one of none, entropy,
    ...``, as ``--cache block`` and a request's ``policy`` are refused."""
    from ..cache import POLICIES

    try:
        POLICIES[name].check_model(POLICIES[name], spec)
    except UsageError as e:
        msg = str(e).replace(f"--cache {name}", f"/cache {name}", 1)
        raise UsageError(msg) from None


def _check_range(name: str, value, command: str) -> None:
    """``value`` in the declared range of setting ``name``, in the flag's words (``config.check_setting``)."""
    from ..config import check_setting

    check_setting(name, value, command)


def open_readline() -> None:
    """Line editing and in-session history for ``input()`` through the standard library's ``readline``,
    where the platform has it (else plain ``input()``)."""
    try:
        import readline  # noqa: F401 (importing it turns on line editing for input())
    except ImportError:  # e.g. Windows without pyreadline
        pass
