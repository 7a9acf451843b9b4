"""``ecache generate``: cached generation over prompts from arguments, stdin or JSONL.

Results go to stdout (plain text, or one JSON record per prompt with ``--jsonl``), written and
flushed prompt by prompt; progress and the live canvas go to stderr.

A ``--jsonl`` record: ``index`` (0-based prompt index in the input), ``line`` (1-based line of stdin or
the ``--input`` file, blank lines counted; the argument's position for prompt arguments), the prompt
field(s), ``id`` and ``input`` (see :func:`input_fields`), ``text``, ``token_ids`` (answer ids),
``ended``, ``stats`` (``Run.results``), ``settings``, ``seed`` and ``model``. Sampling is
batch-invariant: prompt i's random stream is derived from (``--seed``, i) alone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..engine.core import Engine
from .common import Settings, batched, read_prompts, write_jsonl


@dataclass
class GenerateOptions:
    """Non-decoding options of ``ecache generate``."""

    prompts: list[str]
    input_file: Path | None
    chat: bool | None
    jsonl: bool
    batch_size: int
    seed: int
    stream: bool
    quiet: bool


def run(lm, settings: Settings, opts: GenerateOptions, out: IO, err_console) -> int:
    """Generate for every prompt; return the number of prompts done. Raises EcacheError subclasses."""
    engine = Engine.from_loaded(lm)
    chat = lm.chat if opts.chat is None else (opts.chat and lm.chat)
    stdin = sys.stdin if not opts.prompts and opts.input_file is None and not sys.stdin.isatty() else None
    source = read_prompts(opts.prompts, opts.input_file, stdin, lines=True, check_ids=engine.check_prompt_ids)
    done, cut = 0, []
    for batch in batched(source, opts.batch_size):
        prompts = [p for p, _, _ in batch]
        # each row's random stream is (seed, its index in the input): batch-invariant sampling
        run_ = engine.start(engine.encode(prompts, chat), settings.decode, settings.policy(), seed=opts.seed,
                            row_ids=range(done, done + len(prompts)))
        _drive(run_, engine, opts, err_console, done, len(prompts))
        for (prompt, rec, line), res in zip(batch, run_.results()):
            if not res.ended:
                cut.append(line)
            if opts.jsonl:
                write_jsonl(out, {
                    "index": done + res.index, "line": line, **input_fields(rec),
                    "text": res.text, "token_ids": res.answer_ids, "ended": res.ended, "stats": res.stats,
                    "settings": settings.as_dict(), "seed": opts.seed, "model": lm.name,
                })
            else:
                out.write(res.text + "\n")
                out.flush()
        done += len(prompts)
    if done == 0:
        from .common import no_prompts

        raise no_prompts(opts.input_file)
    if cut:
        warn_cut(cut, done, settings.decode.gen_length, "prompt" if opts.prompts else "input line")
    return done


def warn_cut(lines: list, done: int, gen_length: int, where: str) -> None:
    """One stderr warning for the answers that filled the canvas without an end token: their text is
    what fit in ``gen_length`` tokens, likely cut. ``lines``: their ``line`` fields (1-based input line,
    or argument position), named by ``where``."""
    from ..console import warn

    shown = ", ".join(map(str, lines[:8])) + (", ..." if len(lines) > 8 else "")
    warn(f"{len(lines)} of {done} answer(s) did not end within --gen-length {gen_length} ({where} {shown}): "
         "the text may be cut; raise --gen-length")


#: Fields of an input record that say what to decode; they stay at the top of the output record.
PROMPT_FIELDS = ("prompt", "messages", "prompt_ids")


def input_fields(rec: dict) -> dict:
    """The part of a ``--jsonl`` output record that joins it back to its input record.

    Returns ``prompt`` / ``messages`` / ``prompt_ids`` as given (whichever the record has), ``id`` (the
    record's ``id``, None when it has none) and ``input``: every other field of the user's record,
    unchanged (an empty dict for prompt arguments and stdin lines). So no user field can collide with
    the output's own fields (``text``, ``stats``, ...).
    """
    rec = rec if isinstance(rec, dict) else {}
    out = {k: rec[k] for k in PROMPT_FIELDS if k in rec}
    out["id"] = rec.get("id")
    out["input"] = {k: v for k, v in rec.items() if k not in PROMPT_FIELDS and k != "id"}
    return out


def _drive(run_, engine: Engine, opts: GenerateOptions, console, done: int, n: int) -> None:
    """Consume the run's steps, showing progress (or the live canvas with ``--stream``) on stderr."""
    if opts.quiet or not console.is_terminal and not opts.stream:
        for _ in run_:
            pass
        return
    if opts.stream:
        from rich.live import Live
        from rich.text import Text

        tok, spec = engine.tokenizer, engine.spec
        shown: dict[int, str] = {}  # every row of the batch, by its index in the input; finished rows stay
        with Live(console=console, refresh_per_second=12, transient=False) as live:
            for _ in run_:
                st = run_.state
                canvas = st.tokens[:, run_.P:].tolist()  # (B_alive, G)
                for r, row in zip(st.rows.tolist(), canvas):
                    text = "".join("░" if t == spec.mask_id else tok.decode([t], skip_special_tokens=True) for t in row)
                    shown[done + r] = f"[{done + r}] step {st.step + 1}: " + text.rstrip()
                live.update(Text("\n".join(shown[i] for i in sorted(shown))))
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    total = run_.blocks.num_blocks
    with Progress(TextColumn("prompts {task.fields[rows]}"), BarColumn(), TextColumn("block {task.completed}/{task.total}"),
                  TextColumn("step {task.fields[step]}"), TimeElapsedColumn(), console=console, transient=True) as prog:
        task = prog.add_task("gen", total=total, rows=f"{done + 1}-{done + n}", step=0)
        for rec in run_:
            prog.update(task, completed=int(rec.block.min()), step=rec.step + 1)
