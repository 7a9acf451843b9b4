"""``ecache generate`` over long inputs: records checked before decoding (``--skip-invalid``),
``--output`` / ``--resume``, ``--print0``, progress with rate and ETA, and Ctrl-C in ``profile`` and
``calibrate`` keeping what finished."""

from __future__ import annotations

import io
import json

import pytest
from cli_helpers import one_line_error, records

from ecache_cli.models.synthetic import write_random_checkpoint

SMALL = ["--gen-length", "16", "--block-length", "8", "--no-chat"]
PROMPTS = ["Sort: 9 3 7 1", "abc", "Reverse 4 5 6", "x=2; y=x*3", "Sort: 5 2"]


def write_jsonl(path, lines) -> None:
    """``lines``: dicts (one JSON record each) or raw strings (written as they are)."""
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))


def answers(recs) -> list[tuple]:
    """What decoding decides, without the timings."""
    return [(r["index"], r["line"], r.get("text"), r.get("token_ids"), r.get("mean_entropy"), r.get("error"))
            for r in recs]


@pytest.fixture(scope="module")
def short_dir(tmp_path_factory):
    """A random LLaDA checkpoint with 32 positions: with --gen-length 16 a prompt may take 16 tokens."""
    d = write_random_checkpoint(tmp_path_factory.mktemp("short") / "short", "llada", scale=4.0)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_sequence_length": 32}))
    return d


def test_invalid_records_are_all_named_before_anything_is_decoded(cli, short_dir, tmp_path):
    f = tmp_path / "in.jsonl"
    write_jsonl(f, [{"prompt": "abc"}, {"prompt": "x" * 40}, '{"prompt": ', {"question": "q"}, {"prompt": "ok"}])
    out = tmp_path / "out.jsonl"
    res = cli("generate", "--model", short_dir, *SMALL, "-q", "--input", f, "--output", out)
    line = one_line_error(res, 2, "2 of 5 record(s) invalid, nothing decoded", f"{f}:3: not valid JSON",
                          f"{f}:4: a record needs", "--skip-invalid")
    assert f"{f}:1" not in line and f"{f}:2" not in line and f"{f}:5" not in line  # line 2: the model's check
    assert res.stdout == "" and (not out.exists() or out.read_text() == "")
    write_jsonl(f, [{"prompt": "abc"}, {"prompt": "x" * 40}, {"prompt": "ok"}])  # the reading's errors fixed
    res = cli("generate", "--model", short_dir, *SMALL, "-q", "--input", f, "--output", out)
    line = one_line_error(res, 2, "1 of 3 record(s) invalid, nothing decoded",
                          f"{f}:2: the prompt (", "+ --gen-length 16 exceeds the model's 32 positions",
                          "shorten it to at most 16 tokens", "--skip-invalid")
    assert res.stdout == "" and (not out.exists() or out.read_text() == "")


def test_skip_invalid_writes_an_error_record_per_bad_line_and_decodes_the_rest(cli, short_dir, tmp_path):
    f = tmp_path / "in.jsonl"
    write_jsonl(f, [{"prompt": "abc", "id": "a"}, {"prompt": "x" * 40, "id": "long"}, "", "not json",
                    {"prompt": "ok", "id": "b"}])
    res = cli("generate", "--model", short_dir, *SMALL, "--input", f, "--skip-invalid", "--jsonl", "-q")
    assert res.exit_code == 0, res.stderr
    recs = records(res)
    assert [(r["index"], r["line"], r["id"]) for r in recs] == [(0, 1, "a"), (1, 2, "long"), (2, 4, None), (3, 5, "b")]
    assert "exceeds the model's 32 positions" in recs[1]["error"] and "text" not in recs[1]
    assert recs[2]["error"].startswith(f"{f}:4: not valid JSON")
    assert "warning: 2 invalid record(s) skipped (line 2, 4)" in res.stderr
    # the valid records decode as they do alone
    clean = tmp_path / "clean.jsonl"
    write_jsonl(clean, [{"prompt": "abc", "id": "a"}, {"prompt": "ok", "id": "b"}])
    alone = records(cli("generate", "--model", short_dir, *SMALL, "--input", clean, "--jsonl", "-q"))
    assert [(r["text"], r["token_ids"]) for r in (recs[0], recs[3])] == [(r["text"], r["token_ids"]) for r in alone]
    # plain text keeps one answer per input record (an invalid one: empty), NUL-separated with --print0
    plain = cli("generate", "--model", short_dir, *SMALL, "--input", f, "--skip-invalid", "--print0", "-q")
    assert plain.stdout.split("\0") == [recs[0]["text"], "", "", recs[3]["text"], ""]


def test_print0_ends_each_answer_with_nul(cli, llada_dir):
    nl = cli("generate", *PROMPTS[:3], "--model", llada_dir, *SMALL, "-q", "--cache", "none")
    nul = cli("generate", *PROMPTS[:3], "--model", llada_dir, *SMALL, "-q", "--cache", "none", "--print0")
    assert nul.exit_code == 0, nul.stderr
    assert nul.stdout.count("\0") == 3 and nul.stdout.endswith("\0")
    assert nul.stdout.replace("\0", "\n") == nl.stdout
    one_line_error(cli("generate", "x", "--model", llada_dir, *SMALL, "--print0", "--jsonl"), 2, "--print0")


def test_output_writes_the_jsonl_records_and_refuses_to_overwrite(cli, llada_dir, tmp_path):
    out = tmp_path / "sub" / "out.jsonl"
    res = cli("generate", *PROMPTS, "--model", llada_dir, *SMALL, "-q", "--output", out, "-b", "2")
    assert res.exit_code == 0, res.stderr
    assert res.stdout == ""
    got = [json.loads(line) for line in out.read_text().splitlines()]
    want = records(cli("generate", *PROMPTS, "--model", llada_dir, *SMALL, "-q", "--jsonl", "-b", "2"))
    assert answers(got) == answers(want) and [r["index"] for r in got] == [0, 1, 2, 3, 4]
    loud = [a for a in SMALL if a != "-q"]  # the refusal comes alone, before the "using model …" line
    again = cli("generate", *PROMPTS, "--model", llada_dir, *loud, "--output", out)
    one_line_error(again, 2, f"--output {out} already exists", "--resume")
    one_line_error(cli("generate", "x", "--model", llada_dir, *SMALL, "--resume"), 2, "--resume", "--output")


@pytest.mark.parametrize("batch", ["1", "2"])
def test_resume_decodes_only_what_the_file_lacks_and_ends_with_the_full_file(cli, llada_dir, tmp_path, batch):
    f = tmp_path / "in.jsonl"
    write_jsonl(f, [{"prompt": p, "id": i} for i, p in enumerate(PROMPTS)])
    full = tmp_path / "full.jsonl"
    args = ["generate", "--model", llada_dir, *SMALL, "--input", f, "-b", batch, "--temperature", "1", "--seed", "3"]
    assert cli(*args, "-q", "--output", full).exit_code == 0
    want = [json.loads(line) for line in full.read_text().splitlines()]
    # a run killed while writing its third record: two whole lines and a torn one
    part = tmp_path / "part.jsonl"
    lines = full.read_text().splitlines(keepends=True)
    part.write_text(lines[0] + lines[1] + lines[2][: len(lines[2]) // 2])
    res = cli(*args, "--output", part, "--resume")
    assert res.exit_code == 0, res.stderr
    assert f"resuming {part}: 2 record(s) kept (a torn last line dropped), 3 to decode" in res.stderr
    assert res.stderr.splitlines()[-1] == f"wrote {part} (5 record(s))"  # the file's records, kept ones too
    got = [json.loads(line) for line in part.read_text().splitlines()]
    assert answers(got) == answers(want)
    assert [r["stats"] for r in got[:2]] == [r["stats"] for r in want[:2]]  # kept, not decoded again
    # a whole last record that lost only its newline (an editor's doing) is kept, not decoded again
    part.write_text("".join(lines[:3]) + lines[3].rstrip("\n"))  # the last one decodes alone, as before
    res = cli(*args, "--output", part, "--resume")
    assert res.exit_code == 0 and f"resuming {part}: 4 record(s) kept, 1 to decode" in res.stderr, res.stderr
    got = [json.loads(line) for line in part.read_text().splitlines()]
    assert answers(got) == answers(want) and [r["stats"] for r in got[:4]] == [r["stats"] for r in want[:4]]
    # nothing left: resuming again decodes nothing and leaves the file as it is
    before = part.read_bytes()
    res = cli(*args, "--output", part, "--resume")
    assert res.exit_code == 0 and "5 record(s) kept, 0 to decode" in res.stderr
    assert part.read_bytes() == before


def test_ctrl_c_with_output_names_resume_and_the_file_keeps_finished_records(cli, llada_dir, tmp_path, monkeypatch):
    from ecache_cli.runs import generate as gen

    real, calls = gen._Job._decode, {"n": 0}

    def decode(self, *a, **k):  # the third batch is interrupted
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(gen._Job, "_decode", decode)
    out = tmp_path / "out.jsonl"
    res = cli("generate", *PROMPTS, "--model", llada_dir, *SMALL, "-q", "--output", out)
    assert res.exit_code == 130
    assert f"error: interrupted; --output {out} keeps every record written so far" in res.stderr
    assert "--resume" in res.stderr
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1]
    calls["n"] = 2  # the first batch is interrupted: nothing was written, nothing to resume
    first = tmp_path / "first.jsonl"
    res = cli("generate", *PROMPTS, "--model", llada_dir, *SMALL, "-q", "--output", first)
    assert res.exit_code == 130
    assert res.stderr.strip() == (f"error: interrupted before the first record; --output {first} holds none; rerun "
                                  "the same command"), res.stderr
    assert not first.exists()  # the lock's empty file is removed


def test_resume_refuses_another_input_or_other_settings(cli, llada_dir, tmp_path):
    f = tmp_path / "in.jsonl"
    write_jsonl(f, [{"prompt": p} for p in PROMPTS[:3]])
    out = tmp_path / "out.jsonl"
    assert cli("generate", "--model", llada_dir, *SMALL, "-q", "--input", f, "--output", out).exit_code == 0
    before = out.read_bytes()
    other = cli("generate", "--model", llada_dir, *SMALL, "-q", "--input", f, "--output", out, "--resume",
                "--cache", "dual")
    one_line_error(other, 2, f"--output {out} was written with other settings", "settings.cache")
    g = tmp_path / "other.jsonl"
    write_jsonl(g, [{"prompt": "abc"}] + [{"prompt": p} for p in PROMPTS[1:3]])
    res = cli("generate", "--model", llada_dir, *SMALL, "-q", "--input", g, "--output", out, "--resume")
    one_line_error(res, 2, "does not match input line 1", "prompt differs", "another input")
    assert out.read_bytes() == before


def test_resume_decodes_a_line_fixed_since_and_keeps_input_order(cli, llada_dir, tmp_path):
    f = tmp_path / "in.jsonl"
    write_jsonl(f, [{"prompt": "abc"}, "{broken", {"prompt": "Sort: 5 2"}])
    out = tmp_path / "out.jsonl"
    assert cli("generate", "--model", llada_dir, *SMALL, "-q", "--input", f, "--output", out,
               "--skip-invalid").exit_code == 0
    assert "error" in json.loads(out.read_text().splitlines()[1])
    write_jsonl(f, [{"prompt": "abc"}, {"prompt": "x=1"}, {"prompt": "Sort: 5 2"}])
    res = cli("generate", "--model", llada_dir, *SMALL, "--input", f, "--output", out, "--resume")
    assert res.exit_code == 0 and "2 record(s) kept, 1 to decode" in res.stderr, res.stderr  # line 3 kept after the gap
    fixed = [json.loads(line) for line in out.read_text().splitlines()]
    want = records(cli("generate", "--model", llada_dir, *SMALL, "-q", "--input", f, "--jsonl"))
    assert answers(fixed) == answers(want)


def test_progress_lines_on_a_non_terminal_stderr(cli, llada_dir, monkeypatch):
    monkeypatch.setenv("ECACHE_PROGRESS_INTERVAL", "0")  # a line at every step and record
    res = cli("generate", *PROMPTS[:3], "--model", llada_dir, *SMALL, "--cache", "none")
    assert res.exit_code == 0, res.stderr
    lines = res.stderr.splitlines()
    assert lines[0].startswith("using model ")
    assert any(ln.startswith("generate: 1/3 records (33%), ") and "records/" in ln and ", ETA " in ln for ln in lines)
    assert any(ln.startswith("generate: 0/3 records (0%)") and "now prompts 1-1 · block 1/2 · step 1" in ln
               for ln in lines)
    quiet = cli("generate", *PROMPTS[:3], "--model", llada_dir, *SMALL, "--cache", "none", "-q")
    assert not any(ln.startswith("generate: ") for ln in quiet.stderr.splitlines())
    monkeypatch.setenv("ECACHE_PROGRESS_INTERVAL", "3600")  # the default steady interval: no line in a short run
    calm = cli("generate", *PROMPTS[:3], "--model", llada_dir, *SMALL, "--cache", "none")
    assert not any(ln.startswith("generate: ") for ln in calm.stderr.splitlines())


def test_a_bad_progress_interval_is_named_once(cli, llada_dir, monkeypatch):
    monkeypatch.setenv("ECACHE_PROGRESS_INTERVAL", "soon")
    res = cli("generate", *PROMPTS[:2], "--model", llada_dir, *SMALL, "--cache", "none")
    assert res.exit_code == 0, res.stderr
    warned = [ln for ln in res.stderr.splitlines() if "ECACHE_PROGRESS_INTERVAL='soon'" in ln]
    assert len(warned) == 1 and "not a number of seconds" in warned[0] and "30 s" in warned[0], res.stderr
    quiet = cli("generate", *PROMPTS[:2], "--model", llada_dir, *SMALL, "--cache", "none", "-q")
    assert "ECACHE_PROGRESS_INTERVAL" not in quiet.stderr


def test_progress_bar_on_a_terminal_shows_count_rate_and_eta(monkeypatch):
    from rich.console import Console

    from ecache_cli import terminal
    from ecache_cli.runs.gen_progress import Reporter, clock, rate_text

    monkeypatch.setattr(terminal, "MIN_INTERVAL", 0.0)  # every report redraws
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=160)
    with Reporter(con, 4, quiet=False) as rep:
        assert rep.mode == "bar"
        rep.step(0, 2, 0, 2, 0)
        rep.advance(2)
        shown = buf.getvalue()
    assert "generate 2/4" in shown and "records/" in shown and "ETA" in shown and "prompts 1-2" in shown
    assert Reporter(con, 4, quiet=True).mode == "off"
    assert rate_text(3, 60) == "3.0 records/min" and rate_text(5, 2) == "2.5 records/s"
    assert clock(3725) == "1:02:05" and clock(65) == "1:05"


def test_ctrl_c_in_profile_keeps_the_finished_batches(cli, llada_dir, tmp_path, monkeypatch):
    from ecache_cli.metrics import memory

    calls = {"n": 0}
    real = memory.MemoryProbe.peak_bytes

    def peak(self):  # the 4th run ends with Ctrl-C (batch 2's second policy)
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(memory.MemoryProbe, "peak_bytes", peak)
    out = tmp_path / "p.json"
    res = cli("profile", "a", "b", "c", "--policies", "none,entropy", "--warmup", "0", "--model", llada_dir, *SMALL,
              "--json", out)
    assert res.exit_code == 130, (res.exit_code, res.stderr)
    assert "interrupted; the table covers the 1 of 3 prompts every policy finished" in res.stderr
    doc = json.loads(out.read_text())
    assert doc["incomplete"] is True and doc["prompts_done"] == 1 and doc["manifest"]["prompts"] == 3
    assert sorted((r["policy"], r["prompt"]) for r in doc["requests"]) == [("entropy", 0), ("none", 0)]
    assert doc["policies"]["entropy"]["speedup_vs_none"] is not None


def test_sigterm_in_profile_writes_what_finished_like_ctrl_c_and_exits_143(cli, llada_dir, tmp_path, monkeypatch):
    """``timeout`` and batch schedulers stop a run with SIGTERM: the partial JSON is written as on Ctrl-C."""
    import os
    import signal

    from ecache_cli.metrics import memory

    calls = {"n": 0}
    real = memory.MemoryProbe.peak_bytes

    def peak(self):  # SIGTERM during the 4th run (batch 2's second policy)
        calls["n"] += 1
        if calls["n"] == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(memory.MemoryProbe, "peak_bytes", peak)
    out = tmp_path / "p.json"
    res = cli("profile", "a", "b", "c", "--policies", "none,entropy", "--warmup", "0", "--model", llada_dir, *SMALL,
              "--json", out)
    assert res.exit_code == 143, (res.exit_code, res.stderr)
    doc = json.loads(out.read_text())
    assert doc["incomplete"] is True and doc["prompts_done"] == 1
    assert signal.getsignal(signal.SIGTERM) is before  # the command's handler is gone with it


def test_ctrl_c_in_calibrate_writes_what_finished(cli, tmp_path, monkeypatch):
    from ecache_cli.runs import calibrate as cal

    calls = {"n": 0}
    real = cal.Evaluator.records

    def records_(self, tau):  # none, the first τ, then Ctrl-C
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, tau)

    monkeypatch.setattr(cal.Evaluator, "records", records_)
    out, js = tmp_path / "list.yaml", tmp_path / "c.json"
    res = cli("calibrate", "--task", "list", "--limit", "2", "--gen-length", "32", "--out", out, "--json", js,
              "--taus", "0.1,1,2", "--refine", "0")
    assert res.exit_code == 130, (res.exit_code, res.stderr)
    assert "interrupted; no profile written" in res.stderr and "incomplete" in res.stderr
    doc = json.loads(js.read_text())
    assert doc["incomplete"] is True and doc["choice"] is None and doc["none"]["n"] == 2
    assert [p["tau"] for p in doc["points"]] == [0.1]
    assert not out.exists()


def test_invalid_records_are_grouped_by_reason_with_line_ranges():
    from pathlib import Path

    from ecache_cli.runs.gen_input import Item, invalid_error

    f = Path("in.jsonl")
    need = "a record needs a string 'prompt'"
    items = [Item(i, i + 1, None, None, error=f"{f}:{i + 1}: {need}") for i in range(5)]
    items += [Item(5, 7, None, None, error=f"{f}:7: not valid JSON"), Item(6, 8, {"prompt": "ok"}, "ok")]
    items += [Item(7, 9, None, None, error=f"{f}:9: {need}")]
    msg = str(invalid_error(items, f))
    assert "7 of 8 record(s) invalid" in msg
    assert f"{f} lines 1-5, 9: {need}; {f}:7: not valid JSON;" in msg
    assert msg.count(need) == 1
    many = [Item(i, i + 1, None, None, error=f"{f}:{i + 1}: reason {i}") for i in range(12)]
    assert str(invalid_error(many, f, shown=10)).count("reason") == 10 and "and 2 more at lines 11-12" in str(
        invalid_error(many, f, shown=10))
