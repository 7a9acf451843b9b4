"""``ecache generate`` end to end through typer's CliRunner (stdout and stderr are captured apart)."""

from __future__ import annotations

import pytest
import yaml
from cli_helpers import one_line_error, records
from conftest import SMALL

from ecache_cli.cache import make_policy
from ecache_cli.engine import DecodeConfig, Engine

STAT_KEYS = {"nfe", "full_forwards", "partial_forwards", "tokens_computed", "generated_tokens", "tokens_per_s",
             "wall_s", "prompt_tokens"}


def test_help_lists_the_four_subcommands(cli):
    res = cli("--help")
    assert res.exit_code == 0
    for cmd in ("generate", "profile", "calibrate", "trace-drift"):
        assert cmd in res.stdout


def test_generate_prints_the_engines_text(cli, llada_dir, llada_lm):
    res = cli("generate", "Sort: 9 3 7 1", "--model", llada_dir, *SMALL, "--cache", "none")
    assert res.exit_code == 0, res.stderr
    eng = Engine.from_loaded(llada_lm)
    (want,) = eng.generate(["Sort: 9 3 7 1"], DecodeConfig(gen_length=16, block_length=8), make_policy("none"),
                           chat=False)
    assert want.text.strip()  # the comparison is not between two empty strings
    assert res.stdout == want.text + "\n"


def test_jsonl_records_carry_stats(cli, dream_dir):
    res = cli("generate", "abc", "Reverse: 4 5 6", "--model", dream_dir, *SMALL, "--jsonl", "--seed", 3, "-b", 2)
    assert res.exit_code == 0, res.stderr
    recs = records(res)
    assert [r["index"] for r in recs] == [0, 1] and [r["prompt"] for r in recs] == ["abc", "Reverse: 4 5 6"]
    for r in recs:
        s = r["stats"]
        assert STAT_KEYS <= set(s)
        assert s["nfe"] == s["full_forwards"] + s["partial_forwards"] >= 1
        assert 1 <= s["generated_tokens"] <= 16 and s["wall_s"] > 0 and s["tokens_per_s"] > 0
        assert r["seed"] == 3 and r["settings"]["cache"] == "entropy"
        assert r["settings"]["decode"]["gen_length"] == 16 and r["settings"]["decode"]["block_length"] == 8
        assert isinstance(r["text"], str) and len(r["token_ids"]) <= 16


def test_stdin_pipeline_gives_one_record_per_line(cli, llada_dir):
    res = cli("generate", "--model", llada_dir, *SMALL, "--jsonl", input="a\n\nb\n")
    assert res.exit_code == 0, res.stderr
    assert [(r["index"], r["prompt"]) for r in records(res)] == [(0, "a"), (1, "b")]


def test_answers_cut_by_the_canvas_are_named_in_one_warning(cli, llada_dir):
    # on the random checkpoint the first answer writes an end token, the second fills its 16-token canvas
    res = cli("generate", "--model", llada_dir, *SMALL, "--jsonl", input="a\n\nb\n")
    assert res.exit_code == 0, res.stderr
    assert [(r["line"], r["ended"]) for r in records(res)] == [(1, True), (3, False)]
    assert res.stderr == ("warning: 1 of 2 answer(s) did not end within --gen-length 16 (input line 3): "
                          "the text may be cut; raise --gen-length\n")
    many = cli("generate", *"bcdefghijk", "--ban-eos", "--model", llada_dir, *SMALL, "--jsonl", "-b", 5)
    cut = [r["line"] for r in records(many) if not r["ended"]]
    assert cut == list(range(1, 11))  # with EOS banned no answer ends; the warning names the first 8
    assert many.stderr == (f"warning: {len(cut)} of 10 answer(s) did not end within --gen-length 16 (prompt "
                           f"{', '.join(map(str, cut[:8]))}, ...): the text may be cut; raise --gen-length\n")
    # the embedded model ends a short answer: no warning, and ``ended`` says so
    ok = cli("generate", "Reverse: 1 2", "Sort: 3 1 2", "--jsonl", "-q")
    assert ok.exit_code == 0 and ok.stderr == "", ok.stderr
    assert [r["ended"] for r in records(ok)] == [True, True]


def test_empty_stdin_is_a_usage_error(cli, llada_dir):
    one_line_error(cli("generate", "--model", llada_dir, *SMALL, "--jsonl", input=""), 2, "stdin was empty")


@pytest.mark.parametrize("args,needles", [
    (["--cache", "lru"], ["'lru'", "cache", "none, prefix, dual, entropy, d2cache"]),
    (["--block-length", "0"], ["--block-length 0"]),
    (["--steps", "1"], ["--steps 1", "2 blocks"]),
    (["--gen-length", "12"], ["--gen-length 12", "--block-length 8"]),
    (["--temperature", "-1"], ["--temperature -1"]),
    (["--signal", "mean"], ["--signal 'mean'"]),
    (["-b", "0"], ["--batch-size 0"]),
])
def test_bad_settings_exit_2(cli, llada_dir, args, needles):
    res = cli("generate", "hi", "--model", llada_dir, *SMALL, *args)
    one_line_error(res, 2, *needles)
    assert res.stdout == ""


def test_missing_model_dir_exits_1(cli, tmp_path):
    one_line_error(cli("generate", "hi", "--model", tmp_path / "nope", *SMALL), 1, "nope")


def test_unreadable_input_exits_1(cli, llada_dir, tmp_path):
    one_line_error(cli("generate", "--model", llada_dir, *SMALL, "--input", tmp_path / "none.jsonl"), 1, "none.jsonl")
    one_line_error(cli("generate", "--model", llada_dir, *SMALL, "--input", tmp_path), 1, "--input")  # a folder
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    res = cli("generate", "--model", llada_dir, *SMALL, "--input", bad, "--jsonl")
    one_line_error(res, 2, "latin1.jsonl:2", "UTF-8", "nothing decoded")  # every record is checked first
    assert res.stdout == ""


@pytest.mark.parametrize("batch", ["1", "4"])
def test_malformed_jsonl_line_stops_the_run_before_decoding(cli, llada_dir, tmp_path, batch):
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "one"}\n{"messages": [{"role": "user", "content": "two"}], "id": 7}\n{"prompt": \n'
                 '{"prompt": "four"}\n')
    res = cli("generate", "--model", llada_dir, *SMALL, "--input", f, "--jsonl", "-b", batch)
    one_line_error(res, 2, "1 of 4 record(s) invalid, nothing decoded", "in.jsonl:3", "JSON", "--skip-invalid")
    assert res.stdout == ""
    res = cli("generate", "--model", llada_dir, *SMALL, "--input", f, "--jsonl", "-b", batch, "--skip-invalid")
    recs = records(res)
    assert [r["index"] for r in recs] == [0, 1, 2, 3] and "error" in recs[2] and recs[3]["prompt"] == "four"
    assert recs[0]["prompt"] == "one" and recs[1]["id"] == 7 and "messages" in recs[1]


def test_record_without_prompt_exits_2(cli, llada_dir, tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text('{"question": "x"}\n')
    one_line_error(cli("generate", "--model", llada_dir, *SMALL, "--input", f), 2, "in.jsonl:1", "'prompt'")


def test_profile_unknown_key_exits_2(cli, llada_dir, tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump({"decode": {"gen_lenght": 8}}))
    one_line_error(cli("generate", "hi", "--model", llada_dir, "--profile", p, "-q"), 2, "decode.gen_lenght")
    p.write_text(yaml.safe_dump({"cache": {"policy": "dual"}, "speed": 3}))
    one_line_error(cli("generate", "hi", "--model", llada_dir, "--profile", p, "-q"), 2, "'speed'")
    one_line_error(cli("generate", "hi", "--model", llada_dir, "--profile", tmp_path / "gone.yaml", "-q"),
                   2, "gone.yaml")


def test_profile_values_are_used_and_flags_override(cli, llada_dir, tmp_path):
    p = tmp_path / "prof.yaml"
    p.write_text(yaml.safe_dump({"decode": {"gen_length": 8, "block_length": 4, "steps": 4, "ban_eos": True},
                                 "cache": {"policy": "dual", "refresh_every": 1}}))
    res = cli("generate", "hi", "--model", llada_dir, "--profile", p, "--no-chat", "-q", "--jsonl")
    assert res.exit_code == 0, res.stderr
    (r,) = records(res)
    dec = r["settings"]["decode"]
    assert (dec["gen_length"], dec["block_length"], dec["steps"]) == (8, 4, 4)
    assert r["settings"]["cache"] == "dual" and r["settings"]["cache_params"] == {"refresh_every": 1}
    assert r["settings"]["profile"] == str(p)
    assert len(r["token_ids"]) == 8 and r["stats"]["nfe"] == 4 == r["stats"]["full_forwards"]  # refresh_every 1
    res = cli("generate", "hi", "--model", llada_dir, "--profile", p, "--no-chat", "-q", "--jsonl",
              "--gen-length", "16", "--cache", "none", "--allow-eos")
    assert res.exit_code == 0, res.stderr
    (r,) = records(res)
    dec = r["settings"]["decode"]
    # the profile's steps follow --gen-length at its tokens per step: 16 × 4 / 8
    assert (dec["gen_length"], dec["block_length"], dec["steps"], dec["ban_eos"]) == (16, 4, 8, False)
    assert r["settings"]["cache"] == "none" and r["stats"]["nfe"] <= 8


@pytest.mark.parametrize("flags", [["--top-p", "0.3"], ["--top-k", "2"]])
def test_top_p_and_top_k_change_nothing_in_greedy_decoding_with_llada_rules(cli, llada_dir, flags):
    """The warning says they are ignored at temperature 0: the tokens and the steps are those without them
    (LLaDA's confidence is the unfiltered probability; a filter that renormalised it would reorder commits)."""
    prompts = ["Sort: 9 3 7 1", "Reverse: 4 5 6", "Sort: 2 8 5"]
    base = records(cli("generate", *prompts, "--model", llada_dir, *SMALL, "--jsonl"))
    got = records(cli("generate", *prompts, *flags, "--model", llada_dir, *SMALL, "--jsonl"))
    assert [(r["text"], r["stats"]["nfe"]) for r in got] == [(r["text"], r["stats"]["nfe"]) for r in base]


def test_more_steps_than_masks_warns_and_decodes_as_one_step_per_mask(cli, llada_dir):
    small = ["--gen-length", "16", "--block-length", "8", "--no-chat", "--jsonl"]  # SMALL without -q
    many = cli("generate", "Sort: 9 3 7 1", "--model", llada_dir, *small, "--steps", "64")
    assert many.exit_code == 0, many.stderr
    assert "warning: --steps 64 gives each block 32 steps for its 8 masks" in many.stderr
    plain = cli("generate", "Sort: 9 3 7 1", "--model", llada_dir, *small, "--steps", "16")
    assert "--steps" not in plain.stderr
    assert [(r["token_ids"], r["stats"]["nfe"]) for r in records(many)] == \
        [(r["token_ids"], r["stats"]["nfe"]) for r in records(plain)]
    dream_rule = cli("generate", "Sort: 9 3 7 1", "--model", llada_dir, *small, "--steps", "64", "--schedule", "dream")
    assert dream_rule.exit_code == 0 and "gives each block" not in dream_rule.stderr  # Dream's commits use every step
