"""bench/frontier.py: knob grids, Pareto frontiers, the dominance rule (0.97 slack), the margin over dual's
fastest point, the profile gap, per-pass speedups, and one tiny end-to-end run on the embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import load_bench

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fr():
    return load_bench("frontier")


def P(fr, policy, speedup, agreement, spec=None, label=""):
    return fr.Point(policy=policy, spec=spec or f"{policy}:{speedup}:{agreement}", speedup=speedup,
                    agreement=agreement, label=label)


def test_expand_is_the_cartesian_product_in_order_and_specs_parse_back(fr):
    from ecache_cli.runs.profile import parse_policy_spec

    specs = fr.expand("entropy", {"tau": [0.0, 0.5], "recent_k": [16, 64], "block_refresh": [False, True]})
    assert len(specs) == 8
    assert specs[0] == "entropy:tau=0.0:recent_k=16:block_refresh=false"
    assert specs[1] == "entropy:tau=0.0:recent_k=16:block_refresh=true"
    assert specs[-1] == "entropy:tau=0.5:recent_k=64:block_refresh=true"
    assert parse_policy_spec(specs[-1]) == ("entropy", {"tau": 0.5, "recent_k": 64, "block_refresh": True})
    assert parse_policy_spec(fr.spec("entropy", {"tau": 0.00271}))[1] == {"tau": 0.00271}
    assert fr.expand("dual", {}) == ["dual"]
    with pytest.raises(ValueError, match="knob kr has no values"):
        fr.expand("dllm-cache", {"kr": []})


def test_every_grid_point_is_a_valid_setting_and_no_peer_point_is_its_forced_refresh(fr):
    from ecache_cli.cache import POLICIES
    from ecache_cli.runs.profile import parse_policy_spec

    for size, grids in fr.GRIDS.items():
        taus = {s: [0.1, 0.5, 2.0] for s in ("max-entropy", "sum-entropy", "max-confidence")}
        specs = fr.policy_specs([*fr.PEER_ORDER, "entropy"], size, taus)
        assert len(specs) == len(set(specs))
        for s in specs:
            name, params = parse_policy_spec(s)  # raises for an unknown knob or a value out of range
            forced = POLICIES[name].forced_refresh
            if name != "entropy" and forced:
                assert not all(params.get(k) == v for k, v in forced.items()), s
        n_entropy = sum(1 for s in specs if s.startswith("entropy:"))
        want = 0
        for fam in grids["entropy"]:
            size = 3  # τ values
            for vs in fam.values():
                size *= len(vs)
            want += size
        assert n_entropy == want
        assert any("recent_steps=" in s for s in specs)  # the variant is swept beside the paper's rule
    assert set(fr.GRIDS["small"]) == set(fr.PEER_ORDER) | {"entropy"} == set(POLICIES) - {"none", "block"}


def test_high_block_tau_is_the_workloads_largest_tau_below_the_maximum(fr):
    fam = {"recent_k": [0], "recent_steps": [1], "block_tau": [fr.HIGH_TAU], "signal": ["max-entropy"]}
    specs = fr.entropy_axes([fam], {"max-entropy": [4.6, 0.2, 4.08, 0.6]})
    assert specs == [f"entropy:tau={t}:recent_k=0:recent_steps=1:block_tau=4.08:signal=max-entropy"
                     for t in (0.2, 0.6, 4.08, 4.6)]
    assert fr.entropy_axes([fam], {"max-entropy": [1.5]}) == \
        ["entropy:tau=1.5:recent_k=0:recent_steps=1:block_tau=1.5:signal=max-entropy"]


def test_fixed_points_are_kept_and_tau_grid_follows_the_signal(fr):
    assert fr.policy_specs(["dual:refresh_every=2", "entropy:tau=1"], "small", {}) == \
        ["dual:refresh_every=2", "entropy:tau=1"]
    sig = [0.1 * i for i in range(1, 101)] + [None, float("-inf")]
    taus = fr.tau_grid(sig, 4)
    assert len(taus) == 4 and taus == sorted(taus)
    assert taus[-1] == 10.0  # the largest signal (rounded up): no step of none refreshes
    assert taus[0] == pytest.approx(5.05, rel=1e-3)  # the median: about half the steps refresh
    assert taus[1] == pytest.approx(9.01, rel=1e-3)  # the 0.9 quantile: a tenth of the steps
    assert fr.tau_grid([None], 4) == [1.0]


def test_pareto_keeps_exactly_the_undominated_points(fr):
    pts = [P(fr, "dual", 1.0, 1.0), P(fr, "dual", 2.0, 0.9), P(fr, "dual", 1.5, 0.8), P(fr, "dual", 2.0, 0.95),
           P(fr, "dual", 3.0, 0.5), P(fr, "dual", 0.9, 1.0)]
    front = fr.pareto(pts)
    assert [(p.speedup, p.agreement) for p in front] == [(1.0, 1.0), (2.0, 0.95), (3.0, 0.5)]


def test_dominance_uses_the_097_slack_and_needs_agreement_at_least_the_peers(fr):
    ent = [P(fr, "entropy", 1.94, 0.95, "e1"), P(fr, "entropy", 3.0, 0.80, "e2")]
    # 1.94 >= 0.97 * 2.0 = 1.94 (matched at the edge); agreement 0.95 >= 0.95
    assert fr.dominates(ent, [P(fr, "dual", 2.0, 0.95)])["dominated"] is True
    # 1.94 < 0.97 * 2.01
    r = fr.dominates(ent, [P(fr, "dual", 2.01, 0.95, "d-fast"), P(fr, "dual", 1.0, 0.9, "d-slow")])
    assert r == {"dominated": False, "points": 2, "unmatched": ["d-fast"]}
    # faster entropy points do not count when less faithful
    assert fr.dominates(ent, [P(fr, "dual", 1.0, 0.96, "d")])["unmatched"] == ["d"]
    assert fr.dominates(ent, [])["dominated"] is None  # no peer point: no verdict
    assert fr.dominates([], [P(fr, "dual", 1.0, 0.9)])["dominated"] is None  # no entropy point: no verdict
    assert fr.match(ent, P(fr, "dual", 1.5, 0.8)).spec == "e2"  # the fastest qualifying entropy point


def test_margin_over_duals_fastest_point(fr):
    dual = [P(fr, "dual", 1.0, 1.0, "d0"), P(fr, "dual", 2.0, 0.9, "d-fast")]
    ent = [P(fr, "entropy", 2.3, 0.91, "e-ok"), P(fr, "entropy", 4.0, 0.85, "e-unfaithful")]
    r = fr.beats_fastest(ent, dual)
    assert r["ok"] is True and r["ratio"] == pytest.approx(1.15)
    assert r["dual_fastest"] == ("d-fast", 2.0, 0.9) and r["entropy"][0] == "e-ok"
    assert fr.beats_fastest([P(fr, "entropy", 2.1, 0.95)], dual)["ok"] is False  # 1.05x < 1.10x
    assert fr.beats_fastest(ent, [])["ok"] is None
    assert fr.beats_fastest([], dual)["ok"] is None


def test_profile_gap_and_not_slower_than_none(fr):
    ent = [P(fr, "entropy", 3.0, 0.95, "e"), P(fr, "entropy", 2.95, 0.96, "prof", "profile:list")]
    g = fr.frontier_gap(ent[1], ent)
    assert g["ratio"] == 1.0 and g["ok"] is True  # nothing at >= 0.96 agreement is faster
    low = P(fr, "entropy", 2.8, 0.95, "p2", "profile:arith")
    g = fr.frontier_gap(low, ent + [low])
    assert g["ratio"] == pytest.approx(2.8 / 3.0) and g["ok"] is False and g["frontier_point"] == "e"
    slow = P(fr, "entropy", 0.99, 1.0, "p3", "profile:code")
    assert fr.frontier_gap(slow, [slow])["ok"] is False  # on the frontier, but slower than none
    # the default profile (one setting for every domain) need only not be slower than none
    default = P(fr, "entropy", 2.0, 0.96, "d", "profile:default")
    g = fr.frontier_gap(default, ent + [default])
    assert g["ratio"] == pytest.approx(2.0 / 2.95) and g["domain"] is False and g["ok"] is True
    assert fr.frontier_gap(P(fr, "entropy", 0.9, 1.0, "d", "profile:default"), ent)["ok"] is False
    both = P(fr, "entropy", 2.0, 0.96, "d", "profile:list,profile:default")  # also a domain's profile
    assert fr.frontier_gap(both, ent + [both])["ok"] is False


def test_profile_points_follow_the_mode_and_match_grid_specs(fr, tmp_path, monkeypatch):
    import yaml

    monkeypatch.setenv("ECACHE_PROFILES", str(tmp_path))
    d = tmp_path / "mymodel"
    d.mkdir()
    for name, cache in (("list", {"tau": 0.002, "recent_k": 0, "recent_steps": 4}),
                        ("list-parallel", {"tau": 0.3, "recent_k": 64}),
                        ("default", {"tau": 0.001, "recent_k": 16, "block_refresh": True})):
        (d / f"{name}.yaml").write_text(yaml.safe_dump({"model": "mymodel", "task": name,
                                                        "cache": {"policy": "entropy", **cache}}))
    plain = fr.profile_points("mymodel", "list")
    assert plain == {"profile:list": "entropy:tau=0.002:recent_k=0:recent_steps=4:signal=max-entropy",
                     "profile:default": "entropy:tau=0.001:recent_k=16:block_refresh=true:signal=max-entropy"}
    # the same spec as the grid's variant family writes for that point
    assert plain["profile:list"] in fr.expand("entropy", {"tau": [0.002], "recent_k": [0], "recent_steps": [4],
                                                          "signal": ["max-entropy"]})
    par = fr.profile_points("mymodel", "list", parallel=True)  # no default-parallel: the plain default
    assert par == {"profile:list-parallel": "entropy:tau=0.3:recent_k=64:block_refresh=false:signal=max-entropy",
                   "profile:default": plain["profile:default"]}


def test_verdicts_group_points_per_policy(fr):
    pts = [P(fr, "dual", 1.5, 0.99, "d1"), P(fr, "prefix", 1.2, 1.0, "p1"), P(fr, "entropy", 1.6, 1.0, "e1"),
           P(fr, "entropy", 1.5, 0.9, "e2", "profile:list")]
    v = fr.verdicts(pts)
    assert v["frontiers"] == {"dual": ["d1"], "prefix": ["p1"], "entropy": ["e1"]}
    assert list(v["dominance"]) == ["prefix", "dual"]
    assert all(d["dominated"] for d in v["dominance"].values())
    assert v["beats_dual_fastest"]["ok"] is False and v["beats_dual_fastest"]["ratio"] == pytest.approx(1.6 / 1.5)
    assert [g["label"] for g in v["profiles"]] == ["profile:list"] and v["profiles"][0]["ok"] is False


def test_pass_speedups_pair_passes_with_nones(fr):
    from ecache_cli.metrics.throughput import RowMeasure, RunMeasure

    def run(policy, repeat, tokens, wall):
        row = RowMeasure(prompt=0, repeat=repeat, generated_tokens=tokens, latency_s=wall, nfe=1, full_forwards=1,
                         partial_forwards=0, tokens_computed=1, canvas=1)
        return RunMeasure(policy=policy, wall_s=wall, forward_s=wall, decision_s=0, sampling_s=0, steps=1, rows=[row])

    base = [run("none", 0, 10, 1.0), run("none", 1, 10, 2.0), run("none", 2, 10, 1.0)]
    mine = [run("e", 0, 10, 0.5), run("e", 1, 10, 0.5), run("e", 2, 10, 0.25)]
    assert fr.pass_speedups(mine, base) == [2.0, 4.0, 4.0]


def test_markdown_and_plot_from_a_document(fr, tmp_path):
    from dataclasses import asdict

    pts = [P(fr, "dual", 1.5, 0.99, "dual:refresh_every=0"), P(fr, "entropy", 1.8, 1.0, "entropy:tau=1.0")]
    doc = {"model": "tiny", "n": 2, "seed": 5, "passes": 3, "grid": "small", "gen_length": 32, "block_length": 32,
           "threshold": 0.9, "margin": 1.1,
           "workloads": {"list@0shot|plain": {"points": [asdict(p) for p in pts], "verdicts": fr.verdicts(pts)}}}
    md = fr.markdown(doc)
    assert "| list@0shot | plain | dual | 1 | yes | – |" in md
    assert "| entropy | `entropy:tau=1.0` | 1.80x | 100.0 | – | – |" in md
    out = tmp_path / "f.png"
    fr.plot(doc, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    s = fr.summary(doc)
    assert s["plain"]["dominates_all"] == {"list": True} and s["plain"]["beats_dual_fastest_domains"] == 1


def exit_code(fr, argv) -> int:
    """``fr.main(argv)``'s status, whether returned or raised (argparse-level errors exit via SystemExit)."""
    try:
        return fr.main(argv)
    except SystemExit as e:
        return e.code


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_bad_input_is_one_line_exit_2(fr, capsys):
    assert exit_code(fr, ["--gsm8k-shots", "x"]) == 2
    assert "--gsm8k-shots x: 'x' is not a whole number" in one_line_error(capsys)
    assert exit_code(fr, ["--modes", "fast"]) == 2
    assert one_line_error(capsys) == "error: --modes 'fast' is not a mode; use plain, threshold"
    assert exit_code(fr, ["--policies", "dual:nope=1"]) == 2
    assert "nope" in one_line_error(capsys)
    assert fr.main(["--domains", "poetry", "--n", "1"]) == 2
    assert "poetry" in capsys.readouterr().err
    assert fr.main(["--seed", "0", "--domains", "list", "--n", "1"]) == 2  # the shipped list profile's seed
    assert "calibrated with" in capsys.readouterr().err


def test_end_to_end_tiny_run(fr, tmp_path, capsys):
    """One workload, two points besides none, on the embedded model: the JSON line holds both points with
    their per-pass speedups, fidelity in [0, 1] and the verdicts; the Markdown and the PNG are written."""
    md, png = tmp_path / "f.md", tmp_path / "f.png"
    rc = fr.main(["--domains", "list", "--shots", "0", "--n", "1", "--passes", "1", "--warmup", "0",
                  "--modes", "plain", "--policies", "dual:refresh_every=0,entropy:tau=0.0:recent_k=16",
                  "--no-profiles", "--gen-length", "32", "--block-length", "16", "--threads", "1",
                  "--markdown", str(md), "--plot", str(png)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    wl = doc["workloads"]["list@0shot|plain"]
    pts = {p["spec"]: p for p in wl["points"]}
    assert set(pts) == {"dual:refresh_every=0", "entropy:tau=0.0:recent_k=16"}
    ent = pts["entropy:tau=0.0:recent_k=16"]
    assert ent["agreement"] == 1.0 and ent["identical"] == 1.0  # τ = 0 refreshes every step: decodes as none
    assert len(ent["speedups"]) == 1 and ent["speedup"] > 0
    assert 0 <= pts["dual:refresh_every=0"]["agreement"] <= 1
    assert set(wl["verdicts"]["dominance"]) == {"dual"}
    assert wl["taus"]["max-entropy"] == sorted(wl["taus"]["max-entropy"]) and wl["taus"]["max-entropy"][0] > 0
    assert "| list@0shot | plain | dual |" in md.read_text()
    assert png.stat().st_size > 1000

    # --merge: two runs' JSON files, one set of tables; a workload in both files is refused
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(doc) + "\n")
    b.write_text(json.dumps({**doc, "workloads": {"arith@0shot|plain": wl}}) + "\n")
    assert fr.main(["--merge", str(a), str(b), "--markdown", str(md)]) == 0
    merged = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(merged["workloads"]) == {"list@0shot|plain", "arith@0shot|plain"}
    assert set(merged["summary"]["plain"]["dominates_all"]) == {"list", "arith"}
    assert "| arith@0shot | plain | dual |" in md.read_text()
    assert fr.main(["--merge", str(a), str(a)]) == 2
    assert "is in two files" in capsys.readouterr().err
    b.write_text(json.dumps({**doc, "seed": 7}) + "\n")
    assert fr.main(["--merge", str(a), str(b)]) == 2
    assert "seed=7 differs" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--domains", "list,list"], "--domains list,list lists list twice; give each value once: --domains list"),
    (["--domains", "list,"], "--domains list, has an empty entry; remove the extra comma: --domains list"),
    (["--domains", "arith,,code"],
     "--domains arith,,code has an empty entry; remove the extra comma: --domains arith,code"),
    (["--shots", "0,0"], "--shots 0,0 lists 0 twice; give each value once: --shots 0"),
    (["--shots", "0,00,4"], "--shots 0,00,4 lists 0 twice; give each value once: --shots 0,4"),
    (["--shots", "0,x"], "--shots 0,x: 'x' is not a whole number"),
    (["--gsm8k-shots", ",4"], "--gsm8k-shots ,4 has an empty entry; remove the extra comma: --gsm8k-shots 4"),
    (["--modes", "plain,plain"], "--modes plain,plain lists plain twice; give each value once: --modes plain"),
    (["--policies", "none,none"], "--policies none,none lists none twice; give each value once: --policies none"),
    (["--policies", "none,,dual"],
     "--policies none,,dual has an empty entry; remove the extra comma: --policies none,dual"),
    (["--threads", "0"], "--threads 0 must be ≥ 1"),
    (["--threads", "-3"], "--threads -3 must be ≥ 1"),
    (["--gen-length", "0"], "--gen-length 0 must be ≥ 1"),
    (["--gen-length", "48"], "--gen-length 48 is not a multiple of --block-length 32"),
    (["--passes", "0"], "--passes 0 must be ≥ 1"),
    (["--threshold", "1.5"], "--threshold 1.5 must be in (0, 1]"),
])
def test_bad_lists_and_ranges_are_refused_in_one_line(fr, capsys, argv, words):
    assert exit_code(fr, argv) == 2
    line = one_line_error(capsys)
    assert line.startswith("error: ") and words in line


def test_output_paths_are_checked_before_any_measurement(fr, tmp_path, capsys, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("an output check must fail before the model loads")

    monkeypatch.setattr("ecache_cli.models.loader.load_model", no_model)
    top = Path("/") / f"ecache-no-such-folder-{tmp_path.name}"
    assert exit_code(fr, ["--json", str(top / "x.json")]) == 2
    assert f"folder {top} does not exist" in one_line_error(capsys)
    assert not top.exists()  # nothing created at the filesystem root
    f = tmp_path / "out.json"
    assert exit_code(fr, ["--json", str(f), "--markdown", str(f)]) == 2
    assert one_line_error(capsys).startswith(f"error: --markdown {f} is the same file as --json")
    src = tmp_path / "a.json"
    src.write_text("{}\n")
    assert exit_code(fr, ["--merge", str(src), "--json", str(tmp_path / ".." / tmp_path.name / "a.json")]) == 2
    assert "is the same file as --merge (the input)" in one_line_error(capsys)
    assert src.read_text() == "{}\n"  # the input is untouched
    assert exit_code(fr, ["--plot", str(tmp_path)]) == 2  # a folder where a file is wanted
    assert f"--plot {tmp_path} is a folder; give a file name" in one_line_error(capsys)
    assert not f.exists()


def test_no_entropy_points_give_no_verdict_never_yes(fr):
    from dataclasses import asdict

    pts = [P(fr, "dual", 1.5, 0.99, "dual:refresh_every=0")]
    only_none = {"points": [], "verdicts": fr.verdicts([])}
    no_entropy = {"points": [asdict(p) for p in pts], "verdicts": fr.verdicts(pts)}
    for wl in (only_none, no_entropy):
        doc = {"model": "tiny", "n": 1, "seed": 5, "passes": 1, "grid": "small", "gen_length": 32,
               "block_length": 32, "threshold": 0.9, "margin": 1.1, "workloads": {"list@0shot|plain": wl}}
        s = fr.summary(doc)["plain"]
        assert s["dominates_all"] == {"list": None} and s["beats_dual_fastest"] == {"list": None}
        assert s["profiles_ok"] is None and s["beats_dual_fastest_domains"] == 0
        line = fr._summary_lines(fr.summary(doc))[0]
        assert "yes" not in line and line.count("n/a (") == 3
        assert json.loads(json.dumps(s))["profiles_ok"] is None  # JSON null
        md = fr.markdown(doc)
        assert "| yes |" not in md
    assert "| list@0shot | plain | dual | 1 | n/a (no entropy points) | – |" in md


def test_ctrl_c_keeps_the_finished_workloads(fr, tmp_path, capsys, monkeypatch):
    """A KeyboardInterrupt in the second workload's measurement: the first workload's points are written
    (JSON marked incomplete, a note in the Markdown, the plot) and the run exits 130 with one stderr line."""
    calls = []

    def measure(engine, settings, requests, specs, labels, args, chat, log):
        calls.append(specs)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return [fr.Point(policy="dual", spec="dual:refresh_every=0", speedup=1.4, agreement=0.9, speedups=[1.4])]

    monkeypatch.setattr(fr, "measure_workload", measure)
    js, md, png = tmp_path / "f.json", tmp_path / "f.md", tmp_path / "f.png"
    rc = fr.main(["--domains", "list", "--shots", "0", "--n", "1", "--passes", "1", "--modes", "plain,threshold",
                  "--policies", "dual:refresh_every=0", "--no-profiles", "--gen-length", "32", "--threads", "1",
                  "--json", str(js), "--markdown", str(md), "--plot", str(png)])
    assert rc == 130 and len(calls) == 2
    out = capsys.readouterr()
    assert out.err.strip().splitlines()[-1].startswith("interrupted (Ctrl-C): kept the 1 finished workload(s)")
    doc = json.loads(js.read_text())
    assert doc["incomplete"] is True and list(doc["workloads"]) == ["list@0shot|plain"]
    assert doc["workloads"]["list@0shot|plain"]["points"][0]["speedup"] == 1.4
    assert doc["args"]["n"] == 1 and doc["args"]["threads"] == 1 and doc["args"]["data"] is None
    assert doc["args"]["modes"] == ["plain", "threshold"] and doc["args"]["json"] == str(js)
    assert json.loads(out.out.strip().splitlines()[-1])["incomplete"] is True
    assert "**Incomplete run**" in md.read_text() and "| list@0shot | plain | dual |" in md.read_text()
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_resume_measures_only_the_workloads_not_yet_saved(fr, tmp_path, capsys, monkeypatch):
    """Each finished workload is saved to --json at once, so a run that dies in its second workload keeps
    the first; --resume measures only the rest; other settings or no --json are refused in one line."""
    calls = []

    def measure(engine, settings, requests, specs, labels, args, chat, log):
        calls.append(settings.decode.threshold)
        if len(calls) == 2:
            raise RuntimeError("the machine went away")
        return [fr.Point(policy="dual", spec="dual:refresh_every=0", speedup=1.0 + len(calls), agreement=0.9,
                         speedups=[1.0 + len(calls)])]

    monkeypatch.setattr(fr, "measure_workload", measure)
    js = tmp_path / "f.json"
    argv = ["--domains", "list", "--shots", "0", "--n", "1", "--passes", "1", "--modes", "plain,threshold",
            "--policies", "dual:refresh_every=0", "--no-profiles", "--gen-length", "32", "--threads", "1",
            "--json", str(js)]
    with pytest.raises(RuntimeError):
        fr.main([*argv, "--resume"])  # nothing to resume yet: a fresh run
    saved = json.loads(js.read_text())
    assert saved["incomplete"] is True and list(saved["workloads"]) == ["list@0shot|plain"]

    assert fr.main([*argv, "--resume"]) == 0
    assert calls == [None, 0.9, 0.9]  # plain, threshold (died), threshold again; plain not measured again
    doc = json.loads(js.read_text())
    assert "incomplete" not in doc and list(doc["workloads"]) == ["list@0shot|plain", "list@0shot|threshold"]
    assert doc["workloads"]["list@0shot|plain"]["points"][0]["speedup"] == 2.0  # kept from the first run
    assert doc["workloads"]["list@0shot|threshold"]["points"][0]["speedup"] == 4.0
    assert all(wl["date"] and "git_commit" in wl for wl in doc["workloads"].values())
    capsys.readouterr()

    assert fr.main([*argv[:argv.index("--n") + 1], "2", *argv[argv.index("--n") + 2:], "--resume"]) == 2
    assert "was made with n=1, this run has 2" in capsys.readouterr().err
    monkeypatch.setitem(fr.GRIDS, "small", {**fr.GRIDS["small"], "dual": {"refresh_every": [0, 3]}})
    assert fr.main([*argv, "--resume"]) == 2  # the same --grid name with other knob values
    assert "other knob values for --grid small" in capsys.readouterr().err
    assert len(calls) == 3
    with pytest.raises(SystemExit) as e:
        fr.main(["--domains", "list", "--resume"])
    assert e.value.code == 2 and "add --json FILE" in capsys.readouterr().err


def test_chunks_save_a_half_measured_workload_and_resume_goes_on_from_the_last(fr, tmp_path, capsys, monkeypatch):
    """--chunk 2 measures a workload's settings two at a time (each call its own none passes) and saves
    after each chunk; a run that dies in the second chunk leaves the first chunk's points as a partial
    workload, and --resume measures only the settings it lacks, then files the workload as finished."""
    calls = []

    def measure(engine, settings, requests, specs, labels, args, chat, log):
        calls.append(list(specs))
        if len(calls) == 2:
            raise RuntimeError("the machine went away")
        return [fr.Point(policy="dual", spec=s, speedup=1.0 + 0.1 * int(s[-1]), agreement=0.9,
                         speedups=[1.0 + 0.1 * int(s[-1])]) for s in specs]

    monkeypatch.setattr(fr, "measure_workload", measure)
    js = tmp_path / "f.json"
    specs = ["dual:refresh_every=2", "dual:refresh_every=3", "dual:refresh_every=4"]
    argv = ["--domains", "list", "--shots", "0", "--n", "1", "--passes", "1", "--modes", "plain", "--policies",
            ",".join(specs), "--no-profiles", "--gen-length", "32", "--threads", "1", "--json", str(js), "--chunk", "2"]
    with pytest.raises(RuntimeError):
        fr.main(argv)
    saved = json.loads(js.read_text())
    part = saved["partial"]["list@0shot|plain"]
    assert saved["incomplete"] is True and saved["workloads"] == {}
    assert part["specs"] == specs and [p["spec"] for p in part["points"]] == specs[:2] and part["chunks"] == 1

    assert fr.main([*argv, "--resume"]) == 0
    assert calls == [specs[:2], specs[2:], specs[2:]]  # the first chunk is not measured again
    assert "goes on after its 2 measured setting(s)" in capsys.readouterr().err
    doc = json.loads(js.read_text())
    wl = doc["workloads"]["list@0shot|plain"]
    assert doc["partial"] == {} and "incomplete" not in doc and wl["chunks"] == 2
    assert {p["spec"]: p["speedup"] for p in wl["points"]} == {specs[0]: 1.2, specs[1]: 1.3, specs[2]: 1.4}
    assert fr.main([*argv, "--resume"]) == 0 and len(calls) == 3  # nothing left to measure
    with pytest.raises(SystemExit) as e:
        fr.main([*argv[:-1], "-1"])
    assert e.value.code == 2 and "--chunk -1 must be ≥ 0" in capsys.readouterr().err


def test_a_grown_grid_adds_only_its_new_points_to_saved_workloads(fr, tmp_path, capsys, monkeypatch):
    """--resume after the grid gained values (dual's refresh 3) and an entropy family: the saved workload
    keeps its points and gets only the new ones, measured over its own saved τ values, listed in
    grid_added; a grid that lost a value is refused in one line."""
    calls = []

    def measure(engine, settings, requests, specs, labels, args, chat, log):
        calls.append(list(specs))
        return [fr.Point(policy=s.split(":")[0], spec=s, speedup=1.5, agreement=0.95, speedups=[1.5]) for s in specs]

    monkeypatch.setattr(fr, "measure_workload", measure)
    monkeypatch.setattr(fr, "none_signals", lambda *a: {"max-entropy": [0.1, 0.2, 0.3, 0.4]})
    monkeypatch.setitem(fr.TAU_QUANTILES, "small", 2)
    family = {"recent_k": [16], "signal": ["max-entropy"]}
    monkeypatch.setitem(fr.GRIDS, "small", {"dual": {"refresh_every": [0]}, "entropy": [family]})
    js = tmp_path / "f.json"
    argv = ["--domains", "list", "--shots", "0", "--n", "1", "--passes", "1", "--modes", "plain", "--policies",
            "dual,entropy", "--no-profiles", "--gen-length", "32", "--threads", "1", "--json", str(js)]
    assert fr.main(argv) == 0
    taus = json.loads(js.read_text())["workloads"]["list@0shot|plain"]["taus"]["max-entropy"]
    assert len(calls) == 1 and len(calls[0]) == 1 + len(taus)

    added = {"recent_k": [0], "recent_steps": [4], "signal": ["max-entropy"]}
    monkeypatch.setitem(fr.GRIDS, "small", {"dual": {"refresh_every": [0, 3]}, "entropy": [family, added]})
    assert fr.main([*argv, "--resume"]) == 0
    new = ["dual:refresh_every=3", *(f"entropy:tau={t!r}:recent_k=0:recent_steps=4:signal=max-entropy" for t in taus)]
    assert calls[1] == new
    wl = json.loads(js.read_text())["workloads"]["list@0shot|plain"]
    assert wl["grid_added"] == new and len(wl["points"]) == 2 + 2 * len(taus)
    assert "measured later, when the grid or a profile changed" in fr.markdown(json.loads(js.read_text()))
    assert fr.main([*argv, "--resume"]) == 0 and len(calls) == 2  # nothing new
    capsys.readouterr()
    monkeypatch.setitem(fr.GRIDS, "small", {"dual": {"refresh_every": [3]}, "entropy": [family, added]})
    assert fr.main([*argv, "--resume"]) == 2 and "other knob values" in capsys.readouterr().err
    assert fr.grid_grew({"dual": {"a": [1]}}, {"dual": {"a": [1, 2]}, "prefix": {"b": [0]}})
    assert not fr.grid_grew({"dual": {"a": [1], "b": [2]}}, {"dual": {"b": [2], "a": [1, 3]}})  # knob order: specs


def test_a_changed_profile_is_measured_on_saved_workloads_and_takes_the_label(fr, tmp_path, monkeypatch):
    """--resume after a shipped profile changed its setting: the saved workload measures the new setting
    (labelled) and the old setting's point loses the label, so the verdict judges the profile as shipped."""
    calls = []

    def measure(engine, settings, requests, specs, labels, args, chat, log):
        calls.append(list(specs))
        return [fr.Point(policy=s.split(":")[0], spec=s, speedup=2.0, agreement=0.99, speedups=[2.0],
                         label=labels.get(s, "")) for s in specs]

    monkeypatch.setattr(fr, "measure_workload", measure)
    monkeypatch.setattr(fr, "none_signals", lambda *a: {"max-entropy": [0.1, 0.2]})
    monkeypatch.setitem(fr.GRIDS, "small", {"entropy": [{"recent_k": [16], "signal": ["max-entropy"]}]})
    old, new = "entropy:tau=0.3:recent_k=64:signal=max-entropy", "entropy:tau=0.6:recent_k=0:signal=max-entropy"
    monkeypatch.setattr(fr, "profile_points", lambda *a: {"profile:list": old})
    js = tmp_path / "f.json"
    argv = ["--domains", "list", "--shots", "0", "--n", "1", "--passes", "1", "--modes", "plain", "--policies",
            "entropy", "--gen-length", "32", "--threads", "1", "--json", str(js)]
    assert fr.main(argv) == 0 and calls[0][-1] == old
    monkeypatch.setattr(fr, "profile_points", lambda *a: {"profile:list": new})
    assert fr.main([*argv, "--resume"]) == 0 and calls[1] == [new]
    wl = json.loads(js.read_text())["workloads"]["list@0shot|plain"]
    assert {p["spec"]: p["label"] for p in wl["points"] if p["label"]} == {new: "profile:list"}
    assert [g["label"] for g in wl["verdicts"]["profiles"]] == ["profile:list"] and wl["grid_added"] == [new]
    assert fr.main([*argv, "--resume"]) == 0 and len(calls) == 2  # up to date: nothing measured


def test_refinement_targets_unmatched_peers_and_bisects_tau_per_arm(fr):
    E = lambda tau, sp, ag, k=16: P(fr, "entropy", sp, ag, spec=f"entropy:tau={tau}:recent_k={k}")  # noqa: E731
    ent = [E(0.01, 2.0, 1.0), E(0.1, 2.5, 0.99), E(1.0, 3.0, 0.95),  # k 16: 0.1 keeps 0.98, 1.0 does not
           E(0.01, 1.5, 1.0, k=64), E(1.0, 1.9, 0.97, k=64)]
    elastic, dual = P(fr, "elastic", 2.7, 0.98, spec="elastic:gamma=0.95"), P(fr, "dual", 2.0, 0.9, spec="dual:x")
    pts = [*ent, elastic, dual]
    v = fr.verdicts(pts)
    assert v["dominance"]["elastic"]["unmatched"] == ["elastic:gamma=0.95"]  # 2.5 < 0.97 × 2.7 at ≥ 98%
    assert v["beats_dual_fastest"]["ok"] is True  # 3.0 at 95% ≥ 1.1 × 2.0 at 90%
    assert fr.refine_targets(pts, v) == [elastic]
    # per arm, between the last τ at ≥ 98% and the next: k 16 between 0.1 and 1.0, k 64 between 0.01 and 1.0;
    # the arm whose faithful end is faster comes first, and arms=1 keeps it alone
    assert fr.tau_between(ent, elastic) == ["entropy:tau=0.316:recent_k=16", "entropy:tau=0.1:recent_k=64"]
    assert fr.tau_between(ent, elastic, arms=1) == ["entropy:tau=0.316:recent_k=16"]
    # τ = 0 keeping the agreement: a quarter of the next τ; no faithful τ or nothing above it: no proposal
    assert fr.tau_between([E(0.0, 1.0, 1.0), E(0.4, 2.0, 0.5)], elastic) == ["entropy:tau=0.1:recent_k=16"]
    assert fr.tau_between([E(0.4, 2.0, 0.5)], elastic) == [] and fr.tau_between([E(0.4, 2.0, 1.0)], elastic) == []
    # the margin missed: dual's fastest becomes a target too
    slow = [E(0.01, 2.0, 1.0), E(1.0, 2.1, 0.8)]
    v2 = fr.verdicts([*slow, dual])
    assert v2["beats_dual_fastest"]["ok"] is False and fr.refine_targets([*slow, dual], v2) == [dual]


def test_refine_rounds_add_points_update_verdicts_and_resume(fr, tmp_path, capsys, monkeypatch):
    """--refine measures the proposed τ in rounds until the peer point is matched; a saved workload gets the
    rounds it lacks under --resume, and none once it has them."""
    calls = []

    def measure(engine, settings, requests, specs, labels, args, chat, log):
        calls.append(list(specs))
        if len(calls) == 1:  # the grid: entropy at τ 0.1 and 1.0 brackets elastic's 98%
            return [fr.Point(policy="entropy", spec="entropy:tau=0.1", speedup=2.5, agreement=0.99),
                    fr.Point(policy="entropy", spec="entropy:tau=1.0", speedup=3.0, agreement=0.9),
                    fr.Point(policy="elastic", spec="elastic:gamma=0.95", speedup=2.7, agreement=0.98)]
        tau = float(specs[0].split("=")[1])
        return [fr.Point(policy="entropy", spec=specs[0], speedup=2.55 + tau / 2, agreement=0.99 - tau / 20)]

    monkeypatch.setattr(fr, "measure_workload", measure)
    js = tmp_path / "f.json"
    argv = ["--domains", "list", "--shots", "0", "--n", "1", "--passes", "1", "--modes", "plain", "--policies",
            "elastic:gamma=0.95", "--no-profiles", "--gen-length", "32", "--threads", "1", "--json", str(js)]
    assert fr.main(argv) == 0
    assert len(calls) == 1 and "refine_rounds" not in json.loads(js.read_text())["workloads"]["list@0shot|plain"]
    assert fr.main([*argv, "--resume", "--refine", "3"]) == 0
    wl = json.loads(js.read_text())["workloads"]["list@0shot|plain"]
    # round 1: τ 0.316 (2.71x at 97.4%: not faithful enough); round 2: between 0.1 and 0.316, τ 0.178
    # (2.64x at 98.1%, ≥ 0.97 × 2.7): matched, so round 3 has nothing to reach
    assert calls[1:] == [["entropy:tau=0.316"], ["entropy:tau=0.178"]]
    assert wl["refined"] == ["entropy:tau=0.316", "entropy:tau=0.178"] and wl["refine_rounds"] == 2
    assert wl["verdicts"]["dominance"]["elastic"]["dominated"] is True and len(wl["points"]) == 5
    assert fr.main([*argv, "--resume", "--refine", "2"]) == 0 and len(calls) == 3  # nothing left to do
    assert "2 entropy settings added by 2 round(s) of τ bisection" in fr.markdown(json.loads(js.read_text()))


def test_confirm_times_both_sides_of_a_close_call_again_and_pools_the_passes(fr, tmp_path, capsys, monkeypatch):
    """--confirm 1: the unmatched peer point and the fastest entropy point of each arm at ≥ its agreement
    are timed again in one call; their passes join the earlier ones (median of all), the verdict is
    recomputed; a point that decodes differently keeps only its earlier passes; one round only."""
    calls = []
    first = [fr.Point(policy="entropy", spec="entropy:tau=0.1:recent_k=16", speedup=2.5, agreement=0.99,
                      speedups=[2.5, 2.5, 2.5]),
             fr.Point(policy="entropy", spec="entropy:tau=0.1:recent_k=64", speedup=2.0, agreement=0.99,
                      speedups=[2.0, 2.0, 2.0]),
             fr.Point(policy="entropy", spec="entropy:tau=1.0:recent_k=16", speedup=3.0, agreement=0.9,
                      speedups=[3.0, 3.0, 3.0]),
             fr.Point(policy="elastic", spec="elastic:gamma=0.95", speedup=2.7, agreement=0.98,
                      speedups=[2.7, 2.7, 2.7])]
    again = {"elastic:gamma=0.95": ([2.5, 2.5, 2.5], 0.98), "entropy:tau=0.1:recent_k=16": ([2.6, 2.6, 2.6], 0.99),
             "entropy:tau=0.1:recent_k=64": ([9.0, 9.0, 9.0], 0.97)}  # k 64 decodes differently: dropped

    def measure(engine, settings, requests, specs, labels, args, chat, log):
        calls.append(list(specs))
        if len(calls) == 1:
            return first
        return [fr.Point(policy=s.split(":")[0], spec=s, speedup=again[s][0][0], agreement=again[s][1],
                         speedups=again[s][0]) for s in specs]

    monkeypatch.setattr(fr, "measure_workload", measure)
    js = tmp_path / "f.json"
    argv = ["--domains", "list", "--shots", "0", "--n", "1", "--passes", "3", "--modes", "plain", "--policies",
            "elastic:gamma=0.95", "--no-profiles", "--gen-length", "32", "--threads", "1", "--json", str(js)]
    assert fr.main(argv) == 0
    wl = json.loads(js.read_text())["workloads"]["list@0shot|plain"]
    assert wl["verdicts"]["dominance"]["elastic"]["unmatched"] == ["elastic:gamma=0.95"]  # 2.5 < 0.97 × 2.7
    assert fr.main([*argv, "--resume", "--confirm", "1"]) == 0
    assert calls[1] == ["elastic:gamma=0.95", "entropy:tau=0.1:recent_k=16", "entropy:tau=0.1:recent_k=64"]
    assert "decoded differently when timed again" in capsys.readouterr().err
    wl = json.loads(js.read_text())["workloads"]["list@0shot|plain"]
    sp = {p["spec"]: (p["speedup"], len(p["speedups"])) for p in wl["points"]}
    assert sp["elastic:gamma=0.95"] == (pytest.approx(2.6), 6) and sp["entropy:tau=0.1:recent_k=16"] == (2.55, 6)
    assert sp["entropy:tau=0.1:recent_k=64"] == (2.0, 3) and wl["confirm_rounds"] == 1
    assert wl["verdicts"]["dominance"]["elastic"]["dominated"] is True  # 2.55 ≥ 0.97 × 2.6
    assert "timed again in 1 round(s)" in fr.markdown(json.loads(js.read_text()))
    assert fr.main([*argv, "--resume", "--confirm", "1"]) == 0 and len(calls) == 2


def test_a_narrowly_matched_peer_point_is_a_close_call(fr):
    ent = [P(fr, "entropy", 1.21, 1.0, spec="entropy:tau=0.24:recent_k=0"),
           P(fr, "entropy", 1.5, 0.99, spec="entropy:tau=0.5:recent_k=0")]
    close = P(fr, "d2cache", 1.205, 1.0, spec="d2cache:rollout_p=0.3")  # matched by 1.21: within 1/0.97
    clear = P(fr, "dual", 1.3, 0.99, spec="dual:refresh_every=0")  # matched by 1.5: clear of the noise band
    pts = [*ent, close, clear]
    v = fr.verdicts(pts)
    assert v["dominance"]["d2cache"]["dominated"] and v["dominance"]["dual"]["dominated"]
    assert [p.spec for p in fr.confirm_targets(pts, v)] == ["d2cache:rollout_p=0.3", "entropy:tau=0.24:recent_k=0"]


def test_equivalent_entropy_settings_pool_their_passes(fr):
    def E(spec, speedups, work=0.88, agreement=1.0, label=""):
        return fr.Point(policy="entropy", spec=spec, speedup=sorted(speedups)[1], agreement=agreement, identical=1.0,
                        score=1.0, speedups=speedups, work=work, label=label)

    pts = [E("entropy:tau=0.5:recent_k=16", [1.06, 1.06, 1.07], label="profile:code-parallel"),
           E("entropy:tau=0.9:recent_k=16", [1.12, 1.08, 1.12]),
           E("entropy:tau=0.03:recent_k=16", [1.14, 1.04, 1.05]),
           E("entropy:tau=0.9:recent_k=64", [1.20, 1.20, 1.20], agreement=0.99),  # another arm: never pooled
           E("entropy:tau=2.0:recent_k=16", [1.30, 1.30, 1.30], work=0.80, agreement=0.99),  # other decisions
           fr.Point(policy="dual", spec="dual:refresh_every=0", speedup=1.0, agreement=1.0, speedups=[1.0, 1.0, 1.0],
                    work=0.88)]
    got = {p.spec: p for p in fr.pool_equivalent(pts)}
    same = [got[f"entropy:tau={t}:recent_k=16"] for t in ("0.5", "0.9", "0.03")]
    # the nine passes of the three k 16 settings with the same work and fidelity: median 1.07
    assert [p.speedup for p in same] == [1.07] * 3 and [p.pooled for p in same] == [3] * 3
    assert [p.own_speedup for p in same] == [1.06, 1.12, 1.05]
    assert (got["entropy:tau=0.9:recent_k=64"].speedup, got["entropy:tau=0.9:recent_k=64"].pooled) == (1.20, 1)
    assert got["entropy:tau=2.0:recent_k=16"].speedup == 1.30 and got["dual:refresh_every=0"].pooled == 1
    again = fr.pool_equivalent(list(got.values()))
    assert [p.speedup for p in again] == [p.speedup for p in got.values()]  # idempotent
    # the profile's gap is then measured against the same computation, not against its timing noise
    # (unpooled: 1.06x against τ 0.9's 1.12x at 100% agreement, 0.95)
    assert fr.verdicts(list(got.values()))["profiles"][0]["ratio"] == 1.0
    assert fr.verdicts(pts)["profiles"][0]["ratio"] == pytest.approx(1.06 / 1.12)
    assert "1.07x (pooled ×3; own 1.06x)" in "\n".join(fr.summary_table(same))
