"""bench/serve_sim.py: one-line option errors, a real pass of each admission mode that serves every request,
the random-checkpoint form that bench/gpu_check.sh step 8 runs, and the scheduler's CUDA step timing."""

from __future__ import annotations

import re
import shlex
import types

import pytest
import torch
from cli_helpers import REPO, bench_usage_error, load_bench


@pytest.fixture(scope="module")
def sim():
    return load_bench("serve_sim")


@pytest.mark.parametrize("argv, words", [
    (["--rates", "4,x"], "--rates '4,x' is not a list of numbers; give requests/s, e.g. --rates 4,8"),
    (["--rates", "4,0"], "--rates 4,0: every rate must be > 0 requests/s"),
    (["--n", "1"], "--n 1 must be ≥ 2"),
    (["--max-batch", "0"], "--max-batch 0 must be ≥ 1"),
    (["--shots", "-1"], "--shots -1 must be ≥ 0"),
    (["--policy", "fast"], "--policy 'fast' is not a cache policy; use one of none, "),
    (["--admission", "always,static"], "--admission 'static': use always, fcfs or auto (comma-separated)"),
    (["--rates", "0.5x,0x"], "--rates 0.5x,0x: every rate must be > 0 requests/s"),
    (["--size", "2b"], "--size '2b': use one of 1b, tiny"),
    (["--device", "gpu0"], "--device 'gpu0' is not a device; use auto, cpu, cuda or cuda:N"),
    (["--dtype", "float8"], "--dtype 'float8' is not known; use one of "),
])
def test_bad_options_exit_2_with_one_line(sim, capsys, argv, words):
    assert words in bench_usage_error(sim.parse, argv, capsys)


def test_each_mode_serves_every_request_and_counts_its_steps(sim):
    args = sim.parse(["--n", "4", "--rates", "50", "--shots", "0", "--max-tokens", "32", "--profile", "list",
                      "--domains", "list,arith"])
    lm, settings, prompts = sim.build(args)
    assert [d for d, _ in prompts[:4]] == ["list", "arith", "list", "arith"]  # interleaved
    for mode in ("always", "fcfs", "auto"):
        r = sim.one_pass(lm, settings, prompts, args, mode, 50.0, 0, 4)
        assert r["mode"] == mode and r["steps"] >= 1 and r["rows_per_step"] >= 1
        assert 0 < r["p50"] <= r["p95"] and r["throughput"] > 0
        assert set(r["p95_by_domain"]) == {"list", "arith"} and max(r["p95_by_domain"].values()) == r["p95"]
        assert r["cost"]["per_position"] > 0  # the model the scheduler fitted to its warm-up and steps
        # one 32-token block: at most 32 steps per request, however the requests overlap
        assert r["steps"] <= 4 * 32
        assert r["busy_s"] > 0 and r["ms_per_step"] == pytest.approx(1000 * r["busy_s"] / r["steps"])
        assert 0 <= r["joined_running"] <= 3  # the first request finds nothing running
        if mode == "fcfs":
            assert r["joined_running"] == 0  # static batches: no request joins running rows


def test_spread_is_each_modes_slowest_over_fastest_pass(sim):
    rows = [{"mode": "fcfs", "rate": 8.0, "p50": 0.2, "p95": 0.5},
            {"mode": "fcfs", "rate": 8.0, "p50": 0.3, "p95": 0.4},
            {"mode": "auto", "rate": 8.0, "p50": 0.25, "p95": 0.5},
            {"mode": "auto", "rate": 4.0, "p50": 9.0, "p95": 9.0}]
    spread = sim.spread_at(rows, 8.0)
    assert spread["fcfs"] == pytest.approx({"p50": 1.5, "p95": 1.25})
    assert spread["auto"] == {"p50": 1.0, "p95": 1.0}  # one pass at this rate


def test_rates_take_numbers_and_fractions_of_the_measured_capacity(sim):
    assert sim.parse(["--rates", "4,0.9x"]).rates == [(4.0, False), (0.9, True)]
    assert sim.parse([]).rates == [(4.0, False), (8.0, False)]  # the default run is unchanged


def test_gpu_check_step_8_options_parse(sim):
    """bench/gpu_check.sh step 8's serve_sim command, with the dry run's values, is one serve_sim accepts."""
    script = (REPO / "bench" / "gpu_check.sh").read_text().replace("\\\n", " ")
    cmd = re.search(r"bench/serve_sim\.py (.*?) 2>&1", script).group(1)
    cmd = re.sub(r'"\$\(\[.*?\)"', "1", cmd)  # --threads "$([ "$DEVICE" = cpu ] && echo 1 || echo 4)"
    cmd = cmd.replace('"$SIZE"', "tiny").replace('"$DEVICE"', "cpu").replace('"$DTYPE"', "float32")
    args = sim.parse(shlex.split(cmd))
    assert (args.size, args.device, args.dtype, args.threads) == ("tiny", "cpu", "float32", 1)
    assert args.admission == ["always", "fcfs", "auto"] and all(frac for _, frac in args.rates)


def test_random_checkpoint_serves_the_embedded_tokens_and_a_burst_is_one_batch(sim, tmp_path):
    from ecache_cli.models.loader import load_model

    args = sim.parse(["--size", "tiny", "--n", "4", "--max-batch", "4", "--shots", "0", "--max-tokens", "32"])
    lm, settings, prompts = sim.build(args, tmp_path)
    assert args.model == str(tmp_path / "llada-tiny-random")
    emb = load_model("tiny", device="cpu", dtype="float32")
    # gpu_speed.py's tiny shape has 128 rows; widened to the embedded model's, so its token ids fit
    assert (lm.spec.vocab_size, lm.spec.d_model) == (emb.spec.vocab_size, 64)
    text = prompts[0][1]
    assert lm.tokenizer.encode(text) == emb.tokenizer.encode(text)  # the embedded model's tokens
    assert settings.profile is None and settings.decode.gen_length == 32  # defaults: no profile of the embedded model
    r = sim.one_pass(lm, settings, prompts, args, "fcfs", 1.0, 0, 4, burst=True)
    # the 4 requests queued before the scheduler started run as one batch: a 32-token block's steps at
    # 4 rows (an answer that samples an end marker leaves earlier), never one row after another
    assert r["steps"] <= 33 and r["rows_per_step"] > 2 and r["throughput"] > 0


def test_continuous_over_static_is_the_ratio_of_the_median_p95s(sim):
    rows = [{"mode": m, "rate": 5.0, "p95": p} for m, p in
            [("always", 1.0), ("always", 3.0), ("fcfs", 4.0), ("fcfs", 6.0), ("auto", 9.0)]]
    assert sim.continuous_over_static(rows, 5.0) == {"always_p95_over_fcfs": 2.0 / 5.0, "met": True}
    rows[0]["p95"] = 5.0
    assert sim.continuous_over_static(rows, 5.0) == {"always_p95_over_fcfs": 4.0 / 5.0, "met": False}
    assert sim.continuous_over_static(rows, 6.0) == {}


def test_scheduler_waits_for_a_cuda_steps_kernels_before_timing_it(monkeypatch):
    """A CUDA step returns with its kernels queued: its time is read after a synchronize of its device."""
    from ecache_cli.serve import scheduler

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    scheduler._settle(types.SimpleNamespace(rows=types.SimpleNamespace(is_cuda=True, device="cuda:1")))
    assert calls == ["cuda:1"]
    scheduler._settle(types.SimpleNamespace(rows=torch.zeros(2)))  # CPU: nothing to wait for
    assert calls == ["cuda:1"]
