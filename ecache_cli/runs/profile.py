"""``ecache profile``: the same requests through several cache policies in one process, timed fairly.

Measurement protocol (``measure``):
- every policy decodes the same token ids with the same decoding settings and the same random stream
  per request (seed and request index, ``Engine.start`` row_ids);
- ``warmup`` runs per policy on the first batch come first and are excluded;
- then, for each repeat and each batch, every policy runs once, in an order rotated by one per batch
  and per repeat, so no policy always runs first (right after another policy's memory traffic) and
  slow drifts of the machine (thermal, other jobs) spread over all policies;
- nothing runs between engine steps; memory probes, scoring and progress updates happen between runs,
  outside the engine's clock; the engine syncs CUDA at the run's start and end and when a row
  finishes (``Run._now``), and times the step sections with CUDA events read once per block;
- ``tokens_computed`` (work %) counts what the forwards computed, padding included; ``tokens_planned``
  (planned work %) the plans' own positions, what each request would compute alone.
Numbers are computed by ``ecache_cli.metrics`` (throughput, fidelity, memory). With ``trace_dir``
each policy then decodes the first batch once more under torch.profiler (``runs/tracing.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..decoding.config import DecodeConfig
from ..distributed import DistEnv, aggregate_speed
from ..engine.core import Engine
from ..errors import UsageError
from ..metrics.fidelity import fidelity
from ..metrics.memory import MemoryProbe
from ..metrics.throughput import RowMeasure, RunMeasure, row_record, summarize, work_efficiency
from ..terminal import fit
from .inputs import piped_stdin, read_items
from .settings import Settings
from .streams import batched

BASELINE = "none"


@dataclass
class Request:
    """One prompt to profile; with a task, ``example`` is what its completion is scored against."""

    prompt: str | list
    example: object | None = None
    task: object | None = None
    item: object | None = None  # the inputs.Item it came from (prompt arguments, --input, stdin)
    records: list = field(default_factory=list)  # with a task: the examples whose text the prompt holds


@dataclass
class ProfileOptions:
    """Options of a profile run (besides model and decoding settings)."""

    policies: list[str]
    warmup: int = 1
    repeats: int = 1
    batch_size: int = 1
    seed: int = 0
    chat: bool | None = None
    trace_dir: Path | None = None
    input_file: Path | None = None  # --input, named by the errors of its records
    quiet: bool = False  # -q: nothing but warnings and errors on stderr (the profiler's own lines too)
    trace_steps: int | None = 32
    #: the model's family when it is known before loading (``settings.model_family``): the policies that
    #: do not apply to its attention are refused before the model loads, and only those that do are listed
    family: object | None = None

    def validate(self) -> None:
        """UsageError for a bad option: an empty or repeated ``--policies`` entry, a policy that is none or
        does not apply to ``family`` (:func:`check_policies_apply`), a count below its minimum. Every bad
        entry of ``--policies`` is named (:func:`check_policy_specs`), as a comma list's are."""
        if not self.policies:
            fits = _fitting(getattr(self.family, "block_causal", None))
            raise UsageError("--policies is empty; name at least one of " + ", ".join(fits))
        check_policy_specs(self.policies, self.family)
        seen: dict = {}  # a setting (name, parameters as parsed) -> the entry that names it
        for p in self.policies:
            name, params = parse_policy_spec(p, family=self.family)
            key = (name, tuple(sorted(params.items())))  # entropy:tau=1 is entropy:tau=1.0; order does not count
            if key in seen:
                same = "twice" if seen[key] == p else f"twice ({seen[key]} and {p} are the same setting)"
                raise UsageError(f"--policies {','.join(self.policies)} names a policy {same}; keep one")
            seen[key] = p
        minimums = (("--warmup", self.warmup, 0), ("--repeats", self.repeats, 1), ("--batch-size", self.batch_size, 1))
        for flag, v, lo in minimums:
            if v < lo:
                raise UsageError(f"{flag} {v} must be ≥ {lo}")
        if self.trace_steps is not None and self.trace_steps < 1:
            raise UsageError(f"--trace-steps {self.trace_steps} must be ≥ 1")
        if self.family is not None:
            check_policies_apply(self.policies, self.family.block_causal, self.family.name)


def check_policy_specs(specs: Sequence[str], family=None) -> None:
    """One UsageError naming every ``--policies`` entry that :func:`parse_policy_spec` refuses: the names that
    are no policy together (``--policies 'foo' and 'bar' are not cache policies; use one of …``, the policies
    that fit ``family``), then each other refusal in its own words."""
    from ..cache import POLICIES, unknown_policy
    from .comma_lists import and_list

    unknown, others = [], []
    for spec in specs:
        name = spec.split(":")[0]
        if name not in POLICIES:
            unknown.append(name)
            continue
        try:
            parse_policy_spec(spec, family=family)
        except UsageError as e:
            others.append(str(e))
    if not unknown and not others:
        return
    fits = _fitting(getattr(family, "block_causal", None))
    if len(unknown) == 1:
        others.insert(0, str(unknown_policy(unknown[0], "--policies", fits)))
    elif unknown:
        others.insert(0, f"--policies {and_list([repr(n) for n in unknown])} are not cache policies; use one of "
                         f"{', '.join(fits)}")
    raise UsageError("; ".join(others))


def _fitting(block_causal: bool | None) -> list[str]:
    """The policies for a model's attention (``block_causal``; None: not known, bidirectional's)."""
    from ..cache import policies_for

    return policies_for(bool(block_causal))


def check_policies_apply(specs: Sequence[str], block_causal: bool, family: str) -> None:
    """UsageError naming the first ``--policies`` entry that does not apply to a model of ``family`` whose
    attention is ``block_causal`` or not, with the policy's own reason and the policies that apply
    (``cache.base.CachePolicy.check_model``, which the engine applies to a ``--cache`` policy)."""
    from types import SimpleNamespace

    from ..cache import make_policy

    for spec in specs:
        name, params = parse_policy_spec(spec)
        try:
            make_policy(name, **params).check_model(SimpleNamespace(block_causal=block_causal, family=family))
        except UsageError as e:
            msg = str(e)
            raise UsageError(f"--policies {spec} {msg.removeprefix(f'--cache {name} ')}"
                             if msg.startswith(f"--cache {name} ") else f"--policies {spec}: {msg}") from None


def parse_policy_spec(spec: str, where: str = "--policies", family=None) -> tuple[str, dict]:
    """``name`` or ``name:key=value:key=value`` (e.g. ``entropy:tau=2.5:recent_k=16``) -> (name, params).

    Values are read as int, float, true/false, else kept as strings; ``none`` reads as None, which
    gives the parameter the policy's own default whatever the profile or flags set (e.g.
    ``entropy:block_tau=none``: no block-start signal check). A spec's parameters override the resolved
    cache settings for that entry only, so one run can compare variants of one policy.
    Raises UsageError for an unknown policy or parameter, a malformed ``key=value`` or a key given twice,
    naming ``where`` the spec was given (``--policies``; ``/cache`` in ``ecache chat``); an unknown name's
    error lists the policies that apply to ``family`` (a ``models.family.Family`` or a ``ModelSpec``: its
    ``block_causal``) when it is known, else those for bidirectional attention, as ``--cache``'s error does
    (the embedded model's and a repository id's family is known only once loaded).
    """
    from ..cache import POLICIES, make_policy, unknown_policy

    name, *pairs = spec.split(":")
    if name not in POLICIES:  # an unknown family: bidirectional's policies, as --cache's
        raise unknown_policy(name, where, _fitting(getattr(family, "block_causal", None)))
    from ..config import GivenFloat

    params, typed = {}, {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise UsageError(f"{where} {spec!r}: write parameters as name:key=value (e.g. entropy:tau=2.5)")
        param = key.replace("-", "_")
        if param in params:  # as a profile refuses a key given twice: no silent "last wins"
            raise UsageError(f"{where} {spec!r}: parameter {key} given twice; keep one {key}=value")
        params[param] = _scalar(value)
        # checked as typed, so a refusal names the text (tau=1e400, not inf; refresh_every=1e2, not 100.0)
        typed[param] = GivenFloat(value) if isinstance(params[param], float) else params[param]
    try:
        make_policy(name, strict=True, **typed)  # unknown parameter or bad value -> UsageError
    except UsageError as e:
        raise UsageError(f"{where} {spec!r}: {e}") from None
    return name, params


def _scalar(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


@dataclass
class ProfileReport:
    """Everything a profile run measured: per-policy summaries (``metrics.throughput.summarize`` plus
    fidelity against ``none`` and the policy's parameters), the runs, and the trace files."""

    policies: list[str]
    summaries: dict[str, dict]
    runs: dict[str, list[RunMeasure]]
    memory_kind: str
    decode: DecodeConfig
    trace: dict | None = None
    extra: dict = field(default_factory=dict)
    incomplete: bool = False  # interrupted (Ctrl-C): only the batches every policy finished

    @property
    def prompts_done(self) -> int:
        """Distinct prompts measured (every policy has the same ones)."""
        return len({row.prompt for run in next(iter(self.runs.values()), []) for row in run.rows})

    def to_dict(self, manifest: dict | None = None) -> dict:
        """JSON-ready: manifest, per-policy numbers, and one record per measured request."""
        requests = [row_record(p, row) for p in self.policies for run in self.runs[p] for row in run.rows]
        return {"command": "profile", "incomplete": self.incomplete, "manifest": manifest,
                "memory_kind": self.memory_kind,
                "decode": self.decode.as_dict(), "policies": self.summaries, **self.extra,
                "trace": self.trace, "requests": requests}


def task_requests(task, limit: int, shots: int, seed: int, split: str = "test") -> list[Request]:
    """``limit`` examples of ``task`` as requests (``shots`` solved examples before each question)."""
    if limit < 1:
        raise UsageError(f"--limit {limit} must be ≥ 1")
    if shots < 0:
        raise UsageError(f"--shots {shots} must be ≥ 0")
    examples = task.examples(split, limit, seed)
    return [Request(task.prompt(ex, shots, seed), ex, task, records=task.prompt_examples(ex, shots, seed))
            for ex in examples]


def prompt_requests(args: list[str] | None, input_file: Path | None, stdin, limit: int | None = None) -> list[Request]:
    """Requests from arguments, a JSONL file or stdin (``runs.inputs.read_items``: every line read and
    checked first), the first ``limit``. UsageError (exit 2) naming every one of them that is invalid
    without the model (``inputs.invalid_error``), so the command refuses it before the load; the model's
    checks come after it (``_check_requests``)."""
    from .inputs import FIX, invalid_error, source_head

    items = read_items(args, input_file, stdin, raise_invalid=False)[:limit]
    head, what = source_head(items, input_file)
    error = invalid_error(items, head, what=what, fix=FIX)
    if error is not None:
        raise error
    return [Request(it.prompt, item=it) for it in items]


def policy_names(policies: str | None, model: str | None = None) -> list[str]:
    """The entries of ``--policies`` (comma-separated); None: every policy that applies to ``model``'s
    attention when its family is known before loading (``settings.model_family``; block diffusion: none
    and block), else every policy for bidirectional attention. UsageError as :func:`comma_lists.parse_list`
    (nothing named, an empty entry, an entry given twice)."""
    from .comma_lists import parse_list
    from .settings import model_family

    if policies is not None:
        return parse_list(policies, "--policies", example="none,dual,entropy")
    fam = model_family(model)
    return _fitting(fam is not None and fam.block_causal)


def check_sources(prompts: list[str] | None, input_file: Path | None, task: str | None, data: str | None,
                  shots: int | None, limit: int | None) -> None:
    """The prompts come one way: ``--task`` (with ``--data``, ``--shots``), prompt arguments, or
    ``--input`` / stdin (``--limit`` takes the first N of those). UsageError otherwise, and for a
    ``--task`` that is none (``tasks.check_task_name``). Stdin is read only when no other source is given
    (piped data beside ``--task`` is a warning: ``inputs.warn_unread_stdin``)."""
    from ..tasks import check_task_name
    from .inputs import check_prompt_sources

    if task is not None:
        check_task_name(task)
    check_prompt_sources(prompts, input_file, task, data, shots)
    if limit is not None and prompts:
        raise UsageError(f"--limit {limit} with prompt arguments: --limit takes the first N of --task, --input or "
                         "stdin; pass the prompt arguments you want instead")


def task_setup(task: str, data: str | None, shots: int | None, limit: int | None, seed: int,
               allow_code_execution: bool) -> tuple[object, list[Request], dict]:
    """``--task``: the task object, its requests (``limit`` examples, 8 when None; ``shots`` solved
    examples, the task's default when None) and what the JSON says of it (``scored``: False for a
    code task without ``--allow-code-execution``, whose scorer runs the code). Piped stdin is not read
    (a warning when it holds data: ``inputs.warn_unread_stdin``)."""
    from ..tasks import get_task
    from .inputs import warn_unread_stdin

    task_obj = get_task(task, data=data, allow_code_execution=allow_code_execution)
    n_shots = task_obj.default_shots if shots is None else shots
    requests = task_requests(task_obj, 8 if limit is None else limit, n_shots, seed)
    warn_unread_stdin(None, None, task, data)
    info = {"name": task, "data": data, "shots": n_shots, "limit": len(requests), "split": "test",
            "scored": task_obj.can_score}
    return task_obj, requests, info


def input_requests(prompts: list[str] | None, input_file: Path | None, limit: int | None) -> list[Request]:
    """Requests from prompt arguments, ``--input`` or stdin (when piped, and only without the others), at
    most ``limit``; the error of :func:`inputs.no_prompts` when the source gave none."""

    from .inputs import no_prompts

    stdin = piped_stdin() if not prompts and input_file is None else None
    requests = prompt_requests(list(prompts or []), input_file, stdin, limit)
    if not requests:
        raise no_prompts(input_file)
    return requests


def run_profile(lm, settings: Settings, requests: Sequence[Request], opts: ProfileOptions, on_run=None,
                dist: DistEnv | None = None, task_info: dict | None = None,
                hold=None) -> tuple[ProfileReport | None, bool]:
    """:func:`measure` (``hold`` passed on) on the loaded model, the chat template applied when ``opts.chat``
    allows and the model has one. Returns (the report with ``task``, ``world_size`` and ``prompts_done`` in its
    ``extra``, or None on ranks other than 0; whether the chat template was applied)."""
    dist = dist or DistEnv()
    engine = Engine.from_loaded(lm)
    check_policies_apply(opts.policies, lm.spec.block_causal, lm.spec.family)  # a family known only now
    use_chat = lm.chat if opts.chat is None else (opts.chat and lm.chat)
    _check_requests(requests, engine, use_chat, settings.decode, opts.input_file)
    report = measure(engine, settings, requests, opts, chat=use_chat, on_run=on_run, dist=dist, hold=hold)
    if report is not None:
        report.extra["task"] = task_info
        report.extra["world_size"] = dist.world_size
        report.extra["prompts_done"] = report.prompts_done  # all of them unless interrupted
    return report, use_chat


def compare_quantized(report: ProfileReport, reference: ProfileReport) -> dict[str, dict]:
    """Per policy, a quantized run (``report``) against the same policy on the unquantized weights
    (``reference``, the same prompts and seed): ``speedup`` (tokens/s over the reference's), ``latency_speedup``
    (the reference's mean latency over this one's), ``identical_share`` and ``token_agreement`` of the answers
    (``metrics.fidelity``), ``score`` and ``score_unquantized`` (None without a scored task), and both
    tokens/s. ``profile --compare-quantize`` (README "Quantized weights")."""
    from ..metrics.fidelity import fidelity

    out = {}
    for p in report.policies:
        q, ref = report.summaries[p], reference.summaries[p]
        rows = [r for run in report.runs[p] for r in run.rows]
        ref_rows = [r for run in reference.runs[p] for r in run.rows]
        fid = fidelity(rows, ref_rows)
        out[p] = {"tokens_per_s": q["tokens_per_s"], "tokens_per_s_unquantized": ref["tokens_per_s"],
                  "speedup": q["tokens_per_s"] / ref["tokens_per_s"] if ref["tokens_per_s"] else None,
                  "latency_speedup": ref["mean_ms"] / q["mean_ms"] if q.get("mean_ms") else None,
                  "identical_share": fid["identical_share"], "token_agreement": fid["token_agreement"],
                  "score": q.get("score"), "score_unquantized": ref.get("score")}
    return out


def compare_with_unquantized(report: ProfileReport, lm, settings: Settings, requests: Sequence[Request],
                             opts: ProfileOptions) -> dict[str, dict]:
    """Load ``lm``'s checkpoint again with its weights as stored (beside the quantized model), run the same
    policies, prompts and seed on it and return :func:`compare_quantized` of ``report`` against that run."""
    from ..models.loader import load_model

    reference = load_model(str(lm.path), lm.device, lm.dtype, force=True)
    ref_report, _ = run_profile(reference, settings, requests, opts, None, None, report.extra.get("task"))
    return compare_quantized(report, ref_report)


def render_comparison(comparison: dict[str, dict], fmt: str):
    """``--compare-quantize``'s table: per policy, ``fmt`` weights against unquantized ones (the JSON
    document has every number, e.g. both tokens/s and the latency speedup)."""
    from rich.table import Table

    t = Table(title=f"{fmt} weights vs unquantized (same policy, prompts and seed)", title_justify="left",
              caption="speedup: tok/s over the unquantized weights'; identical / agree: answers vs theirs",
              caption_justify="left")
    t.add_column("policy", overflow="fold", min_width=8)
    for h in ("tok/s", "speedup", "identical\n%", "agree\n%", "score", "unquant.\nscore"):
        t.add_column(h, justify="right", no_wrap=True)
    for p, c in comparison.items():
        t.add_row(p, cell(c["tokens_per_s"], "num"), cell(c["speedup"], "{:.2f}×"), cell(c["identical_share"], "pct"),
                  cell(c["token_agreement"], "pct"), cell(c["score"], "pct"), cell(c["score_unquantized"], "pct"))
    return fit(t)


def _check_requests(requests: Sequence[Request], engine, chat: bool, decode, input_file) -> None:
    """Every request read from the input checked by the model before any is decoded
    (``gen_input.check_prompts``: UsageError naming each prompt it cannot decode); a task's prompts the
    same way, each naming its record (``gen_input.encode_task_prompts``)."""
    from .gen_input import check_prompts, encode_task_prompts

    tasked = [r for r in requests if r.records]
    encode_task_prompts(engine, [r.prompt for r in tasked], [r.records for r in tasked], chat)
    items = [r.item for r in requests if r.item is not None]
    if items:
        check_prompts(items, engine, chat, decode.gen_length, decode.block_length, input_file)
        for r in requests:
            if r.item is not None:
                r.prompt = r.item.prompt


def empty_answers(report: ProfileReport) -> tuple[int, str]:
    """The number of runs' answers when every one is empty text, else 0, and why (``final_text.empty_reason``:
    an answer with no token before its end marker ended at once)."""
    from .final_text import empty_reason

    rows = [row for p in report.policies for run in report.runs[p] for row in run.rows]
    if not rows or any(row.text.strip() for row in rows):
        return 0, ""
    return len(rows), empty_reason([not row.answer_ids for row in rows])


def profile_document(report: ProfileReport, lm, settings: Settings, opts: ProfileOptions, chat: bool,
                     task_info: dict | None, n_prompts: int) -> dict:
    """The ``--json`` document: the report (:meth:`ProfileReport.to_dict`) with a manifest holding the
    run's options."""
    from .manifest import manifest

    extra = {"command": "profile", "policies": opts.policies, "warmup": opts.warmup, "repeats": opts.repeats,
             "batch_size": opts.batch_size, "chat": chat, "trace_dir": str(opts.trace_dir) if opts.trace_dir else None,
             "trace_steps": opts.trace_steps, "task": task_info, "prompts": n_prompts,
             "memory_kind": report.memory_kind,
             "policy_params": {p: report.summaries[p]["params"] for p in opts.policies}}
    return report.to_dict(manifest(lm, settings, opts.seed, extra))


def measure(engine: Engine, settings: Settings, requests: Sequence[Request], opts: ProfileOptions,
            chat: bool = True, on_run: Callable[[str, str], None] | None = None,
            dist: DistEnv | None = None, hold=None) -> ProfileReport | None:
    """Decode ``requests`` under every policy of ``opts`` (protocol in the module docstring).

    ``on_run(kind, policy)`` is called before each run (kind: "warmup", "measure", "trace"), outside
    the timed region (progress display). Returns the report; raises EcacheError subclasses.

    ``dist`` (``ecache_cli.distributed``, several ranks): each rank decodes its round-robin share of the
    batches (same batches, seeds and row ids as one process, so the same tokens) and warms up on its
    own first batch; rank 0 gathers every run and returns the report (other ranks return None), with
    tokens/s and speedups over the slowest rank's wall time (``merge_ranks``). Traces: rank 0 only.

    ``hold`` (one process, no ``--trace-dir``): an ``interrupts.HeldInterrupts`` started as the timed runs
    end, so a Ctrl-C or SIGTERM while they are summed up waits until the caller has written ``--json``.
    """
    opts.validate()
    if not requests:
        raise UsageError("no prompts to profile: pass prompts as arguments, on stdin, as --input FILE.jsonl "
                         "or --task NAME")
    bench = _Bench(engine, settings, requests, opts, chat, on_run)
    dist = dist or DistEnv()
    runs, incomplete = bench.timed_runs(dist)
    if hold is not None and not dist.active and opts.trace_dir is None:  # traces: a decode Ctrl-C stops at once
        hold.start()
    runs, rank_speed = merge_ranks(dist, runs)
    if runs is None:  # not rank 0: its runs are on rank 0 now
        return None
    summaries = bench.summaries(runs)
    if dist.active:
        apply_rank_speed(summaries, rank_speed, opts.policies)
    trace = bench.traces() if opts.trace_dir is not None and not incomplete else None
    return ProfileReport(policies=opts.policies, summaries=summaries, runs=runs, memory_kind=bench.probe.kind,
                         decode=settings.decode, trace=trace, incomplete=incomplete)


class _Bench:
    """The requests encoded once and cut into batches (lists of request indices), decoded under each
    policy of ``opts`` with the memory probe reset around every run."""

    def __init__(self, engine: Engine, settings: Settings, requests: Sequence[Request], opts: ProfileOptions,
                 chat: bool, on_run: Callable[[str, str], None] | None):
        self.engine, self.settings, self.requests, self.opts, self.on_run = engine, settings, requests, opts, on_run
        self.ids = engine.encode([r.prompt for r in requests], chat)
        self.batches = list(batched(range(len(requests)), opts.batch_size))
        self.probe = MemoryProbe(engine.device)
        self.weights = weights_record(engine.model)

    def make(self, spec: str):
        """A fresh policy object for a ``--policies`` entry such as ``entropy:tau=2.5``."""
        name, params = parse_policy_spec(spec)
        return self.settings.policy(name, **params)

    def _announce(self, kind: str, policy: str) -> None:
        if self.on_run:
            self.on_run(kind, policy)

    def timed_runs(self, dist: DistEnv) -> tuple[dict[str, list[RunMeasure]], bool]:
        """Warm-up runs, then ``repeats`` passes over this rank's batches, each batch under every policy
        in rotated order (each policy takes its turn first). Returns the runs per policy and whether a
        Ctrl-C cut them short: then only the batches every policy finished are kept (the same prompts
        for each, so the comparison holds); one process only (ranks stop together through the launcher)."""
        names, opts = self.opts.policies, self.opts
        runs: dict[str, list[RunMeasure]] = {p: [] for p in names}
        mine = dist.shard(range(len(self.batches)))  # this rank's batch indices (all of them for one process)
        try:
            for _ in range(opts.warmup):
                for p in names:
                    self._announce("warmup", p)
                    self.one(p, mine[0] if mine else 0, -1)
            for repeat in range(opts.repeats):
                for b in mine:
                    k = (b + repeat) % len(names)
                    for p in names[k:] + names[:k]:
                        self._announce("measure", p)
                        runs[p].append(self.one(p, b, repeat))
        except KeyboardInterrupt:
            done = min(len(r) for r in runs.values())
            if dist.active or done == 0:
                raise
            return {p: r[:done] for p, r in runs.items()}, True
        return runs, False

    def one(self, policy: str, b: int, repeat: int) -> RunMeasure:
        """Decode batch ``b`` under ``policy`` (``repeat`` -1: a warm-up) and measure it."""
        idx = self.batches[b]
        self.probe.reset()
        run = self.engine.start([self.ids[i] for i in idx], self.settings.decode, self.make(policy),
                                seed=self.opts.seed, row_ids=idx)
        for _ in run:  # nothing between steps; the step timings are the run's totals (CUDA: events, per block)
            pass
        peak = self.probe.peak_bytes()
        growth = self.probe.growth_bytes(peak)
        rows = [self._row(run, res, idx, repeat) for res in run.results()]
        return RunMeasure(policy=policy, wall_s=run.wall_s, forward_s=run.timer.forward_s,
                          decision_s=run.timer.decision_s,
                          sampling_s=run.timer.sampling_s, steps=run.steps_done, rows=rows, peak_memory_bytes=peak,
                          batch_size=len(idx), peak_growth_bytes=growth)

    def _row(self, run, res, idx: list[int], repeat: int) -> RowMeasure:
        """One row's measures; scored when its request has a task whose scorer may run, except in a warm-up
        (``repeat`` -1: its rows are dropped, so a code task's model-written program is not run for them)."""
        req, s = self.requests[idx[res.index]], res.stats
        score = None
        if req.task is not None and req.task.can_score and repeat >= 0:
            score = float(req.task.score(req.example, res.text))
        return RowMeasure(prompt=idx[res.index], repeat=repeat, generated_tokens=s["generated_tokens"],
                          latency_s=s["wall_s"], nfe=s["nfe"], full_forwards=s["full_forwards"],
                          partial_forwards=s["partial_forwards"], tokens_computed=s["tokens_computed"],
                          tokens_planned=s["tokens_planned"],
                          canvas=run.P + run.width, token_ids=res.token_ids, answer_ids=res.answer_ids,
                          text=res.text, score=score)

    def summaries(self, runs: dict[str, list[RunMeasure]]) -> dict[str, dict]:
        """Per policy: ``summarize`` against the baseline, fidelity to it (None without a baseline)
        and the policy's resolved parameters."""
        out = {}
        base = runs.get(BASELINE)
        base_rows = [r for run in base for r in run.rows] if base else []
        for p in self.opts.policies:
            s = summarize(runs[p], base)
            rows = [r for run in runs[p] for r in run.rows]
            s.update({f"fidelity_{k}": v for k, v in fidelity(rows, base_rows).items()} if base else
                     {"fidelity_identical_share": None, "fidelity_token_agreement": None, "fidelity_pairs": 0})
            s["params"] = self.make(p).params()
            s.update(self.weights)
            out[p] = s
        return out

    def traces(self) -> dict:
        """A torch.profiler trace of the first batch per policy under ``opts.trace_dir``."""
        from .tracing import trace_run

        opts, first = self.opts, self.batches[0]
        trace = {"dir": str(opts.trace_dir), "steps": opts.trace_steps, "policies": {}}
        for p in opts.policies:
            self._announce("trace", p)
            run = self.engine.start([self.ids[i] for i in first], self.settings.decode, self.make(p), seed=opts.seed,
                                    row_ids=first)
            trace["policies"][p] = trace_run(run, Path(opts.trace_dir), p.replace(":", "_").replace("=", "-"),
                                             opts.trace_steps)
        return trace


def merge_ranks(dist: DistEnv, runs: dict[str, list[RunMeasure]]):
    """Gather every rank's runs on rank 0: (runs per policy in (repeat, first prompt) order, per-policy
    list of per-rank {generated_tokens, wall_s}); (None, None) on the other ranks. One process: unchanged."""
    if not dist.active:
        return runs, None
    parts = dist.all_gather_object(runs, "profile runs")
    if not dist.is_main:
        return None, None
    merged = {p: sorted((r for part in parts for r in part[p]), key=lambda r: (r.rows[0].repeat, r.rows[0].prompt))
              for p in runs}
    speed = {p: [{"generated_tokens": sum(row.generated_tokens for r in part[p] for row in r.rows),
                  "wall_s": sum(r.wall_s for r in part[p])} for part in parts] for p in runs}
    return merged, speed


def apply_rank_speed(summaries: dict[str, dict], rank_speed: dict[str, list[dict]], names: list[str]) -> None:
    """Ranks ran side by side: tokens/s = all generated tokens over the slowest rank's wall time
    (``distributed.aggregate_speed``), and the speedup over ``none`` is the ratio of those figures."""
    for p in names:
        agg = aggregate_speed(rank_speed[p])
        summaries[p].update(wall_s=agg["wall_s"], tokens_per_s=agg["tokens_per_s"], ranks=agg["ranks"],
                            world_size=agg["world_size"])
    if BASELINE in summaries:
        base = summaries[BASELINE]["tokens_per_s"]
        for p in names:
            summaries[p]["speedup_vs_none"] = summaries[p]["tokens_per_s"] / base if base else None
            summaries[p]["work_efficiency"] = work_efficiency(summaries[p])


# --- rendering ------------------------------------------------------------------------------------

COLUMNS = [  # (header, summary key, format, in the default view)
    ("policy", None, None, True),
    ("tok/s", "tokens_per_s", "num", True),
    ("speedup\nvs none", "speedup_vs_none", "{:.2f}×", True),
    ("latency\nspeedup", "latency_speedup_vs_none", "{:.2f}×", False),
    ("latency ms\nmean", "mean_ms", "{:.0f}", False),
    ("p50", "p50_ms", "{:.0f}", False),
    ("p95", "p95_ms", "{:.0f}", False),
    ("NFE\n/req", "nfe_per_request", "num", True),
    ("TPF", "tokens_per_forward", "{:.2f}", False),
    ("full\n/req", "full_forwards_per_request", "{:.1f}", False),
    ("partial\n/req", "partial_forwards_per_request", "{:.1f}", False),
    ("work %\nof none", "work_share_vs_none", "pct", True),
    ("planned\nwork %", "planned_work_share_vs_none", "pct", False),
    ("work\nefficiency", "work_efficiency", "{:.2f}", False),
    ("work %\n/forward", "work_share_per_forward", "pct", False),
    ("decision\n% time", "decision_overhead_pct", "{:.2f}", False),
    ("weights\nMiB", "weight_bytes", "mib1", False),
    ("peak mem\nMiB", "peak_memory_bytes", "mib", False),
    ("run mem\nMiB", "peak_growth_bytes", "mib1", False),
    ("identical\n%", "fidelity_identical_share", "pct", True),
    ("token\nagree %", "fidelity_token_agreement", "pct", True),
    ("score", "score", "{:.3f}", True),
]


def cell(value, fmt: str | None) -> str:
    """Format one table cell; None (not measured / no baseline) shows as an en dash."""
    if value is None:
        return "–"
    if fmt == "pct":
        return f"{100 * value:.1f}"
    if fmt == "mib":
        return f"{value / 2**20:.0f}"
    if fmt == "mib1":
        return f"{value / 2**20:.1f}"
    if fmt == "num":  # a tenth matters below 100, not above (keeps the 80-column view narrow; --json has all)
        return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"
    return fmt.format(value)


def render_table(report: ProfileReport, title: str | None = None, wide: bool = False):
    """A rich Table, one row per policy. The default view (sized for 80 columns): tokens/s, speedup,
    NFE, work share, identical and token-agreement shares vs none, and the score (with a task);
    ``wide``: every column of ``COLUMNS`` (latency, full/partial forwards, planned work, decision time,
    peak memory too). No cell is ever cut: a long policy spec breaks between its parts
    (:class:`PolicySpec`), and the table fits the width it is printed at (``terminal.fit``); ``--json``
    keeps every number unrounded."""
    from rich.table import Table

    has_score = any(report.summaries[p].get("score") is not None for p in report.policies)
    cols = [c for c in COLUMNS if (c[1] != "score" or has_score) and (wide or c[3])]
    mem = {"cuda_peak_allocated": "CUDA peak allocated", "peak_rss": "peak RSS", "rss_after_run": "RSS after run"}
    if wide:
        cap = (f"speedup: tok/s over none's; latency speedup: none's mean latency over this one's. "
               f"work %: positions x layers the forwards computed (padding included), over none's (NFE_none x canvas) "
               f"/ over own NFE x canvas; planned: the plans' own positions over none's. "
               f"decision: policy plan+observe time over wall time. "
               f"weights: the model's stored weights ({_quantized(report)}); "
               f"peak mem: {mem.get(report.memory_kind, report.memory_kind)}; run mem: the peak over what was in use "
               f"before the run. "
               f"identical/token agree: outputs vs none (same prompts, same seed).")
    else:
        cap = ("speedup: tok/s over none's. work %: positions x layers computed, over none's. identical / token "
               "agree: outputs vs none. --wide: latency, forwards, decision time, memory.")
    if "none" not in report.policies:  # nothing is measured against none: its legend would explain blanks
        cap = "no none in --policies: speedup, work % and fidelity vs none are not measured." + (
            "" if wide else " --wide: latency, forwards, decision time, memory.")
    t = Table(title=title, caption=cap, caption_justify="left")
    # the policy column keeps room for its widest name part, so a narrow terminal squeezes the numbers, not it
    name_width = max(len(part) for p in report.policies for part in p.split(":"))
    for header, key, _, _ in cols:
        t.add_column(header, justify="left" if key is None else "right", overflow="fold", no_wrap=key is not None,
                     min_width=name_width if key is None else None)
    for p in report.policies:
        s = report.summaries[p]
        t.add_row(PolicySpec(p), *[cell(s.get(key), fmt) for _, key, fmt, _ in cols[1:]])
    return fit(t)


def _quantized(report: ProfileReport) -> str:
    """The weights' format as the table caption names it."""
    q = next(iter(report.summaries.values()), {}).get("quantize", "none")
    return "unquantized" if q == "none" else f"{q} quantized"


def weights_record(model) -> dict:
    """``{"quantize": "none" | "int8" | ..., "weight_bytes": N}``: the weights' format and stored bytes
    (``models/quantize.py``), as profile's summaries and generate's records carry them."""
    from ..models.quantize import quantization_name, weight_bytes

    return {"quantize": quantization_name(model), "weight_bytes": weight_bytes(model)}


def timing_warnings(report: ProfileReport, slack: float = 1.5) -> list[str]:
    """One line per policy whose measured speedup disagrees with the work it skipped.

    A policy whose forwards compute a share w of none's positions x layers (``work_share_vs_none``:
    what the forwards computed, padding included, not the plans' own positions) cannot run more than about
    1/w times faster (the decision adds work, it never removes any); a speedup above ``slack`` / w, or
    a slowdown below 1 / ``slack`` with w < 1, means the timings were disturbed (other load on the
    machine, CPU frequency changes, too few repeats). Policies without none's numbers are skipped.
    """
    out = []
    for p in report.policies:
        s = report.summaries[p]
        sp, w = s.get("speedup_vs_none"), s.get("work_share_vs_none")
        if p == "none" or sp is None or not w:
            continue
        bound = 1 / w
        if sp > slack * bound or (w < 1 and sp < 1 / slack):
            out.append(f"warning: {p} measured {sp:.2f}x faster than none with {w:.0%} of its work (expected at most "
                       f"~{bound:.2f}x): the timings look disturbed; rerun with --repeats 3 on an idle machine, "
                       f"or pin --threads")
    return out


def json_line(data: dict) -> str:
    """One compact JSON line (the last stdout line with ``--json -``)."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, default=str)


#: Where a policy spec may break, preferred first: before ``:`` (between policy and parameters), before
#: ``=`` (between a key and its value), then after ``_`` or ``-`` (between the words of a name).
SPEC_BREAKS = ((":", True), ("=", True), ("_", False), ("-", False))


def spec_lines(text: str, width: int, level: int = 0) -> list[str]:
    """``text`` (a ``--policies`` entry or a piece of one) laid out in ``width`` columns. Text that does
    not fit is cut into pieces at ``SPEC_BREAKS[level]`` (none there: one piece), each piece laid out
    the same way one level down; a piece that fits whole joins the line before it when there is room, a
    broken one starts a new line. A line is wider than ``width`` only when a piece with no break left is
    (e.g. a 12-letter word in 10 columns; the cell then folds it)."""
    if len(text) <= width or level == len(SPEC_BREAKS):
        return [text]
    sep, before = SPEC_BREAKS[level]
    parts = text.split(sep)
    pieces = [parts[0], *(sep + p for p in parts[1:])] if before else [*(p + sep for p in parts[:-1]), parts[-1]]
    lines: list[str] = []
    for piece in filter(None, pieces):
        sub = spec_lines(piece, width, level + 1)
        if len(sub) == 1 and lines and len(lines[-1]) + len(sub[0]) <= width:  # a whole piece joins the line
            lines[-1] += sub[0]
        else:  # a piece broken over lines starts a line of its own
            lines += sub
    return lines


class PolicySpec:
    """A ``--policies`` entry (``entropy:tau=2.5:recent_k=16``) as a table cell that never cuts a name
    when the column is at least as wide as its widest ``:`` part: :func:`spec_lines` breaks it between
    its parts (a part that starts a line starts it with ``:``), and in a narrower column before
    ``=`` and between the words of a name. A rich renderable: ``__rich_measure__`` asks for the widest
    ``:`` part as the column's minimum and the whole spec as its maximum."""

    def __init__(self, spec: str):
        self.spec = spec

    def __rich_measure__(self, console, options):
        from rich.measure import Measurement

        widest = max(len(p) + (i > 0) for i, p in enumerate(self.spec.split(":")))
        return Measurement(widest, len(self.spec)).clamp(max_width=options.max_width)

    def __rich_console__(self, console, options):
        from rich.text import Text

        yield Text("\n".join(spec_lines(self.spec, options.max_width)), overflow="fold")
