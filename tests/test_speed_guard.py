"""``ecache calibrate``'s wall-clock speed check (``runs/speed_guard.py``): the decision rule on scripted
timings, its place after the proxy ranking in a real (tiny) search with the timing function replaced,
what the JSON and the profile record, and the command end to end on the embedded model ``tiny``."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from ecache_cli.decoding.config import DecodeConfig
from ecache_cli.errors import UsageError
from ecache_cli.runs import calibrate as calib_mod
from ecache_cli.runs.calib_report import json_document
from ecache_cli.runs.calibrate import CalibrateOptions, calibrate
from ecache_cli.runs.profile import parse_policy_spec
from ecache_cli.runs.settings import resolve_settings
from ecache_cli.runs.speed_guard import (
    SpeedGuard,
    Timed,
    check_modes,
    mode_threshold,
    policy_spec,
    spread,
)
from ecache_cli.runs.tau_search import Point, choose, ranking
from ecache_cli.tasks import get_task


def pt(tau, speedup, recent_k=None, block_refresh=None):
    return Point(tau=tau, n=8, score=0.9, fidelity=1.0, identical=1.0, speedup=speedup, speedup_wall=speedup,
                 tokens_per_s=10.0, refresh_rate=0.1, nfe=32.0, cost=int(1000 / speedup), wall_s=1.0,
                 recent_k=recent_k, block_refresh=block_refresh)


BASE = pt(None, 1.0)


def scripted(speeds: dict):
    """A timing function answering from ``speeds`` {τ: (plain, threshold)}, recording what it timed."""
    calls = []

    def time_fn(p):
        calls.append(p.tau)
        return speeds[p.tau]

    return time_fn, calls


# --- the decision rule ---------------------------------------------------------------------------------


def test_ranking_follows_the_choice_rule():
    pts = [pt(0.5, 2.0), pt(1.0, 3.0), pt(2.0, 3.0), pt(4.0, 0.9)]  # τ=4 is slower by the proxy: never ranked
    order = ranking(pts, BASE, "task", 0.01)
    assert [p.tau for p in order] == [1.0, 2.0, 0.5]  # equal speedups: the lower τ first
    assert order[0] is choose(pts, BASE, "task", 0.01).point
    assert ranking([pt(1.0, 0.9)], BASE, "task", 0.01) == []


def test_a_parallel_run_rejects_a_candidate_slower_under_threshold_decoding():
    a, b, c = pt(1.0, 3.0), pt(0.5, 2.0), pt(0.1, 1.5)
    time_fn, calls = scripted({1.0: (1.5, 0.93), 0.5: (0.8, 1.05), 0.1: (1.2, 1.2)})
    lines = []
    v = SpeedGuard(threshold=0.9, examples=8, own="threshold").run([a, b, c], time_fn, warn=lines.append)
    assert v.point is b and calls == [1.0, 0.5]  # c is never timed; b's plain speed does not matter here
    assert [(t.point.tau, t.passed) for t in v.timed] == [(1.0, False), (0.5, True)]
    assert v.chosen.plain == 0.8 and v.chosen.threshold == 1.05
    assert len(lines) == 1 and lines[0].startswith("speed check: rejected τ=1: 1.50× plain, 0.93× at threshold 0.9")
    assert "median of 3 passes on 8 examples" in lines[0] and "trying the next" in lines[0]


def test_a_plain_run_keeps_its_choice_and_names_the_parallel_profile_when_threshold_is_slower():
    time_fn, calls = scripted({1.0: (1.5, 0.93), 0.5: (1.3, 1.05)})
    lines = []
    v = SpeedGuard(threshold=0.9).run([pt(1.0, 3.0), pt(0.5, 2.0)], time_fn, warn=lines.append)
    assert v.point.tau == 1.0 and calls == [1.0] and v.timed[0].passed
    assert lines == ["speed check: warning: τ=1 is slower than none under threshold decoding (0.93× at 0.9); for "
                     "such runs calibrate a parallel profile too (the same command with --threshold 0.9), which "
                     "they then use"]


def test_where_none_answers_in_one_forward_under_threshold_no_parallel_profile_is_suggested():
    """A timing function whose none took one forward per example under threshold decoding (its
    ``reference_nfe``, as ``WallClock`` records it): the warning says no step there reads a cache, not to
    calibrate a parallel profile that could not be faster; at 2 forwards it names the profile as before."""
    for nfe, want in ((1.0, "speed check: warning: under threshold decoding at 0.9 none answers every example in one "
                            "forward (NFE 1.0), so no step there reads a cache: τ=1 cannot run faster there "
                            "(0.97×), nor could a parallel profile"),
                      (2.0, "speed check: warning: τ=1 is slower than none under threshold decoding (0.97× at 0.9); "
                            "for such runs calibrate a parallel profile too (the same command with --threshold "
                            "0.9), which they then use")):
        time_fn, _ = scripted({1.0: (1.5, 0.97)})
        time_fn.reference_nfe = {"plain": 32.0, "threshold": nfe}
        lines = []
        assert SpeedGuard(threshold=0.9).run([pt(1.0, 3.0)], time_fn, warn=lines.append).point.tau == 1.0
        assert lines == [want]


def test_plain_slowdown_rejects_too_and_exactly_none_speed_passes():
    time_fn, _ = scripted({1.0: (0.99, 2.0), 0.5: (1.0, 1.0)})
    v = SpeedGuard().run([pt(1.0, 3.0), pt(0.5, 2.0)], time_fn)
    assert v.point.tau == 0.5 and not v.timed[0].passed


def test_all_rejected_is_no_choice_and_tries_bound_the_timing():
    pts = [pt(t, 4.0 - t) for t in (1.0, 2.0, 3.0)]
    time_fn, calls = scripted({1.0: (0.8, 0.9), 2.0: (1.1, 0.7), 3.0: (2.0, 2.0)})
    lines = []
    g = SpeedGuard(threshold=0.8, examples=4, tries=2, own="threshold")
    v = g.run(pts, time_fn, warn=lines.append)
    assert v.point is None and v.chosen is None and calls == [1.0, 2.0]  # τ=3 would pass, but 2 tries are spent
    assert "2 setting(s) timed (--speed-check-tries), giving up" in lines[-1]
    why = g.no_choice_reason(v)
    assert why.startswith("no qualifying setting runs at least as fast as none under threshold decoding at 0.8 in "
                          "wall-clock time")
    assert "τ=1 0.80× plain, 0.90× at threshold 0.8; τ=2 1.10× plain, 0.70× at threshold 0.8" in why
    doc = g.document(v, batch_size=2)
    assert doc["chosen"] is None and [t["passed"] for t in doc["timed"]] == [False, False]
    assert (doc["threshold"], doc["examples"], doc["passes"], doc["tries"], doc["batch_size"]) == (0.8, 4, 3, 2, 2)
    assert doc["mode"] == "threshold" and [t["mode"] for t in doc["timed"]] == ["threshold", "threshold"]


def test_a_setting_deciding_as_a_rejected_one_is_skipped_untimed():
    a, twin, b = pt(0.5, 3.0), pt(0.6, 3.0), pt(0.1, 2.0)
    time_fn, calls = scripted({0.5: (0.9, 1.2), 0.6: (9.0, 9.0), 0.1: (1.4, 1.1)})
    lines = []
    v = SpeedGuard().run([a, twin, b], time_fn, same=lambda x, y: {x.tau, y.tau} == {0.5, 0.6}, warn=lines.append)
    assert v.point is b and calls == [0.5, 0.1] and v.skipped == [(twin, a)]
    assert "skipped τ=0.6: it decides exactly as the rejected τ=0.5" in lines[1]
    v = SpeedGuard().run([a], time_fn, warn=lines.append)
    assert v.point is None and lines[-1].endswith("slower than none; no other setting qualifies")


def test_the_two_modes_and_helpers():
    plain = DecodeConfig(gen_length=64)
    assert mode_threshold(plain) == 0.9 and mode_threshold(DecodeConfig(threshold=0.8)) == 0.8
    assert mode_threshold(DecodeConfig(threshold=0.8), 0.7) == 0.7
    modes = check_modes(plain, 0.9)
    assert modes["plain"] == plain and modes["threshold"] == DecodeConfig(gen_length=64, threshold=0.9)
    factor = DecodeConfig(gen_length=64, factor=1.0)
    modes = check_modes(factor, 0.9)  # a factor run: plain drops its rule, the parallel mode is its own
    assert modes["plain"] == plain and modes["threshold"] == factor
    with pytest.raises(UsageError, match=r"the speed check's threshold decoding at 0.9: --alg-temp .*--no-speed-check"):
        check_modes(DecodeConfig(alg_temp=0.5, schedule="dream"), 0.9)
    assert spread(50, 8) == [0, 6, 12, 18, 25, 31, 37, 43] and spread(3, 8) == [0, 1, 2]
    assert policy_spec(pt(0.00271, 2.0)) == "entropy:tau=0.00271"
    assert policy_spec(pt(4.0, 2.0, 16, True)) == "entropy:tau=4.0:recent_k=16:block_refresh=true:block_tau=none"


def test_the_timed_policy_is_the_points_arm_not_the_base_profiles_block_tau():
    base = resolve_settings("tiny", {}, {"policy": "entropy", "recent_k": 0, "recent_steps": 1, "block_tau": 0.3,
                                         "refresh_prompt": False})

    def timed(point):  # the policy WallClock times for ``point``
        name, params = parse_policy_spec(policy_spec(point))
        return base.policy(name, **params)

    # "none" gives a parameter the policy's default, whatever the base profile set
    assert parse_policy_spec("entropy:tau=1:block_tau=none") == ("entropy", {"tau": 1, "block_tau": None})
    assert base.policy("entropy", **parse_policy_spec("entropy:block_tau=None")[1]).block_tau is None
    assert base.policy("entropy").block_tau == 0.3
    paper = pt(2.0, 3.0, 64, False)  # a --joint arm of the paper's rule: no block_tau, the prompt refreshed
    paper.recent_steps, paper.refresh_prompt = 0, True
    got = timed(paper)
    assert (got.tau, got.recent_k, got.recent_steps, got.block_tau, got.refresh_prompt) == (2.0, 64, 0, None, True)
    high = pt(2.0, 3.0, 0, False)  # the block_tau arm keeps its own (resolved) block_tau
    high.recent_steps, high.block_tau, high.refresh_prompt = 1, 2.73, False
    got = timed(high)
    assert (got.recent_k, got.recent_steps, got.block_tau, got.refresh_prompt) == (0, 1, 2.73, False)
    got = timed(pt(1.5, 3.0))  # a one-arm search: the point is τ alone, the rest is the base profile's
    assert (got.tau, got.recent_steps, got.block_tau, got.refresh_prompt) == (1.5, 1, 0.3, False)
    # the JSON's timed entry names the whole arm, so the two block_tau arms stay apart
    rec = Timed(high, 1.4, 1.2).as_dict()
    assert (rec["setting"], rec["recent_steps"], rec["block_tau"], rec["refresh_prompt"]) == (
        "τ=2 k=0 steps=1 block-τ=2.73 canvas-refresh", 1, 2.73, False)


# --- in a real search, with the timing function scripted -----------------------------------------------


def run_search(lm, tmp_path, threshold=None, **kw):
    """A small real τ search (random tiny LLaDA, fidelity metric: every faster τ qualifies); the tests
    replace ``WallClock.__call__``, so its speed check answers from a script instead of timing."""
    flags = {"gen_length": 16, "block_length": 8, "threshold": threshold}
    settings = resolve_settings(str(lm.path), flags, {"policy": "entropy"})
    opts = CalibrateOptions(task="list", limit=3, metric="fidelity", grid=4, refine=0, max_drop=100.0,
                            run_file=tmp_path / "run.jsonl", out=tmp_path / "p.yaml", chat=False, quiet=True,
                            speed_check_limit=2, **kw)
    return calibrate(lm, settings, get_task("list"), opts, err_console=None), opts


def test_the_check_passes_over_the_proxy_pick_and_records_the_speedups(llada_lm, tmp_path, profiles_dir, monkeypatch):
    timed = []

    def fake(self, point):
        timed.append(point)
        return (1.4, 0.95) if len(timed) == 1 else (1.25, 1.1)  # the proxy's pick is slower under threshold

    monkeypatch.setattr(calib_mod.WallClock, "__call__", fake)
    out, opts = run_search(llada_lm, tmp_path, threshold=0.9)  # a parallel run: threshold is its own mode
    assert out.speed_check["mode"] == "threshold"
    order = ranking(out.points, out.base, "fidelity", 1.0)
    assert len(order) >= 2 and timed[0] == order[0]
    assert out.choice.point == timed[-1] != order[0]  # the next setting that decides otherwise
    assert out.choice.reason.endswith("wall clock 1.25× plain, 1.10× at threshold 0.9 (tokens/s over none, "
                                      "median of 3 passes on 2 examples)")
    sc = out.speed_check
    assert sc["chosen"] == {"plain": 1.25, "threshold": 1.1} and sc["timed"][0]["passed"] is False
    assert sc["timed"][0]["threshold"] == 0.95 and sc["examples"] == 2
    prof = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert prof["cache"]["tau"] == out.choice.point.tau and prof["task"] == "list-parallel"
    assert prof["decode"]["threshold"] == 0.9
    assert prof["measured"]["speed_check"] == {"plain": 1.25, "threshold": 1.1, "threshold_value": 0.9,
                                               "mode": "threshold", "examples": 2, "passes": 3}
    doc = json_document(out, {}, opts)
    assert doc["speed_check"]["chosen"] == {"plain": 1.25, "threshold": 1.1}
    assert doc["choice"]["tau"] == out.choice.point.tau and doc["calibrate"]["speed_check_limit"] == 2


def test_every_candidate_slower_means_no_profile(llada_lm, tmp_path, profiles_dir, monkeypatch):
    monkeypatch.setattr(calib_mod.WallClock, "__call__", lambda self, p: (0.9, 0.8))
    out, _ = run_search(llada_lm, tmp_path, speed_check_tries=2)
    assert out.choice.point is None and out.profile is None and not (tmp_path / "p.yaml").exists()
    assert out.choice.reason.startswith("no qualifying setting runs at least as fast as none under plain decoding")
    assert len(out.speed_check["timed"]) == 2 and out.speed_check["chosen"] is None


def test_no_speed_check_keeps_the_proxy_choice(llada_lm, tmp_path, profiles_dir, monkeypatch):
    monkeypatch.setattr(calib_mod.WallClock, "__call__", lambda self, p: pytest.fail("timed with --no-speed-check"))
    out, _ = run_search(llada_lm, tmp_path, speed_check=False)
    assert out.choice.point is choose(out.points, out.base, "fidelity", 1.0).point
    assert out.speed_check == {"enabled": False}
    assert "speed_check" not in yaml.safe_load((tmp_path / "p.yaml").read_text())["measured"]


# --- the command ---------------------------------------------------------------------------------------


def test_bad_speed_check_options_are_one_line_usage_errors(cli):
    res = cli("calibrate", "--task", "list", "--speed-check-limit", "0")
    assert res.exit_code == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert "--speed-check-limit 0 must be ≥ 1" in res.stderr
    for bad in ({"speed_check_tries": 0}, {"speed_check_threshold": 1.5}):  # library options
        with pytest.raises(UsageError, match="must be"):
            calib_mod.validate(CalibrateOptions(task="list", **bad))


def test_cli_on_the_embedded_model_reports_measured_speedups(cli, tmp_path, profiles_dir):
    out, js = tmp_path / "list.yaml", tmp_path / "c.json"
    res = cli("calibrate", "--task", "list", "--limit", 2, "--gen-length", 32, "--taus", 1, "--refine", 0,
              "--metric", "fidelity", "--max-drop", 100, "--speed-check-limit", 2, "--out", out, "--json", js)
    doc = json.loads(js.read_text())
    sc = doc["speed_check"]
    assert sc["enabled"] is True and sc["examples"] == 2 and sc["threshold"] == 0.9 and sc["passes"] == 3
    (t,) = sc["timed"][:1]
    assert t["tau"] == 1.0 and all(math.isfinite(t[k]) and t[k] > 0 for k in ("plain", "threshold"))
    if res.exit_code == 0:  # faster than none in plain decoding (the usual case; timing-dependent by nature)
        assert sc["chosen"] == {"plain": t["plain"], "threshold": t["threshold"]} and t["passed"]
        m = yaml.safe_load(out.read_text())["measured"]["speed_check"]
        assert m["plain"] == round(t["plain"], 4) and m["threshold"] == round(t["threshold"], 4)
        assert "wall clock" in res.stdout and "at threshold 0.9" in res.stdout
    else:
        assert res.exit_code == 1 and sc["chosen"] is None and not out.exists(), res.stderr
        assert "no qualifying setting runs at least as fast as none under plain decoding" in res.stderr


def test_a_ctrl_c_during_the_timed_passes_ends_the_run_without_a_profile(llada_lm, tmp_path, profiles_dir,
                                                                        monkeypatch):
    """A Ctrl-C after some of the speed check's passes (where ``ecache profile`` would report the passes it
    finished) interrupts calibrate: no setting chosen on part of the timing, no profile written."""
    from ecache_cli.runs import profile as profile_mod

    calls = {"n": 0}
    real = profile_mod._Bench.one

    def cut(self, policy, b, repeat):  # the fifth run: both warm-ups and the first pass of each policy done
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(self, policy, b, repeat)

    monkeypatch.setattr(profile_mod._Bench, "one", cut)
    with pytest.raises(calib_mod.Interrupted) as info:
        run_search(llada_lm, tmp_path)
    assert calls["n"] == 5 and not (tmp_path / "p.yaml").exists()
    assert info.value.outcome.choice.point is None and "speed check" in info.value.outcome.choice.reason
