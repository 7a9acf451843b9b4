"""Item 4 of issue 49: ``ecache models`` (list, ``show``, ``pull``) and the memory refusal.

Nothing here reaches the network: every hub lookup runs against a private Hugging Face cache
(``HF_HUB_CACHE`` under ``tmp_path``, ``HF_HUB_OFFLINE=1``), where a "downloaded" alias is a fake
snapshot laid out as ``hf download`` leaves it; the free memory of the device is monkeypatched.
"""

from __future__ import annotations

import pytest
import torch
from cli_helpers import one_line_error
from conftest import SMALL

from ecache_cli.errors import ModelLoadError
from ecache_cli.models import loader
from ecache_cli.models.loader import load_model, weight_bytes

# --- memory refusal ------------------------------------------------------------------------------------------


def _state_bytes(lm, size: int) -> int:
    """The bytes of a loaded model's checkpoint tensors at ``size`` bytes an element (fused projections
    count once: they are views of the same storage as the checkpoint's own tensors)."""
    return sum(t.numel() for t in lm.model.state_dict().values()) * size


@pytest.mark.parametrize("family", ["llada", "dream"])  # one file, and two shards + index
def test_weight_bytes_are_the_checkpoints_tensors_in_the_load_dtype(family, request):
    path = request.getfixturevalue(f"{family}_dir")
    lm = request.getfixturevalue(f"{family}_lm")
    assert weight_bytes(path, torch.float32) == _state_bytes(lm, 4)
    assert weight_bytes(path, torch.bfloat16) == _state_bytes(lm, 2)


def test_weight_bytes_fall_back_to_the_spec_for_an_unreadable_header(llada_dir, llada_lm, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(llada_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\xff" * 16)
    assert weight_bytes(broken, torch.float32, llada_lm.spec) == llada_lm.spec.n_params * 4
    assert weight_bytes(broken, torch.float32) == 0  # no spec: no figure (the load's own check reports the file)


def _tight(monkeypatch, path, spare: int = -1) -> int:
    """Make the device's free memory ``spare`` bytes more than ``path``'s float32 weights need; return the need."""
    need = weight_bytes(path, torch.float32)
    monkeypatch.setattr(loader, "free_memory", lambda device: need + spare)
    return need


def test_load_model_refuses_weights_that_do_not_fit_before_reading_any(llada_dir, monkeypatch):
    need = _tight(monkeypatch, llada_dir)
    read = []
    real = loader.load_weights
    monkeypatch.setattr(loader, "load_weights", lambda *a, **k: read.append(1) or real(*a, **k))
    with pytest.raises(ModelLoadError) as e:
        load_model(llada_dir, device="cpu", dtype="float32")
    msg = str(e.value)
    assert read == [] and "\n" not in msg
    shown = loader._apart(need, need - 1)
    assert f"needs {shown[0]}" in msg and f"has {shown[1]} free" in msg and "--force" in msg
    assert "use --dtype bfloat16" in msg  # half the bytes fit
    lm = load_model(llada_dir, device="cpu", dtype="float32", force=True)
    assert read == [1] and lm.model is not None
    assert load_model(llada_dir, device="cpu", dtype="bfloat16").dtype == torch.bfloat16  # bfloat16 fits


def test_weights_that_just_fit_load(llada_dir, monkeypatch):
    _tight(monkeypatch, llada_dir, spare=0)
    assert load_model(llada_dir, device="cpu", dtype="float32").spec.family == "llada"


def test_figures_that_round_alike_get_more_digits():
    assert loader._apart(15 * 2**30, 14 * 2**30) == ("15.0 GiB", "14.0 GiB")
    assert loader._apart(int(14.93 * 2**30), int(14.91 * 2**30)) == ("14.93 GiB", "14.91 GiB")
    assert loader._apart(2**30 + 1, 2**30) == ("1,073,741,825 bytes", "1,073,741,824 bytes")


def test_free_memory_reads_the_device():
    import psutil

    assert abs(loader.free_memory(torch.device("cpu")) - psutil.virtual_memory().available) < 2**30
    assert loader.free_memory(torch.device("meta")) is None  # no figure: no refusal


def test_an_unknown_free_memory_refuses_nothing(llada_dir, monkeypatch):
    monkeypatch.setattr(loader, "free_memory", lambda device: None)
    assert load_model(llada_dir, device="cpu", dtype="float32").spec.family == "llada"


#: Each command that loads a model, with arguments that make it start (a prompt, a task, a free port).
LOADING = {
    "generate": ["generate", "Sort: 3 1", *SMALL],
    "profile": ["profile", "Sort: 3 1", "--policies", "none", *SMALL],
    "calibrate": ["calibrate", "--task", "list", "--limit", "2", "--gen-length", "16", "--block-length", "8",
                  "--dry-run", "-q"],
    "trace-drift": ["trace-drift", "Sort: 3 1", "--gen-length", "16", "--block-length", "8", "--no-chat", "-q"],
    "serve": ["serve", "--port", "0", "-q"],
}


@pytest.mark.parametrize("command", list(LOADING))
def test_every_loading_command_refuses_a_model_that_does_not_fit(cli, llada_dir, monkeypatch, command):
    need = _tight(monkeypatch, llada_dir)
    res = cli(*LOADING[command], "--model", llada_dir, "--device", "cpu", "--dtype", "float32")
    shown = loader._apart(need, need - 1)
    one_line_error(res, 1, f"needs {shown[0]} for its weights in float32", f"has {shown[1]} free", "--force")
    assert res.stdout == ""


def test_force_loads_a_model_that_does_not_fit(cli, llada_dir, monkeypatch):
    _tight(monkeypatch, llada_dir)
    res = cli(*LOADING["generate"], "--model", llada_dir, "--device", "cpu", "--dtype", "float32", "--force")
    assert res.exit_code == 0, res.stderr
    assert res.stdout.strip()


def test_lm_eval_model_args_refuse_and_force_alike(llada_dir, monkeypatch, profiles_dir):
    pytest.importorskip("lm_eval")
    from ecache_cli.evaluation.lm_eval_adapter import EcacheLM

    _tight(monkeypatch, llada_dir)
    args = f"model={llada_dir},device=cpu,dtype=float32"
    with pytest.raises(ModelLoadError, match="--force"):
        EcacheLM.create_from_arg_string(args)
    assert EcacheLM.create_from_arg_string(args + ",force=true").lm.spec.family == "llada"
