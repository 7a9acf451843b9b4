"""Hints that lead somewhere: every value an error message suggests is one the same command accepts.

Each case runs ``ecache generate`` with one bad value, reads the values its one-line error suggests
(``e.g. X``, ``use --steps A or B``, ``use one of ...``) and runs the same command again with each of them
in place of the bad one: every rerun must succeed."""

from __future__ import annotations

import re

import pytest

BASE = ["--gen-length", "16", "--block-length", "8"]

# (flag, bad value, the other flags of the command, the pattern whose groups are the suggested values)
CASES = [
    ("--gen-length", "20", ["--block-length", "8"], r"e\.g\. (\d+) or (\d+)"),
    ("--gen-length", "0", ["--block-length", "8", "--steps", "2"], r"e\.g\. (\d+)"),
    ("--gen-length", "5000", ["--block-length", "32"], r"e\.g\. (\d+)\)"),  # the multiples near it do not fit
    # the model's 4096 positions: the one that does
    ("--block-length", "0", ["--gen-length", "16"], r"e\.g\. (\d+)"),
    ("--steps", "3", BASE, r"use --steps (\d+) or (\d+)"),
    ("--steps", "0", BASE, r"e\.g\. (\d+)\)$"),  # the given gen-length's steps: no "at most N steps run" warning
    ("--steps", "1", BASE, r"use --steps ≥ (\d+)"),
    ("--threshold", "1.5", BASE, r"e\.g\. ([\d.]+)"),
    ("--temperature", "-1", BASE, r"e\.g\. ([\d.]+)"),
    ("--top-p", "2", BASE, r"e\.g\. ([\d.]+)"),
    ("--top-k", "0", BASE, r"e\.g\. (\d+)"),
    ("--factor", "0", BASE, r"e\.g\. ([\d.]+)"),
    ("--alg-temp", "-1", [*BASE, "--schedule", "dream"], r"e\.g\. ([\d.]+)"),
    ("--tau", "-1", BASE, r"e\.g\. ([\d.]+)"),
    ("--recent-k", "-2", BASE, r"e\.g\. (\d+)"),
    ("--cache", "lru", BASE, r"use one of ([\w, -]+)$"),
    ("--remasking", "bogus", BASE, r"use one of ([\w, ]+), or origin"),
    ("--remasking", "bogus", [*BASE, "--schedule", "dream"], r"or (origin) with --schedule dream"),
    ("--remasking", "random", [*BASE, "--threshold", "0.9"], r"use --remasking (\w+)$"),
]


@pytest.mark.parametrize("flag,bad,others,pattern", CASES, ids=[f"{c[0]}={c[1]}" for c in CASES])
def test_every_suggested_value_is_accepted_by_the_same_command(cli, flag, bad, others, pattern):
    r = cli("generate", *others, flag, bad, "Sort: 3 1 2")
    assert r.exit_code == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    m = re.search(pattern, line)
    assert m, line
    values = [v.strip() for g in m.groups() for v in g.split(",")]
    assert values
    for value in values:
        again = cli("generate", *others, flag, value, "Sort: 3 1 2")
        assert again.exit_code == 0, (flag, value, again.stderr)


def test_the_note_of_a_dropped_family_threshold_suggests_an_accepted_value(cli):
    """``--remasking random`` on SDAR drops the family's default threshold with a note; the remasking it
    suggests to keep the threshold rule is accepted by the same command."""
    from pathlib import Path

    sdar = str(Path(__file__).resolve().parent / "fixtures" / "sdar")
    r = cli("generate", "--model", sdar, "--gen-length", "16", "--remasking", "random", "Sort: 3 1 2")
    assert r.exit_code == 0, r.stderr
    (note,) = [line for line in r.stderr.splitlines() if line.startswith("note: ")]
    value = re.search(r"pass --remasking (\w+) to keep", note).group(1)
    again = cli("generate", "--model", sdar, "--gen-length", "16", "--remasking", value, "Sort: 3 1 2")
    assert again.exit_code == 0 and "note: " not in again.stderr, again.stderr


SDAR = str(__import__("pathlib").Path(__file__).resolve().parent / "fixtures" / "sdar")
LISTED = r"(?:use one of|use names from) ([\w, -]+)$"


@pytest.mark.parametrize("model", [None, SDAR], ids=["tiny", "sdar"])
@pytest.mark.parametrize("command", ["generate", "trace-drift", "profile", "chat"])
def test_every_policy_an_unknown_name_lists_is_one_the_command_runs_on_the_model(cli, command, model):
    """``--cache foo`` (``--policies none,foo``, chat's ``/cache foo``) lists the policies that apply to the
    model's attention (the embedded model's too, whose family is known before it loads), and the same
    command takes each of them: generate and trace-drift run each, profile runs them all, chat switches
    to each without an error."""
    m = ["--model", model] if model else []
    run = ["--gen-length", "16", "--block-length", "8", *m]
    if command == "chat":
        first = cli("chat", *run, input="/cache foo\n")
        assert first.exit_code == 2, first.stderr  # a piped script with a failed line
        (line,) = [ln for ln in first.stderr.splitlines() if ln.startswith("error: /cache")]
        listed = re.search(LISTED, line).group(1).split(", ")
        again = cli("chat", *run, input="".join(f"/cache {p}\n" for p in listed))
        assert again.exit_code == 0 and "error" not in again.stderr, again.stderr
    elif command == "profile":
        first = cli("profile", *run, "--policies", "none,foo", "x")
        assert first.exit_code == 2, first.stderr
        listed = re.search(LISTED, first.stderr.strip().splitlines()[-1]).group(1).split(", ")
        again = cli("profile", *run, "-q", "--warmup", "0", "--repeats", "1", "--policies", ",".join(listed), "x")
        assert again.exit_code == 0, again.stderr
    else:
        first = cli(command, *run, "--cache", "foo", "x")
        assert first.exit_code == 2, first.stderr
        listed = re.search(LISTED, first.stderr.strip().splitlines()[-1]).group(1).split(", ")
        for policy in listed:
            again = cli(command, *run, "-q", "--cache", policy, "x")
            assert again.exit_code == 0, (policy, again.stderr)
    assert ("block" in listed) == (model == SDAR) and "none" in listed, listed


def test_the_note_of_a_threshold_dropped_for_alg_temp_names_alg_temp(cli, dream_dir, tmp_path):
    """``--alg-temp`` drops a profile's threshold with a note whose hint undoes what caused it (drop
    ``--alg-temp``), not a flag the user already passed; following it keeps the threshold, with no note."""
    prof = tmp_path / "p.yaml"
    prof.write_text("decode: {threshold: 0.9}\n")
    run = ["generate", "--model", str(dream_dir), "--profile", str(prof), "--gen-length", "16", "--block-length",
           "8", "--no-chat", "--remasking", "low_confidence"]
    r = cli(*run, "--alg-temp", "0.5", "x")
    assert r.exit_code == 0, r.stderr
    (note,) = [line for line in r.stderr.splitlines() if line.startswith("note: ")]
    assert "(drop --alg-temp to keep the threshold rule)" in note and "--remasking" not in note, note
    again = cli(*run, "x")
    assert again.exit_code == 0 and "note: " not in again.stderr, again.stderr


@pytest.mark.parametrize("command,flag,value", [("/threshold", "--threshold", "2"), ("/tau", "--tau", "-1"),
                                                ("/gen-length", "--gen-length", "0"),
                                                ("/threshold", "--threshold", "1.50"), ("/tau", "--tau", "1e400")])
def test_a_chat_command_refuses_a_value_in_its_flags_words(cli, command, flag, value):
    """Chat's ``/threshold 2`` is refused with ``generate --threshold 2``'s message, the command in place of
    the flag and the value as typed in both: one check, not a second copy."""
    chat = cli("chat", "--gen-length", "16", "--block-length", "8", input=f"{command} {value}\n")
    assert chat.exit_code == 2, chat.stderr  # a piped script with a failed line
    (said,) = [line for line in chat.stderr.splitlines() if line.startswith(f"error: {command}")]
    gen = cli("generate", "--gen-length", "16", "--block-length", "8", flag, value, "x")
    assert gen.exit_code == 2, gen.stderr
    assert said == gen.stderr.strip().replace(f"{flag} {value}", f"{command} {value}", 1), said  # named as typed


@pytest.mark.parametrize("model", ["tiny", SDAR], ids=["tiny", "sdar"])
@pytest.mark.parametrize("source", ["argument", "input"])
def test_the_gen_length_a_canvas_too_long_suggests_is_one_the_run_takes(cli, tmp_path, model, source):
    """A prompt plus ``--gen-length`` past the model's positions: the gen-length the error suggests (before
    the load for a prompt argument, whose tokens are counted there) is whole
    blocks (the family's block length; SDAR's last block decodes whole, a block-diffusion canvas being
    block_length − 1 positions wider) and a run with it passes every check, one block more does not. The
    suggestion is checked by starting the run (the checks run there), not by decoding thousands of tokens."""
    from ecache_cli.cache import make_policy
    from ecache_cli.engine import DecodeConfig, Engine
    from ecache_cli.errors import UsageError
    from ecache_cli.models.loader import load_model
    from ecache_cli.runs.settings import resolve_settings

    prompt = "Sort: " + "3 1 2 " * 20  # longer than the room the longest gen-length leaves (less than a block)
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "%s"}\n' % prompt)
    given = [prompt] if source == "argument" else ["--input", str(f)]
    alone = cli("generate", "--model", model, "--gen-length", "100000", *given)  # before the load, alone
    assert alone.exit_code == 2 and len(alone.stderr.strip().splitlines()) == 1, alone.stderr
    if source == "argument":  # its tokens are counted before the load: the prompt's own bound at once
        line = alone.stderr.strip()
    else:  # an --input file is read after the settings: beside a one-token prompt first, then its own
        assert "leaves no room for a prompt" in alone.stderr, alone.stderr
        most = int(re.search(r"use at most (\d+)", alone.stderr).group(1))
        r = cli("generate", "--model", model, "--gen-length", str(most), *given)
        assert r.exit_code == 2, r.stderr
        line = r.stderr.strip().splitlines()[-1]
    size = int(re.search(r"prompt \((\d+) tokens", line).group(1))
    fit = int(re.search(r"lower --gen-length to at most (\d+)", line).group(1))
    lm = load_model(model, device="cpu", dtype="float32")
    block = resolve_settings(model, {"gen_length": fit}, {}).decode.block_length
    assert fit % block == 0, (fit, block)
    engine, ids = Engine.from_loaded(lm), [[lm.spec.mask_id - 1] * size]  # a prompt of the measured size
    engine.start(ids, DecodeConfig(gen_length=fit, block_length=block), make_policy("none"))
    with pytest.raises(UsageError, match="exceeds the model's"):
        engine.start(ids, DecodeConfig(gen_length=fit + block, block_length=block), make_policy("none"))


@pytest.mark.parametrize("command", ["generate", "profile", "trace-drift"])
def test_a_prompt_too_long_among_several_is_named_by_its_number(cli, command):
    """The room check before the load names the prompt that is too long when there are several (``prompt 2
    (N tokens)``), counted from 1 as the other prompt refusals count; one prompt is ``prompt (N tokens)``."""
    long = " ".join(["word"] * 5000)
    extra = ["--policies", "none"] if command == "profile" else []
    for prompts, which in ((["Sort: 3 1 2", long], "prompt 2 ("), ([long], "prompt (")):
        res = cli(command, *extra, "--gen-length", "32", *prompts)
        assert res.exit_code == 2, res.stderr
        (line,) = res.stderr.strip().splitlines()
        assert line.startswith(f"error: {which}") and "tokens) + --gen-length 32 exceeds the model's" in line, line


@pytest.mark.parametrize("command", [("calibrate", "--limit", "2"), ("profile", "--limit", "2"),
                                     ("trace-drift", "--limit", "1")], ids=lambda c: c[0])
def test_a_task_runs_gen_length_hint_counts_its_own_prompts(cli, tmp_path, command):
    """``--task``'s prompts are known before the load (the embedded tokenizer, the task's examples and
    shots): the first refusal of a too-long ``--gen-length`` names the longest prompt the run encodes (as
    calibrate's sample, profile's task requests and trace-drift's read build them, after the load), and
    the gen-length it suggests passes the run's own check at that prompt length (checked by starting a
    run, not by decoding 4000 tokens)."""
    from ecache_cli.cache import make_policy
    from ecache_cli.engine import DecodeConfig, Engine
    from ecache_cli.errors import UsageError
    from ecache_cli.models.loader import load_model
    from ecache_cli.runs.calibrate import CalibrateOptions, _Sample
    from ecache_cli.runs.profile import task_setup
    from ecache_cli.runs.trace_drift import TraceOptions, read_first
    from ecache_cli.tasks import get_task

    outs = {"calibrate": ["--run-file", tmp_path / "r.jsonl", "--out", tmp_path / "p.yaml"]}.get(command[0], [])
    first = cli(*command, "--task", "list", *outs, "--gen-length", "8192")
    assert first.exit_code == 2 and len(first.stderr.strip().splitlines()) == 1, first.stderr
    named = re.search(r"^error: prompt (?:\d+ )?\((\d+) tokens\) \+ --gen-length 8192 exceeds", first.stderr)
    size = int(named.group(1))  # the longest prompt, numbered among several
    fit = int(re.search(r"lower --gen-length to at most (\d+)", first.stderr).group(1))
    lm = load_model("tiny", device="cpu", dtype="float32")
    engine = Engine.from_loaded(lm)
    if command[0] == "calibrate":
        ids = _Sample.encode(lm, get_task("list"), CalibrateOptions(task="list", limit=2)).prompt_ids
    elif command[0] == "profile":
        ids = engine.encode([r.prompt for r in task_setup("list", None, None, 2, 0, False)[1]], lm.chat)
    else:
        ids = engine.encode([p for p, _ in read_first(TraceOptions(prompts=[], task="list", limit=1))], lm.chat)
    assert size == max(len(i) for i in ids)
    cfg = DecodeConfig(gen_length=fit, block_length=32)
    engine.start([[5] * size], cfg, make_policy("none"))  # the run's check passes
    with pytest.raises(UsageError, match="exceeds the model's"):
        engine.start([[5] * size], DecodeConfig(gen_length=fit + 32, block_length=32), make_policy("none"))


def test_a_recalibration_command_carries_the_flags_this_machine_needs():
    """The command a τ-from-other-weights (or other-model) warning suggests: the profile's task without its
    suffixes, the embedded model's trained domains for ``default`` (with the consent code needs), the shots
    and parallel threshold it was calibrated at, and the dtype the format needs on a CPU."""
    from ecache_cli.config import load_profile
    from ecache_cli.runs.settings import recalibrate_command

    default = load_profile("default", "tiny")
    assert recalibrate_command("tiny", default, "int4") == (
        "ecache calibrate --task arith,code,list --allow-code-execution --shots 0,4 --quantize int4 --dtype bfloat16")
    own = {"task": "list-parallel-int8", "quantize": "int8", "decode": {"threshold": 0.9}}
    assert recalibrate_command("tiny", own, "none") == "ecache calibrate --task list --threshold 0.9"
    assert recalibrate_command("tiny", own, "int8") == "ecache calibrate --task list --threshold 0.9 --quantize int8"
    assert recalibrate_command("llada-8b", {"task": "default"}, "none") == (
        "ecache calibrate --task <tasks> --model llada-8b")
    # a hand-written profile's file name is no task: the model's trained domains, as for default
    mine = {"_path": "prof/my-settings.yaml", "cache": {"policy": "dual"}}
    assert recalibrate_command("tiny", mine, "none") == "ecache calibrate --task arith,code,list --allow-code-execution"
    assert recalibrate_command("llada-8b", mine, "none") == "ecache calibrate --task <tasks> --model llada-8b"
    assert recalibrate_command("tiny", {"_path": "p/list-parallel.yaml"}, "none") == "ecache calibrate --task list"


@pytest.mark.slow  # a calibration (a few τs on two examples, quantized): .ci/run's slow step
def test_the_recalibration_a_quantized_run_suggests_is_one_the_machine_runs(cli):
    gen = cli("generate", "--gen-length", "16", "--block-length", "16", "--quantize", "int4", "--dtype", "bfloat16",
              "--task", "list", "Sort: 3 1")
    assert gen.exit_code == 0, gen.stderr
    (command,) = re.findall(r"run `ecache calibrate ([^`]*)`", gen.stderr)
    res = cli("calibrate", *command.split(), "--limit", "2", "--dry-run", "-q")
    assert res.exit_code == 0, res.stderr


@pytest.mark.parametrize("source", ["argument", "stdin"])
def test_a_block_as_long_as_the_model_is_told_a_block_length_that_leaves_room(cli, source):
    """``--gen-length 4096 --block-length 4096`` on a model of 4096 positions: no whole block of 4096 leaves a
    prompt room, so the error suggests a gen-length in smaller blocks, which the run then takes (checked by
    starting it, as above), not only to shorten the prompt."""
    from ecache_cli.cache import make_policy
    from ecache_cli.engine import DecodeConfig, Engine
    from ecache_cli.models.loader import load_model

    given = {"argument": (["Sort: 3 1"], None), "stdin": ([], "Sort: 3 1\n")}[source]
    res = cli("generate", "--gen-length", "4096", "--block-length", "4096", *given[0], input=given[1])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    gen, block = map(int, re.search(r"use --gen-length (\d+) --block-length (\d+)", res.stderr).groups())
    assert (gen, block) == (4064, 32), res.stderr
    lm = load_model("tiny", device="cpu", dtype="float32")
    Engine.from_loaded(lm).start([[5] * 19], DecodeConfig(gen_length=gen, block_length=block), make_policy("none"))
