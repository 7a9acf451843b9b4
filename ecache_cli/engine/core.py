"""The denoising engine: one loop for every cache policy and both model families.

``Engine.start(...)`` returns a :class:`Run`; iterating it yields one :class:`StepRecord` per
denoising step (nanochat's generator pattern), so ``generate`` decodes, ``profile`` times,
``trace-drift`` measures beside each step and ``calibrate`` sweeps, all over this one loop.

Per step: the policy plans (which rows refresh, which positions the others compute), the model runs
the step's forwards over the request's KV store, the step's logits are sampled, the remasking rule
commits tokens of the current block, and the policy observes the result. A step whose rows all
refresh runs one full forward; otherwise one partial forward at the widest non-refreshing row's width
and, when some rows refresh, one full forward of those rows alone (``Run._forward``), so no row pays
for another row's refresh. ``computed`` counts what the forwards computed, padding included. Rows
whose answer has ended (an EOS/EOT with no mask before it) are filled with EOS and dropped from the
batch, so they stop costing forwards; the run stops when every row has finished. Under threshold
decoding a row that has finished the current block before the others is parked (``Run._park``: set
aside with its store rows and the policy's per-row state, no forward, plan or observe) until the block
ends, so every row takes only its own steps (``DecodeState.row_step``) and decides alone: a prompt
decodes the same in any batch. The canvas never
leaves the device inside the loop; the forward part of a step reads its scalars (widths, how many
rows refresh) in one host sync, never per position, and on CUDA step timings are CUDA events read
once per block.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from ..decoding.commit import CommitRule
from ..decoding.remasking import confidence_scores, validate_remasking
from ..decoding.sampling import sample
from ..decoding.schedule import default_steps, plan_blocks
from ..errors import DataError, UsageError
from .state import DecodeConfig, DecodeState, StepRecord

if TYPE_CHECKING:  # annotations only: importing cache here would cycle (cache.base -> engine.state)
    from ..cache.base import CachePolicy

_NO_RANGE = contextlib.nullcontext()  # reusable: what ``Run._range`` returns when ranges are off


@dataclass
class GenerationResult:
    """One prompt's output. token_ids: the gen_length generated ids; answer_ids: up to (excluding) the
    first EOS/EOT; text: answer_ids decoded without special tokens; stats: see ``Run.results``."""

    index: int
    prompt_ids: list[int]
    token_ids: list[int]
    answer_ids: list[int]
    text: str
    ended: bool
    stats: dict = field(default_factory=dict)


def padded_index(mask: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn a (B, T) bool mask into a (B, S) index of its True positions in ascending order.

    S is the largest row count, at least 1: ``width`` when the caller has already read it (no device
    sync; it must not be below the largest count, or rows are cut), else read from the device (one
    sync). Short rows are padded by repeating their first position (or 0 for an empty row); ``valid``
    (B, S) bool marks the real entries.
    """
    counts = mask.sum(1)  # (B,)
    S = max(int(counts.max()) if width is None else int(width), 1)
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :S]  # (B, S) True positions first
    valid = torch.arange(S, device=mask.device)[None, :] < counts[:, None]  # (B, S)
    return torch.where(valid, order, order[:, :1]), valid


def row_generator(seed: int, row_id: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The random stream of input row ``row_id`` under ``seed``: a torch.Generator on ``device``.

    Seeded with a 63-bit value that numpy's SeedSequence derives from (seed mod 2**64, row_id), the
    standard way to spawn independent streams from one seed, so streams of nearby seeds or rows do not
    overlap and a row's stream does not depend on the batch it is decoded in.
    """
    import numpy as np  # already imported by torch

    assert row_id >= 0, f"row_id {row_id} must be ≥ 0"
    state = np.random.SeedSequence([int(seed) % 2**64, int(row_id)]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(state) >> 1)


@dataclass(frozen=True)
class _Group:
    """How one step's forwards are grouped (``Run._group``): ``n_refresh`` rows refresh; ``part`` (B, T)
    bool positions of the partial forward (None when every row refreshes), ``width`` its query width;
    ``targets`` / ``attn`` the largest row counts of the block's masks and of the plan's attention rows;
    ``n_expand`` non-refreshing rows whose layer-selective plan expands from a layer < n_layers."""

    n_refresh: int
    part: torch.Tensor | None
    width: int
    targets: int
    attn: int
    n_expand: int = 0


class Engine:
    """Runs denoising over a model. ``model(tokens, store, query_pos, logits_pos)`` computes;
    ``spec`` gives the mask/EOS/EOT ids and the logit shift; ``tokenizer`` encodes and decodes."""

    def __init__(self, model, tokenizer, spec):
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.device = next(model.parameters()).device
        vocab = len(tokenizer) if tokenizer is not None else spec.vocab_size
        banned = [spec.mask_id] + list(range(vocab, spec.vocab_size))
        self.banned = torch.tensor(sorted(set(banned)), dtype=torch.long, device=self.device)
        self.end_ids = torch.tensor([i for i in (spec.eos_id, spec.eot_id) if i is not None], device=self.device)

    @classmethod
    def from_loaded(cls, lm) -> "Engine":
        """Build from a :class:`ecache_cli.models.loader.LoadedModel`."""
        return cls(lm.model, lm.tokenizer, lm.spec)

    def encode(self, prompts: Sequence[str | list], chat: bool) -> list[list[int]]:
        """Token ids of each prompt: a string, a list of chat messages ({role, content} dicts), or a list
        of token ids (ints: used as they are, no chat template; check them with ``check_prompt_ids``).

        With ``chat`` the tokenizer's chat template is applied (generation prompt appended) and the
        rendered text is tokenized without adding special tokens (the template carries the BOS,
        spec/models.md C1). Raises UsageError for an empty prompt or messages without a template.
        """
        tok, out = self.tokenizer, []
        for p in prompts:
            if isinstance(p, (list, tuple)) and not p:
                raise UsageError("a prompt is empty; give at least one token of text")
            if isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                why = self.check_prompt_ids(p)
                if why:
                    raise DataError(f"prompt {len(out) + 1}: {why}")
                out.append(list(p))
                continue
            if isinstance(p, list):
                if not getattr(tok, "chat_template", None):
                    raise UsageError("chat messages need a checkpoint with a chat template; pass a plain prompt")
                text = tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
            elif chat and getattr(tok, "chat_template", None):
                text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            else:
                text = p
            ids = tok(text, add_special_tokens=False)["input_ids"]
            if not ids:
                raise UsageError("a prompt is empty; give at least one token of text")
            out.append(list(ids))
        return out

    def check_prompt_ids(self, ids: Sequence[int]) -> str | None:
        """Why a prompt given as token ids cannot be decoded, as a one-line reason, or None if it can.

        Ids must be ints in [0, vocab_size) (the embedding rows) and never the mask id (a masked prompt
        position would be generated). Non-int entries are reported too.
        """
        spec = self.spec
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                return f"prompt_ids[{i}] = {t!r} is not an int token id"
            if not 0 <= t < spec.vocab_size:
                return f"prompt_ids[{i}] = {t} is outside the model's vocabulary [0, {spec.vocab_size})"
            if t == spec.mask_id:
                return f"prompt_ids[{i}] = {t} is the mask id; a prompt holds no mask tokens"
        return None if len(ids) else "prompt_ids is empty; give at least one token id"

    def start(self, prompt_ids: Sequence[Sequence[int]], cfg: DecodeConfig, policy: CachePolicy,
              seed: int = 0, row_ids: Sequence[int] | None = None) -> "Run":
        """Prepare a run over a batch of tokenized prompts; iterate it for StepRecords.

        ``row_ids``: each prompt's index in the whole input (default 0..B-1). Row b's random stream
        (Gumbel noise, random remasking) comes from ``row_generator(seed, row_ids[b])`` alone, so a
        prompt decodes the same whatever batch it lands in (``--seed 7 -b 1`` = ``--seed 7 -b 4``).
        """
        return Run(self, [list(p) for p in prompt_ids], cfg, policy, seed, row_ids)

    def generate(self, prompts: Sequence[str | list], cfg: DecodeConfig, policy: CachePolicy | str = "none",
                 chat: bool = True, seed: int = 0, row_ids: Sequence[int] | None = None) -> list[GenerationResult]:
        """Encode, run to the end, and return one :class:`GenerationResult` per prompt (``row_ids``: as
        in :meth:`start`, the prompts' indices in the whole input for batch-invariant sampling)."""
        if isinstance(policy, str):
            from ..cache import make_policy

            policy = make_policy(policy)
        run = self.start(self.encode(prompts, chat), cfg, policy, seed, row_ids)
        for _ in run:
            pass
        return run.results()


class Run:
    """One batched denoising run; iterate for StepRecords, then call ``results()``."""

    def __init__(self, engine: Engine, prompts: list[list[int]], cfg: DecodeConfig, policy: CachePolicy, seed: int,
                 row_ids: Sequence[int] | None = None):
        if not prompts:
            raise UsageError("no prompts to generate from")
        threshold_mode = cfg.threshold is not None or cfg.factor is not None
        validate_remasking(cfg.remasking, parallel=threshold_mode)
        if cfg.threshold is not None and cfg.factor is not None:
            raise UsageError("--threshold and --factor are two parallel-decoding rules; pass only one")
        self.plan = plan_blocks(cfg.gen_length, cfg.block_length, default_steps(cfg.gen_length, cfg.steps, threshold_mode),
                                threshold_mode)
        self.engine, self.cfg, self.policy, self.prompts = engine, cfg, policy, prompts
        spec, dev = engine.spec, engine.device
        self.rule = CommitRule.resolve(spec.family, self.plan, schedule=cfg.schedule, compat=cfg.compat,
                                       threshold=cfg.threshold, factor=cfg.factor,
                                       eps=spec.eps if cfg.eps is None else cfg.eps, remasking=cfg.remasking,
                                       alg_temp=cfg.alg_temp, low_eos_confidence=cfg.low_eos_confidence)
        B, P, G = len(prompts), max(len(p) for p in prompts), cfg.gen_length
        if P + G > spec.max_positions:
            fit = spec.max_positions - P
            fix = (f"lower --gen-length to at most {fit} or shorten the prompt" if fit > 0
                   else "shorten the prompt (fewer shots or less context)")
            raise UsageError(f"prompt ({P} tokens) + --gen-length {G} exceeds the model's {spec.max_positions} "
                             f"positions; {fix}")
        tokens = torch.full((B, P + G), spec.pad_id, dtype=torch.long)
        key_mask = torch.zeros(B, P + G, dtype=torch.bool)
        for b, p in enumerate(prompts):  # left padding
            tokens[b, P - len(p):P] = torch.tensor(p, dtype=torch.long)
            key_mask[b, P - len(p):] = True
        tokens[:, P:] = spec.mask_id
        tokens, key_mask = tokens.to(dev), key_mask.to(dev)
        self.P, self.G, self.B = P, G, B
        self.store = engine.model.new_store(key_mask, keep_hidden=getattr(policy, "needs_hidden", False))
        self.state = DecodeState(
            tokens=tokens, key_mask=key_mask, masked=tokens == spec.mask_id,
            commit_order=torch.full_like(tokens, -1), commit_step=torch.full_like(tokens, -1),
            n_committed=torch.zeros(B, dtype=torch.long, device=dev), rows=torch.arange(B, device=dev),
            prompt_len=P, gen_length=G, block_length=cfg.block_length, logit_shift=spec.logit_shift,
            n_layers=spec.n_layers, row_step=torch.zeros(B, dtype=torch.long, device=dev),
        )
        self._parked: list = []  # (state rows, store rows, policy rows) of rows waiting for the block's end
        self.final = tokens.clone()  # (B, T) canvas of every original row, filled as rows finish
        self.row_ids = list(range(B)) if row_ids is None else [int(r) for r in row_ids]
        assert len(self.row_ids) == B, f"{len(self.row_ids)} row_ids for {B} prompts"
        self._generators: list[torch.Generator] | None = None  # one stream per original row, made on first use
        self.seed = seed
        zeros = lambda dt=torch.long: torch.zeros(B, dtype=dt, device=dev)  # noqa: E731
        self.nfe, self.n_full, self.n_partial, self.computed = zeros(), zeros(), zeros(), zeros()
        self.planned = zeros()  # the plans' own positions (computed: what the forwards computed, padding included)
        self._cuda = dev.type == "cuda"
        self._pending: list = []  # (StepRecord, timing marks) not yet turned into seconds
        # CUDA: step times are read from events once per block (no per-step sync); True reads them after
        # every step (one sync per step) for consumers that need rec.forward_s as soon as a step is yielded.
        self.step_timing = False
        # Measurement switch: False runs a step whose rows have mixed plans as one forward padded to the
        # widest row (every row pays for a refresh), the engine's behaviour before issue 13.
        self.split_refresh = True
        self.finish_s = [0.0] * B
        self.steps_done = 0
        self.t_forward = self.t_decision = self.t_sampling = 0.0
        self.wall_s = 0.0
        self.ranges = False  # True: name each step section for torch.profiler (runs/tracing.py); off costs nothing
        # Optional measurement hook, called as on_forward(run, plan, query_pos, logits_pos, logits) right after
        # each model call, before sampling/commit (``run.state.tokens`` is the canvas the forward saw,
        # ``run.store`` holds what it served). It must only look (trace-drift captures, then measures
        # after the step is yielded); its time counts in sampling_s. None costs nothing.
        self.on_forward = None

    def _range(self, name: str):
        """A torch.profiler range named ``name`` when ``self.ranges`` is on, else a shared no-op context."""
        return torch.profiler.record_function(name) if self.ranges else _NO_RANGE

    def _now(self) -> float:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
        return time.perf_counter()

    def __iter__(self) -> Iterator[StepRecord]:
        with torch.inference_mode():
            yield from self._loop()

    def _loop(self) -> Iterator[StepRecord]:
        st, cfg, spec = self.state, self.cfg, self.engine.spec
        t_start = self._now()
        self.policy.reset(st)
        self._t0 = t_start
        for b in range(self.plan.num_blocks):
            if st.batch == 0:
                break
            st.block, st.step_in_block = b, 0
            st.block_start = self.P + b * cfg.block_length
            st.block_end = st.block_start + cfg.block_length
            spb = self.plan.steps_per_block
            schedule = self.rule.block_schedule(st.masked[:, st.block_start:st.block_end].sum(1))  # (B, spb) | None
            while st.batch > 0:
                if schedule is not None and st.step_in_block >= spb:
                    break
                left = st.masked[:, st.block_start:st.block_end].any(1)  # (B,) rows with masks in the block
                n_left = int(left.sum())
                if n_left == 0:
                    break
                if schedule is None and n_left < st.batch:
                    self._park(~left)  # threshold decoding: rows done with the block wait, taking no step
                rec = self._step(schedule)
                self._mark_finished(rec)  # rec.finished is set before the consumer sees the record
                yield rec
                keep = self._finish_rows(rec)
                if keep is not None and schedule is not None:
                    schedule = schedule[keep]
                st.step += 1
                st.step_in_block += 1
                st.row_step = st.row_step + 1
            self._unpark()
            self._resolve_times()  # CUDA: one sync per block reads the block's step timings
        if st.batch > 0:  # rows that used the whole canvas without an end marker
            self._retire(torch.arange(st.batch, device=st.tokens.device), ended=False)
        self.wall_s = self._now() - t_start

    def _park(self, idle: torch.Tensor) -> None:
        """Set rows ``idle`` (B,) bool aside until the block ends: their canvas, KV store rows and the
        policy's per-row bookkeeping leave the batch, so they take no step (no forward, no plan, no
        observe; their ``row_step`` stays) while the other rows finish the block. A row so decodes the
        same in any batch: alone it would go straight on to the next block."""
        st = self.state
        B = st.batch
        idx, keep = idle.nonzero().squeeze(1), (~idle).nonzero().squeeze(1)
        self._parked.append((st.take_rows(idx), self.store.take_rows(idx), self.policy.take_rows(idx, B)))
        st.select_rows(keep)
        self.store.select_rows(keep)
        self.policy.select_rows(keep, B)

    def _unpark(self) -> None:
        """Bring the parked rows back at the block's end, in their original order (``state.rows``)."""
        if not self._parked:
            return
        st = self.state
        for rows, store, pol in self._parked:
            st.append_rows(rows)
            self.store.append_rows(store)
            self.policy.append_rows(pol)
        self._parked.clear()
        B = st.batch
        order = torch.argsort(st.rows)
        st.select_rows(order)
        self.store.select_rows(order)
        self.policy.select_rows(order, B)

    def _step(self, schedule: torch.Tensor | None) -> StepRecord:
        st, cfg, eng = self.state, self.cfg, self.engine
        t0 = self._mark()
        with self._range("ecache.decision.plan"):
            if self.policy.needs_values:  # dLLM-Cache's similarity probe (layer-0 V): decision time
                st.value_probe = (eng.model.probe_values(st.tokens), self.store.v[0].transpose(1, 2).flatten(2))
            plan = self.policy.plan(st)
        t1 = self._mark()
        tmask = st.block_masked()  # (B, T) the masked positions of the current block
        group = self._group(plan, tmask)  # the step's one host sync: widths and how many rows refresh
        # targets: masked positions of the current block; sources: the rows whose logits predict them
        targets, valid = padded_index(tmask, group.targets)  # (B, R)
        # a row with no masks left in this block (threshold decoding, ragged rows) pads with position 0,
        # whose Dream source would be -1: pad it with the block start instead (never committed: ~valid)
        targets = torch.where(valid.any(1, keepdim=True), targets, st.block_start)
        sources = targets - st.logit_shift
        refresh = plan.refresh
        logits, query, computed, planned, width, split, attn_pos = self._forward(plan, group, sources)  # (B, R, V)
        t2 = self._mark()
        attention, t2b = None, t2
        if attn_pos is not None:  # weights the fused attention does not return: decision time
            with self._range("ecache.decision.attention"):
                probs = eng.model.attention_rows(self.store)  # per layer (B, A, T)
                for idx, sub in split:  # rows that ran a forward of their own (refresh, expansion)
                    probs = [p.index_copy(0, idx, q) for p, q in zip(probs, eng.model.attention_rows(sub))]
                attention = (attn_pos, probs)
            t2b = self._mark()
        if self.on_forward is not None:
            self.on_forward(self, plan, query, sources, logits)
        with self._range("ecache.sampling_commit"):
            # a row's draws per step, each from its own generator, in this order: token noise (temperature > 0),
            # the random / origin scores, the alg_temp keys; each one value (× V) per valid target
            drawn = cfg.remasking in ("random", "origin")
            # (original row, valid targets) per row, read in one host sync for every draw of the step
            counts = (torch.stack([st.rows, valid.sum(1)], 1).tolist()
                      if cfg.temperature > 0 or drawn or self.rule.alg_temp else None)
            noise = self._row_uniform(counts, valid.shape[1], logits.shape[-1]) if cfg.temperature > 0 else None
            sampled = sample(logits, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                             generator=None, banned_ids=self._banned(), uniform=noise,
                             dream_alg=self.rule.dream_alg(cfg.remasking))  # Dream's confidence under its rules
            del noise
            rand = self._row_uniform(counts, valid.shape[1]) if drawn else None  # (B, R)
            conf = confidence_scores(cfg.remasking, sampled, None, uniform=rand)  # (B, R) float64
            if cfg.low_eos_confidence:  # LLaDA confidence_eos_eot_inf: probability 0, still selectable
                conf = torch.where(torch.isin(sampled.x0, eng.end_ids), torch.zeros_like(conf), conf)
            conf = conf.masked_fill(~valid, float("-inf"))
            keys = self._row_uniform(counts, valid.shape[1]) if self.rule.alg_temp else None  # (B, R)
            commit = self.rule.select(conf, targets, valid, schedule, st.step_in_block, st.block_start,
                                      noise=keys)  # (B, R)
            commit &= valid
            self._apply(targets, commit, sampled.x0)
        rows = st.rows
        self.nfe[rows] += 1
        self.n_full[rows] += refresh.long()
        self.n_partial[rows] += (~refresh).long()
        self.computed[rows] += computed
        self.planned[rows] += planned
        rec = StepRecord(step=st.step, block=st.block, step_in_block=st.step_in_block, rows=rows, refresh=refresh,
                         computed=computed, query_width=width, targets=targets, valid=valid, committed=commit,
                         x0=sampled.x0, prob=sampled.prob, entropy=sampled.entropy, attention=attention,
                         planned=planned)
        t3 = self._mark()  # after the engine's own bookkeeping: decision_s is the policy's time alone
        with self._range("ecache.decision.observe"):
            self.policy.observe(st, rec)
        t4 = self._mark()
        self._pending.append((rec, (t0, t1, t2, t2b, t3, t4)))
        if not self._cuda or self.step_timing:
            self._resolve_times()
        self.steps_done += 1
        return rec

    def _group(self, plan, tmask: torch.Tensor) -> "_Group":
        """How this step's forwards are grouped, with the widths they need, read in one host sync.

        ``tmask`` (B, T) bool: the block's masked positions. Returns a :class:`_Group`: ``n_refresh``
        rows refresh; ``part`` (B, T) bool are the positions of the partial forward (a non-refreshing
        row's ``plan.compute``; a refreshing row only the sources of its targets and its attention rows,
        since its full forward follows), ``width`` its largest row count; ``targets`` and ``attn`` the
        largest row counts of ``tmask`` and ``plan.attn_rows``. Raises AssertionError when a
        non-refreshing row's ``compute`` misses the sources of its targets or its attention rows (a
        policy bug), after the sync that reads the widths.
        """
        st = self.state
        B, T = st.batch, st.length
        attn = plan.attn_rows
        counts = [tmask.sum(1).amax()]
        if attn is not None:
            counts.append(attn.sum(1).amax())
        if plan.compute is None:  # every row refreshes (ForwardPlan.full)
            values = torch.stack(counts).tolist()
            return _Group(B, None, T, values[0], values[1] if attn is not None else 0)
        refresh = plan.refresh[:, None]  # (B, 1)
        need = st.sources(tmask) if attn is None else st.sources(tmask) | attn  # (B, T)
        bad = (need & ~(plan.compute | refresh)).any()
        if self.split_refresh:
            part = torch.where(refresh, need, plan.compute)
        else:  # one padded forward: a refreshing row widens every row to T
            part = plan.compute | refresh
        L = st.n_layers
        expand = (plan.refresh.sum() * 0 if plan.start_layer is None
                  else (plan.start_layer.clamp(0, L).masked_fill(plan.refresh, L) < L).sum())
        values = torch.stack(counts + [expand, plan.refresh.sum(), part.sum(1).amax(), bad.long()]).tolist()
        n_expand, n_refresh, width, bad = values[-4:]
        assert not bad, (f"policy {self.policy.name} did not plan the positions whose logits (or attention rows) "
                         f"this step needs")
        return _Group(n_refresh, part, width, values[0], values[1] if attn is not None else 0, n_expand)

    def _forward(self, plan, group: "_Group", sources: torch.Tensor):
        """Run the step's forwards; returns (logits, query, computed, planned, width, split, attn_pos).

        Every row refreshes: one full forward (query None). Otherwise one partial forward over the
        whole batch at ``group.width`` (the widest row's ``compute``, padded by repeats), then, when some
        rows refresh, one full forward of those rows alone over a scratch store whose K/V are copied
        into their rows of the request's store, and whose logits replace theirs. A refreshing row so
        costs T plus its few positions of the partial forward, and no other row pays for it. Likewise,
        when only some rows of a layer-selective plan expand (``plan.start_layer`` < n_layers), the
        partial forward runs unexpanded and the expanding rows run again, expanded, on a copy of their
        store rows (``KVStore.take_rows``), so the other rows do not compute T from the first expanding
        layer on. ``split``: [(rows (n,) long, their store)] of these extra forwards, for their
        attention rows. ``split_refresh = False`` gives the single padded forward of before (issue 13).

        ``computed`` (B,) long counts what the forwards computed for each row, padding included
        (layer-averaged: a partial forward in which some row expands from layer m computes T positions
        for every row from m on, models/base.py ``_expand``); ``planned`` (B,) long the plan's own
        positions (T for a refreshing row; layer-averaged ``compute`` otherwise). ``width``: the
        partial forward's query width (T when every row refreshes). ``logits`` (B, R, V) as the model
        returns them for ``sources`` (B, R).
        """
        st, model = self.state, self.engine.model
        B, T, L = st.batch, st.length, st.n_layers
        dev = st.tokens.device
        attn_pos = None if plan.attn_rows is None else padded_index(plan.attn_rows, group.attn)[0]  # (B, A)
        if group.n_refresh == B:
            extra = {} if attn_pos is None else {"attn_pos": attn_pos}
            with self._range("ecache.forward.full"):
                logits = model(st.tokens, self.store, query_pos=None, logits_pos=sources, **extra)
            full = torch.full((B,), T, dtype=torch.long, device=dev)
            return logits, None, full, full, T, [], attn_pos
        query, _ = padded_index(group.part, group.width)  # (B, S)
        S = query.shape[1]
        refresh = plan.refresh
        extra = {} if attn_pos is None else {"attn_pos": attn_pos}
        own = plan.compute.sum(1)  # (B,)
        computed = torch.full((B,), S, dtype=torch.long, device=dev)
        sl = expand = None
        if plan.start_layer is not None:  # layer-selective recomputation (refreshing rows never expand)
            sl = plan.start_layer.clamp(0, L).masked_fill(refresh, L)  # (B,)
            own = (own * sl + T * (L - sl)) // L
            # some rows expand, others not: the expanding rows get a forward of their own below
            expand = self.split_refresh and 0 < group.n_expand < B
            if not expand and group.n_expand > 0:
                extra["expand_from_layer"] = sl
                m = sl.amin()  # from the first expanding layer on, every row of the forward computes T
                computed = ((S * m + T * (L - m)) // L).expand(B).clone()
        planned = torch.where(refresh, T, own)
        with self._range("ecache.forward.partial"):
            logits = model(st.tokens, self.store, query_pos=query, logits_pos=sources, **extra)  # (B, R, V)
        split = []
        if expand:
            # The expanding rows again, on a copy of their store rows: below their start layer the same S
            # positions (their K/V are rewritten with what they were), from it on every position from the
            # cached layer inputs; exactly their single expanded forward (models/base.py _expand).
            grows = sl < L  # (B,)
            idx = torch.argsort((~grows).to(torch.int8), stable=True)[:group.n_expand]  # (n,) expanding rows
            sub = self.store.take_rows(idx)
            sub_sl = sl[idx]
            extra = {"expand_from_layer": sub_sl} if attn_pos is None else {"expand_from_layer": sub_sl,
                                                                             "attn_pos": attn_pos[idx]}
            with self._range("ecache.forward.partial"):
                sub_logits = model(st.tokens[idx], sub, query_pos=query[idx], logits_pos=sources[idx], **extra)
            logits = logits.index_copy(0, idx, sub_logits)
            self.store.put_rows(idx, sub)
            m = sub_sl.amin()  # every row of that forward computes T from its first expanding layer on
            computed = computed + grows.long() * ((S * m + T * (L - m)) // L)
            split.append((idx, sub))
        if group.n_refresh > 0 and self.split_refresh:
            idx = torch.argsort((~refresh).to(torch.int8), stable=True)[:group.n_refresh]  # (n,) refreshing rows
            sub = self.store.scratch_rows(idx)
            extra = {} if attn_pos is None else {"attn_pos": attn_pos[idx]}
            with self._range("ecache.forward.full"):
                full_logits = model(st.tokens[idx], sub, query_pos=None, logits_pos=sources[idx], **extra)
            logits = logits.index_copy(0, idx, full_logits)
            self.store.put_rows(idx, sub)
            computed = computed + refresh.long() * T
            split.append((idx, sub))
        return logits, query, computed, planned, S, split, attn_pos

    def _mark(self):
        """A timing mark: ``time.perf_counter()`` on CPU; on CUDA an event recorded on the current stream
        (no host sync; read by ``_resolve_times``)."""
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _resolve_times(self) -> None:
        """Turn the pending steps' marks into their ``forward_s`` / ``sampling_s`` / ``decision_s``
        (seconds) and the run's totals. On CUDA: one sync on the last event, then event pairs (called once
        per block and at the run's end, or per step with ``step_timing``)."""
        if not self._pending:
            return
        if self._cuda:
            self._pending[-1][1][-1].synchronize()
            dt = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731  (milliseconds between events)
        else:
            dt = lambda a, b: b - a  # noqa: E731
        for rec, (t0, t1, t2, t2b, t3, t4) in self._pending:
            extra = dt(t2, t2b) if t2b is not t2 else 0.0
            rec.forward_s, rec.sampling_s = dt(t1, t2), dt(t2b, t3)
            rec.decision_s = dt(t0, t1) + dt(t3, t4) + extra
            self.t_forward += rec.forward_s
            self.t_sampling += rec.sampling_s
            self.t_decision += rec.decision_s
        self._pending.clear()

    @property
    def generators(self) -> list[torch.Generator]:
        """Row b's random stream ``row_generator(seed, row_ids[b])``, created on first use (greedy runs
        never draw, so they skip it)."""
        if self._generators is None:
            self._generators = [row_generator(self.seed, r, self.engine.device) for r in self.row_ids]
        return self._generators

    def _row_uniform(self, counts: list[list[int]], width: int, *tail: int) -> torch.Tensor:
        """U[0, 1) noise (B, width, *tail) float64, row by row from each original row's own generator.

        ``counts[b]`` = [original row, n]: row b draws exactly n × tail values (its valid targets, which
        come first in the padded index), so what it draws depends on its own progress only, never on the
        batch's padded width or on the other rows. Padding entries get 0.5 (finite; never committed).
        """
        dev = self.engine.device
        out = torch.full((len(counts), width, *tail), 0.5, dtype=torch.float64, device=dev)
        for b, (orig, n) in enumerate(counts):
            if n:
                out[b, :n] = torch.rand((n, *tail), dtype=torch.float64, device=dev, generator=self.generators[orig])
        return out

    def _banned(self) -> torch.Tensor:
        if self.cfg.ban_eos:
            return torch.cat([self.engine.banned, self.engine.end_ids])
        return self.engine.banned

    def _apply(self, targets: torch.Tensor, commit: torch.Tensor, x0: torch.Tensor) -> None:
        """Write committed tokens into the canvas and update the commit bookkeeping."""
        st = self.state
        hit = torch.zeros_like(st.tokens).scatter_add_(1, targets, commit.long()) > 0  # (B, T)
        new = torch.zeros_like(st.tokens).scatter_add_(1, targets, torch.where(commit, x0, 0))  # (B, T)
        st.tokens = torch.where(hit, new, st.tokens)
        st.masked = st.masked & ~hit
        rank = hit.long().cumsum(1) - 1  # order within the step: by position
        st.commit_order = torch.where(hit, st.n_committed[:, None] + rank, st.commit_order)
        st.commit_step = torch.where(hit, st.own_steps()[:, None].expand_as(rank), st.commit_step)
        st.n_committed = st.n_committed + hit.sum(1)

    def _mark_finished(self, rec: StepRecord) -> None:
        """Set ``rec.finished`` (B,) bool: rows fully decoded, or (early exit) whose answer has ended."""
        st = self.state
        gen_tok, gen_mask = st.tokens[:, self.P:], st.masked[:, self.P:]  # (B, G)
        idx = torch.arange(self.G, device=gen_tok.device)
        is_end = torch.isin(gen_tok, self.engine.end_ids) & ~gen_mask
        end_pos = torch.where(is_end, idx, self.G).amin(1)  # (B,)
        open_before = (gen_mask & (idx < end_pos[:, None])).any(1)
        done = ~gen_mask.any(1)
        if self.cfg.early_exit:
            done = done | ((end_pos < self.G) & ~open_before)
        rec.finished = done

    def _finish_rows(self, rec: StepRecord) -> torch.Tensor | None:
        """Retire the rows ``rec.finished`` marks (early exit); return the kept row indices, or None."""
        st = self.state
        done = rec.finished
        if not bool(done.any()):
            return None
        fin = done.nonzero().squeeze(1)
        self._retire(fin, ended=True)
        keep = (~done).nonzero().squeeze(1)
        st.select_rows(keep)
        self.store.select_rows(keep)
        self.policy.select_rows(keep, len(done))
        return keep

    def _retire(self, fin: torch.Tensor, ended: bool) -> None:
        """Copy finished rows (indices into the current batch) into the output canvas, masks → EOS."""
        st, spec = self.state, self.engine.spec
        tok = st.tokens[fin]
        tok = torch.where(tok == spec.mask_id, torch.full_like(tok, spec.eos_id), tok)
        orig = st.rows[fin]
        self.final[orig] = tok
        now = self._now() - self._t0
        for r in orig.tolist():
            self.finish_s[r] = now

    def results(self) -> list[GenerationResult]:
        """Per-prompt outputs with stats: nfe, full_forwards, partial_forwards, tokens_computed
        (positions the forwards computed for this row, summed over its steps, padding included: see
        ``StepRecord.computed``), tokens_planned (the plans' own positions, what the row would compute
        alone at batch 1), token_layer_share (tokens_computed x layers over full-recompute positions x
        layers, nfe x T), generated_tokens (answer tokens plus its end
        marker; prompt and EOS filler excluded), wall_s (seconds until the row finished),
        tokens_per_s (generated_tokens / wall_s)."""
        tok, spec, out = self.engine.tokenizer, self.engine.spec, []
        final = self.final[:, self.P:].tolist()
        end_ids = set(self.engine.end_ids.tolist())
        nfe, full, part, comp, planned = (t.tolist() for t in (self.nfe, self.n_full, self.n_partial, self.computed,
                                                               self.planned))
        T = self.P + self.G
        for b, ids in enumerate(final):
            end = next((i for i, t in enumerate(ids) if t in end_ids), None)
            answer = ids if end is None else ids[:end]
            gen = len(answer) + (1 if end is not None else 0)
            wall = self.finish_s[b] or self.wall_s
            stats = dict(nfe=nfe[b], full_forwards=full[b], partial_forwards=part[b], tokens_computed=comp[b],
                         tokens_planned=planned[b], token_layer_share=comp[b] / max(nfe[b] * T, 1), generated_tokens=gen,
                         prompt_tokens=len(self.prompts[b]), wall_s=wall, tokens_per_s=gen / wall if wall > 0 else 0.0)
            text = tok.decode(answer, skip_special_tokens=True) if tok is not None else ""
            out.append(GenerationResult(index=b, prompt_ids=self.prompts[b], token_ids=ids, answer_ids=answer,
                                        text=text, ended=end is not None, stats=stats))
        return out
