"""Where profiles are written and found: calibrate writes ./profiles of the current
directory; generate --task looks up --profile > ./profiles > the user's config folder > the package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import SMALL
from typer.testing import CliRunner

import ecache_cli
from ecache_cli.cli import app
from ecache_cli.config import (
    find_mode_profile,
    find_profile,
    mode_task,
    packaged_profiles_dir,
    profile_candidates,
    profile_dirs,
    profile_path,
    user_profiles_dir,
)

PACKAGE = Path(ecache_cli.__file__).resolve().parent


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A user with an empty working directory and config folder, no $ECACHE_PROFILES."""
    work, config = tmp_path / "work", tmp_path / "config"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("ECACHE_PROFILES", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    return work, config / "ecache" / "profiles"


def write(path: Path, tau: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"model": "x", "task": "list", "cache": {"policy": "entropy", "tau": tau}}))
    return path


def test_lookup_order_and_write_target(home):
    work, user = home
    assert profile_dirs() == [work / "profiles", user, PACKAGE / "profiles"]
    assert user_profiles_dir() == user and packaged_profiles_dir() == PACKAGE / "profiles"
    shipped = PACKAGE / "profiles" / "tiny" / "list.yaml"
    assert shipped.is_file() and find_profile("tiny", "list") == shipped  # the calibrated profile ships
    assert find_profile("tiny", "llada-tiny-nothing") is None
    mine = write(user / "tiny" / "list.yaml", 1.5)
    assert find_profile("tiny", "list") == mine
    here = write(work / "profiles" / "tiny" / "list.yaml", 2.5)
    assert find_profile("tiny", "list") == here
    assert profile_candidates("tiny", "list") == [here, mine, shipped]
    # calibrate writes into the current directory, never into the package
    assert profile_path("tiny", "list") == here and PACKAGE not in profile_path("tiny", "list").parents


def test_generate_task_takes_the_first_profile_found(home, llada_dir):
    work, user = home
    model = llada_dir.name  # profiles are filed under the checkpoint folder's name
    run = lambda *a: CliRunner().invoke(app, ["generate", "abc", "--model", str(llada_dir), *SMALL, "--jsonl", *a])  # noqa: E731
    write(user / model / "list.yaml", 1.5)
    res = run("--task", "list")
    assert res.exit_code == 0, res.stderr
    s = json.loads(res.stdout)["settings"]
    assert s["cache_params"]["tau"] == 1.5 and s["profile"] == str(user / model / "list.yaml")
    write(work / "profiles" / model / "list.yaml", 2.5)
    assert json.loads(run("--task", "list").stdout)["settings"]["cache_params"]["tau"] == 2.5
    explicit = write(work / "elsewhere.yaml", 0.5)
    assert json.loads(run("--profile", str(explicit)).stdout)["settings"]["cache_params"]["tau"] == 0.5
    assert json.loads(run("--profile", "list").stdout)["settings"]["cache_params"]["tau"] == 2.5  # NAME: same order


def test_parallel_decoding_takes_the_parallel_profile_first(home, llada_dir):
    work, user = home
    model = llada_dir.name
    run = lambda *a: json.loads(CliRunner().invoke(  # noqa: E731
        app, ["generate", "abc", "--model", str(llada_dir), *SMALL, "--jsonl", *a]).stdout)["settings"]
    write(user / model / "list.yaml", 1.5)
    write(user / model / "default.yaml", 0.7)
    assert run("--task", "list", "--threshold", "0.9")["cache_params"]["tau"] == 1.5  # no parallel one: the plain one
    write(user / model / "list-parallel.yaml", 3.5)
    write(user / model / "default-parallel.yaml", 2.7)
    for flag in (["--threshold", "0.9"], ["--factor", "1.0"]):
        s = run("--task", "list", *flag)
        assert s["cache_params"]["tau"] == 3.5 and s["profile"] == str(user / model / "list-parallel.yaml")
        assert run(*flag)["cache_params"]["tau"] == 2.7  # without --task: default-parallel
    assert run("--task", "list")["cache_params"]["tau"] == 1.5 and run()["cache_params"]["tau"] == 0.7
    assert find_mode_profile(model, "list", parallel=False) == user / model / "list.yaml"
    assert mode_task("default", True) == "default-parallel" and mode_task("list", False) == "list"


def test_task_without_any_profile_names_every_place_it_looked(home, llada_dir):
    work, user = home
    res = CliRunner().invoke(app, ["generate", "abc", "--model", str(llada_dir), *SMALL, "--task", "arith"])
    assert res.exit_code == 2
    line = res.stderr.strip()
    for d in (work / "profiles", user, PACKAGE / "profiles"):
        assert str(d / llada_dir.name / "arith.yaml") in line, line


def test_calibrate_writes_under_the_current_directory(home, llada_dir):
    work, user = home
    res = CliRunner().invoke(app, ["calibrate", "--model", str(llada_dir), "--task", "list", "--limit", "2", "--metric",
                                   "fidelity", "--max-drop", "100", "--grid", "2", "--refine", "0", "--no-speed-check",
                                   *SMALL])
    assert res.exit_code == 0, res.stderr
    prof = yaml.safe_load((work / "profiles" / llada_dir.name / "list.yaml").read_text())
    assert prof["model"] == llada_dir.name and prof["task"] == "list" and prof["cache"]["tau"] > 0
    assert (work / "profiles" / llada_dir.name / ".list.calib.jsonl").is_file()
    assert not user.exists()  # the user's folder is read, never written


def test_a_parallel_rule_flag_replaces_the_profiles_other_rule(home, llada_dir):
    """default-parallel profiles set ``threshold``; ``--factor`` must take its place, not clash with it."""
    work, user = home
    model = llada_dir.name
    run = lambda *a: CliRunner().invoke(app, ["generate", "abc", "--model", str(llada_dir), *SMALL, "--jsonl", *a])  # noqa: E731
    path = user / model / "default-parallel.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"model": model, "decode": {"threshold": 0.9}, "cache": {"policy": "none"}}))
    r = run("--factor", "1.0")
    assert r.exit_code == 0, r.stderr
    decode = json.loads(r.stdout)["settings"]["decode"]
    assert decode["factor"] == 1.0 and decode["threshold"] is None
    path.write_text(yaml.safe_dump({"model": model, "decode": {"factor": 1.0}, "cache": {"policy": "none"}}))
    decode = json.loads(run("--threshold", "0.8").stdout)["settings"]["decode"]
    assert decode["threshold"] == 0.8 and decode["factor"] is None
    assert json.loads(run("--factor", "2.0").stdout)["settings"]["decode"]["factor"] == 2.0
    # the profile chose `none`: a --tau it drops is blamed on the profile, with the flag that overrides it
    warned = run("--threshold", "0.8", "--tau", "0.5").stderr
    assert f"--tau is not used by --cache none (the policy of profile {path}; pass --cache to choose" in warned


def test_a_repo_id_finds_its_alias_s_shipped_profile(monkeypatch, tmp_path):
    """``--model apple/DiffuCoder-7B-Instruct`` reads the profiles ``diffucoder-7b`` ships, as the alias
    does (profiles are kept by alias folder name); a repo id the registry does not know keeps its base name."""
    from ecache_cli.config import canonical_model_name, find_mode_profile
    from ecache_cli.models.registry import ALIASES

    monkeypatch.setenv("ECACHE_PROFILES", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert ALIASES["diffucoder-7b"] == "apple/DiffuCoder-7B-Instruct"
    assert canonical_model_name("apple/DiffuCoder-7B-Instruct") == "diffucoder-7b"
    found = find_mode_profile(canonical_model_name("apple/DiffuCoder-7B-Instruct"), "default", False)
    assert found is not None and found == find_mode_profile("diffucoder-7b", "default", False)
    assert canonical_model_name("GSAI-ML/LLaDA-8B-Instruct") == "llada-8b"  # the first of its two aliases
    assert canonical_model_name("someone/Other-Model") == "Other-Model"
