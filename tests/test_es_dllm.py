"""ES-dLLM (``cache/es_dllm.py``) against a plain reference of the official skip rule (zhuzj19/ES-dLLM
``early_skipping.py skip_in_hidden_state`` / ``get_importance_score``, ``generate.py batch_generate``),
its schedule, its hidden-state cache, skipped positions getting no commits, and its work against ``dual``.
Forced refresh == ``none``, batch == alone and a row joining mid-block are covered for every policy by
test_policies.py, test_batch_groups.py and test_rows.py (``ESDLLM.forced_refresh`` / ``test_params``)."""

from __future__ import annotations

import math

import pytest
import torch
from cli_helpers import step_layer_positions
from conftest import PROMPTS as RAGGED_PROMPTS

from ecache_cli.cache import make_policy
from ecache_cli.cache.es_dllm import skip_layers
from ecache_cli.engine import DecodeConfig, Engine
from ecache_cli.errors import UsageError
from ecache_cli.models.loader import load_model
from ecache_cli.models.synthetic import write_random_checkpoint

PROMPTS = RAGGED_PROMPTS[:3]  # three of the shared prompts of different lengths
CFG = DecodeConfig(gen_length=32, block_length=16, steps=32, early_exit=False)
BUF = 8  # block updates at steps 0 and 8 of each block (PUF = the block length: prompt update at step 0)


@pytest.fixture(scope="module", params=["llada", "dream"])
def lm8(request, tmp_path_factory):
    """An 8-layer random model: the default proportions/positions skip after layers 1 and 2 (inputs of 2, 3)."""
    d = write_random_checkpoint(tmp_path_factory.mktemp(f"es8{request.param}"), request.param, seed=3, scale=4.0,
                                n_layers=8)
    return load_model(d, device="cpu", dtype="float32")


def reference_keep(h, h_c, conf, bonus, count, alpha):
    """The official rule for one row at one skip layer, written out plainly in float64.

    h, h_c: (n, d) this step's layer input and the cached one of the n positions still computed; conf (n,)
    their last confidences; bonus (n,) the +5 leftmost-mask / +3 last-commit constants; count the kept count.
    Returns the kept indices (ties: the lower index first)."""
    n = h.shape[0]
    h, h_c = h.double(), h_c.double()
    v = []
    for j in range(n):
        diff = sum(abs(float(a) - float(b)) for a, b in zip(h[j], h_c[j])) / h.shape[1]
        rms = math.sqrt(sum(float(b) ** 2 for b in h_c[j]) / h.shape[1])
        v.append(diff / (rms + 1e-6))
    top = max(max(v), 1.0)
    score = [alpha * float(conf[j]) + (1 - alpha) * v[j] / top for j in range(n)]
    if alpha > 0:
        for j in sorted(range(n), key=lambda j: (-float(conf[j]), j))[:2]:
            score[j] += 2.0
    score = [score[j] + float(bonus[j]) for j in range(n)]
    return sorted(sorted(range(n), key=lambda j: (-score[j], j))[:count])


def spied_run(lm, policy, prompts=PROMPTS, cfg=CFG):
    """Run ``policy``, capturing per step the state it planned from and every shrink's view and keep mask."""
    eng = Engine.from_loaded(lm)
    steps, inner = [], policy.plan

    def plan(state):
        p = inner(state)
        entry = dict(masked=state.masked.clone(), commit_step=state.commit_step.clone(), rows=state.rows.clone(),
                     row_step=state.row_step.clone(), block=state.block.clone(), sib=state.step_in_block.clone(),
                     block_start=state.block_start.clone(), refresh=p.refresh.clone(), compute=p.compute, shrinks=[],
                     scheduled=state.schedule.gather(1, state.step_in_block[:, None]).squeeze(1))
        steps.append(entry)
        if p.hooks is not None:
            for sh in p.hooks.shrinks:
                def keep(view, rows, _k=sh.keep, _layer=sh.layer):
                    out = _k(view, rows)
                    entry["shrinks"].append(dict(layer=_layer, x=view.x.clone(), cached=view.cached.clone(),
                                                 positions=view.positions.clone(), keep=out.clone()))
                    return out
                object.__setattr__(sh, "keep", keep)
        return p

    policy.plan = plan
    run = eng.start(eng.encode(prompts, chat=False), cfg, policy)
    records = list(run)
    return steps, records, run


def test_skip_layers_follow_the_official_schedule():
    shares, depths = [1, 0.5, 0.25], [0, 0.125, 0.25]
    assert skip_layers(shares, depths, 32) == [(5, 0.5), (9, 0.25)]  # LLaDA-8B: after layers 4 and 8
    assert skip_layers(shares, depths, 28) == [(5, 0.5), (8, 0.25)]  # Dream-7B: after layers 4 and 7
    assert skip_layers(shares, depths, 8) == [(2, 0.5), (3, 0.25)]
    assert skip_layers(shares, depths, 2) == []  # the only change is after the last layer
    assert skip_layers([1, 0.5], [0, 0], 2) == [(1, 0.5)]


@pytest.mark.parametrize("params,match", [
    ({"alpha": 1.5}, "alpha"), ({"proportions": "1,0.5"}, "as many"), ({"proportions": "1,x,0.2"}, "numbers"),
    ({"proportions": "1,0,0.25"}, r"\(0, 1\]"), ({"positions": "0,0.25,0.125"}, "must not decrease"),
    ({"block_update_freq": -1}, "block_update_freq"),
])
def test_bad_parameters_name_the_value(params, match):
    with pytest.raises(UsageError, match=match):
        make_policy("es-dllm", **params)


def test_slash_separated_shares_for_policy_variants():
    from ecache_cli.runs.profile import parse_policy_spec

    name, params = parse_policy_spec("es-dllm:proportions=1/0.5/0.25:positions=0/0.125/0.25")
    pol = make_policy(name, **params)
    assert pol.shares == [1.0, 0.5, 0.25] and pol.depths == [0.0, 0.125, 0.25]
    name, params = parse_policy_spec("es-dllm:proportions=0.5:positions=0")  # one stage: typed as numbers
    one = make_policy(name, **params)
    assert one.shares == [0.5] and one.depths == [0.0]
    with pytest.raises(UsageError, match="proportions"):
        parse_policy_spec("es-dllm:proportions=1;0.5")


def check_against_reference(lm, policy, alpha: float) -> tuple[int, int]:
    """Run ``policy`` (BUF = ``BUF``, default proportions/positions) and compare, for every skipping step, row
    and skip layer, the positions kept with :func:`reference_keep` on the same layer inputs, with confidences
    tracked here from the step records and bonuses from the decode state (+3 only when alpha < 1).
    Returns (comparisons, skipping row-steps)."""
    steps, records, run = spied_run(lm, policy)
    L, BL, shift, T = lm.spec.n_layers, CFG.block_length, lm.spec.logit_shift, run.P + run.G
    layers = dict(skip_layers([1, 0.5, 0.25], [0, 0.125, 0.25], L))
    conf = torch.zeros(len(PROMPTS), T, dtype=torch.float64)  # by logit position, as the official buffer
    checked = skipped = 0
    for st, rec in zip(steps, records):
        g = st["block"] * BL + st["sib"]
        skipping = (st["row_step"] > 0) & (g % BL != 0) & (g % BUF != 0)
        if skipping.any():
            assert [s["layer"] for s in st["shrinks"]] == sorted(layers)
        for b in range(len(st["rows"])):
            r = int(st["rows"][b])
            last = (st["commit_step"][b] == st["row_step"][b] - 1).nonzero().flatten() - shift
            masked_src = st["masked"][b].nonzero().flatten() - shift
            start = int(st["block_start"][b])
            in_block = masked_src[(masked_src + shift >= start) & (masked_src + shift < start + BL)]
            width = None
            for s in st["shrinks"]:
                posn = s["positions"][b]
                real = [j for j in range(len(posn)) if j == 0 or posn[j] != posn[0]]
                kept = sorted(int(posn[j]) for j in range(len(posn)) if s["keep"][b, j])
                if not skipping[b]:
                    assert kept == sorted(int(posn[j]) for j in real)
                    continue
                width = len(real) if width is None else width  # the window, at the first skip layer
                p = [int(x) for x in posn[real]]
                bonus = [5.0 * (q == int(in_block.min())) + 3.0 * (q in last.tolist() and alpha < 1) for q in p]
                count = max(int(layers[s["layer"]] * width), min(len(last) + 2, BL))
                want = reference_keep(s["x"][b, real], s["cached"][b, real], conf[r, p], bonus, count, alpha)
                assert kept == sorted(p[j] for j in want), (rec.step, b, s["layer"])
                checked += 1
            skipped += int(skipping[b])
        # confidences as the official last_confidence: overwritten where logits came, 0 where committed
        for b in range(len(rec.rows)):
            r = int(rec.rows[b])
            for j in range(rec.targets.shape[1]):
                if rec.valid[b, j]:
                    q = int(rec.targets[b, j]) - shift
                    conf[r, q] = 0.0 if rec.committed[b, j] else float(rec.prob[b, j])
    return checked, skipped


def test_kept_positions_equal_the_reference(lm8):
    """The kept positions per skip layer equal the official rule's (3 prompts, 28 skipping steps each)."""
    checked, skipped = check_against_reference(lm8, make_policy("es-dllm", block_update_freq=BUF), 0.5)
    assert skipped == 3 * 28 and checked == 2 * skipped  # two skip layers per skipping row-step


def test_hidden_cache_is_written_only_for_the_positions_kept(lm8):
    """Between two consecutive skipping steps of a row, a skip layer's cached input of a position is this
    step's input where the position was kept there, and unchanged where it was dropped."""
    pol = make_policy("es-dllm", block_update_freq=BUF)
    steps, _, _ = spied_run(lm8, pol, prompts=PROMPTS[:1])
    pairs = 0
    for a, b in zip(steps, steps[1:]):
        if not (a["shrinks"] and b["shrinks"]):
            continue
        for sa, sb in zip(a["shrinks"], b["shrinks"]):
            pa, pb = sa["positions"][0].tolist(), sb["positions"][0].tolist()
            for j, q in enumerate(pb):
                if q not in pa:
                    continue
                i = pa.index(q)
                want = sa["x"][0, i] if sa["keep"][0, i] else sa["cached"][0, i]
                assert torch.equal(sb["cached"][0, j], want), (q, bool(sa["keep"][0, i]))
                pairs += 1
    assert pairs > 100


def test_skipped_positions_get_no_logits_and_no_commit(lm8):
    """A masked position dropped at a skip layer gets no logits at that step (the record's ``valid`` is False
    there) and is not committed; every step still commits its scheduled tokens (Dream's schedule has steps
    with 0 and 2), and every answer is decoded in full."""
    pol = make_policy("es-dllm", block_update_freq=BUF)
    steps, records, _ = spied_run(lm8, pol)
    shift, dropped = lm8.spec.logit_shift, 0
    for st, rec in zip(steps, records):
        for b in range(len(rec.rows)):
            start = int(st["block_start"][b])
            masks = int(st["masked"][b, start:start + CFG.block_length].sum())  # real targets: the first `masks`
            if st["shrinks"]:
                final = st["shrinks"][-1]
                kept = set(final["positions"][b][final["keep"][b]].tolist())
            else:
                kept = None  # no shrink: every target got logits
            for j in range(masks):
                got = kept is None or int(rec.targets[b, j]) - shift in kept
                assert bool(rec.valid[b, j]) == got, (rec.step, b, j)
                dropped += not got
            assert not (rec.committed[b] & ~rec.valid[b]).any()
        assert torch.equal(rec.committed.sum(1), st["scheduled"])  # the schedule's count, always met
    assert dropped > 50
    per_row = {}
    for rec in records:
        for r, n in zip(rec.rows.tolist(), rec.committed.sum(1).tolist()):
            per_row[r] = per_row.get(r, 0) + n
    assert per_row == {r: CFG.gen_length for r in range(len(PROMPTS))}


def layer_positions(lm, policy, prompts, cfg):
    """(records, per step the positions all layers' query projections computed)."""
    eng = Engine.from_loaded(lm)
    return step_layer_positions(lm, eng.start(eng.encode(prompts, chat=False), cfg, policy))


def test_a_skipping_step_computes_fewer_layer_positions_than_dual(lm8):
    cfg = DecodeConfig(gen_length=32, block_length=16, steps=32, early_exit=False)
    es, es_seen = layer_positions(lm8, make_policy("es-dllm", block_update_freq=BUF), PROMPTS[:1], cfg)
    du, du_seen = layer_positions(lm8, make_policy("dual"), PROMPTS[:1], cfg)
    L, BL = lm8.spec.n_layers, cfg.block_length
    # dual: a partial step computes the block (+ Dream's source before it) at every layer
    dual_partial = {n for rec, n in zip(du, du_seen) if not rec.full}
    assert max(dual_partial) <= (BL + 1) * L
    # es-dllm skipping steps: block at layers 0-1, half from layer 2, a quarter from layer 3 (at least 3 kept)
    skipping = [(rec, n) for rec, n in zip(es, es_seen) if not rec.full and n < BL * L]
    assert len(skipping) >= 24
    for rec, n in skipping:
        assert n < min(dual_partial)
        assert 0 <= n - int(rec.computed.sum()) * L < L  # the reported work is the layer average
    assert sum(es_seen) < 0.6 * sum(du_seen)


def test_a_yaml_list_of_shares_is_the_same_setting_as_the_comma_text():
    """A profile may write ``proportions: [1, 0.5]``: the policy takes it as "1,0.5" (records show the text)."""
    from ecache_cli.cache import make_policy

    listed = make_policy("es-dllm", proportions=[1, 0.5], positions=(0, 0.5))
    text = make_policy("es-dllm", proportions="1,0.5", positions="0,0.5")
    assert listed.shares == text.shares == [1.0, 0.5] and listed.depths == text.depths == [0.0, 0.5]
    assert listed.params()["proportions"] == "1,0.5" and listed.params()["positions"] == "0,0.5"
