"""Peer cache policies (docs/METHOD.md §3): dLLM-Cache, dKV-Cache, d2Cache, Elastic-Cache, and the model API they
need (value probe, attention rows, layer-selective recomputation). Their forced-refresh equivalence with
``none`` is in tests/test_policies.py (FORCED_REFRESH)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import PROMPTS as RAGGED_PROMPTS

from ecache_cli.cache import POLICIES, make_policy
from ecache_cli.cache.d2cache import (
    D2Cache,
    certainty_density,
    nucleus,
    rollout_importance,
)
from ecache_cli.cache.elastic import ElasticCache
from ecache_cli.engine import DecodeConfig, DecodeState, Engine, StepRecord
from ecache_cli.errors import UsageError
from ecache_cli.models.layers import apply_rope
from ecache_cli.models.loader import load_model
from ecache_cli.models.synthetic import write_random_checkpoint

PROMPTS = RAGGED_PROMPTS[:3]  # three of the shared prompts of different lengths
CFG = DecodeConfig(gen_length=24, block_length=8, steps=24, early_exit=False)


def spy_run(lm, policy, prompts=PROMPTS, cfg=CFG):
    """Run ``policy`` and return (plans, records): per step the state facts seen by plan and the plan."""
    eng = Engine.from_loaded(lm)
    plans, inner = [], policy.plan

    def spy(state):
        plan = inner(state)
        plans.append(dict(step=state.step, step_in_block=state.step_in_block.clone(), masked=state.masked.clone(),
                          commit_step=state.commit_step.clone(), rows=state.rows.clone(), plan=plan,
                          tokens=state.tokens.clone(),
                          sources=state.sources(state.block_masked())))
        return plan

    policy.plan = spy
    run = eng.start(eng.encode(prompts, chat=False), cfg, policy)
    records = list(run)
    return plans, records


@pytest.fixture(scope="module")
def lm3(tmp_path_factory):
    """A 3-layer random LLaDA (layer-selective tests need a layer below and two above the start)."""
    d = write_random_checkpoint(tmp_path_factory.mktemp("l3"), "llada", seed=1, scale=4.0, n_layers=3)
    return load_model(d, device="cpu", dtype="float32")


def test_registered_with_published_defaults():
    assert {"dllm-cache", "dkv", "d2cache", "elastic"} <= set(POLICIES)
    assert make_policy("dllm-cache").params() == {"kp": 50, "kr": 7, "rho": 0.25, "tol": 1e-3}
    assert make_policy("dkv").params() == {"refresh_every": 8}
    assert make_policy("d2cache").params() == {"rollout_p": 0.1, "current_k": 32, "sigma": 10.0, "refresh_every": 0}
    assert make_policy("elastic").params() == {"gamma": 0.9, "window": 16, "refresh_every": 0}
    caps = {n: (sorted(POLICIES[n].row_state), POLICIES[n].keeps_hidden) for n in POLICIES}
    assert caps["dllm-cache"] == (["last"], False) and caps["d2cache"] == (["conf", "importance"], False)
    assert caps["elastic"] == (["has_prev", "prev_row", "similarity", "start_next", "tracked"], True)
    assert caps["dkv"] == caps["none"] == caps["dual"] == ([], False)
    assert caps["entropy"] == (["block_signal", "refresh_next"], False)


@pytest.mark.parametrize("name,params,match", [
    ("dkv", {"refresh_every": 0}, "refresh_every=0"), ("dllm-cache", {"kr": 0}, "kr=0"),
    ("dllm-cache", {"rho": 1.5}, "rho"), ("d2cache", {"rollout_p": 2.0}, "rollout_p"),
    ("elastic", {"window": -1}, "window"),
])
def test_bad_parameters_name_the_value(name, params, match):
    with pytest.raises(UsageError, match=match):
        make_policy(name, **params)


# --- model API: value probe, attention rows, expansion


def test_value_probe_matches_cached_layer0_values(lm):
    m = lm.model
    ids = torch.randint(10, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    store = m.new_store(torch.ones_like(ids, dtype=torch.bool))
    with torch.inference_mode():
        m(ids, store)
        probe = m.probe_values(ids)  # (B, T, H_kv*D)
        cached = store.v[0].transpose(1, 2).flatten(2)
        torch.testing.assert_close(probe, cached, rtol=0, atol=1e-5)
        ids2 = ids.clone()
        ids2[:, 3] = ids[:, 3] + 1  # a changed token changes its probe, nothing else's
        diff = (m.probe_values(ids2) - cached).abs().amax(-1)  # (B, T)
    assert (diff[:, 3] > 1e-3).all() and (diff[:, [0, 1, 2, 4, 5]] < 1e-5).all()


def test_attention_rows_are_the_softmax_of_the_fused_attention(lm):
    """attention_rows reproduces the weights behind the fused attention: sum_t p(t) V(t) per head equals the
    attention output, and padding keys get no weight."""
    m, s = lm.model, lm.spec
    ids = torch.randint(10, 90, (2, 10), generator=torch.Generator().manual_seed(1))
    key_mask = torch.ones_like(ids, dtype=torch.bool)
    key_mask[0, :2] = False
    store = m.new_store(key_mask)
    rows = torch.tensor([[2, 5, 9], [0, 4, 4]])
    with torch.inference_mode():
        m(ids, store, attn_pos=rows)
        probs = m.attention_rows(store)  # L x (B, 3, T)
    assert len(probs) == s.n_layers and probs[0].shape == (2, 3, 10)
    for p in probs:
        torch.testing.assert_close(p.sum(-1), torch.ones(2, 3))
        assert p[0, :, :2].abs().max() == 0
    # head-averaged reference from the kept queries and the stored keys
    q, k = store.queries[0], store.k[0].repeat_interleave(s.n_heads // s.n_kv_heads, 1)
    ref = ((q @ k.transpose(-1, -2)) / s.head_dim ** 0.5).masked_fill(~key_mask[:, None, None], float("-inf"))
    torch.testing.assert_close(probs[0], ref.softmax(-1).mean(1))
    torch.testing.assert_close(probs[0][1, 1], probs[0][1, 2])  # a repeated row gives the same weights


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_expand_from_layer_zero_is_a_full_forward(family, llada_lm, dream_lm):
    lm = llada_lm if family == "llada" else dream_lm
    m = lm.model
    ids = torch.randint(10, 90, (2, 14), generator=torch.Generator().manual_seed(2))
    km = torch.ones_like(ids, dtype=torch.bool)
    with torch.inference_mode():
        ref_store = m.new_store(km)
        full = m(ids, ref_store)
        store = m.new_store(km, keep_hidden=True)
        m(torch.full_like(ids, 7), store)  # a stale cache of another canvas
        q = torch.tensor([[3, 4], [8, 8]])
        got = m(ids, store, query_pos=q, logits_pos=torch.tensor([[1, 13], [0, 8]]), expand_from_layer=0)
    want = full[:, [1, 13]]
    want[1] = full[1, [0, 8]]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for a, b in zip(ref_store.k + ref_store.v, store.k + store.v):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_expand_keeps_shallow_cache_and_recomputes_deep_layers(lm3):
    """From the start layer l every position is recomputed from the store's layer-l inputs; below l only the
    query positions are."""
    m, s = lm3.model, lm3.spec
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(10, 90, (1, 16), generator=g)
    km = torch.ones_like(ids, dtype=torch.bool)
    q = torch.tensor([[5, 6, 7]])
    other = torch.tensor([i for i in range(16) if i not in (5, 6, 7)])
    with torch.inference_mode():
        store = m.new_store(km, keep_hidden=True)
        m(ids, store)
        ids2 = ids.clone()
        ids2[0, 5:8] = torch.randint(10, 90, (3,), generator=g)  # the canvas changes at the query positions
        before = store.clone()
        partial = store.clone()
        m(ids2, partial, query_pos=q)  # reference: the same forward without expansion
        m(ids2, store, query_pos=q, expand_from_layer=1)
        h1 = partial.hidden[1]  # layer-1 inputs: cached outside q, fresh at q
        p = m.parts(1)
        k1 = p.k(p.attn_norm(h1)).view(1, 16, s.n_kv_heads, s.head_dim).transpose(1, 2)
        k1 = apply_rope(k1, *store.rope, s.rope_full_precision)
    # layer 0: cached outside the query, fresh at it
    torch.testing.assert_close(store.k[0][:, :, other], before.k[0][:, :, other], rtol=0, atol=0)
    torch.testing.assert_close(store.k[0], partial.k[0], rtol=0, atol=1e-6)
    # layer 1 (the start layer): every position recomputed from those inputs
    torch.testing.assert_close(store.k[1], k1, rtol=0, atol=1e-5)
    # layer 2: the positions outside the query are fresh (they saw the new layer-1 K/V), not the cached ones
    assert (store.k[2][:, :, other] - before.k[2][:, :, other]).abs().max() > 1e-3
    assert (store.k[2][:, :, other] - partial.k[2][:, :, other]).abs().max() > 1e-3


def test_expand_is_per_row(lm3):
    m = lm3.model
    ids = torch.randint(10, 90, (2, 12), generator=torch.Generator().manual_seed(4))
    km = torch.ones_like(ids, dtype=torch.bool)
    q = torch.tensor([[2, 3], [6, 9]])
    with torch.inference_mode():
        store = m.new_store(km, keep_hidden=True)
        m(ids, store)
        ids2 = ids.clone()
        ids2[:, [2, 3, 6, 9]] += 1
        plain = store.clone()
        want = m(ids2, plain, query_pos=q)
        got = m(ids2, store, query_pos=q, expand_from_layer=torch.tensor([1, 3]))  # row 1: 3 = never
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
    for a, b in zip(plain.k, store.k):
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-5)
    assert (store.k[2][0] - plain.k[2][0]).abs().max() > 1e-3  # row 0 did expand


# --- dKV-Cache-Decode


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_dkv_caches_a_token_one_step_after_its_commit(family, llada_lm, dream_lm):
    lm = llada_lm if family == "llada" else dream_lm
    plans, records = spy_run(lm, make_policy("dkv", refresh_every=3))
    partial = with_commits = 0
    for p in plans:
        plan = p["plan"]
        assert plan.refresh.tolist() == (p["step_in_block"] % 3 == 0).tolist()
        if plan.refresh.all():
            continue
        partial += 1
        compute, step = plan.compute, p["step"]
        just = p["commit_step"] == step - 1
        assert compute[just].all()  # committed at t: recomputed at t+1 (Dream's schedule may commit 0 at t)
        with_commits += int(bool(just.any()))
        assert compute[p["masked"]].all()  # every mask, in and out of the block
        older = (p["commit_step"] >= 0) & (p["commit_step"] < step - 1)
        extra = compute & ~p["masked"] & ~just  # only the logit sources (Dream: i-1) may add to the set
        assert not (extra & ~p["sources"]).any()
        assert not (compute & older & ~p["sources"]).any()  # older commits come from the cache
    assert partial >= 8 and with_commits >= partial - 3  # Dream's schedule: 0 commits at each block's step 0


# --- dLLM-Cache


def test_dllm_cache_schedule_and_value_selection(llada_lm):
    pol = make_policy("dllm-cache", kp=4, kr=3, rho=0.25)
    picks = []
    inner_select = pol.select

    def select(state):
        out = inner_select(state)
        fresh, cached = state.probe.layer_values(state.tokens), state.probe.cached_values()
        change = 1 - torch.nn.functional.cosine_similarity(fresh, cached, dim=-1)  # (B, T)
        changed = (state.commit_step >= 0) & (state.commit_step >= pol.last)  # committed since last computed
        picks.append((out.clone(), change, changed))
        return out

    pol.select = select
    plans, _ = spy_run(llada_lm, pol)
    P = plans[0]["masked"].shape[1] - CFG.gen_length
    k = math.ceil(0.25 * CFG.gen_length)
    for p in plans:
        step, plan = p["step"], p["plan"]
        assert bool(plan.refresh.all()) == (step % 12 == 0)
        if plan.refresh.all():
            continue
        assert plan.compute[:, :P].all() == (step % 4 == 0)  # prompt every kp steps
        assert plan.compute[:, P:].all() == (step % 3 == 0)  # response every kr steps
    assert len(picks) == sum(1 for p in plans if p["step"] % 3 and p["step"] % 12)
    for out, change, changed in picks:
        assert (out.sum(1) == k).all() and not out[:, :P].any()  # exactly ceil(rho * G) response positions
        resp = change[:, P:]
        assert torch.equal(resp > pol.tol, changed[:, P:])  # layer-0 V moved exactly where the token changed
        for b in range(out.shape[0]):
            sel, rest = resp[b][out[b, P:]], resp[b][~out[b, P:]]
            assert sel.min() >= rest.max() - 1e-6  # the largest value changes are the ones chosen
    assert any((c[:, P:] & o[:, P:]).any() for o, _, c in picks)


# --- d2Cache


def test_certainty_density_padding_rule():
    G, sigma = 64, 4.0
    none = certainty_density(torch.zeros(1, G, dtype=torch.bool), sigma)[0]
    d = torch.arange(-16, 17, dtype=torch.float32)
    w = torch.exp(-d ** 2 / (2 * sigma ** 2))
    assert none[0].item() == pytest.approx((w[:16].sum() / w.sum()).item(), abs=1e-6)  # prompt side counts
    assert none[-1].item() == pytest.approx(0.0, abs=1e-6)
    alld = certainty_density(torch.ones(1, G, dtype=torch.bool), sigma)
    torch.testing.assert_close(alld, torch.ones(1, G))
    last = torch.zeros(1, G, dtype=torch.bool)
    last[0, -1] = True  # the far side now counts as committed
    assert certainty_density(last, sigma)[0, -1] > 0.5


def test_rollout_importance_equals_matrix_product():
    g = torch.Generator().manual_seed(5)
    B, T, L = 2, 9, 3
    pos = torch.tensor([[1, 4, 6, 1], [0, 2, 3, 8]])  # row 0 padded with a repeat of its first
    probs = [torch.rand(B, 4, T, generator=g).softmax(-1) for _ in range(L)]
    for a in probs:
        a[0, 3] = a[0, 0]  # a padding repeat carries its position's row
    got = rollout_importance(pos, probs, T)
    for b in range(B):
        roll = torch.eye(T)
        for a in probs:
            eff = torch.eye(T)
            for r in range(4):
                eff[pos[b, r]] = a[b, r]
            res = eff + torch.eye(T)
            roll = (res / res.sum(-1, keepdim=True)) @ roll
        torch.testing.assert_close(got[b], roll.sum(0))


def test_nucleus_takes_the_top_share_and_at_least_one():
    scores = torch.tensor([[0.5, 0.05, 0.3, 0.15], [0.9, 0.1, 0.0, 0.0]])
    allowed = torch.tensor([[True, True, True, True], [False, True, True, True]])
    assert nucleus(scores, 0.85, allowed).tolist() == [[True, False, True, False], [False, True, False, False]]
    assert nucleus(scores, 0.0, allowed).sum(1).tolist() == [1, 1]


def _state(masked, prompt_len, block, gen_length, shift=0):
    masked = torch.tensor(masked, dtype=torch.bool)
    B, T = masked.shape
    cs = torch.where(masked, -1, 0)
    return DecodeState(tokens=torch.zeros(B, T, dtype=torch.long), key_mask=torch.ones(B, T, dtype=torch.bool),
                       masked=masked, commit_order=cs.clone(), commit_step=cs, n_committed=(cs >= 0).sum(1),
                       rows=torch.arange(B), prompt_len=prompt_len, gen_length=gen_length,
                       block_length=block[1] - block[0], logit_shift=shift, n_layers=2,
                       block=torch.full((B,), (block[0] - prompt_len) // (block[1] - block[0])),
                       step_in_block=torch.zeros(B, dtype=torch.long), row_step=torch.zeros(B, dtype=torch.long))


def test_d2cache_masked_selection_block_first_then_density():
    # prompt 2, blocks of 4: block [6, 10) has masks 7 and 9; the next block [10, 14) is all masked
    row = [0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1]
    state = _state([row], prompt_len=2, block=(6, 10), gen_length=14)
    pol = D2Cache(current_k=4, sigma=2.0)
    pol.reset(state)
    sel = pol.masked_selection(state)[0].nonzero().flatten().tolist()
    # both block masks, then the two next-block masks with the highest density (nearest the committed text);
    # the window stops at the end of the block that holds the 4th mask (13), so 14 and 15 are out
    assert sel == [7, 9, 10, 11]
    pol.conf[0, 11] = 0.01  # a low confidence lowers a position's certainty
    assert pol.masked_selection(state)[0].nonzero().flatten().tolist() == [7, 9, 10, 12]
    dream = _state([row], prompt_len=2, block=(6, 10), gen_length=14, shift=1)
    assert pol.masked_selection(dream)[0].nonzero().flatten().tolist() == [6, 7, 8, 9, 10, 11, 12]  # + sources


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_d2cache_recomputes_commits_density_and_rollout(family, llada_lm, dream_lm):
    lm = llada_lm if family == "llada" else dream_lm
    pol = make_policy("d2cache", current_k=4, rollout_p=0.3)
    plans, records = spy_run(lm, pol)
    assert plans[0]["plan"].refresh.all() and not any(p["plan"].refresh.any() for p in plans[1:])
    for p, prev in zip(plans[1:], records):
        plan = p["plan"]
        assert torch.equal(plan.hooks.attention_rows, plan.compute)  # rollout reads every query row
        assert plan.compute[p["commit_step"] == p["step"] - 1].all()
        # the rollout nucleus adds committed or prompt positions beyond commits, masks and their sources
        need = p["masked"] | (p["commit_step"] == p["step"] - 1)
        need = need | torch.roll(need, -1, 1) if family == "dream" else need
        assert (plan.compute & ~need).any(1).all()
        pos, probs = prev.outputs["attention"]
        assert len(probs) == lm.spec.n_layers and probs[0].shape[:2] == pos.shape
    assert sum(r.computed.sum() for r in records[1:]) < sum(r.computed.sum() for r in records[:1]) * (len(records) - 1)


# --- Elastic-Cache


def _elastic_record(state, pos, rows_per_layer):
    B = state.batch
    zeros = torch.zeros(B, dtype=torch.long)
    return StepRecord(step=state.step, block=zeros, step_in_block=zeros, rows=torch.arange(B), planned=zeros,
                      refresh=torch.zeros(B, dtype=torch.bool), computed=torch.zeros(B, dtype=torch.long),
                      query_width=0, targets=torch.zeros(B, 1, dtype=torch.long),
                      valid=torch.ones(B, 1, dtype=torch.bool),
                      committed=torch.zeros(B, 1, dtype=torch.bool), x0=torch.zeros(B, 1, dtype=torch.long),
                      prob=torch.ones(B, 1, dtype=torch.float64), entropy=torch.zeros(B, 1, dtype=torch.float64),
                      outputs={"attention": (pos, rows_per_layer)})


def test_elastic_drift_test_sets_the_start_layer():
    """The most-attended key of each layer is tracked; when its own attention row moves (cos < gamma) at layer
    l, the next forward recomputes every position from layer l + 1."""
    T, L = 6, 3
    state = _state([[0, 0, 0, 0, 1, 1]], prompt_len=2, block=(4, 6), gen_length=4)
    state.n_layers = L
    pol = ElasticCache(gamma=0.9)
    pol.reset(state)
    pos = torch.tensor([[1, 4, 5]])  # queries: token 1 and the two masks

    def rows(change_layer=None):
        out = []
        for layer in range(L):
            a = torch.full((1, 3, T), 0.02)
            a[0, 1:, 1] = 0.9  # the masks attend to position 1: it is the most-attended token
            a[0, 0] = torch.tensor([0.1, 0.5, 0.1, 0.1, 0.1, 0.1])
            if layer == change_layer:
                a[0, 0] = torch.tensor([0.5, 0.0, 0.0, 0.5, 0.0, 0.0])  # its own row moved
            out.append(a / a.sum(-1, keepdim=True))
        return out

    pol.observe(state, _elastic_record(state, pos, rows()))
    assert pol.tracked.tolist() == [[1, 1, 1]] and pol.has_prev.all()
    assert pol.start_next.tolist() == [L]  # nothing to compare yet
    state.step = 1
    plan = pol.plan(state)
    assert plan.compute[0, 1] and plan.hooks.attention_rows[0, 1]  # the tracked token is a query now
    pol.observe(state, _elastic_record(state, pos, rows()))
    assert pol.start_next.tolist() == [L] and pol.similarity.min() > 0.99
    pol.observe(state, _elastic_record(state, pos, rows(change_layer=1)))
    assert pol.similarity[0, 1] < 0.9 and pol.start_next.tolist() == [2]
    state.step = 2
    assert pol.plan(state).hooks.grow_from_layer.tolist() == [2]
    pol.observe(state, _elastic_record(state, pos, rows(change_layer=0)))
    assert pol.start_next.tolist() == [1]


@pytest.mark.parametrize("gamma", [2.0, -1.0])
def test_elastic_engine_passes_the_start_layer(lm3, gamma):
    """The start layer decided after step t reaches the model at step t + 1, and the step's work counts
    layer-averaged positions. gamma 2 drifts at the first tested layer, gamma -1 never."""
    seen, decided = [], []
    model = lm3.model
    inner = model.forward

    def spy(tokens, store, query_pos=None, logits_pos=None, **kw):
        never = torch.full((tokens.shape[0],), 3)  # no row expands: the engine passes no start layer
        seen.append((query_pos is None, kw.get("expand_from_layer", never)))
        return inner(tokens, store, query_pos=query_pos, logits_pos=logits_pos, **kw)

    pol = POLICIES["elastic"](gamma=gamma, window=4)  # past make_policy's [0, 1] on purpose: always / never
    inner_observe = pol.observe

    def observe(state, rec):
        tested = pol.has_prev.clone()  # layers whose tracked row this forward can compare
        inner_observe(state, rec)
        first = [int(t.nonzero()[0]) + 1 if t.any() and gamma > 1 else 3 for t in tested]
        decided.append((pol.start_next.tolist(), first))

    pol.observe = observe
    model.forward = spy
    try:
        _, records = spy_run(lm3, pol, prompts=PROMPTS[:1])
    finally:
        del model.forward
    assert seen[0][0] and records[0].full  # the first step is full
    starts = [s.tolist() for _, s in seen[1:]]
    assert starts == [d[0] for d in decided[:-1]]
    assert all(d[0] == d[1] for d in decided)  # the first tested layer drifts (gamma 2) or none (gamma -1)
    T = records[0].query_width
    for r, s in zip(records[1:], starts):
        assert r.computed.item() == (r.query_width * s[0] + T * (3 - s[0])) // 3  # layer-averaged positions
    if gamma > 1:
        assert sum(s == [1] for s in starts) > len(starts) // 2
    else:
        assert all(s == [3] for s in starts)


def test_elastic_plan_is_window_block_tracked_and_recent_commits():
    state = _state([[0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1]], prompt_len=0, block=(4, 8), gen_length=12)
    state.n_layers = 2
    state.commit_step = torch.tensor([[-1, -1, 0, 0, 2, -1, 3, -1, -1, -1, -1, -1]])
    state.row_step = torch.tensor([4])
    pol = ElasticCache(window=3)
    pol.reset(state)
    pol.tracked = torch.tensor([[1, 2]])
    plan = pol.plan(state)
    # masks 5, 7 (block) + window {5, 7, 8} + tracked {1, 2} + committed at step 3: {6}
    assert plan.compute[0].nonzero().flatten().tolist() == [1, 2, 5, 6, 7, 8]
    assert plan.hooks.attention_rows[0].nonzero().flatten().tolist() == [1, 2, 5, 7, 8]
    assert plan.hooks.grow_from_layer.tolist() == [2]
