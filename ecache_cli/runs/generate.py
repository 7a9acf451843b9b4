"""``ecache generate``: cached generation over prompts from arguments, stdin or JSONL.

Results go to stdout (plain text, or one JSON record per prompt with ``--jsonl``), written and
flushed prompt by prompt; progress and the live canvas go to stderr.
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
    source = read_prompts(opts.prompts, opts.input_file, stdin)
    done = 0
    for batch in batched(source, opts.batch_size):
        prompts = [p for p, _ in batch]
        seed = opts.seed + done
        run_ = engine.start(engine.encode(prompts, chat), settings.decode, settings.policy(), seed=seed)
        _drive(run_, engine, opts, err_console, done, len(prompts))
        for (prompt, rec), res in zip(batch, run_.results()):
            if opts.jsonl:
                write_jsonl(out, {
                    "index": done + res.index, **{k: v for k, v in rec.items() if k not in ("text", "stats")},
                    "text": res.text, "token_ids": res.answer_ids, "ended": res.ended, "stats": res.stats,
                    "settings": settings.as_dict(), "seed": seed, "model": lm.name,
                })
            else:
                out.write(res.text + "\n")
                out.flush()
        done += len(prompts)
    if done == 0:
        from ..errors import UsageError

        raise UsageError("no prompt given: stdin was empty; pipe prompts one per line, pass them as arguments or use --input FILE.jsonl")
    return done


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
        with Live(console=console, refresh_per_second=12, transient=False) as live:
            for _ in run_:
                st = run_.state
                if st.batch == 0:
                    continue
                row = st.tokens[0, run_.P:].tolist()
                text = "".join("░" if t == spec.mask_id else tok.decode([t], skip_special_tokens=True) for t in row)
                live.update(Text(f"[{done + int(st.rows[0])}] step {st.step + 1}: " + text.rstrip()))
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    total = run_.plan.num_blocks
    with Progress(TextColumn("prompts {task.fields[rows]}"), BarColumn(), TextColumn("block {task.completed}/{task.total}"),
                  TextColumn("step {task.fields[step]}"), TimeElapsedColumn(), console=console, transient=True) as prog:
        task = prog.add_task("gen", total=total, rows=f"{done + 1}-{done + n}", step=0)
        for rec in run_:
            prog.update(task, completed=rec.block, step=rec.step + 1)
