"""Shared fixtures: tiny random checkpoints in the official on-disk formats, loaded once per session.

``llada_dir`` is a single-file LLaDA checkpoint (``model.safetensors``), ``dream_dir`` a sharded Dream
one (two ``model-0000k-of-00002.safetensors`` + index), both written by
``ecache_cli.models.synthetic.write_random_checkpoint`` (d_model 64, 2 layers, model vocab 128 > the
character tokenizer's ~100 ids). ``llada_lm`` / ``dream_lm`` are the loaded models (CPU, float32);
``lm`` runs a test once per family. Loaded models are shared: wrap them, never modify their weights.

``scale=4`` makes the random models' token distributions peaked enough to be useful in tests: the
committed tokens vary and their entropies span ~0.05-2.7 nats (at the default 0.5 every masked position
predicts the same token at ~4.7 nats, so cached and uncached decoding could not disagree).
"""

from __future__ import annotations

import pytest
import torch

from ecache_cli.models.loader import load_model

# The test models are tiny: one thread is faster than two (no OpenMP hand-offs) and keeps the suite
# from stalling when the 2-core machine is shared.
torch.set_num_threads(1)
from ecache_cli.models.synthetic import write_random_checkpoint

SYNTH_SCALE = 4.0


@pytest.fixture(scope="session")
def llada_dir(tmp_path_factory):
    """Directory of a random LLaDA checkpoint, single ``model.safetensors``."""
    return write_random_checkpoint(tmp_path_factory.mktemp("llada") / "llada-rand", "llada", shards=1, seed=0,
                                   scale=SYNTH_SCALE)


@pytest.fixture(scope="session")
def dream_dir(tmp_path_factory):
    """Directory of a random Dream checkpoint, two shards + ``model.safetensors.index.json``."""
    return write_random_checkpoint(tmp_path_factory.mktemp("dream") / "dream-rand", "dream", shards=2, seed=0,
                                   scale=SYNTH_SCALE)


@pytest.fixture(scope="session")
def llada_lm(llada_dir):
    """The random LLaDA checkpoint loaded on CPU in float32 (a ``LoadedModel``)."""
    return load_model(llada_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def dream_lm(dream_dir):
    """The random Dream checkpoint loaded on CPU in float32 (a ``LoadedModel``)."""
    return load_model(dream_dir, device="cpu", dtype="float32")


@pytest.fixture(params=["llada", "dream"])
def lm(request):
    """Each family's loaded random checkpoint in turn (test ids ``[llada]`` / ``[dream]``)."""
    return request.getfixturevalue(f"{request.param}_lm")


@pytest.fixture
def profiles_dir(tmp_path, monkeypatch):
    """An empty profiles folder used through ``$ECACHE_PROFILES``, so the project's profiles never leak in."""
    d = tmp_path / "profiles"
    d.mkdir()
    monkeypatch.setenv("ECACHE_PROFILES", str(d))
    return d
