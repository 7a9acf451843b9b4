"""Bad input ends as one ``error:`` line naming the value and the fix, never a traceback or a crash; tables
and help fit an 80-column terminal; two writers of one output file are refused.

One row per bad input. Most run in-process through CliRunner with a model folder that does not exist,
so they prove the error comes before anything loads; those that need a model use the random test
checkpoint (``llada_dir``), and a subprocess only where the process boundary is the point (another
process holding an output file, a closed stdout pipe).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from cli_helpers import no_model, one_line_error
from conftest import SMALL
from rich.text import Text
from typer.testing import CliRunner

from ecache_cli.cli import app
from ecache_cli.help import TOPICS

BIG = "99999999999999999999"  # > 2**64
COMMANDS = ["generate", "profile", "calibrate", "trace-drift"]


def _no_traceback(res):
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.stderr


# --- numeric options and policy parameters ------------------------------------------------------------------

@pytest.mark.parametrize("args, needles", [
    (["generate", "x", "--recent-k", BIG], [f"--recent-k {BIG}", "≤ 2147483647", "e.g. 64"]),
    (["generate", "x", "--gen-length", BIG], [f"--gen-length {BIG}", "≤ 2147483647"]),
    (["generate", "x", "--block-length", "0"], ["--block-length 0", "≥ 1"]),
    (["generate", "x", "--steps", "-4"], ["--steps -4", "≥ 1"]),
    (["generate", "x", "--top-k", BIG], [f"--top-k {BIG}", "≤ 2147483647"]),
    (["generate", "x", "--seed", "1" + BIG], [f"--seed 1{BIG}", "≤ 18446744073709551615"]),
    (["generate", "x", "--seed", "-1"], ["--seed -1", "≥ 0"]),
    (["generate", "x", "--batch-size", "-3"], ["--batch-size -3", "≥ 1"]),
    (["generate", "x", "--refresh-every", BIG, "--cache", "dual"], [f"--refresh-every {BIG}", "≤ 2147483647"]),
    (["generate", "x", "--tau", "inf"], ["--tau inf", "a finite number ≥ 0"]),
    (["generate", "x", "--factor", "abc"], ["--factor abc must be a finite number > 0 (e.g. 1.0)"]),
    (["generate", "x", "--watch-delay", "abc"], ["--watch-delay abc must be a finite number ≥ 0"]),
    (["generate", "x", "--watch-delay", "nan"], ["--watch-delay nan must be a finite number ≥ 0"]),
    (["trace-drift", "x", "--volatility-level", "abc"], ["--volatility-level abc must be a finite number > 0"]),
    (["calibrate", "--task", "list", "--max-drop", "abc"], ["--max-drop abc must be a finite number in [0, 100]"]),
    (["generate", "x", "--tau", "-0.5"], ["--tau -0.5", "≥ 0", "e.g. 0.5"]),
    (["generate", "x", "--top-p", "nan"], ["--top-p nan", "a finite number in (0, 1]"]),
    (["generate", "x", "--threshold", "0"], ["--threshold 0 ", "in (0, 1]", "e.g. 0.9"]),
    (["generate", "x", "--factor", "-inf"], ["--factor -inf", "a finite number > 0"]),
    (["generate", "x", "--temperature", "nan"], ["--temperature nan", "finite"]),
    (["generate", "x", "--alg-temp", "-1"], ["--alg-temp -1 ", "≥ 0"]),
    (["generate", "x", "--threads", "0"], ["--threads 0", "≥ 1", "$ECACHE_THREADS"]),
    (["profile", "x", "--warmup", "-1"], ["--warmup -1", "≥ 0"]),
    (["profile", "x", "--repeats", BIG], [f"--repeats {BIG}", "≤ 2147483647"]),
    (["profile", "x", "--trace-steps", "0"], ["--trace-steps 0", "≥ 1"]),
    (["profile", "--task", "list", "--limit", "0"], ["--limit 0", "≥ 1"]),
    (["profile", "--task", "list", "--shots", "-2"], ["--shots -2", "≥ 0"]),
    (["calibrate", "--task", "list", "--max-drop", "200"], ["--max-drop 200 ", "in [0, 100]"]),
    (["calibrate", "--task", "list", "--min-fidelity", "nan"], ["--min-fidelity nan", "finite"]),
    (["calibrate", "--task", "list", "--grid", "0"], ["--grid 0", "≥ 1"]),
    (["calibrate", "--task", "list", "--refine", BIG], [f"--refine {BIG}", "≤ 2147483647"]),
    (["calibrate", "--task", "list", "--taus", "0.5,nan"], ["--taus nan must be a finite number ≥ 0"]),
    (["trace-drift", "x", "--volatility-level", "inf"], ["--volatility-level inf", "finite"]),
    (["trace-drift", "x", "--rows", BIG], [f"--rows {BIG}", "≤ 2147483647"]),
    (["trace-drift", "--task", "arith", "--limit", "-1"], ["--limit -1", "≥ 1"]),
    # --policies variants: every policy's parameters, each checked against its declared range
    (["profile", "x", "--policies", f"none,entropy:recent_k={BIG}"], [f"recent_k={BIG}", "≤ 2147483647"]),
    (["profile", "x", "--policies", "entropy:tau=nan"], ["tau=nan", "a finite number ≥ 0"]),
    (["profile", "x", "--policies", "elastic:gamma=1.5"], ["elastic parameter gamma=1.5", "in [0, 1]", "cosine"]),
    (["profile", "x", "--policies", "elastic:gamma=-0.1"], ["gamma=-0.1", "in [0, 1]"]),
    (["profile", "x", "--policies", "elastic:window=-1"], ["window=-1", "≥ 0"]),
    (["profile", "x", "--policies", "dllm-cache:rho=1.5"], ["rho=1.5", "in [0, 1]"]),
    (["profile", "x", "--policies", "dllm-cache:kp=0"], ["kp=0", "≥ 1"]),
    (["profile", "x", "--policies", f"dllm-cache:kr={BIG}"], [f"kr={BIG}", "≤ 2147483647"]),
    (["profile", "x", "--policies", "dllm-cache:tol=inf"], ["tol=inf", "finite"]),
    (["profile", "x", "--policies", "d2cache:sigma=0"], ["sigma=0", "in (0, 65536]"]),
    (["profile", "x", "--policies", "d2cache:rollout_p=2"], ["rollout_p=2", "in [0, 1]"]),
    (["profile", "x", "--policies", "d2cache:current_k=0"], ["current_k=0", "≥ 1"]),
    (["profile", "x", "--policies", "dkv:refresh_every=0"], ["dkv parameter refresh_every=0", "≥ 1"]),
    (["profile", "x", "--policies", "dual:refresh_every=-1"], ["refresh_every=-1", "≥ 0"]),
])
def test_out_of_range_values_are_one_line_usage_errors(cli, tmp_path, args, needles):
    res = cli(*args, "--model", no_model(tmp_path), "--no-chat", "-q")
    _no_traceback(res)
    one_line_error(res, 2, *needles)


def test_every_policy_parameter_and_decode_setting_has_a_declared_range():
    """A numeric field added to a policy or to DecodeConfig must get a range in its class's ``ranges``."""
    import typing

    from ecache_cli.cache import POLICIES
    from ecache_cli.config import Range, field_types
    from ecache_cli.decoding.config import DecodeConfig

    for cls in [DecodeConfig, *POLICIES.values()]:
        for name, kind in field_types(cls).items():
            base = kind
            if typing.get_origin(kind) is typing.Annotated:
                base, *meta = typing.get_args(kind)
                assert any(isinstance(m, Range) for m in meta)
                continue
            numeric = {int, float} & set(typing.get_args(base) or (base,))
            assert not numeric, f"{cls.__name__}.{name} has no declared range (its class's ranges)"


# --- profile files ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content, needles", [
    (b"cache:\n  tau: 0.5\xff\n", ["not UTF-8 text", "0xff", "line 2", "save the file as UTF-8"]),
    (b"cache:\n  tau: 0.5\n  tau: 0.7\n", ["key 'tau' given twice", "lines 2 and 3", "keep one"]),
    (b"cache: {tau: 0.5, tau: 0.7}\n", ["key 'tau' given twice"]),
    (b"", ["the profile is empty", "decode: and cache:"]),
    (b"# only a comment\n", ["the profile is empty"]),
    (b"note: hello\n", ["holds no settings", "decode: and cache:"]),
    (b"cache: {policy: entropy, gamma: 0.5}\n", ["unknown key cache.gamma of policy entropy", "allowed:", "tau"]),
    (b"cache: {gamma: 0.5}\n", ["cache.gamma of policy entropy (cache.policy unset: entropy)"]),
    (b"cache: {policy: elastic, tau: 0.5}\n", ["unknown key cache.tau of policy elastic", "gamma"]),
    (b"cache: {policy: entropy, foo: 1}\n", ["unknown key cache.foo", "allowed:"]),
    (b"cache: {policy: nosuch}\n", ["cache.policy 'nosuch' is not a cache policy", "entropy"]),
    (b"cache: {policy: elastic, gamma: 2}\n", ["cache.gamma: 2", "in [0, 1]"]),
    (b"cache: {policy: entropy, recent_k: " + BIG.encode() + b"}\n", ["cache.recent_k", "≤ 2147483647"]),
    (b"decode: {gen_length: -5}\n", ["decode.gen_length: -5", "≥ 1"]),
    (b"decode: {top_p: .nan}\n", ["decode.top_p: .nan", "a finite number in (0, 1]"]),
    (b"cache: [1, 2]\n", ["'cache' must be a mapping"]),
    (b"cache: {tau: [0.5\n", ["not valid YAML"]),
    (b"cache:\n  policy: entropy\n  policy: dual\n", ["not valid YAML (key 'policy' given twice (lines 2 and 3); "
                                                      "keep one)"]),
    (b"cache: [a, b\ndecode: {x: 1}\n", ["not valid YAML (while parsing a flow sequence: expected ',' or ']'",
                                         "(line 2, column 7))"]),
])
def test_bad_profile_file_is_one_line(cli, tmp_path, content, needles):
    prof = tmp_path / "p.yaml"
    prof.write_bytes(content)
    res = cli("generate", "x", "--profile", prof, "--model", no_model(tmp_path), *SMALL)
    _no_traceback(res)
    one_line_error(res, 2, str(prof), *needles)
    assert "<unicode string>" not in res.stderr and " ^" not in res.stderr  # words, never the parser's fragment


def test_profile_with_its_own_policy_keys_is_accepted(cli, llada_dir, tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text("cache: {policy: elastic, gamma: 0.8, window: 4}\ndecode: {gen_length: 16, block_length: 8}\n")
    res = cli("generate", "x", "--profile", prof, "--model", llada_dir, "--no-chat", "-q", "--jsonl")
    assert res.exit_code == 0, res.stderr
    settings = json.loads(res.stdout)["settings"]
    assert settings["cache"] == "elastic" and settings["cache_params"] == {"gamma": 0.8, "window": 4}


# --- input records, checkpoints ------------------------------------------------------------------------------

@pytest.mark.parametrize("messages, needles", [
    ([{"role": "robot", "content": "hi"}], ["messages[0] has role 'robot'", "system, user, assistant"]),
    ([{"role": "user", "content": "a"}, {"role": "User", "content": "b"}], ["messages[1] has role 'User'"]),
    ([{"role": "user", "content": 5}], ["messages[0] 'content' must be a string", "5"]),
])
def test_chat_messages_with_unknown_roles_are_rejected(cli, llada_dir, tmp_path, messages, needles):
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"messages": messages}) + "\n")
    res = cli("generate", "--input", f, "--model", llada_dir, *SMALL)
    _no_traceback(res)
    one_line_error(res, 2, f"{f}:1", *needles)  # checked before decoding: a usage error


def _edit_config(llada_dir: Path, tmp_path: Path, edit) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(llada_dir, ck)
    cfg = ck / "config.json"
    data = edit(json.loads(cfg.read_text()))
    cfg.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
    return ck


@pytest.mark.parametrize("edit, needles", [
    (lambda c: {**c, "mask_token_id": 10**6}, ["mask_token_id 1000000 (the mask token) is outside the vocabulary",
                                                "ids 0..", "fix config.json"]),
    (lambda c: {**c, "mask_token_id": -1}, ["mask_token_id -1", "outside the vocabulary"]),
    (lambda c: {k: v for k, v in c.items() if k != "mask_token_id"},  # absent: the family's default, said so
     ["mask_token_id 126336 (the mask token, the llada family's default: config.json has no mask_token_id) is "
      "outside the vocabulary"]),
    (lambda c: {**c, "eos_token_id": c.get("vocab_size", c.get("embedding_size"))}, ["eos_token_id", "outside"]),
    (lambda c: {**c, "d_model": "abc"}, ["'d_model' is 'abc'", "whole number"]),
    (lambda c: b'{"model_type": "llada", "d_model": 64\xff}', ["not UTF-8 text", "0xff"]),
    (lambda c: b"[1, 2]", ["holds a JSON array, not an object"]),
    (lambda c: b"{", ["not valid JSON"]),
])
def test_damaged_checkpoint_config_is_one_line(cli, llada_dir, tmp_path, edit, needles):
    ck = _edit_config(Path(llada_dir), tmp_path, edit)
    res = cli("generate", "x", "--model", ck, *SMALL)
    _no_traceback(res)
    one_line_error(res, 1, str(ck / "config.json"), *needles)


# --- threads, Ctrl-C --------------------------------------------------------------------------------------------

def test_threads_beyond_the_cores_are_clamped_with_one_warning(cli, llada_dir):
    import torch

    from ecache_cli.runtime import available_cpus

    before = torch.get_num_threads()
    try:
        res = cli("generate", "x", "--model", llada_dir, *SMALL, "--threads", BIG)
        assert res.exit_code == 0, res.stderr
        n = available_cpus()
        warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning: --threads")]
        assert warnings == [f"warning: --threads {BIG} is more than the {n} CPU core(s) this process may use; "
                            f"using {n}"]
        assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)


def test_ctrl_c_in_lm_eval_is_one_line_and_130(monkeypatch, capsys):
    import types

    from ecache_cli.evaluation import __main__ as entry

    def cli_evaluate():
        raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "lm_eval", types.ModuleType("lm_eval"))
    monkeypatch.setitem(sys.modules, "lm_eval.__main__", types.SimpleNamespace(cli_evaluate=cli_evaluate))
    monkeypatch.setitem(sys.modules, "ecache_cli.evaluation.lm_eval_adapter", types.ModuleType("adapter"))
    with pytest.raises(SystemExit) as exc:
        entry.main()
    assert exc.value.code == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["error: interrupted; the evaluation stopped before lm-eval wrote its results"]


# --- outputs: one writer per file, closed pipes -------------------------------------------------------------

HOLD = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)")


@pytest.mark.skipif(sys.platform == "win32", reason="advisory locks: fcntl")
@pytest.mark.parametrize("args, flag", [
    (["profile", "x", "--policies", "none", "--json"], "--json"),
    (["trace-drift", "x", "--jsonl"], "--jsonl"),
    (["calibrate", "--task", "list", "--run-file"], "--run-file"),
    (["generate", "x", "--output"], "--output"),
    (["trace-drift", "x", "--json"], "--json"),
    (["calibrate", "--task", "list", "--dry-run", "--json"], "--json"),
])
def test_a_second_writer_of_one_output_fails_at_once(cli, tmp_path, args, flag):
    out = tmp_path / "out.file"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.perf_counter()
        res = cli(*args, out, "--model", no_model(tmp_path), *SMALL)
        assert time.perf_counter() - t0 < 30  # refused at once, not after waiting
        line = one_line_error(res, 1, f"{flag} {out} is being written by another process", "choose another path")
        assert f"pid {holder.pid}" in line or "another ecache run" in line
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_ends_with_the_command_and_a_failed_run_leaves_no_empty_file(cli, tmp_path):
    out = tmp_path / "p.json"
    for _ in range(2):  # the second run is not refused by the first one's lock
        res = cli("profile", "x", "--policies", "none", "--json", out, "--model", no_model(tmp_path), *SMALL)
        assert res.exit_code == 1 and "being written" not in res.stderr, res.stderr
    assert not out.exists()  # created for the lock, removed because the run wrote nothing


@pytest.mark.parametrize("args", [
    ["trace-drift", "--jsonl", "-", "--rows", "0"],
    ["profile", "--policies", "none", "--json", "-", "--warmup", "0"],
])
def test_closed_stdout_exits_0(llada_dir, profiles_dir, args):
    prompts = [f"Sort: {i} 3 1" for i in range(40)]
    cmd = [sys.executable, "-m", "ecache_cli", *args, *prompts, "--model", str(llada_dir), *SMALL, "-b", "8"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "80"})
    p.stdout.read(10)
    p.stdout.close()  # like `| head -c 10`
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_help_into_a_closed_pipe_exits_0():
    p = subprocess.Popen([sys.executable, "-m", "ecache_cli", "profile", "-h"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "80"})
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0, err
    assert err == ""


# --- help: -h, the terminal's width, no cut option name, about 60 lines --------------------------------------

def _help(args, columns: int):
    res = CliRunner().invoke(app, args, env={"COLUMNS": str(columns)})
    assert res.exit_code == 0, res.output
    return res.stdout


def _help_lengths_said() -> tuple[int, int]:
    """README's longest help at 100 columns: (any command but serve, serve)."""
    text = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    m = re.search(r"at 100 columns at most (\d+) lines; `serve`, with the most options, (\d+)\)", text)
    return int(m.group(1)), int(m.group(2))


@pytest.mark.parametrize("columns", [80, 100])
@pytest.mark.parametrize("command", [None, *COMMANDS, "chat", "serve", "models", "help"])
def test_help_fits_the_terminal(command, columns):
    args = [] if command is None else [command]
    short, long = _help([*args, "-h"], columns), _help([*args, "--help"], columns)
    assert short == long
    lines = short.splitlines()
    assert "…" not in short
    assert max(len(ln) for ln in lines) <= columns, max(lines, key=len)
    group = typer.main.get_command(app)
    cmd = group if command is None else group.commands[command]
    ctx = typer.Context(cmd, info_name=command or "ecache")
    for p in cmd.get_params(ctx):  # every option name whole, on one line
        if p.param_type_name != "option" or p.hidden:
            continue
        for name in [*p.opts, *p.secondary_opts]:
            pair = p.secondary_opts and name in (p.opts[0], "--no-" + p.opts[0][2:])
            shown = f"--[no-]{p.opts[0][2:]}" if pair and p.secondary_opts[0] == "--no-" + p.opts[0][2:] else name
            assert any(shown in ln for ln in lines), (command, name)
    if columns == 100:  # README's numbers: about one screen, serve's options (server, admission, Ray) more
        most, serve = _help_lengths_said()
        assert len(lines) <= (serve if command == "serve" else most), (command, len(lines))


@pytest.mark.parametrize("columns", [60, 80])
@pytest.mark.parametrize("topic", [None, *TOPICS])
def test_help_topics_fit_the_terminal(topic, columns):
    """``ecache help [TOPIC]`` wraps to the width, its tables too, and keeps every word of the topic."""
    from rich.cells import cell_len

    text = _help(["help"] + ([topic] if topic else []), columns)
    assert len(text.splitlines()) > 3 and max(cell_len(ln) for ln in text.splitlines()) <= columns, text
    if topic is not None:
        source = Text.from_markup(TOPICS[topic][1]).plain
        assert text.split() == source.split()  # wrapped, nothing cut or added


def test_help_lists_topics_and_rejects_an_unknown_one(cli):
    res = cli("help")
    assert res.exit_code == 0 and all(t in res.stdout for t in ("decoding", "cache", "profiles", "input", "outputs"))
    assert cli("help", "generate").stdout == cli("generate", "-h").stdout
    one_line_error(cli("help", "nosuch"), 2, "'nosuch' is not a help topic", "decoding")


# --- tables at 80 columns --------------------------------------------------------------------------------------

def _render(renderable, width: int) -> str:
    from rich.console import Console

    con = Console(width=width, record=True, file=open(os.devnull, "w"))
    con.print(renderable)
    return con.export_text()


def _table_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln[:1] in "┏┃┡│└"]


def _profile_report(names):
    from ecache_cli.runs.profile import ProfileReport

    s = {"tokens_per_s": 12345.6, "speedup_vs_none": 12.34, "latency_speedup_vs_none": 11.1, "mean_ms": 123456,
         "p50_ms": 1234, "p95_ms": 12345, "nfe_per_request": 1024.0, "full_forwards_per_request": 256.0,
         "partial_forwards_per_request": 768.0, "work_share_vs_none": 0.123, "planned_work_share_vs_none": 0.1,
         "work_share_per_forward": 0.5, "decision_overhead_pct": 12.34, "peak_memory_bytes": 123 * 2**30,
         "fidelity_identical_share": 1.0, "fidelity_token_agreement": 0.999, "score": 0.875}
    return ProfileReport(policies=names, summaries={p: dict(s) for p in names}, runs={}, memory_kind="peak_rss",
                         decode=None)


def _policy_cells(text: str) -> list[list[str]]:
    """The policy column of a printed profile table: per row (a row starts where its tok/s cell is
    filled), the lines of its policy cell."""
    out = []
    for ln in text.splitlines():
        if ln.startswith("│"):
            cells = [c.strip() for c in ln.strip("│").split("│")]
            if cells[1]:
                out.append([])
            out[-1].append(cells[0])
    return out


def test_profile_table_fits_80_columns_and_wide_has_every_column():
    from ecache_cli.runs.profile import COLUMNS, render_table

    names = ["none", "dllm-cache", "entropy", "entropy:tau=2.5:recent_k=16", "entropy:tau=3:recent_k=16"]
    rep = _profile_report(names)
    text = _render(render_table(rep, "title"), 80)
    rows = _table_lines(text)
    assert "…" not in text and max(len(ln) for ln in rows) <= 80
    for needle in ("tok/s", "speedup", "NFE", "work %", "identical", "agree", "score", "12346", "12.34×", "0.875"):
        assert needle in text, needle
    # a policy spec breaks only between its parts (before ':' or '='), never inside a name or a value
    assert _policy_cells(text) == [["none"], ["dllm-cache"], ["entropy"], ["entropy", ":tau=2.5", ":recent_k=16"],
                                   ["entropy", ":tau=3", ":recent_k=16"]]
    assert "┃ work % ┃" in text  # the policy column narrows before a header wraps further
    assert [c[0] for c in _policy_cells(_render(render_table(rep, "title"), 120))] == names  # room: one line each
    wide = _render(render_table(rep, "title", wide=True), 240)
    assert "…" not in wide
    for header, *_ in COLUMNS:
        assert header.split("\n")[0] in wide, header
    assert "p95" not in text and "p95" in wide  # a wide-only column
    for width in (60, 80):  # every column at a terminal's width: tables of the same rows, stacked
        stacked = _render(render_table(rep, "title", wide=True), width)
        assert "…" not in stacked and max(len(ln) for ln in stacked.splitlines()) <= width, stacked
        for header, *_ in COLUMNS:
            assert header.split("\n")[0] in stacked, (width, header)
        assert stacked.count("dllm-cache") >= 2  # each part names the rows


def test_spec_lines_break_between_parts_then_before_values_then_between_words():
    from ecache_cli.runs.profile import spec_lines

    spec = "entropy:recent_steps=4:recent_k=0:block_refresh=true"
    assert spec_lines(spec, 80) == [spec]
    assert spec_lines(spec, 20) == ["entropy", ":recent_steps=4", ":recent_k=0", ":block_refresh=true"]
    assert spec_lines(spec, 11) == ["entropy", ":recent_", "steps=4", ":recent_k=0", ":block_", "refresh", "=true"]
    assert spec_lines("entropy:tau=2.5:recent_k=16", 16) == ["entropy:tau=2.5", ":recent_k=16"]
    assert spec_lines("dllm-cache", 7) == ["dllm-", "cache"] and spec_lines("dllm-cache", 10) == ["dllm-cache"]
    assert spec_lines("abcdefghijkl", 5) == ["abcdefghijkl"]  # no break left: the cell folds it


def test_sweep_table_fits_80_columns():
    from test_cli_errors import _point

    from ecache_cli.runs.calib_report import sweep_table

    base = _point(None, 1.0, 1.0, score=0.875, fidelity=1.0)
    pts = [_point(t, 12.34, 10.5, score=0.85, fidelity=0.95) for t in (0.00271, 1.5, 123.456)]
    for p in pts:
        p.delta_ci, p.lost, p.gained = (-0.0512, 0.0012), 3, 2
    outcome = SimpleNamespace(base=base, points=pts, frontier=pts[:1], choice=SimpleNamespace(point=pts[0]))
    text = _render(sweep_table(outcome, "task", 0.01, None), 80)
    assert "…" not in text and max(len(ln) for ln in _table_lines(text)) <= 80
    assert "12.34×" in text and "-2.5" in text and "★" in text
    wide = _render(sweep_table(outcome, "task", 0.01, None, wide=True), 240)
    assert "[-5.1, +0.1]" in wide and "lost/gained" in wide and "[-5.1" not in text
    for width in (60, 80):  # every column at a terminal's width: tables of the same rows, stacked
        stacked = _render(sweep_table(outcome, "task", 0.01, None, wide=True), width)
        assert "…" not in stacked and max(len(ln) for ln in stacked.splitlines()) <= width, stacked
        assert "[-5.1, +0.1]" in stacked and "lost/gained" in stacked and "12.34×" in stacked


def test_trace_drift_table_fits_80_columns():
    from rich.console import Console

    from ecache_cli.runs.drift_report import render_steps

    def rec(prompt, step, refresh):
        return {"prompt": prompt, "step": step, "block": step // 32, "refresh": refresh, "computed": 1536,
                "served": 0 if refresh else 1200, "signal": {"max-entropy": 12.345}, "drift_k": 1.234e-3,
                "drift_k_max": [9.9e-2, 1e-3], "drift_v": 2.3e-3, "drift_k_mean": [1e-3, 2e-3],
                "fidelity_mismatch": 12, "committed": 256, "forward_ms": 1234.5}

    records = [rec(p, s, s % 7 == 0) for p in (0, 12) for s in range(0, 1024, 37)]
    report = SimpleNamespace(records=records, signal="max-entropy")
    con = Console(width=80, record=True, file=open(os.devnull, "w"))
    render_steps(con, report, 0)
    text = con.export_text()
    table = [ln for ln in text.splitlines() if ln.strip() and ln.split()[0].isdigit()]
    assert table and "…" not in text and max(len(ln) for ln in table) <= 80
    assert "12/256" in text and "1234.5" in text


def test_profile_command_table_at_80_columns(cli, llada_dir):
    res = CliRunner().invoke(app, ["profile", "x", "--policies", "none,entropy,entropy:tau=2.5:recent_k=16",
                                   "--model", str(llada_dir), *SMALL, "--warmup", "0"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.stderr
    rows = _table_lines(res.stdout)
    assert rows and "…" not in res.stdout and max(len(ln) for ln in res.stdout.splitlines()) <= 80  # caption too
    cells = _policy_cells(res.stdout)
    assert ["".join(c) for c in cells] == ["none", "entropy", "entropy:tau=2.5:recent_k=16"]
    assert len(cells[2]) > 1 and all(line[:1] in ":=" for line in cells[2][1:])  # broken before ':' or '=' only


# --- the new-user trial's bad inputs: outputs onto inputs, closed streams, help, profile steps ---------------

def _digests(*folders: Path) -> dict:
    import hashlib

    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for d in folders for f in sorted(d.rglob("*"))
            if f.is_file()}


Q = '{"prompt": "Sort: 3 1 2"}\n{"prompt": "Sort: 2 1"}\n'
G = '{"question": "What is 2+3?", "answer": "#### 5"}\n{"question": "What is 4+4?", "answer": "#### 8"}\n'
CAL = ["calibrate", "--task", "list", "--limit", "2", "--taus", "0.1"]


@pytest.mark.parametrize("args, code, needles", [
    # an output that is an input file: refused before anything is opened for writing
    (["profile", "--policies", "none", "--input", "{q}", "--json", "{q}"], 2,
     ["--json {q}", "--input", "choose another path"]),
    (["trace-drift", "--input", "{q}", "--jsonl", "{q}"], 2, ["--jsonl {q}", "--input", "destroy the input"]),
    (["generate", "--input", "{q}", "--output", "{q}"], 2, ["--output {q}", "--input"]),
    (["calibrate", "--task", "gsm8k", "--data", "{g}", "--limit", "2", "--shots", "0", "--taus", "1", "--out",
      "{t}/g.yaml", "--json", "{g}"], 2, ["--json {g}", "--data", "choose another path"]),
    # two outputs of one command on one file
    ([*CAL, "--out", "{t}/x.yaml", "--json", "{t}/x.yaml"], 2, ["--json {t}/x.yaml", "--out", "another output"]),
    ([*CAL, "--out", "{t}/x.yaml", "--run-file", "{t}/x.yaml"], 2, ["--run-file {t}/x.yaml", "--out"]),
    (["trace-drift", "x", "--json", "{t}/same.json", "--jsonl", "{t}/same.json"], 2, ["{t}/same.json", "--jsonl"]),
    # a plot name that is not a PNG, checked up front (alone and beside clashing outputs)
    ([*CAL, "--out", "{t}/x.yaml", "--plot", "{t}/p.yaml"], 2, ["--plot {t}/p.yaml", ".png"]),
    ([*CAL, "--out", "{t}/x.yaml", "--json", "{t}/x.yaml", "--plot", "{t}/x.yaml"], 2, ["--plot", ".png"]),
    (["trace-drift", "x", "--plot", "-"], 2, ["--plot -: a plot is written to a file, not to stdout; give a .png file "
                                              "name (e.g. plot.png)"]),
    # a shipped profile is never rewritten
    ([*CAL, "--out", "{pkg}/tiny/list.yaml"], 2, ["--out {pkg}/tiny/list.yaml", "never rewrites", "write to"]),
    ([*CAL, "--out", "{pkg}/tiny/x.yaml", "--dry-run"], 2, ["--out {pkg}/tiny/x.yaml", "never rewrites"]),  # as the run
    # a policy parameter given twice
    (["profile", "x", "--policies", "entropy:tau=1:tau=2"], 2, ["entropy:tau=1:tau=2", "tau given twice"]),
    # a path that exists but is no profile file
    (["generate", "x", "--profile", "/dev/null"], 2, ["/dev/null", "not a regular file"]),
    # a setting from the shipped default profile is named as such
    (["generate", "x", "--model", "tiny", "--steps", "3"], 2, ["--steps 3", "from profile", "default.yaml",
                                                                "pass the flag to override"]),
])
def test_trial_bad_inputs_are_refused_before_anything_is_written(cli, tmp_path, args, code, needles):
    from ecache_cli.config import packaged_profiles_dir

    pkg = packaged_profiles_dir()
    (tmp_path / "q.jsonl").write_text(Q)
    (tmp_path / "g.jsonl").write_text(G)
    fill = {"q": tmp_path / "q.jsonl", "g": tmp_path / "g.jsonl", "t": tmp_path, "pkg": pkg}
    args = [a.format(**fill) for a in args]
    model = [] if "--model" in args else ["--model", no_model(tmp_path)]  # fails if anything loads
    before = _digests(tmp_path, pkg)
    sizes = [] if "--steps" in args else ["--gen-length", "16", "--block-length", "8"]  # --steps: the profile's
    res = cli(*args, *model, *sizes, "-q")
    _no_traceback(res)
    one_line_error(res, code, *[n.format(**fill) for n in needles])
    assert _digests(tmp_path, pkg) == before  # inputs and shipped profiles untouched, no output written


def _closed(fd: int, args: list, tmp_path) -> subprocess.CompletedProcess:
    """``ecache ARGS`` with file descriptor ``fd`` closed (``<&-`` for 0, ``>&-`` for 1); stderr captured."""
    return subprocess.run([sys.executable, "-m", "ecache_cli", *map(str, args)], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                          preexec_fn=lambda: os.close(fd), timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "80"})


@pytest.mark.parametrize("command", [["generate"], ["profile", "--policies", "none"]])
def test_closed_stdin_is_no_stdin(llada_dir, tmp_path, command):
    res = _closed(0, [*command, "--model", llada_dir, *SMALL], tmp_path)
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "error: no prompt given: pass it as an argument, pipe prompts on stdin (one per line) or use --input "
        "FILE.jsonl"], res.stderr


def test_closed_stdout_is_one_line_before_decoding(tmp_path):
    res = _closed(1, ["generate", "Sort: 1 2", "--model", no_model(tmp_path), *SMALL], tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines() == ["error: cannot write the output: stdout is closed; redirect it "
                                               "(> answers.txt) or use --output FILE"]


def test_ecache_alone_prints_the_usage_and_commands(cli):
    res = cli()
    assert res.exit_code == 2
    assert res.stdout.startswith("Usage: ") and all(c in res.stdout for c in (*COMMANDS, "serve", "help"))


def test_help_lists_one_topic_a_line(cli):
    lines = cli("help").stdout.splitlines()
    for topic in ("decoding", "cache", "profiles", "input", "outputs"):
        assert sum(ln.split()[:1] == [topic] for ln in lines) == 1, (topic, lines)


def test_steps_of_a_profile_follow_gen_length(cli):
    res = cli("generate", "Sort: 3 1 2", "--model", "tiny", "--gen-length", "32", "--block-length", "8", "--no-chat",
              "-q", "--jsonl", "--no-early-exit")
    assert res.exit_code == 0, res.stderr
    rec = json.loads(res.stdout.splitlines()[0])
    assert rec["settings"]["profile"].endswith("default.yaml")  # 256 tokens in 256 steps
    assert rec["settings"]["decode"]["steps"] == 32  # one token a step at the new length, not 256


def test_model_folder_without_tokenizer_files(cli, llada_dir, tmp_path):
    from ecache_cli.models.loader import TOKENIZER_FILES

    ck = tmp_path / "m_notok"
    shutil.copytree(llada_dir, ck)
    for name in TOKENIZER_FILES:
        (ck / name).unlink(missing_ok=True)
    res = cli("generate", "x", "--model", ck, *SMALL)
    _no_traceback(res)
    one_line_error(res, 1, str(ck), "no tokenizer files", "tokenizer.json", "copy the tokenizer files")
    (ck / "tokenizer_config.json").write_text((llada_dir / "tokenizer_config.json").read_text())  # a config alone
    res = cli("generate", "x", "--model", ck, *SMALL)
    one_line_error(res, 1, f"{ck}: cannot load the tokenizer", "it has no tokenizer.json: copy the checkpoint's")


def test_lm_eval_negative_whole_number_names_the_range(profiles_dir):
    pytest.importorskip("lm_eval")
    from ecache_cli.errors import UsageError
    from ecache_cli.evaluation.lm_eval_adapter import EcacheLM

    with pytest.raises(UsageError) as e:
        EcacheLM.create_from_arg_string("model=tiny,device=cpu,gen_length=-1")
    assert str(e.value).startswith("model_args: gen_length=-1 must be ≥ 1"), str(e.value)


def test_ctrl_c_after_the_search_keeps_the_json_and_says_what_was_written(cli, llada_dir, tmp_path, monkeypatch):
    from ecache_cli.runs import calib_report

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(calib_report, "sweep_table", interrupted)  # Ctrl-C while the tables print
    out, doc = tmp_path / "x.yaml", tmp_path / "j.json"
    res = cli(*CAL, "--model", llada_dir, *SMALL, "--out", out, "--json", doc)
    _no_traceback(res)
    assert res.exit_code == 130, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]  # (warnings on the random model)
    assert len(errors) == 1 and res.stderr.strip().splitlines()[-1] == errors[0], res.stderr
    line = errors[0]
    assert "interrupted after the search finished" in line and f"--json {doc}" in line, line
    assert json.loads(doc.read_text())["incomplete"] is False  # the search finished: the document is whole
    assert (f"profile {out}" in line) == out.exists()


@pytest.mark.parametrize("yaml_text, needles", [
    ("cache: {policy: entropy, signal: max-entropi}\n",
     ["'max-entropi' is not a signal", "signal max-entropi from profile"]),
    ("decode: {remasking: low_confidance}\n", ["'low_confidance'", "remasking low_confidance from profile"]),
])
def test_a_bad_value_from_a_profile_names_the_profile(cli, tmp_path, yaml_text, needles):
    prof = tmp_path / "v.yaml"
    prof.write_text(yaml_text)
    res = cli("generate", "x", "--profile", prof, "--model", no_model(tmp_path), "--gen-length", "16",
              "--block-length", "8", "-q")
    _no_traceback(res)
    one_line_error(res, 2, *needles, str(prof), "pass the flag to override")
    flag = cli("generate", "x", "--signal", "bogus", "--model", no_model(tmp_path), "-q")
    assert flag.exit_code == 2 and "from profile" not in flag.stderr  # the user's own flag is not blamed on it


@pytest.mark.parametrize("flag", ["--input", "--data"])
def test_a_file_that_opens_but_cannot_be_read_names_the_fix(cli, flag):
    """``/proc/self/mem`` opens but its first read fails (EIO): one line naming the flag, the error and what
    to pass instead, exit 1, before the model loads."""
    args = ["generate", "--input", "/proc/self/mem"] if flag == "--input" else \
        ["profile", "--task", "gsm8k", "--data", "/proc/self/mem"]
    res = cli(*args)
    assert res.exit_code == 1 and res.stdout == "", res.stderr
    assert res.stderr.strip() == (f"error: {flag} /proc/self/mem: cannot read (Input/output error); pass a file that "
                                  "can be read to its end"), res.stderr
