"""Cache policies: forced refresh reproduces ``none``, partial forwards are exact on a fresh store, the
EntropyCache decision and its signals, recent-k, and the positions every plan must compute."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS as RAGGED_PROMPTS
from conftest import bidirectional_policies

from ecache_cli.cache import POLICIES, make_policy
from ecache_cli.cache.entropy import EntropyCache
from ecache_cli.engine import DecodeConfig, DecodeState, Engine, StepRecord
from ecache_cli.errors import UsageError

PROMPTS = RAGGED_PROMPTS[:3]  # three of the shared prompts of different lengths

# Parameters that make a policy refresh (full forward) at every step: each policy declares them in its own
# file (``CachePolicy.forced_refresh``; None = it has no such setting, and the equivalence test skips it).
FORCED_REFRESH: dict[str, dict] = {n: c.forced_refresh for n, c in POLICIES.items() if c.forced_refresh is not None}
NO_FORCED_REFRESH: dict[str, str] = {n: f"{n} declares no forced_refresh setting" for n in bidirectional_policies()
                                     if POLICIES[n].forced_refresh is None}


def run_policy(lm, prompts, cfg, policy, **params):
    eng = Engine.from_loaded(lm)
    run = eng.start(eng.encode(prompts, chat=False), cfg, make_policy(policy, **params))
    records = list(run)
    return run.results(), records


def make_state(masked_rows, commit_order=None, block=(0, 0), shift=0, prompt_len=0) -> DecodeState:
    """A DecodeState by hand: masked_rows (B, T) of 0/1, commit_order (B, T) ranks (−1 = none)."""
    masked = torch.tensor(masked_rows, dtype=torch.bool)
    B, T = masked.shape
    order = torch.full((B, T), -1) if commit_order is None else torch.tensor(commit_order)
    return DecodeState(
        tokens=torch.zeros(B, T, dtype=torch.long), key_mask=torch.ones(B, T, dtype=torch.bool), masked=masked,
        commit_order=order, commit_step=order.clone(), n_committed=(order >= 0).sum(1), rows=torch.arange(B),
        prompt_len=prompt_len, gen_length=T - prompt_len, block_length=block[1] - block[0], logit_shift=shift,
        n_layers=2, block=torch.full((B,), (block[0] - prompt_len) // max(block[1] - block[0], 1)),
        step_in_block=torch.zeros(B, dtype=torch.long), row_step=torch.zeros(B, dtype=torch.long),
    )


def make_record(entropy, prob, committed) -> StepRecord:
    e = torch.tensor(entropy, dtype=torch.float64)
    B, R = e.shape
    return StepRecord(
        step=0, block=torch.zeros(B, dtype=torch.long), step_in_block=torch.zeros(B, dtype=torch.long),
        rows=torch.arange(B), refresh=torch.ones(B, dtype=torch.bool), planned=torch.zeros(B, dtype=torch.long),
        computed=torch.zeros(B, dtype=torch.long), query_width=0, targets=torch.zeros(B, R, dtype=torch.long),
        valid=torch.ones(B, R, dtype=torch.bool), committed=torch.tensor(committed, dtype=torch.bool),
        x0=torch.zeros(B, R, dtype=torch.long), prob=torch.tensor(prob, dtype=torch.float64), entropy=e,
    )


# --- forced refresh == none, token for token


def test_every_shipped_policy_declares_a_forced_refresh():
    """The equivalence below is only as strong as the policies it covers: every shipped policy has one."""
    assert not NO_FORCED_REFRESH, f"declare forced_refresh in the policy's class: {sorted(NO_FORCED_REFRESH)}"


@pytest.mark.parametrize("policy", bidirectional_policies())
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("rule", [{"steps": 16}, {"threshold": 0.7}], ids=["schedule", "threshold"])
def test_forced_refresh_reproduces_none(lm, policy, batch, rule):
    if policy in NO_FORCED_REFRESH:
        pytest.skip(NO_FORCED_REFRESH[policy])
    cfg = DecodeConfig(gen_length=16, block_length=8, **rule)
    prompts = PROMPTS[:batch]
    ref, _ = run_policy(lm, prompts, cfg, "none")
    got, records = run_policy(lm, prompts, cfg, policy, **FORCED_REFRESH[policy])
    # every forward that follows a change of the row's canvas is full (a row with no masks left in the block
    # commits nothing, so its store stays exact and it may skip the refresh)
    changed = {}
    for rec in records:
        for i, row in enumerate(rec.rows.tolist()):
            assert rec.refresh[i] or not changed.get(row, True), f"step {rec.step} row {row}: not forced to refresh"
            changed[row] = bool(rec.committed[i].any())
    assert records[0].full
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [r.stats["nfe"] for r in got] == [r.stats["nfe"] for r in ref]


@pytest.mark.parametrize("policy", ["prefix", "dual", "entropy"])
def test_default_policies_do_partial_forwards(lm, policy):
    """The equivalence above is not vacuous: by default these policies do compute less than ``none``."""
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=16)
    _, records = run_policy(lm, PROMPTS[:1], cfg, policy)
    assert any(not rec.full for rec in records)
    assert min(rec.query_width for rec in records) < records[0].query_width


# --- partial forward on a fresh store


def test_partial_forward_after_full_refresh_is_exact(lm):
    """Right after a full forward, computing any subset of positions (with duplicates) gives the full forward's
    logits for those rows and rewrites the store with the same K/V."""
    model, spec = lm.model, lm.spec
    T = 20
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(10, 90, (2, T), generator=g)
    tokens[:, 12:] = spec.mask_id
    tokens[0, :3] = spec.pad_id
    key_mask = torch.ones(2, T, dtype=torch.bool)
    key_mask[0, :3] = False  # row 0 is left padded
    query = torch.tensor([[12, 13, 14, 15, 4, 12], [12, 13, 14, 15, 16, 17]])  # (B, S), row 0 repeats 12
    logits_pos = query[:, :4]
    with torch.inference_mode():
        store = model.new_store(key_mask)
        full = model(tokens, store)  # (B, T, V)
        k_before, v_before = [t.clone() for t in store.k], [t.clone() for t in store.v]
        part = model(tokens, store, query_pos=query, logits_pos=logits_pos)  # (B, 4, V)
    want = full.gather(1, logits_pos[..., None].expand(-1, -1, full.shape[-1]))
    torch.testing.assert_close(part, want, rtol=0, atol=1e-5)
    for a, b in zip(k_before + v_before, store.k + store.v):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # and the check can fail: once the canvas changes, a partial forward reads stale K/V (KV drift)
    tokens2 = tokens.clone()
    tokens2[:, 12] = 42
    with torch.inference_mode():
        stale = model(tokens2, store, query_pos=query[:, :4], logits_pos=query[:, 1:4])
        fresh = model(tokens2, model.new_store(key_mask))
    fresh = fresh.gather(1, query[:, 1:4, None].expand(-1, -1, fresh.shape[-1]))
    assert (stale - fresh).abs().max() > 1e-3


# --- EntropyCache decision and signals


def test_signal_variants():
    rec = make_record(entropy=[[0.2, 1.5, 0.7], [0.1, 0.3, 2.0], [3.0, 3.0, 3.0]],
                      prob=[[0.9, 0.2, 0.6], [0.99, 0.8, 0.1], [0.5, 0.5, 0.5]],
                      committed=[[1, 0, 1], [1, 1, 0], [0, 0, 0]])
    assert rec.signal("max-entropy").tolist() == pytest.approx([0.7, 0.3, float("-inf")])
    assert rec.signal("sum-entropy").tolist() == pytest.approx([0.9, 0.4, 0.0])
    assert rec.signal("max-confidence").tolist() == pytest.approx([0.4, 0.2, float("-inf")])  # 1 − min prob
    with pytest.raises(ValueError):
        rec.signal("mean-entropy")


@pytest.mark.parametrize("signal,tau,expect", [
    ("max-entropy", 0.5, [True, False, False]),
    ("max-entropy", 0.7, [False, False, False]),  # E = τ exactly: no refresh (E > τ refreshes)
    ("max-entropy", 0.25, [True, True, False]),
    ("sum-entropy", 0.5, [True, False, False]),
    ("sum-entropy", 0.35, [True, True, False]),
    ("max-confidence", 0.3, [True, False, False]),
    ("max-confidence", 0.1, [True, True, False]),
])
def test_entropy_cache_refresh_follows_signal(signal, tau, expect):
    rec = make_record(entropy=[[0.2, 1.5, 0.7], [0.1, 0.3, 2.0], [3.0, 3.0, 3.0]],
                      prob=[[0.9, 0.2, 0.6], [0.99, 0.8, 0.1], [0.5, 0.5, 0.5]],
                      committed=[[1, 0, 1], [1, 1, 0], [0, 0, 0]])  # row 2 committed nothing: no refresh
    pol = EntropyCache(tau=tau, signal=signal)
    state = make_state([[0] * 4] * 3)
    pol.reset(state)
    assert pol.refresh_next.tolist() == [True] * 3  # the first step always refreshes
    pol.observe(state, rec)
    assert pol.refresh_next.tolist() == expect
    assert pol.plan(state).refresh.tolist() == expect


def test_entropy_cache_block_refresh_and_bad_params():
    pol = EntropyCache(tau=5.0, block_refresh=True)
    state = make_state([[0, 1, 1, 0]], block=(1, 3))
    pol.reset(state)
    pol.observe(state, make_record([[0.1]], [[0.9]], [[1]]))
    state.step_in_block = torch.tensor([0])
    assert pol.plan(state).refresh.tolist() == [True]
    state.step_in_block = torch.tensor([1])
    assert pol.plan(state).refresh.tolist() == [False]
    with pytest.raises(UsageError, match="--signal"):
        EntropyCache(signal="nope")
    with pytest.raises(UsageError, match="--recent-k"):
        EntropyCache(recent_k=-1)


def test_recent_k_is_by_commit_order_not_position():
    # committed order (rank): position 9 first, then 2, 7, 4, 5; row 1 committed two tokens
    order = [[-1, -1, 1, -1, 3, 4, -1, 2, -1, 0], [-1, 0, -1, -1, -1, -1, -1, -1, 1, -1]]
    state = make_state([[0] * 10, [0] * 10], commit_order=order)
    recent = lambda k: [r.nonzero().flatten().tolist() for r in EntropyCache(recent_k=k).recent(state)]  # noqa: E731
    assert recent(3) == [[4, 5, 7], [1, 8]]  # ranks 2, 3, 4 of row 0; all of row 1
    assert recent(1) == [[5], [8]]
    assert recent(0) == [[], []]
    assert recent(64) == [[2, 4, 5, 7, 9], [1, 8]]


def test_entropy_plan_is_block_masks_sources_and_recent():
    order = [[-1, -1, -1, 0, 1, 2, -1, -1, -1, -1]]
    masked = [[0, 0, 0, 0, 0, 0, 1, 0, 1, 1]]
    for shift, expect in ((0, [4, 5, 6, 8]), (1, [4, 5, 6, 7, 8])):
        state = make_state(masked, commit_order=order, block=(6, 9), shift=shift, prompt_len=3)
        pol = EntropyCache(recent_k=2)
        pol.reset(state)
        pol.refresh_next = torch.zeros(1, dtype=torch.bool)
        plan = pol.plan(state)
        # targets: masked 6 and 8 (9 lies outside the block); Dream adds 5 and 7; recent-2: ranks 1, 2 = 4, 5
        assert plan.compute[0].nonzero().flatten().tolist() == expect


def test_fastdllm_windows():
    masked = [[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]]
    for shift in (0, 1):
        state = make_state(masked, block=(4, 7), shift=shift, prompt_len=4)
        state.step_in_block = torch.tensor([1])
        prefix, dual = make_policy("prefix").plan(state), make_policy("dual").plan(state)
        extra = [3] if shift else []
        assert prefix.compute[0].nonzero().flatten().tolist() == extra + list(range(4, 10))
        assert dual.compute[0].nonzero().flatten().tolist() == extra + [4, 5, 6]
        assert not prefix.refresh.any() and not dual.refresh.any()
        state.step_in_block = torch.tensor([0])
        assert make_policy("dual").plan(state).refresh.all()


@pytest.mark.parametrize("policy,params",
                         [(p, {}) for p in bidirectional_policies()] + [("entropy", {"tau": 1.0, "recent_k": 2})])
def test_plans_cover_the_logit_sources(lm, policy, params):
    """Every plan computes, for rows that do not refresh, each masked target of the block and (Dream) the
    position i−1 whose hidden state predicts it."""
    eng = Engine.from_loaded(lm)
    pol = make_policy(policy, **params)
    seen = []
    inner = pol.plan

    def spy(state):
        plan = inner(state)
        targets = state.block_masked()
        sources = torch.zeros_like(targets)
        sources[:, : state.length - state.logit_shift] = targets[:, state.logit_shift:]
        for b in range(state.batch):
            if plan.refresh[b]:
                continue
            assert plan.compute is not None
            need = (targets[b] | sources[b]).nonzero().flatten()
            assert plan.compute[b, need].all(), (state.step, b, need.tolist())
            if state.logit_shift:
                i = targets[b].nonzero().flatten()
                assert plan.compute[b, i - 1].all()
        seen.append(bool(plan.refresh.all()))
        return plan

    pol.plan = spy
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=16)
    run = eng.start(eng.encode(PROMPTS, chat=False), cfg, pol)
    for _ in run:
        pass
    assert len(seen) == 16
    if policy != "none":
        assert not all(seen), "no partial step was planned: the check saw nothing"


def test_make_policy_errors():
    with pytest.raises(UsageError, match="not a cache policy"):
        make_policy("lru")
    with pytest.raises(UsageError, match="no parameter 'tau'"):
        make_policy("dual", tau=1.0)  # strict by default, as the command line
    assert make_policy("dual", strict=False, tau=1.0).name == "dual"  # non-strict drops foreign parameters
    assert make_policy("entropy", tau=0.3, recent_k=8).params() == {
        "tau": 0.3, "recent_k": 8, "signal": "max-entropy", "block_refresh": False, "recent_steps": 0,
        "block_tau": None, "refresh_prompt": True}


def test_block_masks_are_computed_once_while_masks_and_block_stay_the_same_tensors():
    state = make_state([[0, 1, 1, 1, 0, 1]], block=(1, 4), prompt_len=1)
    state.enter_blocks()  # the engine keeps the block mask
    first = state.block_masked()
    assert first.tolist() == [[False, True, True, True, False, False]] and state.block_masked() is first
    state.masked = state.masked & torch.tensor([[True, True, False, True, True, True]])  # a step commits position 2
    assert state.block_masked().tolist() == [[False, True, False, True, False, False]]
    state.block = state.block + 1  # the next block: positions 4-6
    state.enter_blocks()
    assert state.block_masked().tolist() == [[False, False, False, False, False, True]]
    state.select_rows(torch.tensor([0]))  # rows moved: the kept result belongs to the old tensors
    assert state.block_masked().tolist() == [[False, False, False, False, False, True]]
