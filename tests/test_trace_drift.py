"""``ecache trace-drift``: drift maths, the shadow measurement, its outputs and the CLI (tiny random models)."""

from __future__ import annotations

import io
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import SMALL
from scipy import stats

from ecache_cli.engine import DecodeConfig, Engine
from ecache_cli.metrics.drift import VolatilityBins, correlation, cosine_drift
from ecache_cli.models.loader import load_model
from ecache_cli.models.synthetic import write_random_checkpoint
from ecache_cli.runs import drift_report as rep  # noqa: I001  (after trace_drift: engine first)
from ecache_cli.runs.settings import Settings
from ecache_cli.runs.trace_drift import DriftTracer, TraceOptions, trace

PROMPTS = ["Sort: 9 3 7 1", "Reverse the list 4 5 6 7 8 please"]  # different lengths: left padding in a batch
DECODE = dict(gen_length=16, block_length=8)
RECORD_KEYS = {"prompt", "step", "block", "step_in_block", "refresh", "computed", "served", "signal", "committed",
               "fidelity_mismatch", "fidelity_kl", "drift_k_mean", "drift_k_max", "drift_v_mean", "drift_v_max",
               "drift_k", "drift_v", "start_layer", "route_change", "forward_ms", "shadow_ms"}
NEVER = 1e9  # a tau no signal reaches: the entropy policy refreshes only at the first step


def settings(cache: str = "entropy", **params) -> Settings:
    decode = {**DECODE, **{k: params.pop(k) for k in list(params) if k in DecodeConfig.__dataclass_fields__}}
    return Settings(decode=DecodeConfig(**decode), cache=cache, cache_params=params)


def run_trace(lm, cache="entropy", prompts=PROMPTS, batch=2, sinks=(), seed=0, **params):
    opts = TraceOptions(prompts=list(prompts), chat=False, batch_size=batch, seed=seed)
    return trace(lm, settings(cache, **params), opts, sinks)


def traced_steps(lm, cache="entropy", prompts=PROMPTS, **params):
    """Run a batch with a tracer installed; yield (run, rec, per_position(...)) for every step."""
    s = settings(cache, **params)
    engine = Engine.from_loaded(lm)
    run = engine.start(engine.encode(prompts, chat=False), s.decode, s.policy(), seed=0)
    tracer = DriftTracer(run)
    run.on_forward = tracer.capture
    for rec in run:
        yield run, rec, tracer.per_position(rec)


# --- drift maths ------------------------------------------------------------------------------------------


def test_cosine_drift_known_angles_and_agrees_with_torch():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, 5, 4, generator=g)  # (B, H, T, D)
    b = torch.randn(2, 3, 5, 4, generator=g)
    assert cosine_drift(a, a.clone()).eq(0).all()  # identical vectors: exactly 0
    assert torch.allclose(cosine_drift(a, -a), torch.full((2, 5), 2.0), atol=1e-6)
    e0, e1 = torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2)
    e0[..., 0], e1[..., 1] = 1.0, 1.0
    assert cosine_drift(e0, e1).item() == pytest.approx(1.0)
    flat = lambda t: t.transpose(1, 2).reshape(2, 5, 12)  # noqa: E731  all heads of a position concatenated
    ref = 1 - F.cosine_similarity(flat(a).double(), flat(b).double(), dim=-1)
    assert cosine_drift(a, b).shape == (2, 5)
    assert torch.allclose(cosine_drift(a, b).double(), ref, atol=1e-6)


def test_volatility_bins_mean_count_and_settle():
    bins = VolatilityBins()
    age = torch.tensor([[2, 2, 3, 5, 0]])
    change = torch.tensor([[1e-2, 3e-2, 4e-4, 1e-5, 9.0]])
    mask = torch.tensor([[True, True, True, True, False]])  # the age-0 entry is not counted
    bins.add(age, change, mask)
    curve = bins.curve()
    assert [p["n"] for p in curve] == [2, 3, 5]
    assert curve[0]["mean"] == pytest.approx(2e-2) and curve[0]["count"] == 2
    assert bins.settle_steps(1e-3, min_count=1) == 3
    assert bins.settle_steps(1e-6, min_count=1) is None
    assert bins.settle_steps(1e-3, min_count=2) is None  # only bin 2 (2 tokens, 2e-2) is counted
    other = VolatilityBins()
    other.add(torch.tensor([[7]]), torch.tensor([[5e-2]]), torch.tensor([[True]]))
    bins.merge(other)
    assert bins.curve()[-1] == {"n": 7, "mean": pytest.approx(5e-2), "count": 1}
    assert bins.settle_steps(1e-3, min_count=1) is None  # the last bin is above the level again


def test_correlation_undefined_cases():
    assert correlation([1, 2], [3, 4])["pearson_r"] is None  # fewer than 3 pairs
    assert correlation([1, 2, 3], [5, 5, 5])["spearman_rho"] is None  # constant series
    c = correlation([1, 2, 3, float("nan"), 4], [1, 3, 2, 7, 5])
    assert c["n"] == 4 and c["pearson_r"] == pytest.approx(stats.pearsonr([1, 2, 3, 4], [1, 3, 2, 5])[0])


# --- the shadow measurement ---------------------------------------------------------------------------------


def test_none_policy_has_exactly_zero_drift_and_full_fidelity(lm):
    report = run_trace(lm, "none")
    assert report.records and all(r["refresh"] and r["served"] == 0 for r in report.records)
    zeros = [0.0] * lm.spec.n_layers
    for r in report.records:
        assert r["drift_k_mean"] == zeros and r["drift_v_max"] == zeros and r["drift_k"] == 0.0
        assert r["fidelity_mismatch"] == 0 and r["fidelity_kl"] == 0.0
    assert report.correlation()["next_step_drift"]["pearson_r"] is None  # no partial step: undefined


def test_refresh_steps_match_the_shadow_bit_for_bit(lm):
    """Right after a full refresh the live store IS a fresh full forward: per-position drift is exactly 0
    at every real position and layer (not only over the empty served set)."""
    n_refresh = 0
    for run, rec, (shadow, _, _, _, _) in traced_steps(lm, "entropy", tau=0.5, recent_k=2):
        for b in range(rec.rows.numel()):
            if not bool(rec.refresh[b]) or not bool(rec.refresh.all()):
                continue
            n_refresh += 1
            real = run.store.key_mask[b]
            for layer in range(lm.spec.n_layers):
                assert cosine_drift(run.store.k[layer], shadow.k[layer])[b][real].eq(0).all()
                assert cosine_drift(run.store.v[layer], shadow.v[layer])[b][real].eq(0).all()
    assert n_refresh >= 2  # the first step of each row at least


def test_recomputed_positions_have_zero_drift_and_served_ones_do_not(lm):
    """At a partial step the computed positions' K/V of layers 0 and 1 equal the fresh ones: layer 0
    depends on the token alone, and layer 1's input is layer 0's output, which attended to exact
    layer-0 K/V. Served positions are exact at layer 0 (their tokens did not change) but stale at
    layer 1 (their cached values predate the newest commits)."""
    tol = 1e-6
    stale, partial = 0.0, 0
    for run, rec, (shadow, _, computed, served, _) in traced_steps(lm, "entropy", tau=NEVER, recent_k=2):
        if bool(rec.refresh.all()):
            continue
        partial += 1
        comp = computed & run.store.key_mask
        for layer in (0, 1):
            dk = cosine_drift(run.store.k[layer], shadow.k[layer])
            dv = cosine_drift(run.store.v[layer], shadow.v[layer])
            assert dk[comp].max() <= tol and dv[comp].max() <= tol, (rec.step, layer)
        assert cosine_drift(run.store.k[0], shadow.k[0])[served[0]].max() <= tol
        stale = max(stale, float(cosine_drift(run.store.k[1], shadow.k[1])[served[1]].max()))
    assert partial >= 10
    assert stale > 1e-4  # the served positions of layer 1 did drift


def test_deeper_layers_of_recomputed_positions_inherit_drift(tmp_path):
    """Layer 2 of a recomputed position attended to stale layer-1 K/V, so it is not exact: the definition
    of drift over *served* positions is a choice, and this shows what it leaves out."""
    lm3 = load_model(write_random_checkpoint(tmp_path / "l3", "llada", n_layers=3, scale=4.0), "cpu", "float32")
    worst = 0.0
    for run, _rec, (shadow, _, computed, _, _) in traced_steps(lm3, "entropy", tau=NEVER, recent_k=2):
        comp = computed & run.store.key_mask
        assert cosine_drift(run.store.k[1], shadow.k[1])[comp].max() <= 1e-6
        worst = max(worst, float(cosine_drift(run.store.k[2], shadow.k[2])[comp].max()))
    assert worst > 1e-6


def test_records_are_well_formed(lm):
    report = run_trace(lm, "entropy", tau=1.0, recent_k=2)
    L = lm.spec.n_layers
    by_prompt: dict[int, list[dict]] = {}
    for r in report.records:
        assert set(r) == RECORD_KEYS
        for key in ("drift_k_mean", "drift_k_max", "drift_v_mean", "drift_v_max"):
            assert len(r[key]) == L and all(isinstance(v, float) and 0.0 <= v <= 2.0 for v in r[key])
        assert isinstance(r["refresh"], bool) and isinstance(r["computed"], int) and isinstance(r["served"], int)
        assert r["served"] == 0 if r["refresh"] else r["served"] > 0
        assert r["drift_k"] == pytest.approx(sum(r["drift_k_mean"]) / L) if r["served"] else r["drift_k"] == 0.0
        assert max(r["drift_k_max"]) >= max(r["drift_k_mean"])
        assert r["shadow_ms"] > 0 and r["forward_ms"] > 0
        if lm.spec.n_experts:  # MoE: the share of expert choices caching changed, 0 for a full forward
            assert 0.0 <= r["route_change"] <= 1.0 and (r["route_change"] == 0.0 or not r["refresh"])
        else:
            assert r["route_change"] is None
        json.dumps(r)  # JSON-able
        by_prompt.setdefault(r["prompt"], []).append(r)
    assert sorted(by_prompt) == [0, 1]
    for prompt, rs in by_prompt.items():
        assert [r["step"] for r in rs] == list(range(len(rs)))
        assert rs[0]["signal"] is None and rs[0]["refresh"]  # first step: no previous commits, full forward
        for r in rs[1:]:
            assert set(r["signal"]) == {"max-entropy", "sum-entropy", "max-confidence"}
            # the recorded signal is the one the policy used for this step's decision (None: the previous
            # step committed nothing, as Dream's schedule may, so nothing is stale and it does not refresh)
            e = r["signal"]["max-entropy"]
            assert r["refresh"] == (e is not None and e > 1.0)
        committed = sum(r["committed"] for r in rs)
        assert committed == DECODE["gen_length"] or (report.results[prompt].ended and committed < DECODE["gen_length"])
    assert any(not r["refresh"] for r in report.records) and any(r["refresh"] for r in report.records[2:])


def test_signal_and_next_step_drift_correlation_is_computed_on_the_recorded_series(llada_lm):
    """x = the engine's own signal of step t's commits (read from a plain run), y = the recorded drift at
    step t+1 of partial steps; the report's statistics must be scipy's on exactly these pairs."""
    report = run_trace(llada_lm, "entropy", prompts=PROMPTS[:1], batch=1, tau=NEVER, recent_k=2)
    s = settings("entropy", tau=NEVER, recent_k=2)
    engine = Engine.from_loaded(llada_lm)
    plain = engine.start(engine.encode(PROMPTS[:1], chat=False), s.decode, s.policy(), seed=0)
    signal = [float(rec.signal("max-entropy")[0]) for rec in plain]
    drift = {r["step"]: r["drift_k"] for r in report.records if r["served"] > 0}
    x = [signal[t] for t in range(len(signal)) if t + 1 in drift]
    y = [drift[t + 1] for t in range(len(signal)) if t + 1 in drift]
    c = report.correlation()["next_step_drift"]
    assert c["n"] == len(x) == len(signal) - 1  # every step after the first is partial here
    assert c["pearson_r"] == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-12)
    assert c["pearson_p"] == pytest.approx(stats.pearsonr(x, y)[1], rel=1e-9)
    assert c["spearman_rho"] == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)
    assert "step t+1" in c["y"] and "step t" in c["x"]


POLICIES = ["none", "prefix", "dual", "entropy", "dkv", "dllm-cache", "d2cache", "elastic"]


@pytest.mark.parametrize("cache", POLICIES)
def test_shadow_forward_does_not_change_the_generated_tokens(lm, cache):
    params = {"tau": 0.5, "recent_k": 2} if cache == "entropy" else {}
    report = run_trace(lm, cache, **params)
    s = settings(cache, **params)
    engine = Engine.from_loaded(lm)
    plain = engine.start(engine.encode(PROMPTS, chat=False), s.decode, s.policy(), seed=0)
    for _ in plain:
        pass
    assert [r.token_ids for r in report.results] == [r.token_ids for r in plain.results()]
    assert len(report.records) == int(plain.ledger.nfe.sum())  # one record per forward of every row


def test_layer_selective_forwards_serve_only_the_layers_below_the_start(llada_lm):
    """Elastic-Cache recomputes every position from ``start_layer`` on: those layers serve nothing, so
    their drift is 0 and the step's drift averages the layers below."""
    report = run_trace(llada_lm, "elastic", gen_length=32, block_length=16)
    expanded = [r for r in report.records if r["start_layer"] is not None and r["start_layer"] < llada_lm.spec.n_layers]
    assert expanded, "elastic never expanded: pick a setting where its attention drift exceeds gamma"
    for r in expanded:
        start = r["start_layer"]
        assert all(v == 0.0 for v in r["drift_k_mean"][start:] + r["drift_v_max"][start:])
        if start > 0 and r["served"]:
            assert r["drift_k"] == pytest.approx(sum(r["drift_k_mean"][:start]) / start)


def test_sampling_rng_is_untouched_by_the_shadow(llada_lm):
    report = run_trace(llada_lm, "entropy", temperature=1.0, seed=3, tau=0.5, recent_k=2)
    s = settings("entropy", temperature=1.0, tau=0.5, recent_k=2)
    engine = Engine.from_loaded(llada_lm)
    plain = engine.generate(PROMPTS, s.decode, s.policy(), chat=False, seed=3)
    assert [r.token_ids for r in report.results] == [r.token_ids for r in plain]


def test_rows_dropped_by_early_exit_keep_their_prompt_numbers(llada_lm):
    """When prompt 0 ends first, prompt 1 moves to batch row 0: its records must still say prompt 1 (the
    engine's ``rec.rows``), which the signals of an untraced run with the same seed confirm."""
    params = dict(temperature=3.0, block_length=4, tau=0.5, recent_k=2)  # hot sampling: EOS comes early
    s = settings("entropy", **params)
    engine = Engine.from_loaded(llada_lm)
    for seed in range(40):
        plain = engine.start(engine.encode(PROMPTS, chat=False), s.decode, s.policy(), seed=seed)
        signal, drop = {}, None
        for rec in plain:
            for b, row in enumerate(rec.rows.tolist()):
                signal[(row, rec.step)] = float(rec.signal("max-entropy")[b])
            if drop is None and rec.finished.tolist() == [True, False]:
                drop = rec.step
        if drop is not None and drop >= 2 and plain.steps_done > drop + 3:
            break
    else:
        pytest.fail("no seed in 0..39 ends prompt 0 before prompt 1; the early-exit test needs a new setting")
    report = run_trace(llada_lm, "entropy", seed=seed, **params)
    assert [r.token_ids for r in report.results] == [r.token_ids for r in plain.results()]
    p0 = [r for r in report.records if r["prompt"] == 0]
    p1 = [r for r in report.records if r["prompt"] == 1]
    assert p0[-1]["step"] == drop and len(p1) == plain.steps_done > drop + 1
    for r in p0[1:] + p1[1:]:
        assert r["signal"]["max-entropy"] == pytest.approx(signal[(r["prompt"], r["step"] - 1)], abs=1e-12)
    assert report.per_prompt[1].curve()[-1]["n"] > drop  # prompt 1's volatility kept being measured


def test_batches_of_one_number_prompts_globally(llada_lm):
    report = run_trace(llada_lm, "entropy", batch=1, tau=NEVER, recent_k=2)
    assert sorted({r["prompt"] for r in report.records}) == [0, 1]
    assert [r.index for r in report.results] == [0, 1]
    assert set(report.per_prompt) == {0, 1}
    total = sum(b.counts.sum() for b in report.per_prompt.values())
    assert total == report.volatility.counts.sum() > 0


# --- outputs ------------------------------------------------------------------------------------------------


def test_tensorboard_event_file_has_the_expected_tags(llada_lm, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = rep.TensorBoardSink(tmp_path / "tb", "{}")
    report = run_trace(llada_lm, "entropy", sinks=[sink], tau=NEVER, recent_k=2)
    acc = EventAccumulator(str(tmp_path / "tb" / "prompt-0001"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    L = llada_lm.spec.n_layers
    expected = {"signal/max-entropy", "signal/sum-entropy", "signal/max-confidence", "cache/refresh",
                "cache/positions_computed", "cache/positions_served", "drift/k_mean_over_layers",
                "drift/v_mean_over_layers", "fidelity/mismatched_tokens", "fidelity/kl_nats", "volatility/k_change"}
    expected |= {f"drift_{n}_{s}/layer_{i:02d}" for n in "kv" for s in ("mean", "max") for i in range(L)}
    assert expected <= set(tags["scalars"])
    assert "drift_k_positions" in tags["histograms"]
    mine = [r for r in report.records if r["prompt"] == 1]
    assert [e.value for e in acc.Scalars("cache/refresh")] == [float(r["refresh"]) for r in mine]
    got = [e.value for e in acc.Scalars("drift_k_mean/layer_01")]
    assert got == pytest.approx([r["drift_k_mean"][1] for r in mine], rel=1e-6)
    assert [e.step for e in acc.Scalars("volatility/k_change")] == [p["n"] for p in report.per_prompt[1].curve()]
    summary = EventAccumulator(str(tmp_path / "tb" / "all-prompts"))
    summary.Reload()
    assert "volatility/k_change" in summary.Tags()["scalars"]


def test_plot_writes_a_png(llada_lm, tmp_path):
    import matplotlib.image

    report = run_trace(llada_lm, "entropy", tau=1.0, recent_k=2)
    path = tmp_path / "drift.png"
    rep.plot(report, path, "test", tau=1.0)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 400 and img.shape[1] > 600
    assert rep.no_drift_reason(report) is None  # drift measured: no panel says otherwise
    assert not [n for n in _notes(report) if "no KV drift" in n]


FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _notes(report, tau=None) -> list[str]:
    """The texts on the figure's panels, drawn with every warning an error (an empty legend was one)."""
    import matplotlib.pyplot as plt

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = rep.figure(report, "test", tau=tau)
        fig.savefig(io.BytesIO(), format="png", dpi=40)
    plt.close(fig)
    return rep.panel_notes(fig)


def _summary_text(report) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=100)
    rep.render_summary(console, report)
    return " ".join(console.file.getvalue().split())


@pytest.mark.parametrize("model", ["sdar", "llada2-mini"])
def test_block_diffusion_panels_say_why_there_is_no_drift_as_the_summary_does(model):
    """Block-causal attention serves finished blocks only, exact by construction: the drift panel (empty
    or float rounding) and the correlation panel say so in the text summary's words."""
    report = run_trace(load_model(FIXTURES / model, device="cpu", dtype="float32"), "block", prompts=["hi"],
                       batch=1)
    reason = rep.no_drift_reason(report)
    assert report.block_causal and reason.startswith("no KV drift: it is zero by construction")
    notes = _notes(report)
    assert any(n.startswith(reason) for n in notes), notes
    assert f"{reason}, so the signal-vs-drift figures above carry no information" in _summary_text(report)


def test_full_refresh_panels_say_nothing_was_served_as_the_summary_does(llada_lm):
    report = run_trace(llada_lm, "none")
    reason = rep.no_drift_reason(report)
    assert reason == "no KV drift measured: every step was a full refresh, so nothing was served from the cache"
    assert [n for n in _notes(report) if n == reason] == [reason, reason]  # the drift and the correlation panel
    assert f"({reason})" in _summary_text(report)


@pytest.mark.parametrize("model, gen", [("sdar", "16"), ("llada2-mini", "32")])
def test_cli_plot_of_a_block_diffusion_model_warns_nothing(cli, tmp_path, model, gen):
    """The new-user run: ``-q --plot`` on a block-diffusion model exits 0 with no matplotlib warning (it
    used to print "No artists with labels found to put in legend" for the empty drift panel)."""
    png = tmp_path / "p.png"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = cli("trace-drift", "-q", "--model", FIXTURES / model, "hi", "--gen-length", gen, "--plot", png)
    assert res.exit_code == 0, res.stderr
    assert "Warning" not in res.stderr and "legend" not in res.stderr, res.stderr
    assert not [str(w.message) for w in caught if "matplotlib" in w.filename or "drift_report" in w.filename]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_signal_under_a_policy_without_it_is_traced_not_warned_ignored(cli):
    """``--signal`` is what the trace plots beside the drift, whatever the policy: under ``dual`` (which takes
    no signal) it is used, so it is not named among the ignored cache flags (``--tau`` still is)."""
    res = cli("trace-drift", "-q", "Sort: 9 3 7 1", "--gen-length", "32", "--cache", "dual", "--signal",
              "sum-entropy", "--tau", "1", "--json", "-")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["signal"] == "sum-entropy"
    assert res.stderr.splitlines() == ["warning: --tau is not used by --cache dual (it takes refresh_every); ignored"]


@pytest.mark.skipif(not os.path.exists("/proc/version"), reason="needs /proc")
def test_a_jsonl_that_cannot_be_written_is_named_with_its_flag(cli):
    """A ``--jsonl`` file the first record cannot be written to (``/proc/version``: it opens, and the write
    fails) is one line naming ``--jsonl`` and its path, exit 1, as ``--json`` names its own."""
    res = cli("trace-drift", "--gen-length", "32", "Sort: 1 2", "--jsonl", "/proc/version")
    assert res.exit_code == 1 and res.stderr.strip().splitlines()[-1].startswith(
        "error: --jsonl /proc/version: cannot write ("), res.stderr


def test_the_summary_step_counts_add_up_to_the_records_on_block_diffusion(cli):
    """Refresh, partial and uncached steps (a block's first step reads nothing and refreshes nothing) add up
    to the records, on a block-diffusion model as on the others."""
    res = cli("trace-drift", "-q", "--model", FIXTURES / "sdar", "hi", "--gen-length", "16", "--json", "-")
    assert res.exit_code == 0, res.stderr
    s = json.loads(res.stdout)
    assert s["uncached_steps"] > 0 and s["refresh_steps"] + s["partial_steps"] + s["uncached_steps"] == s["records"]


def test_table_condenses_to_strided_and_first_refresh_steps():
    recs = [{"prompt": 0, "step": i, "refresh": i in (0, 5, 6)} for i in range(12)]
    shown, stride = rep.shown_records(recs, rows=4)
    assert stride == 3
    assert [r["step"] for r in shown] == [0, 3, 5, 6, 9, 11]  # 6 is a stride step; 5 starts a refresh run
    assert rep.shown_records(recs, rows=0)[0] == recs


# --- the command ----------------------------------------------------------------------------------------------


def app_():
    from ecache_cli.cli import app

    return app




def test_cli_writes_jsonl_tensorboard_plot_and_summary(cli, llada_dir, tmp_path):
    out = tmp_path / "steps.jsonl"
    loud = [a for a in SMALL if a != "-q"]  # under -q the tables stay off stderr when files hold the results
    res = cli("trace-drift", "--model", llada_dir, *PROMPTS, "-b", "2", *loud, "--tau", NEVER, "--recent-k", "2",
              "--jsonl", out, "--tensorboard", tmp_path / "tb", "--plot", tmp_path / "p.png", "--json", "-")
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert summary["records"] == len(lines) == 32 and {r["prompt"] for r in lines} == {0, 1}
    assert summary["partial_steps"] == 30 and summary["refresh_steps"] == 2 and summary["uncached_steps"] == 0
    corr = summary["correlation"]["next_step_drift"]
    xs = [r["signal"]["max-entropy"] for r in lines if r["served"] > 0]
    ys = [r["drift_k"] for r in lines if r["served"] > 0]
    assert corr["n"] == 30 and corr["pearson_r"] == pytest.approx(float(np.corrcoef(xs, ys)[0, 1]), abs=1e-9)
    assert summary["manifest"]["settings"]["cache"] == "entropy"
    assert summary["volatility"]["level"] == 1e-3 and summary["volatility"]["curve"]
    assert "trace-drift: per-step" in res.stderr and "volatility:" in res.stderr
    stats = [line.strip() for line in res.stderr.splitlines() if line.strip().startswith(("Pearson r", "Spearman"))]
    assert stats[:2] == [f"Pearson r = {corr['pearson_r']:+.3f} (p = {corr['pearson_p']:.2g})",  # one a line: a narrow
                         f"Spearman ρ = {corr['spearman_rho']:+.3f} (p = {corr['spearman_p']:.2g})"]  # terminal wraps
    # between them, never inside a number
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "tb" / "prompt-0000").is_dir() and (tmp_path / "tb" / "all-prompts").is_dir()


def test_cli_reads_task_prompts(cli, llada_dir, tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    rows = [{"question": f"Tom has {n} apples and eats 2. How many are left?", "answer": f"{n}-2={n - 2}\n#### {n - 2}"}
            for n in (5, 7, 9)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "s.jsonl"
    res = cli("trace-drift", "--model", llada_dir, "--task", "gsm8k", "--data", data, "--limit", "2", "--shots", "0",
              *SMALL, "--jsonl", out)
    assert res.exit_code == 0, res.stderr
    assert {json.loads(x)["prompt"] for x in out.read_text().splitlines()} == {0, 1}


@pytest.mark.parametrize("args, needle", [
    (["--plot", "x.jpg"], "--plot"),
    (["--signal", "loudness"], "--signal"),
    (["--volatility-level", "0"], "--volatility-level"),
    (["--data", "x.jsonl"], "--task"),
    (["--jsonl", "-", "--json", "-"], "stdout"),
    (["--plot", "same.png", "--tensorboard", "same.png"], "--tensorboard same.png is the same file as --plot"),
])
def test_cli_usage_errors_exit_2(cli, llada_dir, args, needle):
    res = cli("trace-drift", "--model", llada_dir, "hi", *SMALL, *args)
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    assert res.stderr.startswith("error: ") and needle in res.stderr


def test_volatility_table_keeps_the_bins_that_decide_the_verdict():
    from ecache_cli.runs.drift_report import _condense_curve

    curve = [{"n": n, "mean": 1e-4, "count": 40 - n} for n in range(2, 32)]
    curve[19]["mean"] = 5e-3  # n = 21, 19 tokens: above the level, so nothing settles before it
    curve[27]["mean"] = 5e-3  # n = 29, 11 tokens: above the level too
    curve[28]["mean"] = 5e-3  # n = 30, 10 tokens
    shown = [p["n"] for p in _condense_curve(curve, level=1e-3, settle=31)]
    assert shown == [*range(2, 14), 16, 21, 29, 30, 31]  # first 12, powers of two, the deciding bins, the last
    assert [p["n"] for p in _condense_curve(curve, level=1e-2, settle=2)] == [*range(2, 14), 16, 31]


@pytest.mark.parametrize("signal_name,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupted_trace_reports_and_writes_what_it_measured(signal_name, code, cli, llada_dir, tmp_path,
                                                                  monkeypatch):
    """Ctrl-C (130) or SIGTERM (143) during the trace, as in profile: --jsonl keeps every step measured,
    --json gets their summary with ``"incomplete": true``, one error line says so."""
    import os
    import signal

    from ecache_cli.runs import trace_drift

    real, tracers = trace_drift.DriftTracer.measure, []

    def measure(self, rec):  # the signal arrives at the second prompt's third step, before it is measured
        tracers.append(id(self))
        if tracers.count(id(self)) == 3 and len(set(tracers)) == 2:
            os.kill(os.getpid(), getattr(signal, signal_name))
        return real(self, rec)

    monkeypatch.setattr(trace_drift.DriftTracer, "measure", measure)
    before = signal.getsignal(signal.SIGTERM)
    js, jl = tmp_path / "t.json", tmp_path / "t.jsonl"
    res = cli("trace-drift", "Sort: 3 1 2", "Reverse: 4 5 6", "abc", "--batch-size", "1", "--model", llada_dir,
              *SMALL, "--json", js, "--jsonl", jl)
    assert signal.getsignal(signal.SIGTERM) == before
    assert res.exit_code == code, (res.exit_code, res.stderr)
    doc = json.loads(js.read_text())
    steps = [json.loads(line) for line in jl.read_text().splitlines()]
    measured = tracers.count(tracers[0]) + 2  # the first prompt's steps and two of the second's
    assert doc["incomplete"] is True and doc["prompts"] == 1 and doc["records"] == len(steps) == measured, doc
    # the step counts, the fidelity and the volatility describe the same steps: every one measured
    assert doc["fidelity"]["committed"] == sum(r["committed"] for r in steps)
    assert doc["refresh_steps"] + doc["partial_steps"] + doc["uncached_steps"] == measured
    assert doc["volatility"]["tokens_per_step"] == pytest.approx(doc["fidelity"]["committed"] / measured)
    assert [ln for ln in res.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: interrupted; the report covers 1 finished prompt(s) and {measured} measured step(s); --json {js} "
        "holds them (\"incomplete\": true)"]


@pytest.mark.parametrize("when,signal_name,code", [("summary", "SIGINT", 130), ("summary", "SIGTERM", 143),
                                                   ("sinks", "SIGTERM", 143), ("loop-and-summary", "SIGINT", 130)])
def test_an_interrupt_after_the_last_step_still_writes_the_json(when, signal_name, code, cli, llada_dir, tmp_path,
                                                                monkeypatch):
    """A signal after the trace's loop (closing the sinks, computing the summary) is held until --json is
    written: the summary is whole (``"incomplete": false``) when every step ran, and the exit is 130 / 143;
    a second signal while an interrupted trace is summed up keeps ``"incomplete": true``."""
    import os
    import signal

    from ecache_cli.runs import drift_report, trace_drift

    sig = getattr(signal, signal_name)
    real_summary, real_measure, calls = trace_drift.TraceReport.summary, trace_drift.DriftTracer.measure, []

    def summary(self):
        os.kill(os.getpid(), sig)  # held: the summary is still computed and written
        return real_summary(self)

    def measure(self, rec):  # loop-and-summary: a first signal at the third step, before it is measured
        calls.append(rec.step)
        if len(calls) == 3:
            os.kill(os.getpid(), sig)
        return real_measure(self, rec)

    if when == "sinks":
        real_close = drift_report.JsonlSink.close

        def close(self, report):
            os.kill(os.getpid(), sig)
            return real_close(self, report)

        monkeypatch.setattr(drift_report.JsonlSink, "close", close)
    else:
        monkeypatch.setattr(trace_drift.TraceReport, "summary", summary)
    if when == "loop-and-summary":
        monkeypatch.setattr(trace_drift.DriftTracer, "measure", measure)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    js, jl = tmp_path / "t.json", tmp_path / "t.jsonl"
    res = cli("trace-drift", "Sort: 3 1 2", "Reverse: 4 5 6", "--model", llada_dir, *SMALL, "--json", js,
              "--jsonl", jl)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert res.exit_code == code, (res.exit_code, res.stderr)
    doc = json.loads(js.read_text())
    steps = [json.loads(line) for line in jl.read_text().splitlines()]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    if when == "loop-and-summary":
        assert doc["incomplete"] is True and doc["prompts"] == 0 and doc["records"] == len(steps) == 2, doc
        assert errors == [f"error: interrupted; the report covers 0 finished prompt(s) and 2 measured step(s); "
                          f"--json {js} holds them (\"incomplete\": true)"]
    else:
        assert doc["incomplete"] is False and doc["prompts"] == 2 and doc["records"] == len(steps) > 2, doc
        assert errors == [f"error: interrupted; --json {js} holds the whole trace's summary "
                          "(tables and plot not drawn)"]


def test_a_refused_prompt_leaves_an_existing_jsonl_file_as_it_was(cli, llada_dir, tmp_path):
    """``--jsonl`` opens its file at the first record: a run refused on a prompt after the model loads
    (text spelling the mask token) leaves an existing file as it was; a run that traces replaces it."""
    out = tmp_path / "keep.jsonl"
    out.write_text("precious\n")
    res = cli("trace-drift", "--model", llada_dir, *SMALL, "--jsonl", out, "Sort: 3 1 <|mdm_mask|>")
    assert res.exit_code == 2 and "nothing decoded" in res.stderr, res.stderr
    assert out.read_text() == "precious\n"
    res = cli("trace-drift", "--model", llada_dir, *SMALL, "--jsonl", out, "Sort: 3 1")
    assert res.exit_code == 0, res.stderr
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()][:1] == [0]
