"""The model-family registry, each family against its own tiny checkpoint, and LLaDA-MoE against the
official modeling code.

``tests/fixtures/llada-moe/`` was written by the official LLaDA-MoE modeling code (its ``save_pretrained``,
float32, random weights; the folder's README says which file and commit), and ``official_outputs.safetensors``
holds that code's logits, routing and LLaDA generate.py outputs for it. The official code itself is not run
here (it needs transformers' remote code at a pinned version): its recorded outputs are the reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS, SMALL
from safetensors import safe_open
from safetensors.torch import load_file

from ecache_cli.cache import make_policy
from ecache_cli.engine import DecodeConfig, Engine
from ecache_cli.errors import ModelLoadError
from ecache_cli.models.loader import load_model, resolve_path
from ecache_cli.models.registry import ALIASES, FAMILIES, alias, family_of, spec_from_config
from ecache_cli.models.synthetic import tiny_config, write_random_checkpoint

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MOE = FIXTURES / "llada-moe"


# --- the registry ------------------------------------------------------------------------------------


def test_every_family_file_is_registered_under_its_name():
    folder = Path(__file__).resolve().parents[1] / "ecache_cli" / "models" / "families"
    files = sorted(f.stem.replace("_", "-") for f in folder.glob("*.py") if not f.stem.startswith("_"))
    assert sorted(FAMILIES) == files
    assert list(FAMILIES)[:2] == ["llada", "dream"]
    for name, fam in FAMILIES.items():
        assert fam.name == name and fam.sampler in ("llada", "dream", "sdar", "llada2") and fam.aliases


def test_aliases_are_unique_and_name_their_family():
    seen = [a for fam in FAMILIES.values() for a in fam.aliases]
    assert len(seen) == len(set(seen)) == len(ALIASES)
    assert alias("llada-moe")[0].name == "llada-moe" and alias("diffucoder-7b")[0].name == "dream"
    assert alias("dream-coder-7b")[1].repo == "Dream-org/Dream-Coder-v0-Instruct-7B"
    assert alias("nope") is None
    for name in ("llada-moe", "llada-moe-instruct", "llada-moe-base", "diffucoder-7b", "diffucoder-7b-base",
                 "diffucoder-7b-cpgrpo", "dream-coder-7b"):
        assert name in ALIASES


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_loads_its_tiny_checkpoint(family, tmp_path):
    """Every family: its tiny config is claimed by it alone, the checkpoint written in its official layout
    loads with every tensor round-tripped, the parameter count implied by the config equals the tensors',
    and a full forward equals a partial forward over every position."""
    d = write_random_checkpoint(tmp_path / family, family, shards=2, seed=1, scale=4.0)
    cfg = json.loads((d / "config.json").read_text())
    assert [f.name for f in FAMILIES.values() if f.claims(cfg)] == [family]
    lm = load_model(d, device="cpu", dtype="float32")
    assert lm.spec.family == family and isinstance(lm.model, FAMILIES[family].model_class)
    stored = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            stored.update({k: sf.get_tensor(k) for k in sf.keys()})
    state = lm.model.state_dict()
    assert set(stored) == set(state) and all(torch.equal(state[k], t) for k, t in stored.items())
    assert lm.spec.n_params == sum(t.numel() for t in stored.values())  # a router's expert_bias buffer included
    ids = torch.randint(10, 90, (2, 20), generator=torch.Generator().manual_seed(0))
    m = lm.model
    with torch.inference_mode():
        full = m(ids, m.new_store(torch.ones_like(ids, dtype=torch.bool)))
        part = m(ids, m.new_store(torch.ones_like(ids, dtype=torch.bool)), query_pos=torch.arange(20).expand(2, -1))
    assert (full - part).abs().max() <= 1e-5 and full.std() > 0.5


def test_official_sizes_of_every_alias_family():
    """The parameter counts ``ecache models`` lists are the ones the official configs imply."""
    moe = {"model_type": "llada", "architectures": ["LLaDAMoEModelLM"], "hidden_size": 2048,
           "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
           "num_experts": 64, "num_experts_per_tok": 8, "expert_intermediate_size": 1024,
           "dense_intermediate_size": 8192, "moe_layer_freq": [1] * 16, "qk_layernorm": True,
           "rope_theta": 50000, "partial_rotary_factor": 1.0, "vocab_size": 157184, "tie_word_embeddings": False,
           "shared_expert_intermediate_size": None, "pad_token_id": 156892}
    s = spec_from_config(moe)
    assert (s.n_params, s.n_active_params) == (alias("llada-moe")[1].params, alias("llada-moe")[1].active)
    assert (s.mask_id, s.eos_id, s.head_dim, s.rotary_dim) == (156895, 156892, 128, 128)
    dream = tiny_config("dream", vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                        mlp_hidden=18944)
    assert spec_from_config(dream).n_params == alias("diffucoder-7b")[1].params
    llada = tiny_config("llada", vocab_size=126464, d_model=4096, n_layers=32, n_heads=32, mlp_hidden=12288)
    assert spec_from_config(llada).n_params == alias("llada-8b")[1].params
    for name, sp in (("llada-moe", s), ("diffucoder-7b", spec_from_config(dream)),
                     ("llada-8b", spec_from_config(llada))):
        assert alias(name)[1].outer == sp.vocab_size * sp.d_model * 2  # untied embedding and head


# --- LLaDA-MoE against the official code --------------------------------------------------------------


@pytest.fixture(scope="module")
def official():
    return load_file(MOE / "official_outputs.safetensors")


@pytest.fixture(scope="module")
def moe_fixture():
    return load_model(MOE, device="cpu", dtype="float32")


def test_the_fixture_is_llada_moe_in_its_official_layout(moe_fixture):
    cfg = json.loads((MOE / "config.json").read_text())
    assert cfg["model_type"] == "llada" and cfg["architectures"] == ["LLaDAMoEModelLM"]  # as the checkpoints ship it
    assert family_of(cfg).name == "llada-moe"
    s = moe_fixture.spec
    assert (s.n_kv_heads, s.n_heads, s.n_experts, s.experts_per_token, s.qk_norm) == (2, 4, 8, 2, True)
    assert s.logit_shift == 0
    assert (s.mask_id, s.eos_id, s.eot_id, s.sampler) == (2, 1, 5, "llada")  # mask and EOS from the tokenizer
    names = set(moe_fixture.model.state_dict())
    assert {"model.layers.1.mlp.gate.weight", "model.layers.0.mlp.experts.7.down_proj.weight",
            "model.layers.0.self_attn.q_norm.weight", "lm_head.weight"} <= names


def test_logits_equal_the_official_code(moe_fixture, official):
    """Unpadded: the official float32 logits, max |Δ| ≤ 1e-4 (bit-identical on some CPUs, 3.9e-5 on an
    AVX2 AMD EPYC: float32 rounding follows the CPU's matmul kernels, and the official float32 logits
    themselves move by 2.8e-5 in float64). Left padded with the official key-padding mask: ≤ 1e-4 at the
    real positions (the official code keeps positions 0..T-1 for a padded row, ecache counts them from
    the first real token: the same relative angles, rounded differently)."""
    m = moe_fixture.model
    with torch.inference_mode():
        ids = official["ids"]
        got = m(ids, m.new_store(torch.ones_like(ids, dtype=torch.bool)))
        assert (got - official["logits"]).abs().max() <= 1e-4
        mask = official["padded_mask"].bool()
        padded = m(official["padded_ids"], m.new_store(mask))
    assert (padded - official["padded_logits"]).abs()[mask].max() <= 1e-4


def test_the_router_equals_the_official_one(moe_fixture, official):
    """Layer 0's top-k experts and their unrenormalised softmax weights, token for token."""
    block = moe_fixture.model.parts(0).moe
    block.routes = []
    seen = []
    hook = block.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    try:
        with torch.inference_mode():
            ids = official["ids"]
            moe_fixture.model(ids, moe_fixture.model.new_store(torch.ones_like(ids, dtype=torch.bool)))
            idx, weight = block.route(seen[0].reshape(-1, seen[0].shape[-1]))
    finally:
        hook.remove()
        block.routes = None
    assert torch.equal(idx, official["router_idx_layer0"])
    assert (weight - official["router_weight_layer0"]).abs().max() <= 1e-6
    assert float(weight.sum(1).max()) < 1  # no renormalisation
    assert len(set(idx.flatten().tolist())) > 4  # the tokens spread over the experts


def _official_generate(lm, prompt: list[int], gen_length: int, block_length: int, steps: int) -> list[int]:
    """LLaDA generate.py as written (temperature 0, low-confidence remasking): every id may be chosen, the
    confidence is the softmax over the whole vocabulary."""
    model, spec = lm.model, lm.spec
    x = torch.tensor([prompt + [spec.mask_id] * gen_length])
    P, per_block = len(prompt), steps // (gen_length // block_length)
    with torch.inference_mode():
        for b in range(gen_length // block_length):
            end = P + (b + 1) * block_length
            n = int((x[0, P + b * block_length:end] == spec.mask_id).sum())
            counts = [n // per_block + (1 if t < n % per_block else 0) for t in range(per_block)]
            for k in counts:
                logits = model(x, model.new_store(torch.ones_like(x, dtype=torch.bool))).double()
                x0 = logits.argmax(-1)
                p = logits.softmax(-1).gather(-1, x0[..., None]).squeeze(-1)
                p[:, end:] = float("-inf")
                conf = torch.where(x == spec.mask_id, p, torch.full_like(p, float("-inf")))
                x[0, conf[0].topk(k).indices] = x0[0, conf[0].topk(k).indices]
    return x[0, P:].tolist()


@pytest.mark.parametrize("steps, key", [(16, "gen_llada"), (4, "gen_llada_4steps")])
def test_llada_generate_is_the_official_output(moe_fixture, official, steps, key):
    """LLaDA generate.py run on the official model gave ``official[key]``; the same loop on ecache's model
    gives it token for token. The engine's LLaDA sampler equals that loop with ecache's deliberate
    difference (the mask id is never chosen, so the confidence's softmax leaves it out, README
    "Samplers"): at 4 steps the two agree; at 16 the renormalised confidences order two positions the
    other way, so there the engine is compared with tests/test_engine.py's reference loop, which mirrors it."""
    from test_engine import reference_decode

    prompt = official["gen_prompt"][0].tolist()
    want = official[key][0, len(prompt):].tolist()
    assert _official_generate(moe_fixture, prompt, 16, 8, steps) == want
    eng = Engine.from_loaded(moe_fixture)
    run = eng.start([prompt], DecodeConfig(gen_length=16, block_length=8, steps=steps, early_exit=False),
                    make_policy("none"))
    list(run)
    got = run.results()[0].token_ids
    assert got == reference_decode(moe_fixture, prompt, 16, 8, steps)
    assert (got == want) == (steps == 4)


def test_a_partial_forward_routes_only_the_positions_it_computes(moe_lm):
    m = moe_lm.model
    ids = torch.randint(10, 90, (2, 20), generator=torch.Generator().manual_seed(3))
    store = m.new_store(torch.ones_like(ids, dtype=torch.bool))
    blocks = [m.parts(i).moe for i in range(moe_lm.spec.n_layers)]
    for b in blocks:
        b.routes = []
    try:
        with torch.inference_mode():
            m(ids, store)
            m(ids, store, query_pos=torch.tensor([[3, 4, 5], [7, 8, 9]]))
    finally:
        routes = [b.routes for b in blocks]
        for b in blocks:
            b.routes = None
    assert [[tuple(r.shape) for r in layer] for layer in routes] == [[(40, 2), (6, 2)]] * moe_lm.spec.n_layers


def test_grouped_experts_equal_a_loop_over_tokens():
    from ecache_cli.models.layers import SwiGLU
    from ecache_cli.models.moe import run_experts

    g = torch.Generator().manual_seed(0)
    experts = torch.nn.ModuleList(SwiGLU(16, 8) for _ in range(5))
    for p in experts.parameters():
        p.data = torch.randn(p.shape, generator=g)
    x = torch.randn(7, 16, generator=g)
    idx = torch.tensor([[0, 3], [3, 0], [4, 1], [1, 1], [2, 4], [0, 2], [3, 4]])
    w = torch.rand(7, 2, generator=g)
    want = torch.stack([sum(w[n, j] * experts[int(idx[n, j])](x[n:n + 1])[0] for j in range(2)) for n in range(7)])
    got = run_experts(x, idx, w, experts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    experts[0].fuse()
    torch.testing.assert_close(run_experts(x, idx, w, experts), got, rtol=0, atol=1e-5)


@pytest.mark.parametrize("change, needle", [
    ({"partial_rotary_factor": None}, "partial_rotary_factor is None: the official code then rotates nothing"),
    ({"partial_rotary_factor": -1}, "partial_rotary_factor is -1.0: the official code then rotates nothing"),
    ({"partial_rotary_factor": 0}, "set it to the share of each head RoPE turns, in (0, 1]"),
    ({"clip_qkv": -1}, "clip_qkv is -1.0; it must be > 0"),
    ({"moe_layer_freq": [1, "x"]}, "moe_layer_freq [1, 'x'] must list one number per layer (2)"),
    ({"num_experts": 0}, "num_experts is 0 but moe_layer_freq makes layers MoE; it must be ≥ 1"),
    ({"hidden_size": None}, "config.json field 'hidden_size' is null; it must be a whole number"),
    ({"moe_layer_freq": [1]}, "moe_layer_freq [1] must list one number per layer (2)"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than num_experts 8"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "only the default RoPE"),
])
def test_bad_moe_configs_are_one_line(change, needle):
    cfg = {**tiny_config("llada-moe"), **change}
    if "partial_rotary_factor" in change and change["partial_rotary_factor"] is None:
        del cfg["partial_rotary_factor"]
    with pytest.raises(ModelLoadError) as e:
        spec_from_config(cfg, "ckpt/config.json", vocab={"<|mask|>": 2, "<|endoftext|>": 1})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_dense_layer_and_a_shared_expert_load_and_count(tmp_path):
    """``moe_layer_freq`` 0 makes a layer dense (``mlp.{gate,up,down}_proj``), a shared expert sits beside
    ``mlp``; both load under their official names and change the output."""
    d = write_random_checkpoint(tmp_path / "m", "llada-moe", seed=2, scale=4.0, moe_layer_freq=[0, 1],
                                shared_expert_intermediate_size=24, moe_router_enable_expert_bias=True)
    lm = load_model(d, device="cpu", dtype="float32")
    names = set(lm.model.state_dict())
    assert "model.layers.0.mlp.down_proj.weight" in names and "model.layers.1.shared_expert.up_proj.weight" in names
    assert "model.layers.1.mlp.expert_bias" in names
    assert lm.model.parts(0).moe is None and lm.model.parts(1).moe is not None
    assert lm.spec.n_params == sum(t.numel() for t in lm.model.state_dict().values())
    m, ids = lm.model, torch.randint(10, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = m(ids, m.new_store(torch.ones_like(ids, dtype=torch.bool)))
        shared = lm.model.model.layers[1].shared_expert
        shared.down_proj.weight.zero_()  # the shared expert's output is part of the layer's
        without = m(ids, m.new_store(torch.ones_like(ids, dtype=torch.bool)))
    assert (full - without).abs().max() > 1e-3


# --- the Dream-based coders ------------------------------------------------------------------------------


def _hub_snapshot(cache: Path, repo: str, src: Path) -> Path:
    """Lay ``src`` out as the Hugging Face cache's snapshot of ``repo`` (what ``hf download`` leaves)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / ("0" * 40)
    shutil.copytree(src, snap)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0" * 40)
    return snap


@pytest.fixture
def diffucoder(tmp_path, monkeypatch, profiles_dir):
    """DiffuCoder-7B-Instruct's shape shrunk: Dream's config with DiffuCoder's own fields, a tokenizer with
    ``<|dlm_pad|>``, placed in a private Hugging Face cache under its repository id."""
    from tokenizers import Tokenizer

    d = write_random_checkpoint(tmp_path / "src", "dream", seed=4, scale=4.0, max_position_embeddings=131072)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(use_mrope=False, max_window_layers=2, use_sliding_window=False, transformers_version="4.51.3")
    (d / "config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens(["<|dlm_pad|>"])
    tok.save(str(d / "tokenizer.json"))
    cache = tmp_path / "hub"
    _hub_snapshot(cache, "apple/DiffuCoder-7B-Instruct", d)
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))  # read once, at its import
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tok.token_to_id("<|dlm_pad|>")


def test_diffucoder_loads_by_alias_and_stops_at_dlm_pad(diffucoder):
    lm = load_model("diffucoder-7b", device="cpu", dtype="float32")
    assert lm.spec.family == "dream" and lm.spec.sampler == "dream" and lm.spec.logit_shift == 1
    assert lm.spec.stop_ids == (diffucoder,) and diffucoder in Engine.from_loaded(lm).end_ids.tolist()
    assert resolve_path("diffucoder-7b")[0].parts[-2] == "snapshots"


def test_diffucoder_decodes_with_its_authors_settings(cli, diffucoder):
    """The alias's shipped default profile: Dream's entropy alg, temperature 0.4, top-p 0.95, one token a
    step; the start line names the profile."""
    r = cli("generate", PROMPTS[0], "--model", "diffucoder-7b", "--gen-length", "16", "--block-length", "16",
            "--no-chat", "--jsonl")
    assert r.exit_code == 0, r.output
    assert "diffucoder-7b/default.yaml (shipped with ecache)" in r.stderr
    rec = json.loads(r.stdout.splitlines()[-1])
    decode = rec["settings"]["decode"] if "settings" in rec else rec["decode"]
    assert (decode["temperature"], decode["top_p"], decode["remasking"], decode["steps"]) == (0.4, 0.95, "entropy", 16)
    # the profile's one block is the whole canvas: at another --gen-length it stays one block, one token a step
    r = cli("generate", PROMPTS[0], "--model", "diffucoder-7b", "--gen-length", "32", "--no-chat", "--jsonl",
            "--temperature", "0")
    assert r.exit_code == 0, r.output
    decode = json.loads(r.stdout.splitlines()[-1])["settings"]["decode"]
    assert (decode["gen_length"], decode["block_length"], decode["steps"], decode["temperature"]) == (32, 32, 32, 0.0)


def test_llada_moe_runs_every_subcommand(cli, moe_dir, tmp_path):
    for args in (["generate", PROMPTS[1]],
                 ["generate", PROMPTS[1], "--cache", "dual", "--threshold", "0.9"],
                 ["profile", PROMPTS[0], "--policies", "none,entropy,dual", "--json", tmp_path / "p.json"],
                 ["trace-drift", PROMPTS[0], "--json", tmp_path / "t.json"],
                 ["calibrate", "--task", "list", "--limit", "2", "--metric", "fidelity", "--grid", "3", "--refine", "1",
                  "--max-drop", "100", "--no-speed-check", "--out", tmp_path / "c.yaml"]):
        r = cli(*args, "--model", moe_dir, *SMALL)
        assert r.exit_code == 0, (args, r.output)
    assert json.loads((tmp_path / "t.json").read_text())


def test_llada_moe_serves_and_evaluates_as_it_generates(cli, moe_dir, moe_lm, profiles_dir):
    """``ecache serve`` (official openai client) and the lm-eval model give ``ecache generate``'s answer."""
    pytest.importorskip("openai")
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from test_serve import client, serving

    from ecache_cli.evaluation.lm_eval_adapter import EcacheLM
    from ecache_cli.runs.settings import resolve_settings

    r = cli("generate", PROMPTS[0], "--model", moe_dir, "--gen-length", "16", "--block-length", "8", "--no-chat",
            "--cache", "dual", "--jsonl", "-q")
    assert r.exit_code == 0, r.output
    want = json.loads(r.stdout)["text"]
    settings = resolve_settings(str(moe_dir), {"gen_length": 16, "block_length": 8}, {"policy": "dual"})
    with serving(moe_lm, settings, api_key="k", max_batch=4) as (url, _):
        got = client(url, "k").completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16)
    assert got.choices[0].text == want
    adapter = EcacheLM.create_from_arg_string(f"model={moe_dir},device=cpu,cache=dual,gen_length=16,block_length=8,"
                                              "chat=false,mc_num=4")
    (text,) = adapter.generate_until([Instance("generate_until", {}, (PROMPTS[0], {"until": [], "max_gen_toks": 16}),
                                               0)])
    assert text == want
    ((ll, _),) = adapter.loglikelihood([Instance("loglikelihood", {}, ("Sort: 3 1", " 1 3"), 0)])
    assert ll < 0


def test_trace_drift_reports_how_caching_changes_the_routing(cli, moe_dir, llada_dir, tmp_path):
    """On a MoE model each partial step's record gives the share of the computed positions' expert choices that
    differ from a full forward's: 0 for a full forward, some but not all for a cached one; None on a dense model."""
    docs = {}
    for name, model, cache in (("moe", moe_dir, "dual"), ("dense", llada_dir, "dual"), ("none", moe_dir, "none")):
        r = cli("trace-drift", PROMPTS[0], "--model", model, *SMALL, "--cache", cache, "--jsonl", tmp_path / name,
                "--json", tmp_path / f"{name}.json")
        assert r.exit_code == 0, r.output
        recs = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        docs[name] = (json.loads((tmp_path / f"{name}.json").read_text()), [x for x in recs if "route_change" in x])
    summary, recs = docs["moe"]
    assert 0 < summary["route_change_mean"] < 0.5
    assert all(x["route_change"] == 0.0 for x in recs if x["refresh"])
    assert any(x["route_change"] > 0 for x in recs if not x["refresh"])
    assert docs["dense"][0]["route_change_mean"] is None and docs["none"][0]["route_change_mean"] is None


def fastdllm_reference(lm, prompt: list[int], gen_length: int, block_length: int, cache: str,
                       steps: int | None = None, threshold: float | None = None) -> list[int]:
    """Fast-dLLM's LLaDA generators written out plainly (docs/MODELS.md §6.1, §6.3, §6.4), batch 1, greedy:
    per block a full forward with a fresh K/V cache commits the step's tokens, then each step computes the
    positions from the block start to the canvas end (``prefix``) or the block alone (``dual``) against the
    cache; a step commits LLaDA's scheduled count of the most confident masks of the block, or with
    ``threshold`` every mask whose confidence reaches it plus the most confident one, until the block is done.
    The engine's deliberate difference is mirrored: the mask id and ids past the tokenizer are never chosen."""
    model, spec = lm.model, lm.spec
    P = len(prompt)
    x = torch.tensor([prompt + [spec.mask_id] * gen_length])
    T = x.shape[1]
    banned = [spec.mask_id] + list(range(len(lm.tokenizer), spec.vocab_size))
    n_blocks = gen_length // block_length
    per_block = (steps or gen_length) // n_blocks
    with torch.inference_mode():
        for b in range(n_blocks):
            start, end = P + b * block_length, P + (b + 1) * block_length
            q, r = divmod(block_length, per_block)
            schedule = [q + (1 if t < r else 0) for t in range(per_block)]
            store = model.new_store(torch.ones_like(x, dtype=torch.bool))
            t = 0
            while bool((x[0, start:end] == spec.mask_id).any()):
                if t == 0:
                    window = torch.arange(T)
                    logits = model(x, store)[0]  # (T, V) the block's refresh
                else:
                    window = torch.arange(start, T if cache == "prefix" else end)
                    logits = model(x, store, query_pos=window[None])[0]  # (len(window), V)
                logits = logits.double()
                logits[:, banned] = float("-inf")
                x0 = logits.argmax(-1)
                conf = logits.softmax(-1).gather(-1, x0[:, None]).squeeze(-1)
                pos = window
                ok = (pos >= start) & (pos < end) & (x[0, pos] == spec.mask_id)
                conf = torch.where(ok, conf, torch.full_like(conf, float("-inf")))
                if threshold is None:
                    pick = conf.topk(schedule[t]).indices
                else:
                    pick = ((conf >= threshold) | (torch.arange(len(conf)) == conf.argmax())).nonzero().flatten()
                x[0, pos[pick]] = x0[pick]
                t += 1
    return x[0, P:].tolist()


@pytest.mark.parametrize("family", ["llada", "moe"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("rule", [dict(steps=16), dict(steps=8), dict(threshold=0.9), dict(threshold=0.3)])
def test_fastdllm_caches_and_threshold_decoding_match_the_official_loops(family, cache, rule, request):
    """``--cache prefix|dual`` with LLaDA's schedule or Fast-dLLM's threshold rule decode as Fast-dLLM's LLaDA
    generators do, token for token, on LLaDA and on LLaDA-MoE."""
    lm = request.getfixturevalue(f"{family}_lm")
    eng = Engine.from_loaded(lm)
    cfg = DecodeConfig(gen_length=16, block_length=8, early_exit=False, **rule)
    for prompt in PROMPTS[:2]:
        ids = eng.encode([prompt], chat=False)[0]
        run = eng.start([ids], cfg, make_policy(cache))
        list(run)
        got = run.results()[0].token_ids
        assert got == fastdllm_reference(lm, ids, 16, 8, cache, **rule), (prompt, rule)
        assert len(set(got)) > 2  # not degenerate: the check can fail


def test_llada_moe_loads_by_alias_from_the_hub_cache(tmp_path, monkeypatch):
    """``--model llada-moe`` finds the official layout in the Hugging Face cache under its repository id."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    _hub_snapshot(cache, "inclusionAI/LLaDA-MoE-7B-A1B-Instruct", MOE)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = load_model("llada-moe", device="cpu", dtype="float32")
    assert lm.spec.family == "llada-moe" and lm.name == "llada-moe"
    with pytest.raises(ModelLoadError, match="inclusionAI/LLaDA-MoE-7B-A1B-Base"):
        load_model("llada-moe-base", device="cpu")
