"""EntropyCache's variants (``recent_steps``: recompute commits while they are young; ``block_tau``: the
signal decides whether a block start refreshes): the positions and refreshes they plan on hand-built
states, the paper's rule unchanged when they are off, and decoding equal to ``none`` under the forced
refresh (τ = 0) whatever the variant."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS
from test_policies import make_record, make_state, run_policy

from ecache_cli.cache import make_policy
from ecache_cli.cache.entropy import EntropyCache
from ecache_cli.decoding.config import DecodeConfig
from ecache_cli.errors import UsageError


def positions(mask: torch.Tensor) -> list[list[int]]:
    return [r.nonzero().flatten().tolist() for r in mask]


def test_recent_steps_recompute_commits_by_age_together_with_recent_k():
    # row 0 committed 9 and 2 at its step 0, 7 at step 1, 4 and 5 at step 2; it is now at step 3
    order = [[-1, -1, 1, -1, 3, 4, -1, 2, -1, 0]]
    state = make_state([[0] * 10], commit_order=order)
    state.commit_step = torch.tensor([[-1, -1, 0, -1, 2, 2, -1, 1, -1, 0]])
    state.row_step = torch.tensor([3])
    recent = lambda **kw: positions(EntropyCache(**kw).recent(state))  # noqa: E731
    assert recent(recent_k=0, recent_steps=1) == [[4, 5]]  # committed at the previous step (age 1)
    assert recent(recent_k=0, recent_steps=2) == [[4, 5, 7]]
    assert recent(recent_k=0, recent_steps=3) == [[2, 4, 5, 7, 9]]
    assert recent(recent_k=1, recent_steps=2) == [[4, 5, 7]]  # the union: rank 4 (position 5) is in both
    assert recent(recent_k=4, recent_steps=1) == [[2, 4, 5, 7]]  # k = 4: ranks 1..4
    assert recent(recent_k=2) == recent(recent_k=2, recent_steps=0) == [[4, 5]]  # off: the paper's k rule


def test_block_tau_refreshes_a_block_start_only_after_an_uncertain_block():
    pol = EntropyCache(tau=5.0, block_tau=1.0)
    state = make_state([[0, 1, 1, 0], [0, 1, 1, 0]], block=(1, 3))
    pol.reset(state)
    state.step_in_block = torch.tensor([1, 1])
    pol.refresh_next = torch.zeros(2, dtype=torch.bool)
    assert pol.plan(state).refresh.tolist() == [False, False]
    # row 0's block had a step at 1.5 nats (> block_tau, < tau), row 1's at most 0.5
    pol.observe(state, make_record([[1.5], [0.5]], [[0.5], [0.9]], [[1], [1]]))
    pol.observe(state, make_record([[0.2], [0.1]], [[0.9], [0.9]], [[1], [1]]))
    assert pol.refresh_next.tolist() == [False, False]
    assert pol.plan(state).refresh.tolist() == [False, False]  # not a block start
    state.step_in_block = torch.tensor([0, 0])
    assert pol.plan(state).refresh.tolist() == [True, False]
    assert pol.block_signal.tolist() == [float("-inf")] * 2  # the new block starts afresh
    pol.observe(state, make_record([[0.3], [0.3]], [[0.9], [0.9]], [[1], [1]]))
    state.step_in_block = torch.tensor([0, 0])  # the next block start: nothing above 1 nat since
    assert pol.plan(state).refresh.tolist() == [False, False]
    # block_refresh forces every block start whatever block_tau
    both = EntropyCache(tau=5.0, block_tau=100.0, block_refresh=True)
    both.reset(state)
    both.refresh_next = torch.zeros(2, dtype=torch.bool)
    assert both.plan(state).refresh.tolist() == [True, True]


def test_refresh_prompt_off_recomputes_the_canvas_and_keeps_the_prompt():
    # prompt [0, 4), canvas [4, 10), block [4, 7): row 0 was triggered (an uncertain step), row 1 was not
    pol = EntropyCache(tau=1.0, recent_k=0, refresh_prompt=False)
    state = make_state([[0, 0, 0, 0, 1, 1, 0, 1, 1, 1]] * 2, block=(4, 7), prompt_len=4)
    pol.reset(state)
    first = pol.plan(state)
    assert first.refresh.tolist() == [True, True]  # a row's first step is a full forward
    state.row_step = torch.tensor([3, 3])
    state.step_in_block = torch.tensor([2, 2])
    pol.refresh_next = torch.tensor([True, False])
    plan = pol.plan(state)
    assert plan.refresh.tolist() == [False, False]
    assert positions(plan.compute) == [[4, 5, 6, 7, 8, 9], [4, 5]]  # the canvas / the block's masks
    # a block start under block_refresh stays a full forward
    both = EntropyCache(tau=1.0, recent_k=0, refresh_prompt=False, block_refresh=True)
    both.reset(state)
    both.refresh_next = torch.tensor([True, False])
    state.step_in_block = torch.tensor([0, 2])
    plan = both.plan(state)
    assert plan.refresh.tolist() == [True, False] and positions(plan.compute)[1] == [4, 5]
    # on: the paper's full refresh
    on = EntropyCache(tau=1.0, recent_k=0)
    on.reset(state)
    on.refresh_next = torch.tensor([True, False])
    assert on.plan(state).refresh.tolist() == [True, False]


def test_refresh_prompt_off_decodes_a_row_alike_alone_and_in_a_batch_with_less_work(lm):
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=16)
    params = {"tau": 0.0, "recent_k": 0, "refresh_prompt": False}  # every step triggered: canvas refreshes
    batch, records = run_policy(lm, PROMPTS[:3], cfg, "entropy", **params)
    alone = [run_policy(lm, [p], cfg, "entropy", **params)[0][0] for p in PROMPTS[:3]]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    full = [rec.full for rec in records]
    assert full[0] and not any(full[1:])  # only the first step is a full forward
    ref, ref_records = run_policy(lm, PROMPTS[:3], cfg, "none")
    assert sum(int(r.computed.sum()) for r in records) < sum(int(r.computed.sum()) for r in ref_records)


def test_variant_parameters_are_checked():
    with pytest.raises(UsageError, match="recent_steps -1 must be ≥ 0"):
        EntropyCache(recent_steps=-1)
    with pytest.raises(UsageError, match="block_tau=-0.5"):
        make_policy("entropy", block_tau=-0.5)
    with pytest.raises(UsageError, match=r"block_tau='0\.5' must be a number, not a string \(e\.g\. block_tau=0\.5\)"):
        make_policy("entropy", block_tau="0.5")  # the Python API takes numbers, as --policies' parser gives it
    assert make_policy("entropy", block_tau=0.5).block_tau == 0.5


@pytest.mark.parametrize("variant", [{"recent_steps": 2, "recent_k": 0}, {"block_tau": 0.5},
                                     {"recent_steps": 1, "block_tau": 0.0, "block_refresh": True}])
@pytest.mark.parametrize("rule", [{"steps": 16}, {"threshold": 0.7}], ids=["schedule", "threshold"])
def test_forced_refresh_reproduces_none_for_every_variant(lm, variant, rule):
    cfg = DecodeConfig(gen_length=16, block_length=8, **rule)
    ref, _ = run_policy(lm, PROMPTS[:3], cfg, "none")
    got, records = run_policy(lm, PROMPTS[:3], cfg, "entropy", tau=0.0, **variant)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [r.stats["nfe"] for r in got] == [r.stats["nfe"] for r in ref]


@pytest.mark.parametrize("variant", [{"recent_steps": 2, "recent_k": 0}, {"block_tau": 0.5}])
def test_variants_decode_a_row_alike_alone_and_in_a_batch_and_skip_work(lm, variant):
    cfg = DecodeConfig(gen_length=16, block_length=8, threshold=0.7)
    params = {"tau": 1.0, "recent_k": 4, **variant}
    batch, records = run_policy(lm, PROMPTS[:3], cfg, "entropy", **params)
    alone = [run_policy(lm, [p], cfg, "entropy", **params)[0][0] for p in PROMPTS[:3]]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    assert any(not rec.full for rec in records)
