"""Rows with their own clocks: per-row state by declaration, and rows joining a running run.

A row added to a running run mid-block decodes token for token as its prompt alone (float32, every
policy, both families), and rows that finish leave without disturbing the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import PROMPTS as RAGGED_PROMPTS
from conftest import bidirectional_policies

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


@pytest.mark.parametrize("policy", bidirectional_policies())
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


# --- rows moving in place in the KV store's buffers


def test_store_rows_join_and_leave_in_place_in_their_buffers():
    from ecache_cli.kvstore import KVStore

    km = torch.tensor([[False, True, True], [True, True, True], [False, False, True]])
    store = KVStore.allocate(2, 1, 2, km, torch.float32, keep_hidden=4, capacity=5)
    for t in store.k + store.v + store.hidden:  # each row's entries hold its index + 1
        t.copy_(torch.arange(1, 4, dtype=torch.float32).view(3, *[1] * (t.dim() - 1)).expand_as(t))
    ptrs = [t.data_ptr() for t in store.k + store.v + store.hidden + [store.key_mask, store.positions]]
    assert store.capacity == 5 and store.k[0].shape == (3, 1, 3, 2) and store.attn_mask.shape == (3, 1, 1, 3)
    store.select_rows(torch.tensor([2, 1]))  # row 0 leaves, row 2 takes its slot
    assert store.k[1][:, 0, 0, 0].tolist() == [3.0, 2.0] and store.hidden[0][:, 0, 0].tolist() == [3.0, 2.0]
    assert store.key_mask.tolist() == [[False, False, True], [True, True, True]]
    assert store.positions.tolist() == [[0, 0, 0], [0, 1, 2]]
    store.add_rows(torch.tensor([[False, True, True], [True, True, True]]))  # two fresh rows join
    assert store.k[0][:, 0, 0, 0].tolist() == [3.0, 2.0, 0.0, 0.0] and store.positions[2].tolist() == [0, 0, 1]
    assert store.attn_mask[:, 0, 0].tolist() == store.key_mask.tolist() and store.rope is None
    assert [t.data_ptr() for t in store.k + store.v + store.hidden + [store.key_mask, store.positions]] == ptrs
    store.add_rows(torch.ones(2, 3, dtype=torch.bool))  # 6 rows > capacity 5: the buffers grow (doubling)
    assert store.capacity == 10 and store.batch == 6 and store.k[0].data_ptr() != ptrs[0]
    assert store.v[1][:, 0, 0, 0].tolist() == [3.0, 2.0, 0.0, 0.0, 0.0, 0.0]
    assert store.key_mask[:4].tolist() == [[False, False, True], [True, True, True], [False, True, True], [True] * 3]
    grown = store.k[0].data_ptr()
    store.select_rows(torch.zeros(0, dtype=torch.long))  # every row leaves, then one joins the empty store
    assert store.batch == 0 and store.k[0].shape == (0, 1, 3, 2)
    store.add_rows(torch.tensor([[False, True, True]]))
    assert store.k[0].data_ptr() == grown and store.capacity == 10 and store.k[0].abs().sum() == 0
    assert store.positions.tolist() == [[0, 0, 1]] and store.attn_mask[:, 0, 0].tolist() == [[False, True, True]]


def test_store_writes_land_on_their_positions_in_contiguous_and_strided_buffers():
    """A partial write puts each (row, head, position) vector at its canvas position and nowhere else,
    through the flat row copy (the store's own buffers) and through the scatter kept for K/V tensors set
    from outside that are not contiguous; a write with new positions is not served a stale index."""
    from ecache_cli.kvstore import KVStore

    B, H, T, D = 2, 3, 6, 4
    idx = torch.tensor([[4, 1], [0, 5]])  # (B, S)
    k = torch.arange(B * H * 2 * D, dtype=torch.float32).view(B, H, 2, D)
    want = torch.zeros(B, H, T, D)
    for b in range(B):
        for s in range(2):
            want[b, :, idx[b, s]] = k[b, :, s]
    store = KVStore.allocate(1, H, D, torch.ones(B, T, dtype=torch.bool), torch.float32)
    store.write(0, idx, k, -k)
    assert torch.equal(store.k[0], want) and torch.equal(store.v[0], -want)
    store.write(0, idx.flip(1), k, k)  # same shape, other positions
    flipped = torch.zeros(B, H, T, D)
    for b in range(B):
        for s in range(2):
            flipped[b, :, idx[b, 1 - s]] = k[b, :, s]
    assert torch.equal(store.k[0], flipped)
    strided = KVStore.allocate(1, H, D, torch.ones(B, T, dtype=torch.bool), torch.float32)
    strided.k = [torch.zeros(B, T, H, D).transpose(1, 2)]  # (B, H, T, D) view, not contiguous
    strided.v = [torch.zeros(B, T, H, D).transpose(1, 2)]
    strided.write(0, idx, k, -k)
    assert torch.equal(strided.k[0], want) and torch.equal(strided.v[0], -want)


def test_store_rows_never_move_inside_tensors_set_from_outside():
    from ecache_cli.kvstore import KVStore

    store = KVStore.allocate(1, 1, 2, torch.ones(3, 4, dtype=torch.bool), torch.float32)
    cos = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 4, 2).contiguous()
    store.rope = (cos, cos)  # as the model sets its tables; the caller may hold them elsewhere
    store.select_rows(torch.tensor([2, 1]))
    assert store.rope[0][:, 0, 0, 0].tolist() == [2.0, 1.0] and cos[:, 0, 0, 0].tolist() == [0.0, 1.0, 2.0]


def test_compact_order_fills_freed_slots_from_the_end():
    leaving = torch.tensor([True, False, True, False, False, True, False])
    assert row_fields.compact_order(leaving).tolist() == [4, 1, 6, 3]  # slots 0 and 2 get rows 4 and 6
    assert row_fields.compact_order(torch.tensor([False, False, True])).tolist() == [0, 1]
    assert row_fields.compact_order(torch.tensor([True, True])).tolist() == []


@pytest.mark.parametrize("policy", ["entropy", "elastic"])  # partial forwards; elastic keeps hidden states too
def test_rows_joining_and_leaving_reuse_the_store_buffers_and_decode_as_alone(llada_lm, policy):
    eng = Engine.from_loaded(llada_lm)
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=16, temperature=0.7)
    ids = eng.encode(RAGGED_PROMPTS, chat=False)
    run = eng.start(ids[:2], cfg, make_policy(policy, **PARAMS[policy]), seed=3, prompt_width=40)
    run.store.max_rows = 8
    joined, ptrs, moved = [(ids[0], 0), (ids[1], 1)], None, False
    for i, rec in enumerate(run):
        if run.store.capacity == 8:  # grown to max_rows (2 -> 4 -> 8): from then on the same buffers
            now = [t.data_ptr() for t in run.store.k + run.store.v + (run.store.hidden or [])]
            assert ptrs is None or now == ptrs, i
            ptrs = now
        moved |= bool((rec.rows[1:] < rec.rows[:-1]).any())  # a later row took a freed slot
        if i % 3 == 2 and len(joined) < 10:
            p = ids[len(joined) % len(ids)]
            joined.append((p, 10 + len(joined)))
            run.add(p, row_id=joined[-1][1])
        assert run.store.k[0].shape[0] == run.state.batch <= 8
    assert ptrs is not None and moved, "the buffers never reached max_rows or no row moved: weak test"
    got = run.results()
    assert len(got) == len(joined) == 10
    for b, (prompt, row_id) in enumerate(joined):
        alone = _alone(eng, prompt, cfg, policy, row_id, seed=3)
        assert got[b].token_ids == alone.token_ids, (policy, b)
        assert got[b].stats["nfe"] == alone.stats["nfe"], (policy, b)


def test_padded_index_of_one_row_matches_the_batched_rule():
    """A single row's index (found without a sort) is the same as that row's inside a batch, for widths at
    and above its count and for an empty row."""
    from ecache_cli.contract.rows import padded_index

    gen = torch.Generator().manual_seed(5)
    for count in (0, 1, 7, 30):
        row = torch.zeros(1, 64, dtype=torch.bool)
        row[0, torch.randperm(64, generator=gen)[:count]] = True
        other = torch.ones(1, 64, dtype=torch.bool)  # a second row at least as wide, so the batch path pads row 0
        for width in (count, count + 3):
            alone, valid = padded_index(row, width)
            batched, bvalid = padded_index(torch.cat([row, other]), max(width, 64))
            S = max(width, 1)
            assert alone.tolist() == batched[:1, :S].tolist(), (count, width)
            assert valid.tolist() == bvalid[:1, :S].tolist()
            assert valid.sum().item() == count
            assert sorted(set(alone[valid].tolist())) == row[0].nonzero().flatten().tolist()
            if width == count and count > 0:  # the engine's case: the width read is the count itself
                fast, fast_valid = padded_index(row, width, exact=True)
                assert fast.tolist() == alone.tolist() and fast_valid.tolist() == valid.tolist()
                assert fast.stride() == alone.stride()  # compiled graphs guard on strides: no retrace
