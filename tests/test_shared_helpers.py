"""Helpers the commands, the engine and the policies share: the warnings of ``resolve_settings`` and
``warn_unused_cache_flags``, ``load_for_command``, and the KV store's row set-aside and append."""

from __future__ import annotations

import pytest
import torch

from ecache_cli.errors import UsageError
from ecache_cli.kvstore import KVStore
from ecache_cli.runs.settings import resolve_settings, warn_unused_cache_flags
from ecache_cli.runtime import load_for_command


@pytest.mark.parametrize("flags, needle", [
    ({"top_k": 5}, "warning: --top-k does nothing at temperature 0"),
    ({"top_k": 5, "top_p": 0.9}, "warning: --top-k and --top-p do nothing at temperature 0"),
])
def test_sampling_flags_at_temperature_0_warn_once_under_llada_rules(profiles_dir, capsys, flags, needle):
    """Without --schedule the model's sampler decides (warn_model_rules, after the load): LLaDA's drops the
    flags at temperature 0, Dream's keeps them (they filter its confidence); --schedule llada warns at once."""
    from ecache_cli.runs.settings import warn_model_rules

    settings = resolve_settings("tiny", flags, {"policy": "entropy"})
    assert capsys.readouterr().err == ""
    warn_model_rules(settings, "dream")
    assert capsys.readouterr().err == ""
    warn_model_rules(settings, "llada")
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and needle in err, err
    resolve_settings("tiny", {**flags, "schedule": "llada"}, {"policy": "entropy"})
    assert needle in capsys.readouterr().err
    warn_model_rules(resolve_settings("tiny", {**flags, "temperature": 1.0}, {"policy": "entropy"}), "llada")
    assert capsys.readouterr().err == ""


def test_warn_unused_cache_flags_names_them_in_one_line(capsys):
    warn_unused_cache_flags(["none"], {"policy": "none", "tau": 3.0, "recent_k": 4}, "not used by --cache none")
    assert capsys.readouterr().err == "warning: --tau, --recent-k are not used by --cache none; ignored\n"
    warn_unused_cache_flags(["none", "entropy"], {"policy": None, "tau": 3.0}, "used by none of --policies x")
    assert capsys.readouterr().err == ""


def test_load_for_command_sets_threads_then_loads(llada_dir):
    before = torch.get_num_threads()
    try:
        lm, dist = load_for_command(str(llada_dir), "cpu", "float32", 1)
        assert dist is None and torch.get_num_threads() == 1 and lm.device.type == "cpu"
        lm, dist = load_for_command(str(llada_dir), "cpu", "float32", None, ranks=True)
        assert dist is not None and dist.world_size == 1 and lm.device.type == "cpu"
    finally:
        torch.set_num_threads(before)
    with pytest.raises(UsageError, match="--threads 0 must be ≥ 1"):
        load_for_command("/nonexistent", "cpu", "float32", 0)  # before any model is read


def test_kv_store_parks_and_restores_rows():
    key_mask = torch.tensor([[False, True, True], [True, True, True], [False, False, True]])
    store = KVStore.allocate(2, 1, 4, key_mask, torch.float32, keep_hidden=5)
    for t in store.k + store.v + store.hidden:
        t.normal_()
    store.rope = (torch.randn(3, 1, 3, 4), torch.randn(3, 1, 3, 4))
    ref = store.clone()  # a deep copy: the store moves its rows in place
    sub = store.take_rows(torch.tensor([1]))
    store.select_rows(torch.tensor([0, 2]))
    store.append_rows(sub)
    order = torch.tensor([0, 2, 1])
    for got, want in zip(store.k + store.v + store.hidden + list(store.rope),
                         ref.k + ref.v + ref.hidden + list(ref.rope)):
        assert torch.equal(got, want[order])
    assert torch.equal(store.key_mask, key_mask[order]) and torch.equal(store.positions, ref.positions[order])
    assert torch.equal(store.attn_mask, ref.attn_mask[order]) and store.queries is None
