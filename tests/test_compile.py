"""``--compile``: the compiled step (``ecache_cli/models/compiled.py``) on CPU (inductor).

Both forms are tested: the bucketed one with slots (``pad=True``, CUDA's default, CUDA graphs aside)
and the CPU default (rows symbolic, none padded, the store's own tensors). The tests use batches of
3-4 rows and canvases of at most 32 positions (a 13-token prompt + 16 generated), so each forward
lands in one bucket per form (queries and logits rows as wide as the canvas, whose length is
symbolic): the file compiles two graphs (the second process and the CLI read them from the inductor
cache of this module's temporary folder), which keeps it near a minute on 2 cores. Compiled and eager
forwards are compared in float32."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from cli_helpers import one_line_error, without_cut_warning
from conftest import REPO

from ecache_cli.cache import POLICIES, make_policy
from ecache_cli.decoding.config import DecodeConfig
from ecache_cli.engine.core import Engine
from ecache_cli.errors import EcacheError
from ecache_cli.models import compiled
from ecache_cli.models.compiled import StaticStep, bucket, prompt_bucket

PROMPTS = ["Sort: 9 3 7 1", "abc", "x=2; y=x*3"]  # 13, 3 and 10 tokens: left padded
JOINING = "1 2 3 4"
CFG = DecodeConfig(gen_length=16, block_length=8, steps=16)
SMALL = ["--gen-length", "16", "--block-length", "8", "--no-chat", "-q"]


#: Tests that compile the random checkpoints' decoding with inductor (tens of seconds each on a 2-core CPU):
#: ``.ci/run``'s slow step. The default run keeps the checks that an eager run imports no compiler.
COMPILES = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory):
    """This module's compiled artefacts in a temporary folder (never the user's cache)."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("inductor")
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def step(llada_lm, inductor_cache):
    """The random LLaDA checkpoint's static step with buckets and slots (``pad=True``: CUDA's default),
    shared by the tests (its graphs stay compiled): one graph at most, so the sub-batches of refreshing
    rows pad up to the 4-row bucket."""
    return StaticStep(llada_lm.model, max_graphs=1, pad=True)


@pytest.fixture(scope="module")
def free(llada_lm, inductor_cache):
    """The CPU default: rows and canvas length symbolic, no row padded, the store's own tensors."""
    return StaticStep(llada_lm.model)


def _start(engine: Engine, policy: str, prompts=PROMPTS):
    params = POLICIES[policy].test_params if policy != "none" else {}
    return engine.start(engine.encode(prompts, chat=False), CFG, make_policy(policy, **params), seed=0)


def _decode(engine: Engine, policy: str, join_at: int | None = None):
    """Token ids of every row; with ``join_at`` a fourth prompt joins after that many steps."""
    run = _start(engine, policy)
    for i, _ in enumerate(run):
        if i + 1 == join_at:
            run.add(engine.encode([JOINING], chat=False)[0])
    return [r.token_ids for r in run.results()], run


def test_buckets_are_powers_of_two_within_the_canvas():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert bucket(5, 32) == 32 and bucket(40, 32) == 64
    assert bucket(40, 32, 44) == 44 and bucket(29, 32, 29) == 29  # never wider than the canvas
    # prompt widths: powers of two and 1.5 times them, unless the canvas would pass the model's positions
    assert [prompt_bucket(p, 16, 4096) for p in (1, 13, 17, 25, 600, 1000, 1025)] == [16, 16, 24, 32, 768, 1024, 1536]
    assert prompt_bucket(4000, 256, 4096) == 4000


@COMPILES
def test_compiled_forward_matches_eager(llada_lm, step):
    """Full forward, then a partial one with padded (repeated) query positions: logits within 1e-4 and
    the K/V written into the store equal the eager forward's."""
    model = llada_lm.model
    run = _start(Engine(step, llada_lm.tokenizer, llada_lm.spec), "none")  # (the canvas: 29)
    tokens, key_mask = run.state.tokens.clone(), run.state.key_mask
    T = tokens.shape[1]
    logits_pos = torch.arange(T - 16, T - 8).expand(3, 8)  # the first block's positions
    with torch.inference_mode():
        eager, comp = model.new_store(key_mask), step.new_store(key_mask)
        want, got = model(tokens, eager, None, logits_pos), step(tokens, comp, None, logits_pos)
        assert got.shape == want.shape == (3, 8, llada_lm.spec.vocab_size)
        assert (got - want).abs().max().item() <= 1e-4
        tokens[:, T - 16:T - 13] = torch.tensor([5, 6, 7])  # three commits, then a partial forward over them
        query = torch.tensor([[T - 16, T - 15, T - 14, T - 16], [T - 15, T - 14, T - 13, T - 15], [3, T - 16, 3, 3]])
        lpos = query[:, 1:3]
        want, got = model(tokens, eager, query, lpos), step(tokens, comp, query, lpos)
        assert (got - want).abs().max().item() <= 1e-4
        for a, b in zip(eager.k + eager.v, comp.k + comp.v):
            assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-4
        cut = slice(2, None)  # a canvas 2 positions shorter: the same graph (its length is symbolic)
        want = model(tokens[:, cut], model.new_store(key_mask[:, cut]), None, logits_pos - 2)
        got = step(tokens[:, cut], step.new_store(key_mask[:, cut]), None, logits_pos - 2)
        assert (got - want).abs().max().item() <= 1e-4
    assert eager.shrunk is None and comp.shrunk is None and comp.produced is None
    assert step.stats.graphs == step.stats.traces == 1 and step.stats.buckets == [[4, "T", "T", True]]


@COMPILES
@pytest.mark.parametrize("policy", ["none", "entropy"])
def test_compiled_decoding_is_token_identical(llada_lm, step, policy):
    """Compiled and eager decoding agree token for token, also for a row joining mid-run, which reuses the
    graph of its batch bucket (3 and 4 rows share bucket 4: still one graph, the store bound again)."""
    want, _ = _decode(Engine.from_loaded(llada_lm), policy, join_at=3)
    rebinds = step.stats.rebinds
    got, run = _decode(Engine(step, llada_lm.tokenizer, llada_lm.spec), policy, join_at=3)
    assert got == want and len(got) == 4
    assert step.stats.graphs == step.stats.traces == 1 and step.stats.eager_calls == 0
    assert step.stats.rebinds > rebinds  # the join (and rows leaving) moved the store into the slot again
    assert run.wall_s >= 0 and all(r.stats["tokens_per_s"] > 0 for r in run.results() if r.stats["generated_tokens"])


@COMPILES
@pytest.mark.parametrize("policy", ["none", "entropy"])
def test_unpadded_decoding_is_token_identical(llada_lm, free, policy):
    """The CPU default (rows and canvas length symbolic, no row padded): the same tokens as eager, rows
    joining and leaving and sub-batches of every size served by one graph (plus a variant where a
    batch of one row is specialised), never bound to a slot."""
    want, _ = _decode(Engine.from_loaded(llada_lm), policy, join_at=3)
    got, _ = _decode(Engine(free, llada_lm.tokenizer, llada_lm.spec), policy, join_at=3)
    assert got == want and len(got) == 4
    assert free.stats.graphs == 1 and free.stats.buckets == [["any", "T", "T", True]]
    assert free.stats.traces <= 4 and free.stats.eager_calls == 0 and free.stats.rebinds == 0


@COMPILES
def test_graphs_are_bounded_and_hooks_run_eager(llada_lm, step):
    """At ``max_graphs`` a 1-row forward pads up to the compiled 4-row bucket; with no bucket to hold it
    (``max_graphs=0``) it runs eager, with the eager result; a forward with a hook (attention rows) runs
    eager."""
    model = llada_lm.model
    run = _start(Engine(step, llada_lm.tokenizer, llada_lm.spec), "none")  # (the canvas: 29)
    tokens, key_mask = run.state.tokens, run.state.key_mask
    pos = torch.arange(20, 24).expand(3, 4)
    one = slice(1, 2)  # a left-padded row: the bucket's padding mask
    with torch.inference_mode():
        want = model(tokens[one], model.new_store(key_mask[one]), None, pos[one])
        calls, eager_calls = step.stats.compiled_calls, step.stats.eager_calls
        got = step(tokens[one], step.new_store(key_mask[one]), None, pos[one])
        assert step.stats.compiled_calls == calls + 1 and step.stats.graphs == 1
        assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-4
        step(tokens, step.new_store(key_mask), None, pos, attn_pos=pos)
        assert step.stats.eager_calls == eager_calls + 1 and step.stats.graphs == 1
        bounded = StaticStep(model, max_graphs=0)
        got = bounded(tokens[one], bounded.new_store(key_mask[one]), None, pos[one])
    assert bounded.stats.graphs == 0 and bounded.stats.eager_calls == 1 and torch.equal(got, want)


def test_no_compiler_is_one_line_error(monkeypatch, cli, llada_dir, llada_lm):
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(EcacheError, match="build-essential"):
        StaticStep(llada_lm.model)
    res = cli("generate", "--model", llada_dir, "--compile", *SMALL, "abc")
    one_line_error(res, 1, "--compile needs a C++ compiler", "build-essential")


@COMPILES
def test_second_process_reuses_compiled_artefacts(llada_dir, free, inductor_cache):
    """A fresh process compiling the same graph loads it from the inductor cache: FX graph cache hits,
    no miss (``free`` compiled it in this process first)."""
    assert free.stats.graphs == 1
    script = textwrap.dedent(f"""
        import json, torch
        torch.set_num_threads(1)
        from torch._dynamo.utils import counters
        from ecache_cli.cache import make_policy
        from ecache_cli.decoding.config import DecodeConfig
        from ecache_cli.engine.core import Engine
        from ecache_cli.models.compiled import StaticStep
        from ecache_cli.models.loader import load_model
        lm = load_model({str(llada_dir)!r}, device="cpu", dtype="float32")
        st = StaticStep(lm.model)
        eng = Engine(st, lm.tokenizer, lm.spec)
        run = eng.start(eng.encode({PROMPTS!r}, chat=False), DecodeConfig(gen_length=16, block_length=8, steps=16),
                        make_policy("none"))
        next(iter(run))
        print(json.dumps({{"hit": counters["inductor"]["fxgraph_cache_hit"],
                          "miss": counters["inductor"]["fxgraph_cache_miss"], "graphs": st.stats.graphs}}))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["hit"] >= 1 and got["miss"] == 0 and got["graphs"] == 1, got


@COMPILES
def test_cli_compile_flag_and_profile_key(cli, llada_dir, profiles_dir, tmp_path):
    """``generate --compile`` prints what it compiled and the eager answers; the profile key ``compile``
    turns it on, ``--no-compile`` off; ``profile --compile --json`` reports the graphs in its manifest."""
    args = ["generate", "--model", llada_dir, *SMALL[:-1], "-b", "4", "--cache", "none", *PROMPTS]
    eager = cli(*args)
    assert eager.exit_code == 0, eager.stderr
    comp = cli(*args, "--compile")
    assert comp.exit_code == 0, comp.stderr
    assert comp.stdout == eager.stdout
    assert "--compile: 1 graph(s)" in comp.stderr and "--compile" not in eager.stderr
    prof = tmp_path / "on.yaml"
    prof.write_text("compile: true\ncache: {policy: none}\n")
    on = cli(*args, "--profile", prof)
    assert on.exit_code == 0 and on.stdout == eager.stdout and "--compile: 1 graph(s)" in on.stderr
    off = cli(*args, "--profile", prof, "--no-compile")
    assert off.exit_code == 0 and "--compile:" not in without_cut_warning(off.stderr)
    prof.write_text("compile: 3\n")
    one_line_error(cli(*args, "--profile", prof), 2, "compile: 3 must be true or false")
    doc = tmp_path / "p.json"
    res = cli("profile", "--model", llada_dir, *SMALL, "--compile", "--policies", "none", "--warmup", "0",
              "-b", "4", "--json", doc, *PROMPTS)
    assert res.exit_code == 0, res.stderr
    report = json.loads(doc.read_text())["manifest"]["compile"]
    assert report["graphs"] == 1 and report["compiled_calls"] > 0 and report["eager_calls"] == 0
    assert report["buckets"] == [["any", "T", "T", True]] and report["compile_s"] >= 0


def test_eager_runs_leave_the_compiler_unimported_and_compiled_ones_use_ecaches_folder(tmp_path, llada_dir):
    """Importing the model code does not import torch's compiler (whose import picks and creates an artefact
    folder: a bad TORCHINDUCTOR_CACHE_DIR would break every command); --compile sets ecache's folder first,
    and one it cannot use is a one-line error."""
    code = ("import os, sys; import ecache_cli.models.loader, ecache_cli.engine, ecache_cli.cli; "
            "assert 'torch._dynamo' not in sys.modules, 'imported'; "
            "from ecache_cli.models.compiled import prepare_compiler; prepare_compiler(); "
            "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "xdg" / "ecache" / "inductor")
    (tmp_path / "file").write_text("")
    bad = {**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "file" / "x"), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "ecache_cli", "generate", "x", "--model", str(llada_dir), "--gen-length", "16",
            "--block-length", "8", "--no-chat", "-q"]
    eager = subprocess.run(args, env=bad, capture_output=True, text=True, cwd=tmp_path)
    assert eager.returncode == 0, eager.stderr
    comp = subprocess.run([*args, "--compile"], env=bad, capture_output=True, text=True, cwd=tmp_path)
    assert comp.returncode == 1 and comp.stderr.strip().count("\n") == 0, comp.stderr
    assert "compiled-artefact folder" in comp.stderr and "TORCHINDUCTOR_CACHE_DIR" in comp.stderr


@COMPILES
def test_a_mixture_of_experts_compiles_whole_and_decodes_the_same(moe_lm, inductor_cache):
    """LLaDA-MoE's experts inside one compiled graph (fixed shapes, no host sync for the expert counts):
    the same tokens as eager, rows joining and leaving, no forward left eager."""
    free = StaticStep(moe_lm.model)
    want, _ = _decode(Engine.from_loaded(moe_lm), "entropy", join_at=3)
    got, _ = _decode(Engine(free, moe_lm.tokenizer, moe_lm.spec), "entropy", join_at=3)
    assert got == want and len(got) == 4
    assert free.stats.graphs == 1 and free.stats.eager_calls == 0 and free.stats.compiled_calls > 10


@COMPILES
def test_a_block_diffusion_model_compiles_with_its_block_causal_mask(inductor_cache):
    """SDAR under the CPU graphs: the block-causal mask of the widened queries is a graph input, so the block
    cache's forwards compile (none runs eager) and decode the tokens of the eager model, rows joining too;
    the bucketed (CUDA) form runs them eager."""
    from pathlib import Path

    from ecache_cli.engine import DecodeConfig
    from ecache_cli.models.loader import load_model

    lm = load_model(Path(__file__).parent / "fixtures" / "sdar", device="cpu", dtype="float32")
    prompts = [[5, 9, 17, 40, 41], [7, 8, 9], [30, 31, 32, 33, 34, 35, 36, 37, 38], [60, 61]]
    cfg = DecodeConfig(gen_length=16, block_length=4, threshold=0.85)

    def decode(model):
        run = Engine(model, lm.tokenizer, lm.spec).start(prompts[:2], cfg, make_policy("block"), prompt_width=12)
        for i, _ in enumerate(run):
            if i == 3:
                run.add(prompts[2])
                run.add(prompts[3])
        return [r.token_ids for r in run.results()]

    free = StaticStep(lm.model)
    assert decode(free) == decode(lm.model)
    assert free.stats.eager_calls == 0 and free.stats.compiled_calls > 10
    padded = StaticStep(lm.model, pad=True)
    store = lm.model.new_store(torch.ones(1, 8, dtype=torch.bool), block=4)
    with torch.inference_mode():
        padded(torch.full((1, 8), 5), store)
    assert padded.stats.eager_calls == 1
