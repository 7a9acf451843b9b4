"""The lm-eval adapter (``--model ecache``) on the embedded model, through lm-eval's own API.

The task YAMLs (``tests/lm_eval_tasks``) hold held-out ``list`` examples; answers are compared with
``ecache generate`` on the same prompts and settings, never with hard-coded strings (the embedded
model is retrained from time to time).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from ecache_cli.cli import app  # noqa: E402
from ecache_cli.errors import UsageError  # noqa: E402
from ecache_cli.evaluation.likelihood import mask_counts, mc_loglikelihood  # noqa: E402
from ecache_cli.evaluation.lm_eval_adapter import EcacheLM, cut_at  # noqa: E402

TASKS = Path(__file__).parent / "lm_eval_tasks"
ARGS = "model=tiny,device=cpu,mc_num=16,mc_batch_size=8"


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """One lm-eval run of both test tasks (generate_until and multiple choice) with samples logged."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_DATASETS_OFFLINE", "1")  # the tasks' data is built in memory: nothing to download
    out = tmp_path_factory.mktemp("lm_eval") / "speed.json"
    try:
        res = lm_eval.simple_evaluate(model="ecache", model_args=f"{ARGS},stats_out={out}",
                                      tasks=["ecache_list", "ecache_list_mc"],
                                      task_manager=TaskManager(include_path=str(TASKS)), log_samples=True)
    finally:
        mp.undo()
    return res, out


def generate_jsonl(prompts: list[str], *flags: str) -> list[dict]:
    res = CliRunner().invoke(app, ["generate", "--jsonl", "-q", *flags, *prompts])
    assert res.exit_code == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


def test_generate_until_gives_the_answers_of_ecache_generate(evaluated, profiles_dir):
    res, _ = evaluated
    samples = res["samples"]["ecache_list"]
    prompts = [s["arguments"][0][0] for s in samples]
    until = samples[0]["arguments"][0][1]["until"]
    # the task asks max_gen_toks 32: one 32-token block, everything else at generate's defaults
    want = [cut_at(r["text"], until) for r in generate_jsonl(prompts, "--gen-length", "32")]
    got = [s["resps"][0][0] for s in samples]
    assert got == want
    assert any(w.strip() for w in want)  # not a comparison of empty strings
    exact = sum(g.strip() == s["target"].strip() for g, s in zip(got, samples)) / len(samples)
    assert res["results"]["ecache_list"]["exact_match,none"] == pytest.approx(exact)
    assert exact >= 5 / 6, got  # the README's scored table: the embedded model solves its held-out list problems


def test_speed_stats_sit_beside_the_scores(evaluated):
    res, out = evaluated
    speed = res["config"]["ecache"]["speed"]
    on_disk = json.loads(out.read_text())
    assert on_disk["speed"]["generate_until"] == json.loads(json.dumps(speed["generate_until"]))
    gen = speed["generate_until"]
    assert gen["requests"] == len(res["samples"]["ecache_list"]) and gen["world_size"] == 1
    assert gen["tokens_per_s"] == pytest.approx(gen["generated_tokens"] / gen["wall_s"])
    assert gen["refresh_rate"] == pytest.approx(gen["full_forwards"] / gen["nfe"])
    assert 0 < gen["refresh_rate"] < 1  # entropy (the default cache) refreshed some steps, not all
    assert gen["forwards"] == gen["nfe"] > 0 and [r["forwards"] for r in gen["ranks"]] == [gen["nfe"]]
    ll = speed["loglikelihood"]
    assert ll["requests"] == 2 * len(res["samples"]["ecache_list_mc"]) and ll["forwards"] == ll["requests"] * 2
    assert on_disk["manifest"]["settings"]["cache"] == "entropy"


def test_loglikelihood_prefers_the_right_answer_through_lm_eval(evaluated):
    res, _ = evaluated
    for s in res["samples"]["ecache_list_mc"]:
        (right, _), (wrong, _) = (r[0] for r in s["resps"])
        assert right > wrong, (s["doc"], right, wrong)
    assert res["results"]["ecache_list_mc"]["acc,none"] == 1.0


@pytest.fixture(scope="module")
def adapter():
    return EcacheLM.create_from_arg_string(ARGS + ",cache=none,batch_size=2")


def test_stop_strings_end_rows_early_with_the_same_prefix(adapter, profiles_dir):
    (full,) = generate_jsonl(["Sort: 9 3 7 1"], "--gen-length", "32", "--cache", "none")
    assert " " in full["text"], full["text"]  # the cut below must remove something
    req = Instance("generate_until", {}, ("Sort: 9 3 7 1", {"until": [" "], "max_gen_toks": 32}), 0)
    (text,) = adapter.generate_until([req])
    assert text == cut_at(full["text"], [" "]) and text != full["text"]
    assert adapter.speed["generate_until"]["nfe"] <= full["stats"]["nfe"]


def test_loglikelihood_is_deterministic_and_ranks_answers(adapter):
    reqs = [Instance("loglikelihood", {}, ("Reverse: 4 5 6", c), 0) for c in ("6 5 4", "zq xv kw", "6 5 4")]
    (a, greedy), (b, _), (c, _) = adapter.loglikelihood(reqs)
    assert a == c and a > b and greedy is False
    assert a < 0


def test_mc_estimate_follows_llada_sampler(adapter):
    import torch

    m = mask_counts(10, 8, torch.Generator().manual_seed(0))
    assert m.shape == (8,) and int(m.min()) >= 1 and int(m.max()) <= 10
    assert len(set(m.tolist())) == 8  # stratified: 8 distinct counts spread over 1..10
    lm = adapter.lm
    prefix = lm.tokenizer("Sort: 3 1", add_special_tokens=False)["input_ids"]
    target = lm.tokenizer(" 1 3", add_special_tokens=False)["input_ids"]
    one = mc_loglikelihood(lm.model, lm.spec, prefix, target, 8, 8, torch.Generator().manual_seed(1))
    two = mc_loglikelihood(lm.model, lm.spec, prefix, target, 8, 4, torch.Generator().manual_seed(1))
    assert one < 0 and two < 0 and one != two  # another batching draws other masks: a different sample
    with pytest.raises(UsageError, match="mc_batch_size=3 must be ≥ 1 and divide mc_num=8"):
        mc_loglikelihood(lm.model, lm.spec, prefix, target, 8, 3)


@pytest.mark.parametrize("arg, message", [
    ("steps=x", "model_args: steps='x' must be a whole number ≥ 1 (e.g. 256)"),
    ("temperature=x", "model_args: temperature='x' must be a finite number ≥ 0 (0 = greedy; e.g. 0.7)"),
    ("gen_length=2.5", "model_args: gen_length=2.5 must be a whole number ≥ 1 (e.g. 256)"),
    ("seed=x", "model_args: seed='x' must be a whole number ≥ 0 (a 64-bit seed; e.g. 0)"),
    ("seed=-1", "model_args: seed=-1 must be ≥ 0 (a 64-bit seed; e.g. 0)"),
    ("mc_num=2.5", "model_args: mc_num=2.5 must be a whole number"),
    ("greedy_check=maybe", "model_args: greedy_check='maybe' must be true or false"),
    ("chat=maybe", "model_args: chat='maybe' must be true or false"),
    ("early_exit=x", "model_args: early_exit='x' must be true or false"),
    ("tau=abc", "model_args: tau='abc' must be a finite number ≥ 0 (an entropy in nats; e.g. 0.5)"),
    ("task=nope", "model_args: task='nope' is not a task"),
])
def test_wrongly_typed_model_args_are_one_line_errors(profiles_dir, arg, message):
    with pytest.raises(UsageError) as e:
        EcacheLM.create_from_arg_string(f"model=tiny,device=cpu,{arg}")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("args, message", [
    ("gen_length=16,block_length=32", "gen_length=16 is not a multiple of block_length=32"),
    ("cache=foo", "cache='foo' is not a cache policy"),
    ("dtype=foo", "dtype='foo' is not a dtype; use one of"),
    ("device=foo", "device='foo' is not a device"),
    ("gen_length=32,block_length=8,steps=3", "steps=3 is fewer than the 4 blocks"),
    ("schedule=foo", "schedule='foo' is not a schedule; use one of"),
    ("remasking=foo", "remasking='foo' is not a remasking rule; use one of"),
    ("threshold=0.9,alg_temp=0.5,schedule=dream", "threshold"),
    ("model=nonsense", "model='nonsense' is neither"),
])
def test_errors_of_the_shared_checks_name_model_args_keys(profiles_dir, args, message):
    """The checks the adapter shares with the command line name its model_args keys (``gen_length=``),
    never a command-line flag (``--gen-length``)."""
    from ecache_cli.errors import EcacheError

    with pytest.raises(EcacheError) as e:
        EcacheLM.create_from_arg_string(f"model=tiny,device=cpu,{args}")
    assert message in str(e.value) and str(e.value).startswith("model_args: "), str(e.value)  # one prefix for all
    assert not re.search(r"--[a-z]", str(e.value)), str(e.value)


def test_model_args_message_renames_flags_with_a_key_only():
    from ecache_cli.evaluation.lm_eval_adapter import model_args_message

    assert model_args_message("--gen-length 16 is not a multiple of --block-length 32: use --steps ≥ 8") == \
        "gen_length=16 is not a multiple of block_length=32: use steps ≥ 8"
    assert model_args_message("add --force, or --no-chat, --cache 'x', --dtype bfloat16") == \
        "add force=true, or chat=false, cache='x', dtype=bfloat16"
    kept = "--threads 2 and lm-eval's --batch_size 8 stay"
    assert model_args_message(kept) == kept


def test_unwritable_stats_out_fails_before_decoding(tmp_path, profiles_dir):
    from ecache_cli.errors import EcacheError

    (tmp_path / "file").write_text("x")
    with pytest.raises(EcacheError, match="stats_out"):
        EcacheLM.create_from_arg_string(f"model=tiny,device=cpu,stats_out={tmp_path / 'file' / 'speed.json'}")


def test_an_output_path_that_is_a_file_fails_before_decoding(tmp_path, profiles_dir, monkeypatch):
    """lm-eval's ``--output_path`` (the speed JSON goes beside its results) that is a file, or lies under
    one, is refused when the model is made, naming the flag: not with a traceback after the evaluation."""
    from ecache_cli.errors import UsageError

    (tmp_path / "file").write_text("x")
    for path, said in ((tmp_path / "file", f"--output_path {tmp_path / 'file'} is a file; give a folder name"),
                       (tmp_path / "file" / "sub", f"--output_path {tmp_path / 'file' / 'sub'}: {tmp_path / 'file'} "
                                                  "is a file, not a folder; choose another path")):
        monkeypatch.setattr("sys.argv", ["lm_eval", "--model", "ecache", "--output_path", str(path)])
        with pytest.raises(UsageError) as e:
            EcacheLM.create_from_arg_string("model=tiny,device=cpu")
        assert str(e.value) == said


def test_bad_model_args_are_one_line_errors(profiles_dir):
    with pytest.raises(UsageError, match=r"model_args: taux=0\.5 is not an ecache setting"):
        EcacheLM.create_from_arg_string("model=tiny,device=cpu,taux=0.5")
    with pytest.raises(UsageError, match="batch_size='big' must be an integer"):
        EcacheLM.create_from_arg_string("model=tiny,device=cpu", {"batch_size": "big"})
    with pytest.raises(UsageError, match="cache='nope' is not a cache policy"):
        EcacheLM.create_from_arg_string("model=tiny,device=cpu,cache=nope")


@pytest.mark.parametrize("typed,says", [("tau=-1", "tau=-1 must be ≥ 0"),
                                         ("temperature=-1", "temperature=-1 must be ≥ 0"),
                                         ("tau=1e400", "tau=1e400 must be a finite number"),
                                         ("seed=1e3", "seed=1e3 must be a whole number ≥ 0 (a 64-bit seed"),
                                         ("gen_length=1e3", "gen_length=1e3 must be a whole number ≥ 1")])
@pytest.mark.parametrize("how", ["string", "argv"])
def test_model_args_numbers_are_named_as_typed(typed, says, how, profiles_dir, monkeypatch):
    """lm-eval reads ``tau=-1`` as -1.0, in its ``create_from_arg_string`` parser and in its own command line,
    which hands the model a dict; either way the error names ``tau=-1``, as ``--tau -1`` is named."""
    from lm_eval.utils import simple_parse_args_string

    args = f"model=tiny,device=cpu,{typed}"
    with pytest.raises(UsageError, match="^model_args: " + re.escape(says)):
        if how == "string":
            EcacheLM.create_from_arg_string(args)
        else:
            monkeypatch.setattr(sys, "argv", ["lm_eval", "--model", "ecache", "--model_args", args])
            EcacheLM.create_from_arg_obj(simple_parse_args_string(args))


def test_a_whole_number_model_arg_takes_what_the_flag_takes():
    """lm-eval reads ``-1`` and ``8.0`` as floats: ``-1`` stays a whole number (and is refused by the range),
    ``8.0`` and ``1e3``, which ``--seed`` refuses, are refused (``test_model_args_numbers_are_named_as_typed``)."""
    from typing import Annotated

    from ecache_cli.contract.fields import GivenFloat
    from ecache_cli.evaluation.lm_eval_adapter import _arg
    from ecache_cli.options import option_ranges

    seeded = Annotated[int, option_ranges()["seed"]]
    assert _arg("seed", GivenFloat("8"), seeded) == 8 and _arg("seed", 8.0, seeded) == 8  # no text: lm-eval's dict
    with pytest.raises(UsageError, match=r"^model_args: seed=8\.0 must be a whole number ≥ 0"):
        _arg("seed", GivenFloat("8.0"), seeded)
    with pytest.raises(UsageError, match=r"^model_args: seed=-1 must be ≥ 0"):
        _arg("seed", GivenFloat("-1"), seeded)


def lm_eval_cli(args: list[str], cwd, **env) -> subprocess.CompletedProcess:
    """lm-eval's own console script (``lm_eval``, installed next to this interpreter) in a fresh process."""
    exe = Path(sys.executable).parent / "lm_eval"
    assert exe.exists(), f"{exe}: lm-eval's console script is missing (pip install -e '.[eval]')"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", **env}
    return subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, timeout=300, cwd=cwd)


@pytest.mark.slow  # lm_eval's own command line in a fresh process: .ci/run's slow step
def test_lm_eval_command_line_runs_the_ecache_model(evaluated, tmp_path):
    """``lm_eval --model ecache`` itself (the installed ecache_lm_eval.pth registers the model in lm-eval
    releases without plugin discovery): a scored table, and the answers and scores of the in-process run."""
    res = lm_eval_cli(["--model", "ecache", "--model_args", f"{ARGS},stats_out={tmp_path / 'speed.json'}",
                       "--tasks", "ecache_list,ecache_list_mc", "--include_path", str(TASKS),
                       "--output_path", str(tmp_path / "out"), "--log_samples"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "|ecache_list   |" in res.stdout and "|ecache_list_mc|" in res.stdout and "exact_match" in res.stdout
    ref, _ = evaluated
    (results,) = (tmp_path / "out").glob("*/results_*.json")
    got = json.loads(results.read_text())["results"]
    for task, metric in (("ecache_list", "exact_match,none"), ("ecache_list_mc", "acc,none")):
        assert got[task][metric] == pytest.approx(ref["results"][task][metric])
    (samples,) = (tmp_path / "out").glob("*/samples_ecache_list_2*.jsonl")
    resps = {json.loads(line)["doc_id"]: json.loads(line)["resps"] for line in samples.read_text().splitlines()}
    assert resps == {s["doc_id"]: s["resps"] for s in ref["samples"]["ecache_list"]}
    assert json.loads((tmp_path / "speed.json").read_text())["speed"]["generate_until"]["requests"] == len(resps)


@pytest.mark.slow  # lm_eval's own command line in a fresh process: .ci/run's slow step
def test_lm_eval_command_line_prints_ecache_errors_on_one_line(tmp_path):
    res = lm_eval_cli(["--model", "ecache", "--model_args", "model=tiny,device=cpu,cache=foo",
                       "--tasks", "ecache_list", "--include_path", str(TASKS)], tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: model_args: cache='foo' is not a cache policy")


@pytest.mark.parametrize("flag, found", [("1", True), ("0", False)])
def test_the_startup_hook_registers_ecache_unless_turned_off(tmp_path, flag, found):
    code = ("from lm_eval.api.registry import get_model\n"
            "try:\n    print(get_model('ecache').__name__)\n"
            "except ValueError as e:\n    print('missing', 'hf' in str(e))")
    env = {**os.environ, "ECACHE_LM_EVAL_HOOK": flag}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    # off: lm-eval's own models are still there, only ecache is not
    assert res.stdout.split() == (["EcacheLM"] if found else ["missing", "True"])


def test_the_hook_leaves_a_registered_name_alone():
    from ecache_cli.evaluation.hook import TARGET, register

    class Registry(dict):
        def register(self, name, target):
            self[name] = target

    reg = Registry()
    assert register(reg) is True and reg == {"ecache": TARGET}
    reg["ecache"] = EcacheLM
    assert register(reg) is False and reg["ecache"] is EcacheLM


def test_the_entry_point_names_the_adapter():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="lm_eval.models") if e.name == "ecache"]
    assert ep.load() is EcacheLM


def test_greedy_check_recognises_the_greedy_continuation(profiles_dir):
    from ecache_cli.cache import make_policy
    from ecache_cli.engine import DecodeConfig

    lm = EcacheLM.create_from_arg_string(ARGS + ",greedy_check=true")
    prompt = "Reverse: 4 5 6"
    prefix = lm._encode_context(prompt)
    run = lm.engine.start([prefix], DecodeConfig(gen_length=6, block_length=6, steps=6, early_exit=False),
                          make_policy("none"))
    for _ in run:
        pass
    greedy_ids = run.results()[0].token_ids
    continuation = lm.tokenizer.decode(greedy_ids)
    assert lm.tokenizer(continuation, add_special_tokens=False)["input_ids"] == greedy_ids  # round trip
    reqs = [Instance("loglikelihood", {}, (prompt, c), 0) for c in (continuation, "zq xv kw")]
    (_, is_greedy), (_, other) = lm.loglikelihood(reqs)
    assert is_greedy is True and other is False


def test_sampling_model_args_at_temperature_0_warn_once_as_ecache_generate(profiles_dir, capsys):
    EcacheLM.create_from_arg_string("model=tiny,device=cpu,top_k=5")  # warned once the model is loaded, as the CLI
    err = capsys.readouterr().err
    assert err.count("warning: top_k does nothing at temperature 0") == 1, err  # the model_args key, not --top-k
    EcacheLM.create_from_arg_string("model=tiny,device=cpu,top_k=5,temperature=1.0")
    assert "does nothing at temperature 0" not in capsys.readouterr().err


@pytest.mark.parametrize("args,warned", [
    ("cache=dual,tau=0.5", "warning: tau is not used by cache=dual (it takes refresh_every); ignored"),
    ("cache=entropy,kr=3", "warning: kr is not used by cache=entropy (it takes "),
])
def test_a_cache_key_the_policy_does_not_take_is_warned_as_generate_warns_its_flag(profiles_dir, capsys, args,
                                                                                   warned):
    """model_args are the command line's flags: a cache key of another policy is one warning, in model_args'
    words, and the run goes on (``generate --cache dual --tau 0.5``); a key of no policy stays an error."""
    EcacheLM.create_from_arg_string(f"model=tiny,device=cpu,gen_length=32,{args}")
    err = capsys.readouterr().err
    assert err.count(warned) == 1, err
