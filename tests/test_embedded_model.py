"""The shipped model (ecache_cli/data/tiny): official LLaDA format, size, aliases, and real answers."""

import json

import pytest
import torch
from safetensors import safe_open

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


# Held-out code problems (test split, seed 0) that the shipped weights solve with the default generate
# settings (greedy, gen 256, block 32, one token per step, policy none). Regression test of the weights:
# retraining may change this list, never to an empty one (bench/quality.py has the full numbers).
SOLVED_CODE = ("reverse_string", "square_all", "tail_2", "last_2")


def _solved(task):
    first = {}
    for ex in task.examples("test", 24, 0):
        first.setdefault(ex.meta["entry_point"], ex)  # the first problem of each name
    return [first[n] for n in SOLVED_CODE]


def test_greedy_answers_pass_the_held_out_tests(tiny):
    task = get_task("code", allow_code_execution=True)
    examples = _solved(task)
    assert all(task.split_for(ex.meta["key"]) == "test" for ex in examples)
    res = Engine.from_loaded(tiny).generate([task.prompt(ex, 0, 0) for ex in examples],
                                            DecodeConfig(gen_length=256, block_length=32, temperature=0.0),
                                            policy="none", chat=True)
    for ex, r in zip(examples, res):
        assert r.text.startswith(f"def {ex.meta['entry_point']}("), r.text
        assert task.score(ex, r.text) == 1.0, (ex.question, r.text)


def test_cached_generation_keeps_the_solved_answers(tiny):
    """EntropyCache at the default τ on the same problems: the answers still pass their tests."""
    task = get_task("code", allow_code_execution=True)
    examples = _solved(task)
    res = Engine.from_loaded(tiny).generate([task.prompt(ex, 0, 0) for ex in examples],
                                            DecodeConfig(gen_length=256, block_length=32, temperature=0.0),
                                            policy="entropy", chat=True)
    assert sum(task.score(ex, r.text) for ex, r in zip(examples, res)) >= len(examples) - 1
