"""The shipped model (ecache_cli/data/tiny): official LLaDA format, size, aliases, and real answers."""

import json

import pytest
import torch
from safetensors import safe_open

from ecache_cli.cache import make_policy
from ecache_cli.engine import DecodeConfig, Engine
from ecache_cli.models.loader import DEFAULT_MODEL, embedded_dir, load_model
from ecache_cli.tasks import get_task

TINY = embedded_dir()
# config.json fields of GSAI-ML/LLaDA-8B-Instruct that the loader and engine rely on
LLADA_FIELDS = ("model_type", "architectures", "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size",
                "vocab_size", "embedding_size", "rope_theta", "max_sequence_length", "mask_token_id",
                "eos_token_id", "pad_token_id", "weight_tying", "rms_norm_eps", "activation_type", "block_type",
                "layer_norm_type", "include_bias", "rope", "auto_map")


@pytest.fixture(scope="module")
def tiny():
    return load_model(DEFAULT_MODEL, device="cpu", dtype="float32")


def test_shipped_files_and_size():
    names = {p.name for p in TINY.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= names
    total = sum(p.stat().st_size for p in TINY.iterdir() if p.is_file())
    assert total <= 20 * 1024 * 1024, f"embedded model is {total / 2**20:.1f} MiB, over the 20 MiB budget"


def test_config_is_official_llada():
    cfg = json.loads((TINY / "config.json").read_text())
    missing = [k for k in LLADA_FIELDS if k not in cfg]
    assert not missing, missing
    assert cfg["model_type"] == "llada" and cfg["architectures"] == ["LLaDAModelLM"]
    assert cfg["block_type"] == "llama" and cfg["activation_type"] == "silu" and cfg["rope"] is True
    assert cfg["weight_tying"] is False and cfg["include_bias"] is False
    assert cfg["mask_token_id"] != cfg["eos_token_id"] == cfg["pad_token_id"]
    assert cfg["embedding_size"] % 64 == 0 and cfg["embedding_size"] >= cfg["vocab_size"] - 64


def test_tensor_names_are_official():
    cfg = json.loads((TINY / "config.json").read_text())
    with safe_open(str(TINY / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        emb = f.get_slice("model.transformer.wte.weight").get_shape()
    assert emb == [cfg["embedding_size"], cfg["d_model"]]
    assert {"model.transformer.wte.weight", "model.transformer.ln_f.weight", "model.transformer.ff_out.weight"} <= names
    per_block = {"q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out", "attn_norm", "ff_norm"}
    for i in range(cfg["n_layers"]):
        assert {f"model.transformer.blocks.{i}.{n}.weight" for n in per_block} <= names
    assert len(names) == 3 + 9 * cfg["n_layers"]


def test_alias_and_default_load_the_same_weights(tiny):
    other = load_model("llada-tiny", device="cpu", dtype="float32")
    assert tiny.spec == other.spec and tiny.spec.family == "llada"
    for (n1, p1), (n2, p2) in zip(tiny.model.state_dict().items(), other.model.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


# Held-out problems (test split, seed 0: indices into task.examples("test", 100, 0), whose first 24 are
# examples("test", 24, 0)) that the shipped weights answer correctly with the default generate settings
# (greedy, gen 256, block 32, one token per step). A regression test of the weights: retraining may
# change these indices, never to none (bench/quality.py has the full numbers).
SOLVED = {"list": (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24),
          "code": (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23),
          "arith": (0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20, 21, 22, 24, 25, 26)}
CFG = DecodeConfig(gen_length=256, block_length=32, temperature=0.0)


def _solved(domain):
    task = get_task(domain, allow_code_execution=True)
    examples = task.examples("test", 100, 0)
    return task, [examples[i] for i in SOLVED[domain]]


@pytest.mark.slow  # 256 full forwards per domain: .ci/run's slow step
@pytest.mark.parametrize("domain", sorted(SOLVED))
def test_greedy_answers_are_correct_on_held_out_problems(tiny, domain):
    task, examples = _solved(domain)
    assert all(task.split_for(ex.meta["key"]) == "test" for ex in examples)
    res = Engine.from_loaded(tiny).generate([task.prompt(ex, 0, 0) for ex in examples], CFG, policy=make_policy("none"))
    for ex, r in zip(examples, res):
        if domain == "list":
            assert r.text.strip() == ex.answer, (ex.question, r.text)
        assert task.score(ex, r.text) == 1.0, (ex.question, r.text)


@pytest.mark.parametrize("domain", sorted(SOLVED))
def test_cached_generation_keeps_the_correct_answers(tiny, domain):
    """EntropyCache at the default τ (1 nat, not recalibrated for these weights) on the same problems:
    at least 75% of the answers stay correct (step 274203: list 21/24, code and arith all)."""
    task, examples = _solved(domain)
    res = Engine.from_loaded(tiny).generate([task.prompt(ex, 0, 0) for ex in examples], CFG,
                                            policy=make_policy("entropy"))
    assert sum(task.score(ex, r.text) for ex, r in zip(examples, res)) >= 0.75 * len(examples)


def test_readme_first_command_prints_the_sorted_list():
    """The README's first command, through the CLI: ``ecache generate "Sort: 9 3 7 1"``."""
    from typer.testing import CliRunner

    from ecache_cli.cli import app

    r = CliRunner().invoke(app, ["generate", "Sort: 9 3 7 1"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "1 3 7 9"
