"""``ecache calibrate``'s joint search (τ with recent_k and block refresh) and its groups (several task
domains or shot counts that must each meet the tolerance): the choice rule on hand-made points, the run
file's arms, and the command end to end on the tiny random checkpoint (``--metric fidelity``)."""

from __future__ import annotations

import json

import pytest
import yaml
from cli_helpers import one_line_error
from conftest import SMALL

from ecache_cli.errors import UsageError
from ecache_cli.runs import calib_report, calib_store, speed_guard
from ecache_cli.runs import calibrate as calib_mod
from ecache_cli.runs.calib_groups import TaskGroups, parse_list, parse_shots
from ecache_cli.runs.calib_store import HIGH_BLOCK_TAU, Arm, RunFile, as_arm
from ecache_cli.runs.calibrate import CalibrateOptions, arms, calibrate
from ecache_cli.runs.settings import resolve_settings
from ecache_cli.runs.tau_search import Point, choose, failing_groups, high_tau, qualifies
from ecache_cli.tasks import get_task


def pt(tau, score, speedup, fidelity=1.0, k=None, br=None, parts=None, rp=None):
    return Point(tau=tau, n=10, score=score, fidelity=fidelity, identical=fidelity, speedup=speedup,
                 speedup_wall=speedup, tokens_per_s=1.0, refresh_rate=0.5, nfe=8.0, cost=int(1000 / speedup),
                 wall_s=1.0, recent_k=k, block_refresh=br, parts=parts, refresh_prompt=rp)


def test_joint_choice_takes_the_least_work_over_every_arm_and_breaks_ties_safely():
    base = pt(None, 0.8, 1.0)
    sweep = [pt(0.5, 0.80, 3.0, k=64, br=False), pt(2.0, 0.80, 4.0, k=16, br=True),
             pt(3.0, 0.70, 6.0, k=16, br=False)]  # the fastest drops 10 points
    c = choose(sweep, base, "task", max_drop=0.01)
    assert (c.point.tau, c.point.recent_k, c.point.block_refresh) == (2.0, 16, True)
    assert c.reason.startswith("τ=2 k=16 block-refresh: 4.00× (cost proxy)")
    ties = [pt(1.0, 0.8, 3.0, k=16, br=True), pt(1.0, 0.8, 3.0, k=64, br=True), pt(1.0, 0.8, 3.0, k=64, br=False)]
    assert choose(ties, base, "task", 0.0).point.safety() == (1.0, -64, False, 0, False)  # larger k, the paper's rule
    canvas = [pt(1.0, 0.8, 3.0, k=0, br=False, rp=False), pt(1.0, 0.8, 3.0, k=0, br=False, rp=True)]
    assert choose(canvas, base, "task", 0.0).point.refresh_prompt is True  # then the prompt refreshed too
    assert canvas[0].label() == "τ=1 k=0 canvas-refresh"
    assert pt(0.5, 0.8, 2.0).label() == "τ=0.5" and base.label() == "none"


def test_groups_must_each_meet_the_tolerance():
    base = pt(None, 0.8, 1.0, parts={"arith": pt(None, 0.9, 1.0), "list": pt(None, 0.7, 1.0)})
    good = pt(1.0, 0.8, 3.0, parts={"arith": pt(1.0, 0.9, 3.5), "list": pt(1.0, 0.7, 2.5)})
    # the pooled score drops 1 point, but list loses 10 (arith gains 8)
    bad = pt(2.0, 0.79, 5.0, parts={"arith": pt(2.0, 0.98, 5.0), "list": pt(2.0, 0.60, 5.0)})
    slow = pt(3.0, 0.80, 1.5, parts={"arith": pt(3.0, 0.9, 2.5), "list": pt(3.0, 0.7, 0.9)})  # list slower than none
    assert qualifies(good, base, "task", 0.02)
    assert not qualifies(bad, base, "task", 0.02) and failing_groups(bad, base, "task", 0.02) == ["list"]
    assert not qualifies(slow, base, "task", 0.02) and failing_groups(slow, base, "task", 0.02) == ["list"]
    c = choose([good, bad, slow], base, "task", 0.02)
    assert c.point is good and c.reason.endswith("within the tolerance on every group (arith, list)")
    none = choose([bad], base, "task", 0.02)
    assert none.point is None and "on every group (arith, list)" in none.reason and "(fails on list)" in none.reason


def test_arms_and_list_parsing():
    settings = resolve_settings("tiny", {}, {"policy": "entropy", "recent_k": 32, "recent_steps": 0})
    assert arms(CalibrateOptions(task="list"), settings) == [Arm(32, False, 0)]
    # without a list, an arm takes the base setting's value of each knob
    base = resolve_settings("tiny", {}, {"policy": "entropy", "recent_k": 32, "recent_steps": 2})
    assert arms(CalibrateOptions(task="list"), base) == [Arm(32, False, 2)]
    opts = CalibrateOptions(task="list", recent_ks=[16, 64], block_refreshes=[False, True])
    assert arms(opts, settings) == [Arm(16, False), Arm(64, False), Arm(16, True), Arm(64, True)]
    # recent_steps is a third axis; extra arms follow the product, without repeating one of it
    opts = CalibrateOptions(task="list", recent_steps=[0, 4], extra_arms=[Arm(32, False, 4), Arm(0, False, 8)])
    assert arms(opts, settings) == [Arm(32, False, 0), Arm(32, False, 4), Arm(0, False, 8)]
    stepped = resolve_settings("tiny", {}, {"policy": "entropy", "recent_k": 0, "recent_steps": 4})
    assert arms(CalibrateOptions(task="list"), stepped) == [Arm(0, False, 4)]
    # the run file's form: two values when recent_steps is off, three when on; both read back
    assert Arm(16, True).as_record() == [16, True] and Arm(0, False, 8).as_record() == [0, False, 8]
    assert as_arm([16, True]) == Arm(16, True, 0) and as_arm([0, False, 8]) == Arm(0, False, 8)
    assert Arm(0, False, 8).params() == {"recent_k": 0, "block_refresh": False, "recent_steps": 8, "block_tau": None,
                                         "refresh_prompt": True}
    # block_tau and refresh_prompt follow when either is set; the high τ is resolved from the none run's signal
    high = Arm(0, False, 1, HIGH_BLOCK_TAU, False)
    assert high.as_record() == [0, False, 1, "high", False] and as_arm(high.as_record()) == high
    assert high.resolved(0.42) == Arm(0, False, 1, 0.42, False) and as_arm([0, False, 1, 0.42, False]) == Arm(
        0, False, 1, 0.42, False)
    assert Arm(16, False, 0, None, False).as_record() == [16, False, 0, None, False]
    assert high.resolved(0.42).describe() == "recent_k=0, block_refresh=off, recent_steps=1, block_tau=0.42, " \
        "refresh_prompt=off"
    assert high_tau([0.01 * i for i in range(1, 101)]) == pytest.approx(0.98, abs=0.006)
    # a base setting's block_tau and refresh_prompt stay in its one arm, but not in --joint's paper-rule arms
    canvas = resolve_settings("tiny", {}, {"policy": "entropy", "recent_k": 0, "recent_steps": 0,
                                           "block_tau": 0.3, "refresh_prompt": False})
    assert arms(CalibrateOptions(task="list"), canvas) == [Arm(0, False, 0, 0.3, False)]
    assert arms(CalibrateOptions(task="list", block_refreshes=[False]), canvas) == [Arm(0, False)]
    # an arm without recent_steps decodes without it, even over a base setting that has it
    assert stepped.policy("entropy", tau=1.0, **Arm(16, False).params()).recent_steps == 0
    assert Arm(0, False, 8).describe() == "recent_k=0, block_refresh=off, recent_steps=8"
    assert parse_list(" arith, code ,list", "--task") == ["arith", "code", "list"]
    assert parse_shots("0,4") == [0, 4] and parse_shots(None) is None
    for bad, msg in (("list,list", "--task list,list lists list twice; give each value once: --task list"),
                     (",", "--task , names nothing"), ("", "--task '' names nothing"),
                     ("arith,,code",
                      "--task arith,,code has an empty entry; remove the extra comma: --task arith,code"),
                     ("arith,", "--task arith, has an empty entry; remove the extra comma: --task arith")):
        with pytest.raises(UsageError, match=msg):
            parse_list(bad, "--task")
    with pytest.raises(UsageError, match="--shots 0,00 lists 0 twice; give each value once: --shots 0"):
        parse_shots("0,00")
    with pytest.raises(UsageError, match="--shots -1 must be ≥ 0"):
        parse_shots("0,-1")


def test_task_groups_dispatch_prompts_and_scores_to_their_own_task():
    g = TaskGroups.build(["arith", "list"], [0, 2], get_task)
    exs = g.examples("test", 2, 0)
    assert [e.id.split(":")[0] for e in exs] == ["arith@0"] * 2 + ["arith@2"] * 2 + ["list@0"] * 2 + ["list@2"] * 2
    assert g.groups(exs) == {"arith@0": [0, 1], "arith@2": [2, 3], "list@0": [4, 5], "list@2": [6, 7]}
    arith, lst = get_task("arith"), get_task("list")
    ex0 = arith.examples("test", 2, 0)[0]
    assert g.prompt(exs[0], 99, 0) == arith.prompt(ex0, 0, 0) and g.prompt(exs[2], None, 0) == arith.prompt(ex0, 2, 0)
    ex_l = lst.examples("test", 2, 0)[1]
    assert g.score(exs[5], ex_l.answer) == lst.score(ex_l, ex_l.answer) == 1.0
    assert g.score(exs[5], "nonsense") == 0.0
    assert g.name == "arith,list" and g.can_score and not g.needs_code_execution and g.default_shots == [0, 2]


def run_joint(lm, tmp_path, name="run.jsonl", **kw):
    settings = resolve_settings(str(lm.path), {"gen_length": 16, "block_length": 8}, {"policy": "entropy"})
    kw = {"task": "list", "limit": 2, "metric": "fidelity", "grid": 2, "refine": 1, "max_drop": 100.0,
          "recent_ks": [0, 4], "block_refreshes": [False, True], "run_file": tmp_path / name,
          "out": tmp_path / "p.yaml", "chat": False, "quiet": True, "speed_check": False, **kw}
    return calibrate(lm, settings, get_task("list"), CalibrateOptions(**kw), err_console=None)


def test_joint_search_decodes_each_arm_and_writes_the_chosen_arm(llada_lm, tmp_path, profiles_dir, monkeypatch):
    calls = []
    real = calib_mod.Evaluator._run_chunk

    def spy(self, tau, c, idx):
        calls.append((tau, self.arm))
        return real(self, tau, c, idx)

    monkeypatch.setattr(calib_mod.Evaluator, "_run_chunk", spy)
    out = run_joint(llada_lm, tmp_path)
    got = {p.arm() for p in out.points}
    assert got == {(k, br, 0, None, True) for k in (0, 4) for br in (False, True)}
    assert {a for t, a in calls if t is not None} <= got and (None, None) in calls  # none decoded once, no arm
    assert sum(1 for t, _ in calls if t is None) == 2  # two examples, batch size 1
    # --max-drop 100: every faster setting qualifies; the least work (highest proxy speedup) wins
    c = out.choice.point
    assert c.speedup == max(p.speedup for p in out.points if p.speedup > 1)
    prof = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert prof["cache"]["tau"] == c.tau and prof["cache"]["recent_k"] == c.recent_k
    assert prof["cache"].get("block_refresh", False) == c.block_refresh
    # the run file: records of arms other than the run's own (recent_k 64, off) name their arm
    recs = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert recs[0]["key"]["arms"] == [[0, False], [4, False], [0, True], [4, True]]
    assert {(*r["arm"], 0, None, True) for r in recs[1:] if r["tau"] is not None} == got
    assert all("arm" not in r for r in recs[1:] if r["tau"] is None)
    for r in recs[1:]:  # a copied record comes from the same arm
        if "reused_from" in r:
            src = next(s for s in recs[1:] if s["tau"] == r["reused_from"] and s["index"] == r["index"]
                       and s.get("arm") == r["arm"])
            assert src["token_ids"] == r["token_ids"]
    # resuming decodes nothing and reaches the same choice
    (tmp_path / "p.yaml").unlink()
    n = len(calls)
    again = run_joint(llada_lm, tmp_path, resume=True)
    assert len(calls) == n and again.choice.point == out.choice.point
    f = RunFile(tmp_path / "run.jsonl", recs[0]["key"], resume=True, dry_run=True)
    assert f.get(c.tau, 0, (c.recent_k, c.block_refresh)) is not None  # the run's own arm (64, off) is not searched


def test_a_high_block_tau_arm_is_resolved_from_nones_signal_and_written_to_the_profile(llada_lm, tmp_path):
    arm = Arm(0, False, 1, HIGH_BLOCK_TAU, False)
    out = run_joint(llada_lm, tmp_path, recent_ks=[4], block_refreshes=[False], extra_arms=[arm])
    signals = [s for r in map(json.loads, (tmp_path / "run.jsonl").read_text().splitlines()[1:])
               if r["tau"] is None for s in r["signals"] if s is not None]
    resolved = arm.resolved(high_tau(signals))
    assert isinstance(resolved.block_tau, float)
    assert {p.arm() for p in out.points} == {(4, False, 0, None, True), tuple(resolved)}
    recs = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert recs[0]["key"]["arms"] == [[4, False], [0, False, 1, "high", False]]
    assert {tuple(r["arm"]) for r in recs[1:] if r["tau"] is not None and len(r["arm"]) > 2} == {tuple(resolved)}
    chosen = next(p for p in out.points if p.arm() == tuple(resolved))
    cache = calib_report._profile_cache({"signal": "max-entropy"}, chosen)
    assert cache == {"policy": "entropy", "tau": chosen.tau, "recent_k": 0, "signal": "max-entropy",
                     "recent_steps": 1, "block_tau": resolved.block_tau, "refresh_prompt": False}
    assert speed_guard.policy_spec(chosen) == (f"entropy:tau={chosen.tau!r}:recent_k=0:block_refresh=false:"
                                               f"recent_steps=1:block_tau={resolved.block_tau!r}:refresh_prompt=false")


def test_table_settings_stay_short_with_the_variant_arms():
    paper = pt(0.5, 0.8, 2.0, k=16, br=True)
    canvas = pt(0.00259, 0.8, 3.0, k=0, br=False, rp=False)
    canvas.recent_steps, canvas.block_tau = 1, 0.00195
    pts = [paper, canvas]
    assert [calib_report.short_setting(p, pts) for p in pts] == ["0.5 k16 B", "0.00259 k0 s1 b C"]
    assert calib_report._variant_legend(pts) == (", b = block_tau 0.00195, C = canvas-only refresh (a partial forward: "
                                                 "not in refresh %)")
    other = pt(1.0, 0.8, 3.0, k=0, br=False)
    other.block_tau = 0.5  # two block_tau values: each named in its cell
    assert calib_report.short_setting(other, [*pts, other]) == "1 k0 b0.5"
    assert calib_report.short_setting(pt(None, 0.8, 1.0), pts) == "none"
    assert calib_report.short_setting(pt(0.5, 0.8, 2.0), pts) == "0.5"  # outside a joint search: τ alone


def test_cli_joint_over_domains_writes_the_default_profile(cli, llada_dir, profiles_dir, tmp_path):
    res = cli("calibrate", "--model", llada_dir, "--task", "arith,list", "--limit", 2, "--metric", "fidelity",
              "--max-drop", 100, "--grid", 2, "--refine", 0, "--recent-k", "4,64", "--no-speed-check",
              *SMALL, "--json", tmp_path / "c.json")
    assert res.exit_code == 0, res.stderr
    assert "within the tolerance on every group (arith, list)" in res.stdout
    prof = yaml.safe_load((profiles_dir / "llada-rand" / "default.yaml").read_text())
    doc = json.loads((tmp_path / "c.json").read_text())
    assert prof["task"] == "default" and set(prof["measured"]["groups"]) == {"arith", "list"}
    assert prof["cache"]["recent_k"] == doc["choice"]["recent_k"] in (4, 64)
    assert set(doc["choice"]["parts"]) == {"arith", "list"} and doc["calibrate"]["groups"] == ["arith", "list"]
    assert doc["none"]["n"] == 4 and doc["none"]["parts"]["arith"]["n"] == 2
    assert (profiles_dir / "llada-rand" / ".default.calib.jsonl").is_file()
    gen = cli("generate", "--model", llada_dir, "--jsonl", "--no-chat", "-q", "Sort: 3 1 2")
    assert gen.exit_code == 0, gen.stderr
    assert json.loads(gen.stdout)["settings"]["cache_params"]["tau"] == prof["cache"]["tau"]


@pytest.mark.parametrize("args, msg", [
    (["--task", "arith,nope"], "--task 'nope' is not a task"),
    (["--task", "list,list"], "error: --task list,list lists list twice; give each value once: --task list"),
    (["--task", "arith,,code"],
     "error: --task arith,,code has an empty entry; remove the extra comma: --task arith,code"),
    (["--task", "list", "--recent-k", "4,x"], "error: --recent-k x must be a whole number ≥ 0 (e.g. 64)"),
    (["--task", "list", "--recent-k", "4,4"],
     "error: --recent-k 4,4 lists 4 twice; give each value once: --recent-k 4"),
    (["--task", "list", "--recent-k", "16,,32"],
     "error: --recent-k 16,,32 has an empty entry; remove the extra comma: --recent-k 16,32"),
    (["--task", "list", "--taus", "0.1,0.1"],
     "error: --taus 0.1,0.1 lists 0.1 twice; give each value once: --taus 0.1"),
    (["--task", "list", "--taus", "0.5,0.50,1"],
     "error: --taus 0.5,0.50,1 lists 0.5 twice; give each value once: --taus 0.5,1"),
    (["--task", "list", "--taus", "0.1,x"],
     "error: --taus x must be a finite number ≥ 0 (an entropy in nats; e.g. 0.5)"),
    (["--task", "list", "--shots", "0,0"], "error: --shots 0,0 lists 0 twice; give each value once: --shots 0"),
    (["--task", "list", "--recent-k", "-1"], "error: --recent-k -1 must be ≥ 0"),
    (["--task", "list", "--recent-k", "4,-1"], "error: --recent-k -1 must be ≥ 0 (e.g. 64)"),
    (["--task", "list", "--recent-steps", "4,4"],
     "error: --recent-steps 4,4 lists 4 twice; give each value once: --recent-steps 4"),
    (["--task", "list", "--recent-steps", "0,-4"],
     "error: --recent-steps -4 must be ≥ 0 (0 = off: the recent_k latest commits only; e.g. 4)"),
    (["--task", "list", "--recent-steps", "-4"], "error: --recent-steps -4 must be ≥ 0"),
    (["--task", "list", "--shots", "0,a"], "error: --shots a must be a whole number ≥ 0 (e.g. 4)"),
])
def test_cli_bad_lists_are_one_line_usage_errors(cli, args, msg):
    res = cli("calibrate", *args, "--metric", "fidelity", *SMALL)
    assert res.exit_code == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0]


def test_recent_steps_arms_decode_their_own_setting_and_reach_the_profile(llada_lm, tmp_path, profiles_dir):
    out = run_joint(llada_lm, tmp_path, recent_ks=None, block_refreshes=None, recent_steps=[0, 2],
                    extra_arms=[Arm(0, False, 1)], taus=[100.0], refine=0)
    got = {p.arm()[:3]: p for p in out.points}
    assert set(got) == {(64, False, 0), (64, False, 2), (0, False, 1)}
    assert all(p.arm()[3:] == (None, True) for p in out.points)  # no block_tau, the prompt refreshed too
    # τ 100 never refreshes after the first step: the arms differ only in what a partial step recomputes,
    # so recomputing commits younger than 2 steps on top of k = 64 costs more than k = 64 alone
    assert got[(64, False, 2)].cost >= got[(64, False, 0)].cost
    assert got[(0, False, 1)].cost < got[(64, False, 0)].cost
    c = out.choice.point
    assert c is got[(0, False, 1)]  # the least work, every setting qualifying under --max-drop 100
    prof = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert (prof["cache"]["recent_k"], prof["cache"]["recent_steps"]) == (0, 1)
    assert "block_refresh" not in prof["cache"]
    recs = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert recs[0]["key"]["arms"] == [[64, False], [64, False, 2], [0, False, 1]]
    assert {tuple(r.get("arm", ())) for r in recs[1:] if r["tau"] is not None} == {(), (64, False, 2), (0, False, 1)}
    # the profile decodes as the chosen arm did
    settings = resolve_settings(str(llada_lm.path), {}, {}, profile=str(tmp_path / "p.yaml"))
    assert settings.cache_params["recent_steps"] == 1 and settings.cache_params["recent_k"] == 0


def test_cli_joint_with_one_recent_k_searches_block_refresh_only(cli, llada_dir, profiles_dir, tmp_path):
    # a base profile with the recent_steps variant: the joint search's arms are still the paper's rule
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"cache": {"policy": "entropy", "tau": 1.0, "recent_k": 0, "recent_steps": 4}}))
    res = cli("calibrate", "--model", llada_dir, "--task", "list", "--limit", 2, "--metric", "fidelity",
              "--max-drop", 100, "--taus", "0.5,100", "--refine", 0, "--joint", "--recent-k", 4, *SMALL,
              "--no-speed-check", "--json", tmp_path / "c.json", "--out", tmp_path / "p.yaml", "--profile", base)
    assert res.exit_code == 0, res.stderr
    doc = json.loads((tmp_path / "c.json").read_text())
    got = [(p["tau"], p["recent_k"], p["block_refresh"], p.get("recent_steps", 0)) for p in doc["points"]]
    assert got == [(0.5, 4, False, 0), (100.0, 4, False, 0), (0.5, 4, True, 0), (100.0, 4, True, 0)]
    assert "100 k4 B" in res.stdout and "k = recent_k, B = block refresh" in res.stdout
    prof = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert prof["cache"]["recent_k"] == 4
    assert prof["cache"].get("block_refresh", False) == doc["choice"]["block_refresh"]


def test_cli_resume_of_an_earlier_joint_run_file_is_refused_in_one_line(cli, llada_dir, profiles_dir, tmp_path):
    run = tmp_path / "run.jsonl"
    args = ["calibrate", "--model", llada_dir, "--task", "list", "--limit", 1, "--metric", "fidelity", "--max-drop",
            100, "--taus", "1", "--refine", 0, *SMALL, "--out", tmp_path / "p.yaml", "--run-file", run,
            "--no-speed-check"]
    assert cli(*args, "--recent-k", "4,8").exit_code == 0
    # the header as --joint wrote it before the block_tau arms: its arms are no product of flag values
    lines = run.read_text().splitlines()
    head = json.loads(lines[0])
    head["key"]["arms"] = [[k, b] for b in (False, True) for k in (16, 32, 64)] + [[0, False, 4], [0, False, 8],
                                                                                   [0, True, 4]]
    run.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    res = cli(*args, "--joint", "--resume")
    one_line_error(res, 2, f"run file {run} was made with joint-search arms that no flags of this ecache version "
                           "search (a --joint run file of an earlier version), so it cannot be continued; to start "
                           "over, drop --resume and pass another --run-file")
    # a run file of this version's --joint is named as --joint when another arm list resumes it
    head["key"]["arms"] = [a.as_record() for a in arms(CalibrateOptions(task="list", recent_ks=[16, 32, 64],
                                                                        block_refreshes=[False, True], recent_steps=[0],
                                                                        extra_arms=list(calib_store.JOINT_STEP_ARMS)),
                                                       resolve_settings("tiny", {}, {"policy": "entropy"}))]
    run.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    res = cli(*args, "--joint", "--recent-k", "4,8", "--resume")
    one_line_error(res, 2, "was made with --joint, this run has --recent-k 4,8 --joint; to continue it, rerun with "
                           "--joint; to start over")
