"""The denoising engine on tiny random checkpoints (CPU, float32): the official loop, termination, banned ids,
finished rows, batch invariance, seeds and stats."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS
from torch import nn

from ecache_cli.cache import make_policy
from ecache_cli.engine import DecodeConfig, Engine


def engine_of(lm) -> Engine:
    return Engine.from_loaded(lm)


def decode(lm, prompts, cfg, policy="none", seed=0, **params):
    """Run to the end; return (results, records, run)."""
    eng = engine_of(lm)
    run = eng.start(eng.encode(prompts, chat=False), cfg, make_policy(policy, **params), seed=seed)
    records = list(run)
    return run.results(), records, run


def tokens_of(results) -> list[list[int]]:
    return [r.token_ids for r in results]


# --- the official LLaDA loop (docs/MODELS.md §5.1), written out plainly


def reference_decode(lm, prompt_ids: list[int], gen_length: int, block_length: int, steps: int) -> list[int]:
    """LLaDA generate.py at temperature 0, batch 1: per block, per step, a full forward, argmax, confidence =
    softmax probability of the argmax, −inf outside the current block's masked positions, top-k by the
    linear schedule. Two deliberate differences of the engine are mirrored: the mask id and ids ≥ the
    tokenizer size are never chosen (set to −inf before argmax, and the softmax is over the remaining
    ids), and Dream's hidden state at i−1 gives the logits of token i."""
    model, spec = lm.model, lm.spec
    P = len(prompt_ids)
    x = torch.tensor([prompt_ids + [spec.mask_id] * gen_length])  # (1, T)
    key_mask = torch.ones_like(x, dtype=torch.bool)
    banned = [spec.mask_id] + list(range(len(lm.tokenizer), spec.vocab_size))
    steps_per_block = steps // (gen_length // block_length)
    with torch.no_grad():
        for b in range(gen_length // block_length):
            start, end = P + b * block_length, P + (b + 1) * block_length
            n = int((x[0, start:end] == spec.mask_id).sum())
            schedule = [n // steps_per_block + (1 if t < n % steps_per_block else 0) for t in range(steps_per_block)]
            for t in range(steps_per_block):
                out = model(x, model.new_store(key_mask)).double()  # (1, T, V) full forward, fresh store
                if spec.logit_shift:  # row i predicts token i + 1
                    out = torch.cat([out[:, :1], out[:, :-1]], dim=1)
                out[..., banned] = float("-inf")
                x0 = out.argmax(-1)  # (1, T)
                p = torch.softmax(out, dim=-1).gather(-1, x0[..., None]).squeeze(-1)  # (1, T)
                p[:, end:] = float("-inf")
                mask_index = x == spec.mask_id
                conf = torch.where(mask_index, p, torch.tensor(float("-inf"), dtype=p.dtype))
                idx = torch.topk(conf[0], schedule[t]).indices
                x[0, idx] = x0[0, idx]
    return x[0, P:].tolist()


@pytest.mark.parametrize("steps", [16, 8])  # one and two commits per step
def test_none_matches_official_loop(lm, steps):
    # LLaDA's schedule for both families (Dream's own schedule: tests/test_dream_samplers.py)
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=steps, early_exit=False, schedule="llada")
    for prompt in PROMPTS[:2]:
        (res,), records, _ = decode(lm, [prompt], cfg, "none")
        ids = engine_of(lm).encode([prompt], chat=False)[0]
        assert res.token_ids == reference_decode(lm, ids, 16, 8, steps)
        assert len(records) == steps  # every scheduled step ran (no early exit)
        assert len(set(res.token_ids)) > 2  # the random model is not degenerate, so the check can fail


# --- termination of threshold / factor decoding, ragged rows


# threshold 1.0, the highest the settings take (a confidence), is never reached by the random models'
# confidences: only the forced top-1 commits
@pytest.mark.parametrize("rule", [dict(threshold=0.9), dict(threshold=0.5), dict(threshold=1.0), dict(factor=1.0)])
def test_parallel_decoding_terminates(lm, rule):
    cfg = DecodeConfig(gen_length=16, block_length=8, **rule)
    results, records, run = decode(lm, PROMPTS[:3], cfg, "entropy", tau=1.0)
    per_block: dict[int, int] = {}
    for rec in records:
        for row, block in zip(rec.rows.tolist(), rec.block.tolist()):
            per_block[(row, block)] = per_block.get((row, block), 0) + 1
        has_work = rec.valid.any(1)  # (B,)
        assert (rec.n_committed[has_work] >= 1).all(), f"step {rec.step}: a row with masks committed nothing"
        assert (rec.n_committed[~has_work] == 0).all()
        if rule.get("threshold", 0) == 1.0:  # nothing reaches it: exactly the forced top-1
            assert rec.n_committed[has_work].tolist() == [1] * int(has_work.sum())
    assert all(n <= cfg.block_length for n in per_block.values()), per_block
    for r in results:
        assert lm.spec.mask_id not in r.token_ids


def test_ragged_rows_in_threshold_batch(lm):
    """Rows that finish their block at different steps go on to their next block at once, so one step holds
    rows at different blocks (Dream's shifted sources of a row are its own block's); each decodes as it
    would alone."""
    cfg = DecodeConfig(gen_length=16, block_length=8, threshold=0.7)
    batch, records, _ = decode(lm, PROMPTS[:3], cfg, "none")
    assert all(bool(rec.valid.any(1).all()) for rec in records)  # no row ever takes a step without work
    assert any(len(set(rec.block.tolist())) > 1 for rec in records), "no step held rows at different blocks: weak test"
    for i, p in enumerate(PROMPTS[:3]):
        (alone,), _, _ = decode(lm, [p], cfg, "none")
        assert batch[i].token_ids == alone.token_ids


def test_an_unreached_threshold_takes_block_length_steps(lm):
    cfg = DecodeConfig(gen_length=16, block_length=8, threshold=1.0, ban_eos=True)
    _, records, _ = decode(lm, PROMPTS[:2], cfg, "none")
    assert [rec.block.tolist() for rec in records] == [[0, 0]] * 8 + [[1, 1]] * 8


# --- banned ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ban_eos_and_never_emit_mask_or_out_of_tokenizer_ids(lm, seed):
    cfg = DecodeConfig(gen_length=32, block_length=16, steps=32, temperature=5.0, ban_eos=True)
    results, records, _ = decode(lm, PROMPTS[:3], cfg, "entropy", seed=seed, tau=1.0)
    spec, vocab = lm.spec, len(lm.tokenizer)
    assert spec.vocab_size > vocab  # the checkpoint pads its vocabulary beyond the tokenizer
    forbidden = {spec.mask_id, spec.eos_id, spec.eot_id}
    assert spec.eot_id is not None
    proposed, committed = set(), set()
    for rec in records:
        proposed |= set(rec.x0[rec.valid].tolist())
        committed |= set(rec.x0[rec.committed].tolist())
    final = {t for r in results for t in r.token_ids}
    for ids in (proposed, committed, final):
        assert not ids & forbidden
        assert max(ids) < vocab and min(ids) >= 0
    assert len(proposed) > 40  # the sampling is broad enough that a leak of a banned id would show
    assert all(r.stats["generated_tokens"] == 32 and not r.ended for r in results)


# --- finished rows and early exit


class EosAfter(nn.Module):
    """Wraps a model: each row emits EOS from generated offset ``offsets[prompt_len]`` on (logit +50) and never
    before it (EOS/EOT −50), so rows end at known steps. Rows are told apart by their prompt length."""

    def __init__(self, inner, offsets: dict[int, int], gen_length: int):
        super().__init__()
        self.inner, self.offsets, self.G = inner, offsets, gen_length
        self.spec = inner.spec

    def new_store(self, key_mask, keep_hidden=False):
        return self.inner.new_store(key_mask, keep_hidden=keep_hidden)

    def forward(self, tokens, store, query_pos=None, logits_pos=None):
        logits = self.inner(tokens, store, query_pos, logits_pos)  # (B, R, V)
        T = tokens.shape[1]
        pos = logits_pos if logits_pos is not None else torch.arange(T)[None].expand(tokens.shape[0], T)
        offset = pos + self.spec.logit_shift - (T - self.G)  # (B, R) generated offset each row predicts
        prompt_len = store.key_mask.sum(1) - self.G  # (B,)
        end_at = torch.tensor([self.offsets[int(n)] for n in prompt_len])[:, None]  # (B, 1)
        logits = logits.clone()
        for tid in (self.spec.eos_id, self.spec.eot_id):
            logits[..., tid] -= 50.0
        logits[..., self.spec.eos_id] += torch.where(offset >= end_at, 100.0, 0.0)
        return logits


def test_finished_rows_are_frozen_and_dropped(lm):
    G = 24
    prompts = ["ab", "abcd", "abcdef"]
    eng = Engine(EosAfter(lm.model, {2: 3, 4: 12, 6: 100}, G), lm.tokenizer, lm.spec)
    cfg = DecodeConfig(gen_length=G, block_length=8, steps=G)  # one commit per step
    run = eng.start(eng.encode(prompts, chat=False), cfg, make_policy("entropy", tau=1.0))
    frozen: dict[int, list[int]] = {}
    widths = []
    for rec in run:
        widths.append(len(rec.rows))
        assert rec.finished is not None and rec.finished.shape == rec.rows.shape  # set when the record is seen
        for i in rec.finished.nonzero().flatten().tolist():
            row = run.state.tokens[i, run.P:]
            frozen[int(rec.rows[i])] = torch.where(row == lm.spec.mask_id, lm.spec.eos_id, row).tolist()
    assert widths == [3] * 8 + [2] * 8 + [1] * 8  # rows end after 8, 16 and 24 steps; ended rows are dropped
    res = run.results()
    assert sorted(frozen) == [0, 1, 2]
    for r in res:
        assert r.token_ids == frozen[r.index]  # nothing changed after the row ended
    eos = lm.spec.eos_id
    assert res[0].token_ids[3:] == [eos] * (G - 3) and eos not in res[0].token_ids[:3]
    assert res[1].token_ids[12:] == [eos] * (G - 12) and eos not in res[1].token_ids[:12]
    assert eos not in res[2].token_ids
    # stats: generated tokens = answer + its end marker (prompt and EOS filler excluded); NFE per row
    assert [r.ended for r in res] == [True, True, False]
    assert [r.stats["generated_tokens"] for r in res] == [4, 13, G]
    assert [len(r.answer_ids) for r in res] == [3, 12, G]
    assert [r.stats["nfe"] for r in res] == [8, 16, 24]
    assert [r.stats["prompt_tokens"] for r in res] == [2, 4, 6]
    for r in res:
        s = r.stats
        assert s["nfe"] == s["full_forwards"] + s["partial_forwards"]
        assert s["wall_s"] > 0 and s["tokens_per_s"] == pytest.approx(s["generated_tokens"] / s["wall_s"])


def test_no_early_exit_keeps_rows_to_the_end(lm):
    G = 16
    eng = Engine(EosAfter(lm.model, {2: 3, 4: 100}, G), lm.tokenizer, lm.spec)
    cfg = DecodeConfig(gen_length=G, block_length=8, steps=G, early_exit=False)
    run = eng.start(eng.encode(["ab", "abcd"], chat=False), cfg, make_policy("none"))
    assert [len(rec.rows) for rec in run] == [2] * G
    res = run.results()
    assert res[0].ended and res[0].stats["nfe"] == G and res[0].stats["generated_tokens"] == 4


# --- batch invariance, seeds, stats


@pytest.mark.parametrize("policy,params", [("none", {}), ("entropy", {"tau": 1.0, "recent_k": 4})])
def test_batch_invariance(lm, policy, params):
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=16)
    batch, _, _ = decode(lm, PROMPTS, cfg, policy, **params)
    for i, p in enumerate(PROMPTS):
        (alone,), _, _ = decode(lm, [p], cfg, policy, **params)
        assert batch[i].token_ids == alone.token_ids, p
        for k in ("nfe", "full_forwards", "partial_forwards", "generated_tokens"):
            assert batch[i].stats[k] == alone.stats[k], (p, k)
    if policy == "entropy":  # τ sits inside the entropy range: both kinds of forward happen
        assert all(r.stats["partial_forwards"] > 0 and r.stats["full_forwards"] > 1 for r in batch)


def test_seed_reproduces_and_changes(lm):
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=16, temperature=1.0)
    a, _, _ = decode(lm, PROMPTS[:2], cfg, "entropy", seed=7, tau=1.0)
    b, _, _ = decode(lm, PROMPTS[:2], cfg, "entropy", seed=7, tau=1.0)
    c, _, _ = decode(lm, PROMPTS[:2], cfg, "entropy", seed=8, tau=1.0)
    assert tokens_of(a) == tokens_of(b)
    assert tokens_of(a) != tokens_of(c)


@pytest.mark.parametrize("policy", ["none", "prefix", "dual", "entropy"])
def test_stats_count_forwards_and_positions(lm, policy):
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=16, ban_eos=True)
    results, records, run = decode(lm, PROMPTS[:3], cfg, policy)
    T = run.P + run.G
    for r in results:
        s = r.stats
        assert s["nfe"] == s["full_forwards"] + s["partial_forwards"] == len(records) == 16
        assert s["generated_tokens"] == 16  # prompt tokens are not counted
        assert s["prompt_tokens"] == len(r.prompt_ids) < T - 16 + 1
        assert s["tokens_computed"] == sum(int(rec.computed[list(rec.rows).index(r.index)]) for rec in records)
        assert s["tokens_planned"] == sum(int(rec.planned[list(rec.rows).index(r.index)]) for rec in records)
        assert s["tokens_computed"] >= s["tokens_planned"]  # padding and a refreshing row's partial share
        if policy == "none":
            assert s["tokens_computed"] == s["tokens_planned"] == s["nfe"] * T and s["partial_forwards"] == 0
        else:
            assert s["tokens_planned"] < s["nfe"] * T and s["partial_forwards"] > 0
