"""Profile arithmetic on synthetic step records and results (no model): ``ecache_cli.metrics``."""

from __future__ import annotations

import math

import pytest
import torch

from ecache_cli.metrics.fidelity import fidelity, pair_agreement
from ecache_cli.metrics.memory import MemoryProbe
from ecache_cli.metrics.throughput import (
    RowMeasure,
    RunMeasure,
    latency_ms,
    percentile,
    ratio,
    summarize,
    tokens_per_s,
)


def row(prompt, gen, latency, nfe=8, full=8, partial=0, computed=800, canvas=100, ids=(), answer=(), repeat=0):
    return RowMeasure(prompt=prompt, repeat=repeat, generated_tokens=gen, latency_s=latency, nfe=nfe,
                      full_forwards=full, partial_forwards=partial, tokens_computed=computed, canvas=canvas,
                      token_ids=list(ids), answer_ids=list(answer))


def run(policy, rows, wall, forward=0.0, decision=0.0, sampling=0.0, steps=8, peak=None):
    return RunMeasure(policy=policy, wall_s=wall, forward_s=forward, decision_s=decision, sampling_s=sampling,
                      steps=steps, rows=rows, peak_memory_bytes=peak)


def test_percentile_interpolates_like_numpy_linear():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 95) == pytest.approx(3.85)  # rank 0.95 * 3 = 2.85 -> 3 + 0.85 * (4 - 3)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 95) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_latency_ms_converts_seconds():
    lat = latency_ms([0.1, 0.2, 0.3, 0.4, 1.0])
    assert lat["mean_ms"] == pytest.approx(400.0)
    assert lat["p50_ms"] == pytest.approx(300.0)
    assert lat["p95_ms"] == pytest.approx(880.0)  # rank 3.8: 400 + 0.8 * 600


def test_tokens_per_s_counts_generated_tokens_only():
    # two requests with long canvases (prompt + gen = 1000 positions): only generated tokens count
    runs = [run("none", [row(0, 40, 1.0, canvas=1000)], wall=1.0),
            run("none", [row(1, 20, 2.0, canvas=1000)], wall=2.0)]
    s = summarize(runs)
    assert s["generated_tokens"] == 60
    assert s["tokens_per_s"] == pytest.approx(60 / 3.0)
    assert tokens_per_s(10, 0.0) == 0.0


def test_speedup_overhead_and_work_share():
    base = [run("none", [row(0, 32, 4.0, nfe=8, full=8, computed=800, canvas=100)], wall=4.0, forward=3.8,
                decision=0.004, sampling=0.1)]
    pol = [run("entropy", [row(0, 32, 1.0, nfe=8, full=1, partial=7, computed=100 + 7 * 20, canvas=100)], wall=1.0,
               forward=0.9, decision=0.005, sampling=0.05)]
    s = summarize(pol, base)
    assert s["speedup_vs_none"] == pytest.approx(4.0)  # 32 tok/s over 8 tok/s
    assert s["latency_speedup_vs_none"] == pytest.approx(4.0)
    assert s["decision_overhead_pct"] == pytest.approx(0.5)  # 0.005 s of 1 s
    assert s["forward_pct"] == pytest.approx(90.0) and s["sampling_pct"] == pytest.approx(5.0)
    assert s["other_pct"] == pytest.approx(100 - 90 - 5 - 0.5)
    assert s["work_share_vs_none"] == pytest.approx(240 / 800)
    assert s["work_share_per_forward"] == pytest.approx(240 / 800)
    assert (s["full_forwards_per_request"], s["partial_forwards_per_request"]) == (1, 7)
    # a policy with fewer forwards (parallel decoding): per-forward share differs from the share vs none
    fewer = [run("entropy", [row(0, 32, 0.5, nfe=4, full=1, partial=3, computed=100 + 3 * 20, canvas=100)], wall=0.5)]
    s2 = summarize(fewer, base)
    assert s2["work_share_vs_none"] == pytest.approx(160 / 800)
    assert s2["work_share_per_forward"] == pytest.approx(160 / 400)
    assert summarize(pol)["speedup_vs_none"] is None  # no baseline measured: no speedup
    assert ratio(1.0, 0.0) is None


def test_work_share_pairs_requests_with_the_baseline():
    base = [run("none", [row(0, 8, 1.0, nfe=10, computed=1000, canvas=100),
                         row(1, 8, 1.0, nfe=20, computed=4000, canvas=200)], wall=2.0)]
    pol = [run("dual", [row(1, 8, 1.0, nfe=20, computed=1000, canvas=200)], wall=1.0)]  # only prompt 1 measured
    assert summarize(pol, base)["work_share_vs_none"] == pytest.approx(1000 / 4000)


def test_peak_memory_and_score_aggregate():
    r0, r1 = row(0, 8, 1.0), row(1, 8, 1.0)
    r0.score, r1.score = 1.0, 0.0
    s = summarize([run("none", [r0], 1.0, peak=100), run("none", [r1], 1.0, peak=300)])
    assert s["peak_memory_bytes"] == 300
    assert s["score"] == pytest.approx(0.5)
    assert summarize([run("none", [row(0, 8, 1.0)], 1.0)])["score"] is None


def test_fidelity_identical_and_token_agreement_skip_filler():
    EOS = 1
    ref = [row(0, 3, 1.0, ids=[5, 6, EOS, EOS, EOS, EOS], answer=[5, 6]),
           row(1, 4, 1.0, ids=[7, 8, 9, EOS, EOS, EOS], answer=[7, 8, 9])]
    got = [row(0, 3, 1.0, ids=[5, 6, EOS, EOS, EOS, EOS], answer=[5, 6]),
           row(1, 3, 1.0, ids=[7, 4, EOS, EOS, EOS, EOS], answer=[7, 4])]
    assert pair_agreement(got[1], ref[1]) == (2, 4)  # positions 0..3 (ref's end marker): 7 and EOS match
    f = fidelity(got, ref)
    assert f["identical_share"] == pytest.approx(0.5)
    assert f["token_agreement"] == pytest.approx((3 + 2) / (3 + 4))  # filler after both ends is not counted
    assert f["pairs"] == 2
    assert fidelity(got, [])["identical_share"] is None


def test_memory_probe_reads_a_positive_peak_on_cpu():
    probe = MemoryProbe(torch.device("cpu"))
    probe.reset()
    x = torch.ones(4 * 2**20)  # 16 MiB, touched
    peak = probe.peak_bytes()
    assert probe.kind in ("peak_rss", "rss_after_run")
    assert peak is not None and peak > x.numel() * 4


def test_work_efficiency_is_speedup_times_planned_work_share():
    from ecache_cli.metrics.throughput import work_efficiency

    # a policy planning 10% of none's work and running 6x faster turns 60% of the skipped work into time
    assert work_efficiency({"speedup_vs_none": 6.0, "planned_work_share_vs_none": 0.1}) == pytest.approx(0.6)
    assert work_efficiency({"speedup_vs_none": None, "planned_work_share_vs_none": 0.1}) is None
