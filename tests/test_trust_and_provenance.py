"""No silent garbage (broken checkpoints refused at load; warnings for JSONL on stdin, a task the model
was not trained for, empty answers, unsure answers) and saying what was used (model, policy, τ and
where τ came from, on stderr and in the JSON outputs)."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from cli_helpers import one_line_error, records
from safetensors.torch import load_file, save_file

from ecache_cli.config import packaged_profiles_dir
from ecache_cli.errors import ModelLoadError
from ecache_cli.models.loader import embedded_dir, load_model
from ecache_cli.models.registry import spec_from_config
from ecache_cli.models.synthetic import tiny_config

SMALL = ["--gen-length", "16", "--block-length", "8", "--no-chat"]


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("value, needle", [(float("nan"), "holds 1 non-finite value(s) (NaN or inf)"),
                                           (float("inf"), "holds 1 non-finite value(s)")])
def test_a_checkpoint_with_non_finite_weights_is_refused(cli, llada_dir, tmp_path, value, needle):
    d = _copy(llada_dir, tmp_path / "broken")
    w = load_file(d / "model.safetensors")
    name = sorted(w)[3]
    w[name].view(-1)[5] = value
    save_file(w, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=f"tensor {name} " + needle.replace("(", r"\(").replace(")", r"\)")):
        load_model(d, device="cpu", dtype="float32")
    one_line_error(cli("generate", "hi", "--model", d, *SMALL, "-q"), 1, name, "non-finite", "another checkpoint")


def test_a_checkpoint_of_integer_tensors_is_refused(cli, llada_dir, tmp_path):
    """Weights stored as integers (a quantized export ecache does not read) would be cast to floats and decode
    garbage with exit 0: refused at load, naming the tensor, its dtype and the fix."""
    import torch

    d = _copy(llada_dir, tmp_path / "int8")
    w = load_file(d / "model.safetensors")
    name = sorted(w)[0]
    w[name] = w[name].to(torch.int8)
    save_file(w, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=f"tensor {name} is stored as int8, not as floating-point weights"):
        load_model(d, device="cpu", dtype="float32")
    one_line_error(cli("generate", "hi", "--model", d, *SMALL, "-q"), 1, name, "int8", "--quantize")


def test_a_weight_that_overflows_the_dtype_names_the_fix(llada_dir, tmp_path):
    d = _copy(llada_dir, tmp_path / "big")
    w = load_file(d / "model.safetensors")
    name = sorted(w)[2]
    w[name].view(-1)[0] = 1e6  # finite in float32, beyond float16's 65504
    save_file(w, d / "model.safetensors")
    assert load_model(d, device="cpu", dtype="float32").dtype.is_floating_point
    with pytest.raises(ModelLoadError, match=f"tensor {name} overflows float16.*--dtype float32 or bfloat16"):
        load_model(d, device="cpu", dtype="float16")


@pytest.mark.parametrize("family, change, needle", [
    ("llada", {"n_heads": 3}, "n_heads 3 does not divide d_model 64"),
    ("llada", {"n_layers": 0}, "n_layers is 0; it must be ≥ 1"),
    ("llada", {"n_heads": 0}, "n_heads is 0; it must be ≥ 1"),
    ("llada", {"mlp_hidden_size": -8}, "mlp_hidden_size is -8"),
    ("llada", {"d_model": "abc"}, "field 'd_model' is 'abc'; it must be a whole number"),
    ("llada", {"d_model": 64.5}, "field 'd_model' is 64.5"),
    ("llada", {"d_model": None}, "field 'd_model' is null; it must be a whole number"),
    ("llada", {"mlp_hidden_size": "big"}, "field 'mlp_hidden_size' is 'big'; it must be a whole number"),
    ("llada", {"n_kv_heads": 0}, "n_kv_heads is 0; it must be ≥ 1"),
    ("llada", {"mask_token_id": 500}, "mask_token_id 500 (the mask token) is outside the vocabulary of 128 tokens"),
    ("llada", {"rms_norm_eps": 0}, "rms_norm_eps is 0.0; it must be a finite number > 0"),
    ("dream", {"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ("dream", {"vocab_size": -1}, "vocab_size -1 must be ≥ 1"),
    ("dream", {"max_position_embeddings": 0}, "max_position_embeddings is 0"),
])
def test_impossible_config_values_are_refused(family, change, needle):
    cfg = {**tiny_config(family), **change}
    with pytest.raises(ModelLoadError) as e:
        spec_from_config(cfg, "ckpt/config.json")
    assert needle in str(e.value) and str(e.value).startswith("ckpt/config.json: ") and "\n" not in str(e.value)
    spec_from_config(tiny_config(family))  # the unchanged config is fine


def test_a_bad_config_is_one_line_at_the_cli(cli, llada_dir, tmp_path):
    d = _copy(llada_dir, tmp_path / "badcfg")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "n_heads": 5}))
    one_line_error(cli("generate", "hi", "--model", d, *SMALL, "-q"), 1, "n_heads 5 does not divide d_model 64")


def test_jsonl_on_stdin_without_input_dash_warns_once(cli, llada_dir):
    stdin = '{"prompt": "abc"}\n{"prompt": "x"}\n'
    res = cli("generate", "--model", llada_dir, *SMALL, "-q", "--jsonl", input=stdin)
    assert res.exit_code == 0
    assert res.stderr.count("warning: stdin line 1 looks like a JSONL record") == 1 and "--input -" in res.stderr
    assert [r["prompt"] for r in records(res)] == ['{"prompt": "abc"}', '{"prompt": "x"}']  # still plain prompts
    plain = cli("generate", "--model", llada_dir, *SMALL, "-q", input="{a: 1}\nabc\n")  # braces alone: no warning
    assert "looks like a JSONL record" not in plain.stderr
    dash = cli("generate", "--model", llada_dir, *SMALL, "-q", "--input", "-", input=stdin)
    assert "looks like" not in dash.stderr and dash.exit_code == 0


def test_a_task_the_embedded_model_was_not_trained_on_warns(cli, tmp_path):
    data = tmp_path / "gsm.jsonl"
    data.write_text(json.dumps({"question": "Tom has 3 apples and buys 4. How many?",
                                "answer": "3 + 4 = 7\n#### 7"}) + "\n")
    res = cli("profile", "--task", "gsm8k", "--data", data, "--limit", "1", "--shots", "0", "--policies", "none",
              "--gen-length", "32", "--warmup", "0", "-q")
    assert res.exit_code == 0, res.stderr
    assert "warning: model tiny was trained only on arith, code, list, not gsm8k" in res.stderr
    ok = cli("profile", "--task", "list", "--limit", "1", "--policies", "none", "--gen-length", "32",
             "--warmup", "0", "-q")
    assert ok.exit_code == 0 and "trained only on" not in ok.stderr


def test_an_empty_answer_is_told_apart_from_one_that_ended_at_once():
    """Every answer empty: why depends on whether each ended (an end marker) or wrote tokens that decode to no
    text (special or reserved tokens: the answer did not end at once)."""
    from ecache_cli.runs.final_text import empty_reason

    assert empty_reason([True, True]) == "the model ended each answer at once"
    assert empty_reason([False]) == "their tokens decode to no text (special or reserved tokens)"
    assert "ended some at once" in empty_reason([True, False])


def test_all_empty_answers_warn(cli):
    # the embedded model answers a prompt without its chat template with an end token at once
    res = cli("generate", "Sort: 3 1 2", "hello", "--no-chat", "--gen-length", "32", "-q", "--jsonl")
    assert res.exit_code == 0
    assert [r["text"] for r in records(res)] == ["", ""]
    assert "warning: all 2 answer(s) are empty: the model ended each answer at once;" in res.stderr
    prof = cli("profile", "hello", "--no-chat", "--gen-length", "32", "--policies", "none", "--warmup", "0", "-q")
    assert prof.exit_code == 0 and "warning: every answer is empty (1 runs of 1 prompts): the model ended each " \
        "answer at once, so" in prof.stderr, prof.stderr
    fine = cli("generate", "Sort: 3 1 2", "-q")
    assert "empty" not in fine.stderr


def test_mean_entropy_flags_answers_beyond_the_models_own_99th_percentile(cli):
    card = json.loads((embedded_dir() / "ecache_model.json").read_text())
    p99 = card["mean_entropy_p99"]
    assert card["trained_tasks"] == ["arith", "code", "list"] and 0 < p99 < 1
    assert "scripts/entropy_percentile.py" in card["mean_entropy_reference"]["made_by"]
    res = cli("generate", "Sort: 9 3 7 1", "Reverse: 1 2 3", "What is the capital of France?",
              "Write a poem about the sea", "--jsonl", "-q")
    assert res.exit_code == 0
    ent = [r["mean_entropy"] for r in records(res)]
    assert ent[0] < p99 and ent[1] < p99  # its own domain: confident
    assert ent[2] > p99 and ent[3] > p99  # outside it: unsure
    assert (f"warning: 2 of 4 answer(s) (prompt 3, 4) have a mean entropy above {p99:g} nats, the 99th percentile "
            "of model tiny") in res.stderr


def test_mean_entropy_is_the_mean_over_the_answers_committed_tokens(llada_lm):
    """The accumulator against the StepRecords read directly: the entropy each answer position had at
    the step that committed it, averaged over the answer and its end marker."""
    import math

    from ecache_cli.cache import make_policy
    from ecache_cli.engine import DecodeConfig, Engine
    from ecache_cli.runs.confidence import EntropyMeter

    eng = Engine.from_loaded(llada_lm)
    run = eng.start(eng.encode(["abc", "Sort: 5 2 9"], False), DecodeConfig(gen_length=16, block_length=8),
                    make_policy("none"))
    meter = EntropyMeter(run.B, run.P, run.G)
    seen: dict[tuple[int, int], float] = {}
    for rec in run:
        meter.observe(rec)
        for j, r in enumerate(rec.rows.tolist()):
            for k in range(rec.targets.shape[1]):
                if rec.committed[j, k]:
                    seen[(r, int(rec.targets[j, k]) - run.P)] = float(rec.entropy[j, k])
    res = run.results()
    got = meter.means([r.stats["generated_tokens"] for r in res])
    for b, r in enumerate(res):
        vals = [seen[(b, p)] for p in range(r.stats["generated_tokens"]) if (b, p) in seen]
        assert vals and math.isclose(got[b], sum(vals) / len(vals), rel_tol=1e-12)
    assert len({round(g, 9) for g in got}) == 2  # two different figures


def test_every_command_names_model_policy_tau_and_its_source(cli, llada_dir, tmp_path, profiles_dir):
    flag = cli("generate", "hi", "--model", llada_dir, *SMALL, "--tau", "0.8", "--jsonl")
    first = flag.stderr.splitlines()[0]
    assert first == f"using model {llada_dir}, cache entropy, τ 0.8 from --tau"
    (r,) = records(flag)
    assert (r["settings"]["tau"], r["settings"]["tau_source"], r["settings"]["profile"]) == (0.8, "flag", None)
    default = cli("generate", "hi", "--model", llada_dir, *SMALL, "--jsonl")
    assert default.stderr.splitlines()[0] == f"using model {llada_dir}, cache entropy, τ 1 from built-in default"
    assert records(default)[0]["settings"]["tau_source"] == "default"
    # a calibrated profile found for --task: its path and how many examples it was calibrated on
    prof = profiles_dir / "llada-rand" / "list.yaml"
    prof.parent.mkdir()
    prof.write_text(yaml.safe_dump({"model": "llada-rand", "task": "list", "cache": {"policy": "entropy", "tau": 0.25},
                                    "measured": {"n": 20}}))
    task = cli("generate", "hi", "--model", llada_dir, *SMALL, "--task", "list", "--jsonl")
    assert task.exit_code == 0, task.stderr
    assert task.stderr.splitlines()[0] == (f"using model {llada_dir}, cache entropy, τ 0.25 from profile {prof} "
                                           "(calibrated on 20 examples)")
    s = records(task)[0]["settings"]
    assert (s["tau"], s["tau_source"], s["profile"]) == (0.25, "profile", str(prof))
    none = cli("generate", "hi", "--model", llada_dir, *SMALL, "--cache", "dual")
    assert none.stderr.splitlines()[0] == (f"using model {llada_dir}, "
                                           "cache dual (no τ: only the entropy policy takes one)")
    assert "using model" not in cli("generate", "hi", "--model", llada_dir, *SMALL, "-q").stderr
    # the shipped default profile of the embedded model
    tiny = cli("generate", "Sort: 3 1 2")
    shipped = yaml.safe_load((packaged_profiles_dir() / "tiny/default.yaml").read_text())
    assert tiny.stderr.startswith(f"using model tiny, cache entropy, τ {shipped['cache']['tau']:g} from profile ")
    assert tiny.stderr.splitlines()[0].endswith("ecache_cli/profiles/tiny/default.yaml (shipped with ecache; "
                                                f"calibrated on {shipped['measured']['n']} examples)")
    # τ from the flag, the other settings (recent_k, recent_steps) still from the shipped profile: named
    flag_tiny = cli("generate", "Sort: 3 1 2", "--tau", "3").stderr.splitlines()[0]
    assert flag_tiny.startswith("using model tiny, cache entropy, τ 3 from --tau; other settings from profile ")
    assert flag_tiny.endswith(f"(shipped with ecache; calibrated on {shipped['measured']['n']} examples)")
    own = cli("profile", "Sort: 3 1 2", "--policies", "entropy:tau=1,entropy:tau=2", "--gen-length", "32",
              "--warmup", "0")
    assert own.exit_code == 0, own.stderr
    using = [ln for ln in own.stderr.splitlines() if ln.startswith("using model")]
    assert using[0].startswith("using model tiny, policies entropy:tau=1,entropy:tau=2, τ of each --policies entry; "
                               "other settings from profile "), own.stderr
    # a profile that decodes without a cache (the embedded model's, under threshold decoding) is named too
    par = cli("generate", "Sort: 3 1 2", "--threshold", "0.9")
    first = par.stderr.splitlines()[0]
    assert first.startswith("using model tiny, cache none from profile ")
    assert first.endswith("ecache_cli/profiles/tiny/default-parallel.yaml (shipped with ecache) (no τ: only the "
                          "entropy policy takes one)")
    # profile, trace-drift, calibrate: the same line; their JSON carries it in the manifest's settings
    js = tmp_path / "p.json"
    p = cli("profile", "hi", "--model", llada_dir, *SMALL, "--policies", "none,entropy", "--warmup", "0", "--json", js)
    assert p.stderr.splitlines()[0] == f"using model {llada_dir}, policies none,entropy, τ 1 from built-in default"
    st = json.loads(js.read_text())["manifest"]["settings"]
    assert (st["tau"], st["tau_source"], st["profile"]) == (1.0, "default", None)
    t = cli("trace-drift", "hi", "--model", llada_dir, *SMALL, "--tau", "2", "--json", tmp_path / "t.json")
    assert t.stderr.splitlines()[0] == f"using model {llada_dir}, cache entropy, τ 2 from --tau"
    assert json.loads((tmp_path / "t.json").read_text())["manifest"]["settings"]["tau_source"] == "flag"
    c = cli("calibrate", "--task", "list", "--limit", "1", "--gen-length", "32", "--taus", "1", "--refine", "0",
            "--out", tmp_path / "c.yaml", "--json", tmp_path / "c.json", "--no-speed-check")
    assert c.stderr.splitlines()[0].startswith("using model tiny, cache entropy, τ searched on --task list "
                                               "(calibrate); base settings from profile ")
    assert c.stderr.splitlines()[0].endswith("ecache_cli/profiles/tiny/default.yaml")
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["incomplete"] is False and doc["manifest"]["settings"]["tau_source"] == "search"
