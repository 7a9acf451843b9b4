"""``--sandbox`` and the profile key ``sandbox`` on the commands that run model-written code."""

import json

import yaml
from conftest import SMALL

from ecache_cli.tasks import sandbox


def _profile(cli, llada_dir, *extra):
    return cli("profile", "--model", llada_dir, "--task", "code", "--limit", 2, "--policies", "none",
               "--allow-code-execution", *SMALL, *extra)


def test_profile_records_the_isolation_in_its_manifest(cli, llada_dir, profiles_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "_state", {"mode": "auto", "isolation": {}, "warned": True})
    expected = sandbox.check("auto")
    out = tmp_path / "p.json"
    res = _profile(cli, llada_dir, "--json", out, "--warmup", "2")
    assert res.exit_code == 0, res.stderr
    record = json.loads(out.read_text())["manifest"]["sandbox"]
    assert record["mode"] == "auto" and list(record["isolation"]) == [expected]
    # both examples scored once: not the check before, nor the warm-ups' answers (dropped, never run)
    assert record["isolation"][expected] == 2


def test_strict_without_kernel_isolation_fails_before_loading(cli, llada_dir, profiles_dir, monkeypatch):
    monkeypatch.setattr(sandbox, "_TRY_LAYERS", ("landlock",))  # as on a machine without namespaces and seccomp
    res = _profile(cli, llada_dir, "--sandbox", "strict")
    assert res.exit_code == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --sandbox strict: no kernel isolation"), res.stderr
    assert "namespaces (turned off)" in lines[0] and "seccomp (turned off)" in lines[0]


def test_profile_key_sets_the_mode_and_the_flag_overrides_it(cli, llada_dir, profiles_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "_TRY_LAYERS", ())  # a bare machine: only the guard
    monkeypatch.setitem(sandbox._state, "warned", False)
    prof = tmp_path / "strict.yaml"
    prof.write_text(yaml.safe_dump({"sandbox": "strict"}))
    res = _profile(cli, llada_dir, "--profile", prof)
    assert res.exit_code == 1 and "--sandbox strict: no kernel isolation" in res.stderr, res.stderr
    res = _profile(cli, llada_dir, "--profile", prof, "--sandbox", "auto")
    assert res.exit_code == 0, res.stderr
    assert res.stderr.count("warning: model-written code runs under the in-process guard only") == 1, res.stderr


def test_bad_modes_are_usage_errors(cli, llada_dir, profiles_dir, tmp_path):
    res = cli("calibrate", "--model", llada_dir, "--task", "code", "--limit", 2, "--allow-code-execution",
              "--sandbox", "off", *SMALL)
    says = "--sandbox 'off' is not a sandbox mode; use one of strict, auto, guard"
    assert res.exit_code == 2 and says in res.stderr, res.stderr
    prof = tmp_path / "bad.yaml"
    prof.write_text("sandbox: maybe\n")
    res = _profile(cli, llada_dir, "--profile", prof)
    assert res.exit_code == 2 and "sandbox: 'maybe' must be one of strict, auto, guard" in res.stderr, res.stderr


def test_sandbox_on_a_run_that_executes_no_code_is_warned_ignored(cli, llada_dir, profiles_dir):
    """``--sandbox`` isolates model-written code; a run that executes none (no code task, or one not scored
    without --allow-code-execution) gets one warning that it is ignored, as an unused cache flag does."""
    said = "warning: --sandbox guard is used only when model-written code runs (a code task scored with " \
           "--allow-code-execution); ignored"
    for args in (["Sort: 3 1"], ["--task", "code", "--limit", "1"]):
        res = cli("profile", "--model", llada_dir, "--policies", "none", "--sandbox", "guard", *SMALL, *args)
        assert res.exit_code == 0 and res.stderr.count(said) == 1, res.stderr
    res = _profile(cli, llada_dir, "--sandbox", "guard")  # code runs: no such warning
    assert res.exit_code == 0 and "is used only when" not in res.stderr, res.stderr
