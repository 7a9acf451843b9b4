"""Model loading and the forward API.

Checkpoints are tiny random ones written in exactly the official on-disk formats.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ecache_cli.errors import ModelLoadError
from ecache_cli.models.loader import load_model, resolve_path
from ecache_cli.models.registry import spec_from_config
from ecache_cli.models.synthetic import write_random_checkpoint

FAMILIES = ["llada", "dream"]


@pytest.fixture(scope="module", params=[("llada", 1), ("llada", 3), ("dream", 1), ("dream", 2)],
                ids=["llada-single", "llada-sharded", "dream-single", "dream-sharded"])
def ckpt(request, tmp_path_factory):
    fam, shards = request.param
    d = write_random_checkpoint(tmp_path_factory.mktemp(f"{fam}{shards}"), fam, shards=shards, seed=3)
    return fam, d, load_model(d, device="cpu", dtype="float32")


def _stored_tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


def test_loading_round_trips_every_tensor(ckpt):
    fam, d, lm = ckpt
    stored = _stored_tensors(d)
    state = lm.model.state_dict()
    assert set(stored) == set(state)
    for k, t in stored.items():
        assert torch.equal(state[k], t), k
    if fam == "llada":
        assert "model.transformer.blocks.0.ff_proj.weight" in state and "model.transformer.ff_out.weight" in state
    else:
        assert "model.layers.0.self_attn.q_proj.bias" in state and "lm_head.weight" in state


def test_sharded_index_is_official_layout(tmp_path):
    d = write_random_checkpoint(tmp_path, "llada", shards=3)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def test_missing_tensor_is_named(tmp_path):
    d = write_random_checkpoint(tmp_path, "llada")
    state = _stored_tensors(d)
    del state["model.transformer.blocks.1.up_proj.weight"]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.transformer\.blocks\.1\.up_proj\.weight is missing"):
        load_model(d, device="cpu")


def test_misshaped_tensor_is_named(tmp_path):
    d = write_random_checkpoint(tmp_path, "dream")
    state = _stored_tensors(d)
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 64)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight has shape \(5, 64\)"):
        load_model(d, device="cpu")


def test_missing_shard_and_config_errors(tmp_path):
    d = write_random_checkpoint(tmp_path / "a", "llada", shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError) as e:
        load_model(d, device="cpu")
    assert str(e.value) == (f"{d}: 1 of 2 shards listed in model.safetensors.index.json is missing "
                            f"(model-00002-of-00002.safetensors); copy or download the missing shards into {d}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path / "empty", device="cpu")


def test_many_missing_shards_are_counted_in_the_index_order(tmp_path):
    """Past ``SHARDS_SHOWN`` missing shards the error names the first ones, in the index's order, and counts
    the rest; the weights' own check (``load_weights``) says the same as the load's."""
    import json

    from ecache_cli.models.loader import _weight_files, missing_weights

    d = write_random_checkpoint(tmp_path / "a", "llada", shards=5)
    index = d / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"] = dict(reversed(doc["weight_map"].items()))  # the index's order, not the names'
    index.write_text(json.dumps(doc))
    for k in (1, 2, 3, 5):
        (d / f"model-{k:05d}-of-00005.safetensors").unlink()
    want = (f"{d}: 4 of 5 shards listed in model.safetensors.index.json are missing (model-00005-of-00005.safetensors, "
            "model-00003-of-00005.safetensors, model-00002-of-00005.safetensors and 1 more); copy or download the "
            f"missing shards into {d}")
    with pytest.raises(ModelLoadError) as e:
        load_model(d, device="cpu")
    assert str(e.value) == want
    with pytest.raises(ModelLoadError) as e:
        _weight_files(d)
    assert str(e.value) == want
    assert missing_weights(d) == [f"model-{k:05d}-of-00005.safetensors" for k in (5, 3, 2, 1)]


def test_alias_missing_from_cache_names_repo(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="GSAI-ML/LLaDA-8B-Instruct") as e:
        resolve_path("llada-8b")
    assert "\n" not in str(e.value)
    with pytest.raises(ModelLoadError, match="Dream-org/Dream-v0-Instruct-7B"):
        resolve_path("dream-7b")


def test_official_configs_give_official_sizes():
    llada = {"model_type": "llada", "d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32,
             "mlp_hidden_size": 12288, "vocab_size": 126464, "embedding_size": 126464, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "rope_full_precision": True, "include_bias": False, "weight_tying": False,
             "mask_token_id": 126336, "eos_token_id": 126081, "pad_token_id": 126081}
    s = spec_from_config(llada)
    assert (s.head_dim, s.n_params, s.mask_id, s.logit_shift) == (128, 8_015_581_184, 126336, 0)
    dream = {"model_type": "Dream", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "rms_norm_eps": 1e-6,
             "rope_theta": 1e6, "tie_word_embeddings": False, "mask_token_id": 151666, "pad_token_id": 151643,
             "eos_token_id": 151643}
    s = spec_from_config(dream)
    assert (s.head_dim, s.n_kv_heads, s.n_params, s.logit_shift) == (128, 4, 7_615_616_512, 1)
    with pytest.raises(ModelLoadError, match="model_type 'gpt2'"):
        spec_from_config({"model_type": "gpt2"})


def _canvas(lm, B=2, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, 90, (B, T), generator=g)


def test_partial_over_all_positions_equals_full(ckpt):
    _, _, lm = ckpt
    m, ids = lm.model, _canvas(lm)
    with torch.inference_mode():
        full = m(ids, m.new_store(torch.ones_like(ids, dtype=torch.bool)))
        allpos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        part = m(ids, m.new_store(torch.ones_like(ids, dtype=torch.bool)), query_pos=allpos)
    assert full.shape == (2, 24, lm.spec.vocab_size)
    assert (part - full).abs().max() <= 1e-5


def test_partial_after_full_matches_full_rows(ckpt):
    _, _, lm = ckpt
    m, ids = lm.model, _canvas(lm)
    store = m.new_store(torch.ones_like(ids, dtype=torch.bool))
    with torch.inference_mode():
        full = m(ids, store)
        for qp in ([[0, 5, 23], [2, 3, 4]], [[7], [19]], [[1, 1, 9, 11], [12, 13, 14, 14]]):
            qp = torch.tensor(qp)
            part = m(ids, store, query_pos=qp)
            ref = full.gather(1, qp[:, :, None].expand(-1, -1, full.shape[-1]))
            assert (part - ref).abs().max() <= 1e-5
            sub = m(ids, store, query_pos=qp, logits_pos=qp[:, -1:])
            assert (sub - ref[:, -1:]).abs().max() <= 1e-5


def test_layer_hooks_fire_and_change_nothing(ckpt):
    """Without hooks the layer loop calls the norms' and projections' forward methods; a hook on any of the
    four roles, or a global one, makes it call the modules (so the hook fires): the same logits and K/V."""
    _, _, lm = ckpt
    m, ids = lm.model, _canvas(lm)
    qp = torch.tensor([[0, 5, 23], [2, 3, 4]])

    def run():
        store = m.new_store(torch.ones_like(ids, dtype=torch.bool))
        with torch.inference_mode():
            m(ids, store)
            return m(ids, store, query_pos=qp), store.k + store.v

    plain, plain_kv = run()
    p = m.parts(1)
    seen = []

    def record(module, args, out):
        seen.append(module)

    for mod in (p.attn_norm, p.o, p.mlp_norm, p.down, None):
        seen.clear()
        register = torch.nn.modules.module.register_module_forward_hook if mod is None else mod.register_forward_hook
        hook = register(record)
        try:
            hooked, hooked_kv = run()
        finally:
            hook.remove()
        assert len(seen) >= 2 if mod is None else seen == [mod, mod]  # one full and one partial forward
        assert torch.equal(plain, hooked)
        assert all(torch.equal(a, b) for a, b in zip(plain_kv, hooked_kv))


def test_a_part_compiled_on_its_own_is_called_compiled(ckpt):
    """``Module.compile()`` on one of the four parts: the loop calls the module (its compiled call), not its
    plain ``forward``; the same logits."""
    _, d, lm = ckpt
    m, ids = load_model(d, device="cpu", dtype="float32").model, _canvas(lm)  # its own copy: compiled below
    with torch.inference_mode():
        plain = m(ids, m.new_store(torch.ones_like(ids, dtype=torch.bool)))
    built = []
    m.parts(0).mlp_norm.compile(backend=lambda gm, example: (built.append(gm), gm.forward)[1])
    with torch.inference_mode():
        compiled = m(ids, m.new_store(torch.ones_like(ids, dtype=torch.bool)))
    assert len(built) == 1
    assert torch.equal(plain, compiled)


def test_logits_rows_run_the_head_on_those_entries_alone(ckpt):
    _, _, lm = ckpt
    m, ids = lm.model, _canvas(lm)
    qp, lp = torch.tensor([[3, 5, 9, 11], [4, 6, 8, 12]]), torch.tensor([[5, 9, 11], [6, 6, 6]])
    rows = torch.tensor([[True, True, True], [True, False, False]])  # row 1: one real entry, two padding
    seen = []
    head = m.head
    m.head = lambda h: seen.append(tuple(h.shape)) or head(h)
    try:
        with torch.inference_mode():
            every = m(ids, m.new_store(torch.ones_like(ids, dtype=torch.bool)), query_pos=qp, logits_pos=lp)
            some = m(ids, m.new_store(torch.ones_like(ids, dtype=torch.bool)), query_pos=qp, logits_pos=lp,
                     logits_rows=rows)
    finally:
        del m.head  # the class's own head again
    assert seen == [(2, 3, lm.spec.d_model), (4, lm.spec.d_model)]  # the head ran on the 4 real entries
    assert some.shape == every.shape
    assert (some[rows] - every[rows]).abs().max() <= 1e-6
    assert bool((some[~rows] == 0).all())


def test_packed_partial_forward_equals_the_padded_one(ckpt):
    """``pack``: the per-position work runs on the real query entries alone; logits and every K/V the
    forward writes are those of the padded forward, bit for bit (the same rows' dot products)."""
    from ecache_cli.contract.rows import packed_rows, padded_index

    _, _, lm = ckpt
    m, ids = lm.model, _canvas(lm)
    T = ids.shape[1]
    want = torch.zeros(2, T, dtype=torch.bool)
    want[0, [2, 3, 5, 9, 11]] = True
    want[1, [7]] = True  # one real entry, four padding
    qp, valid = padded_index(want)
    lp = qp[:, :2]
    order, unpack = packed_rows(valid, 6)
    assert order.tolist() == [0, 1, 2, 3, 4, 5] and unpack.tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 5, 5]
    seen = []
    hook = m.parts(0).attn_norm.register_forward_hook(lambda mod, a, out: seen.append(tuple(a[0].shape)))
    stores = []
    try:
        with torch.inference_mode():
            outs = []
            for kw in ({}, {"pack": (order, unpack)}):
                store = m.new_store(torch.ones_like(ids, dtype=torch.bool))
                m(ids, store)
                outs.append(m(ids, store, query_pos=qp, logits_pos=lp, **kw))
                stores.append(store)
    finally:
        hook.remove()
    assert seen[1] == (2, 5, lm.spec.d_model) and seen[3] == (6, lm.spec.d_model)  # padded, then packed
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(stores[0].k + stores[0].v, stores[1].k + stores[1].v))


def test_cached_kv_is_used_for_positions_not_computed(ckpt):
    """A partial forward reads stale K/V from the store: changing a token it does not compute must
    not change its output until that position is recomputed."""
    _, _, lm = ckpt
    m, ids = lm.model, _canvas(lm, B=1)
    store = m.new_store(torch.ones_like(ids, dtype=torch.bool))
    with torch.inference_mode():
        m(ids, store)
        qp = torch.tensor([[3, 4]])
        before = m(ids, store, query_pos=qp)
        changed = ids.clone()
        changed[0, 10] = (changed[0, 10] + 1) % 90 + 6
        stale = m(changed, store, query_pos=qp)
        assert torch.equal(before, stale)
        m(changed, store, query_pos=torch.tensor([[10]]))  # refresh position 10 only
        fresh = m(changed, store, query_pos=qp)
    assert (fresh - before).abs().max() > 1e-4


def test_left_padded_row_matches_row_alone(ckpt):
    _, _, lm = ckpt
    m = lm.model
    row = _canvas(lm, B=1, T=15, seed=1)
    other = _canvas(lm, B=1, T=20, seed=2)
    pad = lm.spec.pad_id
    batch = torch.cat([torch.cat([torch.full((1, 5), pad), row], 1), other])  # (2, 20), row 0 left padded
    key_mask = batch != -1
    key_mask[0, :5] = False
    with torch.inference_mode():
        alone = m(row, m.new_store(torch.ones_like(row, dtype=torch.bool)))
        padded = m(batch, m.new_store(key_mask))
        other_alone = m(other, m.new_store(torch.ones_like(other, dtype=torch.bool)))
    assert (padded[0, 5:] - alone[0]).abs().max() <= 1e-5
    assert (padded[1] - other_alone[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_logit_shift_sources(family, tmp_path):
    """Dream: the logits that predict position i come from hidden state i-1; LLaDA: from i."""
    from ecache_cli.cache import make_policy
    from ecache_cli.engine import DecodeConfig, Engine

    lm = load_model(write_random_checkpoint(tmp_path, family), device="cpu")
    seen = []
    model = lm.model
    orig = model.forward

    def spy(tokens, store, query_pos=None, logits_pos=None):
        seen.append((tokens.clone(), logits_pos.clone()))
        return orig(tokens, store, query_pos=query_pos, logits_pos=logits_pos)

    model.forward = spy
    eng = Engine.from_loaded(lm)
    run = eng.start([[10, 11, 12]], DecodeConfig(gen_length=8, block_length=8, steps=8, early_exit=False),
                    make_policy("none"))
    next(iter(run))
    tokens, logits_pos = seen[0]
    targets = (tokens[0] == lm.spec.mask_id).nonzero().squeeze(1)
    assert torch.equal(logits_pos[0], targets - (1 if family == "dream" else 0))
    # and the shifted row really is the hidden state at i-1: compare with a direct full forward
    with torch.inference_mode():
        direct = orig(tokens, model.new_store(torch.ones_like(tokens, dtype=torch.bool)))
    first = targets[0].item()
    src = first - (1 if family == "dream" else 0)
    with torch.inference_mode():
        got = orig(tokens, model.new_store(torch.ones_like(tokens, dtype=torch.bool)), logits_pos=torch.tensor([[src]]))
    assert torch.allclose(got[0, 0], direct[0, src], atol=1e-6)


def _unfused_copy(lm):
    """The same weights in a model whose projections were never fused (separate parameters)."""
    ref = type(lm.model)(lm.spec)
    ref.load_state_dict(lm.model.state_dict())
    return ref.eval()


def test_fused_projections_keep_names_and_outputs(ckpt):
    fam, d, lm = ckpt
    m, ref = lm.model, _unfused_copy(lm)
    p = m.parts(0)
    assert p.fused() and not ref.parts(0).fused()
    # the parameters are views of the fused matrices, under their official names
    assert p.k.weight.data_ptr() == p.qkv.data_ptr() + p.q.weight.numel() * p.qkv.element_size()
    assert torch.equal(p.qkv, torch.cat([p.q.weight, p.k.weight, p.v.weight]))
    assert torch.equal(p.gate_up, torch.cat([p.gate.weight, p.up.weight]))
    assert set(m.state_dict()) == set(_stored_tensors(d))
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, 90, (2, 24), generator=g)
    key_mask = torch.ones(2, 24, dtype=torch.bool)
    key_mask[1, :5] = False
    q = torch.tensor([[3, 9, 17, 20], [6, 7, 8, 23]])
    with torch.inference_mode():
        a_store, b_store = m.new_store(key_mask), ref.new_store(key_mask)
        full = (m(tokens, a_store), ref(tokens, b_store))
        tokens[:, 17:] = 2  # the canvas changes at query positions
        part = (m(tokens, a_store, query_pos=q), ref(tokens, b_store, query_pos=q))
    for a, b in (full, part):
        assert (a - b).abs().max().item() <= 1e-5
    for i in range(lm.spec.n_layers):
        assert (a_store.k[i] - b_store.k[i]).abs().max().item() <= 1e-5
    # a dtype move gives the parameters storage of their own: the forward runs them one by one
    m64 = _unfused_copy(lm)
    m64.fuse_projections()
    m64.to(torch.float64)
    assert not m64.parts(0).fused()
    with torch.inference_mode():
        out = m64(tokens.clone(), m64.new_store(key_mask))
    assert out.dtype == torch.float64 and torch.isfinite(out).all()


def test_rms_norm_fast_path_is_the_float32_formula():
    from ecache_cli.models.layers import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.randn(64, generator=g)
    x = torch.randn(3, 17, 64, generator=g) * 4
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x), h * norm.weight, rtol=0, atol=1e-6)
    xb = x.bfloat16()  # the official path: normalise in float32, cast back, then scale
    hb = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16() * norm.weight
    assert norm(xb).dtype == torch.float32 and torch.equal(norm(xb), hb)


@pytest.mark.parametrize("full_precision", [True, False])
def test_rope_equals_rotate_half(full_precision):
    from ecache_cli.models.layers import apply_rope, rope_tables

    D = 8
    positions = torch.tensor([[0, 0, 1, 2, 3, 40]])
    cos, signed_sin = rope_tables(positions, D, 10000.0)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    ang = positions.float()[..., None] * inv
    ang = torch.cat([ang, ang], -1)[:, None]  # (1, 1, T, D)
    t = torch.randn(1, 3, 6, D, generator=torch.Generator().manual_seed(1))
    rotated = torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1)  # rotate_half
    want = t * ang.cos() + rotated * ang.sin()
    torch.testing.assert_close(apply_rope(t, cos, signed_sin, full_precision), want, rtol=0, atol=1e-6)
