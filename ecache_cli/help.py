"""``--help`` / ``-h`` for every ecache command, and ``ecache help TOPIC``.

The help is rendered with rich at the terminal's width (``$COLUMNS`` when set; 80 columns for a pipe),
as a two-column list per panel: the option's names and value type, then its one-line help and default.
Typer's own layout puts the ``--no-…`` half of a flag pair in a column of its own, which leaves so
little room below ~100 columns that rich cuts the longest option names (``--low-eos-confi…``); here a
pair is written ``--[no-]chat``, the names column is as wide as the longest name (at most
:data:`NAMES_WIDTH`), so no option name is ever cut, and the help column keeps ~50 characters at 80
columns. Details that do not fit one line live in :data:`TOPICS`
(``ecache help decoding``) and the README.
"""

from __future__ import annotations

import io
import shutil
import sys

#: The widest the names column grows (``--volatility-level <float>`` is 26); a longer entry wraps.
NAMES_WIDTH = 28


def terminal_width() -> int:
    """The width help is rendered at: ``$COLUMNS`` when set, else the terminal's, else 80."""
    return shutil.get_terminal_size((80, 24)).columns


def _names(param, ctx) -> str:
    """``--model, -m <str>`` / ``--[no-]chat`` / ``--ban-eos/--allow-eos`` / ``PROMPTS...``: how the option
    is written."""
    if param.param_type_name == "argument":
        return f"{param.name.upper()}{'...' if param.nargs != 1 else ''}"
    longs = [o for o in param.opts if o.startswith("--")] + [o for o in param.opts if not o.startswith("--")]
    text = ", ".join(longs)
    if param.secondary_opts:
        neg = param.secondary_opts[0]
        if len(longs) == 1 and neg == "--no-" + longs[0][2:]:  # --chat/--no-chat -> --[no-]chat
            text = "--[no-]" + longs[0][2:]
        else:
            text += "/" + ", ".join(param.secondary_opts)
    kind = "" if getattr(param, "is_flag", False) else (param.display_type_rich(ctx) or "")
    return f"{text} {kind}".strip()


def _help_text(param) -> str:
    """The option's help with its default (``[default: …]``, unless the help says it) and env var."""
    text = (param.help or "").strip()
    default = param.default
    if ("[default:" not in text and default is not None and default is not False and param.show_default is not False
            and not getattr(param, "is_flag", False) and param.param_type_name == "option"):
        text += f" \\[default: {default}]"
    if getattr(param, "envvar", None):
        text += f" \\[env: ${param.envvar}]"
    if param.required:
        text += " \\[required]"
    return text


def _panels(console, panels: dict[str, list[tuple[str, str]]]) -> None:
    """Print each panel: its title, then its rows indented by 2, the names column equally wide in every
    panel (the widest name, at most :data:`NAMES_WIDTH`)."""
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    width = min(NAMES_WIDTH, max((len(n) for rows in panels.values() for n, _ in rows), default=0))
    for title, rows in panels.items():
        console.print(Text(title, style="bold"))
        t = Table.grid(padding=(0, 2), pad_edge=False)
        t.add_column(style="bold cyan", min_width=width, max_width=width, overflow="fold")
        t.add_column(overflow="fold")
        for names, text in rows:
            t.add_row(Text(names), Text.from_markup(text))
        console.print(Padding(t, (0, 0, 0, 2)))


def render(command, ctx) -> str:
    """The help of ``command`` (a click command or group) as text for the terminal (ANSI styles when
    stdout is a terminal): usage, description, then the parameters panel by panel (typer's
    ``rich_help_panel``; arguments first) or the subcommands, and a last line on ``-h`` and the topics."""
    from rich.console import Console
    from rich.padding import Padding
    from rich.text import Text

    buf = io.StringIO()
    console = Console(file=buf, width=terminal_width(), force_terminal=sys.stdout is not None and sys.stdout.isatty(),
                      highlight=False)
    pieces = command.collect_usage_pieces(ctx)
    console.print(Text("Usage: ", style="bold") + Text(" ".join([ctx.command_path, *pieces])))
    if command.help:
        import inspect

        for para in inspect.cleandoc(command.help).split("\n\n"):
            console.print(Padding(Text.from_markup(" ".join(para.split())), (0, 0, 0, 1)))
    console.print()
    panels: dict[str, list[tuple[str, str]]] = {}
    help_names = set(ctx.help_option_names)
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False) or help_names & set(getattr(param, "opts", ())):
            continue  # -h/--help: the last line
        if param.param_type_name == "argument":
            panel = "Arguments"
        else:
            panel = getattr(param, "rich_help_panel", None) or "Options"
        panels.setdefault(panel, []).append((_names(param, ctx), _help_text(param)))
    if "Arguments" in panels:
        panels = {"Arguments": panels.pop("Arguments"), **panels}
    if hasattr(command, "list_commands"):
        rows = []
        for name in command.list_commands(ctx):
            cmd = command.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=200)))
        panels["Commands"] = rows
    _panels(console, panels)
    console.print(Text.from_markup(f"[bold]{' / '.join(ctx.help_option_names)}[/] this help · more: "
                                   f"[bold]ecache help[/] {'|'.join(TOPICS)}"))
    return "\n".join(line.rstrip() for line in buf.getvalue().rstrip("\n").split("\n")) + "\n"


# --- ecache help TOPIC -------------------------------------------------------------------------------------

#: ``ecache help TOPIC``: what does not fit an option's one line. Rich markup; kept in step with the README.
TOPICS: dict[str, tuple[str, str]] = {
    "decoding": ("Denoising steps, blocks, parallel decoding and Dream's options", """\
[bold]Canvas and blocks.[/] --gen-length positions are generated in blocks of --block-length, left to right
(semi-autoregressive); inside a block the denoising steps commit masked positions.

[bold]--steps[/]: total denoising steps; each block gets steps / blocks (default: gen-length, one token a
step). A profile's steps belong to its gen_length: with --gen-length given and --steps not, the steps keep
the profile's tokens per step (steps = --gen-length × profile steps / profile gen_length).
Under --threshold or --factor a block runs until it has no masks: with the llada schedule
--steps is then only checked (a multiple of the blocks, as Fast-dLLM does) and does not set the step
count; with the dream schedule it sets the per-step quota (block masks / steps, Fast-dLLM's Dream rule).

[bold]--threshold t[/] (Fast-dLLM parallel decoding): commit every block token with confidence ≥ t (e.g. 0.9),
at least one a step. [bold]--factor f[/]: Fast-dLLM's factor rule (e.g. 1.0).

[bold]--remasking[/]: which masks a step commits: low_confidence (LLaDA), random, topk_margin, entropy,
maskgit_plus (Dream's algs) or origin (Dream's: each mask revealed at random; dream schedule only).

[bold]--schedule[/]: tokens committed per step: llada (even split; Fast-dLLM's uncapped threshold rule),
dream (Dream's timesteps; Fast-dLLM's Dream threshold quota) or block (block-length / steps a step, the
block-diffusion families' rule; on LLaDA at fixed steps the same as llada). Default: the model family's.

[bold]--temperature[/] 0 = greedy; > 0 = Gumbel-max sampling in float64, with --top-k / --top-p (Dream's rule).
[bold]--alg-temp a[/] (Dream's alg_temp; dream schedule, fixed steps): draw each step's positions from
softmax(confidence / a) instead of the top-scoring ones.
[bold]--ban-eos[/] never commits EOS/EOT (LLaDA logits_eos_inf); [bold]--low-eos-confidence[/] gives them
confidence 0 (LLaDA confidence_eos_eot_inf); [bold]--early-exit[/] (on) stops a row once its answer ended.
[bold]--compat fastdllm[/] (Dream only): Fast-dLLM's Dream block sampler, which commits each block's first token
unchecked at its first step (a compatibility mode, not a default).

[bold]Block diffusion[/] (SDAR, LLaDA2.x): blocks are laid from the prompt's first token and decoded with the
family's official rule (schedule block): block-length / steps tokens a step, and with --threshold t every
mask strictly above t when there are at least that many (defaults: SDAR blocks of 4, t 0.85; LLaDA2
blocks of 32, t 0.95; --threshold 1 gives the static rule). [bold]--edit-threshold e[/] (LLaDA2.1's token
editing): a step also rewrites committed tokens of its block whose new prediction is above e; a block ends
after a mask-free step without an edit (at most max_post_steps, a profile key, 16).

Profile keys (decode:): gen_length, block_length, steps, temperature, top_k, top_p, remasking,
threshold, factor, ban_eos, low_eos_confidence, early_exit, schedule, compat, eps, alg_temp,
edit_threshold, max_post_steps."""),
    "cache": ("Cache policies, their parameters and ranges", """\
[bold]--cache[/] chooses the policy (default entropy). Parameters without a flag go in a profile's cache:
section (cache: {policy: dllm-cache, kr: 4}) or a --policies variant (ecache profile --policies
none,elastic:gamma=0.8). In a variant, key=none gives a parameter its default whatever the profile
set (entropy:block_tau=none: no block-start signal check).

  policy      parameters (range, default)
  none        (the baseline: a full forward every step)
  prefix      refresh_every (≥ 0, 0)            Fast-dLLM, block start → end
  dual        refresh_every (≥ 0, 0)            Fast-dLLM, the block only
  entropy     tau (≥ 0 nats, 1), recent_k (≥ 0, 64), signal, block_refresh,
              recent_steps (≥ 0, 0 = off), block_tau (≥ 0 nats, unset = off),
              refresh_prompt (true: a refresh recomputes the prompt too)
  dllm-cache  kp (≥ 1, 50), kr (≥ 1, 7), rho ([0, 1], 0.25), tol ([0, 2], 1e-3)
  dkv         refresh_every (≥ 1, 8)
  d2cache     current_k (≥ 1, 32), rollout_p ([0, 1], 0.1), sigma (> 0, 10),
              refresh_every (≥ 0, 0)
  elastic     gamma (cosine similarity, [0, 1], 0.9), window (≥ 0, 16),
              refresh_every (≥ 0, 0)
  es-dllm     alpha ([0, 1], 0.5), proportions (kept shares per stage,
              1,0.5,0.25), positions (depth fractions per stage, 0,0.125,0.25),
              prompt_update_freq (≥ 0, 0 = the block length), block_update_freq
              (≥ 0, 16), refresh_every (≥ 0, 0)
  es-dllm-conf  es-dllm's parameters with alpha 1 (confidence only)

[bold]--refresh-every N[/]: prefix, dual: a refresh every N steps inside each block besides its start (0 = block
starts only, 1 = every step; default 0); dkv: every N steps of a block (≥ 1, default 8); d2cache,
elastic: every N steps of the run (0 = never, the papers' rule). Steps are those actually run, so under
--threshold a block may end before its next refresh. Not used by none, entropy, dllm-cache.

[bold]--signal[/] (entropy): max-entropy (default), sum-entropy or max-confidence (1 − min probability).
A value outside its range is an error naming the value and the range, from a flag, a profile or a
--policies variant alike."""),
    "profiles": ("Profile files: where they are looked up and what they hold", """\
A profile is a YAML file (UTF-8, no key twice) with the sections model, task, decode, cache, measured,
note, and optionally compile (true: --compile) and sandbox (how code answers are isolated: --sandbox), e.g.

  model: tiny
  task: arith
  decode: {gen_length: 256, block_length: 32, steps: 256}
  cache: {policy: entropy, tau: 0.8, recent_k: 64}

cache: holds the keys of its own cache.policy (entropy when unset); a key of another policy, an unknown
key, an empty profile or a value out of range is an error naming it. Precedence: defaults < profile <
flags. [bold]--profile NAME[/] (or --task NAME) is looked up in ./profiles (or $ECACHE_PROFILES), then the user's
config folder (~/.config/ecache/profiles), then the profiles shipped in the package; without either,
the model's default.yaml is used when present. With --threshold or --factor, NAME-parallel.yaml
(default-parallel.yaml) comes first: τ calibrated under parallel decoding. [bold]ecache calibrate[/] writes
./profiles/<model>/<task>.yaml (<task>-parallel.yaml with --threshold or --factor)."""),
    "input": ("Prompts: arguments, stdin and --input JSONL records", """\
Prompts come as arguments, one per line on stdin, or as [bold]--input FILE.jsonl[/] records (- = stdin), one JSON
object a line with one of:

  {"prompt": "text"}                                  plain text
  {"messages": [{"role": "user", "content": "hi"}]}   a chat (roles below)
  {"prompt_ids": [1, 2, 3]}                           token ids, used as is

Chat roles: system, user, assistant; any other role is an error naming it.

Stdin is read only when no other source is given (arguments, --input, profile's and trace-drift's
--task; a lone - argument is stdin); piped data beside --task gets a warning that it is not read.
--input and --data take any readable path (a file, a named pipe, /dev/stdin, <(...)) or - (stdin).
Files and stdin must be UTF-8. Every record (and every stdin line, chat's too) is read and checked
before decoding starts, in every command: invalid ones stop the run (exit 2) naming file:line and
why, and so does an input with no record (empty stdin or file); generate's --skip-invalid decodes
the others and writes an error record for each.
--jsonl output records echo the input record's other fields."""),
    "outputs": ("Tables, JSON files and concurrent runs", """\
Tables are sized for an 80-column terminal: [bold]profile[/] and [bold]calibrate[/] show the columns that matter
(tokens/s, speedup, work, fidelity, score); [bold]--wide[/] shows every column (tables of the same rows,
stacked where they do not fit side by side); --json keeps every number. Results go to stdout, progress,
warnings and errors to stderr; a closed stdout (ecache profile ... | head -1) ends quietly with exit 0.

Output files (--json, --jsonl, --plot, calibrate's --run-file, which also guards its profile) are
checked before the model loads and locked while a command writes them: a second ecache process
given the same file fails at once (exit 1), naming the other process, instead of interleaving its
lines. An existing output file is replaced (as a shell's > does), except generate's --output and
calibrate's run file: refused unless --resume (exit 2), which continues them.

Progress: on a terminal one line redrawn in place; off it a plain line every $ECACHE_PROGRESS_INTERVAL
seconds (30). [bold]-q[/] leaves stderr to warnings, notes and errors (no start line, progress or status
lines).

Exit codes: 0 done, 1 runtime error (missing model or data, unreadable file, busy output), 2 usage
error (bad flag, value or profile, invalid or empty input), 130 interrupted (Ctrl-C), 143 stopped by SIGTERM (timeout, a
batch scheduler: the same partial outputs as Ctrl-C are written); ecache serve exits 0 on SIGTERM, its
way to stop (queued requests end with shutdown, running ones get --shutdown-grace)."""),
    "compile": ("--compile: the forward compiled per shape bucket", """\
[bold]--compile[/] (every command; profile key compile: true; --no-compile overrides) runs the
model's forward as a few compiled graphs, one per bucket: query positions and logits rows padded to
32, 64, 128, ... or the whole canvas (whose length is symbolic). On CPU: inductor's C++ code, any
number of rows, none padded. On GPU: CUDA graphs (torch.compile mode reduce-overhead), batch rows
padded to 1, 2, 4, 8, ... and the prompt width to 16, 24, 32, 48, 64, 96, ... (more left padding,
masked: no token changes). Rows joining or leaving reuse the graphs. At most 16 graphs; past that a forward pads
up to a compiled bucket that holds it, else it runs eager. Forwards with hooks (elastic, es-dllm,
d2cache's attention rows) run eager.

Compiling takes seconds to minutes per graph; it is reported apart (a stderr line, the manifest's
compile key in --json) and is in no time or tokens/s. The compiled code is cached in
~/.cache/ecache/inductor ($TORCHINDUCTOR_CACHE_DIR), so a second process starts faster. It needs a
C++ compiler on CPU (a C compiler for Triton on GPU): without one, a one-line error says what to
install."""),
}


def print_topic(console, text: str) -> None:
    """Print a topic's text on a rich ``console``: a paragraph whose lines start with two spaces (a table
    or an example) keeps its lines and columns, a line wider than the console wrapped under its second
    column (:func:`wrap_table_line`); any other paragraph is wrapped at the console's width."""
    from rich.text import Text

    for i, para in enumerate(text.strip("\n").split("\n\n")):
        if i:
            console.print()
        if para.startswith("  "):
            lines = [w for line in para.split("\n") for w in wrap_table_line(line, console.width)]
            console.print(Text.from_markup("\n".join(lines)), no_wrap=True, overflow="ignore", crop=False)
        else:
            console.print(Text.from_markup(" ".join(para.split())))


def wrap_table_line(line: str, width: int) -> list[str]:
    """``line`` of an indented topic paragraph as lines of at most ``width`` characters (one word longer
    than that stays whole). A row of columns (text after a run of two or more spaces past the indent)
    continues under its second column; when that column starts past half the width, the first column
    gets a line of its own and the rest follows 4 past the indent. A line without columns continues at
    its own indent. Spaces between columns are kept."""
    import re
    import textwrap

    if len(line) <= width:
        return [line]
    indent = len(line) - len(line.lstrip(" "))
    col = re.search(r"\S {2,}(?=\S)", line[indent:])

    def wrap(text: str, first: int, rest: int) -> list[str]:
        return textwrap.wrap(text, width, initial_indent=" " * first, subsequent_indent=" " * rest,
                             break_long_words=False, break_on_hyphens=False)

    if col is None:
        return wrap(line.strip(), indent, indent)
    hang = indent + col.end()
    if hang <= width // 2:
        return textwrap.wrap(line, width, subsequent_indent=" " * hang, break_long_words=False,
                             break_on_hyphens=False)
    return wrap(line[:indent + col.start() + 1].strip(), indent, indent + 4) + wrap(line[hang:], indent + 4,
                                                                                     indent + 4)


def topic_text(name: str | None) -> str:
    """The text of ``ecache help NAME`` (None: the list of topics). Raises UsageError for an unknown topic."""
    from .errors import UsageError

    if name is None:
        width = max(map(len, TOPICS))
        lines = [f"  {k.ljust(width)}  {v[0]}" for k, v in TOPICS.items()]
        return ("Topics (ecache help TOPIC), besides each command's --help:\n\n" + "\n".join(lines) + "\n")
    if name not in TOPICS:
        raise UsageError(f"{name!r} is not a help topic; use one of {', '.join(TOPICS)} (or run `ecache COMMAND -h`)")
    return TOPICS[name][1]
