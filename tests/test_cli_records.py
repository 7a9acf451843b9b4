"""``ecache generate`` records that join back to their inputs, and batch-invariant sampling at the CLI."""

from __future__ import annotations

import json
import os
import threading

import pytest
from cli_helpers import records
from conftest import SMALL
from typer.testing import CliRunner

from ecache_cli.cli import app

PROMPTS = ["Sort: 9 3 7 1", "abc", "Reverse the list 4 5 6 7 8", "x=2; y=x*3", "Sort: 5 2"]


@pytest.fixture
def cli(profiles_dir):
    runner = CliRunner()

    def invoke(*args, input=None):
        res = runner.invoke(app, [str(a) for a in args], input=input)
        assert res.exit_code == 0, (res.exit_code, res.stdout, res.stderr)
        return res

    return invoke


@pytest.mark.parametrize("policy", ["none", "entropy", "dual", "d2cache", "dllm-cache", "elastic"])
def test_seed_gives_the_same_samples_at_every_batch_size(cli, llada_dir, policy):
    args = ["generate", *PROMPTS, "--model", llada_dir, *SMALL, "--temperature", "1", "--seed", "7", "--cache", policy,
            "--jsonl"]
    b1 = [(r["index"], r["token_ids"]) for r in records(cli(*args, "-b", "1"))]
    b4 = [(r["index"], r["token_ids"]) for r in records(cli(*args, "-b", "4"))]
    assert b1 == b4 and [i for i, _ in b1] == [0, 1, 2, 3, 4]
    other = [(r["index"], r["token_ids"])
             for r in records(cli(*args[:-3], "--seed", "8", "--cache", policy, "--jsonl"))]
    assert other != b1  # the seed is used


def test_stdin_records_carry_their_line_numbers(cli, llada_dir):
    stdin = "Sort: 9 3 7 1\n\n   \nabc\n\nx=2; y=x*3\n"
    recs = records(cli("generate", "--model", llada_dir, *SMALL, "--jsonl", "-b", "2", input=stdin))
    assert [(r["index"], r["line"], r["prompt"]) for r in recs] == [(0, 1, "Sort: 9 3 7 1"), (1, 4, "abc"),
                                                                     (2, 6, "x=2; y=x*3")]
    assert all(r["id"] is None and r["input"] == {} for r in recs)


def test_input_records_carry_id_line_and_user_fields(cli, llada_dir, tmp_path):
    f = tmp_path / "in.jsonl"
    lines = [{"id": "q-17", "prompt": "Sort: 9 3 7 1", "gold": "1 3 7 9", "meta": {"split": "dev"}},
             None,  # a blank line: skipped, still counted
             {"prompt": "abc", "text": "user field named like an output field"},
             {"id": 3, "prompt": "x=2; y=x*3"},
             {"id": "m", "messages": [{"role": "user", "content": "hi"}], "extra": 1}]
    f.write_text("".join("\n" if r is None else json.dumps(r) + "\n" for r in lines))
    recs = records(cli("generate", "--model", llada_dir, *SMALL, "--jsonl", "--input", f))
    assert [(r["index"], r["line"], r["id"]) for r in recs] == [(0, 1, "q-17"), (1, 3, None), (2, 4, 3), (3, 5, "m")]
    assert recs[3]["messages"] == [{"role": "user", "content": "hi"}] and recs[3]["input"] == {"extra": 1}
    assert "prompt" not in recs[3]
    assert recs[0]["input"] == {"gold": "1 3 7 9", "meta": {"split": "dev"}}
    assert recs[1]["input"] == {"text": "user field named like an output field"}
    assert isinstance(recs[1]["text"], str) and recs[1]["text"] != recs[1]["input"]["text"]  # no collision
    assert recs[2]["input"] == {} and recs[2]["prompt"] == "x=2; y=x*3"


def test_argument_records_number_the_arguments(cli, llada_dir):
    recs = records(cli("generate", "abc", "Sort: 5 2", "--model", llada_dir, *SMALL, "--jsonl"))
    assert [(r["index"], r["line"], r["prompt"], r["seed"]) for r in recs] == [(0, 1, "abc", 0), (1, 2, "Sort: 5 2", 0)]


def test_stream_shows_every_row_of_a_batch(profiles_dir, llada_dir):
    args = ["generate", "abc", "Sort: 5 2", "x=1", "--model", str(llada_dir), "--gen-length", "16", "--block-length",
            "8", "--no-chat", "-b", "3"]
    res = CliRunner().invoke(app, [*args, "--stream"])
    assert res.exit_code == 0, res.stderr
    for i in range(3):
        assert f"[{i}] step " in res.stderr, res.stderr
    assert res.stdout == CliRunner().invoke(app, [*args, "-q"]).stdout  # the results are unchanged


def test_input_dash_reads_jsonl_records_from_stdin(cli, llada_dir, tmp_path):
    lines = [{"id": "a", "prompt": "Sort: 9 3 7 1"}, {"prompt": "abc", "gold": 1}]
    stdin = "".join(json.dumps(r) + "\n" for r in lines)
    f = tmp_path / "in.jsonl"
    f.write_text(stdin)
    got = records(cli("generate", "--model", llada_dir, *SMALL, "--jsonl", "--input", "-", input=stdin))
    want = records(cli("generate", "--model", llada_dir, *SMALL, "--jsonl", "--input", f))
    assert [(r["id"], r["line"], r["input"], r["text"]) for r in got] == [(r["id"], r["line"], r["input"], r["text"])
                                                                          for r in want]
    assert [r["prompt"] for r in got] == ["Sort: 9 3 7 1", "abc"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_input_from_a_named_pipe_reads_its_records(cli, llada_dir, tmp_path):
    """``--input <(...)``, ``--input /dev/stdin`` and a FIFO are not regular files: read as a stream,
    with the records and answers of the same lines in a file."""
    lines = [{"id": "a", "prompt": "Sort: 9 3 7 1"}, {"prompt": "abc"}]
    text = "".join(json.dumps(r) + "\n" for r in lines)
    f = tmp_path / "in.jsonl"
    f.write_text(text)
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text(text), daemon=True)  # blocks until a reader opens it
    writer.start()
    try:
        got = records(cli("generate", "--model", llada_dir, *SMALL, "--jsonl", "--input", fifo))
    finally:
        writer.join(timeout=60)
    want = records(cli("generate", "--model", llada_dir, *SMALL, "--jsonl", "--input", f))
    assert [(r["id"], r["line"], r["text"]) for r in got] == [(r["id"], r["line"], r["text"]) for r in want]
    assert len(got) == 2


def test_bad_record_on_stdin_names_stdin_and_line(profiles_dir, llada_dir):
    res = CliRunner().invoke(app, ["generate", "--model", str(llada_dir), *SMALL, "--input", "-"],
                             input='{"prompt": "a"}\n{"prompt": "a", "messages": []}\n')
    assert res.exit_code == 2
    assert res.stderr.strip() == (
        "error: --input -: 1 of 2 record(s) invalid, nothing decoded: stdin:2: the record has "
        "'prompt' and 'messages'; give one of prompt, messages, prompt_ids; fix them, or pass "
        "--skip-invalid to decode the others (each invalid line gets an error record)")
    assert res.stdout == ""


def test_crlf_stdin_and_bom_input_files(cli, llada_dir, tmp_path):
    plain = records(cli("generate", "--model", llada_dir, *SMALL, "--jsonl", input="Sort: 9 3 7 1\nabc\n"))
    crlf = records(cli("generate", "--model", llada_dir, *SMALL, "--jsonl", input="Sort: 9 3 7 1\r\nabc\r\n"))
    assert [r["prompt"] for r in crlf] == ["Sort: 9 3 7 1", "abc"]
    assert [r["token_ids"] for r in crlf] == [r["token_ids"] for r in plain]
    bom_stdin = records(cli("generate", "--model", llada_dir, *SMALL, "--jsonl", input="\ufeffSort: 9 3 7 1\nabc\n"))
    assert [(r["prompt"], r["token_ids"]) for r in bom_stdin] == [(r["prompt"], r["token_ids"]) for r in plain]
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + '{"prompt": "Sort: 9 3 7 1"}\r\n{"prompt": "abc"}\r\n'.encode())
    bom = records(cli("generate", "--model", llada_dir, *SMALL, "--jsonl", "--input", f))
    assert [(r["prompt"], r["token_ids"]) for r in bom] == [(r["prompt"], r["token_ids"]) for r in plain]
