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
