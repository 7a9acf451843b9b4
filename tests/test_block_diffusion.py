"""Block diffusion (SDAR, LLaDA2.x): the official code's logits, router and generation loops on tiny
checkpoints it wrote (``tests/fixtures/sdar``, ``tests/fixtures/llada2-mini``; their READMEs say how),
the exact cache of finished blocks against recomputing everything, batching and the policy refusals.

Tolerances: the official float32 logits move by 1.4e-5 (SDAR) and 1.9e-5 (LLaDA2) when the same code
runs in float64 (the fixtures' metadata), so a re-implementation that sums in another order is held to
5e-5 of either; generation is held token for token."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ecache_cli.cache import make_policy
from ecache_cli.engine import DecodeConfig, Engine
from ecache_cli.errors import UsageError
from ecache_cli.models.loader import load_model

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BLOCK = {"sdar": 4, "llada2-mini": 8}
TOL = 5e-5


@pytest.fixture(scope="module", params=["sdar", "llada2-mini"])
def fixture(request):
    d = FIXTURES / request.param
    with safe_open(str(d / "official_outputs.safetensors"), "pt") as f:
        meta = f.metadata()
    ref = load_file(d / "official_outputs.safetensors")
    return request.param, load_model(d, device="cpu", dtype="float32"), ref, meta


def _forward(lm, ids, block, query=None, store=None):
    store = store or lm.model.new_store(torch.ones_like(ids, dtype=torch.bool), block=block)
    with torch.inference_mode():
        return lm.model(ids, store, query_pos=query), store


def test_logits_of_a_sequence_and_of_cached_blocks_equal_the_official_code(fixture):
    name, lm, ref, _ = fixture
    assert lm.spec.block_causal and lm.spec.family == name.split("-")[0]
    ids, bl = ref["ids"], BLOCK[name]
    full, _ = _forward(lm, ids, bl)
    assert (full - ref["logits"]).abs().max() <= TOL
    assert (full.double() - ref["logits_f64"].double()).abs().max() <= TOL
    # the official cache path: positions 0..15 first, then 16..23 against their cached keys and values
    _, store = _forward(lm, ids, bl, query=torch.arange(16)[None])
    cached, _ = _forward(lm, ids, bl, query=torch.arange(16, 24)[None], store=store)
    assert (cached - ref["cached_logits"]).abs().max() <= TOL
    assert (cached - full[:, 16:]).abs().max() <= 1e-5
    # block-causal: a block's logits do not depend on any later position
    later = ids.clone()
    later[:, 16:] = 5
    changed, _ = _forward(lm, later, bl)
    assert (changed[:, :16] - full[:, :16]).abs().max() <= 1e-5  # (experts batch other tokens: rounding only)
    assert (changed[:, 16:] - full[:, 16:]).abs().max() > 0.1


def test_without_the_block_mask_the_logits_differ(fixture):
    """The block mask matters: the same forward with bidirectional attention is far from the official one."""
    name, lm, ref, _ = fixture
    ids = ref["ids"]
    with torch.inference_mode():
        bidirectional = lm.model(ids, lm.model.new_store(torch.ones_like(ids, dtype=torch.bool)))
    assert (bidirectional - ref["logits"]).abs().max() > 0.1


def test_the_llada2_router_chooses_and_weighs_as_the_official_gate():
    lm = load_model(FIXTURES / "llada2-mini", device="cpu", dtype="float32")
    ref = load_file(FIXTURES / "llada2-mini" / "official_outputs.safetensors")
    layer = lm.model.model.layers[1]
    seen = []
    hook = layer.post_attention_layernorm.register_forward_hook(lambda m, i, o: seen.append(o))
    try:
        _forward(lm, ref["ids"], 8)
    finally:
        hook.remove()
    with torch.inference_mode():
        idx, weight = layer.mlp.route(seen[0].reshape(-1, seen[0].shape[-1]))
    assert torch.equal(idx, ref["router_idx"])
    assert (weight - ref["router_weight"]).abs().max() <= 1e-6
    assert torch.allclose(weight.sum(-1), torch.full((24,), 2.5))  # renormalised, times routed_scaling_factor


#: LLaDA2.1's ``generate`` defaults (dllm llada21 copy), for the runs that leave them unsaid
LLADA21_DEFAULTS = {"threshold": 0.95, "editing_threshold": 0.9, "max_post_steps": 16}


def _official_runs(name: str, meta: dict) -> list[tuple[str, dict]]:
    """(output key, official arguments) of each generation the fixture holds, LLaDA2.1's with its defaults."""
    runs = json.loads(meta["gen_args"]).items()
    return [(k, {**LLADA21_DEFAULTS, **a} if k.startswith("gen_llada21") else a) for k, a in runs]


def _config(a: dict) -> DecodeConfig:
    """The DecodeConfig of an official run's arguments (steps per block → ecache's total steps)."""
    bl, G = a["block_length"], a["gen_length"]
    steps = a.get("denoising_steps", a.get("steps"))
    threshold = a.get("confidence_threshold", a.get("threshold"))
    if a.get("remasking_strategy") == "low_confidence_static":
        threshold = None
    return DecodeConfig(gen_length=G, block_length=bl, steps=steps and steps * (G // bl), threshold=threshold,
                        edit_threshold=a.get("editing_threshold"), max_post_steps=a.get("max_post_steps", 16))


@pytest.mark.filterwarnings("ignore::ecache_cli.errors.IgnoredSetting")  # the official runs pass SDAR's steps too
@pytest.mark.parametrize("policy", ["block", "none"])
def test_the_official_generation_loops_token_for_token(fixture, policy):
    name, lm, ref, meta = fixture
    prompt = ref["gen_prompt"][0].tolist()
    runs = _official_runs(name, meta)
    assert len(runs) == (4 if name == "sdar" else 6)
    for key, a in runs:
        if "stopping_criteria_idx" in a:  # SDAR's stop ids: any of them ends the answer
            spec = replace(lm.spec, eos_id=a["stopping_criteria_idx"][0], stop_ids=tuple(a["stopping_criteria_idx"]))
        else:  # LLaDA2's eos_id
            spec = replace(lm.spec, eos_id=a["eos_id"])
        eng = Engine(lm.model, lm.tokenizer, spec)
        run = eng.start([prompt], _config(a), make_policy(policy))
        nfe = sum(1 for _ in run)
        res = run.results()[0]
        out = ref[key][0].tolist()
        want = out[len(prompt):len(prompt) + a["gen_length"]] if name == "sdar" else out  # LLaDA2: the answer
        got = res.answer_ids + ([res.token_ids[len(res.answer_ids)]] if res.ended else [])  # with its end marker
        if res.ended:  # the official answer runs on to the end of the block holding the end marker
            want = want[:len(got)]
        assert got == want, key
        forwards = json.loads(meta["forwards"])[key]
        # SDAR spends one more forward per finished block (and the prefill) writing keys and values; LLaDA2
        # runs the same forwards (LLaDA2.1's mask-free editing steps included) until the block holding EOS
        assert nfe <= forwards and (name == "sdar" or nfe == forwards or res.ended), (key, nfe, forwards)


def _logits_per_step(lm, prompts, cfg, policy):
    eng = Engine.from_loaded(lm)
    run = eng.start(prompts, cfg, make_policy(policy))
    steps = []
    run.on_forward = lambda r, plan, q, sources, logits: steps.append((r.state.rows.clone(), sources.clone(),
                                                                       logits.clone()))
    records = list(run)
    return run.results(), records, steps


def test_the_block_cache_equals_recomputing_everything_token_and_logit(fixture):
    name, lm, ref, _ = fixture
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 150, (n,), generator=g).tolist() for n in (9, 6, 12)]  # three block offsets
    cfg = DecodeConfig(gen_length=16, block_length=BLOCK[name], steps=16)
    ref_res, ref_recs, ref_logits = _logits_per_step(lm, prompts, cfg, "none")
    got_res, got_recs, got_logits = _logits_per_step(lm, prompts, cfg, "block")
    assert [r.token_ids for r in got_res] == [r.token_ids for r in ref_res]
    assert len(got_logits) == len(ref_logits)
    for (rows_a, src_a, lg_a), (rows_b, src_b, lg_b) in zip(got_logits, ref_logits):
        assert torch.equal(rows_a, rows_b) and torch.equal(src_a, src_b)
        assert (lg_a - lg_b).abs().max() <= 1e-5
    assert all(rec.full for rec in ref_recs) and not any(rec.refresh.any() for rec in got_recs)
    # the block cache computes each row's current block (plus, entering a block, the one just finished)
    T = got_recs[0].targets.new_tensor(0) + ref_recs[0].query_width
    assert sum(r.stats["tokens_computed"] for r in got_res) < 0.5 * sum(r.stats["tokens_computed"] for r in ref_res)
    assert max(rec.query_width for rec in got_recs[1:]) <= 2 * BLOCK[name] < int(T)


class _ForceRows:
    """``block`` with original row r also refreshing at the steps where (step + r) % 3 == 1: mixed steps
    (``block`` itself never refreshes)."""

    def __init__(self):
        self.inner = make_policy("block")
        self.name, self.keeps_hidden = self.inner.name, self.inner.keeps_hidden

    def plan(self, state):
        p = self.inner.plan(state)
        return replace(p, refresh=p.refresh | ((state.row_step + state.rows) % 3 == 1))

    def __getattr__(self, name):  # reset, observe, add_rows, select_rows: the inner policy's
        return getattr(self.inner, name)


def test_a_merged_mixed_step_is_block_causal_as_the_split_forwards(fixture, monkeypatch):
    """``MERGE_REFRESH``: refreshing rows computing every position inside the partial forward get each
    query's own block mask, as their full forward does: the same tokens and logits as the two forwards."""
    from ecache_cli.engine import forward

    name, lm, _, _ = fixture
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 150, (n,), generator=g).tolist() for n in (9, 6, 12)]
    cfg = DecodeConfig(gen_length=16, block_length=BLOCK[name], steps=16)
    got = []
    for merge in (False, True):
        monkeypatch.setattr(forward, "MERGE_REFRESH", merge)
        eng = Engine.from_loaded(lm)
        run = eng.start(prompts, cfg, _ForceRows())
        steps = []
        run.on_forward = lambda r, plan, q, sources, logits, steps=steps: steps.append(
            (q is not None and q.shape[1], logits.clone()))
        records = list(run)
        got.append(([r.token_ids for r in run.results()], records, steps))
    (tok_s, rec_s, steps_s), (tok_m, rec_m, steps_m) = got
    assert tok_m == tok_s
    mixed = 0
    for rec, (_, lg_s), (width, lg_m) in zip(rec_m, steps_s, steps_m):
        assert (lg_m - lg_s).abs().max() <= 1e-5
        if 0 < int(rec.refresh.sum()) < len(rec.rows):
            mixed += 1
            assert width == rec.query_width == int(rec.computed.max())  # every position, one forward
    assert mixed >= 3


def test_a_prompt_decodes_the_same_alone_in_a_batch_and_joining_a_running_one(fixture):
    name, lm, _, _ = fixture
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 150, (n,), generator=g).tolist() for n in (7, 13, 4, 10)]
    cfg = DecodeConfig(gen_length=16, block_length=BLOCK[name], threshold=0.5)
    eng = Engine.from_loaded(lm)
    alone = [eng.generate([p], cfg, make_policy("block"), chat=False)[0].token_ids for p in prompts]
    batch = eng.generate(prompts, cfg, make_policy("block"), chat=False)
    assert [r.token_ids for r in batch] == alone
    run = eng.start(prompts[:2], cfg, make_policy("block"), prompt_width=16)
    for i, _ in enumerate(run):
        if i == 2:  # rows join at different blocks of the running rows
            run.add(prompts[2])
            run.add(prompts[3])
    assert [r.token_ids for r in run.results()] == alone


def test_approximate_policies_are_refused_on_block_diffusion_and_block_on_bidirectional(fixture, llada_lm):
    name, blm, ref, _ = fixture
    eng = Engine.from_loaded(blm)
    cfg = DecodeConfig(gen_length=16, block_length=BLOCK[name], steps=16)
    for policy in ("entropy", "dual", "d2cache"):
        with pytest.raises(UsageError) as e:
            eng.start([[5, 6, 7]], cfg, make_policy(policy))
        msg = str(e.value)
        assert f"--cache {policy} does not apply to the {blm.spec.family} model family" in msg
        assert msg.endswith("use none or block") and "\n" not in msg
    with pytest.raises(UsageError, match="--cache block does not apply to the llada model family .*; use one of none,"):
        Engine.from_loaded(llada_lm).start([[5, 6, 7]], DecodeConfig(gen_length=16, block_length=8),
                                           make_policy("block"))


def test_the_command_line_runs_a_block_diffusion_folder_with_its_defaults(cli):
    """From a folder: the family's cache (block) and decoding defaults (SDAR: blocks of 4, threshold 0.85);
    an approximate policy is refused with one line, exit 2."""
    r = cli("generate", "--model", str(FIXTURES / "sdar"), "--gen-length", "16", "--jsonl", "hello")
    assert r.exit_code == 0, r.stderr
    assert "cache block" in r.stderr.splitlines()[0]
    rec = json.loads(r.stdout)
    assert rec["settings"]["cache"] == "block"
    assert rec["settings"]["decode"]["block_length"] == 4 and rec["settings"]["decode"]["threshold"] == 0.85
    assert len(rec["token_ids"]) == 16 and rec["stats"]["full_forwards"] == 0
    r = cli("generate", "--model", str(FIXTURES / "sdar"), "--gen-length", "16", "--cache", "entropy", "hi")
    assert r.exit_code == 2 and "does not apply to the sdar model family" in r.stderr


def test_a_profile_policy_that_does_not_apply_to_the_family_names_the_profile(cli, tmp_path):
    """A profile's ``cache.policy`` the family does not take is refused before the load, as ``--cache`` is, and
    the error names the profile that set it (no ``--cache`` was given); ``--cache`` over it overrides it."""
    prof = tmp_path / "pe.yaml"
    prof.write_text("cache:\n  policy: entropy\n  tau: 0.5\n")
    r = cli("generate", "--model", str(FIXTURES / "sdar"), "--profile", str(prof), "--gen-length", "16", "hi")
    assert r.exit_code == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: --cache entropy does not apply to the sdar model family (its attention is block-causal, so the "
        "keys and values of finished blocks are cached exactly); use none or block (cache entropy from profile "
        f"{prof}; pass the flag to override)"), r.stderr
    r = cli("generate", "--model", str(FIXTURES / "sdar"), "--profile", str(prof), "--gen-length", "16", "--cache",
            "block", "-q", "hi")
    assert r.exit_code == 0, r.stderr


@pytest.mark.parametrize("quiet", [[], ["-q"]])
def test_a_folder_without_tokenizer_config_runs_without_library_noise(tmp_path, profiles_dir, quiet):
    """Without tokenizer_config.json the tokenizer loads through transformers' AutoTokenizer, which reads
    config.json and warns that its ``rope_scaling`` is deprecated (a FutureWarning): that never reaches
    stderr, with or without -q; one note says the prompts go in without the chat template. A subprocess:
    in-process, pytest records the warnings instead of printing them."""
    import os
    import shutil
    import subprocess
    import sys

    folder = tmp_path / "sdar-noconf"
    shutil.copytree(FIXTURES / "sdar", folder)
    (folder / "tokenizer_config.json").unlink()
    cmd = [sys.executable, "-m", "ecache_cli", "generate", *quiet, "--model", str(folder), "--gen-length", "16", "hi"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"})
    assert p.returncode == 0, p.stderr
    assert "Warning" not in p.stderr and "warnings.warn" not in p.stderr and "rope_scaling" not in p.stderr, p.stderr
    notes = [ln for ln in p.stderr.splitlines() if ln.startswith("note: ")]
    assert notes == [f"note: {folder} has no tokenizer_config.json, so prompts go in without the chat template; copy "
                     "the checkpoint's tokenizer_config.json into it, or pass --no-chat for plain prompts"], p.stderr
    lines = p.stderr.splitlines()
    assert all(ln.startswith(("note: ", "warning: ", "using model")) for ln in lines), p.stderr
    assert any(ln.startswith("using model") for ln in lines) != bool(quiet)


def test_a_folder_without_tokenizer_config_under_no_chat_has_no_note(cli, tmp_path):
    """The note comes from every command that templates its prompts (the load's, ``runtime.load_for_command``),
    and from none under ``--no-chat`` or for a folder that has its template."""
    import shutil

    folder = tmp_path / "sdar-noconf"
    shutil.copytree(FIXTURES / "sdar", folder)
    (folder / "tokenizer_config.json").unlink()
    note = f"note: {folder} has no tokenizer_config.json, so prompts go in without the chat template"
    for command in (["profile", "--policies", "none", "--warmup", "0"], ["trace-drift", "--rows", "0"]):
        r = cli(*command, "-q", "--model", folder, "--gen-length", "16", "hi")
        assert r.exit_code == 0 and r.stderr.count(note) == 1, (command, r.stderr)
        r = cli(*command, "-q", "--no-chat", "--model", folder, "--gen-length", "16", "hi")
        assert r.exit_code == 0 and "note:" not in r.stderr, (command, r.stderr)
    r = cli("generate", "-q", "--no-chat", "--model", folder, "--gen-length", "16", "hi")
    assert r.exit_code == 0 and "note:" not in r.stderr, r.stderr
    r = cli("generate", "-q", "--model", FIXTURES / "sdar", "--gen-length", "16", "hi")  # its template is there
    assert r.exit_code == 0 and "note:" not in r.stderr, r.stderr


def test_profile_compares_the_policies_that_apply_and_records_tokens_per_forward(cli):
    """Without --policies, profile on a block-diffusion folder runs none and block (the others do not apply);
    both decode the same answers, block computing far less; the records carry TPF."""
    r = cli("profile", "--model", str(FIXTURES / "sdar"), "--gen-length", "16", "--json", "-", "hello", "abc def")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    summ = doc["summary"] if "summary" in doc else doc
    text = json.dumps(summ)
    assert '"block"' in text and '"entropy"' not in text
    r = cli("generate", "--model", str(FIXTURES / "sdar"), "--gen-length", "16", "--jsonl", "hello")
    stats = json.loads(r.stdout)["stats"]
    assert stats["tokens_per_forward"] == stats["generated_tokens"] / stats["nfe"] >= 1.0


@pytest.mark.parametrize("model, policies, wants", [
    ("llada2-mini", "none,block,entropy",
     "error: --policies entropy does not apply to the llada2 model family (its attention is block-causal, so the "
     "keys and values of finished blocks are cached exactly); use none or block"),
    ("llada2-mini", "none,foo", "error: --policies 'foo' is not a cache policy; use one of none, block"),
    ("llada-moe", "none,block",
     "error: --policies block does not apply to the llada-moe model family"),
])
def test_profile_refuses_policies_that_do_not_apply_by_their_flag_before_the_start_line(cli, model, policies,
                                                                                       wants):
    """``profile --policies``: a policy for the other attention, or one that is none (listing those that apply
    to the family), is refused naming --policies, before the "using model" line and the load."""
    r = cli("profile", "--model", str(FIXTURES / model), "--gen-length", "32", "--block-length", "8",
            "--policies", policies, "x")
    assert r.exit_code == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()  # nothing printed before it
    assert line.startswith(wants), line


@pytest.mark.parametrize("model, flags, wants", [
    ("llada2-mini", ["--gen-length", "16"],
     "error: --gen-length 16 is not a multiple of --block-length 32 (the llada2 family's default): "),
    ("sdar", ["--gen-length", "18"], "--block-length 4 (the sdar family's default): "),
    ("sdar", ["--gen-length", "18", "--block-length", "4"], "is not a multiple of --block-length 4: "),
])
def test_a_block_length_from_the_family_default_is_named_as_such(cli, model, flags, wants):
    """A decode setting the user did not give, from ``Family.decode_defaults``, is said to be the family's
    default in the error about it; one the user gave is not."""
    r = cli("generate", "--model", str(FIXTURES / model), *flags, "x")
    assert r.exit_code == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert wants in line, line


def test_profile_refuses_a_policy_once_the_loaded_model_shows_its_attention(llada_lm):
    """A model whose family is known only once loaded (a repository id) gets the same --policies error from
    ``run_profile``, before anything is decoded."""
    from ecache_cli.runs.profile import ProfileOptions, Request, run_profile
    from ecache_cli.runs.settings import resolve_settings

    settings = resolve_settings("tiny", {"gen_length": 16, "block_length": 8}, {})
    with pytest.raises(UsageError, match=r"^--policies block does not apply to the llada model family .*; use one of "
                                         r"none, prefix,"):
        run_profile(llada_lm, settings, [Request("x")], ProfileOptions(policies=["none", "block"], warmup=0))


def test_token_editing_rewrites_committed_tokens_of_the_current_block_only():
    """LLaDA2.1's editing on the fixture: some step rewrites a committed token (never a prompt token of the
    first block, never an earlier block), the block runs mask-free editing steps, and the answers of
    ``none`` and ``block`` agree; on a bidirectional model the setting is refused."""
    lm = load_model(FIXTURES / "llada2-mini", device="cpu", dtype="float32")
    prompt = load_file(FIXTURES / "llada2-mini" / "official_outputs.safetensors")["gen_prompt"][0].tolist()
    cfg = DecodeConfig(gen_length=16, block_length=8, threshold=0.7, edit_threshold=0.5)
    run = Engine.from_loaded(lm).start([prompt], cfg, make_policy("block"))
    before, edits, free_steps = run.state.tokens.clone(), 0, 0
    for _ in run:
        if run.state.batch == 0:
            break
        st = run.state
        changed = (st.tokens != before) & ~st.masked & (before != lm.spec.mask_id)  # tokens rewritten
        assert not changed[:, :run.P].any()  # the prompt, also its tail inside the first block, is never edited
        pos = changed.nonzero()[:, 1]
        assert ((pos >= st.block_start[0]) & (pos < st.block_end[0])).all()
        edits += int(changed.sum())
        free_steps += int(st.mask_free_steps.sum() > 0)
        before = st.tokens.clone()
    assert edits > 0 and free_steps > 0


def test_edit_threshold_is_refused_on_a_bidirectional_model(llada_lm):
    with pytest.raises(UsageError, match="--edit-threshold is LLaDA2.1's token editing"):
        Engine.from_loaded(llada_lm).start([[5, 6, 7]], DecodeConfig(gen_length=16, block_length=8, edit_threshold=0.5),
                                           make_policy("none"))


@pytest.mark.parametrize("name,flags", [
    ("sdar", []), ("llada2-mini", ["--block-length", "8", "--threshold", "0.7", "--edit-threshold", "0.5"])],
    ids=["sdar", "llada2.1-editing"])
def test_serve_decodes_concurrent_requests_as_generate_does(tmp_path, cli, name, flags):
    """``ecache serve`` on a block-diffusion folder: requests sent together join the running batch at different
    blocks (each prefilled on its first step) and every answer equals ``generate``'s for its prompt alone (with
    token editing too: only finished blocks count as final)."""
    import os
    import re
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    httpx = pytest.importorskip("httpx")
    model = str(FIXTURES / name)
    prompts = ["hello", "a longer prompt, of several blocks", "abc", "x = 1; y = 2"]
    want = []
    for p in prompts:
        r = cli("generate", "--model", model, "--gen-length", "16", "--no-chat", "--jsonl", *flags, p)
        assert r.exit_code == 0, r.stderr
        want.append(json.loads(r.stdout)["text"])
    env = {**os.environ, "ECACHE_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "XDG_CONFIG_HOME": str(tmp_path / "config")}
    env.pop("ECACHE_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "ecache_cli", "serve", "--model", model, "--port", "0",
                             "--gen-length", "16", *flags], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:  # it prints the address before serving
            lines.append(line)
            if "listening on" in line:
                break
        url = re.search(r"http://127\.0\.0\.1:\d+", "".join(lines)).group(0)
        assert "cache block" in "".join(lines)
        assert "--prefix-cache (exact; at most 1024 MiB)" in lines[-1]  # on by default where reuse is exact

        def ask(p):
            body = {"model": model, "prompt": p, "max_tokens": 16}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, prompts))
    finally:
        proc.terminate()
        proc.wait(30)
    assert got == want


def test_lm_eval_generates_as_generate_and_refuses_a_likelihood():
    """lm-eval on a block-diffusion folder: generate_until gives ``generate``'s answer; loglikelihood (LLaDA's
    bidirectional Monte Carlo estimate) is refused in one line instead of computed wrongly."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from ecache_cli.evaluation.lm_eval_adapter import EcacheLM

    lm = EcacheLM.create_from_arg_string(f"model={FIXTURES / 'sdar'},device=cpu,gen_length=16")
    got = lm.generate_until([Instance(request_type="generate_until", doc={}, arguments=("hello", {"until": []}),
                                      idx=0)])
    loaded = load_model(FIXTURES / "sdar", device="cpu", dtype="float32")
    eng = Engine.from_loaded(loaded)
    want = eng.generate(["hello"], DecodeConfig(gen_length=16, block_length=4, threshold=0.85), make_policy("block"))
    assert got == [want[0].text]
    with pytest.raises(UsageError, match="block-diffusion model, whose likelihood"):
        lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=("hello", " world"), idx=0)])


@pytest.mark.parametrize("alias,repo,folder", [("sdar-4b", "JetLM/SDAR-4B-Chat", "sdar"),
                                               ("llada2.1-mini", "inclusionAI/LLaDA2.1-mini", "llada2-mini")])
def test_an_alias_loads_from_the_hub_cache_and_runs_its_defaults(tmp_path, monkeypatch, profiles_dir, cli, alias,
                                                                 repo, folder):
    """By alias, from a Hugging Face cache holding the official-format folder under the alias's repository:
    the family, its block cache and decoder defaults (LLaDA2.1: its shipped profile's token editing)."""
    import huggingface_hub.constants
    from test_families import _hub_snapshot

    cache = tmp_path / "hub"
    _hub_snapshot(cache, repo, FIXTURES / folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = load_model(alias, device="cpu", dtype="float32")
    assert lm.spec.family == folder.split("-")[0] and lm.spec.block_causal
    args = ["--block-length", "8"] if folder == "llada2-mini" else []
    r = cli("generate", "--model", alias, "--gen-length", "16", *args, "--jsonl", "hello")
    assert r.exit_code == 0, r.stderr
    dec = json.loads(r.stdout)["settings"]["decode"]
    assert json.loads(r.stdout)["settings"]["cache"] == "block"
    assert dec["edit_threshold"] == (0.9 if alias == "llada2.1-mini" else None)


def test_every_decode_setting_is_a_profile_and_model_args_key():
    """A profile's decode section and lm-eval's model_args take every DecodeConfig field (the editing ones too)."""
    import dataclasses

    from ecache_cli.config import DECODE_KEYS

    assert DECODE_KEYS == {f.name for f in dataclasses.fields(DecodeConfig)}


def test_threshold_1_is_sdars_static_rule():
    """--threshold 1 (nothing is strictly above it) commits the scheduled count every step: the official
    low_confidence_static run, token for token."""
    lm = load_model(FIXTURES / "sdar", device="cpu", dtype="float32")
    ref = load_file(FIXTURES / "sdar" / "official_outputs.safetensors")
    prompt = ref["gen_prompt"][0].tolist()
    cfg = DecodeConfig(gen_length=16, block_length=4, steps=16, threshold=1.0)
    res = Engine.from_loaded(lm).generate([prompt], cfg, make_policy("block"), chat=False)[0]
    assert res.token_ids == ref["gen_sdar_static"][0, len(prompt):len(prompt) + 16].tolist()


def test_stream_shows_the_answers_positions_and_ends_its_line(cli):
    """--stream off a terminal: the last frame is the answer (not the last block's positions past it) on
    a line of its own, so the next stderr line starts fresh."""
    r = cli("generate", "--model", str(FIXTURES / "sdar"), "--gen-length", "16", "--jsonl", "--stream", "hello")
    assert r.exit_code == 0, r.stderr
    text = json.loads(r.stdout)["text"]
    frames = [ln for ln in r.stderr.splitlines() if ln.startswith("[0] step ")]
    assert frames and frames[-1].split(": ", 1)[1] == text.rstrip()
    assert all(ln.startswith(("[0] step ", "using model", "warning:")) for ln in r.stderr.splitlines())


def test_models_show_names_the_family_defaults_a_folder_runs_with(cli):
    r = cli("models", "show", str(FIXTURES / "sdar"))
    assert r.exit_code == 0, r.stderr
    line = " ".join(" ".join(r.stdout.split()).split("default profile")[1:])
    assert "sdar family's block_length 4, threshold 0.85, cache block" in line


@pytest.mark.parametrize("command", ["generate", "profile", "trace-drift"])
@pytest.mark.parametrize("model, remasking", [("sdar", "random"), ("llada2-mini", "entropy")])
def test_a_remasking_flag_wins_over_the_family_default_threshold(cli, command, model, remasking):
    """defaults < profile < flags: ``--remasking`` other than low_confidence needs fixed-step decoding, so the
    family's default threshold (SDAR 0.85, LLaDA2 0.95) is dropped with a note naming it, in every command;
    a ``--threshold`` the user gives beside it still conflicts (exit 2)."""
    fam = {"sdar": ("sdar", 0.85), "llada2-mini": ("llada2", 0.95)}[model]
    out = {"generate": ["--jsonl"], "profile": ["--warmup", "0", "--json", "-"],
           "trace-drift": ["--rows", "0", "--json", "-"]}[command]
    args = [command, "--model", str(FIXTURES / model), "--gen-length", "32", "--block-length", "8", "--no-chat",
            "--remasking", remasking, *out]
    r = cli(*args, "hello")
    assert r.exit_code == 0, r.stderr
    assert (f"note: --remasking {remasking} needs fixed-step decoding: --threshold {fam[1]:g} (the {fam[0]} family's "
            "default) is dropped") in r.stderr, r.stderr
    doc = json.loads(r.stdout.splitlines()[0])
    decode = (doc["settings"] if command == "generate" else doc["manifest"]["settings"])["decode"]
    assert decode["threshold"] is None and decode["remasking"] == remasking
    both = cli(*args, "--threshold", "0.9", "hello")
    assert both.exit_code == 2 and f"--remasking {remasking} cannot be used with threshold" in both.stderr


def test_a_remasking_flag_wins_over_a_profile_threshold(cli, tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text("decode:\n  threshold: 0.7\n")
    r = cli("generate", "--gen-length", "16", "--block-length", "8", "--profile", prof, "--remasking", "random",
            "--jsonl", "Sort: 3 1 2")
    assert r.exit_code == 0, r.stderr
    assert f"--threshold 0.7 (profile {prof}) is dropped" in r.stderr, r.stderr
    assert json.loads(r.stdout)["settings"]["decode"]["threshold"] is None


def test_the_block_benchs_logit_gap_is_zero_where_the_cache_is_exact(fixture):
    """``bench/block_speed.py``'s ``logit_gap`` (which GPU runs read for the dtype's rounding) finds the
    tolerance's gap and no differing commit on the official-format fixtures in float32, and compares
    every step."""
    from cli_helpers import load_bench

    name, lm, _, _ = fixture
    gap = load_bench("block_speed").logit_gap(lm, "Sort: 9 3 7 1", DecodeConfig(gen_length=16, block_length=BLOCK[name],
                                                                                 steps=16))
    assert gap["first_differing_step"] is None and gap["steps_compared"] == gap["steps"] > 0
    assert gap["max_abs_logit_diff"] <= 1e-5
