"""The Python API (README "Python API": ``make_policy``, ``Engine.encode``, ``Engine.start``,
``Engine.generate``, ``Run.add``) refuses what the command line refuses, with
UsageError and the same message (the part after the flag or argument it names)."""

from __future__ import annotations

import pytest
from conftest import SMALL

from ecache_cli.cache import POLICIES, make_policy
from ecache_cli.engine import DecodeConfig, Engine
from ecache_cli.errors import UsageError

CFG = DecodeConfig(gen_length=16, block_length=8)


def _cli_error(cli, *args) -> str:
    res = cli(*map(str, args))
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    (line,) = res.stderr.strip().splitlines()
    return line


#: (what the API call is, the call, the command line that refuses the same value, the message both give)
CASES = [
    ("unknown policy parameter", lambda e: make_policy("entropy", kr=3),
     ["profile", "x", "--policies", "entropy:kr=3"], "policy 'entropy' has no parameter 'kr'; it takes "),
    ("a parameter of a policy that takes none", lambda e: make_policy("none", tau=1.0),
     ["profile", "x", "--policies", "none:tau=1"], "policy 'none' has no parameter 'tau'; it takes no parameters"),
    ("parameter out of range", lambda e: make_policy("entropy", tau=-1.0),
     ["generate", "x", "--cache", "entropy", "--tau", "-1"], "must be ≥ 0 (an entropy in nats; e.g. 0.5)"),
    ("parameter of the wrong type", lambda e: make_policy("entropy", tau="x"),
     ["profile", "x", "--policies", "entropy:tau=x"],
     "tau='x' must be a finite number ≥ 0 (an entropy in nats; e.g. 0.5)"),
    ("parameter NaN", lambda e: make_policy("entropy", tau=float("nan")),
     ["generate", "x", "--cache", "entropy", "--tau", "nan"],
     "must be a finite number ≥ 0 (an entropy in nats; e.g. 0.5)"),
    ("unknown policy", lambda e: make_policy("nope"),
     ["generate", "x", "--cache", "nope"], "'nope' is not a cache policy; use one of"),
    ("empty prompt", lambda e: e.encode([""], chat=False),
     ["generate", ""], "a prompt is empty; give at least one token of text"),
    ("blank prompt, chat", lambda e: e.generate(["   "], CFG, make_policy("none"), chat=True),
     ["generate", "   ", "--chat"], "a prompt is empty; give at least one token of text"),
    # the decode settings' ranges (DecodeConfig.ranges), the command line's flags checking the same values
    ("threshold above 1", lambda e: e.generate(["x"], DecodeConfig(gen_length=16, block_length=8, threshold=2),
                                               make_policy("none")),
     ["generate", "x", "--threshold", "2"], "must be in (0, 1] (a confidence; e.g. 0.9)"),
    ("threshold 1.5", lambda e: DecodeConfig(threshold=1.5),
     ["generate", "x", "--threshold", "1.5"], "must be in (0, 1] (a confidence; e.g. 0.9)"),
    ("negative factor", lambda e: DecodeConfig(factor=-1.0),
     ["generate", "x", "--factor", "-1"], "must be > 0 (e.g. 1.0)"),
    ("infinite temperature", lambda e: DecodeConfig(temperature=float("inf")),
     ["generate", "x", "--temperature", "inf"], "must be a finite number ≥ 0 (0 = greedy; e.g. 0.7)"),
    ("gen_length 0", lambda e: DecodeConfig(gen_length=0), ["generate", "x", "--gen-length", "0"], "must be ≥ 1"),
    # names and pairs refused with no model, when the DecodeConfig is made (not at generate)
    ("unknown remasking", lambda e: DecodeConfig(remasking="foo"), ["generate", "x", "--remasking", "foo"],
     "'foo' is not a remasking rule; use one of low_confidence, "),
    ("unknown schedule", lambda e: DecodeConfig(schedule="foo"), ["generate", "x", "--schedule", "foo"],
     "'foo' is not a schedule; use one of llada"),
    ("unknown compat", lambda e: DecodeConfig(compat="foo"), ["generate", "x", "--compat", "foo"],
     "'foo' is not a compatibility mode; use fastdllm"),
    ("threshold with factor", lambda e: DecodeConfig(threshold=0.9, factor=1.0),
     ["generate", "x", "--threshold", "0.9", "--factor", "1"],
     "factor are two parallel-decoding rules; pass only one"),
]


@pytest.mark.parametrize("kwargs, message", [
    ({"remasking": "foo"}, "DecodeConfig remasking='foo' is not a remasking rule; use one of low_confidence, random, "
                           "topk_margin, entropy, maskgit_plus, or origin with schedule='dream'"),
    ({"schedule": "foo"}, "DecodeConfig schedule='foo' is not a schedule; use one of llada (LLaDA's linear split), "),
    ({"compat": "foo"}, "DecodeConfig compat='foo' is not a compatibility mode; use fastdllm"),
    ({"threshold": 0.9, "factor": 1.0}, "DecodeConfig threshold and factor are two parallel-decoding rules; pass "
                                        "only one"),
])
def test_decode_config_names_its_own_keys(kwargs, message):
    """DecodeConfig words a bad name or pair in its keys, as it words a bad number (``DecodeConfig
    gen_length=0 must be ≥ 1``) and as lm-eval's model_args do: never a command-line flag."""
    with pytest.raises(UsageError) as e:
        DecodeConfig(**kwargs)
    assert str(e.value).startswith(message) and "--" not in str(e.value), str(e.value)


@pytest.mark.parametrize("call, message", [
    (lambda e: DecodeConfig(top_k="5"), "DecodeConfig top_k='5' must be a number, not a string (e.g. top_k=5)"),
    (lambda e: DecodeConfig(gen_length="32"), "DecodeConfig gen_length='32' must be a number, not a string (e.g. "
                                              "gen_length=32)"),
    (lambda e: DecodeConfig(threshold="0.9"), "DecodeConfig threshold='0.9' must be a number, not a string (e.g. "
                                              "threshold=0.9)"),
    (lambda e: make_policy("entropy", recent_k="64"), "entropy parameter recent_k='64' must be a number, not a string "
                                                      "(e.g. recent_k=64)"),
    (lambda e: e.generate(["x"], CFG, make_policy("none"), seed="1"), "seed '1' must be a number, not a string (e.g. "
                                                                      "1)"),
    # a text whose number is out of range or of the wrong kind: the range's words first, as the server's
    (lambda e: DecodeConfig(top_k="-1"), "DecodeConfig top_k='-1' must be ≥ 1"),
    (lambda e: DecodeConfig(top_k="0.5"), "DecodeConfig top_k='0.5' must be a whole number ≥ 1"),
    (lambda e: e.generate(["x"], CFG, make_policy("none"), seed="-1"), "seed '-1' must be ≥ 0 (a 64-bit seed"),
])
def test_a_number_given_as_text_is_refused_as_the_server_refuses_it(call, message, llada_lm):
    """A whole number or a float passed as a string is ``must be a number, not a string``, as the server
    words ``"top_k": "5"``, after the number itself is checked (its range, its kind)."""
    with pytest.raises(UsageError) as e:
        call(Engine.from_loaded(llada_lm))
    assert str(e.value).startswith(message), str(e.value)


def test_a_policy_parameter_that_takes_text_keeps_a_number_written_in_it():
    """es-dllm's ``proportions`` and ``positions`` are text (a comma list, one number for one stage) and
    entropy's ``signal`` a name: a number written there is the field's text, not a number given as a string."""
    policy = make_policy("es-dllm", proportions="1", positions="0")
    assert (policy.proportions, policy.positions) == ("1", "0")
    with pytest.raises(UsageError) as e:
        make_policy("entropy", signal="1")
    assert str(e.value).startswith("entropy parameter signal='1' is not a signal; use one of max-entropy"), str(e.value)


@pytest.mark.parametrize("what, call, cli_args, message", CASES, ids=[c[0] for c in CASES])
def test_api_refuses_what_the_cli_refuses(what, call, cli_args, message, llada_lm, llada_dir, cli):
    with pytest.raises(UsageError) as e:
        call(Engine.from_loaded(llada_lm))
    assert message in str(e.value), str(e.value)
    line = _cli_error(cli, *cli_args, "--model", llada_dir, *[a for a in SMALL if a not in cli_args])
    assert message in line, line


@pytest.mark.parametrize("ids, reason", [
    ([], "a prompt is empty; give at least one token id"),
    ([10 ** 8], "prompt_ids[0] = 100000000 is outside the model's vocabulary"),
    (["a"], 'prompt_ids[0] = "a" is not an int token id; give ids of the model\'s tokenizer'),
])
def test_token_ids_are_checked_at_every_entry(ids, reason, llada_lm):
    engine = Engine.from_loaded(llada_lm)
    for call in (lambda: engine.start([ids], CFG, make_policy("none")),
                 lambda: engine.start(engine.encode(["abc"], chat=False), CFG, make_policy("none")).add(ids)):
        with pytest.raises(UsageError, match=reason.replace("[", r"\[").replace("]", r"\]")):
            call()


def test_every_policy_refuses_an_unknown_parameter_and_keeps_its_own():
    for name, cls in POLICIES.items():
        with pytest.raises(UsageError, match=f"policy '{name}' has no parameter 'bogus'"):
            make_policy(name, bogus=1)
        assert isinstance(make_policy(name, **cls.test_params), cls)
    # internal callers holding one set of settings for several policies
    assert make_policy("none", strict=False, tau=1.0).name == "none"


def test_decode_config_must_be_one(llada_lm):
    engine = Engine.from_loaded(llada_lm)
    with pytest.raises(UsageError, match="cfg must be a DecodeConfig, not dict"):
        engine.start(engine.encode(["abc"], chat=False), {"gen_length": 16}, make_policy("none"))


@pytest.mark.parametrize("call, message", [
    (lambda e: e.encode("Sort: 3 1", chat=False), "prompts must be a list of prompts, not one string"),
    (lambda e: e.encode([None], chat=False), "prompt 1 is None; a prompt is text"),
    (lambda e: e.encode(["Sort: 3 1"], chat="yes"), r"^chat 'yes' must be True or False$"),
    (lambda e: e.generate(["Sort: 3 1"], CFG, make_policy("none"), chat=None), r"^chat None must be True or False$"),
    (lambda e: e.generate(["ok", 123], CFG, make_policy("none")), "prompt 2 is 123; a prompt is text"),
    (lambda e: make_policy(None), "None is not a cache policy; use one of"),
    (lambda e: make_policy("entropy", tau="0.5"), r"tau='0.5' must be a number, not a string \(e.g. tau=0.5\)"),
    (lambda e: DecodeConfig(temperature="0.5"),  # refused when made: not a TypeError in the first step
     r"DecodeConfig temperature='0.5' must be a number, not a string \(e.g. temperature=0.5\)"),
    (lambda e: DecodeConfig(threshold="0.9"), r"threshold='0.9' must be a number, not a string"),
    (lambda e: DecodeConfig(top_p="0.5"), r"top_p='0.5' must be a number, not a string"),
    (lambda e: e.start(e.encode(["abc"], chat=False), CFG, make_policy("none"), prompt_width=0),
     "prompt_width 0 must be a whole number ≥ 1"),
    (lambda e: e.start(e.encode(["abc"], chat=False), CFG, make_policy("none"), prompt_width=-1),
     "prompt_width -1 must be a whole number ≥ 1"),
    (lambda e: e.start([[5] * 28], CFG, make_policy("none"), prompt_width=10**7),  # the width, not the prompt
     r"^prompt_width 10000000 \+ gen_length 16 exceeds the model's (\d+) positions; use a prompt_width of at most "
     r"\d+ \(the longest prompt has 28 tokens\) or leave it unset$"),
    (lambda e: e.generate(["Sort: 3 1 2"], CFG, "entropy"),  # a policy's name where the policy belongs
     r"^policy must be a CachePolicy, not str: pass make_policy\('entropy'\) \(ecache_cli.cache\)$"),
    (lambda e: e.start(e.encode(["abc"], chat=False), CFG, None),
     r"^policy must be a CachePolicy, not NoneType: pass make_policy\(name\)"),
    (lambda e: e.generate(["Sort: 3 1 2"], CFG, make_policy("none"), seed=-1),  # --seed's range and words
     r"^seed -1 must be ≥ 0 \(a 64-bit seed; e.g. 0\)$"),
    (lambda e: e.start(e.encode(["abc"], chat=False), CFG, make_policy("none"), seed="abc"),
     r"^seed 'abc' must be a whole number ≥ 0 \(a 64-bit seed; e.g. 0\)$"),
    (lambda e: e.start(e.encode(["abc"], chat=False), CFG, make_policy("none"), seed=None),
     r"^seed None must be a whole number ≥ 0"),
    (lambda e: make_policy("entropy", tau=True),  # a bool for a number: the range's words, as the server's
     r"^entropy parameter tau=True must be a finite number ≥ 0 \(an entropy in nats; e.g. 0.5\)$"),
    (lambda e: DecodeConfig(temperature=True), r"^DecodeConfig temperature=True must be a finite number ≥ 0 \(0 = "
                                               r"greedy; e.g. 0.7\)$"),
    (lambda e: e.encode(["caf\udce9"], chat=True),  # bytes read with surrogateescape: the CLI's words
     r"^prompt 1: not UTF-8 text \(byte 0xe9 at character 4\); pass UTF-8 text$"),
    (lambda e: e.encode([[{"role": "user", "content": "ok"}], [{"role": "user", "content": "\ud800"}]], chat=True),
     r"^prompt 2: not UTF-8 text \(a lone surrogate U\+D800 at character 1\)"),
])
def test_wrong_kinds_of_argument_are_usage_errors(call, message, llada_lm):
    """A value of the wrong kind is refused in one line, never encoded as its text or a TypeError."""
    with pytest.raises(UsageError, match=message):
        call(Engine.from_loaded(llada_lm))


def test_the_widest_prompt_width_a_run_takes_is_the_one_its_refusal_names(llada_lm):
    """``prompt_width`` up to the model's positions less the generation starts a run; one more is refused
    naming that largest width."""
    engine, room = Engine.from_loaded(llada_lm), llada_lm.spec.max_positions - CFG.gen_length
    assert engine.start([[5, 6]], CFG, make_policy("none"), prompt_width=room).P == room
    with pytest.raises(UsageError, match=f"use a prompt_width of at most {room} "):
        engine.start([[5, 6]], CFG, make_policy("none"), prompt_width=room + 1)


def test_load_model_takes_force_as_a_bool(llada_dir):
    from ecache_cli.models.loader import load_model

    with pytest.raises(UsageError, match=r"load_model\(force='no'\): force is True or False"):
        load_model(llada_dir, "cpu", "float32", force="no")


def test_an_unused_tensor_is_one_warning_line(llada_dir, tmp_path, capsys):
    """A checkpoint holding a tensor its config does not use (here: a head under tied embeddings) loads, with
    one ``warning:`` line naming it."""
    import json
    import shutil

    from ecache_cli.models.loader import load_model

    d = tmp_path / "tied"
    shutil.copytree(llada_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "weight_tying": True}))
    capsys.readouterr()
    load_model(d, "cpu", "float32")
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "model.transformer.ff_out.weight" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("message, reason", [
    ({"role": "bot", "content": "hi"}, "messages[0] has role 'bot'; use one of system, user, assistant"),
    ({"role": "tool", "content": "hi"}, "messages[0] has role 'tool'; use one of system, user, assistant"),
    ({"role": "user", "content": 5}, "messages[0] 'content' must be a string, not 5"),
    ({"role": "user"}, 'messages[0] = {"role": "user"} is not a {role, content} message'),
])
def test_api_refuses_the_chat_messages_input_refuses(message, reason, llada_lm, llada_dir, cli, tmp_path):
    """``Engine.encode`` / ``Engine.generate`` check messages as ``generate --input`` checks a record's
    (``models.prompting.check_messages``): the same reason, nothing decoded."""
    import json

    eng = Engine.from_loaded(llada_lm)
    with pytest.raises(UsageError) as e:
        eng.encode([[message]], chat=True)
    assert str(e.value) == f"prompt 1: {reason}"
    with pytest.raises(UsageError) as e:
        eng.generate(["ok", [message]], CFG, make_policy("none"))
    assert str(e.value) == f"prompt 2: {reason}"
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"messages": [message]}) + "\n")
    line = _cli_error(cli, "generate", "--input", f, "--model", llada_dir, *SMALL)
    assert f"{f}:1: {reason}" in line, line


def test_a_caller_may_widen_the_chat_roles(llada_lm):
    """``Engine.encode(..., roles=...)``: a caller that takes more roles (``ecache serve``: OpenAI's ``tool``
    messages) passes them; the content is still checked."""
    eng = Engine.from_loaded(llada_lm)
    tool = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]
    roles = ("system", "user", "assistant", "tool")
    want = llada_lm.tokenizer.apply_chat_template(tool, tokenize=False, add_generation_prompt=True)
    ids = llada_lm.tokenizer(want, add_special_tokens=False)["input_ids"]
    assert eng.encode([tool], chat=True, roles=roles) == [ids]
    with pytest.raises(UsageError, match=r"^prompt 1: messages\[1\] 'content' must be a string, not 5$"):
        eng.encode([[tool[0], {"role": "tool", "content": 5}]], chat=True, roles=roles)


def test_engine_warns_the_top_k_greedy_decoding_ignores_as_the_cli_does(llada_lm, llada_dir, cli):
    """``top_k`` at temperature 0 under LLaDA's rules: the command line's warning, and ``Engine.start``'s
    ``IgnoredSetting`` with the same words; at temperature > 0 neither warns."""
    import warnings

    from ecache_cli.errors import IgnoredSetting

    engine = Engine.from_loaded(llada_lm)
    with pytest.warns(IgnoredSetting) as got:
        engine.generate(["abc"], DecodeConfig(gen_length=16, block_length=8, top_k=5), make_policy("none"), chat=False)
    res = cli("generate", "x", "--model", llada_dir, "--top-k", "5", *[a for a in SMALL if a != "-q"])
    assert res.exit_code == 0, res.stderr
    assert [f"warning: {w.message}" for w in got] == [ln for ln in res.stderr.splitlines() if "--top-k" in ln]
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredSetting)
        engine.generate(["abc"], DecodeConfig(gen_length=16, block_length=8, top_k=5, temperature=0.7),
                        make_policy("none"), chat=False)


def test_engine_start_names_each_prompt_by_its_place(llada_lm):
    """``Engine.start`` names the prompt it was passed, counted from 1 as ``Engine.encode`` and the command
    line count them, not a run's internals; ``Run.add`` names its own argument."""
    engine = Engine.from_loaded(llada_lm)
    with pytest.raises(UsageError) as empty:
        engine.start([[5, 6, 7], []], CFG, make_policy("none"))
    assert str(empty.value) == "prompt 2: a prompt is empty; give at least one token id"
    with pytest.raises(UsageError) as unknown:
        engine.start([[5, 10**6]], CFG, make_policy("none"))
    assert str(unknown.value).startswith("prompt 1: ") and str(unknown.value).endswith(
        "; give ids of the model's tokenizer"), str(unknown.value)
    run = engine.start([[5, 6, 7]], CFG, make_policy("none"))
    with pytest.raises(UsageError, match=r"^Run\.add prompt_ids: a prompt is empty; give at least one token id$"):
        run.add([])
