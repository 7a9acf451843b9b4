"""The committed training state of the embedded model: format, size, exact resume, and scripts/train_gpu.sh.

scripts/tiny_train_state.pt is what a later run (on this CPU or a lent GPU) resumes from; these tests
keep it loadable, within its 20 MB budget, consistent with the shipped weights, and resumable
bit for bit. Every run here writes under tmp_path: the committed state is only read.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
STATE = REPO / "scripts" / "tiny_train_state.pt"
TINY = REPO / "ecache_cli" / "data" / "tiny"


def _train_module():
    spec = importlib.util.spec_from_file_location("train_tiny", REPO / "scripts" / "train_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_tiny"] = mod  # dataclasses look their module up there
    if str(REPO / "scripts") not in sys.path:  # spawned data workers import it by name
        sys.path.insert(0, str(REPO / "scripts"))
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def train_tiny():
    return _train_module()


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    """A copy of the committed state taken once (a training run may replace the file meanwhile)."""
    dst = tmp_path_factory.mktemp("state") / "state.pt"
    shutil.copyfile(STATE, dst)
    return dst


@pytest.fixture(scope="module")
def state(train_tiny, snapshot):
    return train_tiny.load_state(snapshot)


def test_state_is_one_file_within_budget(state):
    assert STATE.stat().st_size <= 20_000_000
    assert state["step"] > 0 and state["stats"]["tokens"] > 0
    for key in ("model", "ema", "opt", "stream", "cfg", "torch_rng", "py_rng", "history"):
        assert key in state, key
    assert any("eval" in h for h in state["history"]), "the state records its held-out evaluations"


def test_shipped_weights_are_the_states_ema(state, train_tiny):
    """The exported model is the committed state's EMA weights (what the next run continues from)."""
    shipped = load_file(str(TINY / "model.safetensors"))
    assert set(shipped) == set(state["ema"])
    for k, v in shipped.items():
        assert torch.equal(v.float(), state["ema"][k].float()), k
    assert state["tokenizer_sha256"] == train_tiny.tokenizer_sha256(TINY)


def _run(train_tiny, state_path: Path, log: Path, steps: int) -> None:
    train_tiny.main(["--state", str(state_path), "--max-new-steps", str(steps), "--log", str(log),
                     "--save-every-min", "1000", "--adapt-every-min", "1000", "--threads", "1"])


def test_resume_is_exact(train_tiny, snapshot, state, tmp_path):
    """2 + 2 steps with a save/load in between give the same weights, optimizer and EMA as 4 steps."""
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    shutil.copyfile(snapshot, a)
    shutil.copyfile(snapshot, b)
    _run(train_tiny, a, tmp_path / "a.log", 4)
    _run(train_tiny, b, tmp_path / "b.log", 2)
    _run(train_tiny, b, tmp_path / "b.log", 2)
    sa, sb = train_tiny.load_state(a), train_tiny.load_state(b)
    assert sa["step"] == sb["step"] == state["step"] + 4
    assert sa["stream"] == sb["stream"]
    for part in ("model", "ema"):
        for k in sa[part]:
            assert torch.equal(sa[part][k], sb[part][k]), (part, k)
    moved = [k for k in sa["model"] if not torch.equal(sa["model"][k], state["model"][k])]
    assert moved, "training changed no weight"
    for pid, st in sa["opt"]["state"].items():
        assert torch.equal(st["exp_avg"], sb["opt"]["state"][pid]["exp_avg"])


def test_cooldown_decays_linearly_from_the_resumed_step_and_resumes(train_tiny, snapshot, state, tmp_path):
    """--cooldown N: the LR falls linearly from lr to lr * min_lr_frac over N steps starting at the step
    the call resumed at, stays there, and a later resume without the flag continues the same decay."""
    from dataclasses import replace

    cfg = replace(train_tiny.TrainConfig(), lr=1e-3, min_lr_frac=0.1, warmup=10, cooldown=100, cooldown_start=500)
    assert train_tiny.lr_at(499, cfg) == pytest.approx(1e-3)
    assert train_tiny.lr_at(500, cfg) == pytest.approx(1e-3)
    assert train_tiny.lr_at(550, cfg) == pytest.approx(1e-3 * (1 - 0.5 * 0.9))
    assert train_tiny.lr_at(600, cfg) == pytest.approx(1e-4)
    assert train_tiny.lr_at(10_000, cfg) == pytest.approx(1e-4)
    assert train_tiny.lr_at(550, replace(cfg, cooldown=0)) == pytest.approx(1e-3)

    path = tmp_path / "cool.pt"
    shutil.copyfile(snapshot, path)
    train_tiny.main(["--state", str(path), "--max-new-steps", "1", "--cooldown", "40", "--log", str(tmp_path / "l"),
                     "--save-every-min", "1000", "--adapt-every-min", "1000", "--threads", "1"])
    _run(train_tiny, path, tmp_path / "l", 1)  # no flag: the saved cfg carries the decay on
    cool = train_tiny.load_state(path)
    assert cool["cfg"]["cooldown"] == 40 and cool["cfg"]["cooldown_start"] == state["step"]
    assert cool["opt"]["param_groups"][0]["lr"] == pytest.approx(state["cfg"]["lr"] * (1 - 0.9 / 40))
    train_tiny.main(["--state", str(path), "--max-new-steps", "1", "--cooldown", "0", "--log", str(tmp_path / "l"),
                     "--save-every-min", "1000", "--adapt-every-min", "1000", "--threads", "1"])
    warm = train_tiny.load_state(path)  # --cooldown 0: the stable LR again, through a fresh warmup
    assert warm["cfg"]["cooldown"] == 0 and warm["schedule_start"] == state["step"] + 2
    assert warm["opt"]["param_groups"][0]["lr"] == pytest.approx(state["cfg"]["lr"] / state["cfg"]["warmup"])


def test_loss_over_the_answer_region_equals_the_full_logits_loss(train_tiny, state):
    """batch_loss computes logits for the last `canvas` columns only; value and gradients are those
    of the loss over every position's logits (a plain reference written here)."""
    import random

    import torch.nn.functional as F

    cfg = train_tiny.TrainConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in state["cfg"].items()})
    tok = train_tiny.Tok(TINY)
    model = train_tiny.build_model(train_tiny.model_config(cfg, tok), 0)
    model.load_state_dict(state["ema"])
    stream = train_tiny.Stream(cfg, tok, train_tiny.load_tasks(cfg.domains))
    random.seed(0)
    items = stream.next()[:6]
    noisy, clean, key_mask, weights = train_tiny.make_batch(items, tok, cfg, torch.Generator().manual_seed(3))
    assert {it.canvas for it in items} != {noisy.shape[1]}, "the batch has prompt columns to skip"

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    got = train_tiny.batch_loss(model, noisy, clean, key_mask, weights, max(it.canvas for it in items))
    g_got = grads(got)
    logits = model(noisy, model.new_store(key_mask))  # (B, T, V): every position
    sel = weights > 0
    want = (F.cross_entropy(logits[sel], clean[sel], reduction="none") * weights[sel]).sum() / len(items)
    g_want = grads(want)
    assert got.item() > 0 and abs(got.item() - want.item()) < 1e-5 * want.item()
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_result_weight_scales_only_the_masked_result_digits(train_tiny, state):
    """--result-weight multiplies the loss weight of the digits after "= " / "= $" in arith solutions
    and drills (Tok.result_positions), nothing else; 1.0 leaves make_batch's weights unchanged."""
    tok = train_tiny.Tok(TINY)
    ids = tok.answer_ids("Ben saves 12 * 3 = $36.\nHe has 36 - 35 = $1 left.\nSo 3 + 40 = 43 pens.\n#### 1")
    assert "".join(tok.hf.decode([ids[i]]) for i in tok.result_positions(ids)) == "36143"
    base = {k: tuple(v) if isinstance(v, list) else v for k, v in state["cfg"].items()}
    items = [train_tiny.Item(tok.prompt_ids("Compute:\n12 * 3"), tok.answer_ids("12 * 3 = 36"), 16),
             train_tiny.Item(tok.prompt_ids("Sort: 3 1"), tok.answer_ids("1 3"), 12)]
    items[0].results = tok.result_positions(items[0].answer)
    assert len(items[0].results) == 2
    out = {}
    for rw in (1.0, 5.0):
        cfg = train_tiny.TrainConfig(**{**base, "result_weight": rw, "block_mask_frac": 0.0, "prefix_mask_frac": 1.0})
        out[rw] = train_tiny.make_batch(items, tok, cfg, torch.Generator().manual_seed(0))
    (n1, c1, k1, w1), (n5, c5, k5, w5) = out[1.0], out[5.0]
    assert torch.equal(n1, n5) and torch.equal(c1, c5) and torch.equal(k1, k5)  # only the weights differ
    T = n1.shape[1]
    res = [T - 16 + i for i in items[0].results]
    ratio = torch.ones_like(w1)
    ratio[0, res] = 5.0
    assert torch.equal(w5, w1 * ratio)
    assert (w1[0, res] > 0).any(), "a prefix mask covers the result here"


def test_result_end_weight_scales_only_the_token_after_each_result(train_tiny, state):
    """--result-end-weight multiplies the loss weight of the token right after each computed result's
    digits (the newline, the eot), where its digit count shows; the digits and everything else keep
    their weights, and 1.0 leaves make_batch's weights unchanged."""
    tok = train_tiny.Tok(TINY)
    base = {k: tuple(v) if isinstance(v, list) else v for k, v in state["cfg"].items()}
    answer = tok.answer_ids("12 * 3 = 36\n50 - 42 = 8")
    items = [train_tiny.Item(tok.prompt_ids("Compute:\n12 * 3\n50 - 42"), answer, 24, tok.result_positions(answer)),
             train_tiny.Item(tok.prompt_ids("Sort: 3 1"), tok.answer_ids("1 3"), 12)]
    ends = [i + 1 for i in (items[0].results[1], items[0].results[2])]
    assert [tok.hf.decode([answer[i]]) for i in items[0].results] == ["3", "6", "8"]
    assert tok.hf.decode([answer[ends[0]]]) == "\n"
    assert answer[ends[1]] == tok.eot
    out = {}
    for ew in (1.0, 4.0):
        cfg = train_tiny.TrainConfig(**{**base, "result_weight": 2.0, "result_end_weight": ew,
                                        "block_mask_frac": 0.0, "prefix_mask_frac": 1.0})
        out[ew] = train_tiny.make_batch(items, tok, cfg, torch.Generator().manual_seed(3))
    (n1, c1, k1, w1), (n4, c4, k4, w4) = out[1.0], out[4.0]
    assert torch.equal(n1, n4) and torch.equal(c1, c4) and torch.equal(k1, k4)  # only the weights differ
    T = n1.shape[1]
    ratio = torch.ones_like(w1)
    ratio[0, [T - 24 + i for i in ends]] = 4.0
    assert torch.equal(w4, w1 * ratio)
    assert (w1[0, [T - 24 + i for i in ends]] > 0).all(), "a prefix mask covers the last result's line here"


def test_result_cut_frac_masks_from_a_results_first_digit_on(train_tiny, state):
    """--result-cut-frac: a chosen example with computed results is clean up to the first digit of one
    of them (drawn uniformly) and masked from there to its canvas end, each masked token weighted
    1 / n_masked; an example without results keeps its plain mask; at 0 the batch is the one from before
    the flag (nothing extra is drawn)."""
    tok = train_tiny.Tok(TINY)
    base = {k: tuple(v) if isinstance(v, list) else v for k, v in state["cfg"].items()}
    answer = tok.answer_ids("12 * 3 = 36\n50 - 42 = 8")
    items = [train_tiny.Item(tok.prompt_ids("Compute:\n12 * 3\n50 - 42"), answer, 24, tok.result_positions(answer)),
             train_tiny.Item(tok.prompt_ids("Sort: 3 1"), tok.answer_ids("1 3"), 12)]
    starts = {items[0].results[0], items[0].results[2]}  # "36" starts at its 3, "8" is one digit
    plain = {"block_mask_frac": 0.0, "prefix_mask_frac": 0.0, "result_weight": 1.0, "result_end_weight": 1.0}
    cfg0 = train_tiny.TrainConfig(**{**base, **plain, "result_cut_frac": 0.0})
    cfg1 = train_tiny.TrainConfig(**{**base, **plain, "result_cut_frac": 1.0})
    seen = set()
    for seed in range(12):
        n0, c0, k0, w0 = train_tiny.make_batch(items, tok, cfg0, torch.Generator().manual_seed(seed))
        n1, c1, k1, w1 = train_tiny.make_batch(items, tok, cfg1, torch.Generator().manual_seed(seed))
        T = n1.shape[1]
        assert torch.equal(c0, c1) and torch.equal(k0, k1)
        assert torch.equal(n1[1], n0[1]) and torch.equal(w1[1], w0[1])  # no results: untouched
        m = n1[0] == tok.mask
        cut = int(m.nonzero().min()) - (T - 24)
        assert cut in starts
        assert m[T - 24 + cut:].all() and not m[:T - 24 + cut].any()
        assert torch.equal(n1[0, :T - 24 + cut], c1[0, :T - 24 + cut])  # the operands stay clean
        assert torch.allclose(w1[0], m.float() / m.sum())
        seen.add(cut)
    assert seen == starts, "both results are drawn as the cut"
    cfg_old = train_tiny.TrainConfig(**{k: v for k, v in {**base, **plain}.items() if k != "result_cut_frac"})
    assert cfg_old.result_cut_frac == 0.0  # a state saved before the flag resumes without it
    ref = train_tiny.make_batch(items, tok, cfg_old, torch.Generator().manual_seed(5))
    got = train_tiny.make_batch(items, tok, cfg0, torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_final_cut_frac_masks_from_the_final_answers_first_digit_on(train_tiny, state):
    """--final-cut-frac: an arith solution with a ``#### N`` line is clean up to N's first digit
    (Tok.final_position) and masked from there to its canvas end, each masked token weighted
    1 / n_masked; an example without a final answer keeps its plain mask; rows given a result cut keep
    it; at 0 the batch is the one from before the flag (nothing extra is drawn)."""
    tok = train_tiny.Tok(TINY)
    base = {k: tuple(v) if isinstance(v, list) else v for k, v in state["cfg"].items()}
    answer = tok.answer_ids("She pays 100 - 40 = $60.\n#### 60")
    final = tok.final_position(answer)
    assert tok.hf.decode(answer[final - 2:final + 2]) == "#### 60" and answer[final + 2] == tok.eot
    assert tok.final_position(tok.answer_ids("12 * 3 = 36")) == -1
    res = tok.result_positions(answer)
    items = [train_tiny.Item(tok.prompt_ids("How much?"), answer, 30, res, (), final),
             train_tiny.Item(tok.prompt_ids("Sort: 3 1"), tok.answer_ids("1 3"), 12)]
    plain = {"block_mask_frac": 0.0, "prefix_mask_frac": 0.0, "result_weight": 1.0, "result_end_weight": 1.0,
             "result_cut_frac": 0.0}
    cfg0 = train_tiny.TrainConfig(**{**base, **plain, "final_cut_frac": 0.0})
    cfg1 = train_tiny.TrainConfig(**{**base, **plain, "final_cut_frac": 1.0})
    for seed in range(6):
        n0, c0, k0, w0 = train_tiny.make_batch(items, tok, cfg0, torch.Generator().manual_seed(seed))
        n1, c1, k1, w1 = train_tiny.make_batch(items, tok, cfg1, torch.Generator().manual_seed(seed))
        T = n1.shape[1]
        assert torch.equal(c0, c1) and torch.equal(k0, k1)
        assert torch.equal(n1[1], n0[1]) and torch.equal(w1[1], w0[1])  # no final answer: untouched
        m = n1[0] == tok.mask
        assert int(m.nonzero().min()) == T - 30 + final
        assert m[T - 30 + final:].all() and not m[:T - 30 + final].any()
        assert torch.equal(n1[0, :T - 30 + final], c1[0, :T - 30 + final])  # the solution stays clean
        assert torch.allclose(w1[0], m.float() / m.sum())
    both = train_tiny.TrainConfig(**{**base, **plain, "result_cut_frac": 1.0, "final_cut_frac": 1.0})
    n2 = train_tiny.make_batch(items, tok, both, torch.Generator().manual_seed(0))[0]
    first = int((n2[0] == tok.mask).nonzero().min()) - (n2.shape[1] - 30)
    assert first == res[0], "the result cut (at 60's first digit) wins over the final cut"
    cfg_old = train_tiny.TrainConfig(**{k: v for k, v in {**base, **plain}.items() if k != "final_cut_frac"})
    assert cfg_old.final_cut_frac == 0.0  # a state saved before the flag resumes without it
    ref = train_tiny.make_batch(items, tok, cfg_old, torch.Generator().manual_seed(5))
    got = train_tiny.make_batch(items, tok, cfg0, torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_copy_mask_hides_the_later_copies_of_a_masked_result(train_tiny, state):
    """--copy-mask: in the chosen examples, a result with any digit masked has every later copy of its
    number masked too (Tok.result_copies finds them; numbers inside longer numbers are not copies);
    independent masking, which the test also runs, leaves some copies visible."""
    tok = train_tiny.Tok(TINY)
    ans = "Anna bakes 6 * 7 = 42 cookies.\nAfter selling 18, 42 - 18 = 24 cookies are left.\nShe fills 24 / 4 = 6 bags.\n#### 6"
    ids = tok.answer_ids(ans)
    copies = tok.result_copies(ids, tok.result_positions(ids))
    text = [("".join(tok.hf.decode([ids[i]]) for i in run), "".join(tok.hf.decode([ids[i]]) for i in later))
            for run, later in copies]
    assert text == [("42", "42"), ("24", "24"), ("6", "6")]  # the 6 of "6 * 7" comes before: not a copy
    ids2 = tok.answer_ids("So 3 * 4 = 12 pens.\nThen 12 + 112 = 124 pens.\n#### 124")
    (run, later), _ = tok.result_copies(ids2, tok.result_positions(ids2))
    assert len(later) == 2 and tok.hf.decode([ids2[i] for i in later]) == "12"  # not the 12 of 112 or 124
    base = {k: tuple(v) if isinstance(v, list) else v for k, v in state["cfg"].items()}
    item = train_tiny.Item(tok.prompt_ids("q"), ids, len(ids) + 4, tok.result_positions(ids), copies)
    seen = {}
    for cm in (0.0, 1.0):
        cfg = train_tiny.TrainConfig(**{**base, "copy_mask": cm, "block_mask_frac": 0.0, "prefix_mask_frac": 0.0})
        leaks = 0
        for seed in range(40):
            noisy, clean, _, w = train_tiny.make_batch([item], tok, cfg, torch.Generator().manual_seed(seed))
            off = noisy.shape[1] - item.canvas
            m = noisy[0] == tok.mask
            assert torch.equal(m, w[0] > 0)  # the loss covers exactly the masked tokens
            leaks += sum(bool(m[[off + i for i in r]].any()) and not bool(m[[off + i for i in c]].all())
                         for r, c in copies)
        seen[cm] = leaks
    assert seen[1.0] == 0 and seen[0.0] > 0


def test_list_op_weights_set_the_op_frequencies(train_tiny):
    """--list-op-weights draws list examples by rejection: op frequencies follow the weights (others 1)."""
    import collections
    import random

    tok = train_tiny.Tok(TINY)
    cfg = train_tiny.TrainConfig(domains=("list",), domain_weights=(1.0,), drill_frac=0.0,
                                 list_op_weights=("Sort=4", "Reverse=0"))
    stream = train_tiny.Stream(cfg, tok, train_tiny.load_tasks(cfg.domains))
    rng, ops = random.Random(0), collections.Counter()
    for _ in range(1300):
        text = tok.hf.decode(stream.item(rng, (1.0,)).prompt, skip_special_tokens=True)
        ops[text.rsplit(":", 1)[0].split("\n")[-1].rstrip(" 0123456789")] += 1
    n = sum(ops.values())
    assert ops["Reverse"] == 0
    assert ops["Sort"] / n == pytest.approx(4 / 12, abs=0.04)  # 4 of 4 + 8 ops at 1
    assert ops["Odd"] / n == pytest.approx(1 / 12, abs=0.03)
    with pytest.raises(SystemExit, match="Sorted=2"):
        train_tiny.list_op_weights(("Sorted=2",))


def test_drill_fact_accuracy_scores_each_result_by_its_masked_digits(train_tiny):
    """One forward per result, its digits masked; right iff every masked digit's argmax is the true one.
    A fake model that always predicts "7" gets exactly the results written only with 7s."""
    tok = train_tiny.Tok(TINY)
    seven = tok.hf.convert_tokens_to_ids("7")
    seen = []

    class Sevens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def new_store(self, key_mask):
            return None

        def forward(self, x, store, logits_pos):
            seen.append(int((x == tok.mask).sum()))
            out = torch.zeros(1, logits_pos.shape[1], tok.vocab)
            out[..., seven] = 1.0
            return out

    drills = [("Compute:\n3 + 4\n70 + 7", "3 + 4 = 7\n70 + 7 = 77"),
              ("Compute:\n10 + 7\n21 / 3\n7 * 11", "10 + 7 = 17\n21 / 3 = 7\n7 * 11 = 77")]
    got = train_tiny.drill_fact_accuracy(Sevens(), tok, drills)
    assert got == {"+": [2, 3], "/": [1, 1], "*": [1, 1], "all": [4, 5]}
    assert seen == [1, 2, 2, 1, 2]  # the digits of one result masked per forward
    seen.clear()
    assert train_tiny.drill_fact_accuracy(Sevens(), tok, drills, mode="ltr") == got
    ends = []  # ltr: the result and everything after it (answer, eot, 16 EOS) masked
    for _, a in drills:
        ids = tok.answer_ids(a)
        ends += [len(ids) + 16 - run[0] for run in tok.result_runs(tok.result_positions(ids))]
    assert seen == ends and ends[0] > 2
    problem = [("q", "Tom has 7 * 11 = 77 pens.\nHe gives 70, so he has 77 - 70 = $7 left.\n#### 7")]
    assert train_tiny.drill_fact_accuracy(Sevens(), tok, problem, mode="ltr") == {"*": [1, 1], "-": [1, 1], "all": [2, 2]}
    with pytest.raises(ValueError, match="mode"):
        train_tiny.drill_fact_accuracy(Sevens(), tok, drills, mode="copy")


def test_drill_op_weights_set_the_drill_operations(train_tiny):
    import collections
    import random

    rng, ops = random.Random(0), collections.Counter()
    for _ in range(400):
        _, answer = train_tiny.arith_drill(rng, (3.0, 1.0, 0.0, 0.0))
        ops.update(line.split()[1] for line in answer.split("\n"))
    n = sum(ops.values())
    assert set(ops) == {"*", "+"} and ops["*"] / n == pytest.approx(0.75, abs=0.04)


def test_drill_div_max_widens_the_quotients_and_keeps_the_old_stream_at_20(train_tiny):
    import random

    def divisions(div_max, seed=0, n=300):
        rng, out = random.Random(seed), []
        for _ in range(n):
            _, answer = train_tiny.arith_drill(rng, (0.0, 0.0, 0.0, 1.0), div_max)
            out += [tuple(int(x) for x in line.replace("/ ", "").replace("= ", "").split()) for line in answer.split("\n")]
        return out

    wide = divisions(90)
    assert all(a == b * r and 2 <= b <= 10 and 2 <= r <= 90 and a <= 250 for a, b, r in wide)
    big = sum(r > 20 for _, _, r in wide) / len(wide)
    assert big == pytest.approx(0.5, abs=0.05) and max(r for _, _, r in wide) > 80
    # at 20 the stream is the one from before the argument: a plain reference of the old divisions
    ref, w = random.Random(0), (0.0, 0.0, 0.0, 1.0)
    expected = []
    for _ in range(300):
        for _ in range(ref.randint(3, 6)):
            assert ref.choices(train_tiny.DRILL_OPS, weights=w)[0] == "/"
            b, r = ref.randint(2, 10), ref.randint(2, 20)
            expected.append((b * r, b, r))
    assert divisions(20) == expected


def test_drill_small_frac_draws_small_results_and_keeps_the_old_stream_at_0(train_tiny):
    import random

    def lines(weights, small, seed=0, n=300):
        rng, out = random.Random(seed), []
        for _ in range(n):
            _, answer = train_tiny.arith_drill(rng, weights, 20, small)
            for line in answer.split("\n"):
                a, op, b, _, r = line.split()
                out.append((int(a), op, int(b), int(r)))
        return out

    subs = lines((0.0, 0.0, 1.0, 0.0), 1.0)
    assert all(op == "-" and a - b == r and 1 <= r and 1 <= b for a, op, b, r in subs)
    close = [x for x in subs if x[3] <= 20 and x[0] % 10]  # the 1-20 differences (a round minuend aside)
    round_ = [x for x in subs if x[0] % 10 == 0 and x[0] <= 200]
    assert all(x in round_ or x[3] <= 20 for x in subs) and len(close) > 0.3 * len(subs) and len(round_) > 0.4 * len(subs)
    prods = lines((1.0, 0.0, 0.0, 0.0), 1.0)
    assert all(a * b == r and a >= 2 and b >= 2 and r <= 20 for a, _, b, r in prods)
    mixed = lines((0.0, 1.0, 1.0, 0.0), 0.5)  # + lines are never small, half the - lines are
    plus, minus = [x for x in mixed if x[1] == "+"], [x for x in mixed if x[1] == "-"]
    assert all(a + b == r for a, _, b, r in plus) and max(r for *_, r in plus) > 100
    def share(xs):  # lines that look small: a 1-20 difference or a round minuend
        return sum(r <= 20 or (a % 10 == 0 and a <= 200) for a, _, b, r in xs) / len(xs)

    plain = share([x for x in lines((0.0, 1.0, 1.0, 0.0), 0.0) if x[1] == "-"])
    assert 0.2 < plain < 0.5 and share(minus) == pytest.approx(0.5 + 0.5 * plain, abs=0.06)
    # at 0 the stream is the one from before the argument: a plain reference of the old differences
    ref, w, expected = random.Random(0), (0.0, 0.0, 1.0, 0.0), []
    for _ in range(300):
        for _ in range(ref.randint(3, 6)):
            assert ref.choices(train_tiny.DRILL_OPS, weights=w)[0] == "-"
            a = ref.randint(2, 250)
            b = ref.randint(1, a - 1)
            expected.append((a, "-", b, a - b))
    assert lines(w, 0.0) == expected


def test_arith_fact_drills_are_train_computations_in_the_solutions_notation(train_tiny):
    import operator
    import random

    task = train_tiny.load_tasks(["arith"])["arith"]
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
    rng, dollars, n = random.Random(0), 0, 0
    for _ in range(100):
        question, answer = train_tiny.arith_fact_drill(rng, task)
        lines = answer.split("\n")
        assert 3 <= len(lines) <= 6 and question.split("\n") == ["Compute:", *[ln.split(" = ")[0] for ln in lines]]
        for ln in lines:
            assert train_tiny.FACT_OP.fullmatch(ln), ln
            a, op, b, _, r = ln.replace("$", "").split()
            assert ops[op](int(a), int(b)) == int(r) and (op != "/" or int(a) % int(b) == 0), ln
            dollars += "$" in ln
            n += 1
    assert 0.05 < dollars / n < 0.5  # change's and savings' results keep their "$"


def test_arith_chain_drills_reuse_the_line_before_and_compute_right(train_tiny):
    import collections
    import operator
    import random

    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
    rng, steps, money, one_digit_subs, subs = random.Random(0), collections.Counter(), 0, 0, 0
    for _ in range(500):
        question, answer = train_tiny.arith_chain_drill(rng)
        head, *qs = question.split("\n")
        lines = answer.split("\n")
        assert head.startswith("Compute") and len(qs) == len(lines) and 4 <= len(lines) <= 6
        assert len({"$" in ln for ln in lines}) == 1  # a drill writes "$" in every result or in none
        money += "$" in lines[0]
        prev = None
        for q, ln in zip(qs, lines):
            assert train_tiny.FACT_OP.fullmatch(ln), ln
            a, op, b, _, r = ln.replace("$", "").split()
            a, b, r = int(a), int(b), int(r)
            assert r > 0 and ops[op](a, b) == r and (op != "/" or a % b == 0), ln
            if "_" in q:  # the question's "_" is the line before's result; the answer restates it
                assert prev is not None and q.replace("_", str(prev)) == ln.split(" = ")[0], (q, ln)
                left, qop, right = q.split()
                steps["".join(x if x in "_+-*/" else "n" for x in (left, qop, right))] += 1
                if op == "-":
                    subs += 1
                    one_digit_subs += r < 10
            else:  # a chain's first line: a product or a sum, nothing reused
                assert op in "*+" and q == ln.split(" = ")[0]
            prev = r
    assert 0.4 < money / 500 < 0.6
    assert set(steps) == {"n-_", "_-n", "_+n", "n+_", "_/n", "_*n"}  # every step of CHAIN_STEPS
    assert steps["n-_"] + steps["_-n"] > 0.4 * sum(steps.values())  # subtraction-heavy (CHAIN_WEIGHTS)
    assert one_digit_subs / subs > 0.1  # one-digit results (56 - 53 = 3) are common


def test_adapt_by_tokens_gives_each_domain_its_share_of_tokens(train_tiny, state):
    cfg = train_tiny.TrainConfig(**{**{k: tuple(v) if isinstance(v, list) else v for k, v in state["cfg"].items()},
                                    "adapt_by": "tokens", "adapt_floor": 0.4})
    costs = train_tiny.domain_costs(cfg, train_tiny.Tok(TINY), train_tiny.load_tasks(cfg.domains), n=64)
    i = {d: cfg.domains.index(d) for d in ("list", "code", "arith")}
    assert costs[i["list"]] < costs[i["arith"]]  # a list example is the cheap one
    acc = {"list/0shot": 0.5, "list/4shot": 0.3, "code/0shot": 1.0, "code/4shot": 0.9,
           "arith/0shot": 0.1, "arith/4shot": 0.1}
    w = train_tiny._adapt(acc, cfg, costs)
    share = [wi * c for wi, c in zip(w, costs)]  # expected tokens per draw
    target = {"list": 0.4 + 0.6, "code": 0.4 + 0.05, "arith": 0.4 + 0.9}
    for d, j in i.items():
        assert share[j] / sum(share) == pytest.approx(target[d] / sum(target.values()), abs=2e-3), d
    by_examples = train_tiny._adapt(acc, train_tiny.TrainConfig(**{**cfg.__dict__, "adapt_by": "examples"}))
    assert by_examples[i["list"]] == pytest.approx(1.0) and by_examples[i["arith"]] == pytest.approx(1.3)


def test_data_workers_build_the_same_batches(train_tiny, snapshot, tmp_path):
    """Pools built ahead in worker processes (GPU runs) are the batches the training process builds."""
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    shutil.copyfile(snapshot, a)
    shutil.copyfile(snapshot, b)
    _run(train_tiny, a, tmp_path / "a.log", 2)
    train_tiny.main(["--state", str(b), "--max-new-steps", "2", "--log", str(tmp_path / "b.log"),
                     "--save-every-min", "1000", "--adapt-every-min", "1000", "--threads", "1", "--data-workers", "1"])
    sa, sb = train_tiny.load_state(a), train_tiny.load_state(b)
    assert sa["stream"] == sb["stream"]
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k


def test_train_gpu_script_runs_on_cpu(snapshot, state, tmp_path):
    """scripts/train_gpu.sh on the CPU for 2 steps (stable LR, then decay): state parts + exported model
    under $OUT, joinable."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), TRAIN_DEVICE="cpu", TRAIN_STEPS="2", PYTHON=sys.executable,
               OMP_NUM_THREADS="1", TRAIN_STATE=str(snapshot))
    r = subprocess.run(["bash", str(REPO / "scripts" / "train_gpu.sh")], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    parts = sorted(out.glob("tiny_train_state.pt.part*"))
    assert len(parts) == 2 and all(p.stat().st_size <= 16 * 2**20 for p in parts)
    joined = tmp_path / "joined.pt"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    st = _train_module().load_state(joined)
    assert st["step"] == state["step"] + 2
    # two phases: 1 step at the stable LR (a decayed state warms up again), then a 1-step decay
    assert st["cfg"]["cooldown"] == 1 and st["cfg"]["cooldown_start"] == state["step"] + 1
    exported = load_file(str(out / "tiny" / "model.safetensors"))
    for k, v in exported.items():
        assert torch.equal(v, st["ema"][k]), k
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [p.name for p in parts] + ["tiny", "train.jsonl", "train.log"])


def test_arith_facts_bench_reports_three_measures_on_the_same_items(train_tiny, capsys):
    """bench/arith_facts.py: per model, clean and left-to-right drills and left-to-right arith solutions;
    the counts are the results of exactly those items (drills of seed 123, test problems of seed 0)."""
    import json
    import random

    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("arith_facts", REPO / "bench" / "arith_facts.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--drills", "3", "--problems", "4"])
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    counts = doc["counts"]["tiny"]
    assert set(counts) == {"drills, clean", "drills, ltr", "arith, ltr"}
    rng = random.Random("facts:123")
    n_drill = sum(len(train_tiny.FACT_OP.findall(train_tiny.arith_drill(rng)[1])) for _ in range(3))
    from ecache_cli.tasks import get_task

    n_arith = sum(len(train_tiny.FACT_OP.findall(ex.answer)) for ex in get_task("arith").examples("test", 4, 0))
    assert counts["drills, clean"]["all"][1] == counts["drills, ltr"]["all"][1] == n_drill >= 9
    assert counts["arith, ltr"]["all"][1] == n_arith >= 8
    for c in counts.values():  # per-op counts add up to "all"
        assert sum(v[1] for k, v in c.items() if k != "all") == c["all"][1]
        assert 0 <= c["all"][0] <= c["all"][1]


@pytest.mark.parametrize("knob", ["TRAIN_COOLDOWN_FRAC=abc", "TRAIN_COOLDOWN_FRAC=1", "TRAIN_STEPS=-1", "TRAIN_MINUTES=x"])
def test_train_gpu_script_rejects_a_bad_knob_in_one_line(snapshot, tmp_path, knob):
    name, value = knob.split("=")
    env = dict(os.environ, OUT=str(tmp_path / "out"), TRAIN_DEVICE="cpu", PYTHON=sys.executable, TRAIN_STATE=str(snapshot),
               **{name: value})
    r = subprocess.run(["bash", str(REPO / "scripts" / "train_gpu.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout[-1000:] + r.stderr[-1000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"train_gpu: {name}={value!r}")
    assert "Traceback" not in r.stderr
