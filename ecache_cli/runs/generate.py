"""``ecache generate``: cached generation over prompts from arguments, stdin or JSONL.

Results go to stdout (plain text, or one JSON record per prompt with ``--jsonl``) or, with
``--output FILE``, as JSON records to FILE; either way written and flushed record by record, in input
order. Progress goes to stderr (``runs/gen_progress.py``).

A record: ``index`` (0-based record index in the input), ``line`` (1-based line of stdin or the
``--input`` file, blank lines counted; the argument's position for prompt arguments), the prompt
field(s), ``id`` and ``input`` (see :func:`input_fields`), ``text``, ``token_ids`` (answer ids),
``ended``, ``mean_entropy`` (``runs/confidence.py``), ``stats`` (``Run.results``), ``settings``
(with ``profile``, ``tau`` and ``tau_source``), ``seed`` and ``model``. An invalid ``--input`` line
under ``--skip-invalid`` gets a record with ``error`` instead of the answer fields. Sampling is
batch-invariant: record i's random stream is derived from (``--seed``, i) alone.

``--input`` records are all read and checked before anything is decoded (``runs/gen_input.py``).
Under ``torchrun`` / ``accelerate launch`` (``ecache_cli/distributed.py``) the records to decode are
cut into batches in input order, and round by round each rank decodes one batch (batch c on rank
c % world, with the same seeds and row ids as one process); rank 0 gathers each round and writes
the records in input order, so the file is the one process's, and ``--resume`` works the same.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..engine.core import Engine
from .inputs import read_prompts
from .settings import Settings
from .streams import write_jsonl
from .confidence import EntropyMeter, threshold_for
from .gen_input import Item


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
    output: Path | None = None
    resume: bool = False
    skip_invalid: bool = False
    print0: bool = False


class _Sink:
    """Where records go: stdout (plain text or JSONL) or the ``--output`` file (JSONL)."""

    def __init__(self, out: IO, opts: GenerateOptions, file=None):
        self.out, self.opts, self.file = out, opts, file

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(record)
        elif self.opts.jsonl:
            write_jsonl(self.out, record)
        else:  # plain text: the answer, then a newline (NUL with --print0); an invalid record: empty
            self.out.write(record.get("text", "") + ("\0" if self.opts.print0 else "\n"))
            self.out.flush()


def run(lm, settings: Settings, opts: GenerateOptions, out: IO, err_console, dist=None) -> int:
    """Generate for every record; return the number of records decoded by this run. Raises
    EcacheError subclasses. ``dist``: this process's ``DistEnv`` (None: one process)."""
    from ..console import warn
    from ..distributed import DistEnv
    from ..errors import EcacheError
    from .gen_input import invalid_error, read_input
    from .gen_progress import Reporter

    dist = dist or DistEnv()
    engine = Engine.from_loaded(lm)
    chat = lm.chat if opts.chat is None else (opts.chat and lm.chat)
    settings_doc = json.loads(json.dumps(settings.as_dict()))  # as the records carry it (JSON types)
    common = {"settings": settings_doc, "seed": opts.seed, "model": lm.name}
    main = dist.is_main

    # the items: --input records, all read and checked first; else arguments or stdin lines
    if opts.input_file is not None:
        items: list[Item] | object = read_input(opts.input_file, engine, chat, settings.decode.gen_length)
        if not items:
            from .inputs import no_prompts

            raise no_prompts(opts.input_file)
        bad = [it for it in items if it.error is not None]
        if bad and not opts.skip_invalid:
            raise invalid_error(items, opts.input_file)
    else:
        stdin = sys.stdin if not opts.prompts and not sys.stdin.isatty() else None
        src = read_prompts(opts.prompts, None, stdin, lines=True)
        items = (Item(index=i, line=line, rec=rec, prompt=p) for i, (p, rec, line) in enumerate(src))
        if opts.output is not None or opts.prompts:  # a file to resume needs the whole input first
            items = list(items)
        bad = []

    skip, keep, file = set(), {}, None
    if opts.output is not None and main:
        from .gen_output import OutputFile

        file = OutputFile(opts.output, opts.resume, common)
        if isinstance(items, list) and items:
            skip, keep = file.plan(items, lambda it: input_fields(it.rec))
    if dist.active:  # every rank decodes the same missing records
        skip, kept = dist.all_gather_object((skip, set(keep)) if main else None, "the --output file's records")[0]
        if not main:
            keep = dict.fromkeys(kept)
    if isinstance(items, list) and not items:
        from .inputs import no_prompts

        raise no_prompts(opts.input_file)
    todo = None
    if isinstance(items, list):
        todo = sum(1 for it in items if it.error is None and it.index not in skip and it.index not in keep)
    if file is not None:
        if file.records or file.torn:
            err_console.print(f"resuming {opts.output}: {len(skip) + len(keep)} record(s) kept"
                              + (" (a torn last line dropped)" if file.torn else "") + f", {todo} to decode",
                              markup=False, highlight=False) if not opts.quiet else None
        file.open()
    sink = _Sink(out, opts, file)

    decoded: list[dict] = []
    queue: list[Item] = []  # items in input order whose record is not written yet
    results: dict[int, dict] = {}
    W = dist.world_size

    def emit() -> None:
        while queue:
            it = queue[0]
            if it.index in keep:
                rec = keep[it.index]
            elif it.error is not None:
                rec = {"index": it.index, "line": it.line, **input_fields(it.rec), "error": it.error, **common}
            elif it.index in results:
                rec = results.pop(it.index)
            else:
                return
            queue.pop(0)
            if main:
                sink.write(rec)

    def decode_round(batches: list[list[Item]], reporter) -> None:
        mine = [b for c, b in enumerate(batches) if c % W == dist.rank]
        got = []
        for batch in mine:
            got += _decode(engine, lm, settings, opts, batch, chat, common, reporter, err_console, main)
            if not dist.active:
                reporter.advance(len(batch))
        if dist.active:
            parts = dist.all_gather_object(got, "generated records")
            got = [r for part in parts for r in part]
            reporter.advance(len(got))
        for rec in got:
            results[rec["index"]] = rec
            decoded.append(rec)
        emit()

    failure = None
    try:
        with Reporter(err_console, todo, opts.quiet or not main, stream=opts.stream and not dist.active) as reporter:
            batch: list[Item] = []
            batches: list[list[Item]] = []
            source = iter(items)
            while True:
                try:
                    it = next(source)
                except StopIteration:
                    break
                except EcacheError as e:  # a bad stdin line: the prompts before it are still decoded
                    failure = e
                    break
                if it.index in skip:
                    continue
                queue.append(it)
                if it.error is None and it.index not in keep:
                    batch.append(it)
                    if len(batch) == opts.batch_size:
                        batches.append(batch)
                        batch = []
                        if len(batches) == W:
                            decode_round(batches, reporter)
                            batches = []
                elif not batch and not batches:
                    emit()
            if batch:
                batches.append(batch)
            if batches:
                decode_round(batches, reporter)
            emit()
    finally:
        if file is not None:
            file.close()
    if failure is not None:
        raise failure
    if not isinstance(items, list) and not decoded and not bad and not queue:
        from .inputs import no_prompts

        raise no_prompts(opts.input_file)
    if main:
        _warnings(lm, settings, opts, decoded, bad, warn)
    return len(decoded)


def _decode(engine, lm, settings, opts, batch: list[Item], chat: bool, common: dict, reporter, err_console,
            main: bool) -> list[dict]:
    """Decode one batch; return its records (input order)."""
    ids = engine.encode([it.prompt for it in batch], chat)
    first = batch[0].index
    # each row's random stream is (seed, its index in the input): batch-invariant sampling
    run_ = engine.start(ids, settings.decode, settings.policy(), seed=opts.seed, row_ids=[it.index for it in batch])
    meter = EntropyMeter(run_.B, run_.P, run_.G, run_.state.tokens.device)
    blocks = run_.blocks.num_blocks
    if opts.stream and main and not opts.quiet:
        _stream(run_, engine, err_console, batch, meter)
    else:
        for rec in run_:
            meter.observe(rec)
            reporter.step(first, len(batch), rec.block, blocks, rec.step)
    res = run_.results()
    ents = meter.means([r.stats["generated_tokens"] for r in res])
    return [{"index": it.index, "line": it.line, **input_fields(it.rec), "text": r.text, "token_ids": r.answer_ids,
             "ended": r.ended, "mean_entropy": e, "stats": r.stats, **common}
            for it, r, e in zip(batch, res, ents)]


def _warnings(lm, settings: Settings, opts: GenerateOptions, decoded: list[dict], bad: list[Item], warn) -> None:
    """The end-of-run warnings: invalid records skipped, cut answers, all answers empty, answers less
    confident than the model's own reference (``runs/confidence.py``)."""
    if bad:
        shown = ", ".join(str(it.line) for it in bad[:8]) + (", ..." if len(bad) > 8 else "")
        warn(f"{len(bad)} invalid record(s) skipped (line {shown}); their records carry the reason in 'error'")
    if not decoded:
        return
    cut = [r["line"] for r in decoded if not r["ended"]]
    where = "prompt" if opts.prompts else "input line"
    if cut:
        warn_cut(cut, len(decoded), settings.decode.gen_length, where)
    if all(not r["text"].strip() for r in decoded):
        warn(f"all {len(decoded)} answer(s) are empty: the model ended each answer at once; it may not know this "
             "kind of prompt (check --model, --chat/--no-chat, the prompt format)")
    p99 = threshold_for(lm)
    if p99 is not None:
        unsure = [r["line"] for r in decoded if r["mean_entropy"] is not None and r["mean_entropy"] > p99]
        if unsure:
            shown = ", ".join(map(str, unsure[:8])) + (", ..." if len(unsure) > 8 else "")
            warn(f"{len(unsure)} of {len(decoded)} answer(s) ({where} {shown}) have a mean entropy above {p99:g} nats, "
                 f"the 99th percentile of model {lm.name} on its own domains' test split: the model is unsure, the "
                 "answers are likely wrong (records: mean_entropy)")


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


def input_fields(rec) -> dict:
    """The part of a record that joins it back to its input record.

    Returns ``prompt`` / ``messages`` / ``prompt_ids`` as given (whichever the record has), ``id`` (the
    record's ``id``, None when it has none) and ``input``: every other field of the user's record,
    unchanged (an empty dict for prompt arguments, stdin lines and lines that are no JSON object). So
    no user field can collide with the output's own fields (``text``, ``stats``, ...).
    """
    rec = rec if isinstance(rec, dict) else {}
    out = {k: rec[k] for k in PROMPT_FIELDS if k in rec}
    out["id"] = rec.get("id")
    out["input"] = {k: v for k, v in rec.items() if k not in PROMPT_FIELDS and k != "id"}
    return out


def _stream(run_, engine: Engine, console, batch: list[Item], meter: EntropyMeter) -> None:
    """Consume the run's steps, showing the canvas of every row filling in live on stderr."""
    from rich.live import Live
    from rich.text import Text

    tok, spec = engine.tokenizer, engine.spec
    shown: dict[int, str] = {}  # every row of the batch, by its index in the input; finished rows stay
    with Live(console=console, refresh_per_second=12, transient=False) as live:
        for rec in run_:
            meter.observe(rec)
            st = run_.state
            canvas = st.tokens[:, run_.P:].tolist()  # (B_alive, G)
            for r, row in zip(st.rows.tolist(), canvas):
                text = "".join("░" if t == spec.mask_id else tok.decode([t], skip_special_tokens=True) for t in row)
                shown[batch[r].index] = f"[{batch[r].index}] step {st.step + 1}: " + text.rstrip()
            live.update(Text("\n".join(shown[i] for i in sorted(shown))))
