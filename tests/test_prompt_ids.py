"""Prompts as token ids through ``--input`` (``prompt_ids``) and the sampler flags ``--schedule`` / ``--compat``,
end to end through typer's CliRunner."""

from __future__ import annotations

import json

import pytest
from cli_helpers import one_line_error, records

from ecache_cli.cache import make_policy
from ecache_cli.engine import DecodeConfig, Engine
from ecache_cli.errors import DataError, UsageError

SMALL = ["--gen-length", "16", "--block-length", "8", "-q", "--cache", "none", "--jsonl"]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_prompt_ids_decode_as_the_text_prompt_does(cli, family, request, tmp_path):
    path, lm = request.getfixturevalue(f"{family}_dir"), request.getfixturevalue(f"{family}_lm")
    eng = Engine.from_loaded(lm)
    ids = eng.encode(["Sort: 9 3 7 1"], chat=False)[0]
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"prompt_ids": ids, "id": "a"}) + "\n" + json.dumps({"prompt": "Sort: 9 3 7 1"}) + "\n")
    res = cli("generate", "--model", path, *SMALL, "--input", f, "--no-chat", "-b", 2)
    assert res.exit_code == 0, res.stderr
    by_ids, by_text = records(res)
    assert by_ids["prompt_ids"] == ids and by_ids["id"] == "a" and by_ids["stats"]["prompt_tokens"] == len(ids)
    assert by_ids["token_ids"] == by_text["token_ids"] and len(set(by_ids["token_ids"])) > 2
    run = eng.start([ids], DecodeConfig(gen_length=16, block_length=8), make_policy("none"))
    list(run)
    assert by_ids["token_ids"] == run.results()[0].answer_ids


def test_prompt_ids_skip_the_chat_template(cli, dream_dir, dream_lm, tmp_path):
    ids = [5, 6, 7]
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"prompt_ids": ids}) + "\n")
    res = cli("generate", "--model", dream_dir, *SMALL, "--input", f, "--chat")
    assert res.exit_code == 0, res.stderr
    assert records(res)[0]["stats"]["prompt_tokens"] == 3  # used as is


@pytest.mark.parametrize("bad,needles", [
    ("[5, 128]", ["prompt_ids[1] = 128", "outside the model's vocabulary [0, 128)"]),
    ("[-1, 5]", ["prompt_ids[0] = -1", "outside"]),
    ("[5, 1.5]", ["prompt_ids[1] = 1.5", "not an int"]),
    ('[5, "7"]', ['prompt_ids[1] = "7"', "not an int"]),
    ("[true]", ["prompt_ids[0] = true", "not an int"]),
    ("[]", ["non-empty list"]),
    ('"5 6"', ["non-empty list"]),
    ("MASK", ["is the mask id"]),
])
def test_bad_prompt_ids_are_one_line_errors_naming_the_record(cli, llada_dir, llada_lm, tmp_path, bad, needles):
    bad = bad.replace("MASK", f"[5, {llada_lm.spec.mask_id}]")
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt_ids": [5, 6]}\n' + '{"prompt_ids": ' + bad + "}\n")
    res = cli("generate", "--model", llada_dir, *SMALL, "--input", f)
    one_line_error(res, 2, "in.jsonl:2", "nothing decoded", *needles)  # every record is checked first
    assert res.stdout == ""
    res = cli("generate", "--model", llada_dir, *SMALL, "--input", f, "--jsonl", "--skip-invalid")
    recs = records(res)
    assert recs[0]["prompt_ids"] == [5, 6] and "text" in recs[0] and "in.jsonl:2" in recs[1]["error"]


def test_text_that_spells_the_mask_token_is_refused_where_it_is_encoded(cli, llada_dir, llada_lm, tmp_path):
    """Prompt text that encodes to the mask id (its literal spelling) is refused when it is encoded, as a
    token-id prompt holding the mask id is: by the Python API (numbered among several prompts), by
    ``generate`` before anything is decoded, and as its own record with ``--skip-invalid``, the others
    decoded."""
    eng = Engine.from_loaded(llada_lm)
    mask = llada_lm.tokenizer.convert_ids_to_tokens(llada_lm.spec.mask_id)
    bad = f"Sort: 3 1 {mask}"
    (ids,) = eng.encode(["Sort: 3 1 "], chat=False)
    why = (f"the text holds the mask token {mask!r} (token id {llada_lm.spec.mask_id}, at position {len(ids)} of the "
           "encoded prompt); a prompt holds no mask tokens; remove it from the text")
    with pytest.raises(UsageError) as exc:
        eng.encode(["Sort: 2 1", bad], chat=False)
    assert str(exc.value) == f"prompt 2: {why}"
    with pytest.raises(UsageError) as exc:
        eng.encode([bad], chat=False)
    assert str(exc.value) == why
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Sort: 2 1", bad, "Sort: 4 3")))
    one_line_error(cli("generate", "--model", llada_dir, *SMALL, "--input", f, "--no-chat"), 2, "in.jsonl:2",
                   "nothing decoded", why)
    for given, stdin, head in ((["Sort: 2 1", bad], None, "prompt arguments: 1 of 2 argument(s) invalid"),
                               ([], f"Sort: 2 1\n{bad}\n", "stdin: 1 of 2 line(s) invalid")):
        res = cli("generate", "--model", llada_dir, *SMALL, "--no-chat", *given, input=stdin)
        one_line_error(res, 2, head, "nothing decoded", why)  # checked before the first prompt is decoded
        assert res.stdout == ""
    res = cli("generate", "--model", llada_dir, *SMALL, "--input", f, "--no-chat", "--skip-invalid")
    recs = records(res)
    assert [("text" in r, r.get("error", "").endswith(why)) for r in recs] == [(True, False), (False, True),
                                                                              (True, False)]


def test_engine_checks_ids_given_by_library_callers(llada_lm):
    eng = Engine.from_loaded(llada_lm)
    assert eng.encode([[4, 5, 6]], chat=True) == [[4, 5, 6]]
    with pytest.raises(DataError, match=r"prompt 2: prompt_ids\[0\] = 999 is outside"):
        eng.encode([[1], [999]], chat=False)


def test_schedule_and_compat_flags(cli, llada_dir, llada_lm, dream_dir, dream_lm):
    res = cli("generate", "abc", "--model", llada_dir, *SMALL, "--no-chat", "--schedule", "dream", "--steps", "16")
    assert res.exit_code == 0, res.stderr
    eng = Engine.from_loaded(llada_lm)
    (want,) = eng.generate(["abc"], DecodeConfig(gen_length=16, block_length=8, steps=16, schedule="dream"),
                           make_policy("none"), chat=False)
    (default,) = eng.generate(["abc"], DecodeConfig(gen_length=16, block_length=8, steps=16), make_policy("none"),
                              chat=False)
    assert records(res)[0]["token_ids"] == want.answer_ids != default.answer_ids
    assert records(res)[0]["settings"]["decode"]["schedule"] == "dream"
    res = cli("generate", "abc", "--model", dream_dir, *SMALL, "--no-chat", "--compat", "fastdllm", "--cache", "dual")
    assert res.exit_code == 0, res.stderr
    one_line_error(cli("generate", "abc", "--model", llada_dir, *SMALL, "--compat", "fastdllm"),
                   2, "Dream block sampler")
    one_line_error(cli("generate", "abc", "--model", llada_dir, *SMALL, "--schedule", "cosine"), 2, "'cosine'")
    one_line_error(cli("generate", "abc", "--model", llada_dir, *SMALL, "--compat", "x"), 2, "'x'", "fastdllm")


@pytest.mark.parametrize("alg", ["entropy", "maskgit_plus", "topk_margin"])
def test_cli_with_dreams_defaults_reproduces_diffusion_generate(cli, dream_dir, dream_lm, tmp_path, alg):
    """`ecache generate --model <dream dir>` on prompt ids, with Dream's one block and no cache, equals the plain
    loop of Dream's diffusion_generate (tests/test_dream_samplers.py)."""
    from test_dream_samplers import PROMPTS, dream_reference

    ids = Engine.from_loaded(dream_lm).encode(PROMPTS, chat=False)
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ids))
    res = cli("generate", "--model", dream_dir, "--input", f, "--jsonl", "-q", "-b", 3, "--gen-length", 16,
              "--block-length", 16, "--steps", 16, "--remasking", alg, "--cache", "none", "--no-early-exit")
    assert res.exit_code == 0, res.stderr
    want = dream_reference(dream_lm, ids, 16, 16, 16, alg)
    end_ids = {dream_lm.spec.eos_id, dream_lm.spec.eot_id}
    for rec, row in zip(records(res), want):  # token_ids: the answer, up to its first EOS/EOT
        cut = next((i for i, t in enumerate(row) if t in end_ids), len(row))
        assert rec["token_ids"] == row[:cut] and len(rec["token_ids"]) > 2
