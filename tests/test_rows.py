"""Rows with their own clocks: per-row state by declaration, and rows joining a running run.

A row added to a running run mid-block decodes token for token as its prompt alone (float32, every
policy, both families), and rows that finish leave without disturbing the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import PROMPTS as RAGGED_PROMPTS

from ecache_cli.cache import POLICIES, make_policy
from ecache_cli.cache.base import CachePolicy, ForwardPlan
from ecache_cli.contract import rows as row_fields
from ecache_cli.contract.rows import ROW, PerRow
from ecache_cli.engine import DecodeConfig, Engine

PROMPTS = RAGGED_PROMPTS[:3]  # three of the shared prompts of different lengths
# settings with partial forwards inside a 16-token answer (2 blocks of 8)
PARAMS: dict[str, dict] = {n: c.test_params for n, c in POLICIES.items()}  # each policy's own (CachePolicy.test_params)


# --- per-row fields by declaration


class Pairwise:
    """A holder with a (B, B) pairwise field, a per-row list and a (B, L) field."""

    FIELDS = {"pair": PerRow(dims=(0, 1)), "notes": PerRow(items=True), "per_layer": ROW}

    def __init__(self, B: int):
        self.pair = torch.arange(B * B, dtype=torch.float32).view(B, B)
        self.notes = [f"row{b}" for b in range(B)]
        self.per_layer = torch.arange(B * 2).view(B, 2)


def test_pairwise_state_and_per_row_list_are_kept_taken_and_appended():
    h = Pairwise(3)
    taken = row_fields.take(h, h.FIELDS, torch.tensor([2]))
    assert taken["pair"].tolist() == [[8.0]] and taken["notes"] == ["row2"] and taken["per_layer"].tolist() == [[4, 5]]
    row_fields.keep(h, h.FIELDS, torch.tensor([1, 0]))  # drop row 2, swap the others
    assert h.pair.tolist() == [[4.0, 3.0], [1.0, 0.0]] and h.notes == ["row1", "row0"]
    row_fields.append(h, h.FIELDS, taken)
    # the appended row keeps its own entry; entries pairing it with the others start at 0
    assert h.pair.tolist() == [[4.0, 3.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 8.0]]
    assert h.notes == ["row1", "row0", "row2"] and h.per_layer.tolist() == [[2, 3], [0, 1], [4, 5]]


@dataclass
class PairPolicy(CachePolicy):
    """A policy whose per-row state is a (B, B) tensor and a per-row list: plans full forwards, and records in
    each row's list the steps it observed, so dropping and joining rows must slice exactly these."""

    name = "pair-test"
    row_state = {"affinity": PerRow(dims=(0, 1)), "seen": PerRow(items=True)}

    def reset(self, state):
        B = state.batch
        self.affinity = torch.eye(B) * state.rows[:, None].float()
        self.seen = [[] for _ in range(B)]

    def plan(self, state):
        return ForwardPlan.full(state)

    def observe(self, state, record):
        for b, r in enumerate(state.rows.tolist()):
            self.seen[b].append(int(state.row_step[b]))
            assert float(self.affinity[b, b]) == r  # the diagonal follows its row through drops and joins


def test_declared_pairwise_and_list_state_follow_rows_that_finish_and_join(llada_lm):
    eng = Engine.from_loaded(llada_lm)
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=16, early_exit=True)
    pol = PairPolicy()
    run = eng.start(eng.encode(PROMPTS[:2], chat=False), cfg, pol, prompt_width=40)
    for i, _ in enumerate(run):
        if i == 2:
            run.add(eng.encode(PROMPTS[2:], chat=False)[0])
        assert pol.affinity.shape == (run.state.batch, run.state.batch) and len(pol.seen) == run.state.batch
        for b in range(run.state.batch):
            assert pol.seen[b] == list(range(len(pol.seen[b])))  # each row saw its own steps 0, 1, 2, ...


# --- joining a running run


def _alone(eng, prompt_ids, cfg, policy, row_id, seed):
    run = eng.start([prompt_ids], cfg, make_policy(policy, **PARAMS[policy]), seed=seed, row_ids=[row_id],
                    prompt_width=40)
    list(run)
    return run.results()[0]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_row_joining_mid_block_decodes_as_its_prompt_alone(lm, policy):
    eng = Engine.from_loaded(lm)
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=16, temperature=0.7)
    ids = eng.encode(PROMPTS, chat=False)
    run = eng.start(ids[:2], cfg, make_policy(policy, **PARAMS[policy]), seed=5, prompt_width=40)
    joined_at, blocks_seen = {}, set()
    for i, rec in enumerate(run):
        blocks_seen.add(tuple(rec.block.tolist()))
        if i == 3:  # mid-block: the running rows are at step 3 of block 0
            joined_at[run.add(ids[2], row_id=2)] = i
        if i == 11:  # the first rows are in block 1 now: the second join lands beside them at block 0
            joined_at[run.add(ids[0], row_id=7)] = i
    assert any(len(set(b)) > 1 for b in blocks_seen), "no step held rows at different blocks: weak test"
    got = run.results()
    assert len(got) == 4
    for b, (prompt, row_id) in enumerate([(ids[0], 0), (ids[1], 1), (ids[2], 2), (ids[0], 7)]):
        alone = _alone(eng, prompt, cfg, policy, row_id, seed=5)
        assert got[b].token_ids == alone.token_ids, (policy, b)
        for k in ("nfe", "full_forwards", "partial_forwards", "tokens_planned"):
            assert got[b].stats[k] == alone.stats[k], (policy, b, k)


def test_a_joining_prompt_longer_than_the_canvas_is_refused(llada_lm):
    eng = Engine.from_loaded(llada_lm)
    run = eng.start(eng.encode(["abc"], chat=False), DecodeConfig(gen_length=8, block_length=8), make_policy("none"))
    with pytest.raises(Exception, match="prompt width 3"):
        run.add([5, 6, 7, 8])
