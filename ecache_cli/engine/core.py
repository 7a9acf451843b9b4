"""The denoising engine: one loop for every cache policy and both model families.

``Engine.start(...)`` returns a :class:`Run`; iterating it yields one :class:`StepRecord` per
denoising step (nanochat's generator pattern), so ``generate`` decodes, ``profile`` times,
``trace-drift`` measures beside each step and ``calibrate`` sweeps, all over this one loop.

Per step: the policy plans (which rows refresh, which positions the others compute), the model runs
one forward over the request's KV store, the step's logits are sampled, the remasking rule commits
tokens of the current block, and the policy observes the result. Rows whose answer has ended (an
EOS/EOT with no mask before it) are filled with EOS and dropped from the batch, so they stop costing
forwards; the run stops when every row has finished. The canvas never leaves the device inside the
loop; the loop syncs a few scalars per step (query width, whether every row refreshes), never per
position.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from ..decoding.remasking import confidence_scores, select_factor, select_threshold, select_topk, validate_remasking
from ..decoding.sampling import sample
from ..decoding.schedule import default_steps, num_transfer_tokens, plan_blocks
from ..errors import UsageError
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


def padded_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn a (B, T) bool mask into a (B, S) index of its True positions in ascending order.

    S is the largest row count (one device sync). Short rows are padded by repeating their first
    position (or 0 for an empty row); ``valid`` (B, S) bool marks the real entries.
    """
    counts = mask.sum(1)  # (B,)
    S = max(int(counts.max()), 1)
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :S]  # (B, S) True positions first
    valid = torch.arange(S, device=mask.device)[None, :] < counts[:, None]  # (B, S)
    return torch.where(valid, order, order[:, :1]), valid


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
        """Token ids of each prompt: a string, or a list of chat messages ({role, content} dicts).

        With ``chat`` the tokenizer's chat template is applied (generation prompt appended) and the
        rendered text is tokenized without adding special tokens (the template carries the BOS,
        spec/models.md C1). Raises UsageError for an empty prompt or messages without a template.
        """
        tok, out = self.tokenizer, []
        for p in prompts:
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

    def start(self, prompt_ids: Sequence[Sequence[int]], cfg: DecodeConfig, policy: CachePolicy,
              seed: int = 0) -> "Run":
        """Prepare a run over a batch of tokenized prompts; iterate it for StepRecords."""
        return Run(self, [list(p) for p in prompt_ids], cfg, policy, seed)

    def generate(self, prompts: Sequence[str | list], cfg: DecodeConfig, policy: CachePolicy | str = "none",
                 chat: bool = True, seed: int = 0) -> list[GenerationResult]:
        """Encode, run to the end, and return one :class:`GenerationResult` per prompt."""
        if isinstance(policy, str):
            from ..cache import make_policy

            policy = make_policy(policy)
        run = self.start(self.encode(prompts, chat), cfg, policy, seed)
        for _ in run:
            pass
        return run.results()


class Run:
    """One batched denoising run; iterate for StepRecords, then call ``results()``."""

    def __init__(self, engine: Engine, prompts: list[list[int]], cfg: DecodeConfig, policy: CachePolicy, seed: int):
        if not prompts:
            raise UsageError("no prompts to generate from")
        threshold_mode = cfg.threshold is not None or cfg.factor is not None
        validate_remasking(cfg.remasking, parallel=threshold_mode)
        if cfg.threshold is not None and cfg.factor is not None:
            raise UsageError("--threshold and --factor are two parallel-decoding rules; pass only one")
        self.plan = plan_blocks(cfg.gen_length, cfg.block_length, default_steps(cfg.gen_length, cfg.steps, threshold_mode),
                                threshold_mode)
        self.engine, self.cfg, self.policy, self.prompts = engine, cfg, policy, prompts
        self.threshold_mode = threshold_mode
        spec, dev = engine.spec, engine.device
        B, P, G = len(prompts), max(len(p) for p in prompts), cfg.gen_length
        if P + G > spec.max_positions:
            raise UsageError(f"prompt ({P} tokens) + --gen-length {G} exceeds the model's {spec.max_positions} positions")
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
            n_layers=spec.n_layers,
        )
        self.final = tokens.clone()  # (B, T) canvas of every original row, filled as rows finish
        self.generator = torch.Generator(device=dev).manual_seed(seed)
        self.seed = seed
        zeros = lambda dt=torch.long: torch.zeros(B, dtype=dt, device=dev)  # noqa: E731
        self.nfe, self.n_full, self.n_partial, self.computed = zeros(), zeros(), zeros(), zeros()
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
            schedule = None
            if not self.threshold_mode:
                schedule = num_transfer_tokens(st.masked[:, st.block_start:st.block_end].sum(1), spb)  # (B, spb)
            while st.batch > 0:
                if schedule is not None and st.step_in_block >= spb:
                    break
                if not bool(st.masked[:, st.block_start:st.block_end].any()):
                    break
                rec = self._step(schedule)
                self._mark_finished(rec)  # rec.finished is set before the consumer sees the record
                yield rec
                keep = self._finish_rows(rec)
                if keep is not None and schedule is not None:
                    schedule = schedule[keep]
                st.step += 1
                st.step_in_block += 1
        if st.batch > 0:  # rows that used the whole canvas without an end marker
            self._retire(torch.arange(st.batch, device=st.tokens.device), ended=False)
        self.wall_s = self._now() - t_start

    def _step(self, schedule: torch.Tensor | None) -> StepRecord:
        st, cfg, eng = self.state, self.cfg, self.engine
        t0 = self._now()
        with self._range("ecache.decision.plan"):
            if self.policy.needs_values:  # dLLM-Cache's similarity probe (layer-0 V): decision time
                st.value_probe = (eng.model.probe_values(st.tokens), self.store.v[0].transpose(1, 2).flatten(2))
            plan = self.policy.plan(st)
        t1 = self._now()
        # targets: masked positions of the current block; sources: the rows whose logits predict them
        targets, valid = padded_index(st.block_masked())  # (B, R)
        # a row with no masks left in this block (threshold decoding, ragged rows) pads with position 0,
        # whose Dream source would be -1: pad it with the block start instead (never committed: ~valid)
        targets = torch.where(valid.any(1, keepdim=True), targets, st.block_start)
        sources = targets - st.logit_shift
        refresh = plan.refresh
        if bool(refresh.all()):
            query, computed = None, torch.full((st.batch,), st.length, device=refresh.device)
            width = st.length
        else:
            compute = plan.compute | refresh[:, None]  # (B, T)
            ok = (compute.gather(1, sources) | ~valid).all()
            assert bool(ok), f"policy {self.policy.name} did not plan the positions whose logits this step needs"
            query, _ = padded_index(compute)  # (B, S)
            computed, width = compute.sum(1), query.shape[1]
        extra = self._plan_extras(plan, query)  # policy capabilities: start layer, attention rows
        if "expand_from_layer" in extra:  # layer-averaged positions: S below the start layer, T from it on
            L = st.n_layers
            sl = plan.start_layer.clamp(0, L)
            computed = (computed * sl + st.length * (L - sl)) // L
        with self._range("ecache.forward.full" if query is None else "ecache.forward.partial"):
            logits = eng.model(st.tokens, self.store, query_pos=query, logits_pos=sources, **extra)  # (B, R, V)
        t2 = self._now()
        attention, t_extra = None, 0.0
        if "attn_pos" in extra:  # weights the fused attention does not return: decision time
            with self._range("ecache.decision.attention"):
                attention = (extra["attn_pos"], eng.model.attention_rows(self.store))
            t_extra = self._now() - t2
        if self.on_forward is not None:
            self.on_forward(self, plan, query, sources, logits)
        with self._range("ecache.sampling_commit"):
            sampled = sample(logits, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                             generator=self.generator, banned_ids=self._banned())
            conf = confidence_scores(cfg.remasking, sampled, self.generator)  # (B, R) float64
            if cfg.low_eos_confidence:  # LLaDA confidence_eos_eot_inf: probability 0, still selectable
                conf = torch.where(torch.isin(sampled.x0, eng.end_ids), torch.zeros_like(conf), conf)
            conf = conf.masked_fill(~valid, float("-inf"))
            if cfg.threshold is not None:
                commit = select_threshold(conf, cfg.threshold)
            elif cfg.factor is not None:
                commit = select_factor(conf, cfg.factor)
            else:
                commit = select_topk(conf, schedule[:, st.step_in_block])
            commit &= valid
            self._apply(targets, commit, sampled.x0)
        rows = st.rows
        self.nfe[rows] += 1
        self.n_full[rows] += refresh.long()
        self.n_partial[rows] += (~refresh).long()
        self.computed[rows] += computed
        rec = StepRecord(step=st.step, block=st.block, step_in_block=st.step_in_block, rows=rows, refresh=refresh,
                         computed=computed, query_width=width, targets=targets, valid=valid, committed=commit,
                         x0=sampled.x0, prob=sampled.prob, entropy=sampled.entropy, attention=attention)
        t3 = self._now()  # after the engine's own bookkeeping: decision_s is the policy's time alone
        with self._range("ecache.decision.observe"):
            self.policy.observe(st, rec)
        t4 = self._now()
        rec.forward_s, rec.sampling_s, rec.decision_s = t2 - t1, t3 - t2 - t_extra, (t1 - t0) + (t4 - t3) + t_extra
        self.t_forward += rec.forward_s
        self.t_sampling += rec.sampling_s
        self.t_decision += rec.decision_s
        self.steps_done += 1
        return rec

    def _plan_extras(self, plan, query: torch.Tensor | None) -> dict:
        """Model-call keywords for the plan's capability fields (empty for plain policies).

        ``expand_from_layer`` from ``plan.start_layer`` (partial forwards only); ``attn_pos`` (B, A), the
        padded index of ``plan.attn_rows``, which must be computed positions of every row.
        """
        extra = {}
        if plan.start_layer is not None and query is not None:
            extra["expand_from_layer"] = plan.start_layer
        if plan.attn_rows is not None:
            rows = plan.attn_rows
            if query is not None:
                outside = rows & ~(plan.compute | plan.refresh[:, None])
                assert not bool(outside.any()), f"policy {self.policy.name} asked attention rows it does not compute"
            extra["attn_pos"], _ = padded_index(rows)  # (B, A)
        return extra

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
        st.commit_step = torch.where(hit, torch.full_like(rank, st.step), st.commit_step)
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
        (positions computed summed over this row's forwards), token_layer_share (computed positions x
        layers over full-recompute positions x layers), generated_tokens (answer tokens plus its end
        marker; prompt and EOS filler excluded), wall_s (seconds until the row finished),
        tokens_per_s (generated_tokens / wall_s)."""
        tok, spec, out = self.engine.tokenizer, self.engine.spec, []
        final = self.final[:, self.P:].tolist()
        end_ids = set(self.engine.end_ids.tolist())
        nfe, full, part, comp = (t.tolist() for t in (self.nfe, self.n_full, self.n_partial, self.computed))
        T = self.P + self.G
        for b, ids in enumerate(final):
            end = next((i for i, t in enumerate(ids) if t in end_ids), None)
            answer = ids if end is None else ids[:end]
            gen = len(answer) + (1 if end is not None else 0)
            wall = self.finish_s[b] or self.wall_s
            stats = dict(nfe=nfe[b], full_forwards=full[b], partial_forwards=part[b], tokens_computed=comp[b],
                         token_layer_share=comp[b] / max(nfe[b] * T, 1), generated_tokens=gen,
                         prompt_tokens=len(self.prompts[b]), wall_s=wall, tokens_per_s=gen / wall if wall > 0 else 0.0)
            text = tok.decode(answer, skip_special_tokens=True) if tok is not None else ""
            out.append(GenerationResult(index=b, prompt_ids=self.prompts[b], token_ids=ids, answer_ids=answer,
                                        text=text, ended=end is not None, stats=stats))
        return out
