"""The denoising engine: one loop for every cache policy and every model family.

``Engine.start(...)`` returns a :class:`Run`; iterating it yields one :class:`StepRecord` per
denoising step, so ``generate`` decodes, ``profile`` times, ``trace-drift`` measures beside each step
and ``calibrate`` sweeps, all over this one loop.

Per step: the policy plans (which rows refresh, which positions the others compute, what else the
forward must do), the step's forwards run over the run's KV store (``engine/forward.py``), the
decoder samples the logits and chooses each row's commits (``decoding/step.py``), the policy
observes the result, finished rows retire and every row's clock moves on. Each row keeps its own
clock (block, step in block, own step count), so rows may be at different blocks in one step, a row
that has finished its block goes straight on to the next, and a prompt decodes the same alone or in
any batch. Rows join between steps (:meth:`Run.add`) and leave as soon as their answer has ended.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from ..contract.hooks import ModelProbe
from ..contract.rows import compact_order, padded_index
from ..contract.state import DecodeState, StepRecord
from ..decoding.commit import warn_ignored_settings
from ..decoding.config import DecodeConfig
from ..decoding.step import StepDecoder
from ..decoding.streams import RowStreams
from ..errors import UsageError
from ..metrics.step_timer import StepTimer
from ..models.prompting import CHAT_ROLES, check_prompt_ids, encode_prompts
from . import forward
from .canvas import apply_commits, new_canvas, reused, write_reused
from .checks import check_ids, check_prompts, check_start, prompt_too_long
from .ledger import GenerationResult, Ledger

_NO_RANGE = contextlib.nullcontext()  # reusable: what ``Run._range`` returns when ranges are off


class Engine:
    """Runs denoising over a model. ``model(tokens, store, query_pos, logits_pos, ...)`` computes;
    ``spec`` gives the mask/EOS/EOT ids and the logit shift; ``tokenizer`` encodes and decodes."""

    def __init__(self, model, tokenizer, spec):
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.device = next(model.parameters()).device
        vocab = len(tokenizer) if tokenizer is not None else spec.vocab_size
        # the block-diffusion loops propose the mask id like any token (a step may then leave a mask, or with
        # token editing turn a token back into one); the others never choose it
        banned = [] if spec.block_causal else [spec.mask_id]
        banned += list(range(vocab, spec.vocab_size))
        self.banned = torch.tensor(sorted(set(banned)), dtype=torch.long, device=self.device)
        self.end_ids = torch.tensor(spec.end_ids, device=self.device)

    @classmethod
    def from_loaded(cls, lm) -> "Engine":
        """Build from a :class:`ecache_cli.models.loader.LoadedModel`."""
        return cls(lm.model, lm.tokenizer, lm.spec)

    def encode(self, prompts: Sequence[str | list], chat: bool,
               roles: Sequence[str] = CHAT_ROLES) -> list[list[int]]:
        """Token ids of each prompt (``models/prompting.py``); UsageError as ``checks.check_prompts``
        (chat messages' roles: ``roles``, by default those ``--input`` takes: system, user, assistant; ``chat``
        True or False)."""
        check_prompts(self.spec, prompts, roles, chat)
        return encode_prompts(self.tokenizer, self.spec, prompts, chat)

    def check_prompt_ids(self, ids: Sequence[int]) -> str | None:
        """Why token ids cannot be a prompt, or None (``models/prompting.py`` ``check_prompt_ids``)."""
        return check_prompt_ids(self.spec, ids)

    def start(self, prompt_ids: Sequence[Sequence[int]], cfg: DecodeConfig, policy, seed: int = 0,
              row_ids: Sequence[int] | None = None, prompt_width: int | None = None, reuse=None) -> "Run":
        """Prepare a run over a batch of tokenized prompts; iterate it for StepRecords.

        ``policy``: a ``CachePolicy`` (``ecache_cli.cache.make_policy``). ``row_ids``: each prompt's index
        in the whole input (default 0..B-1); row b's random stream is ``row_generator(seed, row_ids[b])``, so
        a prompt decodes the same in any batch. ``prompt_width``: the canvas's prompt positions (default: the
        longest prompt); rows joining later (:meth:`Run.add`) must fit it. ``reuse``: per prompt, None or
        the K/V of its leading positions (:meth:`Run.add`)."""
        return Run(self, [list(p) for p in prompt_ids], cfg, policy, seed, row_ids, prompt_width, reuse)

    def generate(self, prompts: Sequence[str | list], cfg: DecodeConfig, policy, chat: bool = True, seed: int = 0,
                 row_ids: Sequence[int] | None = None) -> list[GenerationResult]:
        """Encode, run to the end, and return one :class:`GenerationResult` per prompt."""
        run = self.start(self.encode(prompts, chat), cfg, policy, seed, row_ids)
        for _ in run:
            pass
        return run.results()


class Run:
    """One denoising run over rows that may join and leave; iterate for StepRecords, then ``results()``."""

    def __init__(self, engine: Engine, prompts: list[list[int]], cfg: DecodeConfig, policy, seed: int,
                 row_ids: Sequence[int] | None = None, prompt_width: int | None = None, reuse=None):
        check_start(cfg, prompts, prompt_width, engine.spec, policy, seed)  # each prompt's ids, named by place
        spec = engine.spec
        self.decoder = StepDecoder.build(cfg, spec, engine.banned, engine.end_ids)
        warn_ignored_settings(cfg, spec.sampler)  # warnings.warn: IgnoredSetting
        self.blocks, self.rule = self.decoder.blocks, self.decoder.rule
        self.engine, self.cfg, self.policy, self.seed = engine, cfg, policy, seed
        self.P, self.G = max([len(p) for p in prompts] + [prompt_width or 0]), cfg.gen_length
        self.P = getattr(engine.model, "prompt_bucket", lambda p, g, n: p)(self.P, self.G, spec.max_positions)
        # generated positions (block diffusion: a row's last block decodes whole, ``canvas.new_canvas``)
        self.block_causal, self.width = spec.block_causal, self.G + (cfg.block_length - 1) * spec.block_causal
        if hasattr(policy, "check_model"):  # a policy made for the other kind of attention refuses the model
            policy.check_model(spec)
        if self.P + self.width > spec.max_positions:
            raise UsageError(prompt_too_long(spec, self.P, self.G, cfg.block_length))
        self.B, self.streams = len(prompts), RowStreams(seed, engine.device)
        self.ledger = Ledger(self.P + self.width, engine.device)
        self._joining, self._reuse = [], {}  # rows to join; joining row → K/V of its first positions (``add``)
        self._t0: float | None = None  # set when iteration starts
        ids = list(range(len(prompts))) if row_ids is None else [int(r) for r in row_ids]
        assert len(ids) == len(prompts), f"{len(ids)} row_ids for {len(prompts)} prompts"
        for p, r, kv in zip(prompts, ids, reuse or [None] * len(prompts)):
            self.add(p, r, kv)
        self.state = self._new_rows(self._joining)
        self.store = engine.model.new_store(self.state.key_mask, keep_hidden=policy.keeps_hidden,
                                            **({"block": cfg.block_length} if self.block_causal else {}))
        write_reused(self.store, self._joining, 0, self._reuse, self.P, self.ledger.prompts)
        self._joining.clear()
        self.state.probe = ModelProbe(engine.model, lambda: self.store)
        self.steps_done, self._gen_index = 0, torch.arange(self.width, device=engine.device)  # for _finished
        # step times on a clock without the model's compiling (--compile), looked up once (~1 µs a mark if not)
        paused = (lambda: engine.model.compile_s) if hasattr(engine.model, "compile_s") else None
        self.timer = StepTimer(engine.device.type == "cuda", paused=paused)
        self.wall_s = 0.0
        self.step_timing = False  # CUDA: True reads each step's times at once (one sync per step)
        self.ranges = False  # True: name each step section for torch.profiler (runs/tracing.py)
        # Optional measurement hook, called as on_forward(run, plan, query_pos, logits_pos, logits) right after
        # the step's forwards, before sampling (``run.state.tokens`` is the canvas they saw, ``run.store``
        # what they served). It must only look; its time counts in sampling_s. None costs nothing.
        self.on_forward = None

    # -- rows joining and leaving ---------------------------------------------------------------------

    def add(self, prompt_ids: Sequence[int], row_id: int | None = None, reuse: torch.Tensor | None = None) -> int:
        """Queue a tokenized prompt to join at the next step boundary (its first step is its own full forward
        under every shipped policy). Returns its index in the run (its place in ``results()``). ``row_id``: its
        random stream's index (default: that index). ``reuse``: K/V of its first positions (``canvas.write_reused``).
        Raises UsageError when the prompt is longer than the prompt width ``P`` or holds ids the model cannot take."""
        check_ids(self.engine.spec, prompt_ids, "Run.add prompt_ids", width=self.P)
        r = self.ledger.add(list(prompt_ids), row_id, 0.0 if self._t0 is None else self._now() - self._t0)
        self._joining.append(r)
        self._reuse[r] = reuse
        return r

    def _new_rows(self, rows: list[int]) -> DecodeState:
        """The decode state of run rows ``rows`` at their first step (``canvas.new_canvas``): block 0 with
        its schedule."""
        spec, dev, bl, P, G, n = self.engine.spec, self.engine.device, self.cfg.block_length, self.P, self.G, len(rows)
        tokens, key_mask, offset = new_canvas([self.ledger.prompts[r] for r in rows], P, G, self.width, bl,
                                              self.block_causal, spec.mask_id, spec.pad_id)
        tokens, key_mask = tokens.to(dev), key_mask.to(dev)
        zeros = torch.zeros(n, dtype=torch.long, device=dev)
        st = DecodeState(tokens=tokens, key_mask=key_mask, masked=tokens == spec.mask_id,
                         commit_order=torch.full_like(tokens, -1), commit_step=torch.full_like(tokens, -1),
                         n_committed=zeros, rows=torch.tensor(rows, dtype=torch.long, device=dev), block=zeros.clone(),
                         step_in_block=zeros.clone(), row_step=zeros.clone(), prompt_len=P, gen_length=G,
                         block_length=bl, logit_shift=spec.logit_shift, n_layers=spec.n_layers,
                         block_offset=None if offset is None else offset.to(dev),
                         block_done=torch.zeros(n, dtype=torch.bool, device=dev), mask_free_steps=zeros.clone(),
                         reused=torch.tensor([reused(self._reuse.get(r)) for r in rows], dtype=torch.long, device=dev))
        st.enter_blocks()
        st.schedule = self.rule.block_schedule(st.block_masked().sum(1))
        return st

    def _admit(self) -> None:
        """Bring the queued rows into the batch: their decode state, KV store rows (free slots) and policy state."""
        if not self._joining:
            return
        new, first = self._new_rows(self._joining), self.state.batch
        self.state.append_rows({name: getattr(new, name) for name in DecodeState.ROW_FIELDS})
        self.store.add_rows(new.key_mask)
        write_reused(self.store, self._joining, first, self._reuse, self.P, self.ledger.prompts)
        self._joining.clear()
        self.policy.add_rows(new)

    def _retire(self, done: torch.Tensor) -> None:
        """Copy rows ``done`` (B,) bool into the output canvas (masks → EOS) and drop them (``compact_order``)."""
        st, spec = self.state, self.engine.spec
        fin = done.nonzero().squeeze(1)
        tok = st.tokens[fin].masked_fill(st.tokens[fin] == spec.mask_id, spec.eos_id)
        self.ledger.finish(st.rows[fin], tok, self._now() - self._t0)
        keep = compact_order(done)
        st.select_rows(keep)
        self.store.select_rows(keep)
        self.policy.select_rows(keep)

    # -- the loop -------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[StepRecord]:
        with torch.inference_mode():
            yield from self._loop()

    def _loop(self) -> Iterator[StepRecord]:
        self._t0 = self._now()
        self.policy.reset(self.state)
        while True:
            self._admit()
            if self.state.batch == 0:
                break
            rec = self._step()
            rec.finished = self._finished()  # set before the consumer sees the record
            yield rec
            if bool(rec.finished.any()):
                self._retire(rec.finished)
            self._advance()
        self.timer.resolve()
        self.wall_s = self._now() - self._t0

    def _step(self) -> StepRecord:
        st, model = self.state, self.engine.model
        tmask = self.decoder.targets(st)  # (B, T) each row's block masks (kept on the state: the plan reads it free)
        had_masks = st.block_masked().any(1) if self.decoder.editing is not None else None  # editing's block end
        with self._range("ecache.decision.plan"):  # the marks time the policy's own call, not the range
            t0 = self.timer.mark()
            plan = self.policy.plan(st)
            t1 = self.timer.mark()
        merge = forward.MERGE_REFRESH and self.store.hidden is None
        grp = forward.group(plan, st, tmask, self.policy.name, merge)  # the step's one host sync
        targets, valid = padded_index(tmask, grp.targets, exact=True)  # (B, R)
        if st.batch > 1 or grp.targets == 0:  # a row without targets: its block start (never committed)
            targets = torch.where(valid.any(1, keepdim=True), targets, st.block_start[:, None])
        sources = targets - st.logit_shift if st.logit_shift else targets  # hidden states predicting them
        fwd = forward.run_forwards(model, st, self.store, plan, grp, sources, self._range, valid)
        t2 = t2b = self.timer.mark()
        outputs = {}
        if fwd.attn_pos is not None:  # outputs the policy asked for beyond logits: decision time
            with self._range("ecache.decision.outputs"):
                outputs = forward.extra_outputs(model, self.store, fwd)
            t2b = self.timer.mark()
        if self.on_forward is not None:
            self.on_forward(self, plan, fwd.query, sources, fwd.logits)
        with self._range("ecache.sampling_commit"):
            draw = self.streams.drawer(st.rows, self.ledger.row_ids, valid)  # each row from its own stream
            sampled, commit = self.decoder(fwd.logits, targets, valid, st, draw, fwd.produced)
            edited = apply_commits(st, targets, commit, sampled.x0, self.engine.spec.mask_id)
            st.block_done = self.decoder.block_done(st, had_masks, edited)
        rows, refresh = st.rows, plan.refresh
        self.ledger.count(rows, refresh, fwd.computed, fwd.planned)
        rec = StepRecord.of_step(sampled, step=st.step, block=st.block, step_in_block=st.step_in_block,
                                 rows=rows, refresh=refresh, computed=fwd.computed, query_width=fwd.width,
                                 targets=targets, valid=fwd.usable(valid), committed=commit, planned=fwd.planned,
                                 outputs=outputs)
        with self._range("ecache.decision.observe"):
            t3 = self.timer.mark()
            self.policy.observe(st, rec)
            t4 = self.timer.mark()
        self.timer.add(rec, (t0, t1, t2, t2b, t3, t4), now=self.step_timing)
        self.steps_done += 1
        return rec

    def _finished(self) -> torch.Tensor:
        """(B,) bool: rows fully decoded, or (early exit) whose answer has ended: an EOS/EOT before the first
        mask (a masked position holds the mask token, never an end marker). With token editing a row ends
        only with its block (a later step of the block may still rewrite its tokens)."""
        st, P, G = self.state, self.P, self.width
        gen_mask = st.masked[:, P:]  # (B, G)
        first_mask = torch.where(gen_mask, self._gen_index, G + 1).amin(1)  # (B,) G + 1: fully decoded
        first_end = torch.where(torch.isin(st.tokens[:, P:], self.engine.end_ids), self._gen_index, G).amin(1)
        done = first_end < first_mask if self.cfg.early_exit else first_mask > G  # first_end ≤ G when decoded
        return done if self.decoder.editing is None else done & st.block_done

    def _advance(self) -> None:
        """Move every row's clock on one step; a row whose block has no masks left (or, with a fixed
        schedule, has taken its steps) enters its next block with that block's schedule."""
        st = self.state
        st.step += 1
        st.row_step = st.row_step + 1
        st.step_in_block = st.step_in_block + 1
        done = st.block_done  # the decoder's rule: no mask left, or the schedule's steps taken, or (editing) more
        if not bool(done.any()):
            return
        st.block = torch.where(done, st.block + 1, st.block)
        st.step_in_block = torch.where(done, 0, st.step_in_block)
        st.mask_free_steps = torch.where(done, 0, st.mask_free_steps)
        st.enter_blocks()
        if st.schedule is not None:
            st.schedule = torch.where(done[:, None], self.rule.block_schedule(st.block_masked().sum(1)), st.schedule)
        past = ~(st.in_block() & st.key_mask).any(1)  # rows past their canvas's last block, without an end marker
        if bool(past.any()):
            self._retire(past)

    def _range(self, name: str):
        """A torch.profiler range named ``name`` when ``self.ranges`` is on, else a shared no-op context."""
        return torch.profiler.record_function(name) if self.ranges else _NO_RANGE

    def _now(self) -> float:
        return self.timer.clock()

    def results(self) -> list[GenerationResult]:
        """Per-row outputs in run order (``engine/ledger.py`` ``Ledger.results`` lists the stats)."""
        return self.ledger.results(self.engine.tokenizer, set(self.engine.spec.end_ids), self.P, self.wall_s, self.G)

