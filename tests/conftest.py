"""Shared fixtures: tiny random checkpoints in the official on-disk formats, loaded once per session.

``llada_dir`` is a single-file LLaDA checkpoint (``model.safetensors``), ``dream_dir`` a sharded Dream
one (two ``model-0000k-of-00002.safetensors`` + index), both written by
``ecache_cli.models.synthetic.write_random_checkpoint`` (d_model 64, 2 layers, model vocab 128 > the
character tokenizer's ~100 ids). ``llada_lm`` / ``dream_lm`` are the loaded models (CPU, float32);
``moe_dir`` / ``moe_lm`` a LLaDA-MoE one;
``lm`` runs a test once per family. Loaded models are shared: wrap them, never modify their weights.

``scale=4`` makes the random models' token distributions peaked enough to be useful in tests: the
committed tokens vary and their entropies span ~0.05-2.7 nats (at the default 0.5 every masked position
predicts the same token at ~4.7 nats, so cached and uncached decoding could not disagree).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from ecache_cli.models.loader import load_model

# The test models are tiny: one thread is faster than two (no OpenMP hand-offs) and keeps the suite
# from stalling when the 2-core machine is shared.
torch.set_num_threads(1)
from ecache_cli.models.synthetic import write_random_checkpoint  # noqa: E402 (after the thread setting)

SYNTH_SCALE = 4.0

#: The tiny decode settings of the CLI tests: a 16-position canvas in blocks of 8, no chat template, quiet.
SMALL = ["--gen-length", "16", "--block-length", "8", "--no-chat", "-q"]
#: Prompts of different lengths, so a batch of them is left padded.
PROMPTS = ["Sort: 9 3 7 1", "abc", "Reverse the list 4 5 6 7 8", "x=2; y=x*3"]


def bidirectional_policies() -> list[str]:
    """The cache policies that apply to the bidirectional families (the embedded model's): every one but
    those made for block-causal attention (tests/test_block_diffusion.py covers those)."""
    from ecache_cli.cache import POLICIES

    return sorted(n for n, c in POLICIES.items() if c.attention != "block-causal")
REPO = Path(__file__).resolve().parents[1]
DEFAULT_RUN_SIZE = pytest.StashKey[object]()


# --- the suite never modifies the checkout: `git status` at the end equals the start


def _git_status() -> str | None:
    """``git status --porcelain`` of the checkout (every untracked file listed, so a file written into an
    untracked folder shows too), or None outside a git checkout / without git."""
    if not (REPO / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def pytest_sessionstart(session):
    """Snapshot the checkout's state (compared with, not required to be clean: a developer's
    uncommitted work is fine). ``ECACHE_GIT_CLEAN_CHECK=0`` turns the check off."""
    on = os.environ.get("ECACHE_GIT_CLEAN_CHECK", "1") != "0"
    session.config.stash["git_status_before"] = _git_status() if on else None


def pytest_collection_finish(session):
    """Record the size of this run when it is the whole default run (``pytest`` from the repository with
    no paths, keywords, marker expression or deselection of its own): the README's test-count check reads
    it instead of collecting the suite a second time."""
    cfg = session.config
    whole = (cfg.args_source == pytest.Config.ArgsSource.TESTPATHS and not cfg.option.keyword
             and cfg.option.markexpr == "not slow and not gpu"
             and not (getattr(cfg.option, "deselect", None) or getattr(cfg.option, "ignore", None)))
    cfg.stash[DEFAULT_RUN_SIZE] = len(session.items) if whole else None


@pytest.fixture
def default_run_size(request) -> int | None:
    """The number of tests in this run when it is the whole default run, else None."""
    return request.config.stash.get(DEFAULT_RUN_SIZE, None)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when the suite changed, added or removed files of the checkout (tests must write
    under tmp_path only)."""
    before = session.config.stash.get("git_status_before", None)
    if before is None:
        return
    after = _git_status()
    if after is None or after == before:
        return
    old, new = set(before.splitlines()), set(after.splitlines())
    changes = [f"now {line!r}" for line in sorted(new - old)] + [f"was {line!r}" for line in sorted(old - new)]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    msg = ("the test session changed the checkout (git status --porcelain, start vs end): " + "; ".join(changes)
           + ". Tests must write under tmp_path. (Another process editing the tree meanwhile? rerun, or set "
           "ECACHE_GIT_CLEAN_CHECK=0.)")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line("ERROR: " + msg, red=True, bold=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def llada_dir(tmp_path_factory):
    """Directory of a random LLaDA checkpoint, single ``model.safetensors``."""
    return write_random_checkpoint(tmp_path_factory.mktemp("llada") / "llada-rand", "llada", shards=1, seed=0,
                                   scale=SYNTH_SCALE)


@pytest.fixture(scope="session")
def dream_dir(tmp_path_factory):
    """Directory of a random Dream checkpoint, two shards + ``model.safetensors.index.json``."""
    return write_random_checkpoint(tmp_path_factory.mktemp("dream") / "dream-rand", "dream", shards=2, seed=0,
                                   scale=SYNTH_SCALE)


@pytest.fixture(scope="session")
def llada_lm(llada_dir):
    """The random LLaDA checkpoint loaded on CPU in float32 (a ``LoadedModel``)."""
    return load_model(llada_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def dream_lm(dream_dir):
    """The random Dream checkpoint loaded on CPU in float32 (a ``LoadedModel``)."""
    return load_model(dream_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    """Directory of a random LLaDA-MoE checkpoint (8 experts, top-2, grouped-query attention, QK-norm),
    single ``model.safetensors``."""
    return write_random_checkpoint(tmp_path_factory.mktemp("moe") / "llada-moe-rand", "llada-moe", shards=1,
                                   seed=0, scale=SYNTH_SCALE)


@pytest.fixture(scope="session")
def moe_lm(moe_dir):
    """The random LLaDA-MoE checkpoint loaded on CPU in float32."""
    return load_model(moe_dir, device="cpu", dtype="float32")


@pytest.fixture(params=["llada", "dream", "moe"])
def lm(request):
    """Each family's loaded random checkpoint in turn (test ids ``[llada]`` / ``[dream]`` / ``[moe]``)."""
    return request.getfixturevalue(f"{request.param}_lm")


@pytest.fixture
def profiles_dir(tmp_path, monkeypatch):
    """An empty profiles folder used through ``$ECACHE_PROFILES``, so the project's profiles never leak in."""
    d = tmp_path / "profiles"
    d.mkdir()
    monkeypatch.setenv("ECACHE_PROFILES", str(d))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # nor the user's own (platformdirs)
    return d


@pytest.fixture
def cli(profiles_dir):
    """Invoke ``ecache`` in-process with no project profiles: ``cli(*args, input=None)`` -> click's Result."""
    from typer.testing import CliRunner

    from ecache_cli.cli import app

    runner = CliRunner()

    def invoke(*args, input=None):
        return runner.invoke(app, [str(a) for a in args], input=input)

    return invoke
