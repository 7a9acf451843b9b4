"""One contract for every subcommand: the same case gives the same outcome in generate, profile,
trace-drift and calibrate (README's exit codes: 0 done, 1 runtime, 2 usage, 0 on a closed stdout).

Each test runs every command that has the case through it and asserts one outcome, so a rule cannot
hold in one command and not in another. Cases: a closed stdout (``| head -1``), invalid ``--input``
records (every bad line named, exit 2, nothing decoded), records the model cannot take, an unreadable
input (exit 1), non-UTF-8 bytes on stdin (found before anything is decoded), ``-`` as stdin, ``-q``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import SMALL

#: Each subcommand with the flags of a short run whose results go to stdout.
COMMANDS = {
    "generate": ["generate", "--jsonl"],
    "profile": ["profile", "--policies", "none", "--warmup", "0", "--json", "-"],
    "trace-drift": ["trace-drift", "--rows", "0", "--json", "-"],
    "calibrate": ["calibrate", "--task", "list", "--limit", "2", "--dry-run", "--taus", "0.5", "--refine", "0",
                  "--no-speed-check"],
}
#: The commands that read prompts (arguments, stdin, --input).
PROMPTED = ["generate", "profile", "trace-drift"]


def _args(command: str, model, *extra) -> list[str]:
    return [*COMMANDS[command], "--model", str(model), *SMALL, *map(str, extra)]


def _popen(args: list[str], prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-m", "ecache_cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "80"})


@pytest.mark.parametrize("command", list(COMMANDS))
def test_closed_stdout_exits_0_quietly(command, llada_dir, profiles_dir):
    prompts = [] if command == "calibrate" else ["Sort: 3 1 2", "abc"]
    p = _popen([*_args(command, llada_dir), *prompts])
    p.stdout.close()  # like `| head -1`: the reader is gone before the first write
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "error:" not in err, err


BAD_RECORDS = ('{"prompt": "Sort: 3 1 2"}\nnot json\n{"question": "no prompt"}\n{"question": "no prompt"}\n'
               '\n{"prompt": "   "}\n')


@pytest.mark.parametrize("command", PROMPTED)
def test_invalid_records_name_every_line_exit_2(command, cli, llada_dir, tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_bytes(BAD_RECORDS.encode() + b"\xff\xfe\n")
    res = cli(*_args(command, llada_dir, "--input", f))
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    assert res.stdout == ""  # nothing decoded
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"error: --input {f}: 5 of 6 record(s) invalid, nothing decoded: ")
    assert f"{f}:2: not valid JSON" in line and f"{f} lines 3-4: a record needs a string 'prompt'" in line
    assert f"{f}:6: 'prompt' is empty" in line and f"{f}:7: not UTF-8 text" in line


@pytest.mark.parametrize("command", PROMPTED)
def test_records_the_model_cannot_take_are_named_before_decoding(command, cli, llada_dir, tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "Sort: 3 1 2"}\n{"prompt_ids": [99999999]}\n' + json.dumps({"prompt": "x " * 3000}) + "\n")
    res = cli(*_args(command, llada_dir, "--input", f))
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    assert res.stdout == ""
    (line,) = res.stderr.strip().splitlines()
    assert f"2 of 3 record(s) invalid, nothing decoded: {f}:2: prompt_ids[0] = 99999999 is outside" in line
    assert f"{f}:3: the prompt (6000 tokens) + --gen-length 16 exceeds the model's" in line


@pytest.mark.parametrize("command", PROMPTED)
def test_non_utf8_stdin_is_found_before_decoding(command, cli, llada_dir):
    res = cli(*_args(command, llada_dir), input=b"Sort: 3 1 2\n\xff\nabc\n\xfe\xfe\n")
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    assert res.stdout == ""  # the good first line was not decoded either
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: stdin: 2 of 4 line(s) invalid, nothing decoded: stdin lines 2, 4: not UTF-8 text")


@pytest.mark.parametrize("command", PROMPTED)
def test_dash_is_stdin(command, cli, llada_dir):
    good = cli(*_args(command, llada_dir, "--input", "-"), input='{"prompt": "Sort: 3 1 2"}\n')
    assert good.exit_code == 0, good.stderr
    out = [json.loads(line) for line in good.stdout.splitlines()]
    if command == "generate":
        assert [r["prompt"] for r in out] == ["Sort: 3 1 2"]
    else:
        assert len(out) == 1 and out[0]["manifest"]  # the summary document of one run
    bad = cli(*_args(command, llada_dir, "--input", "-"), input='{"prompt": "Sort: 3 1 2"}\n[1, 2]\n')
    assert bad.exit_code == 2 and "error: --input -: 1 of 2 record(s) invalid" in bad.stderr, bad.stderr
    assert "stdin:2: a record needs a string 'prompt'" in bad.stderr


def _unreadable_prefix() -> tuple[str, ...]:
    """Run as a process that cannot read a mode-000 file: root keeps its read override unless it is
    dropped (``setpriv``); another user cannot read it anyway."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv cannot make a file unreadable")
    return ("setpriv", "--bounding-set", "-dac_override,-dac_read_search")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_unreadable_input_exits_1(command, llada_dir, profiles_dir, tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "Sort: 3 1 2", "question": "q", "answer": "a"}\n')
    f.chmod(0)
    extra = ["--task", "gsm8k", "--data", f] if command == "calibrate" else ["--input", f]
    args = _args(command, llada_dir, *extra)
    if command == "calibrate":  # its --task is the data's
        i = args.index("--task")
        del args[i:i + 2]
    p = _popen(args, _unreadable_prefix())
    out, err = p.communicate(timeout=300)
    lines = err.decode().strip().splitlines()
    assert p.returncode == 1, err.decode()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(f) in lines[0], lines
    assert out == b""


@pytest.mark.parametrize("command", list(COMMANDS))
def test_quiet_and_the_first_stderr_line(command, cli, llada_dir):
    """Without -q the first stderr line is README's "using model …" (no warning before it); -q drops
    it and every progress line, in every command."""
    prompts = [] if command == "calibrate" else ["Sort: 3 1 2"]
    # a flag the policy does not use: its warning comes after the first line
    unused = {"generate": ["--cache", "none", "--tau", "0.5"], "profile": ["--tau", "0.5"],
              "trace-drift": ["--cache", "none", "--tau", "0.5"], "calibrate": ["--threads", "999"]}[command]
    loud = cli(*[a for a in _args(command, llada_dir) if a != "-q"], *unused, *prompts)
    assert loud.exit_code == 0, loud.stderr
    assert loud.stderr.splitlines()[0].startswith("using model "), loud.stderr
    assert any(line.startswith("warning: ") for line in loud.stderr.splitlines()), loud.stderr
    quiet = cli(*_args(command, llada_dir), *prompts)
    assert quiet.exit_code == 0, quiet.stderr
    assert "using model" not in quiet.stderr
    progress = ("warmup", "measure", "STAGE:", "none: score", "τ=", "generate:")
    assert not [line for line in quiet.stderr.splitlines() if line.startswith(progress)], quiet.stderr


def test_quiet_profile_traces_print_no_profiler_lines(llada_dir, profiles_dir, tmp_path):
    """torch.profiler's C++ start/stop lines (kineto, on file descriptor 2) stay off ``profile -q``."""
    p = _popen(["profile", "x", "--policies", "none", "--warmup", "0", "--model", str(llada_dir), *SMALL,
                "--trace-dir", str(tmp_path / "traces"), "--trace-steps", "2"])
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()
    assert "profiler_start" not in err.decode() and "profiler_stop" not in err.decode(), err.decode()
    assert (tmp_path / "traces" / "none.chrome_trace.json").exists()
