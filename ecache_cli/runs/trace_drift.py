"""``ecache trace-drift``: per-step EntropyCache signal beside the KV drift of the cache it governs.

The chosen policy decodes as usual (``Engine.start``); the run's ``on_forward`` hook captures the
canvas, the query positions and the logits of every live forward. After each step is yielded (the
live store still holds exactly what that forward served) a *shadow* full forward on the same canvas
with a fresh store gives the reference K/V and logits. The shadow never writes into the live store,
the canvas or the RNG, so the generated tokens are those of ``ecache generate`` with the same settings;
its time is measured apart and never enters the live timings.

Per step and prompt (one record each): the signal of the tokens committed at the previous step (the
value that decided this step's refresh), whether the row refreshed, positions computed / served from
the cache, per-layer K and V drift over the served positions (``metrics/drift.py``), and fidelity of
the cached logits (committed tokens whose greedy choice differs under the fresh logits). Across steps:
the volatility curve of committed tokens' fresh K, and the correlation of signal vs next-step drift.
On a mixture-of-experts model each record also gives the share of the computed positions' expert
assignments that caching changed (``route_change``: the live forward's routing against the shadow's).
Memory: the shadow store plus the previous step's fresh K (two stores' worth next to the live one).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..contract.state import SIGNALS, StepRecord
from ..engine.core import Engine, GenerationResult, Run
from ..errors import UsageError
from ..metrics.drift import (
    VolatilityBins,
    correlation,
    increment_pairs,
    layer_drift,
    layer_mean_change,
    next_step_pairs,
)
from .inputs import piped_stdin, read_items
from .manifest import manifest
from .settings import Settings
from .streams import batched

X_LABEL = "signal E_t = {kind} of the tokens committed at step t"
Y_LABEL = ("drift_{t+1} = mean over layers of the mean K drift (1 - cos) at step t+1, over positions served "
           "from the cache (partial steps only)")
Y_INC_LABEL = "drift_{t+1} - drift_t (both partial steps)"


@dataclass
class TraceOptions:
    """Non-decoding options of ``ecache trace-drift`` (see the command's help)."""

    prompts: list[str]
    input_file: Path | None = None
    task: str | None = None
    data: str | None = None
    limit: int = 4
    shots: int | None = None
    chat: bool | None = None
    batch_size: int = 1
    seed: int = 0
    signal: str = "max-entropy"
    volatility_level: float = 1e-3
    read: list | None = None  # the input as read_first read it (None: read when the trace starts)


@dataclass
class TraceReport:
    """What a trace produced. records: one dict per (prompt, step), see ``DriftTracer.measure``.
    volatility: bins over all prompts; per_prompt: the same per prompt index. results: the generated
    outputs (identical to ``ecache generate``). live_s / shadow_s: seconds in the live steps (forward +
    decision + sampling) and in the shadow forwards."""

    records: list[dict] = field(default_factory=list)
    volatility: VolatilityBins = field(default_factory=VolatilityBins)
    per_prompt: dict[int, VolatilityBins] = field(default_factory=dict)
    results: list[GenerationResult] = field(default_factory=list)
    signal: str = "max-entropy"
    level: float = 1e-3
    n_layers: int = 0
    live_s: float = 0.0
    shadow_s: float = 0.0
    block_causal: bool = False  # block diffusion: the served keys are finished blocks', exact by construction
    incomplete: bool = False  # Ctrl-C or SIGTERM ended the trace: it covers the steps measured before

    def correlation(self) -> dict:
        """Pearson/Spearman of E_t vs drift_{t+1} (labels say exactly which), plus the increment variant."""
        xs, ys = next_step_pairs(self.records, self.signal)
        main = {**correlation(xs, ys), "x": X_LABEL.format(kind=self.signal), "y": Y_LABEL}
        xi, yi = increment_pairs(self.records, self.signal)
        inc = {**correlation(xi, yi), "x": X_LABEL.format(kind=self.signal), "y": Y_INC_LABEL}
        return {"next_step_drift": main, "next_step_increment": inc}

    @property
    def committed(self) -> int:
        """Tokens committed over the measured steps (every record, an interrupted prompt's too, so that the
        counts of an incomplete trace describe one set of steps)."""
        return sum(r["committed"] for r in self.records)

    def tokens_per_step(self) -> float:
        return self.committed / max(len(self.records), 1)

    def summary(self) -> dict:
        """A JSON-able summary (the ``--json`` document)."""
        partial = [r for r in self.records if r["served"] > 0]
        L = self.n_layers
        by_layer = lambda key: [sum(r[key][i] for r in partial) / len(partial) for i in range(L)] if partial else None  # noqa: E731
        settle = self.volatility.settle_steps(self.level)
        return {
            "incomplete": self.incomplete,  # interrupted: prompts counts the finished ones; the step counts,
            # the fidelity and the correlation cover every step measured (the --jsonl records)
            "prompts": len(self.results), "records": len(self.records), "partial_steps": len(partial),
            "refresh_steps": sum(r["refresh"] for r in self.records),
            # neither: a step that read nothing from the cache and refreshed none (a row's first forward,
            # or a block-diffusion block's first step); the three add up to records
            "uncached_steps": sum(not r["refresh"] and r["served"] == 0 for r in self.records),
            "signal": self.signal,
            "correlation": self.correlation(),
            "drift_k_mean_by_layer": by_layer("drift_k_mean"), "drift_v_mean_by_layer": by_layer("drift_v_mean"),
            "fidelity": {"committed": self.committed, "mismatched": sum(r["fidelity_mismatch"] for r in self.records)},
            "route_change_mean": _mean([r["route_change"] for r in partial if r.get("route_change") is not None]),
            "volatility": {"level": self.level, "settle_steps": settle, "tokens_per_step": self.tokens_per_step(),
                           "curve": self.volatility.curve()},
            "time_s": {"live": self.live_s, "shadow": self.shadow_s},
            "block_causal": self.block_causal,
            "drift_k_max": max((max(r["drift_k_max"]) for r in partial), default=None),
        }


class DriftTracer:
    """Measures one :class:`Run` beside its steps. Install with ``run.on_forward = tracer.capture``, then
    call ``measure(rec)`` on every yielded record (before the next step starts).

    ``offset`` is added to row indices to give global prompt numbers across batches.
    """

    def __init__(self, run: Run, offset: int = 0):
        self.run, self.offset = run, offset
        self.model = run.engine.model
        eng = run.engine
        self.banned = torch.cat([eng.banned, eng.end_ids]) if run.cfg.ban_eos else eng.banned
        self.prev_k: list[torch.Tensor] | None = None  # fresh K of the previous step, one (B', H, T, D) per layer
        self.prev_rows: torch.Tensor | None = None
        self.last_signal: dict[int, dict] = {}
        self.bins: dict[int, VolatilityBins] = {}
        self.shadow_s = 0.0
        self._cap = None
        self.routers = self.model.routers() if hasattr(self.model, "routers") else []
        self._full_routes: list[torch.Tensor] = []

    def capture(self, run: Run, plan, query: torch.Tensor | None, sources: torch.Tensor, logits: torch.Tensor) -> None:
        """The engine hook: remember what the live forward saw (no computation)."""
        grow = None if plan.hooks is None else plan.hooks.grow_from_layer
        start = grow if query is not None else None  # forwards whose positions grow at a layer (Elastic-Cache)
        # a refreshing row of a mixed step ran its own full forward after the partial one (Run._forward)
        self._cap = (run.state.tokens.clone(), query, sources, logits, start, plan.refresh, plan.hooks is not None)

    def computed_mask(self, query: torch.Tensor | None, shape) -> torch.Tensor:
        """(B, T) bool positions the live forward computed (all for a full forward)."""
        dev = self.run.state.tokens.device
        if query is None:
            return torch.ones(shape, dtype=torch.bool, device=dev)
        return torch.zeros(shape, dtype=torch.bool, device=dev).scatter_(1, query, True)

    @torch.inference_mode()
    def shadow(self, tokens: torch.Tensor, sources: torch.Tensor):
        """Shadow full forward on ``tokens`` (B, T) with a fresh store; returns (store, logits (B, R, V),
        seconds). Timed with a device sync on CUDA; the time is kept apart from the live timings."""
        live = self.run.store
        store = self.model.new_store(live.key_mask, **({"block": live.block} if live.block is not None else {}))
        t0 = _clock(tokens.device)
        with recording(self.routers) as routes:
            logits = self.model(tokens, store, query_pos=None, logits_pos=sources)
        seconds = _clock(tokens.device) - t0
        self.shadow_s += seconds
        self._full_routes = [r[0].view(*tokens.shape, -1) for r in routes]  # per MoE layer (B, T, k)
        return store, logits, seconds

    @torch.inference_mode()
    def route_change(self, computed: torch.Tensor) -> list[float | None]:
        """Per row, the share of expert assignments at the positions this step computed that differ between
        the live forward (served K/V from the cache) and the shadow full forward, averaged over the MoE
        layers: 0 when caching left every routing decision as a full forward makes it, None without MoE
        layers or for a forward with layer hooks (its per-layer positions are not the query's). The live
        forward's routing comes from running it again on a copy of the live store (the same inputs)."""
        tokens, query, _, _, _, refresh, hooked = self._cap
        B = tokens.shape[0]
        if not self.routers or hooked:
            return [None] * B
        if query is None:  # a full forward: the shadow's own routing
            return [0.0] * B
        with recording(self.routers) as routes:
            self.model(tokens, self.run.store.clone(), query_pos=query, logits_pos=query[:, :1])
        changed = torch.zeros(B, device=tokens.device)
        for live, full in zip(routes, self._full_routes):
            live = live[0].view(B, query.shape[1], -1)  # (B, S, k)
            at = full.gather(1, query[:, :, None].expand(-1, -1, full.shape[-1]))  # (B, S, k)
            kept = (live[..., :, None] == at[..., None, :]).any(-1).float().mean(-1)  # (B, S)
            changed += 1 - kept.mean(1)  # repeated padding entries repeat a real position's value
        share = (changed / len(routes)).masked_fill(refresh, 0.0)
        return share.tolist()

    @torch.inference_mode()
    def per_position(self, rec: StepRecord):
        """Shadow forward plus per-position facts of the step just yielded.

        Returns (store, fresh_logits, computed (B, T) bool, served, shadow seconds); ``served`` is one
        (B, T) bool per layer: real positions the live forward did not compute at that layer (a row
        that a layer-selective plan expands from layer ℓ computes everything from ℓ on). Used by
        ``measure`` and by tests that check per-position drift.
        """
        assert self._cap is not None, "DriftTracer.capture was not installed as run.on_forward"
        tokens, query, sources, _, start, refresh, _ = self._cap
        store, fresh, seconds = self.shadow(tokens, sources)
        computed = self.computed_mask(query, tokens.shape) | refresh[:, None]
        base = self.run.store.key_mask & ~computed  # (B, T)
        if self.run.store.block is not None:  # block-causal: the queries read no key after their own block
            base = base & self.run.state.span(0, self.run.state.block_end)
        L = len(store.k)
        if start is None:
            served = [base] * L
        else:
            served = [base & (start > layer)[:, None] for layer in range(L)]
        return store, fresh, computed, served, seconds

    @torch.inference_mode()
    def measure(self, rec: StepRecord) -> list[tuple[dict, torch.Tensor]]:
        """Measure the step ``rec`` (just yielded: the live store is still as its forward left it).

        Returns one (record, hist) pair per active row: ``record`` is JSON-able (keys: prompt, step,
        block, step_in_block, refresh, computed, served, signal {kind: float | None, of the tokens
        committed at the previous step}, committed, fidelity_mismatch, fidelity_kl (nats, mean over
        committed tokens of KL(fresh ‖ cached)), drift_k_mean / drift_k_max / drift_v_mean /
        drift_v_max (lists of n_layers floats, 0 for a layer that served nothing), drift_k / drift_v
        (mean of the per-layer means over the layers that served something: every layer, unless a
        layer-selective plan recomputed the upper ones), start_layer (the plan's layer-selective start,
        or None), route_change (:meth:`route_change`), forward_ms (live forward of the batch),
        shadow_ms). ``served`` counts the positions
        served at layer 0. ``hist`` is the per-position K drift (mean over the layers that served it) of
        the served positions, a 1-D float32 CPU tensor.
        """
        live = self.run.store
        shadow, fresh_logits, computed, served, seconds = self.per_position(rec)
        d = layer_drift(live.k, live.v, shadow.k, shadow.v, served)  # (B, L) each; k_pos (B, T)
        layer_served = torch.stack([s.any(1) for s in served], 1)  # (B, L) bool
        mismatch, kl = self._fidelity(rec, fresh_logits)
        route = self.route_change(computed)
        self._volatility(rec, shadow.k)
        rows = (rec.rows + self.offset).tolist()
        signals = {kind: rec.signal(kind).tolist() for kind in SIGNALS}
        lists = {key: d[key].tolist() for key in ("k_mean", "k_max", "v_mean", "v_max")}
        refresh, comp_n = rec.refresh.tolist(), computed.sum(1).tolist()
        served_n, n_commit = served[0].sum(1).tolist(), rec.n_committed.tolist()
        n_served_layers = layer_served.sum(1).tolist()
        start = self._cap[4].tolist() if self._cap[4] is not None else None
        blocks, steps_in_block = rec.block.tolist(), rec.step_in_block.tolist()
        out = []
        for b, prompt in enumerate(rows):
            rec_d = {
                "prompt": prompt, "step": rec.step, "block": blocks[b], "step_in_block": steps_in_block[b],
                "refresh": bool(refresh[b]), "computed": int(comp_n[b]), "served": int(served_n[b]),
                "signal": self.last_signal.get(prompt), "committed": int(n_commit[b]),
                "fidelity_mismatch": int(mismatch[b]), "fidelity_kl": float(kl[b]),
                "drift_k_mean": lists["k_mean"][b], "drift_k_max": lists["k_max"][b],
                "drift_v_mean": lists["v_mean"][b], "drift_v_max": lists["v_max"][b],
                "drift_k": sum(lists["k_mean"][b]) / max(n_served_layers[b], 1),
                "drift_v": sum(lists["v_mean"][b]) / max(n_served_layers[b], 1),
                "start_layer": None if start is None else int(start[b]), "route_change": route[b],
                "forward_ms": 1e3 * rec.forward_s, "shadow_ms": 1e3 * seconds,
            }
            self.last_signal[prompt] = {k: (v[b] if math.isfinite(v[b]) else None) for k, v in signals.items()}
            out.append((rec_d, d["k_pos"][b][served[0][b]].cpu()))
        self._cap = None
        return out

    def _fidelity(self, rec: StepRecord, fresh: torch.Tensor) -> tuple[list, list]:
        """Per row: committed tokens whose greedy choice differs between cached and fresh logits, and the
        mean KL(fresh ‖ cached) in nats over committed tokens. Both logits are rows of the same
        ``logits_pos``, so for Dream they predict the same (shifted) tokens. At temperature 0 the cached
        greedy choice is the committed token itself, so the count is exact."""
        cached = self._cap[3]
        commit = rec.committed & rec.valid  # (B, R)
        greedy = lambda x: x.float().index_fill(-1, self.banned, float("-inf")).argmax(-1)  # noqa: E731  (B, R)
        differ = (greedy(cached) != greedy(fresh)) & commit
        lp_f = torch.log_softmax(fresh[commit].float(), -1)  # (N, V)
        lp_c = torch.log_softmax(cached[commit].float(), -1)
        kl_tok = (lp_f.exp() * (lp_f - lp_c)).sum(-1).clamp_min(0.0)  # (N,)
        kl = torch.zeros(commit.shape, dtype=torch.float32, device=commit.device)
        kl[commit] = kl_tok
        kl_row = kl.sum(1) / commit.sum(1).clamp_min(1)
        return differ.sum(1).tolist(), kl_row.tolist()

    def _volatility(self, rec: StepRecord, fresh_k: list[torch.Tensor]) -> None:
        """Bin the fresh-K change since the previous step of every committed token by steps since commit."""
        st = self.run.state
        if self.prev_k is not None:
            # each row's place in the previous step (rows move when others leave); a row that was not in it
            # (it joined since) is not compared
            same = rec.rows[:, None] == self.prev_rows[None, :]  # (B, B_prev)
            seen, idx = same.any(1), same.int().argmax(1)  # (B,) bool, (B,) long
            change = layer_mean_change([k[idx] for k in self.prev_k], fresh_k)  # (B, T)
            age = st.own_steps()[:, None] - st.commit_step  # (B, T) in the row's own steps; this step's: 0
            ok = (st.commit_step >= 0) & (age >= 2) & st.key_mask & seen[:, None]  # both canvases hold the token
            for b, prompt in enumerate((rec.rows + self.offset).tolist()):
                self.bins.setdefault(prompt, VolatilityBins()).add(age[b], change[b], ok[b])
        self.prev_k, self.prev_rows = fresh_k, rec.rows.clone()


def check_flags(prompts: list[str] | None, input_file: Path | None, task: str | None, data: str | None, shots,
                limit: int, batch_size: int, signal: str | None, plot: Path | None, jsonl: Path | None,
                json_out: str | None,
                volatility_level: float, rows: int) -> None:
    """The trace-drift flags, checked before anything loads: ranges (UsageError, exit 2), ``--input``
    readable (``inputs.check_input_file``, DataError), one prompt source and one user of stdout."""
    from ..config import check_ranges
    from ..outputs import check_plot_name
    from ..tasks import check_task_name
    from .inputs import check_input_file, check_prompt_sources

    if task is not None:
        check_task_name(task)
    check_prompt_sources(prompts, input_file, task, data, shots)  # a usage error before the input is read
    if batch_size < 1:
        raise UsageError(f"--batch-size {batch_size} must be ≥ 1")
    if limit < 1:
        raise UsageError(f"--limit {limit} must be ≥ 1")
    if signal is not None and signal not in SIGNALS:
        raise UsageError(f"--signal {signal!r} is not a signal; use one of {', '.join(SIGNALS)}")
    check_plot_name(plot)
    if jsonl is not None and str(jsonl) == "-" and json_out == "-":
        raise UsageError("--jsonl - and --json - both want stdout; send one of them to a file")
    check_ranges({"volatility_level": volatility_level})  # NaN and ±inf too, in the flags' words
    if rows < 0:
        raise UsageError(f"--rows {rows} must be ≥ 0 (0 = every step)")
    check_input_file(input_file)  # after every usage error (exit 2), as in every command


def signal_kind(signal: str | None, settings: Settings) -> str:
    """The signal traced: ``--signal``, else the resolved cache setting's, else ``max-entropy``."""
    return signal or settings.cache_params.get("signal", "max-entropy")


def read_first(opts: TraceOptions) -> list:
    """The trace's input read and checked in full without the model, before it loads (README: an input
    error comes first and alone): ``--task``'s prompts (test split, ``--limit``, ``--shots``; ``--data``
    read here; piped data beside it is a warning, ``inputs.warn_unread_stdin``), each as (prompt, the
    examples whose text it holds: ``Task.prompt_examples``), else the items of the
    arguments, ``--input`` JSONL or stdin (read only without the others). UsageError (exit 2) naming
    every line invalid without the model (``inputs.invalid_error``) or for a source with no prompt;
    DataError (exit 1) for one that cannot be read."""
    from .inputs import check_prompt_sources, warn_unread_stdin

    check_prompt_sources(opts.prompts, opts.input_file, opts.task, opts.data, opts.shots)
    if opts.task:
        from ..tasks import get_task

        task = get_task(opts.task, opts.data)
        shots = task.default_shots if opts.shots is None else opts.shots
        examples = task.examples("test", opts.limit, opts.seed)
        warn_unread_stdin(None, None, opts.task, opts.data)
        return [(task.prompt(ex, shots, opts.seed), task.prompt_examples(ex, shots, opts.seed)) for ex in examples]
    from .inputs import FIX, invalid_error, no_prompts, source_head

    stdin = piped_stdin() if not opts.prompts and opts.input_file is None else None
    items = read_items(opts.prompts, opts.input_file, stdin, raise_invalid=False)
    if not items:
        raise no_prompts(opts.input_file)
    head, what = source_head(items, opts.input_file)
    error = invalid_error(items, head, what=what, fix=FIX)
    if error is not None:
        raise error
    return items


def load_prompts(engine: Engine, opts: TraceOptions, chat: bool, decode) -> list[str | list]:
    """Prompts of :func:`read_first` (``opts.read`` when already read); every one is checked by the model
    too before any is decoded (UsageError naming each bad input line, ``gen_input.check_prompts``, or the
    task record at fault, ``gen_input.encode_task_prompts``)."""
    from .gen_input import check_prompts, encode_task_prompts

    read = opts.read if opts.read is not None else read_first(opts)
    if opts.task:
        prompts = [prompt for prompt, _ in read]
        encode_task_prompts(engine, prompts, [records for _, records in read], chat)
        return prompts

    check_prompts(read, engine, chat, decode.gen_length, decode.block_length, opts.input_file)
    return [it.prompt for it in read]


def trace(lm, settings: Settings, opts: TraceOptions, sinks=(), progress=None, hold=None) -> TraceReport:
    """Decode every prompt with the settings' policy and measure each step beside it.

    ``sinks``: objects with ``step(record, hist)`` (called per record, in order) and ``close(report)``.
    ``progress``: optional callable(prompts done, prompts in all, what runs now) for a status line
    (``terminal.Counter``), called at each step and after each batch. ``hold``: an
    ``interrupts.HeldInterrupts`` started as the loop ends (finished or interrupted), so a Ctrl-C or SIGTERM
    after it waits until the caller has written the summary. Returns the TraceReport.
    """
    if opts.volatility_level <= 0:
        raise UsageError(f"--volatility-level {opts.volatility_level} must be > 0 (e.g. 1e-3)")
    engine = Engine.from_loaded(lm)
    chat = lm.chat if opts.chat is None else (opts.chat and lm.chat)
    report = TraceReport(signal=opts.signal, level=opts.volatility_level, n_layers=lm.spec.n_layers,
                         block_causal=lm.spec.block_causal)
    prompts_all = load_prompts(engine, opts, chat, settings.decode)
    import scipy.stats  # noqa: F401  (the summary's correlations; imported before, so Ctrl-C after the trace
    # finds a summary that takes milliseconds to write, not a second-long import)
    try:
        _trace_batches(engine, settings, opts, chat, prompts_all, report, sinks, progress)
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM: what was measured is reported (README: as profile does)
        report.incomplete = True
    finally:
        if hold is not None:  # from here to the caller's --json write an interrupt is held, not lost
            hold.start()
    for s in sinks:
        s.close(report)
    return report


def _trace_batches(engine, settings: Settings, opts: TraceOptions, chat: bool, prompts_all: list, report: TraceReport,
                   sinks, progress) -> None:
    """:func:`trace`'s loop over the batches of ``prompts_all``, adding to ``report``."""
    done = 0
    for prompts in batched(prompts_all, opts.batch_size):
        run_ = engine.start(engine.encode(prompts, chat), settings.decode, settings.policy(), seed=opts.seed,
                            row_ids=range(done, done + len(prompts)))  # as generate: (seed, prompt index)
        tracer = DriftTracer(run_, offset=done)
        run_.on_forward = tracer.capture
        run_.step_timing = True  # rec.forward_s is read as each step is yielded (CUDA: one sync per step)
        for rec in run_:
            report.live_s += rec.forward_s + rec.decision_s + rec.sampling_s
            for record, hist in tracer.measure(rec):
                report.records.append(record)
                for s in sinks:
                    s.step(record, hist)
            if progress is not None:
                progress(done, len(prompts_all), f"prompts {done + 1}-{done + len(prompts)} · step {rec.step + 1}")
        report.shadow_s += tracer.shadow_s
        for prompt, bins in tracer.bins.items():
            report.per_prompt[prompt] = bins
            report.volatility.merge(bins)
        report.results.extend(_renumber(run_.results(), done))
        done += len(prompts)
        if progress is not None:
            progress(done, len(prompts_all), "")


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@contextlib.contextmanager
def recording(routers: list):
    """Record the expert choices of the MoE blocks ``routers`` during the body: yields one list per block,
    filled with each forward's (N, k) expert ids; recording stops on exit."""
    for r in routers:
        r.routes = []
    try:
        yield [r.routes for r in routers]
    finally:
        for r in routers:
            r.routes = None


def _renumber(results: list[GenerationResult], offset: int) -> list[GenerationResult]:
    for r in results:
        r.index += offset
    return results


def summary_document(lm, settings: Settings, opts: TraceOptions, report: TraceReport) -> dict:
    """The ``--json`` document: ``command`` (as every command's ``--json`` starts), the summary, the settings
    and the reproducibility manifest."""
    return {"command": "trace-drift", **report.summary(),
            "manifest": manifest(lm, settings, opts.seed, {"command": "trace-drift"})}


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
