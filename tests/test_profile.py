"""``ecache profile``: the measurement loop, traces, manifest and the CLI, on tiny random checkpoints."""

from __future__ import annotations

import json

import pytest

from ecache_cli.engine import DecodeConfig, Engine
from ecache_cli.engine.core import _NO_RANGE
from ecache_cli.runs.manifest import manifest
from ecache_cli.runs.profile import (
    ProfileOptions,
    ProfileReport,
    Request,
    measure,
    render_table,
    timing_warnings,
)
from ecache_cli.runs.settings import Settings

CFG = DecodeConfig(gen_length=16, block_length=8)
PROMPTS = ["Sort: 9 3 7 1", "Reverse: 4 5 6 7 8", "Add 12 and 30"]


def settings(cfg=CFG, **cache) -> Settings:
    return Settings(decode=cfg, cache="entropy", cache_params={"tau": 1.0}, all_cache_params={"tau": 1.0, **cache})


@pytest.fixture(scope="module")
def report_and_calls(request):
    lm = request.getfixturevalue("llada_lm")
    calls = []
    opts = ProfileOptions(policies=["none", "entropy", "dual"], warmup=1, repeats=2)
    rep = measure(Engine.from_loaded(lm), settings(), [Request(p) for p in PROMPTS], opts, chat=False,
                  on_run=lambda kind, p: calls.append((kind, p)))
    return rep, calls


def test_measure_reports_every_number(report_and_calls):
    rep, _ = report_and_calls
    assert rep.policies == ["none", "entropy", "dual"]
    none, ent = rep.summaries["none"], rep.summaries["entropy"]
    assert none["requests"] == len(PROMPTS) * 2 and none["runs"] == len(PROMPTS) * 2
    assert none["speedup_vs_none"] == pytest.approx(1.0)
    assert none["work_share_vs_none"] == pytest.approx(1.0) and none["work_share_per_forward"] == pytest.approx(1.0)
    assert none["fidelity_identical_share"] == 1.0 and none["fidelity_token_agreement"] == 1.0
    assert none["full_forwards_per_request"] == none["nfe_per_request"] and none["partial_forwards_per_request"] == 0
    # dual refreshes once per block it visits (2 blocks of 8, fewer after an early end), partial otherwise
    for run in rep.runs["dual"]:
        for r in run.rows:
            assert 1 <= r.full_forwards <= 2 and r.partial_forwards == r.nfe - r.full_forwards > 0
    assert rep.summaries["dual"]["work_share_vs_none"] < 1.0
    for s in rep.summaries.values():
        assert s["tokens_per_s"] > 0 and s["p95_ms"] >= s["p50_ms"] > 0
        assert 0 <= s["decision_overhead_pct"] < 100
        assert s["peak_memory_bytes"] > 0
    assert ent["params"]["tau"] == 1.0 and ent["params"]["recent_k"] == 64


def test_tokens_per_s_is_generated_tokens_over_wall(report_and_calls):
    rep, _ = report_and_calls
    for p in rep.policies:
        rows = [r for run in rep.runs[p] for r in run.rows]
        gen = sum(len(r.answer_ids) + (1 if len(r.answer_ids) < CFG.gen_length else 0) for r in rows)
        wall = sum(run.wall_s for run in rep.runs[p])
        assert rep.summaries[p]["generated_tokens"] == gen
        assert rep.summaries[p]["tokens_per_s"] == pytest.approx(gen / wall)


def test_warmup_first_then_policy_order_rotates(report_and_calls):
    _, calls = report_and_calls
    assert calls[:3] == [("warmup", "none"), ("warmup", "entropy"), ("warmup", "dual")]
    measured = [p for kind, p in calls if kind == "measure"]
    firsts = measured[::3]  # the first policy of each (repeat, prompt) round
    assert firsts == ["none", "entropy", "dual", "entropy", "dual", "none"]
    assert sorted(measured) == sorted(["none", "entropy", "dual"] * 6)


def test_table_has_one_row_per_policy(report_and_calls):
    from rich.console import Console

    rep, _ = report_and_calls
    con = Console(width=300, record=True)
    con.print(render_table(rep, wide=True))
    text = con.export_text()
    for p in rep.policies:
        assert f"│ {p} " in text
    for header in ("tok/s", "speedup", "p95", "NFE", "partial", "work %", "decision", "peak mem", "identical"):
        assert header in text
    con = Console(width=80, record=True)
    con.print(render_table(rep))  # the default view: the columns that matter, in 80 columns
    text = con.export_text()
    for header in ("tok/s", "speedup", "NFE", "work %", "identical", "agree"):
        assert header in text
    assert "p95" not in text and "…" not in text


def test_trace_holds_the_named_ranges(llada_lm, tmp_path):
    eng = Engine.from_loaded(llada_lm)
    opts = ProfileOptions(policies=["none", "entropy"], warmup=0, trace_dir=tmp_path / "tr", trace_steps=6)
    rep = measure(eng, settings(tau=1e9), [Request(PROMPTS[0])], opts, chat=False)  # tau huge: partial steps
    for p in ("none", "entropy"):
        info = rep.trace["policies"][p]
        assert info["steps"] == 6
        tb = info["files"]["tensorboard"]
        assert len(tb) == 1 and tb[0].endswith(".pt.trace.json") and f"/{p}/" in tb[0]
        names = {e.get("name") for e in json.loads(open(info["files"]["chrome_trace"]).read())["traceEvents"]}
        expected = {"ecache.decision.plan", "ecache.forward.full", "ecache.sampling_commit", "ecache.decision.observe",
                    "ecache.layer00.attention", "ecache.layer00.mlp", "ecache.layer01.mlp", f"ecache.request.{p}"}
        assert expected <= names, expected - names
        assert ("ecache.forward.partial" in names) == (p == "entropy")
        assert info["ranges"]["ecache.layer00.attention"]["count"] == 6
    # after tracing: no hooks left on the model, and runs have ranges off (a shared no-op context)
    model = llada_lm.model
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    run = eng.start(eng.encode(["x"], False), CFG, settings().policy("none"))
    assert run.ranges is False and run._range("ecache.any") is _NO_RANGE


def test_policy_variants_get_their_own_parameters(llada_lm):
    opts = ProfileOptions(policies=["none", "entropy", "entropy:tau=1e9:recent_k=2"], warmup=0)
    rep = measure(Engine.from_loaded(llada_lm), settings(), [Request(PROMPTS[0])], opts, chat=False)
    assert rep.summaries["entropy"]["params"]["recent_k"] == 64
    variant = rep.summaries["entropy:tau=1e9:recent_k=2"]
    assert variant["params"]["tau"] == 1e9 and variant["params"]["recent_k"] == 2
    assert variant["full_forwards_per_request"] == 1  # tau 1e9: only the first step refreshes


def test_manifest_holds_reproducibility_fields(llada_lm):
    m = manifest(llada_lm, settings(), 7, {"policies": ["none"]})
    for key in ("ecache_version", "git_commit", "python", "torch", "transformers", "device", "device_name", "dtype",
                "threads", "seed", "settings", "model_path", "config_sha256"):
        assert key in m, key
    assert m["seed"] == 7 and m["dtype"] == "float32" and m["threads"] >= 1
    assert len(m["config_sha256"]) == 64 and m["settings"]["decode"]["gen_length"] == 16
    assert m["policies"] == ["none"]


SMALL = ["--gen-length", "16", "--block-length", "8", "--no-chat", "-q", "--warmup", "0"]


def test_cli_profile_json_last_line(cli, llada_dir, tmp_path):
    loud = [a for a in SMALL if a != "-q"]  # -q would drop the table on stderr (the JSON holds the results)
    r = cli("profile", "--model", llada_dir, "--policies", "none,entropy", *loud, "--json", "-", "Sort: 3 1 2", "Hi")
    assert r.exit_code == 0, (r.stdout, r.stderr)
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(doc["policies"]) == {"none", "entropy"}
    assert doc["policies"]["none"]["speedup_vs_none"] == pytest.approx(1.0)
    assert doc["manifest"]["model_path"] == str(llada_dir) and doc["manifest"]["policies"] == ["none", "entropy"]
    assert len(doc["requests"]) == 4
    assert "tok/s" in r.stderr  # with --json - the table goes to stderr, stdout holds only the JSON line
    out = tmp_path / "p.json"
    r2 = cli("profile", "--model", llada_dir, "--policies", "dual", *SMALL, "--json", out, "Sort: 3 1 2")
    assert r2.exit_code == 0, r2.stderr
    assert "tok/s" in r2.stdout and json.loads(out.read_text())["policies"]["dual"]["speedup_vs_none"] is None


def test_trace_steps_without_a_trace_dir_is_warned_as_ignored(cli, llada_dir):
    """``--trace-steps`` sets the steps of the traces ``--trace-dir`` writes: without it, one warning that it
    is ignored (as every ignored flag gets), the run as without the flag."""
    r = cli("profile", "--model", llada_dir, "--policies", "none", *SMALL, "--trace-steps", "4", "--json", "-", "Hi")
    assert r.exit_code == 0, r.stderr
    assert r.stderr.splitlines() == ["warning: --trace-steps is used only with --trace-dir; ignored"]
    assert json.loads(r.stdout.strip().splitlines()[-1])["policies"]["none"]["requests"] == 1
    r = cli("profile", "--model", llada_dir, "--policies", "none", *SMALL, "--json", "-", "Hi")
    assert r.exit_code == 0 and r.stderr == "", r.stderr


def test_cli_profile_reads_stdin_and_input(cli, llada_dir, tmp_path):
    r = cli("profile", "--model", llada_dir, "--policies", "none", *SMALL, "--json", "-", input="Sort: 3 1 2\n\nabc\n")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["policies"]["none"]["requests"] == 2
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "a b c"}\n{"prompt": "d e"}\n{"prompt": "f"}\n')
    r = cli("profile", "--model", llada_dir, "--policies", "none", *SMALL, "--input", f, "--limit", "2", "--json", "-")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["policies"]["none"]["requests"] == 2


def test_cli_profile_task_prompts_and_score(cli, llada_dir):
    r = cli("profile", "--model", llada_dir, "--policies", "none,dual", "--task", "arith", "--limit", "2", *SMALL,
            "--json", "-")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["task"]["name"] == "arith" and doc["task"]["limit"] == 2
    assert doc["policies"]["none"]["score"] in (0.0, 0.5, 1.0)


@pytest.mark.parametrize("args,needle", [
    (["--policies", "none,bogus", "x"], "bogus"),
    (["--policies", "none,none", "x"], "--policies none,none lists none twice; give each value once: --policies none"),
    (["--policies", "entropy:tau=1,entropy:tau=1.0", "x"], "(entropy:tau=1 and entropy:tau=1.0 are the same setting)"),
    (["--policies", "entropy:tau=1:recent_k=4,entropy:recent_k=4:tau=1", "x"], "are the same setting); keep one"),
    (["--policies", "none,,dual", "x"], "--policies none,,dual has an empty entry; remove the extra comma: "
                                        "--policies none,dual"),
    (["--policies", "", "x"], "--policies '' names nothing"),
    (["--repeats", "0", "x"], "--repeats"),
    (["--task", "arith", "x"], "--task"),
    (["--shots", "2", "x"], "--shots"),
    (["--policies", "none,entropy:bogus=1", "x"], "bogus"),
    (["--policies", "entropy:tau", "x"], "key=value"),
    (["--threads", "0", "x"], "--threads"),
])
def test_cli_profile_usage_errors(cli, llada_dir, args, needle):
    r = cli("profile", "--model", llada_dir, *SMALL, *args)
    assert r.exit_code == 2, (r.stdout, r.stderr)
    assert needle in r.stderr and r.stderr.count("\n") == 1


def test_forward_breakdown_splits_matrix_other_and_python(tmp_path):
    from ecache_cli.runs.tracing import forward_breakdown

    def ev(name, ts, dur, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}

    events = [ev("ecache.forward.partial", 0, 100, "user_annotation"), ev("aten::linear", 10, 30),
              ev("aten::mm", 12, 26), ev("aten::mul", 50, 10), ev("aten::add", 200, 5),  # outside the range
              ev("ecache.forward.partial", 300, 50, "user_annotation"),
              ev("aten::scaled_dot_product_attention", 310, 20)]
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"traceEvents": events}))
    got = forward_breakdown(f)["partial"]
    assert got["count"] == 2
    assert got["mean_ms"] == pytest.approx(75 / 1e3)
    assert got["matrix_ms"] == pytest.approx((30 + 20) / 2 / 1e3)  # the nested aten::mm is not counted twice
    assert got["other_ops_ms"] == pytest.approx(10 / 2 / 1e3)
    assert got["python_ms"] == pytest.approx((150 - 50 - 10) / 2 / 1e3)


def test_timing_warnings_flag_speedups_the_work_cannot_explain():
    def rep(**pols):
        summaries = {"none": {"speedup_vs_none": 1.0, "work_share_vs_none": 1.0}}
        summaries.update({p: {"speedup_vs_none": sp, "work_share_vs_none": w} for p, (sp, w) in pols.items()})
        return ProfileReport(policies=list(summaries), summaries=summaries, runs={}, memory_kind="peak_rss",
                             decode=CFG)

    # 10x faster with 65% of the work: impossible, flagged with both numbers
    (line,) = timing_warnings(rep(entropy=(10.0, 0.65), dual=(1.4, 0.6)))
    assert line.startswith("warning: entropy") and "10.00x" in line and "65%" in line and "1.54x" in line
    # slower than none while skipping work: flagged; within the bound or without none's numbers: not
    assert len(timing_warnings(rep(entropy=(0.5, 0.3)))) == 1
    assert timing_warnings(rep(entropy=(2.9, 0.3), prefix=(None, None))) == []


@pytest.mark.parametrize("signal_name,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupt_after_the_timed_runs_still_writes_the_json(signal_name, code, cli, llada_dir, tmp_path,
                                                                 monkeypatch):
    """Ctrl-C / SIGTERM while the finished runs are summed up is held until --json is written: the document
    covers every prompt (``"incomplete": false``), one error line says so, exit 130 / 143."""
    import os
    import signal

    from ecache_cli.runs import profile as prof

    real = prof._Bench.summaries

    def summaries(self, runs):
        os.kill(os.getpid(), getattr(signal, signal_name))
        return real(self, runs)

    monkeypatch.setattr(prof._Bench, "summaries", summaries)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    js = tmp_path / "p.json"
    res = cli("profile", "--model", llada_dir, "--policies", "none,entropy", *SMALL, "--json", js, "Sort: 3 1 2", "Hi")
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert res.exit_code == code, (res.exit_code, res.stderr)
    doc = json.loads(js.read_text())
    assert doc["incomplete"] is False and doc["prompts_done"] == 2 and len(doc["requests"]) == 4, doc
    assert [ln for ln in res.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: interrupted after every policy finished; the results cover all 2 prompts; --json {js} holds them"]
