"""Training of the embedded model (scripts/tiny_training, scripts/train_tiny.py, scripts/train_gpu.sh).

Every run here is a small new one written under tmp_path (a 1-layer, d_model 32 model, a few steps):
state format, exact resume, the LR schedule, export, the settings a saved state may carry, the
masks and drills of the data stream, and the GPU script's CPU smoke run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "ecache_cli" / "data" / "tiny"
if str(REPO / "scripts") not in sys.path:  # the training package; spawned data workers import it too
    sys.path.insert(0, str(REPO / "scripts"))

import train_tiny  # noqa: E402 (after the training package joins sys.path)
from tiny_training import data, loop  # noqa: E402
from tiny_training import evaluate as tev  # noqa: E402
from tiny_training.config import RETIRED, TrainConfig, config_from_dict  # noqa: E402
from tiny_training.export import tokenizer_sha256  # noqa: E402

# a model small enough that a step takes milliseconds; the warmup ends before the fixture's last step
SMALL = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--mlp-hidden", "64", "--batch-tokens", "512",
         "--warmup", "2"]
FRESH_STEPS = 3


def _train(state: Path, log: Path, *flags: str) -> None:
    train_tiny.main(["--state", str(state), "--log", str(log), "--save-every-min", "1000", "--threads", "1", *flags])


@pytest.fixture(scope="module")
def fresh_dir(tmp_path_factory):
    """A new run: 3 steps of the small model, one curriculum eval at its start (1 problem per domain,
    0-shot), then exported. The state is only read by the tests: each copies it before training on."""
    d = tmp_path_factory.mktemp("fresh")
    _train(d / "state.pt", d / "train.jsonl", *SMALL, "--max-new-steps", str(FRESH_STEPS),
           "--adapt-every-min", "1000", "--eval-n", "1", "--eval-shots", "0", "--export", "--out", str(d / "model"))
    return d


@pytest.fixture(scope="module")
def state(fresh_dir):
    return loop.load_state(fresh_dir / "state.pt")


def _copy(fresh_dir: Path, dst: Path) -> Path:
    shutil.copyfile(fresh_dir / "state.pt", dst)
    return dst


def test_a_new_run_writes_one_state_file(state):
    assert state["step"] == FRESH_STEPS and state["stats"]["tokens"] > 0 and state["init_from"] is None
    for key in ("model", "ema", "opt", "stream", "cfg", "torch_rng", "py_rng", "history", "schedule_start"):
        assert key in state, key
    assert state["cfg"]["d_model"] == 32 and state["cfg"]["n_layers"] == 1
    assert not set(state["cfg"]) & set(RETIRED)
    ev = [h for h in state["history"] if "eval" in h]
    assert len(ev) == 1 and ev[0]["step"] == 0  # a new run sets its first domain weights from an eval
    assert set(ev[0]["eval"]) == {"arith/0shot", "code/0shot", "list/0shot"}
    assert ev[0]["facts"]["all"] >= 0 and "facts_ltr" in ev[0]
    assert state["stream"]["weights"] == ev[0]["next_weights"]
    assert state["tokenizer_sha256"] == tokenizer_sha256(TINY)


def test_the_export_is_the_states_ema_and_loads_like_the_shipped_model(fresh_dir, state):
    from ecache_cli.models.loader import load_model

    out = fresh_dir / "model"
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == set(state["ema"])
    for k, v in exported.items():
        assert torch.equal(v, state["ema"][k]), k
    assert tokenizer_sha256(out) == tokenizer_sha256(TINY)
    lm = load_model(str(out), device="cpu", dtype="float32")
    assert lm.model.spec.d_model == 32 and json.loads((out / "config.json").read_text())["n_layers"] == 1
    moved = [k for k in state["model"] if not torch.equal(state["model"][k], state["ema"][k])]
    assert moved, "3 steps moved the weights away from the EMA"


def test_the_default_settings_build_the_shipped_models_shape():
    """A new run with the default shape trains a model with the shipped model's tensors and config."""
    tok = data.Tok(TINY)
    mcfg = loop.model_config(TrainConfig(), tok)
    assert {**mcfg, "torch_dtype": "float32"} == json.loads((TINY / "config.json").read_text())
    shipped = load_file(str(TINY / "model.safetensors"))
    fresh = loop.build_model(mcfg, 1).state_dict()
    assert {k: tuple(v.shape) for k, v in fresh.items()} == {k: tuple(v.shape) for k, v in shipped.items()}


def test_resume_is_exact(fresh_dir, state, tmp_path):
    """2 + 2 steps with a save/load in between give the same weights, optimizer and EMA as 4 steps."""
    a, b = _copy(fresh_dir, tmp_path / "a.pt"), _copy(fresh_dir, tmp_path / "b.pt")
    _train(a, tmp_path / "a.log", "--max-new-steps", "4")
    _train(b, tmp_path / "b.log", "--max-new-steps", "2")
    _train(b, tmp_path / "b.log", "--max-new-steps", "2")
    sa, sb = loop.load_state(a), loop.load_state(b)
    assert sa["step"] == sb["step"] == state["step"] + 4
    assert sa["stream"] == sb["stream"]
    for part in ("model", "ema"):
        for k in sa[part]:
            assert torch.equal(sa[part][k], sb[part][k]), (part, k)
    moved = [k for k in sa["model"] if not torch.equal(sa["model"][k], state["model"][k])]
    assert moved, "training changed no weight"
    for pid, st in sa["opt"]["state"].items():
        assert torch.equal(st["exp_avg"], sb["opt"]["state"][pid]["exp_avg"])


def test_cooldown_decays_linearly_from_the_resumed_step_and_resumes(fresh_dir, state, tmp_path):
    """--cooldown N: the LR falls linearly from lr to lr * min_lr_frac over N steps starting at the step
    the call resumed at, stays there, and a later resume without the flag continues the same decay."""
    cfg = replace(TrainConfig(), lr=1e-3, min_lr_frac=0.1, warmup=10, cooldown=100, cooldown_start=500)
    assert loop.lr_at(0, cfg) == pytest.approx(1e-4) and loop.lr_at(9, cfg) == pytest.approx(1e-3)
    assert loop.lr_at(499, cfg) == pytest.approx(1e-3)
    assert loop.lr_at(500, cfg) == pytest.approx(1e-3)
    assert loop.lr_at(550, cfg) == pytest.approx(1e-3 * (1 - 0.5 * 0.9))
    assert loop.lr_at(600, cfg) == pytest.approx(1e-4)
    assert loop.lr_at(10_000, cfg) == pytest.approx(1e-4)
    assert loop.lr_at(550, replace(cfg, cooldown=0)) == pytest.approx(1e-3)

    path = _copy(fresh_dir, tmp_path / "cool.pt")
    _train(path, tmp_path / "l", "--max-new-steps", "1", "--cooldown", "40")
    _train(path, tmp_path / "l", "--max-new-steps", "1")  # no flag: the saved cfg carries the decay on
    cool = loop.load_state(path)
    assert cool["cfg"]["cooldown"] == 40 and cool["cfg"]["cooldown_start"] == state["step"]
    assert cool["opt"]["param_groups"][0]["lr"] == pytest.approx(state["cfg"]["lr"] * (1 - 0.9 / 40))
    _train(path, tmp_path / "l", "--max-new-steps", "1", "--cooldown", "0")
    warm = loop.load_state(path)  # --cooldown 0: the stable LR again, through a fresh warmup
    assert warm["cfg"]["cooldown"] == 0 and warm["schedule_start"] == state["step"] + 2
    assert warm["opt"]["param_groups"][0]["lr"] == pytest.approx(state["cfg"]["lr"] / state["cfg"]["warmup"])


def test_a_states_retired_settings_load_at_their_inert_values_only(fresh_dir, tmp_path, capsys):
    """States written before a setting was retired carry it: at the value that switched nothing on it
    is dropped, an unknown key is noted and dropped, any other value stops the resume in one line."""
    saved = {**asdict(TrainConfig(seed=5)), **RETIRED, "from_the_future": 1}
    notes = []
    assert config_from_dict(saved, note=notes.append) == TrainConfig(seed=5)
    assert notes == ["ignored saved settings this version does not know: from_the_future"]
    with pytest.raises(ValueError, match="--drill-chain-frac 0.3"):
        config_from_dict({**saved, "drill_chain_frac": 0.3})
    path = _copy(fresh_dir, tmp_path / "old.pt")
    st = loop.load_state(path)
    st["cfg"]["drill_chain_frac"] = 0.3
    torch.save(st, path)
    with pytest.raises(SystemExit, match=r"old\.pt: the state was trained with --drill-chain-frac 0\.3"):
        _train(path, tmp_path / "l", "--max-new-steps", "1")


def test_bad_state_files_and_flags_stop_in_one_line(fresh_dir, tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a state")
    with pytest.raises(SystemExit, match=r"junk\.pt: cannot read a training state"):
        _train(junk, tmp_path / "l", "--max-new-steps", "1")
    with pytest.raises(SystemExit, match=r"none\.pt: no training state to export"):
        _train(tmp_path / "none.pt", tmp_path / "l", "--export-only", "--out", str(tmp_path / "m"))
    with pytest.raises(SystemExit, match="--d-model cannot change on resume"):
        _train(_copy(fresh_dir, tmp_path / "s.pt"), tmp_path / "l", "--max-new-steps", "1", "--d-model", "64")
    assert not (tmp_path / "m").exists()


def test_loss_over_the_answer_region_equals_the_full_logits_loss(state):
    """batch_loss computes logits for the last `canvas` columns only; value and gradients are those
    of the loss over every position's logits (a plain reference written here)."""
    import random

    import torch.nn.functional as F

    cfg = config_from_dict(state["cfg"])
    tok = data.Tok(TINY)
    model = loop.build_model(loop.model_config(cfg, tok), 0)
    model.load_state_dict(state["ema"])
    stream = data.Stream(replace(cfg, batch_tokens=2048), tok, data.load_tasks(cfg.domains))
    random.seed(0)
    items = stream.next()[:6]
    noisy, clean, key_mask, weights = data.make_batch(items, tok, cfg, torch.Generator().manual_seed(3))
    assert {it.canvas for it in items} != {noisy.shape[1]}, "the batch has prompt columns to skip"

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    got = loop.batch_loss(model, noisy, clean, key_mask, weights, max(it.canvas for it in items))
    g_got = grads(got)
    logits = model(noisy, model.new_store(key_mask))  # (B, T, V): every position
    sel = weights > 0
    want = (F.cross_entropy(logits[sel], clean[sel], reduction="none") * weights[sel]).sum() / len(items)
    g_want = grads(want)
    assert got.item() > 0 and abs(got.item() - want.item()) < 1e-5 * want.item()
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_data_workers_build_the_same_batches(fresh_dir, state, tmp_path):
    """Pools built ahead in worker processes (GPU runs) are the batches the training process builds."""
    a, b = _copy(fresh_dir, tmp_path / "a.pt"), _copy(fresh_dir, tmp_path / "b.pt")
    one_batch_pools = ["--max-new-steps", "2", "--pool-batches", "1"]  # so the 2 steps need new pools
    _train(a, tmp_path / "a.log", *one_batch_pools)
    _train(b, tmp_path / "b.log", *one_batch_pools, "--data-workers", "1")
    sa, sb = loop.load_state(a), loop.load_state(b)
    assert sb["stream"]["pool_idx"] > state["stream"]["pool_idx"], "the worker built no pool"
    assert sa["stream"] == sb["stream"]
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k


def _gpu_script(env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRAIN_DEVICE="cpu", PYTHON=sys.executable, OMP_NUM_THREADS="1", **env)
    return subprocess.run(["bash", str(REPO / "scripts" / "train_gpu.sh")], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.mark.slow  # the training script end to end in a fresh shell: .ci/run's slow step
def test_train_gpu_script_runs_on_cpu(fresh_dir, state, tmp_path):
    """scripts/train_gpu.sh on the CPU for 2 steps (stable LR, then decay) from a state given as
    TRAIN_STATE: state parts + exported model under $OUT, joinable by scripts/join_state.sh."""
    out = tmp_path / "out"
    r = _gpu_script({"OUT": str(out), "TRAIN_STEPS": "2", "TRAIN_STATE": str(fresh_dir / "state.pt")})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    parts = sorted(out.glob("tiny_train_state.pt.part*"))
    assert parts and all(p.stat().st_size <= 16 * 2**20 for p in parts)
    joined = tmp_path / "joined.pt"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    st = loop.load_state(joined)
    assert st["step"] == state["step"] + 2
    # two phases: 1 step at the stable LR, then a 1-step decay from where it stopped
    assert st["cfg"]["cooldown"] == 1 and st["cfg"]["cooldown_start"] == state["step"] + 1
    exported = load_file(str(out / "tiny" / "model.safetensors"))
    for k, v in exported.items():
        assert torch.equal(v, st["ema"][k]), k
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [p.name for p in parts] + ["tiny", "train.jsonl", "train.log"])
    assert loop.load_state(fresh_dir / "state.pt")["step"] == state["step"]  # the given state is untouched


@pytest.mark.slow  # the training script end to end in a fresh shell: .ci/run's slow step
def test_train_gpu_script_starts_a_new_run_without_a_state(tmp_path):
    """TRAIN_STATE=none: a new run (its shape from TRAIN_ARGS), one phase of 1 step, state and model out."""
    out = tmp_path / "out"
    r = _gpu_script({"OUT": str(out), "TRAIN_STEPS": "1", "TRAIN_STATE": "none", "TRAIN_COOLDOWN_FRAC": "0",
                     "TRAIN_ARGS": " ".join(SMALL + ["--adapt-every-min", "0"])})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "TRAIN_STATE=none: a new run" in r.stdout
    st = loop.load_state(out / "tiny_train_state.pt.part00")  # one part: the small state is under 15 MB
    assert st["step"] == 1 and st["cfg"]["d_model"] == 32 and st["cfg"]["cooldown"] == 0
    assert set(load_file(str(out / "tiny" / "model.safetensors"))) == set(st["ema"])


@pytest.mark.parametrize("knob",
                         ["TRAIN_COOLDOWN_FRAC=abc", "TRAIN_COOLDOWN_FRAC=1", "TRAIN_STEPS=-1", "TRAIN_MINUTES=x"])
def test_train_gpu_script_rejects_a_bad_knob_in_one_line(tmp_path, knob):
    name, value = knob.split("=")
    r = _gpu_script({"OUT": str(tmp_path / "out"), name: value}, timeout=120)
    assert r.returncode == 2, r.stdout[-1000:] + r.stderr[-1000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"train_gpu: {name}={value!r}")
    assert "Traceback" not in r.stderr


def test_train_gpu_script_names_a_missing_state(tmp_path):
    r = _gpu_script({"OUT": str(tmp_path / "out"), "TRAIN_STATE": str(tmp_path / "gone.pt")}, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (f"train_gpu: TRAIN_STATE={tmp_path / 'gone.pt'}: no such file "
                                                 "(TRAIN_STATE=none starts a new run)")


def test_result_weight_scales_only_the_masked_result_digits():
    """--result-weight multiplies the loss weight of the digits after "= " / "= $" in arith solutions
    and drills (Tok.result_positions), nothing else; 1.0 leaves make_batch's weights unchanged."""
    tok = data.Tok(TINY)
    ids = tok.answer_ids("Ben saves 12 * 3 = $36.\nHe has 36 - 35 = $1 left.\nSo 3 + 40 = 43 pens.\n#### 1")
    assert "".join(tok.hf.decode([ids[i]]) for i in tok.result_positions(ids)) == "36143"
    base = asdict(TrainConfig())
    items = [data.Item(tok.prompt_ids("Compute:\n12 * 3"), tok.answer_ids("12 * 3 = 36"), 16),
             data.Item(tok.prompt_ids("Sort: 3 1"), tok.answer_ids("1 3"), 12)]
    items[0].results = tok.result_positions(items[0].answer)
    assert len(items[0].results) == 2
    out = {}
    for rw in (1.0, 5.0):
        cfg = TrainConfig(**{**base, "result_weight": rw, "block_mask_frac": 0.0, "prefix_mask_frac": 1.0})
        out[rw] = data.make_batch(items, tok, cfg, torch.Generator().manual_seed(0))
    (n1, c1, k1, w1), (n5, c5, k5, w5) = out[1.0], out[5.0]
    assert torch.equal(n1, n5) and torch.equal(c1, c5) and torch.equal(k1, k5)  # only the weights differ
    T = n1.shape[1]
    res = [T - 16 + i for i in items[0].results]
    ratio = torch.ones_like(w1)
    ratio[0, res] = 5.0
    assert torch.equal(w5, w1 * ratio)
    assert (w1[0, res] > 0).any(), "a prefix mask covers the result here"


def test_result_cut_frac_masks_from_a_results_first_digit_on():
    """--result-cut-frac: a chosen example with computed results is clean up to the first digit of one
    of them (drawn uniformly) and masked from there to its canvas end, each masked token weighted
    1 / n_masked; an example without results keeps its plain mask; at 0 the batch is the one from before
    the flag (nothing extra is drawn)."""
    tok = data.Tok(TINY)
    base = asdict(TrainConfig())
    answer = tok.answer_ids("12 * 3 = 36\n50 - 42 = 8")
    items = [data.Item(tok.prompt_ids("Compute:\n12 * 3\n50 - 42"), answer, 24, tok.result_positions(answer)),
             data.Item(tok.prompt_ids("Sort: 3 1"), tok.answer_ids("1 3"), 12)]
    starts = {items[0].results[0], items[0].results[2]}  # "36" starts at its 3, "8" is one digit
    plain = {"block_mask_frac": 0.0, "prefix_mask_frac": 0.0, "result_weight": 1.0}
    cfg0 = TrainConfig(**{**base, **plain, "result_cut_frac": 0.0})
    cfg1 = TrainConfig(**{**base, **plain, "result_cut_frac": 1.0})
    seen = set()
    for seed in range(12):
        n0, c0, k0, w0 = data.make_batch(items, tok, cfg0, torch.Generator().manual_seed(seed))
        n1, c1, k1, w1 = data.make_batch(items, tok, cfg1, torch.Generator().manual_seed(seed))
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
    cfg_old = config_from_dict({k: v for k, v in {**base, **plain}.items() if k != "result_cut_frac"})
    assert cfg_old.result_cut_frac == 0.0  # a state saved before the flag resumes without it
    ref = data.make_batch(items, tok, cfg_old, torch.Generator().manual_seed(5))
    got = data.make_batch(items, tok, cfg0, torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_copy_mask_hides_the_later_copies_of_a_masked_result():
    """--copy-mask: in the chosen examples, a result with any digit masked has every later copy of its
    number masked too (Tok.result_copies finds them; numbers inside longer numbers are not copies);
    independent masking, which the test also runs, leaves some copies visible."""
    tok = data.Tok(TINY)
    ans = ("Anna bakes 6 * 7 = 42 cookies.\nAfter selling 18, 42 - 18 = 24 cookies are left.\n"
           "She fills 24 / 4 = 6 bags.\n#### 6")
    ids = tok.answer_ids(ans)
    copies = tok.result_copies(ids, tok.result_positions(ids))
    text = [("".join(tok.hf.decode([ids[i]]) for i in run), "".join(tok.hf.decode([ids[i]]) for i in later))
            for run, later in copies]
    assert text == [("42", "42"), ("24", "24"), ("6", "6")]  # the 6 of "6 * 7" comes before: not a copy
    ids2 = tok.answer_ids("So 3 * 4 = 12 pens.\nThen 12 + 112 = 124 pens.\n#### 124")
    (_, later), _ = tok.result_copies(ids2, tok.result_positions(ids2))
    assert len(later) == 2 and tok.hf.decode([ids2[i] for i in later]) == "12"  # not the 12 of 112 or 124
    base = asdict(TrainConfig())
    item = data.Item(tok.prompt_ids("q"), ids, len(ids) + 4, tok.result_positions(ids), copies)
    seen = {}
    for cm in (0.0, 1.0):
        cfg = TrainConfig(**{**base, "copy_mask": cm, "block_mask_frac": 0.0, "prefix_mask_frac": 0.0})
        leaks = 0
        for seed in range(40):
            noisy, _, _, w = data.make_batch([item], tok, cfg, torch.Generator().manual_seed(seed))
            off = noisy.shape[1] - item.canvas
            m = noisy[0] == tok.mask
            assert torch.equal(m, w[0] > 0)  # the loss covers exactly the masked tokens
            leaks += sum(bool(m[[off + i for i in r]].any()) and not bool(m[[off + i for i in c]].all())
                         for r, c in copies)
        seen[cm] = leaks
    assert seen[1.0] == 0 and seen[0.0] > 0


def test_list_op_weights_set_the_op_frequencies():
    """--list-op-weights draws list examples by rejection: op frequencies follow the weights (others 1)."""
    import collections
    import random

    tok = data.Tok(TINY)
    cfg = TrainConfig(domains=("list",), domain_weights=(1.0,), drill_frac=0.0,
                                 list_op_weights=("Sort=4", "Reverse=0"))
    stream = data.Stream(cfg, tok, data.load_tasks(cfg.domains))
    rng, ops = random.Random(0), collections.Counter()
    for _ in range(1300):
        text = tok.hf.decode(stream.item(rng, (1.0,)).prompt, skip_special_tokens=True)
        ops[text.rsplit(":", 1)[0].split("\n")[-1].rstrip(" 0123456789")] += 1
    n = sum(ops.values())
    assert ops["Reverse"] == 0
    assert ops["Sort"] / n == pytest.approx(4 / 12, abs=0.04)  # 4 of 4 + 8 ops at 1
    assert ops["Odd"] / n == pytest.approx(1 / 12, abs=0.03)
    with pytest.raises(SystemExit, match="Sorted=2"):
        data.list_op_weights(("Sorted=2",))


def test_drill_fact_accuracy_scores_each_result_by_its_masked_digits():
    """One forward per result, its digits masked; right iff every masked digit's argmax is the true one.
    A fake model that always predicts "7" gets exactly the results written only with 7s."""
    tok = data.Tok(TINY)
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
    got = tev.drill_fact_accuracy(Sevens(), tok, drills)
    assert got == {"+": [2, 3], "/": [1, 1], "*": [1, 1], "all": [4, 5]}
    assert seen == [1, 2, 2, 1, 2]  # the digits of one result masked per forward
    seen.clear()
    assert tev.drill_fact_accuracy(Sevens(), tok, drills, mode="ltr") == got
    ends = []  # ltr: the result and everything after it (answer, eot, 16 EOS) masked
    for _, a in drills:
        ids = tok.answer_ids(a)
        ends += [len(ids) + 16 - run[0] for run in tok.result_runs(tok.result_positions(ids))]
    assert seen == ends and ends[0] > 2
    problem = [("q", "Tom has 7 * 11 = 77 pens.\nHe gives 70, so he has 77 - 70 = $7 left.\n#### 7")]
    assert tev.drill_fact_accuracy(Sevens(), tok, problem, mode="ltr") == {"*": [1, 1], "-": [1, 1], "all": [2, 2]}
    with pytest.raises(ValueError, match="mode"):
        tev.drill_fact_accuracy(Sevens(), tok, drills, mode="copy")


def test_drill_op_weights_set_the_drill_operations():
    import collections
    import random

    rng, ops = random.Random(0), collections.Counter()
    for _ in range(400):
        _, answer = data.arith_drill(rng, (3.0, 1.0, 0.0, 0.0))
        ops.update(line.split()[1] for line in answer.split("\n"))
    n = sum(ops.values())
    assert set(ops) == {"*", "+"} and ops["*"] / n == pytest.approx(0.75, abs=0.04)


def test_drill_div_max_widens_the_quotients_and_keeps_the_old_stream_at_20():
    import random

    def divisions(div_max, seed=0, n=300):
        rng, out = random.Random(seed), []
        for _ in range(n):
            _, answer = data.arith_drill(rng, (0.0, 0.0, 0.0, 1.0), div_max)
            out += [tuple(int(x) for x in line.replace("/ ", "").replace("= ", "").split())
                    for line in answer.split("\n")]
        return out

    wide = divisions(90)
    assert all(a == b * r and 2 <= b <= 10 and 2 <= r <= 90 and a <= 250 for a, b, r in wide)
    big = sum(r > 20 for _, _, r in wide) / len(wide)
    assert big == pytest.approx(0.5, abs=0.05) and max(r for _, _, r in wide) > 80
    # at 20 (the default) no extra draw is made: the stream equals this plain reference with quotients 2-20
    ref, w = random.Random(0), (0.0, 0.0, 0.0, 1.0)
    expected = []
    for _ in range(300):
        for _ in range(ref.randint(3, 6)):
            assert ref.choices(data.DRILL_OPS, weights=w)[0] == "/"
            b, r = ref.randint(2, 10), ref.randint(2, 20)
            expected.append((b * r, b, r))
    assert divisions(20) == expected


def test_adapt_by_tokens_gives_each_domain_its_share_of_tokens():
    cfg = TrainConfig(adapt_by="tokens", adapt_floor=0.4)
    costs = tev.domain_costs(cfg, data.Tok(TINY), data.load_tasks(cfg.domains), n=64)
    i = {d: cfg.domains.index(d) for d in ("list", "code", "arith")}
    assert costs[i["list"]] < costs[i["arith"]]  # a list example is the cheap one
    acc = {"list/0shot": 0.5, "list/4shot": 0.3, "code/0shot": 1.0, "code/4shot": 0.9,
           "arith/0shot": 0.1, "arith/4shot": 0.1}
    w = tev.adapt_weights(acc, cfg, costs)
    share = [wi * c for wi, c in zip(w, costs)]  # expected tokens per draw
    target = {"list": 0.4 + 0.6, "code": 0.4 + 0.05, "arith": 0.4 + 0.9}
    for d, j in i.items():
        assert share[j] / sum(share) == pytest.approx(target[d] / sum(target.values()), abs=2e-3), d
    by_examples = tev.adapt_weights(acc, TrainConfig(**{**cfg.__dict__, "adapt_by": "examples"}))
    assert by_examples[i["list"]] == pytest.approx(1.0) and by_examples[i["arith"]] == pytest.approx(1.3)


def test_arith_facts_bench_reports_three_measures_on_the_same_items(capsys):
    """bench/arith_facts.py: per model, clean and left-to-right drills and left-to-right arith solutions;
    the counts are the results of exactly those items (drills of seed 123, test problems of seed 0)."""
    import random

    from cli_helpers import load_bench

    bench = load_bench("arith_facts")
    bench.main(["--drills", "3", "--problems", "4"])
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    counts = doc["counts"]["tiny"]
    assert set(counts) == {"drills, clean", "drills, ltr", "arith, ltr"}
    rng = random.Random("facts:123")
    n_drill = sum(len(data.FACT_OP.findall(data.arith_drill(rng)[1])) for _ in range(3))
    from ecache_cli.tasks import get_task

    n_arith = sum(len(data.FACT_OP.findall(ex.answer)) for ex in get_task("arith").examples("test", 4, 0))
    assert counts["drills, clean"]["all"][1] == counts["drills, ltr"]["all"][1] == n_drill >= 9
    assert counts["arith, ltr"]["all"][1] == n_arith >= 8
    for c in counts.values():  # per-op counts add up to "all"
        assert sum(v[1] for k, v in c.items() if k != "all") == c["all"][1]
        assert 0 <= c["all"][0] <= c["all"][1]
