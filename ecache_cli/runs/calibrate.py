"""``ecache calibrate``: search EntropyCache's τ for one model and task domain, score every candidate
against ``none`` on the same examples, and write the chosen settings to a profile.

Procedure (the rules themselves live in ``runs/tau_search.py``):

1. ``--limit`` examples of the task's test split, chosen by ``--seed`` (synthetic domains draw them
   from the seed; file benchmarks take a seeded subset in file order), prompted with ``--shots``.
2. ``none`` decodes every example once; its StepRecords give the signal distribution (the per-step
   signal of the committed tokens, ``rec.signal(kind)``).
3. A coarse τ grid over that distribution (or ``--taus``), then ``--refine`` bisection steps on the
   bracket around the choice.
4. Each τ decodes the same examples (a batch on which its refresh decisions provably equal those of
   an evaluated τ is copied from it, not decoded: ``Evaluator``); score, fidelity to ``none``, cost
   proxy, wall-clock, refresh rate and NFE are aggregated per τ, and the choice rule picks one (or none).

Joint search (``--recent-k 16,32,64`` or ``--recent-steps 0,4,8``: several values; ``--joint``: block
refresh off and on, and recent_k 16, 32, 64 unless listed, all with recent_steps 0, no block_tau and
the prompt in triggered refreshes (the paper's rule, whatever the base profile's) unless --recent-steps
is given, plus the variants' arms ``calib_store.JOINT_STEP_ARMS`` unless --recent-k or --recent-steps is given,
whose ``block_tau`` "high" becomes the high τ of ``none``'s signal on the sample once ``none`` is
decoded, ``tau_search.high_tau``): steps 3–4 run once per arm, an arm (``calib_store.Arm``) being one
(recent_k, block_refresh, recent_steps, block_tau, refresh_prompt) of the product of the searched
values or of the extra arms, every arm against the same ``none`` records; the choice rule then takes
the qualifying setting with the highest cost-proxy speedup (the least planned work) over every arm's
points (``tau_search.choose``), and the profile gets its τ and arm.

Groups (``--task arith,code,list``, ``--shots 0,4``; ``runs/calib_groups.py``): the sample is every
group's examples, each point is also aggregated per group, and a setting qualifies only when it meets
the tolerance on every group; such a run writes the model's ``default`` profile.

Block-diffusion models (``lm.spec.block_causal``; ``runs/calib_sweep.py``): the ``block`` cache is exact,
so the decoder's threshold is searched instead of τ, against the one-token-per-step reference in
``none``'s place; the same search, records, choice rule, reports and profile store, with the values and
the policy and decode settings of each one from the sweep object (``calib_sweep.SWEEPS``).

Speed check (``runs/speed_guard.py``; ``--no-speed-check`` skips it): after the proxy ranking, the
best qualifying setting is timed against ``none`` on ``--speed-check-limit`` examples of the sample,
under plain decoding and under threshold decoding (the run's ``--threshold``, else 0.9), each the
median of 3 alternated passes; one slower than ``none`` in the mode its profile serves (plain; or,
for a run under parallel decoding, which writes the ``<task>-parallel`` profile, that decoding) is
passed over for the next in the ranking (at most ``speed_check_tries`` are timed), and when none
passes nothing is chosen; a plain run's choice slower than ``none`` under threshold decoding is kept
with a warning naming the parallel profile. The check is timing-dependent by nature; it runs after
the ranking and writes nothing to the run file, so it leaves ``--resume``'s determinism of the proxy
ranking intact.

Every (τ, example) record is appended to the run file (``runs/calib_store.py``) as soon as its batch
finishes; ``--resume`` reuses them. Batches are fixed chunks of the sample, re-run whole if any of
their records is missing, so a resumed run decodes exactly what an uninterrupted one would; the choice
depends only on records and the deterministic cost proxy, so it is the same (before the speed check,
which measures anew).

Measurement: fidelity, tokens/s and ratios come from ``ecache_cli/metrics`` (shared with ``ecache
profile``); ``profile``'s ``measure`` protocol (warm-up, rotated policy order) is not reused for the
search because calibrate evaluates settings one after another and resumably (the speed check uses
it). The cost proxy is per row here (``Evaluator``): positions computed, a full forward counting the
row's own prompt + gen length.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from ..cache.entropy import EntropyCache
from ..config import canonical_model_name, profile_path
from ..distributed import DistEnv
from ..engine.core import Engine
from ..errors import ConfigError, EcacheError, UsageError
from .calib_store import Arm, RunFile
from .calib_sweep import SWEEPS, ReferenceClock, ReferenceGuard, check_thresholds
from .gen_input import encode_task_prompts
from .settings import Settings
from .speed_guard import DEFAULT_LIMIT, DEFAULT_TRIES, SpeedGuard, Verdict, WallClock, mode_threshold, spread
from .tau_search import (
    KNOBS,
    Choice,
    Point,
    aggregate,
    choose,
    chosen_reason,
    high_tau,
    pareto_frontier,
    ranking,
    same_decisions,
)

METRICS = ("task", "fidelity")


@dataclass
class CalibrateOptions:
    """Non-decoding options of ``ecache calibrate`` (units: max_drop in points = 1/100 of a 0–1 score,
    min_fidelity in percent)."""

    task: str
    data: str | None = None
    limit: int = 50
    seed: int = 0
    shots: int | None = None
    chat: bool | None = None
    metric: str = "task"
    recent_ks: list[int] | None = None
    block_refreshes: list[bool] | None = None
    recent_steps: list[int] | None = None
    extra_arms: list[Arm] | None = None  # searched besides the product of the three lists above
    max_drop: float = 1.0
    min_fidelity: float | None = None
    grid: int = 8
    refine: int = 3
    taus: list[float] | None = None
    batch_size: int = 1
    allow_code_execution: bool = False
    out: Path | None = None
    json_path: Path | None = None
    plot_path: Path | None = None
    run_file: Path | None = None
    resume: bool = False
    dry_run: bool = False
    quiet: bool = False
    speed_check: bool = True
    speed_check_limit: int = DEFAULT_LIMIT
    speed_check_threshold: float | None = None  # None: the run's --threshold, else speed_guard.DEFAULT_THRESHOLD
    speed_check_tries: int = DEFAULT_TRIES
    parallel: bool = False  # the run decodes in parallel (--threshold / --factor): set by calibrate()
    sweep: str = "tau"  # what is searched (calib_sweep.SWEEPS): "threshold" on a block-diffusion model
    quantize: str | None = None  # the weights' format (--quantize): profile <task>-<format> (config.quantize_task)

    @property
    def profile_task(self) -> str:
        """The profile's task name: ``--task``, or ``default`` for several domains (``--task a,b``);
        with ``-parallel`` after it for a run under parallel decoding (``config.mode_task``), and the weights'
        format after that for quantized weights (``list-int8``, ``config.quantize_task``)."""
        from ..config import mode_task, quantize_task
        from .calib_groups import DEFAULT_PROFILE_TASK

        return quantize_task(mode_task(DEFAULT_PROFILE_TASK if "," in self.task else self.task, self.parallel),
                             self.quantize)

    def fractions(self) -> tuple[float, float | None]:
        """``max_drop`` and ``min_fidelity`` as fractions of 1 (``min_fidelity`` None when not given)."""
        return self.max_drop / 100, None if self.min_fidelity is None else self.min_fidelity / 100


@dataclass
class Outcome:
    """What a calibration found: the ``none`` point, every τ point (ascending τ), the frontier, the
    choice, the profile path written (None when dry-run or nothing qualified) and the run file.
    ``speed_check``: the wall-clock check's JSON entry (``SpeedGuard.document``; ``{"enabled": false}``
    with ``--no-speed-check``; None before the search ended)."""

    base: Point
    points: list[Point]
    frontier: list[Point]
    choice: Choice
    signal_summary: dict
    profile: Path | None
    profile_data: dict | None
    run_file: Path
    resumed_records: int = 0
    speed_check: dict | None = None
    sweep: str = "tau"  # what was searched: "tau" or "threshold" (calib_sweep.SWEEPS)


def validate(opts: CalibrateOptions) -> None:
    """Range checks of the calibrate options (one-line UsageErrors)."""
    if opts.metric not in METRICS:
        raise UsageError(f"--metric {opts.metric!r} is not a metric; use one of task, fidelity")
    from ..config import check_ranges, check_setting

    check_ranges({name: getattr(opts, name) for name in ("limit", "max_drop", "min_fidelity", "grid", "refine",
                                                         "batch_size", "speed_check_limit", "shots")})
    if opts.speed_check_tries < 1:
        raise UsageError(f"speed_check_tries {opts.speed_check_tries} must be ≥ 1 (settings timed at most)")
    t = opts.speed_check_threshold
    if t is not None and not (math.isfinite(t) and 0 < t <= 1):
        raise UsageError(f"speed_check_threshold {t} must be in (0, 1], a confidence (Fast-dLLM uses 0.9)")
    if opts.sweep == "threshold":
        check_thresholds(opts.taus)
    elif opts.taus is not None and not opts.taus:
        raise UsageError("--taus names nothing; give numbers separated by commas, e.g. --taus 0.1,0.5,1")
    if opts.sweep != "threshold":
        for t in opts.taus or []:  # each in --tau's range, in its words
            check_setting("tau", t, "--taus")
    for k in opts.recent_ks or []:
        check_setting("recent_k", k, "--recent-k")
    for n in opts.recent_steps or []:
        check_setting("recent_steps", n, "--recent-steps")
    if opts.recent_ks is not None:
        if not opts.recent_ks or len(set(opts.recent_ks)) != len(opts.recent_ks):
            raise UsageError(f"--recent-k {','.join(map(str, opts.recent_ks))}: give distinct whole numbers ≥ 0 "
                             "separated by commas, e.g. 16,32,64")
    if opts.recent_steps is not None:
        if not opts.recent_steps or len(set(opts.recent_steps)) != len(opts.recent_steps):
            raise UsageError(f"--recent-steps {','.join(map(str, opts.recent_steps))}: give distinct whole numbers ≥ 0 "
                             "separated by commas (0 = off), e.g. 0,4,8")
    if opts.block_refreshes is not None and (not opts.block_refreshes
                                             or len(set(opts.block_refreshes)) != len(opts.block_refreshes)):
        raise UsageError(f"block_refreshes {opts.block_refreshes}: give [False], [True] or [False, True]")
    from ..outputs import check_plot_name

    check_plot_name(opts.plot_path)



def own_arm(settings: Settings) -> Arm:
    """The arm of the resolved settings (flags over profile over EntropyCache's defaults)."""
    params = settings.cache_params
    block_tau = params.get("block_tau")
    return Arm(int(params.get("recent_k", EntropyCache.recent_k)), bool(params.get("block_refresh", False)),
               int(params.get("recent_steps", EntropyCache.recent_steps)),
               None if block_tau is None else float(block_tau), bool(params.get("refresh_prompt", True)))


def arms(opts: CalibrateOptions, settings: Settings) -> list[Arm]:
    """The arms searched: the product of ``opts.recent_ks``, ``opts.block_refreshes`` and
    ``opts.recent_steps`` (each defaulting to the resolved setting alone, so one arm without them),
    then ``opts.extra_arms`` not already in it. The product keeps the resolved block_tau and
    refresh_prompt, except when block refresh is searched (``--joint``: the paper's rule, both off)."""
    own = own_arm(settings)
    ks = opts.recent_ks if opts.recent_ks is not None else [own.recent_k]
    brs = opts.block_refreshes if opts.block_refreshes is not None else [own.block_refresh]
    rss = opts.recent_steps if opts.recent_steps is not None else [own.recent_steps]
    bt, rp = (None, True) if opts.block_refreshes is not None else (own.block_tau, own.refresh_prompt)
    out = [Arm(k, b, r, bt, rp) for r in rss for b in brs for k in ks]
    return out + [a for a in opts.extra_arms or [] if a not in out]


def preflight(task, opts: CalibrateOptions) -> None:
    """Checks that need no model: option ranges, and consent before any model-written code would run
    (a code task scored with ``--metric task`` needs ``--allow-code-execution``; UsageError, exit 2)."""
    validate(opts)
    if opts.metric == "task" and task.needs_code_execution:
        task.require_consent()


def check_outputs(opts: CalibrateOptions) -> None:
    """The files calibrate writes (``--out``, ``--json``, ``--plot``, ``--run-file``; ``--dry-run``: the
    ``--json`` and ``--plot`` reports alone), checked before any
    decoding (``outputs.check_file``). The profile itself is not locked: an empty lock file there would
    be read as an empty profile by another command meanwhile; its run file (beside it by default) is
    the lock of a calibration."""
    from ..outputs import check_distinct, check_file

    written = [(opts.json_path, "--json"), (opts.plot_path, "--plot")]  # --dry-run writes these reports only
    refuse_package_path(opts.out, "--out")  # under --dry-run too: a rehearsal refuses what the run would
    if not opts.dry_run:
        written = [(opts.out, "--out"), *written, (opts.run_file, "--run-file")]
    check_distinct(written, [(opts.data, "--data")])
    for path, flag in written:
        refuse_package_path(path, flag)
    for path, flag in written:
        check_file(path, flag, lock=flag != "--out")


def refuse_package_path(path, flag: str) -> None:
    """Refuse an output inside the installed package's ``profiles/`` folder (``config.packaged_profiles_dir``):
    those shipped profiles are read-only, so a calibration never replaces one (UsageError, exit 2,
    naming the folder to write to instead)."""
    from ..config import packaged_profiles_dir, profiles_dir

    if path is None or str(path) == "-":
        return
    shipped = packaged_profiles_dir()
    if Path(os.path.realpath(Path(path).expanduser())).is_relative_to(os.path.realpath(shipped)):
        raise UsageError(f"{flag} {path} is inside the installed package's profiles ({shipped}), which ecache never "
                         f"rewrites; write to {profiles_dir()} (the default) or another folder")


def default_run_file(model: str, task: str, out: Path | None) -> Path:
    """``profiles/<model>/.<task>.calib.jsonl``, or ``.<stem>.calib.jsonl`` beside ``--out`` (``task``: the
    profile's task name, :attr:`CalibrateOptions.profile_task`)."""
    target = out if out is not None else profile_path(model, task)
    return target.with_name(f".{target.stem}.calib.jsonl")


def run_file_path(model: str | None, opts: "CalibrateOptions") -> Path:
    """The run file a calibration of ``model`` (``--model`` as given, or the loaded model's name) writes:
    ``--run-file``, else :func:`default_run_file` in the model's profile folder; the one rule for the check
    before the load and for the run."""
    return opts.run_file or default_run_file(canonical_model_name(model), opts.profile_task, opts.out)


def check_profile_target(path: Path, model: str, task: str) -> None:
    """Fail early (before any decoding) when ``path`` holds another model's or task's profile; the same
    rule ``config.write_profile`` enforces when writing (``config.profile_target_error``)."""
    from ..config import profile_target_error

    if error := profile_target_error(path, model, task):
        raise ConfigError(error)


def weights_fingerprint(path: Path) -> str:
    """A cheap identity of a checkpoint's weights: SHA-256 over each ``*.safetensors`` file's name,
    size, first and last 64 KiB (so a retrained model never reuses stale run-file records)."""
    h, chunk = hashlib.sha256(), 1 << 16
    for f in sorted(Path(path).glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(chunk))
            if size > 2 * chunk:
                fh.seek(size - chunk)
                h.update(fh.read(chunk))
    return h.hexdigest()[:16]


class Evaluator:
    """Decodes the sample under one setting and returns its per-example records (run file first).

    A record: tau, index, id, chunk, text, token_ids (gen_length ids), answer_len, ended, score (0–1 or
    None), nfe, full_forwards, partial_forwards, cost (computed positions; a full forward counts the
    row's own prompt + gen length, so the number does not depend on batch padding), generated_tokens,
    wall_s (the batch's wall seconds / its rows), signals (per step of this row, the signal the policy
    compares with τ, in the signal's unit, full precision; None for -inf, a step that committed
    nothing), ``reused_from`` when copied from another τ's record, and ``arm`` (``Arm.as_record``)
    when decoded under an arm other than the run's own settings.

    ``arm``: the :class:`Arm` the next ``records`` calls decode with (None: the resolved settings');
    set by the search before each arm of a joint search.

    Reuse (exact, no decoding): a τ decision is ``signal > τ``, so a run at τ' makes the same decision
    as one at τ at every step whose signal lies outside (min(τ, τ'), max(τ, τ')]; same decisions mean
    the same forwards, hence the same tokens and signals (by induction over the steps). A batch whose
    rows' recorded signals under an evaluated τ' all avoid that interval is copied from τ' (its wall
    time too) instead of decoded (``tau_search.same_decisions``).
    """

    def __init__(self, engine: Engine, task, examples: list, prompt_ids: list[list[int]], settings: Settings,
                 opts: CalibrateOptions, store: RunFile, can_score: bool, progress=None, dist: DistEnv | None = None):
        self.engine, self.task, self.examples, self.prompt_ids = engine, task, examples, prompt_ids
        self.dist = dist or DistEnv()
        self.settings, self.opts, self.store, self.can_score = settings, opts, store, can_score
        self.signal = settings.cache_params.get("signal", "max-entropy")
        self.progress = progress
        self.arm: Arm | None = None
        self.own_arm = own_arm(settings)
        self.sweep = SWEEPS[opts.sweep]
        n, bs = len(examples), opts.batch_size
        order = sorted(range(n), key=lambda i: (len(prompt_ids[i]), i)) if bs > 1 else list(range(n))
        self.chunks = [order[s:s + bs] for s in range(0, n, bs)]  # fixed: a resumed run re-runs the same batches

    @property
    def tag(self) -> Arm | None:
        """The run-file arm of the records decoded now: None for ``none`` and for the run's own settings."""
        return None if self.arm is None or self.arm == self.own_arm else self.arm

    def records(self, tau: float | None) -> list[dict]:
        """Records of every example under ``tau`` (None = ``none``) and the current ``arm``, decoding only
        missing batches.

        Several ranks (``self.dist``): the batches go round by round, one per rank (batch c on rank
        c % world), and after each round every rank receives the round's records, so every rank holds
        the same records (and makes the same τ choices); rank 0's run file gets them as each round ends.
        """
        W = self.dist.world_size
        tag = None if tau is None else self.tag
        for start in range(0, len(self.chunks), W):
            new = []
            for c in range(start, min(start + W, len(self.chunks))):
                idx = self.chunks[c]
                missing = [i for i in idx if self.store.get(tau, i, tag) is None]
                if missing and self.dist.owns(c):
                    src = None if tau is None else self._reusable(tau, idx)
                    if src is not None:
                        recs = [{**self.store.get(src, i, tag), "tau": tau, "reused_from": src} for i in idx]
                    else:
                        recs = self._run_chunk(tau, c, idx)
                    new += [rec for rec in recs if rec["index"] in missing]
                if self.progress is not None:
                    self.progress(tau, len(idx))
            for part in self.dist.all_gather_object(new, "calibration records"):
                for rec in part:
                    self.store.add(rec)
        out = [self.store.get(tau, i, tag) for i in range(len(self.examples))]
        for rec in out:
            if rec.get("score") is None and self.can_score:  # e.g. decoded earlier under --metric fidelity
                rec["score"] = float(self.task.score(self.examples[rec["index"]], rec["text"]))
        return out

    def _reusable(self, tau: float, idx: list[int]) -> float | None:
        """An evaluated τ' of the same arm whose records of the batch ``idx`` provably equal τ's (nearest
        first), or None. (A block refresh does not depend on τ, so the rule holds within an arm.) None for
        a sweep without such a rule (a threshold's)."""
        tag = self.tag
        if not self.sweep.reuses:
            return None
        taus = sorted({t for t, _, a in self.store.records if t is not None and t != tau and a == tag},
                      key=lambda t: (abs(t - tau), t))
        for t in taus:
            recs = [self.store.get(t, i, tag) for i in idx]
            if all(r is not None and "signals" in r and same_decisions(r["signals"], t, tau) for r in recs):
                return t
        return None

    def _run_chunk(self, tau: float | None, c: int, idx: list[int]) -> list[dict]:
        policy, decode = self.sweep.setting(self.settings, tau, self.arm)
        run = self.engine.start([self.prompt_ids[i] for i in idx], decode, policy, seed=self.opts.seed,
                                row_ids=idx)  # an example's random stream: (seed, its index)
        signals: list[list[float]] = [[] for _ in idx]
        for step in run:
            sig = step.signal(self.signal).tolist()  # (B,) what the policy compares with τ, per active row
            for j, r in enumerate(step.rows.tolist()):
                signals[r].append(sig[j] if math.isfinite(sig[j]) else None)  # -inf: nothing committed
        out = []
        for j, (i, res) in enumerate(zip(idx, run.results())):
            st, pad = res.stats, run.P - len(self.prompt_ids[i])  # left padding of this row in the batch
            rec = {"tau": tau, "index": i, "id": self.examples[i].id, "chunk": c, "text": res.text,
                   "token_ids": res.token_ids, "answer_len": len(res.answer_ids), "ended": res.ended,
                   "score": float(self.task.score(self.examples[i], res.text)) if self.can_score else None,
                   "nfe": st["nfe"], "full_forwards": st["full_forwards"], "partial_forwards": st["partial_forwards"],
                   "cost": st["tokens_planned"] - st["full_forwards"] * pad,  # batch-independent
                   "generated_tokens": st["generated_tokens"], "prompt_tokens": st["prompt_tokens"],
                   "wall_s": run.wall_s / len(idx), "signals": signals[j]}
            if tau is not None and self.tag is not None:
                rec["arm"] = self.tag.as_record()
            out.append(rec)
        return out


def run_key(lm, settings: Settings, task, opts: CalibrateOptions, prompt_ids: list[list[int]], shots: int,
            chat: bool) -> dict:
    """Everything that changes what a run-file record holds (compared on --resume)."""
    data_sha = None
    files = task.data_files() if hasattr(task, "data_files") else (
        [task.data_path()] if getattr(task, "synthetic", False) is False and hasattr(task, "data_path") else [])
    if files:
        h = hashlib.sha256()
        for p in files:
            h.update(p.read_bytes() if p.is_file() else b"missing")
        data_sha = h.hexdigest()[:16] if len(files) > 1 or files[0].is_file() else None
    prompts_sha = hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()[:16]
    params = settings.cache_params
    return {"model": canonical_model_name(lm.name), "task": opts.task, "data_sha256": data_sha, "limit": opts.limit,
            "seed": opts.seed, "shots": shots, "chat": chat, "decode": settings.decode.as_dict(),
            "signal": params.get("signal", "max-entropy"), "recent_k": params.get("recent_k"),
            "block_refresh": params.get("block_refresh", False),
            **({"recent_steps": params["recent_steps"]} if params.get("recent_steps") else {}),
            **({"block_tau": params["block_tau"]} if params.get("block_tau") is not None else {}),
            **({"refresh_prompt": False} if params.get("refresh_prompt") is False else {}),
            **_arms_key(opts, settings),
            "batch_size": opts.batch_size, **({"sweep": opts.sweep} if opts.sweep != "tau" else {}),
            "dtype": str(lm.dtype).replace("torch.", ""), "device": lm.device.type,
            **({"quantize": settings.quantize} if settings.quantize else {}),
            "config_sha256": lm.config_hash[:16], "weights": weights_fingerprint(lm.path),
            "prompts_sha256": prompts_sha}  # checked in this order: the flags a user sets come first


def _arms_key(opts: CalibrateOptions, settings: Settings) -> dict:
    """``{"arms": [Arm.as_record(), ...]}`` for a joint search, else {} (a one-arm run's key holds its
    recent_k and block_refresh already)."""
    a = arms(opts, settings)
    return {"arms": [x.as_record() for x in a]} if len(a) > 1 else {}


def calibrate(lm, settings: Settings, task, opts: CalibrateOptions, err_console=None,
              dist: DistEnv | None = None) -> Outcome:
    """Run the whole search (see the module docstring) and write the profile unless ``dry_run``.

    ``err_console``: a rich Console for progress lines (None or ``opts.quiet``: silent).
    ``dist``: several ranks (torchrun) share the batches (``Evaluator.records``); every rank returns the
    same Outcome, and only rank 0 writes the run file and the profile.
    A block-diffusion model (``lm.spec.block_causal``) gets the decoder's threshold searched instead of τ
    (``runs/calib_sweep.py``).
    Returns an :class:`Outcome` (its ``profile`` is None when nothing qualified or with dry-run).
    Raises EcacheError subclasses (bad data, settings mismatch with the run file, ...).
    """
    if getattr(lm.spec, "block_causal", False):
        opts, settings = replace(opts, sweep="threshold"), sweep_base(settings)
    preflight(task, opts)
    opts = replace(opts, parallel=settings.decode.parallel)  # a threshold sweep's base decodes one token per step
    model = canonical_model_name(lm.name)
    target = opts.out if opts.out is not None else profile_path(model, opts.profile_task)
    if not opts.dry_run:
        _check_target(target, model, opts)
    sample = _Sample.encode(lm, task, opts)
    run_path = run_file_path(lm.name, opts)
    dist = dist or DistEnv()
    # a threshold mode the decode settings cannot run fails here, before any decoding
    clock = _wall_clock(sample, settings, opts, dist) if opts.speed_check else None
    store = _open_run_file(lm, settings, task, opts, sample, run_path, dist)
    say = (lambda *a, **k: None) if opts.quiet or err_console is None else err_console.print
    if store.loaded:
        torn = " (a torn last line was dropped)" if store.dropped_partial else ""
        say(f"resuming from {run_path}: {store.loaded} records{torn}")
    search = _Search(opts, say, err_console, arms(opts, settings), sample.groups)
    try:
        with _Progress(err_console, opts.quiet, len(sample.examples), opts.sweep) as progress:
            search.run(Evaluator(sample.engine, task, sample.examples, sample.prompt_ids, settings, opts, store,
                                 sample.can_score, progress, dist))
    except KeyboardInterrupt:
        if not opts.dry_run and err_console is not None:
            err_console.print(f"calibrate: records so far are in {run_path}; rerun with --resume to continue")
        raise Interrupted(None if dist.active else search.partial(run_path, store.loaded)) from None
    finally:
        store.close()
    outcome = replace(search.outcome(store, dist, run_path, len(sample.examples)), sweep=opts.sweep)
    _speed_check(outcome, search, clock, err_console if dist.is_main else None, say, dist.active)
    if outcome.choice.point is not None:
        _keep_choice(outcome, model, settings, opts, sample.shots, target, dist)
    return outcome


def sweep_base(settings: Settings) -> Settings:
    """The settings of a threshold sweep (block diffusion): the ``block`` cache and the decode settings
    without a parallel rule (the sweep sets the threshold; its profile is the task's own, not ``-parallel``)."""
    return replace(settings, cache="block", cache_params={},
                   decode=replace(settings.decode, threshold=None, factor=None))


def _wall_clock(sample: "_Sample", settings: Settings, opts: CalibrateOptions, dist: DistEnv):
    """The speed check's timing function over ``--speed-check-limit`` examples of the sample, evenly
    spaced (``speed_guard.spread``): a :class:`WallClock`, or a threshold sweep's ``ReferenceClock``. Raises
    UsageError when threshold decoding at the run's ``--threshold`` (else 0.9), or plain decoding,
    cannot run with these decode settings."""
    idx = spread(len(sample.prompt_ids), opts.speed_check_limit)
    if opts.sweep == "threshold":
        guard = ReferenceGuard(threshold=None, examples=len(idx), tries=opts.speed_check_tries)
        return ReferenceClock(sample.engine, settings, [sample.prompt_ids[i] for i in idx], guard, opts.batch_size,
                              opts.seed, dist)
    guard = SpeedGuard(threshold=mode_threshold(settings.decode, opts.speed_check_threshold), examples=len(idx),
                       tries=opts.speed_check_tries, own="threshold" if opts.parallel else "plain")
    return WallClock(sample.engine, settings, [sample.prompt_ids[i] for i in idx], guard, opts.batch_size,
                     opts.seed, dist)


def _speed_check(outcome: "Outcome", search: "_Search", clock, err_console, say, ranks: bool = False) -> None:
    """Run the wall-clock speed check (``runs/speed_guard.py``) over the proxy ranking and set
    ``outcome.choice`` to its verdict and ``outcome.speed_check`` to its JSON entry. ``clock``: a
    :class:`WallClock` (or any callable point -> (plain, threshold) speedups with a ``guard``), None
    with ``--no-speed-check``; ``err_console``: where rejections are printed (None: nowhere); ``ranks``:
    several ranks run (a Ctrl-C then carries no partial outcome). Ctrl-C raises :class:`Interrupted`
    with the search's points and no choice (the records are whole: ``--resume`` redoes only the check)."""
    if clock is None:
        outcome.speed_check = {"enabled": False}
        return
    try:
        _run_guard(outcome, search, clock, err_console, say)
    except KeyboardInterrupt:
        if err_console is not None and not search.opts.dry_run:
            err_console.print(f"calibrate: records are in {outcome.run_file}; rerun with --resume to redo the speed "
                              "check")
        raise Interrupted(None if ranks else replace(
            outcome, choice=Choice(None, "interrupted during the speed check: no setting chosen", []))) from None


def _guard_line(line: str, say) -> None:
    """A line of the speed check (``SpeedGuard.run``): its warning (``speed check: warning: …``) as a warning
    (``warning: speed check: …``, printed under ``-q`` too), the others (a candidate rejected or skipped) as
    status lines through ``say`` (none under ``-q``)."""
    from ..console import warn

    if line.startswith("speed check: warning: "):
        warn("speed check: " + line.removeprefix("speed check: warning: "))
    else:
        say(line, markup=False, highlight=False)


def _run_guard(outcome: "Outcome", search: "_Search", clock, err_console, say) -> None:
    """:func:`_speed_check`'s work: nothing to time without a proxy choice; else ``SpeedGuard.run`` over
    ``tau_search.ranking`` and its verdict as the choice (its reason carrying both speedups)."""
    guard, opts = clock.guard, search.opts
    if outcome.choice.point is None:
        outcome.speed_check = guard.document(None, opts.batch_size)
        return
    cands = ranking(outcome.points, outcome.base, opts.metric, *opts.fractions())
    warn = None if err_console is None else (lambda line: _guard_line(line, say))
    modes = "" if opts.sweep == "threshold" else f", plain and threshold {guard.threshold:g}"
    say(f"speed check: timing {cands[0].label()} against {guard.against} on {guard.examples} example(s){modes} "
        f"({guard.passes} passes{'' if opts.sweep == 'threshold' else ' each'})")
    verdict: Verdict = guard.run(cands, clock, same=search.decides_alike, warn=warn)
    outcome.speed_check = guard.document(verdict, opts.batch_size)
    if verdict.point is None:
        outcome.choice = Choice(None, guard.no_choice_reason(verdict), outcome.choice.qualifying, "wall")
        return
    reason = chosen_reason(verdict.point, outcome.base, opts.metric, opts.fractions()[0])
    outcome.choice = Choice(verdict.point, f"{reason}; wall clock {guard.speeds(verdict.chosen)}",
                            outcome.choice.qualifying)


def _check_target(target: Path, model: str, opts: CalibrateOptions) -> None:
    """Before decoding: the profile to write holds no other model's or task's profile and is writable
    (the default folder profiles/<model>/ is created silently)."""
    from ..outputs import check_file

    check_profile_target(target, model, opts.profile_task)
    check_file(target, "--out" if opts.out is not None else "the profile", announce=opts.out is not None,
               lock=False)  # the run file beside it is the calibration's lock (claimed in _open_run_file)


@dataclass
class _Sample:
    """The examples calibrated on and their prompts: ``shots`` solved examples each, the chat template
    applied when ``chat``; ``prompt_ids`` the token ids of each prompt."""

    examples: list
    shots: int | list[int]
    chat: bool
    engine: Engine
    prompt_ids: list[list[int]]
    can_score: bool
    groups: dict[str, list[int]] | None = None

    @classmethod
    def encode(cls, lm, task, opts: CalibrateOptions) -> "_Sample":
        """Draw ``--limit`` test examples by ``--seed`` and encode their prompts. Raises DataError for a
        missing data file and UsageError for a task without test examples, before decoding."""
        examples = task.examples("test", opts.limit, opts.seed)
        if not examples:
            raise UsageError(f"task {opts.task} has no test examples to calibrate on")
        shots = task.default_shots if opts.shots is None else opts.shots
        chat = lm.chat if opts.chat is None else (opts.chat and lm.chat)
        engine = Engine.from_loaded(lm)
        prompt_ids = encode_task_prompts(engine, [task.prompt(ex, shots, opts.seed) for ex in examples],
                                         [task.prompt_examples(ex, shots, opts.seed) for ex in examples], chat)
        can_score = task.can_score
        groups = task.groups(examples) if hasattr(task, "groups") else None
        return cls(examples, shots, chat, engine, prompt_ids, can_score, groups)


def _open_run_file(lm, settings: Settings, task, opts: CalibrateOptions, sample: _Sample, run_path: Path,
                   dist: DistEnv) -> RunFile:
    """Claim the run file on rank 0 (one writer per run file: another process fails at once) and open
    it on every rank (the others only read it, for --resume)."""
    if not opts.dry_run and dist.is_main:
        from ..outputs import claim

        claim(run_path, "--run-file")
    key = run_key(lm, settings, task, opts, sample.prompt_ids, sample.shots, sample.chat)
    return dist.agree(lambda: RunFile(run_path, key, resume=opts.resume, dry_run=opts.dry_run or not dist.is_main),
                      "opening the run file")


def zero_score_warning(base: Point, opts: CalibrateOptions) -> str | None:
    """The warning for a ``--metric task`` search whose ``none`` point ``base`` scores 0 on the sample (or,
    with groups, on some group), else None. A τ's score drop is then ≤ 0 there, so ``--max-drop`` accepts
    every τ: the score says nothing, and only ``--min-fidelity`` (agreement with ``none``) can still
    reject a τ. The search goes on; the warning says what makes the score informative."""
    if opts.metric != "task" or base.score is None:
        return None
    zero = [g for g, p in (base.parts or {}).items() if p.score == 0]
    if base.score != 0 and not zero:
        return None
    where = (f"the {base.n} examples of --task {opts.task}" if base.score == 0 else
             f"group{'s' if len(zero) > 1 else ''} {', '.join(zero)} of --task {opts.task}")
    knob = KNOBS[base.knob]
    if opts.min_fidelity is not None:
        judge = f"cannot reject any {knob.name} there (--min-fidelity {opts.min_fidelity:g} still can)"
    else:
        judge = (f"cannot reject any {knob.name} there; add --min-fidelity 95 (agreement with {knob.base}) or use "
                 "--metric fidelity")
    return (f"{knob.base_phrase} scores 0% on {where}, so --max-drop {judge}; for a score that tells {knob.name}s "
            "apart use more examples (--limit), more shots (--shots), another task or another model")


class _Search:
    """The τ search as it goes (steps 2–4 of the module docstring): ``none``'s point ``base`` and its
    records, the sorted signals of its committed tokens, and the point of every (arm, τ) evaluated so
    far. ``arms``: the :class:`Arm` s searched (one: the plain τ search, whose points
    carry no arm); ``groups``: {group: example indices} when several groups are calibrated (each point
    then carries a part per group), else None."""

    def __init__(self, opts: CalibrateOptions, say, err_console, arms: list[Arm] | None = None,
                 groups: dict[str, list[int]] | None = None):
        self.opts, self.say, self.err_console = opts, say, err_console
        self.sweep = SWEEPS[opts.sweep]
        self.arms = arms if arms and opts.sweep == "tau" else [None]  # a threshold sweep has no cache knobs
        self.groups = groups
        self.base, self.base_recs, self.points, self.signals, self.ev = None, None, {}, [], None
        self.tags: dict[tuple, tuple | None] = {}  # (arm index, τ) -> the run-file arm of its records

    @property
    def joint(self) -> bool:
        return len(self.arms) > 1

    def run(self, ev: Evaluator) -> None:
        """The baseline, then per arm the coarse grid (or ``--taus``), then up to ``--refine`` bisection
        steps; a threshold sweep: the reference, the thresholds, the refinement (``calib_sweep``)."""
        self.ev = ev
        self._run_none()
        opts = self.opts
        if self.joint:  # the arms' HIGH_BLOCK_TAU, from this sample's none run
            self.arms = [arm.resolved(high_tau(self.signals)) for arm in self.arms]
        for a, arm in enumerate(self.arms):
            ev.arm = arm
            if self.joint:
                self.say(f"{arm.describe()}:")
            for tau in self.sweep.values(self.signals, opts):
                self._add(a, tau)
            for _ in range(opts.refine):
                mine = [p for (b, _), p in self.points.items() if b == a]
                tau = self.sweep.refine(mine, self.base, self.signals, opts)
                if tau is None:
                    break
                self._add(a, tau, " (refine)")
        ev.arm = None

    def _point(self, tau: float | None, recs: list[dict], arm: Arm | None = None) -> Point:
        """The aggregate of ``recs`` against ``none``'s, with its arm (joint search) and a part per group."""
        p = replace(aggregate(tau, recs, self.base_recs), knob=self.sweep.knob)
        if self.joint and arm is not None:
            p.recent_k, p.block_refresh, p.recent_steps, p.block_tau, p.refresh_prompt = arm
        if self.groups:
            p.parts = {g: replace(aggregate(tau, [recs[i] for i in idx], [self.base_recs[i] for i in idx]),
                                  knob=self.sweep.knob) for g, idx in self.groups.items() if idx}
        return p

    def _run_none(self) -> None:
        """Decode ``none`` (a threshold sweep: its reference); its committed tokens' signals are the
        distribution τ's grid is drawn from. Raises EcacheError when a τ search's ``none`` committed nothing."""
        self.base_recs = self.ev.records(None)
        self.base = self._point(None, self.base_recs)
        self.say(f"{self.base.label()}: {_summary(self.base)}")
        warning = zero_score_warning(self.base, self.opts)
        if warning is not None and self.err_console is not None:
            self.err_console.print("warning: " + warning, style="yellow", markup=False, highlight=False)
        self.signals = sorted(s for r in self.base_recs for s in r["signals"] if s is not None)
        if not self.signals and self.sweep.knob == "tau":
            raise EcacheError("the none run committed no tokens, so there is no signal to calibrate on")

    def _add(self, a: int, tau: float, note: str = "") -> None:
        self.points[(a, tau)] = self._point(tau, self.ev.records(tau), self.arms[a])
        self.tags[(a, tau)] = self.ev.tag
        self.say(f"{self.points[(a, tau)].label()}{note}: {_summary(self.points[(a, tau)])}")

    def decides_alike(self, a: Point, b: Point) -> bool:
        """True when ``a`` provably decides exactly as ``b`` on every example: same arm, and no signal of
        ``b``'s records lies between the two τs (``tau_search.same_decisions``), so both run the same
        forwards (``Evaluator``'s reuse rule)."""
        ka, kb = self._key(a), self._key(b)
        if ka is None or kb is None or ka[0] != kb[0] or not self.sweep.reuses:
            return False
        recs = [self.ev.store.get(b.tau, i, self.tags[kb]) for i in range(len(self.base_recs))]
        return all(r is not None and "signals" in r and same_decisions(r["signals"], b.tau, a.tau) for r in recs)

    def _key(self, p: Point) -> tuple | None:
        """The (arm index, τ) of the evaluated point with ``p``'s setting, or None."""
        return next((k for k, q in self.points.items()
                     if (q.tau, q.arm()) == (p.tau, p.arm())), None)

    def _ordered(self) -> list[tuple[tuple, Point]]:
        return sorted(self.points.items(), key=lambda kv: (kv[0][0], self.sweep.order(kv[0][1])))

    def partial(self, run_path: Path, resumed: int) -> "Outcome | None":
        """What finished before a Ctrl-C: ``none`` and the τs done, no choice; None before ``none`` ended."""
        if self.base is None or (not self.signals and self.sweep.knob == "tau"):
            return None
        pts = [p for _, p in self._ordered()]
        return Outcome(base=self.base, points=pts, frontier=pareto_frontier([self.base, *pts], self.opts.metric),
                       choice=Choice(None, f"interrupted before the search ended: no {self.sweep.name} chosen", []),
                       signal_summary=self._signal_summary(), profile=None, profile_data=None,
                       run_file=run_path, resumed_records=resumed, sweep=self.sweep.knob)

    def _signal_summary(self) -> dict | None:
        """The none run's signal distribution (τ's grid is drawn from it); None for a threshold sweep."""
        return _signal_summary(self.ev.signal, self.signals) if self.sweep.knob == "tau" else None

    def outcome(self, store: RunFile, dist: DistEnv, run_path: Path, n: int) -> "Outcome":
        """The finished search: every point (by arm, then ascending τ), the frontier and the choice rule's
        pick. Several ranks ran side by side: the wall-clock figures are over the slowest rank."""
        base, base_recs = self.base, self.base_recs
        pts = [p for _, p in self._ordered()]
        if dist.active:
            base = parallel_wall(base, base_recs, base, base_recs, dist.world_size)
            pts = [parallel_wall(p, [store.get(p.tau, i, self.tags[key]) for i in range(n)], base, base_recs,
                                 dist.world_size) for key, p in self._ordered()]
        choice = choose(pts, base, self.opts.metric, *self.opts.fractions())
        return Outcome(base=base, points=pts, frontier=pareto_frontier([base, *pts], self.opts.metric), choice=choice,
                       signal_summary=self._signal_summary(), profile=None, profile_data=None,
                       run_file=run_path, resumed_records=store.loaded, sweep=self.sweep.knob)


def _keep_choice(outcome: "Outcome", model: str, settings: Settings, opts: CalibrateOptions, shots: int,
                 target: Path, dist: DistEnv) -> None:
    """The chosen τ as profile data (``outcome.profile_data``), written to ``target`` by rank 0 unless
    ``dry_run`` (every rank has the same outcome)."""
    from .calib_report import profile_data

    run_path = outcome.run_file
    beside = run_path.parent.resolve() == target.parent.resolve()  # the run file sits beside the profile
    shown = run_path.name if beside else str(run_path)
    outcome.profile_data = profile_data(model, settings, opts, outcome.choice.point, outcome.base, shots, shown,
                                        outcome.speed_check)
    if not opts.dry_run:
        from ..config import write_profile

        if dist.is_main:
            write_profile(target, outcome.profile_data)
        outcome.profile = target


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during the search; ``outcome``: the partial :class:`Outcome` (``none`` and the τs that
    finished, no choice), or None when ``none`` had not finished."""

    def __init__(self, outcome: "Outcome | None"):
        super().__init__()
        self.outcome = outcome


def _signal_summary(kind: str, signals: list[float]) -> dict:
    """The none run's signal distribution: its kind, step count, min, max, median (sorted ``signals``)."""
    return {"kind": kind, "n_steps": len(signals), "min": signals[0], "max": signals[-1],
            "median": signals[len(signals) // 2]}


def parallel_wall(p: Point, recs: list[dict], base: Point, base_recs: list[dict], world: int) -> Point:
    """``p`` with wall_s, tokens/s and the wall-clock speedup over ``none`` taken across ``world`` ranks
    that ran side by side: a record's batch ran on rank chunk % world (``Evaluator.records``), a rank's
    time is the sum of its records' wall_s, and the run's time is the slowest rank's
    (``distributed.aggregate_speed``). The cost proxy and the choice do not depend on it."""
    from ..distributed import aggregate_speed

    def per_rank(rs):
        ranks = [{"generated_tokens": 0, "wall_s": 0.0} for _ in range(world)]
        for r in rs:
            ranks[r["chunk"] % world]["generated_tokens"] += r["generated_tokens"]
            ranks[r["chunk"] % world]["wall_s"] += r["wall_s"]
        return aggregate_speed(ranks)

    mine, ref = per_rank(recs), per_rank(base_recs)
    return replace(p, wall_s=mine["wall_s"], tokens_per_s=mine["tokens_per_s"],
                   speedup_wall=ref["wall_s"] / mine["wall_s"] if mine["wall_s"] > 0 else 0.0)


def _summary(p: Point) -> str:
    score = "n/a" if p.score is None else f"{100 * p.score:.1f}%"
    work = f"{p.tpf:.2f} tokens/forward" if p.knob == "threshold" else f"refresh {100 * p.refresh_rate:.0f}%"
    return (f"score {score}, fidelity {100 * p.fidelity:.1f}%, {p.speedup:.2f}× (cost proxy), "
            f"{p.speedup_wall:.2f}× (wall), {work}, NFE {p.nfe:.1f}")


_UNSET = object()  # no setting evaluated yet


class _Progress:
    """The setting being evaluated and its examples done (``calibrate τ=0.5 3/8``, rate and ETA of that
    setting), on one line redrawn in place on a terminal, periodic plain lines off it
    (``terminal.Counter``: every command's format); nothing under ``-q``."""

    def __init__(self, console, quiet: bool, n: int, knob: str = "tau"):
        from ..terminal import Counter, ProgressLine

        self.line, self.n, self.knob = ProgressLine(console, quiet), n, knob
        self.count = Counter(self.line, "calibrate", n, "examples")
        self.tau, self.done = _UNSET, 0
        self.last = self.count.t0  # when the last examples were done: the next setting starts there

    def __enter__(self):
        self.line.__enter__()
        return self.advance if self.line.active else None

    def advance(self, tau, k: int) -> None:
        import time

        if tau != self.tau:  # the settings run one after another: this one began when the last one ended
            label = KNOBS[self.knob].base if tau is None else f"{KNOBS[self.knob].name}={tau:g}"
            self.tau, self.done = tau, 0
            self.count.restart(f"calibrate {label}", self.n)
            self.count.t0 = self.last
        self.done += k
        self.count.update(self.done)
        self.last = time.monotonic()

    def __exit__(self, *exc):
        return self.line.__exit__(*exc)
