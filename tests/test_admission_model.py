"""bench/admission_model.py: the admission rules on a modelled engine (deterministic, no clock):
one-line option errors, and auto following the better mode on the two kinds of machine."""

from __future__ import annotations

import pytest
from cli_helpers import bench_usage_error, load_bench


@pytest.fixture(scope="module")
def model():
    return load_bench("admission_model")


@pytest.mark.parametrize("argv, words", [
    (["--sizes", "32,x"], "--sizes '32,x' is not a list of step counts; e.g. --sizes 32,64"),
    (["--sizes", "32,0"], "--sizes 32,0: every size must be ≥ 1 step"),
    (["--rate", "0"], "--rate 0 must be > 0"),
    (["--mixed", "0.9"], "--mixed 0.9 must be ≥ 1"),
    (["--n", "1"], "--n 1 must be ≥ 2"),
    (["--join", "-1"], "--join -1 must be ≥ 0 seconds"),
    (["--noise", "-0.1"], "--noise -0.1 must be ≥ 0 (the σ of a log-normal factor; 0 for none)"),
])
def test_bad_options_exit_2_with_one_line(model, capsys, argv, words):
    assert words in bench_usage_error(model.parse, argv, capsys)


def test_on_a_cpu_auto_batches_like_fcfs_and_lets_short_requests_past_long_ones(model):
    """The CPU's measured step costs (the defaults): one-block requests, auto as fcfs (joining
    mid-block would run the batch mixed); one- and two-block requests, the short ones' p95 below
    fcfs's, and no mode's p95 better than auto's by more than 2 %."""
    one = model.run(model.parse(["--sizes", "32", "--rate", "8", "--n", "300", "--seeds", "1"]))
    assert one["modes"]["auto"]["p95"] <= 1.02 * one["modes"]["fcfs"]["p95"]
    assert one["modes"]["always"]["p95"] > 1.2 * one["modes"]["fcfs"]["p95"]
    mixed = model.run(model.parse(["--sizes", "32,64", "--rate", "3", "--n", "300", "--seeds", "1"]))
    assert mixed["targets"]["auto_short_p95_over_fcfs"] < 0.95
    assert mixed["targets"]["auto_p95_over_best"] <= 1.02


def test_on_a_gpu_auto_joins_as_always_does(model):
    """A step's fixed 20 ms dominates its 0.2 ms a row: auto lets requests join as always does."""
    out = model.run(model.parse(["--sizes", "32", "--rate", "8", "--n", "300", "--seeds", "1", "--base", "0.02",
                                 "--row", "0.0002"]))
    assert out["modes"]["always"]["p95"] < 0.85 * out["modes"]["fcfs"]["p95"]
    assert out["modes"]["auto"]["p95"] <= 1.05 * out["modes"]["always"]["p95"]


def test_a_noisy_clock_keeps_auto_with_fcfs_on_a_cpu(model):
    """Each step's time times a log-normal factor (σ 0.5, a shared machine): the per-count means the
    fit keeps are noisy, and auto still batches as fcfs does, within 3 % of its p50 and p95; the noise is
    seeded, so a run repeats exactly."""
    argv = ["--sizes", "32", "--rate", "8", "--n", "300", "--seeds", "1", "--noise", "0.5"]
    out = model.run(model.parse(argv))
    assert out == model.run(model.parse(argv))
    quiet = model.run(model.parse(argv[:-2]))
    assert out["modes"]["fcfs"]["p95"] != quiet["modes"]["fcfs"]["p95"]  # the noise reached the clock
    assert out["targets"]["auto_p50_over_best"] <= 1.03 and out["targets"]["auto_p95_over_best"] <= 1.03
