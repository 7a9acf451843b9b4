"""Bad input, odd input and unwritable outputs end as one ``error:`` line (exit 2 usage, 1 data), nothing
is silently ignored, and ``--help`` tells the truth.

Most tests run in-process through CliRunner and fail before any decoding; a few use a subprocess where
the process boundary is the point (non-UTF-8 argv bytes, a closed stdout pipe, a full device).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from cli_helpers import CUT, no_model, one_line_error, table_rows, without_cut_warning
from conftest import SMALL
from typer.testing import CliRunner

from ecache_cli.cli import app

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = ROOT / "ecache_cli" / "data" / "tiny"


# --- item 1: tracebacks -> one-line errors -------------------------------------------------------------

@pytest.fixture(scope="module")
def weights():
    return (EMBEDDED / "model.safetensors").read_bytes()


@pytest.mark.parametrize("command", [["generate"], ["profile", "--policies", "none"], ["trace-drift"]])
@pytest.mark.parametrize("size", [0, 8, 100, 1_000_000, -1])  # -1: one byte short
def test_truncated_safetensors_is_one_line(cli, tmp_path, weights, size, command):
    ck = tmp_path / "ck"
    shutil.copytree(EMBEDDED, ck)
    n = len(weights) - 1 if size == -1 else size
    (ck / "model.safetensors").write_bytes(weights[:n])
    res = cli(command[0], "Sort: 3 1 2", *command[1:], "--model", ck, *SMALL)
    one_line_error(res, 1, str(ck / "model.safetensors"), f"{n:,} bytes", "truncated or corrupt", "download or copy")


def test_non_utf8_prompt_argument_in_process(cli, llada_dir):
    # what Python hands over for the argv byte 0xff: a lone surrogate
    res = cli("generate", "ok \udcff", "--model", llada_dir, *SMALL)
    one_line_error(res, 2, "prompt argument 1", "not UTF-8", "0xff")


def test_non_utf8_stdin_line_names_the_line(llada_dir):
    import io

    from ecache_cli.errors import UsageError
    from ecache_cli.runs.inputs import read_prompts

    # UTF-8 mode / a C locale give stdin bytes as surrogates (surrogateescape); an invalid line: exit 2
    with pytest.raises(UsageError, match=r"stdin:2: not UTF-8 text \(byte 0xfe at character 5\)"):
        list(read_prompts(None, None, io.StringIO("fine\nbad \udcfe\n")))


def test_non_utf8_stdin_bytes(cli, llada_dir):
    res = cli("generate", "--model", llada_dir, *SMALL, input=b"Sort: 3 1\n\xff\xfe\n")
    one_line_error(res, 2, "stdin:2: not UTF-8")
    assert res.stdout == ""  # all of stdin is checked before the first line is decoded


@pytest.mark.parametrize("spec, needle", [
    ("entropy:tau=x", "tau='x' must be a finite number ≥ 0 (an entropy in nats; e.g. 0.5)"),
    ("entropy:recent_k=abc", "recent_k='abc' must be a whole number"),
    ("elastic:gamma=abc", "gamma='abc' must be a finite number in [0, 1] (a cosine similarity; e.g. 0.9)"),
    ("entropy:block_refresh=maybe", "block_refresh='maybe' must be true or false"),
    ("entropy:tau", "write parameters as name:key=value (e.g. entropy:tau=2.5)"),  # every refusal: --policies 'spec':
])
def test_policy_variant_with_a_wrongly_typed_value(cli, llada_dir, spec, needle):
    res = cli("profile", "x", "--policies", f"none,{spec}", "--model", llada_dir, *SMALL)
    one_line_error(res, 2, f"--policies {spec!r}", needle)


@pytest.mark.parametrize("section, key, value, needle", [
    ("cache", "tau", "abc", "must be a finite number ≥ 0 (an entropy in nats; e.g. 0.5)"),
    ("cache", "kr", "abc", "must be a whole number"),
    ("decode", "gen_length", "abc", "must be a whole number"),
    ("decode", "temperature", "hot", "must be a finite number ≥ 0 (0 = greedy; e.g. 0.7)"),
])
def test_profile_yaml_with_a_wrongly_typed_value(cli, llada_dir, tmp_path, section, key, value, needle):
    prof = tmp_path / "bad.yaml"
    cache = {"policy": "dllm-cache"} if key == "kr" else {}
    doc = {"cache": cache, "decode": {}}
    doc[section][key] = value
    prof.write_text(yaml.safe_dump(doc))
    res = cli("generate", "x", "--profile", prof, "--model", llada_dir, *SMALL)
    one_line_error(res, 2, str(prof), f"{section}.{key}: {value!r}", needle)


def test_profile_yaml_reads_1e_3_as_a_number(cli, llada_dir, tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text("cache: {policy: entropy, tau: 1e-3}\n")  # YAML 1.1 reads this as the string '1e-3'
    res = cli("generate", "x", "--profile", prof, "--model", llada_dir, *SMALL, "--jsonl")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout.splitlines()[0])["settings"]["cache_params"]["tau"] == 0.001


@pytest.mark.parametrize("doc, message", [
    ('compile: "false"\ncache: {policy: entropy}\n', "compile: 'false' must be true or false, not a string; write it "
                                                       "without quotes (compile: false)"),
    ('cache: {policy: entropy, block_refresh: "True"}\n', "cache.block_refresh: 'True' must be true or false, not a "
                                                          "string; write it without quotes (block_refresh: true)"),
])
def test_a_quoted_true_or_false_in_a_profile_names_the_quotes(cli, llada_dir, tmp_path, doc, message):
    prof = tmp_path / "b.yaml"
    prof.write_text(doc)
    res = cli("generate", "x", "--profile", prof, "--model", llada_dir, *SMALL)
    assert res.exit_code == 2 and res.stderr.splitlines() == [f"error: {prof}: {message}"], res.stderr


@pytest.mark.parametrize("section, key, value, number", [
    ("cache", "tau", "0.5", "0.5"),
    ("cache", "recent_k", "8", "8"),
    ("cache", "tau", "1e-3", "0.001"),
    ("decode", "gen_length", "32", "32"),
    ("decode", "temperature", " 0.5", "0.5"),
])
def test_a_quoted_number_in_a_profile_is_refused_as_the_api_refuses_it(cli, llada_dir, tmp_path, section, key, value,
                                                                        number):
    """A number written as a quoted string is refused with the same words whatever its key's type (the
    Python API's and the server's: ``must be a number, not a string``), with the unquoted form as the fix."""
    prof = tmp_path / "q.yaml"
    prof.write_text(f"{section}: {{{key}: {value!r}}}\n")
    res = cli("generate", "x", "--profile", prof, "--model", llada_dir, *SMALL)
    assert res.exit_code == 2 and res.stderr.splitlines() == [
        f"error: {prof}: {section}.{key}: {value!r} must be a number, not a string; write it without quotes "
        f"({key}: {number})"], res.stderr


def test_output_json_that_is_a_folder_fails_before_loading(cli, tmp_path):
    # a missing model would fail at load: the output check comes first
    res = cli("trace-drift", "x", "--json", tmp_path, "--model", no_model(tmp_path), *SMALL)
    one_line_error(res, 2, f"--json {tmp_path} is a folder", "give a file name")


@pytest.mark.parametrize("command, flag", [
    (["trace-drift"], "--tensorboard"), (["profile", "--policies", "none"], "--trace-dir"),
    (["trace-drift"], "--jsonl"), (["profile", "--policies", "none"], "--json"),
    (["calibrate", "--task", "list"], "--out"), (["calibrate", "--task", "list"], "--run-file"),
])
def test_output_under_a_file_fails_before_loading(cli, tmp_path, command, flag):
    afile = tmp_path / "afile"
    afile.write_text("x")
    prompt = [] if command[0] == "calibrate" else ["x"]
    res = cli(command[0], *prompt, *command[1:], flag, afile / "out", "--model", no_model(tmp_path), *SMALL)
    one_line_error(res, 2, f"{flag} {afile / 'out'}", f"{afile} is a file, not a folder")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_output_in_an_unwritable_folder(cli, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        res = cli("trace-drift", "x", "--tensorboard", ro / "tb", "--model", no_model(tmp_path), *SMALL)
        one_line_error(res, 1, "--tensorboard", "cannot create folder")
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("command", [["profile", "x", "--policies", "none"], ["trace-drift", "x"],
                                     ["calibrate", "--task", "list"]])
def test_no_new_folder_at_the_filesystem_root(cli, tmp_path, command):
    target = Path("/ecache-test-no-such-folder/out.json")
    assert not target.parent.exists()
    res = cli(*command, "--json", target, "--model", no_model(tmp_path), *SMALL)
    one_line_error(res, 2, f"--json {target}", "filesystem root", "mkdir -p")
    assert not target.parent.exists()


@pytest.mark.parametrize("command, flag", [(["generate", "x"], "--output"),
                                           (["profile", "x", "--policies", "none"], "--json"),
                                           (["trace-drift", "x"], "--plot")])
def test_a_folder_path_under_a_new_root_folder_is_told_the_root_rule_not_a_file_there(cli, tmp_path, command, flag):
    """``--output /new/x/..`` names a folder; a file in it would be refused too (no new folder at the root),
    so the first error is that rule, not an example file there; under an existing folder the example is
    one the command takes."""
    res = cli(*command, flag, "/ecache-test-no-such-folder/x/..", "--model", no_model(tmp_path), *SMALL)
    one_line_error(res, 2, f"{flag} /ecache-test-no-such-folder/x/..", "filesystem root",
                   "mkdir -p /ecache-test-no-such-folder")
    folder = tmp_path / "new"
    res = cli(*command, flag, f"{folder}/x/..", "--model", no_model(tmp_path), *SMALL)
    line = one_line_error(res, 2, f"{flag} {folder}/x/.. is a folder; give a file name (e.g. {folder}/")
    example = re.search(r"\(e\.g\. (\S+)\)", line).group(1)
    res = cli(*command, flag, example, "--model", no_model(tmp_path), *SMALL)
    assert res.exit_code == 1 and "is a folder" not in res.stderr, res.stderr  # taken; the stand-in model fails


@pytest.mark.parametrize("command", [["profile", "x", "--policies", "none"], ["trace-drift", "x"]])
def test_missing_parent_folders_are_created_the_same_way(cli, llada_dir, tmp_path, command):
    target = tmp_path / "new" / "deeper" / "out.json"
    res = cli(*command, "--json", target, "--model", llada_dir, *SMALL)
    assert res.exit_code == 0, res.stderr
    assert f"note: created folder {target.parent} for --json" in res.stderr
    assert json.loads(target.read_text())["command"] == command[0]  # the document itself


@pytest.mark.parametrize("flag, name", [("--json", "runs_out/out.json"), ("--plot", "runs_out/drift.png")])
def test_a_relative_new_folder_is_created_not_taken_for_the_root(cli, llada_dir, tmp_path, monkeypatch, flag, name):
    """``--plot runs_out/drift.png`` (the README's examples) in a folder without ``runs_out``: the
    relative parent ``.`` has an empty anchor, which once read as the filesystem root."""
    monkeypatch.chdir(tmp_path)
    res = cli("trace-drift", "x", flag, name, "--model", llada_dir, *SMALL)
    assert res.exit_code == 0, res.stderr
    assert "note: created folder runs_out for " + flag in res.stderr
    assert (tmp_path / name).stat().st_size > 0


@pytest.mark.parametrize("args, needles", [
    (["generate", "x", "--gen-length", "abc"], ["--gen-length abc must be a whole number ≥ 1 (e.g. 256)"]),
    (["generate", "x", "--temperature=hot"], ["--temperature hot must be a finite number ≥ 0 (0 = greedy; e.g. 0.7)"]),
    (["profile", "x", "--warmup", "two"], ["--warmup two must be a whole number ≥ 0 (e.g. 1)"]),
    (["generate", "x", "--no-such-flag"], ["no such option", "--no-such-flag"]),
    (["no-such-command"], ["no such command", "'no-such-command'"]),
    (["generate", "x", "--cache"], ["'--cache' requires an argument", "ecache generate --help"]),
    (["calibrate"], ["missing option '--task'", "ecache calibrate --help"]),
])
def test_parser_usage_errors_are_one_line(cli, args, needles):
    res = cli(*args)
    one_line_error(res, 2, *needles)


@pytest.mark.parametrize("args, says", [
    (["profile", "x", "--cache", "bogus"], "no such option: --cache (Possible options: --policies); see `ecache "
                                           "profile --help`"),
    (["calibrate", "--cache", "bogus"], "no such option: --cache (Possible options: --taus); see `ecache calibrate "
                                        "--help`"),
    (["generate", "x", "--policies", "none"], "no such option: --policies (Possible options: --cache); see `ecache "
                                              "generate --help`"),
    (["chat", "--task", "list"], "no such option: --task; see `ecache chat --help`"),
    (["generate", "x", "--tempreature", "1"], "no such option: --tempreature (Possible options: --temperature); see "
                                              "`ecache generate --help`"),
])
def test_an_unknown_flag_suggests_the_flag_meant_or_none(cli, args, says):
    """A flag another command takes under another name suggests this command's (``profile --cache`` →
    ``--policies``); otherwise only a close spelling, and no flag merely sharing letters (``chat --task``)."""
    res = cli(*args, input="")
    assert res.exit_code == 2 and res.stderr.strip() == f"error: {says}", res.stderr


def _ecache(*args, **kw):
    """Run ``python -m ecache_cli`` (the installed script's code) in a subprocess, one thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **kw.pop("env", {})}
    return subprocess.run([sys.executable, "-m", "ecache_cli", *args], env=env, **kw)


def test_non_utf8_argv_bytes_subprocess(llada_dir, profiles_dir):
    res = _ecache(b"generate", b"Sort: 3 \xff 1", b"--model", str(llada_dir).encode(), *[a.encode() for a in SMALL],
                  capture_output=True)
    err = res.stderr.decode("utf-8", "replace")
    assert res.returncode == 2, err
    assert err.strip().splitlines() == [err.strip()]
    assert "prompt argument 1: not UTF-8 text (byte 0xff at character 9)" in err


def test_closed_stdout_pipe_ends_quietly(llada_dir, profiles_dir):
    prompts = [f"Sort: {i} 3 1" for i in range(120)]  # > 64 KiB of JSONL, more than a pipe holds
    p = subprocess.Popen([sys.executable, "-m", "ecache_cli", "generate", *prompts, "--model", str(llada_dir),
                          "--gen-length", "8", "--block-length", "8", "--no-chat", "-q", "--jsonl", "-b", "8"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    first = p.stdout.readline()
    p.stdout.close()  # like `| head -1`
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0, err
    assert json.loads(first)["index"] == 0
    assert err == ""  # no BrokenPipeError, no "Exception ignored"


def test_a_closed_stderr_pipe_does_not_cut_the_output_file_short(llada_dir, profiles_dir, tmp_path):
    """``generate --input in.jsonl --output out.jsonl 2>&1 | head -2``: the reader of stderr leaves after two
    lines, but the records go to a file, so the run goes on to write every one of them, quietly, exit 0
    (a closed stdout ends a run whose records it carries: the test above)."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Sort: {i % 9} 3 1"}) + "\n" for i in range(24)))
    p = subprocess.Popen([sys.executable, "-m", "ecache_cli", "generate", "--input", str(src), "--output", str(out),
                          "--model", str(llada_dir), "--gen-length", "8", "--block-length", "8", "--no-chat",
                          "-b", "2"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "ECACHE_PROGRESS_INTERVAL": "0"})
    first = p.stderr.readline()
    p.stderr.close()  # like `2>&1 | head -1`
    assert p.wait(timeout=120) == 0
    assert first.startswith(b"using model")
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [f"q{i}" for i in range(24)]


def test_help_topic_into_a_closed_pipe_ends_quietly():
    """``ecache help decoding | head -1``: the reader is gone before the text is written (exit 0, as generate)."""
    p = subprocess.Popen([sys.executable, "-m", "ecache_cli", "help", "decoding"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()  # closed before the interpreter has even started: the write meets a broken pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0 and err == "", err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_full_device_on_stdout_is_one_line(llada_dir, profiles_dir):
    with open("/dev/full", "w") as full:
        res = _ecache("generate", "Sort: 3 1", "--model", str(llada_dir), *SMALL, stdout=full, stderr=subprocess.PIPE)
    err = res.stderr.decode()
    assert res.returncode == 1, err
    assert err.strip().splitlines() == ["error: cannot write the output (No space left on device); free space on the "
                                        "device or write elsewhere"]


# --- item 2: nothing silently ignored or accepted ---------------------------------------------------------

@pytest.mark.parametrize("args, code, needles", [
    (["generate", "x", "--cache", "dual", "--refresh-every", "-1"], 2, ["--refresh-every -1", "must be ≥ 0"]),
    (["generate", "x", "--cache", "dkv", "--refresh-every", "0"], 2, ["--refresh-every 0 must be ≥ 1", "dkv"]),
    (["generate", "x", "--temperature", "inf"], 2, ["--temperature inf", "finite"]),
    (["generate", "x", "--tau", "nan"], 2, ["--tau nan", "a finite number ≥ 0", "e.g. 0.5"]),
    (["trace-drift", "x", "--volatility-level", "nan"], 2, ["--volatility-level nan", "> 0"]),
    (["trace-drift", "x", "--rows", "-1"], 2, ["--rows -1", "≥ 0"]),
    (["profile", "x", "--limit", "1", "--policies", "none"], 2, ["--limit 1 with prompt arguments"]),
    (["generate", "--task", "nosuch", "x"], 2, ["--task 'nosuch' is not a task", "arith"]),
    (["generate", "--task", "arith", "--profile", "p.yaml", "x"], 2, ["--task arith and --profile p.yaml"]),
])
def test_bad_values_fail_before_loading(cli, tmp_path, args, code, needles):
    res = cli(*args, "--model", no_model(tmp_path), *SMALL)
    one_line_error(res, code, *needles)


@pytest.mark.parametrize("command", [["generate"], ["profile", "--policies", "none"], ["trace-drift"]])
def test_input_file_together_with_prompt_arguments(cli, tmp_path, command):
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "a"}\n')
    res = cli(command[0], "x", *command[1:], "--input", f, "--model", no_model(tmp_path), *SMALL)
    one_line_error(res, 2, f"--input {f}", "prompt argument", "one way")


def test_task_without_a_profile(cli, profiles_dir, llada_dir):
    res = cli("generate", "--task", "arith", "x", "--model", llada_dir, *SMALL)
    one_line_error(res, 2, "--task arith: no calibrated profile", "arith.yaml", "ecache calibrate --task arith")


def test_task_the_model_was_not_trained_on_warns_and_uses_the_settings_without_it(cli, profiles_dir):
    res = cli("generate", "--task", "gsm8k", "x", *SMALL, "--jsonl")  # the embedded model: arith, code and list only
    assert res.exit_code == 0, res.stderr
    assert "warning: model tiny was trained only on arith, code, list, not gsm8k" in res.stderr
    # what the suggested model needs before the same command takes it: the download, then its profile
    assert ("`ecache models pull llada-8b`, then `ecache calibrate --model llada-8b --task gsm8k`"
            in res.stderr), res.stderr
    plain = cli("generate", "x", *SMALL, "--jsonl")
    assert json.loads(res.stdout)["settings"] == json.loads(plain.stdout)["settings"]


def test_skip_invalid_without_input_says_what_stdin_does(cli, llada_dir):
    res = cli("generate", "--skip-invalid", "x", "--model", llada_dir, *SMALL)
    line = one_line_error(res, 2, "--skip-invalid applies to --input records")
    assert "checked before any is decoded" in line and "one by one" not in line


def test_task_with_its_profile_uses_it(cli, profiles_dir, llada_dir):
    from ecache_cli.config import canonical_model_name

    d = profiles_dir / canonical_model_name(str(llada_dir))
    d.mkdir()
    (d / "arith.yaml").write_text("cache: {policy: entropy, tau: 0.25}\n")
    res = cli("generate", "--task", "arith", "x", "--model", llada_dir, *SMALL, "--jsonl")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["settings"]["cache_params"]["tau"] == 0.25


def test_flag_the_policy_does_not_use_warns_once(cli, llada_dir):
    res = cli("generate", "x", "--cache", "dual", "--tau", "3", "--model", llada_dir, *SMALL)
    plain = cli("generate", "x", "--cache", "dual", "--model", llada_dir, *SMALL)
    assert res.exit_code == 0 and plain.exit_code == 0, res.stderr
    assert CUT in res.stderr and CUT in plain.stderr  # the random checkpoint does not end this answer
    warned = without_cut_warning(res.stderr)
    assert warned.count("warning:") == 1
    assert "warning: --tau is not used by --cache dual" in warned and "ignored" in warned
    assert res.stdout == plain.stdout and without_cut_warning(plain.stderr) == ""


def test_profile_flag_no_policy_uses_warns(cli, llada_dir):
    res = cli("profile", "x", "--policies", "none,dual", "--recent-k", "4", "--model", llada_dir, *SMALL)
    assert res.exit_code == 0, res.stderr
    assert res.stderr.count("warning: --recent-k is used by none of --policies none,dual; ignored") == 1


@pytest.mark.parametrize("command", [["generate"], ["profile", "--policies", "none"], ["trace-drift"]])
def test_empty_input_file_names_the_file(cli, llada_dir, tmp_path, command):
    f = tmp_path / "empty.jsonl"
    f.write_text("\n\n")
    res = cli(*command, "--input", f, "--model", llada_dir, *SMALL)
    line = one_line_error(res, 2, f"--input {f}", "holds no record", "'prompt'")  # empty input: usage, as stdin's
    assert "stdin" not in line


def test_trace_drift_with_empty_stdin_is_an_error(cli, llada_dir):
    res = cli("trace-drift", "--model", llada_dir, *SMALL, input="")
    one_line_error(res, 2, "no prompt given: stdin was empty")


def _help(cli, *command) -> str:
    res = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "250"})
    assert res.exit_code == 0
    return res.stdout


#: Options whose value has no default worth a "[default: …]": off unless given, and the help says what they do.
NO_DEFAULT = {"data", "min_fidelity", "taus", "profile", "task", "input_file", "trace_dir", "json_out", "json_path",
              "jsonl", "tensorboard", "plot", "out"}


@pytest.mark.parametrize("command", ["generate", "profile", "calibrate", "trace-drift"])
def test_flags_show_no_value_and_every_option_a_default(cli, command):
    import typer

    text = _help(cli, command)
    assert "<bool>" not in text
    sub = typer.main.get_command(app).commands[command]
    ctx = typer.Context(sub, info_name=command)
    options = [p for p in sub.get_params(ctx) if p.param_type_name == "option" and p.name != "help" and not p.required
               and not (getattr(p, "is_flag", False) and not p.secondary_opts) and p.name not in NO_DEFAULT]
    for p in options:  # a value option or a --x/--no-x pair: its default is in its help line
        line = next(ln for ln in text.splitlines() if ln.startswith((f"  {p.opts[0]}", f"  --[no-]{p.opts[0][2:]}")))
        assert "[default:" in line, (command, p.opts, line)


def test_jsonl_true_is_a_prompt_not_a_value(cli, llada_dir):
    # --jsonl takes no value, and the help says so (no <bool>): `true` is a prompt
    res = cli("generate", "--jsonl", "true", "--model", llada_dir, *SMALL)
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["prompt"] == "true"
    assert "│ --jsonl  " in _help(cli, "generate") or "--jsonl   " in _help(cli, "generate")


def test_steps_and_refresh_every_help_explain_threshold_and_policies(cli):
    import typer

    helps = {p.name: p.help for p in typer.main.get_command(app).commands["generate"].params}
    assert "ecache help decoding" in helps["steps"] and "ecache help cache" in helps["refresh_every"]
    decoding = " ".join(cli("help", "decoding").stdout.split())
    assert "Under --threshold or --factor a block runs until it has no masks" in decoding
    assert "llada schedule --steps is then only checked" in decoding
    assert "dream schedule it sets the per-step quota" in decoding
    cache = " ".join(cli("help", "cache").stdout.split())
    for policy in ("prefix, dual:", "dkv:", "d2cache, elastic:", "under --threshold", "Not used by none, entropy"):
        assert policy in cache, policy


# --- item 7: smaller ---------------------------------------------------------------------------------------

def test_missing_model_hint_names_hf_download(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    res = cli("generate", "x", "--model", "llada-8b", *SMALL)
    line = one_line_error(res, 1, "hf download GSAI-ML/LLaDA-8B-Instruct", "HF_HUB_OFFLINE")
    assert "huggingface-cli" not in line


def test_model_name_that_is_also_a_local_folder_uses_the_folder(cli, llada_dir, tmp_path, monkeypatch):
    shutil.copytree(llada_dir, tmp_path / "llada-tiny")
    monkeypatch.chdir(tmp_path)
    res = cli("generate", "Sort: 3 1", "--model", "llada-tiny", *SMALL, "--cache", "none")
    direct = cli("generate", "Sort: 3 1", "--model", llada_dir, *SMALL, "--cache", "none")
    assert res.exit_code == 0 and direct.exit_code == 0, res.stderr
    assert f"note: --model llada-tiny: using the checkpoint folder {tmp_path / 'llada-tiny'}" in res.stderr
    assert res.stdout == direct.stdout  # the random checkpoint's text, not the embedded model's


def _point(tau, speedup, wall, score=None, fidelity=1.0):
    from ecache_cli.runs.tau_search import Point

    kw = dict(tau=tau, n=4, score=score, fidelity=fidelity, identical=fidelity, speedup=speedup, speedup_wall=wall,
              tokens_per_s=10.0, refresh_rate=0.5, nfe=16.0, cost=100.0, wall_s=1.0)
    import dataclasses

    names = {f.name for f in dataclasses.fields(Point)}
    return Point(**{k: v for k, v in kw.items() if k in names})


def test_calibrate_warns_when_wall_clock_disagrees_with_the_proxy():
    from ecache_cli.runs.calib_report import wall_warnings

    ok = SimpleNamespace(points=[_point(0.5, 2.0, 1.8), _point(1.0, 3.0, 2.5)])
    assert wall_warnings(ok) == []
    bad = SimpleNamespace(points=[_point(0.5, 2.0, 1.8), _point(1.0, 1.5, 6.0), _point(2.0, 3.0, 0.5)])
    (line,) = wall_warnings(bad)
    assert line.startswith("warning: the wall-clock speedup disagrees with the cost proxy")
    assert "τ 1 (6.00× wall vs 1.50× proxy)" in line and "τ 2 (0.50× wall vs 3.00× proxy)" in line
    assert "τ 0.5" not in line


def test_sweep_table_shows_fidelity_as_the_metric():
    from rich.console import Console

    from ecache_cli.runs.calib_report import sweep_table

    base = _point(None, 1.0, 1.0, score=None, fidelity=1.0)
    pts = [_point(0.5, 2.0, 1.9, score=None, fidelity=0.9)]
    outcome = SimpleNamespace(base=base, points=pts, frontier=[], choice=SimpleNamespace(point=None))
    con = Console(width=250, record=True, file=open(os.devnull, "w"))
    con.print(sweep_table(outcome, "fidelity", 0.01, None))
    text = con.export_text()
    header = next(ln for ln in text.splitlines() if "Δ pts" in ln)
    assert header.index("fidelity %") < header.index("Δ pts") < header.index("score %")
    cells = table_rows(text)["0.5"]
    assert cells[1] == "90.0" and cells[2] == "-10.0"  # fidelity and its change where the metric is shown


def test_commands_do_not_import_cli_and_register_in_one_place():
    for f in (ROOT / "ecache_cli" / "commands").glob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").endswith("cli"), (f.name, node.module)
            if isinstance(node, ast.Attribute) and node.attr == "command":
                assert not (isinstance(node.value, ast.Name) and node.value.id == "app"), f.name
    import typer

    names = {"generate", "chat", "profile", "calibrate", "trace-drift", "serve", "models", "help"}
    assert set(typer.main.get_command(app).commands) == names


# --- new-user trial: bad values and odd inputs ------------------------------------------------------------

@pytest.mark.parametrize("raise_, code, needles", [
    ("usage", 2, ["--cache 'foo' is not a cache policy"]),
    ("model", 1, ["/nonexistent"]),
])
def test_ecache_lm_eval_prints_ecache_errors_on_one_line(monkeypatch, capsys, raise_, code, needles):
    """``ecache-lm-eval``: an EcacheError raised inside lm-eval's CLI (here by the code paths the adapter
    calls for ``cache=foo`` and ``model=/nonexistent``) is one ``error:`` line and its exit code."""
    import types

    from ecache_cli.evaluation import __main__ as entry

    def cli_evaluate():
        if raise_ == "usage":
            from ecache_cli.runs.settings import resolve_settings

            resolve_settings("tiny", {}, {"policy": "foo"})
        from ecache_cli.models.loader import load_model

        load_model("/nonexistent", "cpu", "auto")

    monkeypatch.setitem(sys.modules, "lm_eval", types.ModuleType("lm_eval"))
    monkeypatch.setitem(sys.modules, "lm_eval.__main__", types.SimpleNamespace(cli_evaluate=cli_evaluate))
    monkeypatch.setitem(sys.modules, "ecache_cli.evaluation.lm_eval_adapter", types.ModuleType("adapter"))
    with pytest.raises(SystemExit) as exc:
        entry.main()
    assert exc.value.code == code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize("record, needles", [
    ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, ["give one of prompt, messages, prompt_ids"]),
    ({"prompt": "a", "prompt_ids": [1, 2]}, ["give one of prompt, messages, prompt_ids"]),
    ({"messages": []}, ["'messages' is empty"]),
    ({"prompt": ""}, ["'prompt' is empty"]),
    ({"prompt": "  \t "}, ["'prompt' is empty"]),
])
def test_bad_input_record_names_file_and_line(cli, llada_dir, tmp_path, record, needles):
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "abc"}\n' + json.dumps(record) + "\n")
    res = cli("generate", "--input", f, "--model", llada_dir, *SMALL)
    one_line_error(res, 2, f"{f}:2: ", "nothing decoded", *needles)  # every record is checked before decoding


@pytest.mark.parametrize("prompt", ["", "   "])
@pytest.mark.parametrize("chat", ["--chat", "--no-chat"])
def test_empty_prompt_argument_is_a_usage_error(cli, llada_dir, prompt, chat):
    res = cli("generate", prompt, "--model", llada_dir, "--gen-length", "16", "--block-length", "8", "-q", chat)
    one_line_error(res, 2, "prompt argument 1", "a prompt is empty; give at least one token of text")


@pytest.mark.parametrize("flags, needle", [
    (["--top-k", "5"], "warning: --top-k does nothing at temperature 0"),
    (["--top-p", "0.9"], "warning: --top-p does nothing at temperature 0"),
    (["--top-k", "5", "--top-p", "0.9"], "warning: --top-k and --top-p do nothing at temperature 0"),
])
def test_sampling_flags_at_temperature_0_warn_once(cli, llada_dir, flags, needle):
    res = cli("generate", "x", *flags, "--model", llada_dir, *SMALL)
    assert res.exit_code == 0, res.stderr
    warned = without_cut_warning(res.stderr)
    assert warned.count("warning:") == 1 and needle in warned, res.stderr
    sampled = cli("generate", "x", *flags, "--temperature", "1", "--model", llada_dir, *SMALL)
    assert sampled.exit_code == 0 and "warning" not in without_cut_warning(sampled.stderr), sampled.stderr


def test_a_dream_model_keeps_top_p_at_temperature_0_without_a_warning(cli, dream_dir):
    """Dream's rules filter its confidence with --top-p even when greedy: the flag changes the tokens, so no
    "ignored" warning."""
    runs = [cli("generate", "x", *flags, "--remasking", "entropy", "--model", dream_dir, "--jsonl", *SMALL)
            for flags in ([], ["--top-p", "0.3"])]
    assert all(r.exit_code == 0 for r in runs), runs[1].stderr
    assert "warning" not in without_cut_warning(runs[1].stderr), runs[1].stderr
    import json

    assert json.loads(runs[0].stdout)["token_ids"] != json.loads(runs[1].stdout)["token_ids"]


@pytest.mark.parametrize("args, needles", [
    (["generate", "x", "--threshold", "1.5"], ["--threshold 1.5", "(0, 1]"]),
    (["generate", "x", "--tau", "-0.5"], ["--tau -0.5", "≥ 0", "nats"]),
    (["calibrate", "--task", "list", "--taus", "0.5,-1", "--dry-run"],
     ["--taus -1 must be ≥ 0 (an entropy in nats; e.g. 0.5)"]),
])
def test_out_of_range_threshold_and_tau(cli, tmp_path, args, needles):
    res = cli(*args, "--model", no_model(tmp_path), *SMALL)
    one_line_error(res, 2, *needles)


def test_threshold_1_is_accepted(cli, llada_dir):
    res = cli("generate", "x", "--threshold", "1", "--model", llada_dir, *SMALL)
    assert res.exit_code == 0, res.stderr


def test_profile_for_another_model_warns_naming_both(cli, llada_dir, tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text("model: llada-8b\ncache: {policy: entropy, tau: 0.5}\n")
    res = cli("generate", "x", "--profile", prof, "--model", llada_dir, *SMALL)
    assert res.exit_code == 0, res.stderr
    assert without_cut_warning(res.stderr).count("warning:") == 1, res.stderr
    assert "'llada-8b'" in res.stderr and repr(str(llada_dir)) in res.stderr
    same = tmp_path / "same.yaml"
    same.write_text(f"model: {Path(llada_dir).name}\ncache: {{policy: entropy, tau: 0.5}}\n")
    res = cli("generate", "x", "--profile", same, "--model", llada_dir, *SMALL)
    assert res.exit_code == 0 and "warning" not in without_cut_warning(res.stderr), res.stderr


def test_plot_folder_suggests_a_png_name(cli, tmp_path):
    res = cli("trace-drift", "x", "--plot", tmp_path, "--model", no_model(tmp_path), *SMALL)
    one_line_error(res, 2, f"--plot {tmp_path} is a folder", str(tmp_path / "plot.png"))


@pytest.mark.parametrize("command", [["generate"], ["profile", "--policies", "none"], ["trace-drift"]])
def test_input_folder_says_it_is_a_folder(cli, tmp_path, command):
    res = cli(*command, "--input", tmp_path, "--model", no_model(tmp_path), *SMALL)
    line = one_line_error(res, 1, f"--input {tmp_path} is a folder; give a JSONL file")
    assert "no such file" not in line


def test_profile_folder_lookup_lists_each_place_once(cli, tmp_path):
    res = cli("generate", "x", "--profile", tmp_path, "--model", no_model(tmp_path), *SMALL)
    line = one_line_error(res, 2, f"profile {str(tmp_path)!r} is a folder")
    places = line.split("looked at ")[1].split(")")[0].split(", ")
    assert len(places) == len(set(places)), places


def test_an_interrupt_after_the_command_ended_is_one_line_and_130(tmp_path):
    """Once the command has ended, while the interpreter shuts down (torch and its atexit callbacks take a
    few hundred ms), Ctrl-C or SIGTERM ends the process at once with one line, 130 or 143
    (``interrupts.at_shutdown``, which ``__main__`` installs last), not silently by the default action."""
    code = ("import os, signal, sys, time\n"
            "sys.argv = ['ecache', '--version']\n"
            "from ecache_cli import __main__ as m, interrupts\n"
            "try:\n    m._run()\nexcept SystemExit:\n    pass\n"
            "assert signal.getsignal(signal.SIGINT) is interrupts.at_shutdown\n"
            "os.kill(os.getpid(), signal.SIG{}); time.sleep(5)\n")
    for sig, status in (("INT", 130), ("TERM", 143)):
        p = subprocess.run([sys.executable, "-c", code.format(sig)], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert p.returncode == status and p.stderr == "error: interrupted\n", (sig, p.returncode, p.stderr)
        assert p.stdout.startswith("ecache ")


def test_interrupted_profile_does_not_claim_records_were_kept(cli, llada_dir, monkeypatch):
    import ecache_cli.runs.profile as prof

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(prof, "measure", interrupted)
    res = cli("profile", "x", "--policies", "none", "--model", llada_dir, *SMALL)
    line = one_line_error(res, 130, "interrupted before every policy finished a batch; the table and --json were "
                                    "not written")
    assert "kept" not in line


def test_quiet_stream_warns_that_stream_is_ignored(cli, llada_dir):
    res = cli("generate", "x", "--stream", "--model", llada_dir, *SMALL)  # SMALL has -q
    assert res.exit_code == 0, res.stderr
    warned = without_cut_warning(res.stderr)
    assert warned.count("warning:") == 1 and "warning: --stream is ignored under --quiet" in warned


def test_help_at_80_columns_shows_whole_option_names():
    res = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "80"})
    assert res.exit_code == 0
    assert "--[no-]low-eos-confidence " in res.stdout
    assert "…" not in res.stdout


def test_ecache_lm_eval_without_lm_eval_names_the_extra(monkeypatch, capsys):
    from ecache_cli.evaluation import __main__ as entry

    monkeypatch.setitem(sys.modules, "lm_eval.__main__", None)  # import raises ModuleNotFoundError
    with pytest.raises(SystemExit) as exc:
        entry.main()
    assert exc.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: lm-evaluation-harness is not installed") and "ecache[eval]" in lines[0]


def test_a_canvas_past_the_model_positions_says_how_far_to_cut(cli, llada_dir):
    """A gen-length no prompt fits beside is refused before the load with the longest that leaves room (a
    piped prompt is read after the settings); with that one, a prompt argument longer than the room left is
    refused before the load with how far to cut, and the cut one runs."""
    res = cli("generate", "--model", llada_dir, "--gen-length", "8192", "--block-length", "32", "--no-chat", "-q",
              input="abc\n")
    one_line_error(res, 2, "--gen-length 8192 leaves no room for a prompt in the model's", "use at most")
    most = int(res.stderr.split("at most ")[1].split()[0])
    prompt = " ".join(["abc"] * 64)  # more positions than the room the longest gen-length leaves (< a block)
    res = cli("generate", prompt, "--model", llada_dir, "--gen-length", str(most), "--block-length", "32",
              "--no-chat", "-q")
    one_line_error(res, 2, f"--gen-length {most} exceeds the model's", "lower --gen-length to at most")
    limit = int(res.stderr.split("at most ")[1].split()[0])
    ok = cli("generate", prompt, "--model", llada_dir, "--gen-length", str(limit), "--block-length", "32",
             "--steps", str(limit // 32), "--no-chat", "-q")
    assert ok.exit_code == 0, ok.stderr


# --- --schedule block and --compat fastdllm where they do nothing, or something -----------------------

BLOCK_IGNORED = ("warning: --schedule block does nothing at fixed steps on a model with LLaDA's schedule: its "
                 "blocks start fully masked, so block's counts (block-length / steps a step) are LLaDA's even "
                 "split; ignored")


@pytest.mark.parametrize("command", [["generate", "--jsonl"], ["profile", "--policies", "none", "--warmup", "0"],
                                     ["trace-drift", "--rows", "0"]])
def test_schedule_block_at_fixed_steps_on_llada_is_warned_as_ignored(cli, llada_dir, command):
    """A LLaDA block starts fully masked, so block's counts are LLaDA's split: one warning, every command."""
    res = cli(*command, "Sort: 3 1 2", "--model", llada_dir, "--schedule", "block", "--steps", "8",
              *[a for a in SMALL if a != "-q"])
    assert res.exit_code == 0, res.stderr
    assert [ln for ln in res.stderr.splitlines() if "--schedule" in ln] == [BLOCK_IGNORED], res.stderr


def test_schedule_block_on_llada_decodes_as_without_it(cli, llada_dir):
    runs = [cli("generate", "Sort: 3 1 2", "abc", "--model", llada_dir, "--jsonl", "--steps", "8",
                "--temperature", "0.7", *flags, *SMALL) for flags in ([], ["--schedule", "block"])]
    assert all(r.exit_code == 0 for r in runs), runs[1].stderr
    assert [json.loads(ln)["token_ids"] for ln in runs[0].stdout.splitlines()] == \
        [json.loads(ln)["token_ids"] for ln in runs[1].stdout.splitlines()]


@pytest.mark.parametrize("model, flags", [
    ("dream", ["--steps", "8"]),  # Dream's timesteps replaced by the even split: it counts
    ("llada", ["--threshold", "0.9", "--steps", "4"]),  # block's per-step minimum: it counts
])
def test_schedule_block_that_counts_is_not_warned(cli, llada_dir, dream_dir, model, flags):
    path = llada_dir if model == "llada" else dream_dir
    res = cli("generate", "x", "--model", path, "--schedule", "block", *flags, *SMALL)
    assert res.exit_code == 0, res.stderr
    assert "--schedule" not in res.stderr, res.stderr


def test_the_python_api_warns_schedule_block_on_llada(llada_lm):
    from ecache_cli.cache import make_policy
    from ecache_cli.engine import DecodeConfig, Engine
    from ecache_cli.errors import IgnoredSetting

    with pytest.warns(IgnoredSetting, match=re.escape(BLOCK_IGNORED.removeprefix("warning: "))):
        Engine.from_loaded(llada_lm).start([[5, 6, 7]], DecodeConfig(gen_length=16, block_length=8, steps=8,
                                                                      schedule="block"), make_policy("none"))


@pytest.mark.parametrize("cache", ["none", "entropy"])
def test_compat_fastdllm_is_its_commit_rule_under_every_cache(cli, dream_dir, cache):
    """``--compat fastdllm`` is a commit rule, not a cache: with ``--cache none`` or ``entropy`` it changes
    the tokens (no "ignored" warning), and under ``none`` it equals prefix refreshed every step (exact
    forwards), so ``--cache prefix`` differs only by its cache (README "Samplers")."""
    def run(*flags):
        res = cli("generate", "Sort: 3 1 2", "--model", dream_dir, "--jsonl", "--steps", "8", "--remasking",
                  "entropy", *flags, *SMALL)
        assert res.exit_code == 0 and "warning" not in without_cut_warning(res.stderr), res.stderr
        return json.loads(res.stdout)["token_ids"]

    compat = run("--cache", cache, "--compat", "fastdllm")
    assert compat != run("--cache", cache)
    if cache == "none":
        assert compat == run("--cache", "prefix", "--refresh-every", "1", "--compat", "fastdllm")
