"""bench/serve_sim.py: one-line option errors, and a real pass of each admission mode that serves every request."""

from __future__ import annotations

import pytest
from cli_helpers import bench_usage_error, load_bench


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
