"""Grouped forwards: a step whose rows have different plans runs one partial forward at the
non-refreshing rows' width plus one full forward of the refreshing rows alone, or (``MERGE_REFRESH``,
steps without hooks) one partial forward in which the refreshing rows compute every position. A row
decodes in such a batch exactly as it does alone (every policy, both families, float32), both ways give
the same tokens and logits, and the reported work equals the positions the model's forwards computed,
counted on the model's own projections."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cli_helpers import step_layer_positions
from conftest import PROMPTS, bidirectional_policies

from ecache_cli.cache import POLICIES, make_policy
from ecache_cli.engine import DecodeConfig, Engine, forward
from ecache_cli.kvstore import KVStore

CFG = DecodeConfig(gen_length=16, block_length=8, steps=16)
# settings with partial forwards inside a 16-token answer (2 blocks of 8)
PARAMS: dict[str, dict] = {n: c.test_params for n, c in POLICIES.items()}  # each policy's own (CachePolicy.test_params)


class ForceRows:
    """Wraps a policy so that original row r also refreshes at the steps where (step + r) % 3 == 1: mixed
    steps for every policy, with a pattern that follows the row (``offset`` = its index when alone)."""

    def __init__(self, inner, offset: int = 0):
        self.inner, self.offset = inner, offset
        self.name, self.keeps_hidden = inner.name, inner.keeps_hidden

    def reset(self, state):
        self.inner.reset(state)

    def plan(self, state):
        p = self.inner.plan(state)
        force = (state.row_step + state.rows + self.offset) % 3 == 1  # (B,) bool
        return dataclasses.replace(p, refresh=p.refresh | force)

    def observe(self, state, record):
        self.inner.observe(state, record)

    def select_rows(self, keep):
        self.inner.select_rows(keep)


def run(lm, prompts, policy, offset=0, force=True):
    eng = Engine.from_loaded(lm)
    pol = make_policy(policy, **PARAMS[policy])
    r = eng.start(eng.encode(prompts, chat=False), CFG, ForceRows(pol, offset) if force else pol)
    records = list(r)
    return r.results(), records, r


@pytest.mark.parametrize("policy", bidirectional_policies())
def test_mixed_batch_gives_each_row_its_own_tokens(lm, policy):
    batch, records, _ = run(lm, PROMPTS, policy)
    mixed = [rec for rec in records if 0 < int(rec.refresh.sum()) < len(rec.rows)]
    assert len(mixed) >= 3 or policy == "none", "the forcing pattern should mix refreshing and partial rows"
    P = max(len(x.prompt_ids) for x in batch)
    for i, p in enumerate(PROMPTS):
        (alone,), _, _ = run(lm, [p], policy, offset=i)
        assert batch[i].token_ids == alone.token_ids, (policy, p)
        for k in ("nfe", "full_forwards", "partial_forwards"):
            assert batch[i].stats[k] == alone.stats[k], (policy, p, k)
        pad = P - len(alone.prompt_ids)  # a full forward in the batch also computes the row's left padding
        if policy != "elastic":  # (elastic's layer-selective rows also compute their padding from the start layer)
            assert (batch[i].stats["tokens_planned"] - pad * alone.stats["full_forwards"]
                    == alone.stats["tokens_planned"])


@pytest.mark.parametrize("merge", [False, True], ids=["split", "merged"])
@pytest.mark.parametrize("policy", ["entropy", "dual", "dkv", "elastic", "d2cache"])
def test_reported_work_is_what_the_forwards_computed(lm, policy, merge, monkeypatch):
    monkeypatch.setattr(forward, "MERGE_REFRESH", merge)
    eng = Engine.from_loaded(lm)
    params = dict(PARAMS[policy])
    if policy == "elastic" and lm.spec.n_experts:  # the random MoE's attention drifts less: expand at 0.99
        params["gamma"] = 0.99
    pol = ForceRows(make_policy(policy, **params))
    r = eng.start(eng.encode(PROMPTS, chat=False), CFG, pol)
    records, seen = step_layer_positions(lm, r)
    L, T = lm.spec.n_layers, r.P + r.G
    assert len(seen) == len(records)
    n_mixed = n_packed = 0
    for rec, layer_positions in zip(records, seen):
        B = len(rec.rows)
        got = int(rec.computed.sum())
        if policy == "elastic":  # layer-averaged per row, rounded down per row
            assert 0 <= layer_positions / L - got < B, (rec.step, layer_positions, got)
        else:
            assert got * L == layer_positions, (rec.step, layer_positions, got)
        n_ref = int(rec.refresh.sum())
        if 0 < n_ref < B and policy != "elastic":
            n_mixed += 1
            S = rec.query_width
            if merge and policy != "d2cache":  # one forward (d2cache's attention rows keep two): refreshing rows T
                assert S == T and rec.computed[rec.refresh].tolist() == [T] * n_ref
                own = rec.computed[~rec.refresh]
                assert 1 <= int(own.min()) and int(own.max()) <= T
                n_packed += int(own.max()) < T  # packed: the other rows computed their own entries
                assert all(p <= c for p, c in zip(rec.planned.tolist(), rec.computed.tolist()))
                continue
            assert S < T
            want = [T + S if f else S for f in rec.refresh.tolist()]  # no row pays for another's refresh
            if rec.computed.tolist() != want:  # packed: each row computed its own entries, S at most
                n_packed += 1
                own = rec.computed - rec.refresh.long() * T
                assert 1 <= int(own.min()) and int(own.max()) <= S and int(own.sum()) <= 0.9 * B * S
                want = (own + rec.refresh.long() * T).tolist()
            assert rec.computed.tolist() == want
            assert all(p <= c for p, c in zip(rec.planned.tolist(), want))
    assert policy == "elastic" or n_mixed >= 3
    # a refreshing row computes only its logit sources in the partial forward: padding that packing skips
    # (elastic and d2cache ask for layer hooks, whose forwards are not packed)
    assert policy in ("elastic", "d2cache") or n_packed >= 1, policy
    if policy == "elastic":  # expanding rows run apart: a partial row next to an expanding one computes S
        split_steps = [rec for rec in records
                       if {c > rec.query_width for c, f in zip(rec.computed.tolist(), rec.refresh.tolist()) if not f}
                       == {True, False}]
        assert split_steps
        for rec in split_steps:
            S = rec.query_width
            for c, f in zip(rec.computed.tolist(), rec.refresh.tolist()):
                assert c == T + S if f else (c == S or S < c < S + T)
    res = r.results()
    for x in res:
        assert x.stats["tokens_computed"] >= x.stats["tokens_planned"]


def _per_step(lm, prompts, policy, joins=()):
    """Decode ``prompts`` (``joins``: (step, prompt) pairs added at that step, as the server adds them);
    return (results, records, per step (sources, logits, model calls, merge applied: no hooks and no
    hidden states))."""
    eng = Engine.from_loaded(lm)
    r = eng.start(eng.encode(prompts, chat=False), CFG, policy, prompt_width=32)
    calls, steps = [0], []

    def seen(run, plan, query, sources, logits):
        steps.append((sources.clone(), logits.clone(), calls[0], plan.hooks is None and run.store.hidden is None))
        calls[0] = 0

    r.on_forward = seen
    handle = lm.model.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
    records = []
    try:
        for i, rec in enumerate(r):
            records.append(rec)
            for at, p in joins:
                if at == i:
                    r.add(eng.encode([p], chat=False)[0])
    finally:
        handle.remove()
    return r.results(), records, steps


def _merged_equals_split(lm, monkeypatch, make, prompts, joins=()):
    """Run both ways; assert equal tokens, and logits within float32 rounding at every step. Returns the
    merged run's (records, steps) and the split run's steps."""
    runs = []
    for merge in (False, True):
        monkeypatch.setattr(forward, "MERGE_REFRESH", merge)
        runs.append(_per_step(lm, prompts, make(), joins))
    (res_s, rec_s, steps_s), (res_m, rec_m, steps_m) = runs
    assert [x.token_ids for x in res_m] == [x.token_ids for x in res_s]
    assert len(steps_m) == len(steps_s)
    for (src_s, lg_s, *_), (src_m, lg_m, *_), rec in zip(steps_s, steps_m, rec_m):
        assert torch.equal(src_s, src_m)
        # float32 rounding only (seen: ≤ 1.1e-5 on refreshing rows, ≤ 1.8e-5 on rows whose K/V an earlier
        # merged refresh wrote): other matmul shapes sum in another order, the MoE's experts batch other tokens
        assert (lg_m - lg_s).abs().max() <= 5e-5, (rec.step, rec.refresh.tolist())
    for a, b in zip(rec_s, rec_m):  # the same decisions: the merge changes how the step runs, not what it plans
        assert torch.equal(a.refresh, b.refresh) and torch.equal(a.planned, b.planned)
    return rec_m, steps_m, steps_s


@pytest.mark.parametrize("policy", bidirectional_policies())
def test_merged_refresh_gives_the_split_forwards_tokens_and_logits(lm, policy, monkeypatch):
    """A mixed step as one forward: the refreshing rows compute every position inside the partial forward
    (their K/V written before attention reads them), the same tokens and logits as a partial forward plus
    a full forward of the refreshing rows; steps with hooks or hidden states keep the two forwards."""
    rec_m, steps_m, steps_s = _merged_equals_split(
        lm, monkeypatch, lambda: ForceRows(make_policy(policy, **PARAMS[policy])), PROMPTS)
    T = max(rec.query_width for rec in rec_m)
    merged = 0
    for rec, (_, _, calls, plain), (_, _, calls_split, _) in zip(rec_m, steps_m, steps_s):
        n_ref, B = int(rec.refresh.sum()), len(rec.rows)
        if not (0 < n_ref < B) or not plain:
            assert calls == calls_split
            continue
        merged += 1
        assert (calls, calls_split) == (1, 2)
        assert rec.query_width == T
        own = rec.computed[~rec.refresh]
        assert rec.computed[rec.refresh].tolist() == [T] * n_ref  # refreshing rows: T, once
        assert int(own.min()) >= 1 and int(own.max()) <= T
    plain_policy = all(plain for *_, plain in steps_m)
    if policy == "none":  # every row refreshes at every step: never mixed
        assert merged == 0
    else:
        assert merged >= 3 if plain_policy else merged == 0, (policy, merged)


def test_merged_refresh_with_entropy_rows_and_joining_rows(lm, monkeypatch):
    """EntropyCache's own decisions (no forcing) at a tau where rows refresh at different steps, with rows
    joining mid-block as the server adds them: the merged and split forwards decode the same tokens, and
    each row as it decodes alone."""
    make = lambda: make_policy("entropy", tau=0.3, recent_k=4)  # noqa: E731
    rec_m, steps_m, _ = _merged_equals_split(lm, monkeypatch, make, PROMPTS[:2],
                                             joins=((2, PROMPTS[2]), (5, PROMPTS[3])))
    mixed = [calls for r, (_, _, calls, _) in zip(rec_m, steps_m) if 0 < int(r.refresh.sum()) < len(r.rows)]
    assert len(mixed) >= 3 and set(mixed) == {1}  # one forward per mixed step
    eng = Engine.from_loaded(lm)
    alone = [eng.generate([p], CFG, make(), chat=False)[0].token_ids for p in PROMPTS]
    res, _, _ = _per_step(lm, PROMPTS[:2], make(), joins=((2, PROMPTS[2]), (5, PROMPTS[3])))
    assert [x.token_ids for x in res] == alone


def test_scratch_rows_and_put_rows_touch_only_those_rows():
    key_mask = torch.tensor([[False, True, True], [True, True, True], [False, False, True]])
    store = KVStore.allocate(2, 1, 2, key_mask, torch.float32, keep_hidden=4)
    rows = torch.tensor([2, 0])
    sub = store.scratch_rows(rows)
    assert sub.k[0].shape == (2, 1, 3, 2) and sub.hidden[1].shape == (2, 3, 4)
    assert torch.equal(sub.key_mask, key_mask[rows]) and torch.equal(sub.positions, store.positions[rows])
    assert torch.equal(sub.attn_mask, store.attn_mask[rows])
    for i, t in enumerate(sub.k + sub.v + sub.hidden):
        t.fill_(float(i + 1))
    store.put_rows(rows, sub)
    assert torch.equal(store.k[1][[0, 2]], torch.full((2, 1, 3, 2), 2.0))  # layer 1 of K: the second tensor
    assert torch.equal(store.v[0][[0, 2]], torch.full((2, 1, 3, 2), 3.0))
    assert torch.equal(store.hidden[1][[0, 2]], torch.full((2, 3, 4), 6.0))
    assert all(float(t[1].abs().sum()) == 0.0 for t in store.k + store.v + store.hidden)  # row 1 untouched


class FakeEvent:
    """Stands in for torch.cuda.Event on CPU: record() reads the clock, elapsed_time() is in ms."""

    recorded = 0
    synced = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self):
        import time

        self.t = time.perf_counter()
        FakeEvent.recorded += 1

    def synchronize(self):
        FakeEvent.synced += 1

    def elapsed_time(self, other):
        return 1e3 * (other.t - self.t)


def test_event_timings_are_read_once_per_run(lm, monkeypatch):
    """The CUDA timing path (events, no per-step sync) on CPU with a stand-in event: a step's times are
    0 when it is yielded and filled at the end of the run, one synchronize in all, and the run's totals
    are the sums of the steps'."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.recorded = FakeEvent.synced = 0
    eng = Engine.from_loaded(lm)
    r = eng.start(eng.encode(PROMPTS[:2], chat=False), DecodeConfig(gen_length=16, block_length=8, steps=16,
                                                                    early_exit=False), make_policy("entropy"))
    r.timer.cuda = True  # the engine's device stays CPU: only the timing path is switched
    records, at_yield = [], []
    for rec in r:
        at_yield.append(rec.forward_s)
        records.append(rec)
    assert len(records) == 16 and at_yield == [0.0] * 16
    assert FakeEvent.synced == 1  # once, at the end of the run
    assert FakeEvent.recorded == 5 * 16  # five marks per step (no attention rows for entropy)
    assert all(rec.forward_s > 0 and rec.sampling_s > 0 and rec.decision_s > 0 for rec in records)
    assert r.timer.forward_s == pytest.approx(sum(rec.forward_s for rec in records))
    assert r.timer.decision_s == pytest.approx(sum(rec.decision_s for rec in records))
    assert r.timer.forward_s + r.timer.sampling_s + r.timer.decision_s < r.wall_s


def test_profile_reports_honest_and_planned_work_per_batch_size(llada_lm):
    from ecache_cli.runs.profile import ProfileOptions, Request, measure
    from ecache_cli.runs.settings import Settings

    cfg = DecodeConfig(gen_length=16, block_length=8)
    settings = Settings(decode=cfg, cache="entropy", cache_params={"tau": 1.0}, all_cache_params={"tau": 1.0})
    reps = {bs: measure(Engine.from_loaded(llada_lm), settings, [Request(p) for p in PROMPTS],
                        ProfileOptions(policies=["none", "entropy"], warmup=0, batch_size=bs), chat=False)
            for bs in (1, 4)}
    for bs, rep in reps.items():
        e = rep.summaries["entropy"]
        assert e["batch_size"] == bs and rep.summaries["none"]["planned_work_share_vs_none"] == 1.0
        assert e["work_share_vs_none"] >= e["planned_work_share_vs_none"] > 0
        assert e["work_efficiency"] == pytest.approx(e["speedup_vs_none"] * e["planned_work_share_vs_none"])
        rows = rep.to_dict()["requests"]
        assert all(r["tokens_computed"] >= r["tokens_planned"] for r in rows)
    one, four = reps[1].summaries["entropy"], reps[4].summaries["entropy"]
    assert one["work_share_vs_none"] == pytest.approx(one["planned_work_share_vs_none"])  # alone: no padding
    assert four["work_share_vs_none"] > four["planned_work_share_vs_none"]  # a batch pays its padded widths


def test_timing_warning_uses_the_work_the_forwards_computed():
    from ecache_cli.runs.profile import ProfileReport, timing_warnings

    summaries = {"none": {"speedup_vs_none": 1.0, "work_share_vs_none": 1.0, "planned_work_share_vs_none": 1.0},
                 "entropy": {"speedup_vs_none": 4.0, "work_share_vs_none": 0.5, "planned_work_share_vs_none": 0.2}}
    rep = ProfileReport(policies=list(summaries), summaries=summaries, runs={}, memory_kind="peak_rss", decode=CFG)
    (line,) = timing_warnings(rep)  # 4x with 50 % of the work computed: flagged (the plans' 20 % would allow 5x)
    assert "50%" in line and "2.00x" in line
