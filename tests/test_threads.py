"""``--threads`` on every subcommand and ``ECACHE_THREADS``."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from ecache_cli.cli import app
from ecache_cli.runtime import DEFAULT_THREADS, resolve_threads

SMALL = ["--gen-length", "8", "--block-length", "8", "--no-chat", "-q"]


@pytest.fixture
def keep_threads(monkeypatch):
    """The CLI runs in this process: put torch's thread count back after each test. The machine is said
    to have 8 cores, so counts up to 8 are not clamped (runtime.available_cpus) on a smaller test machine."""
    import ecache_cli.runtime as runtime

    monkeypatch.setattr(runtime, "available_cpus", lambda: 8)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cmd", ["generate", "profile", "calibrate", "trace-drift"])
def test_every_subcommand_takes_threads(cmd):
    res = CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    assert "--threads" in res.stdout and "ECACHE_THREADS" in res.stdout


def test_threads_flag_and_env_set_torch_threads(profiles_dir, llada_dir, keep_threads):
    runner = CliRunner()
    res = runner.invoke(app, ["generate", "abc", "--model", str(llada_dir), *SMALL, "--threads", "2"])
    assert res.exit_code == 0, res.stderr
    assert torch.get_num_threads() == 2
    res = runner.invoke(app, ["generate", "abc", "--model", str(llada_dir), *SMALL], env={"ECACHE_THREADS": "3"})
    assert res.exit_code == 0, res.stderr
    assert torch.get_num_threads() == 3
    res = runner.invoke(app, ["generate", "abc", "--model", str(llada_dir), *SMALL, "--threads", "1"],
                        env={"ECACHE_THREADS": "3"})  # the flag wins over the environment
    assert res.exit_code == 0 and torch.get_num_threads() == 1


@pytest.mark.parametrize("value", ["0", "-1"])
def test_threads_below_one_is_a_usage_error(profiles_dir, llada_dir, keep_threads, value):
    res = CliRunner().invoke(app, ["generate", "abc", "--model", str(llada_dir), *SMALL, "--threads", value])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--threads {value} must be ≥ 1" in lines[0], res.stderr


def test_default_is_the_measured_count_for_the_embedded_model_only(keep_threads):
    assert DEFAULT_THREADS == 1
    assert resolve_threads(None, "tiny") == resolve_threads(None, "llada-tiny") == resolve_threads(None, None) == 1
    assert resolve_threads(None, "/some/checkpoint") is None  # torch's default for other models
    assert resolve_threads(4, "tiny") == 4 and resolve_threads(2, "/some/checkpoint") == 2
    assert resolve_threads(100_000, "tiny") == 8  # clamped to the cores (8 here)

