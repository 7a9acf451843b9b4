"""ecache_cli.decoding: schedules, sampling and commit rules on small hand-made tensors (CPU, seconds)."""

import math

import pytest
import torch

from ecache_cli.decoding.remasking import (
    REMASKING,
    confidence_scores,
    select_factor,
    select_threshold,
    select_topk,
    validate_remasking,
)
from ecache_cli.decoding.sampling import Sampled, sample
from ecache_cli.decoding.schedule import BlockPlan, num_transfer_tokens, plan_blocks
from ecache_cli.errors import UsageError

NEG_INF = float("-inf")
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    ),
]


def _sample(logits, temperature=0.0, top_k=None, top_p=None, seed=None, banned_ids=None) -> Sampled:
    gen = None
    if seed is not None:
        gen = torch.Generator(device=logits.device).manual_seed(seed)
    return sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen, banned_ids=banned_ids)


def _conf(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# --- schedule


def test_num_transfer_tokens_spreads_remainder_to_earliest_steps():
    out = num_transfer_tokens(torch.tensor([10, 0, 7, 4, 3]), 4)
    assert out.dtype == torch.long and out.shape == (5, 4)
    assert out.tolist() == [[3, 3, 2, 2], [0, 0, 0, 0], [2, 2, 2, 1], [1, 1, 1, 1], [1, 1, 1, 0]]
    assert out.sum(-1).tolist() == [10, 0, 7, 4, 3]


def test_num_transfer_tokens_sums_to_mask_count():
    counts = torch.arange(0, 70)
    for steps in (1, 3, 8, 32, 64):
        out = num_transfer_tokens(counts, steps)
        assert torch.equal(out.sum(-1), counts)
        assert (out.max(-1).values - out.min(-1).values).le(1).all()  # as even as possible


def test_plan_blocks_valid():
    assert plan_blocks(128, 32, 128, False) == BlockPlan(num_blocks=4, block_length=32, steps_per_block=32)
    assert plan_blocks(256, 256, 256, False).steps_per_block == 256
    assert plan_blocks(128, 32, 4, True).steps_per_block == 1
    threshold_plan = plan_blocks(128, 32, None, True)
    assert threshold_plan.steps_per_block is None and threshold_plan.gen_length == 128


def test_plan_blocks_steps_fewer_than_blocks():
    with pytest.raises(UsageError) as err:
        plan_blocks(128, 32, 3, False)
    assert str(err.value) == (
        "--steps 3 is fewer than the 4 blocks (gen-length 128 / block-length 32): use --steps ≥ 4, "
        "a multiple of 4 (each block then gets steps/4 steps)"
    )
    assert err.value.exit_code == 2


def test_plan_blocks_messages_name_value_and_fix():
    with pytest.raises(UsageError, match=r"--block-length 0 must be ≥ 1"):
        plan_blocks(128, 0, 128, False)
    with pytest.raises(UsageError, match=r"--gen-length 100 is not a multiple of --block-length 32: .*96 or 128"):
        plan_blocks(100, 32, 128, False)
    with pytest.raises(UsageError, match=r"--gen-length 0 must be ≥ 1"):
        plan_blocks(0, 32, 128, False)
    with pytest.raises(UsageError, match=r"--steps 10 is not a multiple of the 4 blocks .*8 or 12 .*2 or 3 steps"):
        plan_blocks(128, 32, 10, False)
    with pytest.raises(UsageError, match=r"--steps 10 is not a multiple"):
        plan_blocks(128, 32, 10, True)  # threshold mode still checks a given step count (Fast-dLLM)
    with pytest.raises(UsageError, match=r"--steps is required"):
        plan_blocks(128, 32, None, False)
    with pytest.raises(UsageError, match=r"--steps 0 must be ≥ 1"):
        plan_blocks(128, 128, 0, False)
    for bad in [(128, 0, 128, False), (100, 32, 128, False), (128, 32, 3, False)]:
        with pytest.raises(UsageError) as err:
            plan_blocks(*bad)
        assert "\n" not in str(err.value)


# --- sampling: selection


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_zero_is_argmax(device):
    logits = torch.randn(3, 17, 50, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    out = _sample(logits)
    assert out.x0.dtype == torch.long and out.x0.shape == (3, 17)
    assert torch.equal(out.x0, logits.float().argmax(-1))
    for field in ("prob", "entropy", "margin", "neg_entropy"):
        value = getattr(out, field)
        assert value.dtype == torch.float64 and value.shape == (3, 17) and value.device.type == device
    expected = torch.softmax(logits.double(), -1).max(-1).values
    torch.testing.assert_close(out.prob, expected, rtol=1e-12, atol=1e-12)


def test_same_seed_same_samples_different_seed_different():
    logits = torch.randn(2, 400, 64, generator=torch.Generator().manual_seed(1)) * 0.1  # flat-ish
    a = _sample(logits, temperature=1.0, seed=7).x0
    b = _sample(logits, temperature=1.0, seed=7).x0
    c = _sample(logits, temperature=1.0, seed=8).x0
    assert torch.equal(a, b)
    assert (a != c).float().mean() > 0.5


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_gumbel_frequencies_match_tempered_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    draws = 60_000
    out = _sample(logits.expand(1, draws, 6), temperature=temperature, seed=1234)
    counts = torch.bincount(out.x0.reshape(-1), minlength=6).double()
    expected = torch.softmax(logits.double() / temperature, -1) * draws
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5  # chi-square, 5 dof, p = 0.001
    assert torch.allclose(counts / draws, expected / draws, atol=0.01)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 50.0])
def test_banned_ids_never_chosen(temperature):
    logits = torch.randn(4, 500, 12, generator=torch.Generator().manual_seed(2))
    logits[..., 3] = 30.0  # the banned id has by far the highest logit
    logits[..., 11] = 29.0
    out = _sample(logits, temperature=temperature, seed=3, banned_ids=torch.tensor([3, 11]))
    assert not torch.isin(out.x0, torch.tensor([3, 11])).any()
    if temperature > 1:
        assert len(out.x0.unique()) == 10  # high temperature: every allowed id shows up
    # prob renormalises over the allowed ids (temperature 1), entropy ignores the ban
    allowed = logits.double().clone()
    allowed[..., [3, 11]] = NEG_INF
    expected_prob = torch.softmax(allowed, -1).gather(-1, out.x0[..., None]).squeeze(-1)
    torch.testing.assert_close(out.prob, expected_prob, rtol=1e-10, atol=1e-12)
    p = torch.softmax(logits.double(), -1)
    torch.testing.assert_close(out.entropy, -(p * p.log()).sum(-1), rtol=1e-10, atol=1e-12)


def test_top_k_one_equals_argmax_even_when_sampling():
    logits = torch.randn(2, 300, 40, generator=torch.Generator().manual_seed(4))
    out = _sample(logits, temperature=1.5, top_k=1, seed=5)
    assert torch.equal(out.x0, logits.argmax(-1))
    torch.testing.assert_close(out.prob, torch.ones(2, 300, dtype=torch.float64))
    torch.testing.assert_close(out.margin, torch.ones(2, 300, dtype=torch.float64))


def test_top_k_keeps_the_k_largest():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15]))
    out = _sample(logits.expand(1, 5000, 5), temperature=1.0, top_k=2, seed=6)
    assert set(out.x0.unique().tolist()) == {1, 3}
    expected = torch.where(out.x0 == 1, 0.4 / 0.7, 0.3 / 0.7).double()
    torch.testing.assert_close(out.prob, expected)


def test_top_p_keeps_first_token_exceeding_p():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5, 0.3 (cum 0.8), 0.15, 0.05
    logits = probs.log().expand(1, 5000, 4)
    out = _sample(logits, temperature=1.0, top_p=0.7, seed=9)
    assert set(out.x0.unique().tolist()) == {1, 3}  # 0.5 < 0.7, then 0.3 brings it to 0.8: kept
    greedy = _sample(logits, top_p=0.7)
    torch.testing.assert_close(greedy.prob, torch.full((1, 5000), 0.5 / 0.8, dtype=torch.float64))
    only_top = _sample(logits, temperature=1.0, top_p=0.4, seed=9)  # the first token already exceeds
    assert set(only_top.x0.unique().tolist()) == {1}
    wide = _sample(logits, temperature=1.0, top_p=0.9, seed=9)
    assert set(wide.x0.unique().tolist()) == {0, 1, 3}


def _dream_top_p_reference(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Dream generation_utils top_p_logits, written out: the kept-token mask."""
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative_probs = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    remove_sorted = cumulative_probs > top_p
    remove_sorted[..., 1:] = remove_sorted[..., :-1].clone()
    remove_sorted[..., 0] = False
    remove = torch.zeros_like(remove_sorted).scatter_(-1, sorted_indices, remove_sorted)
    return ~remove


@pytest.mark.parametrize("temperature", [0.8, 1.3])
def test_top_p_matches_dream_rule_on_random_logits(temperature):
    logits = torch.randn(2, 30, 50, generator=torch.Generator().manual_seed(21), dtype=torch.float64) * 2
    kept = _dream_top_p_reference(logits / temperature, 0.9)
    out = _sample(logits, temperature=temperature, top_p=0.9, seed=22)
    assert kept.gather(-1, out.x0[..., None]).all()
    p = torch.softmax(logits, -1)  # prob is reported at temperature 1, renormalised over the nucleus
    expected = p.gather(-1, out.x0[..., None]).squeeze(-1) / (p * kept).sum(-1)
    torch.testing.assert_close(out.prob, expected, rtol=1e-10, atol=1e-12)


def test_top_p_nucleus_uses_tempered_distribution():
    # at T = 0.5 the probabilities become ∝ p², i.e. 0.25/0.365 = 0.685 > 0.6 for the top token alone
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(1, 4000, 4)
    assert set(_sample(logits, temperature=0.5, top_p=0.6, seed=1).x0.unique().tolist()) == {0}
    assert set(_sample(logits, temperature=1.0, top_p=0.6, seed=1).x0.unique().tolist()) == {0, 1}


def test_sampling_rejects_bad_settings():
    logits = torch.zeros(1, 1, 4)
    with pytest.raises(UsageError, match="--temperature -0.5"):
        _sample(logits, temperature=-0.5)
    with pytest.raises(UsageError, match="--top-k 0"):
        _sample(logits, top_k=0)
    with pytest.raises(UsageError, match="--top-p 1.5"):
        _sample(logits, top_p=1.5)
    with pytest.raises(UsageError, match="--top-p 0"):
        _sample(logits, top_p=0.0)


def test_input_logits_not_modified():
    logits = torch.randn(2, 5, 30, dtype=torch.float64)
    before = logits.clone()
    _sample(logits, temperature=1.0, top_k=5, top_p=0.8, seed=0, banned_ids=torch.tensor([0, 1]))
    assert torch.equal(logits, before)


# --- sampling: signals


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_entropy_matches_direct_computation(dtype):
    logits = (torch.randn(3, 20, 100, generator=torch.Generator().manual_seed(11)) * 3).to(dtype)
    out = _sample(logits, temperature=0.8, top_k=10, top_p=0.9, seed=0)  # filters must not change entropy
    p = torch.softmax(logits.double(), -1)
    direct = -(p * p.log()).sum(-1)
    torch.testing.assert_close(out.entropy, direct, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.neg_entropy, -direct, rtol=1e-10, atol=1e-12)


def test_entropy_extremes_in_nats():
    vocab = 126_464
    uniform = _sample(torch.zeros(1, 2, vocab))
    torch.testing.assert_close(uniform.entropy, torch.full((1, 2), math.log(vocab), dtype=torch.float64))
    one_hot = torch.zeros(1, 2, vocab)
    one_hot[..., 7] = 1000.0
    peaked = _sample(one_hot)
    assert peaked.entropy.abs().max() < 1e-12 and (peaked.entropy >= 0).all()
    with_neg_inf = torch.full((1, 1, 10), NEG_INF)
    with_neg_inf[..., 2] = 0.0
    exact = _sample(with_neg_inf)
    assert exact.entropy.item() == 0.0 and exact.prob.item() == 1.0 and exact.x0.item() == 2


def test_margin_is_top1_minus_top2_probability():
    logits = torch.tensor([[[0.2, 0.5, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25]]]).log()
    out = _sample(logits)
    torch.testing.assert_close(out.margin, _conf([[0.3, 0.0]]))
    torch.testing.assert_close(out.prob, _conf([[0.5, 0.25]]))


# --- remasking scores


def test_confidence_scores_kinds():
    logits = torch.randn(2, 6, 20, generator=torch.Generator().manual_seed(12))
    out = _sample(logits)
    assert REMASKING == ("low_confidence", "random", "topk_margin", "entropy", "maskgit_plus", "origin")
    assert torch.equal(confidence_scores("low_confidence", out, None), out.prob)
    assert torch.equal(confidence_scores("maskgit_plus", out, None), out.prob)  # Dream's name for it
    assert torch.equal(confidence_scores("topk_margin", out, None), out.margin)
    assert torch.equal(confidence_scores("entropy", out, None), -out.entropy)
    r1 = confidence_scores("random", out, torch.Generator().manual_seed(0))
    r2 = confidence_scores("random", out, torch.Generator().manual_seed(0))
    assert r1.dtype == torch.float64 and r1.shape == (2, 6) and torch.equal(r1, r2)
    assert ((r1 >= 0) & (r1 < 1)).all()
    assert torch.equal(confidence_scores("origin", out, torch.Generator().manual_seed(0)), r1)  # Dream's reveal draws
    scores = confidence_scores("low_confidence", out, None)
    scores.fill_(NEG_INF)  # a copy: filling it leaves the sample alone
    assert torch.isfinite(out.prob).all()


def test_unknown_remasking_lists_valid_kinds():
    out = _sample(torch.zeros(1, 1, 3))
    with pytest.raises(UsageError, match="low_confidence, random, topk_margin, entropy"):
        confidence_scores("maskgit", out, None)
    with pytest.raises(UsageError, match="use --remasking low_confidence"):
        validate_remasking("entropy", parallel=True)
    assert validate_remasking("low_confidence", parallel=True) == "low_confidence"


# --- commit rules


@pytest.mark.parametrize("device", DEVICES)
def test_select_topk_picks_highest_and_never_exceeds_candidates(device):
    conf = _conf(
        [
            [0.1, 0.9, NEG_INF, 0.5, 0.7],
            [NEG_INF, 0.2, NEG_INF, NEG_INF, NEG_INF],
            [NEG_INF] * 5,
            [0.3, 0.3, 0.8, 0.3, NEG_INF],
        ]
    ).to(device)
    out = select_topk(conf, torch.tensor([2, 3, 4, 2]))
    assert out.dtype == torch.bool and out.device.type == device
    assert out.cpu().tolist() == [
        [False, True, False, False, True],
        [False, True, False, False, False],  # k = 3 but only one candidate
        [False] * 5,
        [True, False, True, False, False],  # tie at 0.3: lowest column first
    ]
    assert torch.equal(select_topk(conf, torch.tensor([0, 0, 0, -1])), torch.zeros_like(out))


def test_select_topk_random_rows_match_per_row_topk():
    gen = torch.Generator().manual_seed(13)
    conf = torch.rand(6, 40, generator=gen, dtype=torch.float64)
    conf[torch.rand(6, 40, generator=gen) < 0.4] = NEG_INF
    k = torch.tensor([0, 1, 5, 17, 40, 3])
    out = select_topk(conf, k)
    for row in range(6):
        n_cand = int(torch.isfinite(conf[row]).sum())
        n = min(int(k[row]), n_cand)
        assert int(out[row].sum()) == n
        assert set(out[row].nonzero().flatten().tolist()) == set(conf[row].topk(n).indices.tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_select_threshold(device):
    conf = _conf(
        [
            [0.95, 0.5, 0.91, NEG_INF, 0.9],
            [0.2, 0.6, NEG_INF, 0.4, 0.1],
            [NEG_INF] * 5,
        ]
    ).to(device)
    assert select_threshold(conf, 0.9).cpu().tolist() == [
        [True, False, True, False, True],  # every candidate ≥ 0.9 (0.9 itself included)
        [False, True, False, False, False],  # none qualifies: the most confident one
        [False] * 5,  # no candidates: nothing
    ]
    above_one = select_threshold(conf, 1.5).cpu()
    assert above_one.sum(-1).tolist() == [1, 1, 0]
    assert above_one[0, 0] and above_one[1, 1]
    everything = select_threshold(conf, 0.0).cpu()
    assert torch.equal(everything, torch.isfinite(conf).cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_select_factor_hand_computed(device):
    # factor 1: rank m passes iff (m+1)(1 - c_m) < 1
    conf = _conf(
        [
            [0.7, 0.95, 0.5, 0.8],  # sorted 0.95, 0.8 (3·0.2 = 0.6 ok), 0.7 (4·0.3 = 1.2 stop) -> 2
            [0.85, 0.99, 0.9, 0.85],  # 0.99; 3·0.1 = 0.3; 4·0.15 = 0.6; 5·0.15 = 0.75 -> all 4
            [0.3, NEG_INF, 0.29, NEG_INF],  # rank 1 always; 3·0.71 = 2.13 -> 1
            [0.99, 0.5, NEG_INF, NEG_INF],  # last rank fails (3·0.5 = 1.5): 1 (official code commits 2)
            [NEG_INF] * 4,  # no candidates -> 0
            [0.99, 0.97, 0.96, NEG_INF],  # 3·0.03 = 0.09; 4·0.04 = 0.16 -> all 3 candidates, not more
        ]
    ).to(device)
    out = select_factor(conf, 1.0).cpu()
    assert out.sum(-1).tolist() == [2, 4, 1, 1, 0, 3]
    assert out[0].tolist() == [False, True, False, True]
    assert out[2].tolist() == [True, False, False, False]
    assert out[3].tolist() == [True, False, False, False]
    # a larger factor commits more: factor 2 lets 0.7 in (1.2 < 2) but not 0.5 (5·0.5 = 2.5)
    assert select_factor(conf, 2.0).cpu().sum(-1).tolist() == [3, 4, 1, 2, 0, 3]


def test_nan_scores_are_not_candidates():
    conf = _conf([[float("nan"), 0.95, 0.2, NEG_INF]])
    assert select_topk(conf, torch.tensor([4])).tolist() == [[False, True, True, False]]
    assert select_threshold(conf, 0.9).tolist() == [[False, True, False, False]]
    assert select_factor(conf, 1.0).tolist() == [[False, True, False, False]]


def test_parallel_rules_reject_nan():
    conf = _conf([[0.5]])
    with pytest.raises(UsageError):
        select_threshold(conf, float("nan"))
    with pytest.raises(UsageError):
        select_factor(conf, float("nan"))


def test_packed_sampling_equals_the_padded_grid_at_real_entries():
    """Sampling only the real targets (``Sampled.spread``) gives the padded grid's values there; padding
    entries repeat their row's first entry, margin included."""
    from ecache_cli.decoding.sampling import sample

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 40, generator=g) * 3
    valid = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    kw = dict(temperature=0.0, top_k=None, top_p=None, generator=None, banned_ids=torch.tensor([2]))
    grid = sample(logits, **kw)
    packed = sample(logits[valid][None], **kw).spread(valid)
    for name in ("x0", "prob", "entropy", "margin", "neg_entropy"):
        got, want = getattr(packed, name), getattr(grid, name)
        assert torch.equal(got[valid], want[valid]), name
        assert torch.equal(got[~valid], got[:, :1].expand_as(got)[~valid]), name
