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
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..engine.core import Engine
from .confidence import EntropyMeter, threshold_for
from .gen_input import Item
from .inputs import check_one_source, piped_stdin
from .settings import Settings
from .streams import write_jsonl


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
    watch: bool = False  # --watch: the first prompt's canvas live on stderr (runs/watch.py)
    watch_delay: float = 0.0  # --watch-delay: seconds per step of the live view
    items: list[Item] | None = None  # the input as read_first read it (None: read when the run starts)


def read_first(opts: GenerateOptions) -> list[Item]:
    """The run's input read and checked in full without the model, before it loads (README: an input
    error comes first and alone): ``--input`` records (an invalid one refused unless ``--skip-invalid``),
    else the prompt arguments or piped stdin. UsageError (exit 2) for invalid lines (``inputs.invalid_error``)
    and for a source with no prompt (``inputs.no_prompts``); DataError (exit 1) for one that cannot be read.
    The model's own checks (token ids, template, canvas) follow the load (``gen_input.check_items``)."""
    from .inputs import invalid_error, no_prompts, read_items, read_records

    if opts.input_file is not None:
        items = read_records(opts.input_file)
        if not items:
            raise no_prompts(opts.input_file)
        error = None if opts.skip_invalid else invalid_error(items, opts.input_file)
        if error is not None:
            raise error
        return items
    stdin = piped_stdin() if not opts.prompts else None
    items = read_items(opts.prompts, None, stdin)
    if not items:
        raise no_prompts(None)
    return items


def check_options(opts: GenerateOptions):
    """The generate flags that do not go together, checked before anything loads (one-line
    UsageErrors, exit 2). Returns the launcher's ranks (``distributed.from_environment``)."""
    from ..distributed import from_environment
    from ..errors import UsageError

    if opts.batch_size < 1:
        raise UsageError(f"--batch-size {opts.batch_size} must be ≥ 1")
    if opts.resume and opts.output is None:
        raise UsageError("--resume continues an --output FILE; pass --output FILE (the file an earlier run wrote)")
    if opts.output is not None and str(opts.output) == "-":
        raise UsageError("--output - : leave --output out to write to stdout (with --jsonl for records)")
    if opts.print0 and (opts.jsonl or opts.output is not None):
        raise UsageError("--print0 separates plain-text answers; --jsonl and --output write JSON records, one per line")
    check_watch(opts.watch, opts.watch_delay, quiet=opts.quiet, stream=opts.stream)
    if opts.watch_delay and not opts.watch:  # as a cache flag the policy does not take: warned, ignored
        from ..console import warn

        warn("--watch-delay is not used without --watch (it slows the live view); ignored")
    if opts.skip_invalid and opts.input_file is None:
        raise UsageError("--skip-invalid applies to --input records; prompt arguments and stdin lines are all read "
                         "and checked before any is decoded, and an invalid one stops the run (exit 2): fix it, "
                         "or pass the prompts as --input FILE.jsonl records")
    from ..outputs import check_distinct

    check_distinct([(opts.output, "--output")], [(opts.input_file, "--input")])
    ranks = from_environment()
    if ranks.active and opts.watch:
        raise UsageError(f"--watch shows one process's canvas; under {ranks.world_size} ranks leave it out (or run one "
                         "process)")
    if ranks.active and (opts.input_file is None or str(opts.input_file) == "-" or opts.output is None):
        raise UsageError(f"generate under {ranks.world_size} ranks needs --input FILE and --output FILE (rank 0 "
                         "writes every record to FILE, in input order); stdin and stdout are one process's")
    check_one_source(opts.prompts, opts.input_file)
    return ranks


def check_watch(watch: bool, delay: float, quiet: bool = False, stream: bool = False) -> None:
    """``--watch`` / ``--watch-delay`` (generate and chat): a delay ≥ 0 and finite, and no ``-q`` (which
    silences the stderr the view is drawn on) or ``--stream`` (another live view) beside ``--watch``;
    one-line UsageErrors."""
    from ..config import check_ranges
    from ..errors import UsageError

    check_ranges({"watch_delay": delay})  # NaN and ±inf too, in the flags' words
    if watch and quiet:
        raise UsageError("--watch draws the canvas on stderr and -q silences stderr; pass only one")
    if watch and stream:
        raise UsageError("--watch and --stream are both live views of the canvas; pass only one (--watch shows one "
                         "prompt with the cache's decisions, --stream every prompt of a batch)")


def check_task(task: str | None, profile: str | None) -> None:
    """``--task`` names a task and is not given beside ``--profile`` (both choose a profile; UsageError)."""
    if task is None:
        return
    from ..errors import UsageError
    from ..tasks import check_task_name

    check_task_name(task)
    if profile is not None:
        raise UsageError(f"--task {task} and --profile {profile} both choose a profile; pass only one")


def require_task_profile(settings: Settings, model: str, task: str | None) -> None:
    """``--task``: the settings came from the model's calibrated profile ``<model>/<task>.yaml`` (or,
    under parallel decoding, ``<task>-parallel.yaml``; with quantized weights those with the format after
    them, ``config.quantize_task``), else ConfigError naming the places looked in and the fix. A task the
    model's card says it was not trained on (the embedded model: arith, code, list) is not refused: as in
    every command (README), the run warns after the load (``confidence.warn_untrained``) and uses the
    settings without ``--task`` (a calibrated profile of that task, if one exists, still comes first)."""
    from ..config import mode_profile_names, mode_task, profile_candidates, quantize_task

    names = [n for t in (task, mode_task(task, True)) for n in (t, quantize_task(t, settings.quantize))] if task else []
    if task is None or (settings.profile is not None and Path(settings.profile).stem in names):
        return
    from ..errors import ConfigError
    from ..models.loader import local_folder
    from .confidence import trained_tasks

    local = local_folder(model)  # a hub model: not looked up here
    tasks = trained_tasks(local) if local is not None else None
    if tasks is not None and task not in tasks:  # one rule in every command: a warning after the load
        return  # (confidence.warn_untrained), and the settings without --task
    from .settings import recalibrate_command

    q = settings.quantize or "none"
    parallel = bool({"threshold", "factor"} & settings.decode_given)  # as resolve_settings looked: by the flags
    looked = [c for name in mode_profile_names(task, parallel, q) for c in profile_candidates(model, name)]
    wanted = {"task": mode_task(task, True), "decode": {"threshold": settings.decode.threshold}} if parallel \
        else {"task": task}  # the profile calibrate would write for this run
    raise ConfigError(f"--task {task}: no calibrated profile for model {model!r} (looked for "
                      f"{', '.join(map(str, looked))}); run `{recalibrate_command(model, wanted, q)}` or drop --task")


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


def run(lm, settings: Settings, opts: GenerateOptions, out: IO, err_console, dist=None, job_cls=None) -> int:
    """Generate for every record; return the number of records decoded by this run. Raises
    EcacheError subclasses. ``dist``: this process's ``DistEnv`` (None: one process); ``job_cls``: a
    ``_Job`` subclass that decodes elsewhere (``runs/ray_batch.py``)."""
    from ..console import warn
    from ..distributed import DistEnv
    from .inputs import no_prompts

    job = (job_cls or _Job)(lm, settings, opts, err_console, dist or DistEnv())
    items, bad = job.read_items()
    job.plan_output(items)
    if isinstance(items, list) and not items:
        raise no_prompts(opts.input_file)
    todo = job.count_todo(items) if isinstance(items, list) else None
    job.open_output(out, todo)
    failure = job.decode_all(items, todo)
    if failure is not None:
        raise failure
    if not isinstance(items, list) and not job.decoded and not bad and not job.queue:
        raise no_prompts(opts.input_file)
    if job.main:
        _warnings(lm, settings, opts, job.decoded, bad, warn)
    return len(job.decoded)


class _Job:
    """One generate run: the items to decode, the records kept from ``--output`` (``skip``: already
    in the file in input order; ``keep``: index → record to copy), and the records waiting to be
    written in input order (``queue``, with the decoded ones in ``results``)."""

    def __init__(self, lm, settings: Settings, opts: GenerateOptions, err_console, dist):
        self.lm, self.settings, self.opts, self.err_console, self.dist = lm, settings, opts, err_console, dist
        self.engine = Engine.from_loaded(lm)
        self.chat = lm.chat if opts.chat is None else (opts.chat and lm.chat)
        settings_doc = json.loads(json.dumps(settings.as_dict()))  # as the records carry it (JSON types)
        self.common = {"settings": settings_doc, "seed": opts.seed, "model": lm.name}
        self.main = dist.is_main
        from ..metrics.memory import MemoryProbe
        from .profile import weights_record

        self.probe, self.weights = MemoryProbe(self.engine.device), weights_record(lm.model)
        self.skip, self.keep, self.file, self.sink = set(), {}, None, None
        self.decoded: list[dict] = []
        self.queue: list[Item] = []  # items in input order whose record is not written yet
        self.results: dict[int, dict] = {}
        self.watched, self.watched_index = False, None  # --watch: the one batch shown, by its first index

    def read_items(self) -> tuple[list[Item], list[Item]]:
        """The items and the invalid ones, every one checked by the model before any is decoded
        (``gen_input.check_items``: token ids, template, canvas): ``--input`` records (the invalid ones
        refused, or with ``--skip-invalid`` returned to get their error records); arguments or stdin lines
        (an invalid one refused as profile and trace-drift refuse it, ``gen_input.check_prompts``)."""
        from .gen_input import check_items, check_prompts, invalid_error
        from .inputs import no_prompts

        opts = self.opts
        read = opts.items if opts.items is not None else read_first(opts)
        gen_length, block_length = self.settings.decode.gen_length, self.settings.decode.block_length
        if opts.input_file is not None:
            items = check_items(read, self.engine, self.chat, gen_length, block_length)
            if not items:
                raise no_prompts(opts.input_file)
            bad = [it for it in items if it.error is not None]
            if bad and not opts.skip_invalid:
                raise invalid_error(items, opts.input_file)
            return items, bad
        check_prompts(read, self.engine, self.chat, gen_length, block_length, None)
        return [Item(index=i, line=it.line, rec=it.rec, prompt=it.prompt, ids=it.ids) for i, it in enumerate(read)], []

    def plan_output(self, items) -> None:
        """Rank 0 opens the plan of ``--output``: which records it already holds; every rank then
        decodes the same missing records."""
        if self.opts.output is not None and self.main:
            from .gen_output import OutputFile

            self.file = OutputFile(self.opts.output, self.opts.resume, self.common)
            if isinstance(items, list) and items:
                self.skip, self.keep = self.file.plan(items, lambda it: input_fields(it.rec))
        if self.dist.active:
            shared = (self.skip, set(self.keep)) if self.main else None
            self.skip, kept = self.dist.all_gather_object(shared, "the --output file's records")[0]
            if not self.main:
                self.keep = dict.fromkeys(kept)

    def count_todo(self, items: list[Item]) -> int:
        """The valid items neither in the ``--output`` file nor kept from it."""
        return sum(1 for it in items if it.error is None and it.index not in self.skip and it.index not in self.keep)

    def open_output(self, out: IO, todo: int | None) -> None:
        """Say what a resumed ``--output`` keeps (stderr), open it, and set where records go."""
        file = self.file
        if file is not None:
            if (file.records or file.torn) and not self.opts.quiet:
                self.err_console.print(f"resuming {self.opts.output}: {len(self.skip) + len(self.keep)} record(s) kept"
                                       + (" (a torn last line dropped)" if file.torn else "") + f", {todo} to decode",
                                       markup=False, highlight=False)
            file.open()
        self.sink = _Sink(out, self.opts, file)

    def decode_all(self, items, todo: int | None):
        """Decode every item to decode, writing records in input order; return the error a bad stdin
        line raised (the prompts before it are decoded and written first), else None."""
        from .gen_progress import Reporter

        quiet = self.opts.quiet or not self.main
        try:
            live = (self.opts.stream or self.opts.watch) and not self.dist.active  # a live view: no progress bar
            with Reporter(self.err_console, todo, quiet, stream=live) as reporter:
                out = self.sink.out
                self.sink.out = reporter.stdout(out)  # on the progress line's terminal: above it
                try:
                    return self._feed(iter(items), reporter)
                finally:
                    self.sink.out = out
        finally:
            if self.file is not None:
                self.file.close()

    def _feed(self, source, reporter):
        """Cut the items into batches of ``--batch-size``; each round of ``world_size`` batches is
        decoded across the ranks (:meth:`_decode_round`)."""
        from ..errors import EcacheError

        failure, batch, batches = None, [], []
        while True:
            try:
                it = next(source)
            except StopIteration:
                break
            except EcacheError as e:  # a bad stdin line: the prompts before it are still decoded
                failure = e
                break
            if it.index in self.skip:
                continue
            self.queue.append(it)
            if it.error is None and it.index not in self.keep:
                batch.append(it)
                if len(batch) == self.opts.batch_size:
                    batches.append(batch)
                    batch = []
                    if len(batches) == self.dist.world_size:
                        self._decode_round(batches, reporter)
                        batches = []
            elif not batch and not batches:
                self._emit()
        if batch:
            batches.append(batch)
        if batches:
            self._decode_round(batches, reporter)
        self._emit()
        return failure

    def _decode_round(self, batches: list[list[Item]], reporter) -> None:
        """Batch c on rank c % world; the records of the round gathered on every rank, then written."""
        dist = self.dist
        mine = [b for c, b in enumerate(batches) if c % dist.world_size == dist.rank]
        got = []
        for batch in mine:
            got += self._decode(batch, reporter)
            if not dist.active:
                reporter.advance(len(batch))
        if dist.active:
            parts = dist.all_gather_object(got, "generated records")
            got = [r for part in parts for r in part]
            reporter.advance(len(got))
        for rec in got:
            self.results[rec["index"]] = rec
            self.decoded.append(rec)
        self._emit()

    def _decode(self, batch: list[Item], reporter) -> list[dict]:
        """Decode one batch; return its records (input order). ``--input`` items carry the token ids
        :func:`gen_input.read_input` encoded when it checked them; the others are encoded here."""
        engine, settings, opts = self.engine, self.settings, self.opts
        if all(it.ids is not None for it in batch):
            ids = [it.ids for it in batch]
        else:
            ids = engine.encode([it.prompt for it in batch], self.chat)
        first = batch[0].index
        self.probe.reset()
        # each row's random stream is (seed, its index in the input): batch-invariant sampling
        run_ = engine.start(ids, settings.decode, settings.policy(), seed=opts.seed,
                            row_ids=[it.index for it in batch])
        meter = EntropyMeter(run_.B, run_.P, run_.G, run_.state.tokens.device)
        blocks = run_.blocks.num_blocks
        if opts.watch and self.main and not self.watched:
            self.watched = True
            self._watch(run_, meter)
        elif opts.stream and self.main and not opts.quiet:
            _stream(run_, engine, self.err_console, batch, meter)
        else:
            for rec in run_:
                meter.observe(rec)
                reporter.step(first, len(batch), rec.block, blocks, rec.step)
        res = run_.results()
        peak = self.probe.peak_bytes()
        memory = {**self.weights, "peak_bytes": peak, "peak_growth_bytes": self.probe.growth_bytes(peak),
                  "peak_kind": self.probe.kind}  # the batch's peak (every record of a batch shares it)
        ents = meter.means([r.stats["generated_tokens"] for r in res])
        if self.watched and batch[0].index == self.watched_index:
            from .watch import stats_line

            self.err_console.print(stats_line(res[0].stats, self.err_console.width), markup=False, highlight=False)
        return [{"index": it.index, "line": it.line, **input_fields(it.rec), "text": r.text,
                 "token_ids": r.answer_ids, "ended": r.ended, "mean_entropy": e, "stats": r.stats, "memory": memory,
                 **self.common} for it, r, e in zip(batch, res, ents)]

    def _watch(self, run_, meter: EntropyMeter) -> None:
        """Decode ``run_`` showing its first row live (``runs/watch.py``)."""
        from .watch import WatchView

        self.watched_index = run_.ledger.row_ids[0]
        title = f"{self.lm.name} · cache {self.settings.cache}"
        view = WatchView(self.err_console, run_, row=0, title=title, delay=self.opts.watch_delay)
        for rec in view.follow():
            meter.observe(rec)

    def _emit(self) -> None:
        """Write the records at the head of the queue that are ready (rank 0), in input order."""
        while self.queue:
            it = self.queue[0]
            if it.index in self.keep:
                rec = self.keep[it.index]
            elif it.error is not None:
                rec = {"index": it.index, "line": it.line, **input_fields(it.rec), "error": it.error, **self.common}
            elif it.index in self.results:
                rec = self.results.pop(it.index)
            else:
                return
            self.queue.pop(0)
            if self.main:
                self.sink.write(rec)




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
        from .final_text import empty_reason

        why = empty_reason([not r["token_ids"] for r in decoded])  # token_ids: the answer's, up to its end
        warn(f"all {len(decoded)} answer(s) are empty: {why}; it may not know this kind of prompt (check --model, "
             "--chat/--no-chat, the prompt format)")
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
            canvas = st.tokens[:, run_.P:run_.P + run_.G].tolist()  # (B_alive, G): the answers' positions
            for r, row in zip(st.rows.tolist(), canvas):
                text = "".join("░" if t == spec.mask_id else tok.decode([t], skip_special_tokens=True) for t in row)
                shown[batch[r].index] = f"[{batch[r].index}] step {st.step + 1}: " + text.rstrip()
            live.update(Text("\n".join(shown[i] for i in sorted(shown))))
    if not console.is_terminal:  # off a terminal the last frame ends without a newline: end its line
        console.line()
