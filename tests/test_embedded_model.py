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
