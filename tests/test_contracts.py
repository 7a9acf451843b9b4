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
import re
import shutil
import signal
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
    f.write_text('[1, 2]\n"Sort: 3 1"\n{"prompt": "Sort: 3 1"}\n')  # no objects: named as --data names them
    res = cli(*_args(command, llada_dir, "--input", f))
    assert res.exit_code == 2 and f"{f}:1: a JSON array, not an object; a record needs a string 'prompt'" in res.stderr
    assert f"{f}:2: a JSON string, not an object; a record needs" in res.stderr, res.stderr


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
def test_reading_errors_come_before_the_load_and_model_errors_after(command, cli, llada_dir, llada_lm, tmp_path):
    """Records the reading refuses are named together before the model loads (the model's checks cannot
    run yet, so a record only the model refuses, the mask id on line 5, is not among them); once the
    reading finds none, the model's checks name theirs, the same in every command (``gen_input.check_items``)."""
    f = tmp_path / "in.jsonl"
    mask = llada_lm.spec.mask_id
    f.write_text('{"prompt": "Sort: 3 1 2"}\nnot json\n{"question": 1}\n{"prompt": " "}\n'
                 f'{{"prompt_ids": [1, {mask}, 5]}}\n[1]\n{{"prompt_ids": []}}\nnull\n')
    res = cli(*_args(command, llada_dir, "--input", f))
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    assert res.stdout == ""
    (line,) = res.stderr.strip().splitlines()
    assert f"error: --input {f}: 6 of 8 record(s) invalid, nothing decoded: " in line
    assert f"{f}:2: not valid JSON" in line and f"{f}:7: 'prompt_ids' must be a non-empty list" in line
    assert f"{f}:5:" not in line
    f.write_text(f'{{"prompt": "Sort: 3 1 2"}}\n{{"prompt_ids": [1, {mask}, 5]}}\n')
    res = cli(*_args(command, llada_dir, "--input", f))
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    (line,) = res.stderr.strip().splitlines()
    assert f"error: --input {f}: 1 of 2 record(s) invalid, nothing decoded: {f}:2: prompt_ids[1] = {mask} is the " \
           "mask id" in line, line


def test_a_byte_that_is_not_utf8_is_named_alike_in_every_path(cli, llada_dir, llada_lm, tmp_path):
    """The same byte 0xe9 in a prompt argument, a piped line, an ``--input`` record, a ``--data`` line and a
    Python API prompt: every path names the byte and its character (``contract.text.not_text_words``), then
    its own fix."""
    from ecache_cli.engine import Engine
    from ecache_cli.errors import UsageError

    words = "not UTF-8 text (byte 0xe9 at character {})"
    record, data = tmp_path / "in.jsonl", tmp_path / "gsm.jsonl"
    record.write_bytes(b'{"prompt": "Caf\xe9 1"}\n')
    data.write_bytes(b'{"question": "Caf\xe9 1", "answer": "#### 1"}\n')
    said = {"argument": cli("generate", "Caf\udce9 1", "--model", llada_dir, *SMALL).stderr,
            "stdin": cli("generate", "--model", llada_dir, *SMALL, input=b"Caf\xe9 1\n").stderr,
            "--input": cli("generate", "--input", record, "--model", llada_dir, *SMALL).stderr,
            "--data": cli(*_data_args("profile", llada_dir, data)).stderr}
    with pytest.raises(UsageError) as api:
        Engine.from_loaded(llada_lm).encode(["Caf\udce9 1"], chat=False)
    said["api"] = str(api.value)
    expected = {"argument": f"prompt argument 1: {words.format(4)}; ", "stdin": f"stdin:1: {words.format(4)}; ",
                "--input": f"{record}:1: {words.format(16)}; save the file as UTF-8 JSONL",
                "--data": f"{data}:1: {words.format(18)}; save the file as UTF-8 JSONL",
                "api": f"prompt 1: {words.format(4)}; pass UTF-8 text"}
    for path, text in expected.items():
        assert text in said[path], (path, said[path])


@pytest.mark.parametrize("command", PROMPTED)
def test_non_utf8_stdin_is_found_before_decoding(command, cli, llada_dir):
    res = cli(*_args(command, llada_dir), input=b"Sort: 3 1 2\n\xff\nabc\n\xff\xfe\nab\xe9\n")
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    assert res.stdout == ""  # the good first line was not decoded either
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: stdin: 3 of 5 line(s) invalid, nothing decoded: stdin lines 2, 4: not UTF-8 text "
                           "(byte 0xff at character 1); pipe UTF-8 prompts, one per line; stdin:5: not UTF-8 text "
                           "(byte 0xe9 at character 3); "), line


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
    assert "stdin:2: a JSON array, not an object; a record needs a string 'prompt'" in bad.stderr
    # a lone `-` prompt argument reads stdin's lines as prompts, as piping them with no argument does
    piped = cli(*_args(command, llada_dir), input="Sort: 3 1 2\n")
    dash = cli(*_args(command, llada_dir), "-", input="Sort: 3 1 2\n")
    assert dash.exit_code == 0 and piped.exit_code == 0, (dash.stderr, piped.stderr)
    same = [{k: v for k, v in json.loads(line).items() if k not in ("manifest", "stats", "memory", "time_s")}
            for out in (dash.stdout, piped.stdout) for line in out.splitlines()]
    if command == "generate":
        assert same[0]["prompt"] == "Sort: 3 1 2" and same[0]["token_ids"] == same[1]["token_ids"]
    mixed = cli(*_args(command, llada_dir), "abc", "-", input="Sort: 3 1 2\n")
    assert mixed.exit_code == 2 and "- (stdin) must be the only prompt argument" in mixed.stderr, mixed.stderr


def test_calibrate_data_dash_is_stdin(cli, llada_dir):
    """``calibrate --data -`` reads the benchmark's JSONL from stdin, as ``--input -`` does for prompts."""
    rows = "".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n"
                   for i in range(3))
    args = _args("calibrate", llada_dir)
    args[args.index("--task") + 1] = "gsm8k"
    res = cli(*args, "--data", "-", "--json", "-", input=rows)
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout.splitlines()[0])
    assert doc["calibrate"]["data"] == "-" and doc["calibrate"]["limit"] == 2 and len(doc["points"]) == 1
    bad = cli(*args, "--data", "-", input="not json\n")
    assert bad.exit_code == 2 and ("--data -: 1 of 1 line(s) invalid, nothing decoded: stdin:1: not valid JSON "
                                   "(Expecting value); each line must be one JSON object") in bad.stderr, bad.stderr


#: The commands that read a benchmark's ``--data`` (``--task gsm8k``), with the flags of a short run.
DATA_COMMANDS = {
    "calibrate": ["calibrate", "--limit", "2", "--dry-run", "--taus", "0.5", "--refine", "0", "--no-speed-check"],
    "profile": ["profile", "--policies", "none", "--warmup", "0", "--json", "-", "--limit", "2"],
    "trace-drift": ["trace-drift", "--rows", "0", "--json", "-", "--limit", "2"],
}
GSM_ROWS = "".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n"
                   for i in range(3))


def _data_args(command: str, model, data) -> list[str]:
    return [*DATA_COMMANDS[command], "--task", "gsm8k", "--shots", "0", "--data", str(data), "--model", str(model),
            *SMALL]


@pytest.mark.parametrize("command", list(DATA_COMMANDS))
@pytest.mark.parametrize("source", ["file", "dash"])
def test_data_names_every_bad_line_exit_2(command, source, cli, llada_dir, tmp_path):
    """``--data`` lines are checked as ``--input`` records are (one reader, ``sources.py``): a line that
    is not UTF-8 is named with the others, exit 2, nothing decoded, from a file as from stdin (whose fix is
    to pipe UTF-8, not to save a file), in the words ``generate --input`` uses for the same lines
    (``contract.lines``)."""
    bad = GSM_ROWS.encode() + b'{"question": "\xff", "answer": "#### 2"}\nnot json\n\xfe\n'
    f = tmp_path / "gsm.jsonl"
    f.write_bytes(bad)
    res = cli(*_data_args(command, llada_dir, f if source == "file" else "-"), input=bad if source == "dash" else None)
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    assert res.stdout == ""
    (line,) = res.stderr.strip().splitlines()
    name, src = (f, f) if source == "file" else ("-", "stdin")
    fix = "save the file as UTF-8 JSONL" if source == "file" else "pipe UTF-8 JSONL"  # stdin has no file to save
    same = (f"{src}:4: not UTF-8 text (byte 0xff at character 15); {fix}; {src}:5: not valid "
            f"JSON (Expecting value); each line must be one JSON object; {src}:6: not UTF-8 text (byte 0xfe at "
            f"character 1); {fix}")
    assert line == (f"error: --data {name}: 3 of 6 line(s) invalid, nothing decoded: {same}; each line must be one "
                    "UTF-8 JSON object with the fields question, answer (the official gsm8k format)"), line
    gen = cli("generate", "--input", f if source == "file" else "-", "--model", llada_dir, *SMALL,
              input=bad if source == "dash" else None)
    assert gen.exit_code == 2 and same in gen.stderr, gen.stderr


@pytest.mark.parametrize("shots", [0, 1])
def test_a_data_record_spelling_the_mask_token_is_named_by_its_line_in_every_command(shots, cli, llada_dir, tmp_path):
    """A ``--data`` record whose text spells the mask token is refused before anything is decoded, naming its
    ``FILE:LINE`` (blank lines counted) in the same words in calibrate, profile and trace-drift, whether it
    is a prompt's question or (with shots) a solved shot placed before another question; a record that
    spells it only in its own answer, which no prompt holds without shots, is no error."""
    f = tmp_path / "gsm.jsonl"
    rows = [{"question": "What is 1 + 1?", "answer": "#### 2"}, {"question": "What is 2 + <|mdm_mask|>?",
                                                                  "answer": "#### 3"}]
    f.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    said = {}
    for command in DATA_COMMANDS:
        res = cli(*_data_args(command, llada_dir, f), "--shots", str(shots))  # the last --shots counts
        assert res.exit_code == 2 and res.stdout == "", (command, res.stderr)
        said[command] = res.stderr.strip().splitlines()[-1]
    assert set(said.values()) == {
        f"error: {f}:3: the text holds the mask token '<|mdm_mask|>' (token id 2, at position 12 of the encoded "
        "record); a prompt holds no mask tokens; remove it from that record"}, said
    f.write_text(json.dumps(rows[0]) + "\n" + json.dumps({**rows[0], "answer": "<|mdm_mask|> #### 2"}) + "\n")
    res = cli(*_data_args("trace-drift", llada_dir, f))
    assert res.exit_code == 0, res.stderr


@pytest.mark.parametrize("flag", ["--input", "--data"])
@pytest.mark.parametrize("how", ["dev-stdin", "fifo"])
def test_input_and_data_take_any_readable_path(flag, how, llada_dir, tmp_path):
    """README: ``--input`` and ``--data`` take any readable path (a named pipe, ``/dev/stdin``), read once
    as a stream by the same reader; ``--data`` refused both before."""
    def args(path) -> list[str]:
        if flag == "--input":
            return _args("profile", llada_dir, "--input", path)
        return _data_args("profile", llada_dir, path)

    text = '{"prompt": "Sort: 3 1 2"}\n' if flag == "--input" else GSM_ROWS
    if how == "dev-stdin":
        p = subprocess.Popen([sys.executable, "-m", "ecache_cli", *args("/dev/stdin")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
        out, err = p.communicate(text.encode(), timeout=300)
    else:
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        p = _popen(args(fifo))
        with open(fifo, "w") as w:  # blocks until the command opens it to read
            w.write(text)
        out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()
    doc = json.loads(out.decode().splitlines()[0])
    assert doc["prompts_done"] == (1 if flag == "--input" else 2), doc


EMPTY_CASES = {  # (command, how the input is empty) -> (args after the command's own, stdin)
    "stdin": ([], ""),
    "input-file": (["--input", "EMPTY"], None),
    "input-dash": (["--input", "-"], "\n\n"),
}


@pytest.mark.parametrize("command", PROMPTED)
@pytest.mark.parametrize("case", list(EMPTY_CASES))
def test_empty_input_is_a_usage_error(command, case, cli, llada_dir, tmp_path):
    """One rule for an input with no record: exit 2, one line naming the source and the fix; an empty
    file is refused before the "using model …" line (without -q: no line before the error)."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n \n")
    extra, stdin = EMPTY_CASES[case]
    args = _args(command, llada_dir, *[str(empty) if a == "EMPTY" else a for a in extra])
    res = cli(*[a for a in args if a != "-q" or case != "input-file"], input=stdin)
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    (line,) = res.stderr.strip().splitlines()
    want = {"stdin": "no prompt given: stdin was empty", "input-file": f"--input {empty} holds no record",
            "input-dash": "--input - holds no record"}[case]
    assert line.startswith(f"error: {want}") and ("pipe prompts" in line or "'prompt' field" in line), line


@pytest.mark.parametrize("command", list(DATA_COMMANDS))
def test_empty_data_is_a_usage_error(command, cli, llada_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    res = cli(*_data_args(command, llada_dir, empty))
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"error: --data {empty} holds no record") and "question, answer" in line, line


def test_chat_reads_piped_stdin_in_full_first(cli):
    """A line that is not UTF-8 among piped chat lines: named before anything is answered, exit 2, as the
    prompt commands name theirs (``test_non_utf8_stdin_is_found_before_decoding``)."""
    piped = b"Sort: 3 1 2\n\xff\xfe bad\nabc\n\xff\n"
    res = cli("chat", "-q", "--gen-length", "16", "--block-length", "8", input=piped)
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    assert res.stdout == ""  # the good first line was not answered
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: stdin: 2 of 4 line(s) invalid, nothing decoded: stdin lines 2, 4: not UTF-8 text "
                           "(byte 0xff at character 1); pipe UTF-8 prompts, one per line"), line
    prompts = cli("generate", "-q", "--gen-length", "16", "--block-length", "8", input=piped)
    assert prompts.stderr.strip() == line  # one wording: the prompt commands' fix (ecache help input)


#: ``inputs._bounded_lines``' refusal of ``< /dev/zero``.
ENDLESS_NUL = ("stdin: line 1 runs past 1 MiB without a newline and holds only NUL bytes (binary data such as "
               "/dev/zero, not text); pipe text, one prompt or message of at most 1 MiB per line")


def test_an_endless_piped_line_is_refused_at_its_bound():
    """``ecache chat < /dev/zero``: stdin is read line by line, and a line that runs past ``inputs.MAX_LINE``
    without a newline is one DataError (exit 1) once that much is read, not memory used until the process is
    killed; a line of ``MAX_LINE`` bytes is still read."""
    import io

    from ecache_cli.errors import DataError
    from ecache_cli.runs import inputs

    class Zeros(io.RawIOBase):  # /dev/zero, failing the test where stdin would be read to an end it lacks
        read = 0

        def readable(self):
            return True

        def readinto(self, b):
            assert self.read < 4 * inputs.MAX_LINE, "stdin was read past the longest line"
            b[:] = bytes(len(b))
            self.read += len(b)
            return len(b)

    zeros = Zeros()
    with pytest.raises(DataError) as e:
        inputs.piped_lines(io.TextIOWrapper(io.BufferedReader(zeros)))
    assert str(e.value) == ENDLESS_NUL
    assert inputs.MAX_LINE < zeros.read < 2 * inputs.MAX_LINE
    longest = io.TextIOWrapper(io.BytesIO(b"x" * inputs.MAX_LINE + b"\nok\n"))
    assert [len(line) for line in inputs.piped_lines(longest)] == [inputs.MAX_LINE, 2]


@pytest.mark.parametrize("command", ["chat", "generate"])
def test_a_piped_line_past_the_bound_is_one_line_exit_1(command, cli):
    from ecache_cli.runs.inputs import MAX_LINE

    res = cli(command, "-q", "--gen-length", "16", "--block-length", "8", input=b"\0" * (MAX_LINE + 1))
    assert (res.exit_code, res.stdout, res.stderr) == (1, "", f"error: {ENDLESS_NUL}\n"), res.stderr
    res = cli(command, "-q", "--gen-length", "16", "--block-length", "8", input=b"hi\n" + b"a" * (MAX_LINE + 1))
    assert (res.exit_code, res.stderr) == (1, "error: stdin: line 2 runs past 1 MiB without a newline; pipe text, one "
                                              "prompt or message of at most 1 MiB per line\n"), res.stderr


@pytest.mark.parametrize("command", ["generate", "chat", "trace-drift"])
def test_a_cache_flag_the_policy_ignores_is_warned_alike(command, cli):
    """``--tau`` under ``--cache dual``: one warning, naming what the policy takes, in every command."""
    args = [command, "--gen-length", "16", "--block-length", "8", "--cache", "dual", "--tau", "0.5"]
    res = cli(*args, *([] if command == "chat" else ["Sort: 3 1 2"]), input="/exit\n")
    assert res.exit_code == 0, res.stderr
    warned = [line for line in res.stderr.splitlines() if line.startswith("warning: --tau")]
    assert warned == ["warning: --tau is not used by --cache dual (it takes refresh_every); ignored"], res.stderr


def test_chat_gen_length_not_a_multiple_is_worded_as_the_flag(cli):
    flag = cli("generate", "--gen-length", "30", "--block-length", "8", "x")
    assert flag.exit_code == 2, flag.stderr
    chat = cli("chat", "-q", "--gen-length", "16", "--block-length", "8", input="/gen-length 30\n")
    words = flag.stderr.strip().removeprefix("error: --gen-length 30 ")
    assert words.startswith("is not a multiple of --block-length 8: ") and words != flag.stderr.strip()
    assert chat.stderr.splitlines()[0] == f"error: /gen-length 30 {words}", chat.stderr


#: Each model command's short run without -q, with flags that warn once the settings are read (a τ no policy
#: of the run takes), so an output line before an input error would show.
LOUD = {
    "generate": ["generate", "--jsonl", "--no-chat", "--cache", "dual", "--tau", "0.5"],
    "profile": ["profile", "--policies", "none", "--warmup", "0", "--json", "-", "--no-chat", "--tau", "0.5"],
    "trace-drift": ["trace-drift", "--rows", "0", "--json", "-", "--no-chat", "--cache", "dual", "--tau", "0.5"],
    "calibrate": ["calibrate", "--dry-run", "--taus", "0.5", "--refine", "0", "--no-speed-check"],
    "chat": ["chat", "--cache", "dual", "--tau", "0.5"],
}
GSM_BAD = '{"question": "What is 1 + 1?"}\n'
#: (case, the commands that have it) -> (extra args, stdin, the error line's start). FILE: a file with the
#: case's records.
INPUT_ERRORS = {
    "empty-stdin": (["generate", "profile", "trace-drift", "chat"], [], "",
                    "no prompt given: stdin was empty or blank; "),
    "non-utf8-stdin": (["generate", "profile", "trace-drift", "chat"], [], b"Sort: 3 1\n\xff\n",
                       "stdin: 1 of 2 line(s) invalid, nothing decoded: stdin:2: not UTF-8 text"),
    "invalid-input": (["generate", "profile", "trace-drift"], ["--input", "FILE"], None,
                      "--input FILE: 1 of 2 record(s) invalid, nothing decoded: FILE:2: not valid JSON"),
    "empty-input": (["generate", "profile", "trace-drift"], ["--input", "FILE"], None, "--input FILE holds no record"),
    "bad-data": (["profile", "trace-drift", "calibrate"], ["--task", "gsm8k", "--limit", "1", "--data", "FILE"], None,
                 "--data FILE: 1 of 1 line(s) invalid, nothing decoded: FILE:1: lacks answer"),
}
INPUT_FILES = {"invalid-input": '{"prompt": "Sort: 3 1"}\nnot json\n', "empty-input": "\n", "bad-data": GSM_BAD}


@pytest.mark.parametrize("case,command", [(c, m) for c, (ms, *_) in INPUT_ERRORS.items() for m in ms])
def test_an_input_error_comes_first_and_alone(case, command, cli, llada_dir, tmp_path):
    """One order in every command: the input (stdin, ``--input``, ``--data``) is read and checked in full
    before the model loads, so its error is the run's only output: no "using model …" line, no warning of
    the settings before it, exit 2 (chat's empty piped stdin too)."""
    _, extra, stdin, want = INPUT_ERRORS[case]
    f = tmp_path / "in.jsonl"
    f.write_text(INPUT_FILES.get(case, ""))
    args = [*LOUD[command], "--model", llada_dir, "--gen-length", "16", "--block-length", "8",
            *[str(f) if a == "FILE" else a for a in extra]]
    res = cli(*args, input=stdin)
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    assert res.stdout == ""
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: " + want.replace("FILE", str(f))), line


@pytest.mark.parametrize("command", list(LOUD))
@pytest.mark.parametrize("quantize,dtype,want", [
    ("fp8", "float32", "--quantize fp8 needs a CUDA GPU of compute capability ≥ 8.9; on CPU use int8"),
    ("int4", "float32", "--quantize int4 runs in bfloat16 only here (float32 asked): add --dtype bfloat16"),
])
def test_a_quantize_format_the_device_cannot_run_is_refused_in_one_line(command, quantize, dtype, want, cli, llada_dir):
    """The device and dtype are known before the load: a format they cannot run is refused alone, before
    the "using model …" line and before a warning that would suggest calibrating that format here."""
    prompt = [] if command in ("calibrate", "chat") else ["Sort: 3 1"]
    extra = ["--task", "list", "--limit", "1"] if command == "calibrate" else []
    res = cli(*LOUD[command], "--model", llada_dir, "--device", "cpu", "--dtype", dtype, "--quantize", quantize,
              *extra, *prompt, input="Sort: 3 1\n" if command == "chat" else None)
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: " + want), line
    assert "ecache calibrate" not in res.stderr


@pytest.mark.parametrize("command", ["generate", *DATA_COMMANDS])
def test_a_task_the_model_was_not_trained_on_warns_and_runs_in_every_command(command, cli, tmp_path):
    """README: every command that takes ``--task`` warns when the embedded model was not trained on it
    (gsm8k), and runs; ``generate --task`` refused it before."""
    data = tmp_path / "gsm.jsonl"
    data.write_text(GSM_ROWS)
    if command == "generate":
        args = ["generate", "--task", "gsm8k", *SMALL, "What is 2+2?"]
    else:
        args = [a for a in _data_args(command, "tiny", data) if a != "--no-chat"]
    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    assert res.stderr.count("warning: model tiny was trained only on arith, code, list, not gsm8k") == 1, res.stderr


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
    progress = ("warmup", "measure", "STAGE:", "none: score", "τ=", "generate", "profile", "trace-drift", "calibrate ")
    assert not [line for line in quiet.stderr.splitlines() if line.startswith(progress)], quiet.stderr


@pytest.mark.parametrize("quiet", [True, False], ids=["q", "loud"])
def test_profile_traces_print_no_profiler_lines(llada_dir, profiles_dir, tmp_path, quiet):
    """torch.profiler's C++ start/stop lines (kineto, on file descriptor 2) stay off ``profile``'s stderr,
    ``-q`` or not (on a terminal they would land on the progress line)."""
    args = [a for a in SMALL if quiet or a != "-q"]
    p = _popen(["profile", "x", "--policies", "none", "--warmup", "0", "--model", str(llada_dir), *args,
                "--trace-dir", str(tmp_path / "traces"), "--trace-steps", "2"])
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()
    assert "profiler_start" not in err.decode() and "profiler_stop" not in err.decode(), err.decode()
    assert quiet or err.decode().startswith("using model "), err.decode()
    assert (tmp_path / "traces" / "none.chrome_trace.json").exists()


def test_kineto_lines_are_dropped_and_other_native_lines_kept(capfd):
    """What C++ writes to descriptor 2 inside the block comes back to stderr but kineto's own lines."""
    import os

    from ecache_cli.runs.tracing import kineto_lines_off

    with kineto_lines_off():
        os.write(2, b"USDT:2026-12-05 20:54:25 17865:17865 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"W1205 a native warning\n")
        os.write(2, b"USDT:2026-12-05 20:54:26 17865:17865 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    assert capfd.readouterr().err == "W1205 a native warning\n"


# --- every command on a terminal: 60, 80 and 120 columns (a pseudo-terminal, stdlib pty) ---------------------

#: Each command with a tiny run, and the head its progress line starts with (None: it draws no progress).
TERMINAL = {
    "generate": (["generate", "--input", "{input}", "--batch-size", "2"], r"generate \d"),
    "profile": (["profile", "Sort: 3 1 2", "abc", "--policies", "none,es-dllm-conf,entropy,d2cache", "--warmup", "0"],
                r"profile \d"),
    "trace-drift": (["trace-drift", "Sort: 3 1 2", "Reverse the list 4 5 6 7 8", "--batch-size", "1"],
                    r"trace-drift \d"),
    "calibrate": (["calibrate", "--task", "list", "--limit", "2", "--taus", "0.5,1", "--refine", "0", "--dry-run",
                   "--no-speed-check"], r"calibrate (none|τ=\S+) \d+/\d+"),
    # prose at the terminal's width
    "trace-drift --wide": (["trace-drift", "Sort: 3 1 2", "--wide"], r"trace-drift \d"),
    # every column: tables of the same rows stacked where they do not fit side by side
    "profile --wide": (["profile", "Sort: 3 1 2", "--policies", "none,es-dllm-conf,entropy,d2cache", "--warmup", "0",
                        "--wide"], r"profile \d"),
    "calibrate --wide": (["calibrate", "--task", "list", "--limit", "2", "--taus", "0.5,1", "--refine", "0",
                          "--dry-run", "--no-speed-check", "--wide"], r"calibrate (none|τ=\S+) \d+/\d+"),
    "generate --watch": (["generate", "Sort: 3 1 2", "--watch"], None),  # header and status lines: whole fields
    "chat --watch": (["chat", "--watch", "--stdin", "Sort: 3 1 2\n"], None),
    "models": (["models"], None),
    "models show": (["models", "show", "{model}"], None),
    "help cache": (["help", "cache"], None),  # the topics' tables and examples wrap too
    "help input": (["help", "input"], None),
}


def _on_terminal(args: list[str], columns: int) -> tuple[int, str]:
    """Run ``ecache ARGS`` with stdout and stderr on a pseudo-terminal ``columns`` wide (the window size
    set as ``stty cols`` does, and $COLUMNS); return its exit status and everything it wrote. ``--stdin
    TEXT`` among ARGS is not passed on: TEXT is the command's stdin (else /dev/null)."""
    stdin = subprocess.DEVNULL
    if "--stdin" in args:
        i = args.index("--stdin")
        text, args = args[i + 1], args[:i] + args[i + 2:]
        stdin = subprocess.PIPE
    import fcntl
    import pty
    import select
    import struct
    import termios

    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "50", "TERM": "xterm-256color", "OMP_NUM_THREADS": "1"}
    env.pop("NO_COLOR", None)
    p = subprocess.Popen([sys.executable, "-m", "ecache_cli", *args], stdin=stdin, stdout=sub, stderr=sub,
                         env=env, close_fds=True)
    os.close(sub)
    if stdin is subprocess.PIPE:
        p.stdin.write(text.encode())
        p.stdin.close()
    out = b""
    while True:
        ready, _, _ = select.select([main], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the other end closed (Linux: EIO)
                break
            if not chunk:
                break
            out += chunk
        elif p.poll() is not None:
            break
    os.close(main)
    return p.wait(timeout=300), out.decode("utf-8", "replace")


class Screen:
    """A terminal just large enough to check what a command drew: printable text, CR, LF, cursor up
    (``ESC[nA``) and erase line (``ESC[2K``, ``ESC[K``); colours and cursor visibility are skipped. Rows
    never scroll away. ``overflow``: text written past the last column (the line was wider than the
    terminal); ``frames``: each progress frame drawn (row, text), checked against the other rows."""

    ESC = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")

    def __init__(self, columns: int, head: str | None):
        self.columns, self.head = columns, re.compile(head) if head else None
        self.rows: list[list[str]] = [[]]
        self.row = self.col = 0
        self.overflow: list[str] = []
        self.frames: list[tuple[int, str]] = []
        self.stacked: list[str] = []  # progress text found on another row when a frame was drawn

    def feed(self, data: str) -> None:
        pos = 0
        for m in self.ESC.finditer(data):
            self._text(data[pos:m.start()])
            n = int(m.group(1) or 1) if m.group(1).isdigit() else 1
            if m.group(2) == "A":
                self._frame()
                self.row = max(0, self.row - n)
            elif m.group(2) == "K":
                row = self.rows[self.row]
                del row[0 if m.group(1) == "2" else self.col:]
            pos = m.end()
        self._text(data[pos:])
        self._frame()

    def _text(self, text: str) -> None:
        for ch in text:
            if ch == "\r":
                self._frame()
                self.col = 0
            elif ch == "\n":
                self._frame()
                self.row += 1
                while len(self.rows) <= self.row:
                    self.rows.append([])
            elif ch >= " ":
                if self.col >= self.columns:
                    self.overflow.append(self.line(self.row))
                row = self.rows[self.row]
                row.extend(" " * (self.col + 1 - len(row)))
                row[self.col] = ch
                self.col += 1

    def line(self, i: int) -> str:
        return "".join(self.rows[i]).rstrip()

    def _frame(self) -> None:
        """Note a progress frame when the current row holds one (called before the cursor leaves it)."""
        text = self.line(self.row)
        if self.head is None or not self.head.match(text):
            return
        if not self.frames or self.frames[-1] != (self.row, text):
            self.frames.append((self.row, text))
        self.stacked += [self.line(i) for i in range(len(self.rows)) if i != self.row and self.head.match(self.line(i))]

    def text(self) -> list[str]:
        return [self.line(i) for i in range(len(self.rows))]


LEFT, RIGHT = "┏┃┡│└┢╭┣", "┓┃┩│┘┪╮┫"


@pytest.mark.parametrize("columns", [60, 80, 120])
@pytest.mark.parametrize("command", list(TERMINAL))
def test_every_command_fits_the_terminal_and_updates_progress_in_place(command, columns, llada_dir, profiles_dir,
                                                                       tmp_path):
    """On a terminal every line (tables, progress, messages: wrapped at words) fits its width, no table
    border is cut, no number ends in ``…``, and a progress display is one line redrawn in place (carriage
    return and erase, never a second row) and removed at the end."""
    args, head = TERMINAL[command]
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"Sort: {i} 3 1"}) + "\n" for i in range(6)))
    args = [a.format(input=f, model=llada_dir) for a in args]
    if command.split()[0] == "chat":  # the embedded model: it has a chat template
        args += ["--gen-length", "16", "--block-length", "8"]
    elif command.split()[0] not in ("models", "help"):
        args += ["--model", str(llada_dir), "--gen-length", "16", "--block-length", "8", "--no-chat"]
    rc, raw = _on_terminal(args, columns)
    screen = Screen(columns, head)
    screen.feed(raw)
    shown = screen.text()
    assert rc == 0, "\n".join(shown)
    assert screen.overflow == [], (columns, screen.overflow)
    assert not re.search(r"\d…|…\d", "\n".join(shown)), "\n".join(shown)
    assert not [ln for ln in shown if re.match(r"(ecache watch|step \d)", ln) and ln.endswith("…")], shown  # no cut
    for line in shown:
        if line.strip() and line.lstrip()[0] in LEFT:
            assert line[-1] in RIGHT, (columns, line)  # a boxed row keeps its right border
    if head is not None:
        assert len(screen.frames) >= 2, (raw[-2000:], screen.frames)  # the progress line was redrawn
        assert screen.stacked == [], screen.stacked  # one row: earlier frames were erased, not pushed up
        assert not [ln for ln in shown if re.match(head, ln)], shown  # and removed at the end
        last = re.search(r"(\d+)/(\d+)", screen.frames[-1][1])  # the last frame drawn: all done, N/N
        assert last and last.group(1) == last.group(2), screen.frames[-3:]
    assert any(ln.strip() for ln in shown)


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("name", ["nonsense", ""])  # '' is no name, not the current folder
def test_an_unknown_model_is_refused_alone_as_models_show_refuses_it(command, name, cli):
    """No "using model …" line before the error, exit 1 (a missing model), and the wording of ``ecache
    models show``."""
    shown = cli("models", "show", name)
    assert shown.exit_code == 1
    wording = shown.stderr.strip().removeprefix("error: ")
    assert wording.startswith(f"{name!r} is neither a model ecache knows"), wording
    args = [a for a in _args(command, name) if a != "-q"]
    res = cli(*args, *([] if command == "calibrate" else ["x"]))
    assert res.exit_code == 1, res.stderr
    assert res.stderr.strip().splitlines() == [f"error: --model {wording}"], res.stderr
    from ecache_cli.errors import ModelLoadError
    from ecache_cli.models.loader import load_model

    with pytest.raises(ModelLoadError) as e:  # the Python API: the same words
        load_model(name)
    assert str(e.value) == f"--model {wording}"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_folder_without_config_is_refused_as_models_show_and_load_model_refuse_it(command, cli, tmp_path):
    from ecache_cli.errors import ModelLoadError
    from ecache_cli.models.loader import load_model

    empty = tmp_path / "emptydir"
    empty.mkdir()
    shown = cli("models", "show", empty)
    wording = shown.stderr.strip().removeprefix("error: ")
    assert shown.exit_code == 1 and wording.startswith(f"{empty}: no config.json, so it is not a checkpoint"), wording
    res = cli(*[a for a in _args(command, empty) if a != "-q"], *([] if command == "calibrate" else ["x"]))
    assert res.exit_code == 1 and res.stderr.strip().splitlines() == [f"error: --model {wording}"], res.stderr
    with pytest.raises(ModelLoadError) as e:
        load_model(empty)
    assert str(e.value) == f"--model {wording}"


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("name", ["no/such/folder", "./nonexist", "~/nonexist-ecache", "FILE"])
def test_a_mistyped_model_folder_is_refused_before_the_decode_settings(command, name, cli, tmp_path):
    """A path-like ``--model`` that is no folder is refused as no such folder, and a file as no checkpoint
    folder (exit 1), in ``models show``'s and ``load_model``'s words, even when the decode settings are bad
    too (17 is no multiple of any block length here): the model comes first."""
    from ecache_cli.errors import ModelLoadError
    from ecache_cli.models.loader import load_model

    if name == "FILE":
        name = str(tmp_path / "questions.jsonl")
        (tmp_path / "questions.jsonl").write_text('{"prompt": "x"}\n')
        want = (f"{name!r} is a file, not a checkpoint folder (a folder with config.json and the weights); pass its "
                "folder, or run `ecache models` for the known models")
    else:
        want = (f"{name!r}: no such folder; pass a checkpoint folder that exists, or run `ecache models` for the "
                "known models")
    args = [a for a in _args(command, name, "--gen-length", 17) if a != "-q"]
    res = cli(*args, *([] if command == "calibrate" else ["x"]))
    assert res.exit_code == 1, res.stderr
    assert res.stderr.strip().splitlines() == [f"error: --model {want}"], res.stderr
    shown = cli("models", "show", name)
    assert shown.exit_code == 1 and shown.stderr.strip().splitlines() == [f"error: {want}"], shown.stderr
    with pytest.raises(ModelLoadError) as e:
        load_model(name)
    assert str(e.value) == f"--model {want}"


def _settings_doc(command: str, stdout: str) -> dict:
    """The run's ``settings`` as its JSON output carries them (a record's, or the document manifest's)."""
    doc = json.loads(stdout.splitlines()[0])
    return doc["settings"] if command == "generate" else doc["manifest"]["settings"]


@pytest.mark.parametrize("command", PROMPTED)
@pytest.mark.parametrize("policy,takes", [("none", False), ("dual", False), ("entropy", True)])
def test_tau_is_reported_only_when_a_policy_of_the_run_takes_one(command, policy, takes, cli, llada_dir):
    """The start line's rule (``no τ: only the entropy policy takes one``) holds in the JSON: ``tau`` and
    ``tau_source`` are null unless a policy the run decodes with has a τ (``Settings.takes_tau``)."""
    flag = ["--policies", f"none,{policy}"] if command == "profile" else ["--cache", policy]
    if command == "profile" and policy == "none":
        flag = ["--policies", "none"]
    res = cli(*[a for a in _args(command, llada_dir, *flag) if a != "-q"], "Sort: 3 1 2")
    assert res.exit_code == 0, res.stderr
    settings = _settings_doc(command, res.stdout)
    assert ("no τ" in res.stderr.splitlines()[0]) is not takes, res.stderr
    if takes:
        assert settings["tau"] == settings["cache_params"]["tau"] and settings["tau_source"] == "default"
    else:
        assert settings["tau"] is None and settings["tau_source"] is None, settings


#: The options every command that loads a model takes, with one meaning (options.py declares each once).
GLOBAL_OPTIONS = ["--model", "-m", "--device", "--dtype", "--threads", "--force", "--compile", "--quantize",
                  "--group-size", "--profile", "--seed", "--quiet", "-q"]


def _model_commands() -> dict:
    import typer

    from ecache_cli.cli import app

    group = typer.main.get_command(app)
    return {name: cmd for name, cmd in group.commands.items()
            if any("--model" in p.opts for p in getattr(cmd, "params", []))}


@pytest.mark.parametrize("command", ["generate", "chat", "profile", "calibrate", "trace-drift", "serve"])
def test_every_model_command_takes_the_same_global_options(command):
    cmds = _model_commands()
    assert set(cmds) == {"generate", "chat", "profile", "calibrate", "trace-drift", "serve"}
    given = {o for p in cmds[command].params for o in (*p.opts, *p.secondary_opts)}
    assert [o for o in GLOBAL_OPTIONS if o not in given] == []


def _leaf_commands() -> dict:
    """Every command a user runs (``models show``, not ``models``' group alone), by its full name."""
    import typer

    from ecache_cli.cli import app

    out = {}

    def walk(cmd, name):
        if hasattr(cmd, "commands"):  # a group (typer's own click Group)
            if name:  # a group with a callback of its own (``ecache models`` lists the models)
                out[name] = cmd
            for sub, c in cmd.commands.items():
                walk(c, f"{name} {sub}".strip())
        else:
            out[name] = cmd

    walk(typer.main.get_command(app), "")
    return out


def test_every_command_takes_quiet():
    """``-q`` is a global option of every command (README), the model-less ones too; ``help`` prints
    only what it is asked for."""
    cmds = _leaf_commands()
    assert {"models", "models show", "models pull", "generate", "chat", "serve"} <= set(cmds)
    lacking = [name for name, cmd in cmds.items() if name != "help"
               and not {"-q", "--quiet"} <= {o for p in cmd.params for o in p.opts}]
    assert lacking == []


@pytest.mark.parametrize("where", [["models", "-q", "pull", "tiny"], ["models", "pull", "tiny", "-q"]])
def test_models_quiet_keeps_stdout_only(where, cli):
    loud = cli("models", "pull", "tiny")
    assert loud.exit_code == 0 and "embedded in the package" in loud.stderr, loud.stderr
    res = cli(*where)
    assert res.exit_code == 0 and res.stderr == "" and res.stdout == loud.stdout


def test_chat_quiet_drops_the_start_lines(cli):
    loud = cli("chat", "--gen-length", "16", "--block-length", "8", input="/exit\n")
    assert loud.exit_code == 0, loud.stderr
    assert loud.stderr.splitlines()[0].startswith("using model tiny"), loud.stderr
    quiet = cli("chat", "-q", "--gen-length", "16", "--block-length", "8", "--cache", "none", "--tau", "0.5",
                input="/exit\n")
    assert quiet.exit_code == 0, quiet.stderr
    assert quiet.stderr.splitlines() == ["warning: --tau is not used by --cache none (it takes no parameter); ignored"]


SDAR = os.path.join(os.path.dirname(__file__), "fixtures", "sdar")


@pytest.mark.parametrize("command", PROMPTED)
@pytest.mark.parametrize("flags,ignored", [
    (["--schedule", "llada"], "--threshold 0.85 (the sdar family's default)"),  # the block rule's threshold
    (["--schedule", "dream", "--threshold", "0.5"], "--threshold 0.5"),
    (["--schedule", "block", "--steps", "8"], None),  # block's per-step minimum: 2 a step
    (["--schedule", "dream", "--temperature", "0.5"], None),  # Dream's confidences
])
def test_a_schedule_the_threshold_rule_ignores_is_warned(command, flags, ignored, cli):
    """``--schedule`` does nothing under the threshold rule unless --steps or sampling give it a role
    (``decoding.commit.ignored_schedule``): one warning in every command, none when it counts."""
    args = [a for a in _args(command, SDAR, *flags) if a != "-q"]
    res = cli(*args, "Sort: 3 1 2")
    assert res.exit_code == 0, res.stderr
    warned = [line for line in res.stderr.splitlines() if "--schedule" in line]
    if ignored is None:
        assert warned == [], res.stderr
    else:
        assert warned == [f"warning: --schedule {flags[1]} does nothing with {ignored}: that rule commits by "
                          "confidence, not by a schedule's counts (which count there only with --steps, as block's "
                          "minimum or dream's quota, or as dream's confidences when sampling); ignored"], res.stderr


def test_schedule_block_over_a_profiles_steps_is_warned_with_the_reason(cli, tmp_path):
    """``--schedule block`` alone, over a profile whose steps give a block as many steps as positions: its
    warning says why it does nothing (block's minimum is one token), naming the profile's threshold."""
    prof = tmp_path / "p.yaml"
    prof.write_text("decode:\n  steps: 16\n  threshold: 0.85\n  gen_length: 16\n  block_length: 8\n")
    res = cli("generate", "--model", SDAR, "--profile", prof, "--schedule", "block", "--no-chat", "Sort: 3 1 2")
    assert res.exit_code == 0, res.stderr
    assert [ln for ln in res.stderr.splitlines() if ln.startswith("warning: --s")] == [
        f"warning: --schedule block at --steps 16 does nothing with --threshold 0.85 (profile {prof}): 8 steps a "
        "block for its 8 positions make block's per-step minimum one token, which the rule commits anyway; "
        "ignored (fewer steps than positions a block raise it, e.g. --steps 8)"], res.stderr


SDAR_MINIMUM = ("--threshold 0.85 (the sdar family's default): 8 steps a block for its 8 positions make block's "
                "per-step minimum one token, which the rule commits anyway; ignored (fewer steps than positions a "
                "block raise it, e.g. --steps 8)")
UNCAPPED = ("a block runs until no mask is left (steps count there only as block's per-step minimum or Dream's "
            "quota: --schedule block or dream); ignored")


@pytest.mark.parametrize("command", PROMPTED)
@pytest.mark.parametrize("model,flags,why", [
    (SDAR, ["--steps", "16"], f"--steps 16 does nothing with {SDAR_MINIMUM}"),  # 8 a block of 8: minimum 1
    (SDAR, ["--steps", "16", "--schedule", "block"],  # one warning names both flags: neither sends to the other
     f"--steps 16 with --schedule block does nothing with {SDAR_MINIMUM}"),
    (SDAR, ["--steps", "8"], None),  # 4 a block of 8: block's per-step minimum of 2
    ("tiny", ["--threshold", "0.5", "--steps", "8"], f"--steps 8 does nothing with --threshold 0.5: {UNCAPPED}"),
    ("tiny", ["--threshold", "0.5", "--steps", "8", "--schedule", "dream"], None),  # Dream's quota
])
def test_steps_the_threshold_rule_ignores_are_warned(command, model, flags, why, cli):
    """``--steps`` under the threshold rule counts only as block's per-step minimum (fewer steps a block than
    its positions) or Dream's quota (``decoding.commit.ignored_steps``): one warning that says which, in every
    command; none when it counts."""
    args = [a for a in _args(command, model, *flags) if a != "-q"]
    res = cli(*args, "Sort: 3 1 2")
    assert res.exit_code == 0, res.stderr
    warned = [line for line in res.stderr.splitlines() if line.startswith("warning: --s")]
    assert warned == ([] if why is None else [f"warning: {why}"]), res.stderr


@pytest.mark.parametrize("flag,value", [("--gen-length", "0"), ("--gen-length", "-5"), ("--steps", "0"),
                                        ("--block-length", "0"), ("--tau", "-1"), ("--tau", "abc")])
def test_resolve_settings_refuses_a_bad_value_in_the_flags_words(flag, value, cli):
    """The library's ``resolve_settings`` (README, Python API) checks the values it is given as the command
    line checks its flags: the same one line, never a Python exception from deeper down (``gen_length`` 0
    divided by zero); a number sent as text is refused as such."""
    from ecache_cli.errors import UsageError
    from ecache_cli.runs.settings import resolve_settings

    line = cli("generate", flag, value, "Sort: 3 1").stderr.strip().splitlines()[-1]
    key = flag[2:].replace("-", "_")
    parsed = int(value) if value.lstrip("-").isdigit() else value  # as a caller passes them: -1, "abc"
    decode, cache = ({}, {key: parsed}) if key == "tau" else ({key: parsed}, {})
    with pytest.raises(UsageError) as api:
        resolve_settings("tiny", decode, cache)
    assert line == f"error: {api.value}", (line, str(api.value))
    with pytest.raises(UsageError, match=r"^--gen-length '32' must be a number, not a string$"):
        resolve_settings("tiny", {"gen_length": "32"}, {})
    es = resolve_settings("tiny", {}, {"policy": "es-dllm", "proportions": "1/0.5", "positions": "0/0.1"})
    assert es.cache_params["proportions"] == "1/0.5"  # a text setting: its policy reads and checks it


def test_the_python_api_warns_the_same_ignored_schedule(llada_lm):
    """``Engine.start`` warns (``IgnoredSetting``) on the rule the command line warns with."""
    import warnings

    from ecache_cli.cache import make_policy
    from ecache_cli.engine import DecodeConfig, Engine
    from ecache_cli.errors import IgnoredSetting

    engine = Engine.from_loaded(llada_lm)
    with pytest.warns(IgnoredSetting, match=r"^--schedule dream does nothing with --threshold 0\.9: "):
        engine.start([[5, 6, 7]], DecodeConfig(gen_length=16, block_length=8, threshold=0.9, schedule="dream"),
                     make_policy("none"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredSetting)  # the quota counts with --steps: no warning
        engine.start([[5, 6, 7]], DecodeConfig(gen_length=16, block_length=8, threshold=0.9, schedule="dream",
                                               steps=8), make_policy("none"))
    with pytest.warns(IgnoredSetting, match=r"^--steps 8 does nothing with --threshold 0\.9: "):
        engine.start([[5, 6, 7]], DecodeConfig(gen_length=16, block_length=8, threshold=0.9, steps=8),
                     make_policy("none"))


def test_the_python_api_warns_steps_a_blocks_masks_run_out_before(llada_lm):
    """``Engine.start`` warns (``IgnoredSetting``) on steps beyond a block's masks under LLaDA's schedule, in
    the words ``ecache generate --steps`` warns with; steps the blocks use are not warned."""
    import warnings

    from ecache_cli.cache import make_policy
    from ecache_cli.engine import DecodeConfig, Engine
    from ecache_cli.errors import IgnoredSetting

    engine = Engine.from_loaded(llada_lm)
    with pytest.warns(IgnoredSetting, match=r"^--steps 64 gives each block 32 steps for its 8 masks; LLaDA's "):
        engine.start([[5, 6, 7]], DecodeConfig(gen_length=16, block_length=8, steps=64), make_policy("none"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredSetting)
        engine.start([[5, 6, 7]], DecodeConfig(gen_length=16, block_length=8, steps=16), make_policy("none"))


def test_a_whole_number_written_with_a_decimal_point_is_refused_in_every_place(cli):
    """``32.0`` for a whole-number setting: the command line refuses it as chat's ``/gen-length``, a request's
    ``max_tokens`` and ``DecodeConfig`` do, in the same words (typer alone would read it as 32)."""
    from ecache_cli.decoding.config import DecodeConfig
    from ecache_cli.errors import UsageError
    from ecache_cli.serve.protocol import ApiError, CompletionRequest, parse

    words = "32.0 must be a whole number ≥ 1 (e.g. 256)"
    res = cli("generate", "--gen-length", "32.0", "x")
    assert res.exit_code == 2 and res.stderr.strip() == f"error: --gen-length {words}", res.stderr
    chat = cli("chat", "-q", input="/gen-length 32.0\n")
    assert f"error: /gen-length {words}" in chat.stderr.splitlines(), chat.stderr
    with pytest.raises(ApiError, match=f"^max_tokens {re.escape(words)}$"):
        parse(CompletionRequest, {"model": "tiny", "prompt": "x", "max_tokens": 32.0})
    with pytest.raises(UsageError, match=r"^DecodeConfig gen_length=32\.0 must be a whole number ≥ 1"):
        DecodeConfig(gen_length=32.0)
    assert cli("generate", "--gen-length", "+32", "--block-length", "32", "-q", "x").exit_code == 0  # int() reads it


@pytest.mark.parametrize("given", ["0", "abc"])
def test_a_steps_example_fits_the_gen_length_in_every_place(cli, given):
    """A refused ``steps`` is shown an example that fits the canvas given beside it (one token a step: 32
    for a gen-length of 32), on the command line, in a request (beside ``max_tokens``), in ``DecodeConfig``
    and in lm-eval's model_args, not the default canvas's 256."""
    from ecache_cli.decoding.config import DecodeConfig
    from ecache_cli.errors import UsageError
    from ecache_cli.serve.protocol import ApiError, CompletionRequest, parse

    res = cli("generate", "--gen-length", "32", "--steps", given, "x")
    assert res.exit_code == 2 and res.stderr.rstrip().endswith("(e.g. 32)"), res.stderr
    with pytest.raises(ApiError, match=r"^steps .* \(e\.g\. 32\)$"):
        parse(CompletionRequest, {"model": "tiny", "prompt": "x", "max_tokens": 32,
                                  "steps": int(given) if given.isdigit() else given})
    with pytest.raises(UsageError, match=r"^DecodeConfig steps=.* \(e\.g\. 32\)$"):
        DecodeConfig(gen_length=32, block_length=32, steps=int(given) if given.isdigit() else given)
    pytest.importorskip("lm_eval")
    from ecache_cli.evaluation.lm_eval_adapter import EcacheLM

    with pytest.raises(UsageError, match=r"^model_args: steps=.* \(e\.g\. 32\)$"):
        EcacheLM.create_from_arg_string(f"model=tiny,device=cpu,gen_length=32,steps={given}")


#: Values refused before the "using model …" line (README: it comes first; a bad value is refused before
#: it): the model's family rules where the family is known before loading (the embedded model's, a
#: folder's), a device or dtype that is none, an empty prompt argument. (model, flags, what the error says)
BEFORE_THE_FIRST_LINE = [
    (SDAR, ["--alg-temp", "0.5"], "use it with --schedule dream (the block schedule"),
    (SDAR, ["--remasking", "origin"], "use it with --schedule dream (the block schedule"),
    (SDAR, ["--compat", "fastdllm"], "an SDAR model decodes with SDAR's own block-diffusion sampler: drop --compat"),
    ("tests/fixtures/llada2-mini", ["--compat", "fastdllm"], "a LLaDA2 model decodes with LLaDA2's own"),
    ("tiny", ["--compat", "fastdllm"], "LLaDA already decodes as Fast-dLLM's LLaDA generators: drop --compat"),
    ("tiny", ["--alg-temp", "0.5"], "use it with --schedule dream (the llada schedule"),
    ("tiny", ["--alg-temp", "-1"], "use it with --schedule dream (the llada schedule"),  # the schedule first: no
    # range hint to a value the schedule refuses
    ("tiny", ["--edit-threshold", "0.9"], "--edit-threshold is LLaDA2.1's token editing, for block-diffusion models; "
     "the llada model family attends bidirectionally"),
    ("tiny", ["--edit-threshold", "2"], "--edit-threshold is LLaDA2.1's token editing, for block-diffusion models; "
     "the llada model family attends bidirectionally"),  # the family first: no range hint to a refused value
    ("tiny", ["--dtype", "float8"], "--dtype 'float8' is not a dtype"),
    ("tiny", ["--device", "tpu"], "--device 'tpu' is not a device"),
    ("tiny", ["--threshold", "0.9", "--factor", "1"], "--threshold and --factor are two parallel-decoding rules; "
     "pass only one"),
    ("tiny", ["--task", "foo"], "--task 'foo' is not a task; use one of arith, code, list, gsm8k, math500, "
     "humaneval, mbpp"),
]


@pytest.mark.parametrize("command", [*COMMANDS, "chat"])
@pytest.mark.parametrize("model,flags,says", BEFORE_THE_FIRST_LINE, ids=lambda v: " ".join(v) if isinstance(v, list)
                         else None)
def test_a_value_the_model_refuses_is_refused_alone_before_the_first_line(command, model, flags, says, cli):
    """One error line, exit 2, and no "using model …" line or note before it, in every model command."""
    args = ["chat", "--gen-length", "16", "--block-length", "8"] if command == "chat" else \
        [a for a in _args(command, model) if a != "-q"]
    if command == "chat":
        args += ["--model", model]
    if command == "calibrate" and "--edit-threshold" in flags:  # calibrate has no such flag: still one line
        says = "no such option: --edit-threshold"
    if command == "chat" and "--task" in flags:  # chat takes no --task
        says = "no such option: --task"
    res = cli(*args, *flags, *([] if command in ("calibrate", "chat") else ["x"]), input="")
    assert res.exit_code == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and says in res.stderr, res.stderr


@pytest.mark.parametrize("command", ["profile", "calibrate"])
def test_an_unknown_sandbox_is_refused_alone_before_the_first_line(command, cli):
    """``--sandbox`` (the commands that score code) is a flag's value: checked with the others, before the
    "using model …" line and the note that the task is not scored without ``--allow-code-execution``."""
    args = [a for a in _args(command, "tiny") if a != "-q"]  # calibrate's --task list: the last --task wins
    res = cli(*args, "--task", "code", "--limit", "1", "--sandbox", "bogus")
    assert res.exit_code == 2, res.stderr
    says = "error: --sandbox 'bogus' is not a sandbox mode; use one of strict, auto, guard"
    assert res.stderr.strip() == says, res.stderr


@pytest.mark.parametrize("command", PROMPTED)
@pytest.mark.parametrize("model,cache", [(SDAR, "entropy"), ("tiny", "block")])
def test_a_cache_the_family_refuses_and_an_empty_prompt_come_before_the_first_line(command, model, cache, cli):
    flag = ["--policies", f"none,{cache}"] if command == "profile" else ["--cache", cache]
    args = [a for a in _args(command, model) if a not in ("-q", "none")]
    if command == "profile":
        args.remove("--policies")
    res = cli(*args, *flag, "x")
    assert res.exit_code == 2, res.stderr
    assert res.stderr.strip().splitlines() == [res.stderr.strip()] and "does not apply to the" in res.stderr
    empty = cli(*[a for a in _args(command, model) if a != "-q"], "")
    assert empty.exit_code == 2 and empty.stderr.strip() == ("error: prompt argument 1 '': a prompt is empty; give "
                                                             "at least one token of text"), empty.stderr


@pytest.mark.parametrize("command", [*PROMPTED, "serve"])
@pytest.mark.parametrize("value", ["0", "abc"])
def test_a_policy_parameter_is_refused_in_the_policys_range_before_the_first_line(command, value, cli):
    """``--refresh-every`` is dkv's every N steps (≥ 1) and ``prefix``'s (0 = block starts only): with dkv in
    the run, 0 and a text are refused in dkv's words, alone, before the "using model …" line, in every
    command, whichever option came first; with ``prefix`` 0 is taken."""
    runs = ["--policies", "none,dkv"] if command == "profile" else ["--cache", "dkv"]
    args = [command, "--gen-length", "16", "--block-length", "8", *([] if command == "serve" else ["x"])]
    first = cli(*args, "--refresh-every", value, *runs)
    last = cli(*args, *runs, "--refresh-every", value)
    kind = "a whole number ≥ 1" if value == "abc" else "≥ 1"
    want = f"error: --refresh-every {value} must be {kind} (dkv refreshes every N steps of a block; e.g. 8)"
    for res in (first, last):
        assert res.exit_code == 2 and res.stderr.strip() == want, res.stderr
    if command != "serve":
        taken = cli(*args, *(["--policies", "prefix"] if command == "profile" else ["--cache", "prefix"]),
                    "--refresh-every", "0", "-q")
        assert taken.exit_code == 0, taken.stderr


@pytest.mark.parametrize("flag,others,example", [("--steps", ["--gen-length", "32"], "32"),
                                                  ("--gen-length", ["--block-length", "8", "--steps", "4"], "32"),
                                                  ("--block-length", ["--gen-length", "24"], "24")])
def test_a_text_and_an_out_of_range_number_suggest_the_same_fitting_value(flag, others, example, cli):
    """``--steps abc`` and ``--steps 0`` beside ``--gen-length 32`` both suggest the gen-length's steps, a value
    the command takes without a warning (the example fits the other options given, whichever came first)."""
    for value in ("abc", "0"):
        for args in ([*others, flag, value], [flag, value, *others]):
            res = cli("generate", *args, "x")
            assert res.exit_code == 2 and res.stderr.strip().endswith(f"(e.g. {example})"), (args, res.stderr)
    ok = cli("generate", *others, flag, example, "Sort: 3 1 2")
    assert ok.exit_code == 0 and "warning" not in ok.stderr, ok.stderr


def test_a_policy_parameter_without_a_policy_names_every_policys_bound(cli):
    """With no policy named, ``--refresh-every``'s range is the loosest policy's and says which is stricter, so
    the message does not invite a value dkv then refuses; a policy's own range when it is named."""
    from ecache_cli.cache import POLICIES
    from ecache_cli.config import setting_ranges

    res = cli("generate", "--refresh-every", "abc", "x")
    assert res.stderr.strip() == ("error: --refresh-every abc must be a whole number ≥ 0 (0 = block starts only; "
                                  "dkv ≥ 1; e.g. 8)"), res.stderr
    for name, cls in POLICIES.items():
        for key, rng in cls.ranges.items():
            assert setting_ranges([name])[key] == rng, (name, key)
            assert setting_ranges([name, "none"])[key] == rng, (name, key)  # a policy without it adds nothing
    assert setting_ranges(["prefix", "dkv"])["refresh_every"].lo == 1  # several: the strictest


@pytest.mark.parametrize("command,flag", [("profile", "--data"), ("trace-drift", "--data"), ("calibrate", "--data"),
                                          ("profile", "--shots"), ("trace-drift", "--shots"),
                                          ("calibrate", "--shots")])
def test_a_task_option_without_task_is_worded_alike(command, flag, cli, tmp_path):
    """``--data`` and ``--shots`` belong to ``--task``: without it one message in every command that takes them
    (calibrate's ``--task`` is required, and its absence is worded as such only when neither is given)."""
    value = {"--data": str(tmp_path / "test.jsonl"), "--shots": "2"}[flag]
    res = cli(command, flag, value, *([] if command == "calibrate" else ["x"]))
    why = {"--data": "the benchmark the file holds", "--shots": "the solved examples are that task's"}[flag]
    assert res.exit_code == 2 and res.stderr.strip() == f"error: {flag} needs --task NAME ({why})", res.stderr
    if command != "calibrate":
        both = cli(command, "--task", "list", "x")
        assert both.stderr.strip() == ("error: --task chooses the prompts: pass either --task or prompts/--input, "
                                       "not both"), both.stderr
    else:
        alone = cli("calibrate")
        assert alone.exit_code == 2, alone.stderr
        assert alone.stderr.strip().startswith("error: missing option '--task' / '-t'"), alone.stderr


@pytest.mark.parametrize("command", PROMPTED)
def test_prompts_given_two_ways_are_a_usage_error_before_the_input_is_read(command, cli, tmp_path):
    """``--input`` beside prompt arguments is refused as such (exit 2) whether or not the file exists."""
    missing = tmp_path / "none.jsonl"
    res = cli(command, "--input", missing, "Sort: 1 2")
    assert res.exit_code == 2, res.stderr
    assert res.stderr.strip() == (f"error: --input {missing} and 1 prompt argument(s) given: pass prompts one way, "
                                  "as arguments or in the file"), res.stderr


@pytest.mark.parametrize("given", [True, False])
def test_a_run_file_with_records_is_refused_alone_before_the_first_line(given, cli, tmp_path):
    """``calibrate``'s run file (``--run-file``, or the default beside ``--out``) holding records is refused
    first and alone, as ``generate --output`` on an existing file is: nothing is overwritten."""
    run = tmp_path / "run.jsonl" if given else tmp_path / ".cp.calib.jsonl"
    run.write_text("x\n")
    res = cli("calibrate", "--task", "list", "--limit", "2", "--gen-length", "32", "--out", tmp_path / "cp.yaml",
              *(["--run-file", run] if given else []))
    assert res.exit_code == 2 and res.stderr.strip() == (f"error: run file {run} already exists; pass --resume to "
                                                         "continue it, or delete it (or pass another --run-file) to "
                                                         "start over"), res.stderr
    for flag, value, says in (("--dtype", "int7", "--dtype 'int7' is not a dtype"),
                              ("--device", "tpu", "--device 'tpu' is not a device")):  # a bad flag first, as generate
        bad = cli("calibrate", "--task", "list", "--limit", "2", "--gen-length", "32", "--out", tmp_path / "cp.yaml",
                  *(["--run-file", run] if given else []), flag, value)
        assert bad.exit_code == 2 and bad.stderr.startswith(f"error: {says}"), bad.stderr


def test_an_output_path_that_names_a_folder_is_refused_before_anything_is_made(cli, tmp_path):
    res = cli("generate", "--output", tmp_path / "out" / "x" / "..", "x")
    assert res.exit_code == 2 and res.stderr.strip() == (f"error: --output {tmp_path / 'out' / 'x' / '..'} is a "
                                                         f"folder; give a file name (e.g. {tmp_path / 'out'}"
                                                         "/out.jsonl)"), res.stderr
    assert not (tmp_path / "out").exists()  # nothing made on the way


@pytest.mark.parametrize("command", PROMPTED)
def test_a_surrogate_escape_in_a_record_is_an_input_error_before_the_load(command, cli, tmp_path):
    """``"\\ud800"`` is valid JSON but no UTF-8 text: named with the other record errors, alone, exit 2."""
    f = tmp_path / "sur.jsonl"
    f.write_text('{"prompt": "Sort: 3 1\\ud800"}\n{"messages": [{"role": "user", "content": "a\\udce9"}]}\n')
    res = cli(command, "--input", f)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and "2 of 2 record(s) invalid" in lines[0], res.stderr
    assert ("sur.jsonl:1: 'prompt' is not UTF-8 text (a lone surrogate U+D800 at character 10)" in lines[0]
            and "sur.jsonl:2: messages[0] 'content' is not UTF-8 text (a lone surrogate U+DCE9" in lines[0]), lines


def test_a_surrogate_escape_under_skip_invalid_and_in_data_is_named_not_a_traceback(cli, tmp_path):
    """``--skip-invalid`` gives such a line its error record (written with JSON's escapes, as read) and decodes the
    others; a ``--data`` line with one is named before the load, as its other bad lines are."""
    f = tmp_path / "sur.jsonl"
    f.write_text('{"prompt": "Sort: 3 1\\ud800"}\n{"prompt": "Sort: 4 1"}\n')
    res = cli("generate", "--gen-length", "16", "--block-length", "8", "--input", f, "--skip-invalid", "--jsonl")
    assert res.exit_code == 0, res.stderr
    first, second = (json.loads(line) for line in res.stdout.splitlines())
    assert first["prompt"] == "Sort: 3 1\ud800" and "lone surrogate U+D800" in first["error"] and "text" in second
    data = tmp_path / "gsur.jsonl"
    data.write_text('{"question": "What is 1+1?\\ud800", "answer": "#### 2"}\n')
    res = cli("profile", "--task", "gsm8k", "--data", data, "--policies", "none", "--limit", "1")
    assert res.exit_code == 2 and res.stderr.strip() == (
        f"error: --data {data}: 1 of 1 line(s) invalid, nothing decoded: {data}:1: 'question' is not UTF-8 text (a "
        "lone surrogate U+D800 at character 13); write the text itself, not a surrogate escape; each line must be "
        "one UTF-8 JSON object with the fields question, answer (the official gsm8k format)"), res.stderr


def test_watch_delay_without_watch_is_warned_and_ignored(cli):
    res = cli("generate", "--gen-length", "16", "--block-length", "8", "--watch-delay", "0.5", "Sort: 3 1 2")
    assert res.exit_code == 0, res.stderr
    assert res.stderr.splitlines()[1:] == ["warning: --watch-delay is not used without --watch (it slows the live "
                                           "view); ignored"], res.stderr


def test_an_unknown_policy_is_worded_alike_everywhere(cli):
    """``--cache``, ``--policies``, chat's ``/cache`` and the server's ``policy`` word a name that is no policy
    one way: ``<where> 'nosuch' is not a cache policy; use one of …``."""
    from ecache_cli.cache import make_policy, policies_for
    from ecache_cli.errors import UsageError

    listed = ", ".join(policies_for(False))
    for args, where in ((["generate", "--cache", "nosuch", "x"], "--cache"),
                        (["profile", "--policies", "none,nosuch", "x"], "--policies"),
                        (["trace-drift", "--cache", "nosuch", "x"], "--cache")):
        res = cli(*args)
        assert res.exit_code == 2 and res.stderr.strip() == (f"error: {where} 'nosuch' is not a cache policy; use one "
                                                             f"of {listed}"), res.stderr
    chat = cli("chat", "--gen-length", "16", "--block-length", "8", input="/cache nosuch\n/exit\n")
    assert f"error: /cache 'nosuch' is not a cache policy; use one of {listed}" in chat.stderr, chat.stderr
    with pytest.raises(UsageError, match="^policy 'nosuch' is not a cache policy; use one of none, "):
        make_policy("nosuch")  # a Python argument: named as the server's field is
    with pytest.raises(UsageError, match=r"^entropy parameter signal='bogus' is not a signal; use one of max-entr"):
        make_policy("entropy", signal="bogus")  # as tau=-1 is: the parameter, not the flag
    res = cli("profile", "--policies", "entropy:signal=bogus", "x")
    assert res.stderr.strip() == ("error: --policies 'entropy:signal=bogus': entropy parameter signal='bogus' is not "
                                  "a signal; use one of max-entropy, sum-entropy, max-confidence"), res.stderr


# --- interrupts, -q, progress off a terminal, existing output files: one rule in every command ---------------


def test_an_interrupt_while_the_command_line_loads_is_one_line_and_130():
    """Ctrl-C while ``ecache`` imports its command line (typer, rich, the subcommands: before any command's
    own handling) ends as every interrupt does: one line, exit 130, no traceback."""
    code = ("import builtins, ecache_cli.__main__ as m\n"
            "real = builtins.__import__\n"
            "def interrupted(name, *a, **k):\n"
            "    if name == 'cli':\n"
            "        raise KeyboardInterrupt\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = interrupted\n"
            "m.main()\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 130 and res.stderr == "error: interrupted\n", res.stderr


@pytest.mark.parametrize("code", [130, 0])
def test_a_thread_the_command_could_not_stop_ends_the_process_with_the_commands_status(code):
    """A thread recorded as outliving its command (``serve``'s engine thread inside a compile call) ends
    the process at once with the command's exit status and its last lines flushed: the interpreter's normal
    exit would wait for it here (a non-daemon thread), or tear it down (torch's ``terminate called``, 134)."""
    script = ("import sys, threading\n"
              "import ecache_cli.__main__ as m\n"
              "from ecache_cli import interrupts\n"
              "stuck = threading.Thread(target=threading.Event().wait)\n"
              "stuck.start()\n"
              "interrupts.outlived(stuck)\n"
              "def command():\n"
              "    print('the last line')\n"
              "    sys.stderr.write('error: interrupted')\n"
              f"    raise SystemExit({code})\n"
              "m._run = command\n"
              "m.main()\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stdout, res.stderr) == (code, "the last line\n", "error: interrupted"), res


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupt_before_the_command_starts_is_one_line_and_its_own_code(sig, code, monkeypatch, capsys):
    """An interrupt while the option parser runs (typer turns it into a silent exit 130) ends with one line
    and 130, or 143 for SIGTERM; one that a library swallowed before the command started ends the command
    before its body runs, as every interrupt does."""
    script = ("import signal, sys\n"
              "import ecache_cli.__main__ as m, ecache_cli.cli as cli\n"
              "parse = cli.EcacheGroup.parse_args\n"
              "def interrupted(self, ctx, args):\n"
              f"    signal.raise_signal(signal.{sig})\n"
              "    return parse(self, ctx, args)\n"
              "cli.EcacheGroup.parse_args = interrupted\n"
              "sys.argv = ['ecache', 'models']\n"
              "m.main()\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stderr, res.stdout) == (code, "error: interrupted\n", ""), res

    import typer

    from ecache_cli import interrupts
    from ecache_cli.cli import KEPT, handle_errors

    ran = []
    monkeypatch.setattr(interrupts, "early", getattr(signal, sig))
    with pytest.raises(typer.Exit) as exc:
        handle_errors(lambda **_: ran.append(1))()
    assert exc.value.exit_code == code and ran == [] and interrupts.early is None
    assert capsys.readouterr().err.splitlines() == [f"error: {KEPT}"]


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupt_that_surfaces_as_another_error_ends_as_the_interrupt(sig, code, capsys):
    """Ctrl-C inside a C extension's import comes back as ``ImportError: initialization failed``: every
    command (``cli.handle_errors``) still ends with one line and 130 (143 for SIGTERM), no traceback; the
    same error without an interrupt is not hidden."""
    import signal

    import typer

    from ecache_cli.cli import KEPT, app, handle_errors

    def body(**_):
        try:
            signal.raise_signal(getattr(signal, sig))
        except KeyboardInterrupt:
            raise ImportError("initialization failed") from None

    with pytest.raises(typer.Exit) as exc:
        handle_errors(body)()
    assert exc.value.exit_code == code
    assert capsys.readouterr().err.splitlines() == [f"error: {KEPT}"]

    def broken(**_):
        raise ImportError("initialization failed")

    with pytest.raises(ImportError):
        handle_errors(broken)()
    wrapped = [c.callback for c in app.registered_commands if c.name != "help"]
    assert len(wrapped) == 6 and all(hasattr(cb, "__wrapped__") for cb in wrapped)  # every command goes through it


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupt_during_an_import_arrives_after_it_and_a_swallowed_one_still_ends_the_command(
        sig, code, capsys, tmp_path, monkeypatch):
    """A signal that arrives while a module's top level runs is held until the import has finished (an
    exception there can be swallowed by the module or thrown through a C++ extension, ending in
    ``terminate called``): the module is whole, and the command then ends as interrupted, one line. An
    interrupt that a library catches and ignores still ends the command so, never with exit 0."""
    import importlib
    import signal
    import sys
    import time

    import typer

    from ecache_cli.cli import KEPT, handle_errors

    name = f"ecache_test_import_{sig.lower()}"
    (tmp_path / f"{name}.py").write_text(f"import signal, time\nsignal.raise_signal(signal.{sig})\ntime.sleep(0.1)\n"
                                         "WHOLE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)  # imported afresh, and forgotten after the test
    seen = {}

    def importing(**_):
        seen["whole"] = importlib.import_module(name).WHOLE
        time.sleep(5)  # the held signal is sent again 20 ms after the import and ends the command here
        seen["ran on"] = True

    start = time.monotonic()
    with pytest.raises(typer.Exit) as exc:
        handle_errors(importing)()
    assert exc.value.exit_code == code and seen == {"whole": True} and time.monotonic() - start < 2
    assert capsys.readouterr().err.splitlines() == [f"error: {KEPT}"]

    def swallowing(**_):
        try:
            signal.raise_signal(getattr(signal, sig))
        except KeyboardInterrupt:
            pass  # as a library that catches everything
        return "finished"

    with pytest.raises(typer.Exit) as exc:
        handle_errors(swallowing)()
    assert exc.value.exit_code == code and capsys.readouterr().err.splitlines() == [f"error: {KEPT}"]


#: Each command with -q and outputs in files, and the status lines it prints without -q.
QUIET = {
    "generate": (["generate", "--input", "{input}", "--output", "{dir}/o.jsonl"], []),
    "profile": (["profile", "x", "--policies", "none", "--warmup", "0", "--json", "{dir}/p.json", "--trace-dir",
                 "{dir}/tr", "--trace-steps", "2"], ["traces in "]),
    "trace-drift": (["trace-drift", "x", "--json", "{dir}/t.json", "--jsonl", "{dir}/t.jsonl"],
                    ["wrote ", "trace-drift: per-step"]),
    "calibrate": (["calibrate", "--task", "list", "--limit", "2", "--dry-run", "--taus", "0.5", "--refine", "0",
                   "--no-speed-check", "--json", "{dir}/c.json"], []),
    "profile --json -": (["profile", "x", "--policies", "none", "--warmup", "0", "--json", "-"], []),  # table: stderr
    "calibrate --json -": (["calibrate", "--task", "list", "--limit", "2", "--dry-run", "--taus", "0.5", "--refine",
                            "0", "--no-speed-check", "--json", "-"], []),
    "chat": (["chat", "--stdin", "Sort: 3 1 2\n/tau 0.5\n/save {dir}/s.jsonl\n/clear\n"],
             ["τ 0.5 · ", "saved 1 record", "conversation cleared"]),
}


@pytest.mark.parametrize("command", list(QUIET))
def test_quiet_leaves_stderr_to_warnings_notes_and_errors(command, cli, llada_dir, tmp_path):
    """README: ``-q`` (every command; ``models``: stdout only) leaves stderr to warnings, notes and errors: no first
    line, progress or status line (files written, traces made, chat's replies to its commands)."""
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "Sort: 3 1 2"}\n')
    args = [a.format(input=f, dir=tmp_path) for a in QUIET[command][0]]
    stdin = None
    if "--stdin" in args:
        i = args.index("--stdin")
        stdin, args = args[i + 1], args[:i] + args[i + 2:]
    small = [a for a in SMALL if a != "-q"]
    if command == "chat":
        small = [a for a in small if a != "--no-chat"]
    else:
        args += ["--model", str(llada_dir)]
    loud = cli(*args, *small, input=stdin)
    assert loud.exit_code == 0, loud.stderr
    for status in QUIET[command][1]:  # the status lines are there without -q
        assert any(line.startswith(status) for line in loud.stderr.splitlines()), (status, loud.stderr)
    for p in tmp_path.glob("*.json*"):  # the outputs: generate --output refuses an existing one
        if p != f:
            p.unlink()
    quiet = cli(*args, *small, "-q", input=stdin)
    assert quiet.exit_code == 0, quiet.stderr
    others = [ln for ln in quiet.stderr.splitlines() if ln.strip() and not ln.startswith(("warning: ", "note: "))]
    assert others == [], quiet.stderr


def test_an_interrupted_command_that_writes_no_records_says_only_interrupted(cli, monkeypatch):
    """Ctrl-C during ``ecache models`` (which writes no records) ends with ``interrupted`` alone, not the
    prompt commands' ``records written so far are kept``."""
    from ecache_cli.runs import models

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "catalogue", interrupted)
    res = cli("models")
    assert res.exit_code == 130 and res.stderr.splitlines() == ["error: interrupted"], res.stderr


def test_a_plot_adds_nothing_to_stderr_under_q(llada_dir, tmp_path):
    """``--plot`` under ``-q`` leaves stderr empty, in a fresh process (matplotlib names each font family it
    cannot find once per process: the STIX fonts of its math text where a system lacks them)."""
    out = tmp_path / "drift.png"
    p = _popen(["trace-drift", "x", "--model", str(llada_dir), *SMALL, "--plot", str(out)])
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0 and err.decode() == "" and out.stat().st_size > 0, err.decode()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_progress_off_a_terminal_is_a_periodic_line_in_every_command(command, cli, llada_dir, monkeypatch):
    """Off a terminal (a log) every command prints a plain progress line every $ECACHE_PROGRESS_INTERVAL
    seconds (0: at every report); -q prints none."""
    monkeypatch.setenv("ECACHE_PROGRESS_INTERVAL", "0")
    prompts = [] if command == "calibrate" else ["Sort: 3 1 2", "abc"]
    what, unit = {"generate": ("generate", "records"), "profile": ("profile", "runs"),
                  "trace-drift": ("trace-drift", "prompts"),
                  "calibrate": ("calibrate (none|τ=0.5)", "examples")}[command]
    # one format (terminal.Counter): done/total, percentage, rate, elapsed time, ETA, then what runs now
    head = (rf"{what}: \d+/2 {unit} \(\d+%\), (rate unknown|[\d.]+ {unit}/(s|min|h)), elapsed \d+:\d\d, "
            r"ETA (unknown|\d+:\d\d)")
    if command == "profile":
        head = head.replace("/2 ", "/\\d+ ")
    args = [a for a in _args(command, llada_dir) if a != "-q"]
    loud = cli(*args, *prompts)
    assert loud.exit_code == 0, loud.stderr
    lines = [ln for ln in loud.stderr.splitlines() if re.match(head, ln)]
    assert len(lines) >= 2, loud.stderr
    assert re.match(r"\S+( \S+)?: (\d+)/\2 ", lines[-1]), lines  # the last: all done
    assert [ln for ln in lines if re.match(r"\S+( \S+)?: (\d+)/(\d+) .* ETA \d", ln)], lines  # an ETA, once a rate
    quiet = cli(*args, "-q", *prompts)
    assert quiet.exit_code == 0 and not [ln for ln in quiet.stderr.splitlines() if re.match(head, ln)], quiet.stderr


#: Each output flag and whether an existing file is replaced (True) or refused unless --resume (False).
OUTPUTS = {
    "generate --output": (["generate", "x", "--output"], False),
    "profile --json": (["profile", "x", "--policies", "none", "--warmup", "0", "--json"], True),
    "trace-drift --jsonl": (["trace-drift", "x", "--jsonl"], True),
    "trace-drift --json": (["trace-drift", "x", "--json"], True),
    "calibrate --json": (["calibrate", "--task", "list", "--limit", "2", "--dry-run", "--taus", "0.5", "--refine",
                          "0", "--no-speed-check", "--json"], True),
    "calibrate --run-file": (["calibrate", "--task", "list", "--limit", "2", "--taus", "0.5", "--refine", "0",
                              "--no-speed-check", "--out", "{dir}/prof.yaml", "--run-file"], False),
}


@pytest.mark.parametrize("output", list(OUTPUTS))
def test_an_existing_output_file_is_replaced_unless_a_later_run_continues_it(output, cli, llada_dir, tmp_path):
    """README: an existing output file is replaced as a shell's ``>`` replaces it, except the two files a
    later run continues (``generate --output``, calibrate's run file): refused without --resume, exit 2,
    the file untouched."""
    args, replaced = OUTPUTS[output]
    f = tmp_path / "existing.out"
    f.write_text('{"old": "a previous run"}\n')
    res = cli(*[a.format(dir=tmp_path) for a in args], f, "--model", llada_dir, *SMALL)
    if replaced:
        assert res.exit_code == 0, res.stderr
        assert "previous run" not in f.read_text() and f.read_text().strip(), f.read_text()
    else:
        assert res.exit_code == 2, res.stderr
        assert "already exists" in res.stderr and "--resume" in res.stderr, res.stderr
        assert f.read_text() == '{"old": "a previous run"}\n'


def test_chat_save_replaces_an_existing_file(cli, tmp_path):
    f = tmp_path / "s.jsonl"
    f.write_text('{"old": "a previous run"}\n')
    res = cli("chat", "--gen-length", "16", "--block-length", "8", "-q", input=f"Sort: 3 1 2\n/save {f}\n")
    assert res.exit_code == 0, res.stderr
    records = [json.loads(line) for line in f.read_text().splitlines()]
    assert len(records) == 1 and records[0]["messages"][-1]["content"] == "Sort: 3 1 2", records


@pytest.mark.parametrize("sig,terminal,code,answers", [("SIGINT", True, 0, 1), ("SIGINT", False, 130, 0),
                                                       ("SIGTERM", True, 143, 0), ("SIGTERM", False, 143, 0)])
def test_chat_ctrl_c_stops_one_answer_and_sigterm_ends_the_session(sig, terminal, code, answers, cli, monkeypatch):
    """In chat at a terminal Ctrl-C stops the answer being decoded and the session goes on (the next line is
    answered); off a terminal (piped lines, a script) it ends the session as it ends every command, and so
    does SIGTERM (``timeout``, a scheduler) everywhere: one line, exit 130 / 143."""
    import signal

    from ecache_cli.runs import chat

    monkeypatch.setattr(chat, "_interactive", lambda: terminal)
    real, calls = chat.ChatSession._decode, {"n": 0}

    def decode(self, messages, ids):  # the first answer is interrupted
        calls["n"] += 1
        if calls["n"] == 1:
            signal.raise_signal(getattr(signal, sig))
        return real(self, messages, ids)

    monkeypatch.setattr(chat.ChatSession, "_decode", decode)
    res = cli("chat", "-q", "--gen-length", "16", "--block-length", "8", input="Sort: 3 1 2\nReverse: 4 5\n")
    assert res.exit_code == code, (res.exit_code, res.stderr)
    assert calls["n"] == 1 + answers and len(res.stdout.strip().splitlines()) == answers, res.stdout
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert errors == ([] if code == 0 else ["error: interrupted; the session ended (the answers so far were printed; "
                                            "files /save wrote are kept)"]), res.stderr


# --- a value that is no finite number: one message in every place that takes the setting --------------------

#: Each float setting, its flag, and the one message of a value that is no finite number.
NOT_FINITE = {
    "tau": ("--tau", "must be a finite number ≥ 0 (an entropy in nats; e.g. 0.5)"),
    "threshold": ("--threshold", "must be a finite number in (0, 1] (a confidence; e.g. 0.9)"),
    "top_p": ("--top-p", "must be a finite number in (0, 1] (a probability mass; e.g. 0.95)"),
    "temperature": ("--temperature", "must be a finite number ≥ 0 (0 = greedy; e.g. 0.7)"),
}


@pytest.mark.parametrize("value", ["nan", "inf", "abc"])
@pytest.mark.parametrize("name", list(NOT_FINITE))
def test_a_value_that_is_no_finite_number_has_one_message_everywhere(name, value, cli):
    """``--tau nan``, ``--tau abc``, chat's ``/tau abc``, ``"tau": "nan"`` in a request and the Python API
    (``make_policy``, ``DecodeConfig``) say the same words after their own label; exit 2, UsageError, 400."""
    from ecache_cli.cache import make_policy
    from ecache_cli.decoding.config import DecodeConfig
    from ecache_cli.errors import UsageError
    from ecache_cli.serve.protocol import ApiError, CompletionRequest, in_range, parse

    flag, says = NOT_FINITE[name]
    res = cli("generate", "x", flag, value)
    assert res.exit_code == 2 and res.stderr.strip() == f"error: {flag} {value} {says}", res.stderr
    if name in ("tau", "threshold"):  # the chat commands that set a float
        chat = cli("chat", "-q", "--gen-length", "16", "--block-length", "8", input=f"/{name} {value}\n")
        assert chat.stderr.splitlines()[0] == f"error: /{name} {value} {says}", chat.stderr
    with pytest.raises(ApiError) as api:
        parse(CompletionRequest, {"model": "m", "prompt": "x", name: value})
    assert (api.value.status, api.value.param, api.value.message) == (400, name, f"{name} {value} {says}")
    numbers = [value] if value == "abc" else [value, float(value)]
    if value != "abc":  # a JSON number (Python's json reads NaN and Infinity)
        with pytest.raises(ApiError) as api_number:
            in_range(name, float(value))
        assert api_number.value.message == f"{name} {value} {says}"
    for number in numbers:
        call = (lambda v: make_policy("entropy", tau=v)) if name == "tau" else (lambda v: DecodeConfig(**{name: v}))
        with pytest.raises(UsageError) as py:
            call(number)
        assert str(py.value).endswith(f"{name}={number!r} {says}"), str(py.value)


#: Each whole-number setting, its flag, and the one message of a value that is no whole number.
NOT_WHOLE = {
    "gen_length": ("--gen-length", "must be a whole number ≥ 1 (e.g. 256)"),
    "steps": ("--steps", "must be a whole number ≥ 1 (e.g. 256)"),
    "seed": ("--seed", "must be a whole number ≥ 0 (a 64-bit seed; e.g. 0)"),
}


@pytest.mark.parametrize("value", ["abc", "2.5"])
@pytest.mark.parametrize("name", list(NOT_WHOLE))
def test_a_value_that_is_no_whole_number_has_one_message_everywhere(name, value, cli):
    """``--gen-length abc``, chat's ``/gen-length abc``, lm-eval's ``gen_length=abc`` and the Python API
    (``DecodeConfig``) say the range check's words after their own label, as ``--tau abc`` does."""
    from ecache_cli.decoding.config import DecodeConfig
    from ecache_cli.errors import UsageError
    from ecache_cli.evaluation.lm_eval_adapter import EcacheLM

    flag, says = NOT_WHOLE[name]
    res = cli("generate", "x", flag, value)
    assert res.exit_code == 2 and res.stderr.strip() == f"error: {flag} {value} {says}", res.stderr
    if name == "gen_length":  # the chat command that sets a whole number
        chat = cli("chat", "-q", "--gen-length", "16", "--block-length", "8", input=f"/gen-length {value}\n")
        assert chat.stderr.splitlines()[0] == f"error: /gen-length {value} {says}", chat.stderr
    with pytest.raises(UsageError) as lm:
        EcacheLM.create_from_arg_string(f"model=tiny,device=cpu,{name}={value}")
    shown = repr(value) if value == "abc" else value  # lm-eval reads 2.5 as a number
    assert str(lm.value) == f"model_args: {name}={shown} {says}", str(lm.value)
    if name != "seed":  # DecodeConfig's fields
        with pytest.raises(UsageError) as py:
            DecodeConfig(**{name: value})
        assert str(py.value) == f"DecodeConfig {name}={value!r} {says}", str(py.value)


def _numeric_flags():
    """(command path, parameter, kind) of every int or float option of every ``ecache`` command, found by
    walking the app's commands, so an option added later is covered too."""
    import typer

    from ecache_cli.cli import app

    def kind(p):
        descriptor = getattr(p, "type_descriptor", None)  # typer ≥ 0.20
        annotation = getattr(descriptor, "annotation", None)
        if annotation in (int, float):
            return annotation
        name = getattr(getattr(p, "type", None), "name", "")  # click's own types
        return {"integer": int, "float": float}.get(name)

    out = []

    def walk(command, path):
        for p in command.params:
            if getattr(p, "opts", None) and not getattr(p, "is_flag", False) and kind(p) is not None:
                out.append((path, p, kind(p)))
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return out


#: What a command needs beside the flag so that only the flag is refused (a required option).
_NEEDS = {"calibrate": ["--task", "list"]}
_WHERE_IT_APPLIES = {"edit_threshold": ["--model", "tests/fixtures/llada2-mini"], "alg_temp": ["--schedule", "dream"]}


def test_every_numeric_flag_has_a_range_in_one_wording(cli, monkeypatch):
    """Every int and float option of every command (``serve --max-batch``, ``generate --ray``, ``calibrate
    --speed-check-limit``, ...) has a declared range (``config.option_ranges``); a text that is no number
    gets that range's words (``--max-batch abc must be a whole number ≥ 1 (e.g. 32)``), one line, exit 2, as
    a float's ``1e400`` does, named as typed (not ``inf``); and the range's example is taken by the
    parser and the range check (no suggestion is refused in turn)."""
    from ecache_cli.config import check_ranges, option_ranges

    ranges = option_ranges()
    flags = _numeric_flags()
    assert {"max_batch", "ray", "speed_check_limit", "request_timeout", "shutdown_grace", "group_size"} <= {
        p.name for _, p, _ in flags}
    missing = sorted({f"{' '.join(path)} {p.opts[0]}" for path, p, _ in flags if p.name not in ranges})
    assert missing == [], missing
    import typer

    from ecache_cli.cli import app

    root = typer.main.get_command(app)
    monkeypatch.setattr("typer.testing._get_command", lambda _: root)  # built once: ~250 runs in a second
    for path, p, kind in flags:
        flag = next(o for o in p.opts if o.startswith("--"))
        rng = ranges[p.name]
        assert rng.integer == (kind is int), (path, flag)
        # --edit-threshold: on a model family with token editing, --alg-temp: on Dream's schedule (each
        # refused first, as such, elsewhere)
        needs = [*_NEEDS.get(path[0], []), *_WHERE_IT_APPLIES.get(p.name, [])]
        for bad in ["abc", "1.5" if kind is int else "1e400"]:
            res = cli(*path, *needs, flag, bad)
            assert res.exit_code == 2 and res.stderr.splitlines() == [f"error: {flag} {bad} {rng.not_finite()}"], (
                path, flag, res.stderr)
        command = root
        for name in path:
            command = command.commands[name]
        ctx = command.make_context(path[-1], [*needs, flag, rng.example])
        assert ctx.params[p.name] == kind(rng.example), (path, flag)
        check_ranges(ctx.params)  # UsageError: the suggested value is refused by its own check


@pytest.mark.parametrize("spec,says", [
    ("entropy:tau=1e400", "entropy parameter tau=1e400 must be a finite number ≥ 0"),
    ("dual:refresh_every=1e2", "dual parameter refresh_every=1e2 must be a whole number ≥ 0"),
])
def test_a_policy_variants_value_is_named_as_typed(cli, spec, says):
    """``--policies name:key=value`` names a refused value as typed, as ``--tau 1e400`` does."""
    res = cli("profile", "--policies", spec, *SMALL, "x")
    assert res.exit_code == 2 and says in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_calibrate_lists_word_each_bad_entry_as_the_one_value_flag(cli):
    """calibrate's comma-list flags refuse an entry in the words of the flag that takes one value, naming
    the entry as typed (``--taus 1e400``, not ``inf``; ``--recent-k 1.5`` as ``generate --recent-k 1.5``),
    every bad entry named (those with one reason together), and keep what a list needs (each value once)."""
    cases = {("--taus", "nan"): "--taus nan must be a finite number ≥ 0 (an entropy in nats; e.g. 0.5)",
             ("--taus", "0.5,1e400"): "--taus 1e400 must be a finite number ≥ 0 (an entropy in nats; e.g. 0.5)",
             ("--taus", "-1,2"): "--taus -1 must be ≥ 0 (an entropy in nats; e.g. 0.5)",
             ("--recent-k", "1.5"): "--recent-k 1.5 must be a whole number ≥ 0 (e.g. 64)",
             ("--recent-k", "16,-1"): "--recent-k -1 must be ≥ 0 (e.g. 64)",
             ("--recent-steps", "0,x"): "--recent-steps x must be a whole number ≥ 0 (0 = off: the recent_k latest "
                                        "commits only; e.g. 4)",
             ("--shots", "-1"): "--shots -1 must be ≥ 0 (e.g. 4)",
             ("--taus", "0.5,0.50"): "--taus 0.5,0.50 lists 0.5 twice; give each value once: --taus 0.5",
             ("--taus", "0.1,abc,-1,inf"): "--taus abc and inf: each must be a finite number ≥ 0 (an entropy in nats; "
                                           "e.g. 0.5); --taus -1 must be ≥ 0 (an entropy in nats; e.g. 0.5)",
             ("--recent-k", "1.5,x,-2,y"): "--recent-k 1.5, x and y: each must be a whole number ≥ 0 (e.g. 64); "
                                           "--recent-k -2 must be ≥ 0 (e.g. 64)"}
    for (flag, value), says in cases.items():
        res = cli("calibrate", "--task", "list", flag, value)
        assert res.exit_code == 2 and res.stderr.splitlines() == [f"error: {says}"], (flag, value, res.stderr)
    same = cli("generate", "x", "--recent-k", "1.5")  # the one-value flag's words
    assert same.stderr.splitlines() == ["error: --recent-k 1.5 must be a whole number ≥ 0 (e.g. 64)"], same.stderr
    profile = cli("profile", "--shots", "-1")
    assert profile.stderr.splitlines() == ["error: --shots -1 must be ≥ 0 (e.g. 4)"], profile.stderr


def test_profile_policies_names_every_bad_entry(cli):
    """``profile --policies`` names every entry it refuses, as a comma-list flag does: the names that are no
    policy together, then each bad parameter in its own words."""
    listed = "none, prefix, dual, entropy, d2cache, dkv, dllm-cache, elastic, es-dllm, es-dllm-conf"
    cases = {"none,bogus,alsobad": f"--policies 'bogus' and 'alsobad' are not cache policies; use one of {listed}",
             "entropy:kr=3,none,dual:zz=1": "--policies 'entropy:kr=3': policy 'entropy' has no parameter 'kr'; it "
                                             "takes block_refresh, block_tau, recent_k, recent_steps, refresh_prompt, "
                                             "signal, tau; --policies 'dual:zz=1': policy 'dual' has no parameter "
                                             "'zz'; it takes refresh_every",
             "foo,entropy:tau=-1": f"--policies 'foo' is not a cache policy; use one of {listed}; --policies "
                                   "'entropy:tau=-1': entropy parameter tau=-1 must be ≥ 0 (an entropy in nats; e.g. "
                                   "0.5)"}
    for value, says in cases.items():
        res = cli("profile", "--policies", value, "x")
        assert res.exit_code == 2 and res.stderr.splitlines() == [f"error: {says}"], (value, res.stderr)


@pytest.mark.parametrize("name", ["tau", "temperature"])
def test_a_number_too_large_for_a_float_is_named_as_typed(name, cli):
    """``1e400`` (read as inf) is named as typed on the command line, in chat and in lm-eval's model_args."""
    from ecache_cli.errors import UsageError
    from ecache_cli.evaluation.lm_eval_adapter import EcacheLM

    flag = f"--{name}"
    says = NOT_FINITE[name][1]
    for command in (["generate", "x"], ["serve"], ["calibrate", "--task", "list"] if name != "tau" else ["chat"]):
        res = cli(*command, flag, "1e400")
        assert res.exit_code == 2 and res.stderr.splitlines() == [f"error: {flag} 1e400 {says}"], (command, res.stderr)
    if name == "tau":  # the chat command that sets it
        chat = cli("chat", "-q", "--gen-length", "16", "--block-length", "8", input="/tau 1e400\n")
        assert chat.stderr.splitlines()[0] == f"error: /tau 1e400 {says}", chat.stderr
    with pytest.raises(UsageError) as lm:
        EcacheLM.create_from_arg_string(f"model=tiny,device=cpu,{name}=1e400")
    assert str(lm.value) == f"model_args: {name}=1e400 {says}", str(lm.value)


def test_serve_port_that_is_no_whole_number_has_the_range_message(cli):
    res = cli("serve", "--port", "abc")
    assert res.exit_code == 2 and res.stderr.strip() == ("error: --port abc must be a whole number in 0..65535 "
                                                          "(0 = any free one; e.g. 8000)"), res.stderr


def test_every_suggested_value_is_taken_with_the_defaults():
    """The example a range message suggests (``e.g. 256``) is a value the same check takes, and, for a
    decode setting or policy parameter, one the command takes with its other settings left at their
    defaults: no hint leads to a second refusal."""
    from ecache_cli.cache import POLICIES, make_policy
    from ecache_cli.config import option_ranges
    from ecache_cli.runs.settings import resolve_settings

    # a setting of one sampler's rules: the model or the flag its own refusal names
    where = {"edit_threshold": ("tests/fixtures/llada2-mini", {}), "alg_temp": ("tiny", {"schedule": "dream"})}
    decode_names = set(DecodeConfig_ranges())
    for name, rng in option_ranges().items():
        assert rng.example, name
        for part in re.split(r"[,/]", rng.example):  # a list example (es-dllm's 1/0.5/0.25): each number
            rng.check_given(part)  # ValueError: the suggested value is outside its own range
        if name in decode_names:
            model, beside = where.get(name, ("tiny", {}))
            value = int(rng.example) if rng.integer else float(rng.example)
            resolve_settings(model, {name: value, **beside}, {"policy": "none"})
    for policy, cls in POLICIES.items():
        for key, rng in cls.ranges.items():
            if not re.search(r"[,/]", rng.example):
                make_policy(policy, **{key: int(rng.example) if rng.integer else float(rng.example)})


def DecodeConfig_ranges() -> dict:
    from ecache_cli.decoding.config import DecodeConfig

    return DecodeConfig.ranges


#: Each command with output paths in one new folder (every output flag it has), by the flag that names it.
NEW_FOLDER_OUTPUTS = {
    "generate": ["generate", "x", "--output", "{d}/o.jsonl"],
    "profile": ["profile", "--policies", "none", "x", "--json", "{d}/p.json", "--trace-dir", "{d}/tr"],
    "trace-drift": ["trace-drift", "x", "--plot", "{d}/p.png", "--jsonl", "{d}/t.jsonl", "--json", "{d}/s.json",
                    "--tensorboard", "{d}/tb"],
    "calibrate": ["calibrate", "--task", "list", "--limit", "2", "--json", "{d}/c.json", "--plot", "{d}/c.png",
                  "--out", "{d}/cp.yaml", "--run-file", "{d}/run.jsonl"],
}


@pytest.mark.parametrize("command", list(NEW_FOLDER_OUTPUTS))
def test_a_run_refused_on_its_settings_leaves_no_folder_behind(command, cli, tmp_path):
    """The output paths are checked (their folders created) once the settings stand, in every command: a
    run refused on them (the tiny model's block length 32 does not divide --gen-length 16) is that one
    error line, exit 2, and no folder of its outputs exists afterwards."""
    from ecache_cli.config import packaged_profiles_dir

    d = tmp_path / "new" / "sub"
    res = cli(*[a.format(d=d) for a in NEW_FOLDER_OUTPUTS[command]], "--gen-length", "16")
    assert res.exit_code == 2 and res.stderr.strip() == (
        "error: --gen-length 16 is not a multiple of --block-length 32: use a gen-length that is (e.g. 32) or a "
        "block length that divides 16 (block_length 32 from profile "
        f"{packaged_profiles_dir() / 'tiny' / 'default.yaml'}; pass the flag to override)"), res.stderr
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("command", ["generate", "profile", "trace-drift"])
@pytest.mark.parametrize("failure", ["input", "model"])
def test_a_run_that_fails_before_writing_leaves_no_folder_it_made(command, failure, cli, tmp_path):
    """A folder made for an output (and its new parents) that is still empty when the command ends is
    removed, in every command: a run refused on its input (a record without a prompt) or on the model's
    check of a prompt (text spelling the mask token) leaves none; a run that wrote its outputs keeps them."""
    d = tmp_path / "new" / "sub"
    args = [a.format(d=d) for a in NEW_FOLDER_OUTPUTS[command] if a != "x"]
    if failure == "input":
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": 5}\n')
        res = cli(*args, "--gen-length", "32", "--input", bad)
    else:
        res = cli(*args, "--gen-length", "32", "Sort: 3 1 <|mdm_mask|>")
    assert res.exit_code == 2 and "nothing decoded" in res.stderr, res.stderr
    assert not (tmp_path / "new").exists()
    res = cli(*args, "--gen-length", "32", "-q", "Sort: 3 1")
    assert res.exit_code == 0, res.stderr
    assert d.is_dir() and any(d.iterdir())


def _unread_warning(source: str) -> str:
    return (f"warning: stdin holds piped data, but the prompts come from {source}, so stdin is not read; drop "
            f"{source} to decode the piped lines, or pipe nothing")


@pytest.mark.parametrize("command", ["profile", "trace-drift"])
def test_piped_stdin_beside_task_is_warned_unread(command, cli, llada_dir, tmp_path):
    """Stdin is the prompt source only without another: piped data beside --task (profile's and
    trace-drift's prompt source) is left unread with one warning naming it (a prompt argument beside --task is
    refused; data still on its way down a pipe cannot be told from none, so this is no error). Beside
    prompt arguments or --input nothing is said: a command run per line of a `while read` loop inherits the
    loop's stdin. With nothing piped, nothing is said."""
    task = ["--task", "list", "--limit", "1"]
    loud = cli(*_args(command, llada_dir, *task), input="Reverse: 1 2\n")
    assert loud.exit_code == 0, loud.stderr
    said = [ln for ln in loud.stderr.splitlines() if ln.startswith("warning: stdin")]
    assert said == [_unread_warning("--task list")], loud.stderr
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "Sort: 3 1 2"}\n')
    for given, piped in ((task, None), (task, ""), (["Sort: 3 1 2"], "Reverse: 1 2\n"),
                         (["--input", f], "Reverse: 1 2\n")):
        quiet = cli(*_args(command, llada_dir, *given), input=piped)
        assert quiet.exit_code == 0 and "stdin" not in quiet.stderr, (given, quiet.stderr)


def test_stdin_data_is_seen_without_reading_it(monkeypatch, tmp_path):
    """``inputs.stdin_has_data`` on real descriptors: bytes waiting in a pipe, unread bytes of a redirected
    file; not an empty pipe, a file read to its end or /dev/null; and the data is still there after."""
    from ecache_cli.runs.inputs import stdin_has_data

    def check(stream, want):
        monkeypatch.setattr(sys, "stdin", stream)
        assert stdin_has_data() is want

    r, w = os.pipe()
    with os.fdopen(r, "r") as rs, os.fdopen(w, "w") as ws:
        check(rs, False)  # an empty pipe, its writer still open
        ws.write("Sort: 1 2\n")
        ws.flush()
        check(rs, True)
        assert rs.readline() == "Sort: 1 2\n"  # not consumed
    f = tmp_path / "p.txt"
    f.write_text("abc\n")
    with open(f) as fs:
        check(fs, True)
        fs.read()
        check(fs, False)
    with open(os.devnull) as null:
        check(null, False)


@pytest.mark.parametrize("command", ["profile", "trace-drift", "calibrate"])
def test_every_json_document_is_written_by_one_rule(command, cli, llada_dir, profiles_dir, tmp_path):
    """``--json`` in every command that has it (``outputs.write_json``): the document names its command
    first; to stdout (``-``) one line, the last; to a file indented by 2, the same document."""
    base = [a for a in _args(command, llada_dir) if a not in ("--json", "-")]
    prompts = [] if command == "calibrate" else ["Sort: 3 1 2"]
    res = cli(*base, "--json", "-", *prompts)
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert next(iter(doc)) == "command" and doc["command"] == command and doc["manifest"]["command"] == command
    out = tmp_path / "doc.json"
    res = cli(*base, "--json", out, *prompts)
    assert res.exit_code == 0, res.stderr
    text = out.read_text()
    assert text.startswith(f'{{\n  "command": "{command}",\n') and text.endswith("}\n")
    assert set(json.loads(text)) == set(doc)
