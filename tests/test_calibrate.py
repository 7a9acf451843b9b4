"""``ecache calibrate``: the τ choice on hand-made sweeps, the grid and refinement rules, the run file
(resume after an interruption reaches the same answer), and the command end to end on a tiny random
checkpoint (its character tokenizer makes garbage answers, so the mechanics run under ``--metric
fidelity``; task scoring is exercised through MBPP's sandbox)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml
from cli_helpers import one_line_error
from conftest import SMALL

from ecache_cli.engine import Engine
from ecache_cli.errors import UsageError
from ecache_cli.runs import calibrate as calib_mod
from ecache_cli.runs.calib_store import RunFile
from ecache_cli.runs.calibrate import CalibrateOptions, calibrate
from ecache_cli.runs.settings import resolve_settings
from ecache_cli.runs.tau_search import (
    Point,
    aggregate,
    choose,
    coarse_grid,
    pareto_frontier,
    refine_next,
    round_sig,
    same_decisions,
)
from ecache_cli.tasks import get_task


def pt(tau, score, speedup, fidelity=1.0):
    """A sweep point with the fields the choice rule reads (the rest fixed)."""
    return Point(tau=tau, n=50, score=score, fidelity=fidelity, identical=fidelity, speedup=speedup,
                 speedup_wall=speedup, tokens_per_s=10.0 * speedup, refresh_rate=0.5, nfe=32.0,
                 cost=int(1000 / speedup), wall_s=1.0)


BASE = pt(None, 0.80, 1.0)


# --- the choice rule on synthetic sweeps -------------------------------------------------------------


def test_choice_takes_the_fastest_tau_within_the_allowed_drop():
    sweep = [pt(0.1, 0.80, 1.5), pt(0.3, 0.80, 2.5), pt(0.6, 0.79, 4.0), pt(0.9, 0.70, 9.0)]
    c = choose(sweep, BASE, "task", max_drop=0.01)
    assert c.point.tau == 0.6  # 1 point drop allowed (0.80 - 0.79 = 0.0100000...09 in floats)
    assert c.qualifying == [0.1, 0.3, 0.6]
    assert choose(sweep, BASE, "task", max_drop=0.0).point.tau == 0.3
    assert choose(sweep, BASE, "task", max_drop=0.10).point.tau == 0.9


def test_choice_ties_go_to_the_lower_tau():
    sweep = [pt(1.5, 0.80, 3.0), pt(0.7, 0.80, 3.0), pt(2.0, 0.80, 3.0 + 1e-12), pt(0.2, 0.80, 2.0)]
    assert choose(sweep, BASE, "task", max_drop=0.01).point.tau == 0.7


def test_choice_respects_min_fidelity_and_needs_a_real_speedup():
    sweep = [pt(0.1, 0.80, 1.0), pt(0.4, 0.80, 2.0, fidelity=0.97), pt(0.8, 0.80, 3.0, fidelity=0.90)]
    assert choose(sweep, BASE, "task", 0.01).point.tau == 0.8
    assert choose(sweep, BASE, "task", 0.01, min_fidelity=0.95).point.tau == 0.4
    # speedup 1.0 (τ below every signal: always refreshes) is no gain, so it never qualifies
    assert choose([pt(0.1, 0.80, 1.0)], BASE, "task", 0.01).point is None


def test_choice_says_so_when_no_tau_qualifies():
    sweep = [pt(0.5, 0.70, 2.0), pt(1.0, 0.60, 4.0)]
    c = choose(sweep, BASE, "task", max_drop=0.01)
    assert c.point is None and c.qualifying == []
    assert "no τ keeps the task score within 1 points of none (80.0%)" in c.reason
    assert "closest: τ=0.5 at 70.0%" in c.reason


def test_fidelity_metric_needs_no_labels():
    base = pt(None, None, 1.0, fidelity=1.0)
    sweep = [pt(0.2, None, 2.0, fidelity=0.995), pt(0.9, None, 5.0, fidelity=0.95)]
    assert choose(sweep, base, "fidelity", max_drop=0.01).point.tau == 0.2
    assert choose(sweep, base, "fidelity", max_drop=0.05).point.tau == 0.9
    assert choose(sweep, base, "task", max_drop=0.5).point is None  # no score to compare


def test_pareto_frontier_drops_dominated_points():
    a, b, c, d = pt(0.1, 0.80, 1.5), pt(0.3, 0.78, 1.4), pt(0.6, 0.79, 3.0), pt(0.9, 0.60, 8.0)
    front = pareto_frontier([BASE, a, b, c, d], "task")
    assert [p.tau for p in front] == [0.1, 0.6, 0.9]  # none (1.0×, 80%) is dominated by a; b by a


# --- grid and refinement -----------------------------------------------------------------------------


def test_coarse_grid_spans_the_signal_distribution():
    signals = [i / 100 for i in range(1, 201)]  # 0.01 .. 2.00 nats, uniform
    grid = coarse_grid(signals, n=5)
    assert grid == sorted(grid) and len(grid) == 5
    assert grid[-1] == 2.0  # the maximum: no step of none refreshes
    for tau, r in zip(grid, (0.5, 0.5 * 0.04 ** (1 / 3), 0.5 * 0.04 ** (2 / 3), 0.02)):
        share = sum(s > tau for s in signals) / len(signals)  # refresh rate on none's trajectory
        assert abs(share - r) < 0.01, (tau, share, r)
    assert coarse_grid([0.3, 0.3, 0.3], n=8) == [0.3]  # duplicates collapse
    assert coarse_grid([float("-inf"), 1.234567], n=1) == [1.24]  # max rounded up, -inf ignored
    with pytest.raises(ValueError):
        coarse_grid([float("-inf")], n=3)


def test_round_sig():
    assert round_sig(0.0123456) == 0.0123 and round_sig(1234.5) == 1230.0
    assert round_sig(1.2301, up=True) == 1.24 and round_sig(0.5, up=True) == 0.5


def test_refine_bisects_between_the_choice_and_the_next_tau():
    sweep = [pt(0.1, 0.80, 1.5), pt(0.4, 0.80, 2.5), pt(1.6, 0.70, 6.0)]
    assert refine_next(sweep, BASE, 0.01, "task", 0.01) == 0.8  # geometric midpoint of 0.4 and 1.6
    sweep.append(pt(0.8, 0.80, 4.0))
    assert refine_next(sweep, BASE, 0.01, "task", 0.01) == round_sig((0.8 * 1.6) ** 0.5)
    # the chosen τ is the largest evaluated one: nothing above to bracket
    assert refine_next([pt(0.4, 0.80, 2.5)], BASE, 0.01, "task", 0.01) is None
    # nothing qualifies: bracket between the smallest signal (τ ≡ none there) and the smallest τ
    assert refine_next([pt(0.4, 0.5, 2.5)], BASE, 0.0, "task", 0.01) == 0.2


# --- aggregation against none ------------------------------------------------------------------------


def rec(index, ids, answer_len, score, cost, nfe=4, full=4, wall=1.0):
    return {"index": index, "token_ids": ids, "answer_len": answer_len, "score": score, "nfe": nfe,
            "full_forwards": full, "partial_forwards": nfe - full, "cost": cost, "generated_tokens": answer_len + 1,
            "wall_s": wall}


def test_aggregate_against_none():
    E = 9  # end marker / filler
    base = [rec(0, [1, 2, 3, E, E, E], 3, 1.0, 600), rec(1, [4, 5, E, E, E, E], 2, 0.0, 600)]
    got = [rec(0, [1, 2, 3, E, E, E], 3, 1.0, 200, full=1, wall=0.5),
           rec(1, [4, 6, 7, E, E, E], 3, 1.0, 100, full=2, wall=0.5)]
    p = aggregate(0.5, got, base)
    assert p.identical == 0.5
    assert p.fidelity == pytest.approx((4 + 2) / (4 + 4))  # pair 2 compares 4 positions, 2 agree
    assert p.speedup == pytest.approx(1200 / 300) and p.speedup_wall == pytest.approx(2.0)
    assert p.score == 1.0 and (p.lost, p.gained) == (0, 1)
    assert p.refresh_rate == pytest.approx(3 / 8) and p.nfe == 4.0
    assert p.tokens_per_s == pytest.approx((4 + 4) / 1.0)
    b = aggregate(None, base, base)
    assert (b.fidelity, b.identical, b.speedup, b.delta_ci) == (1.0, 1.0, 1.0, (0.0, 0.0))


# --- run file ----------------------------------------------------------------------------------------


def test_run_file_refuses_to_overwrite_and_checks_settings(tmp_path):
    path = tmp_path / "r.jsonl"
    f = RunFile(path, {"limit": 5, "decode": {"gen_length": 16}})
    f.add({"tau": None, "index": 0, "x": 1})
    f.close()
    with pytest.raises(UsageError, match="already exists; pass --resume"):
        RunFile(path, {"limit": 5, "decode": {"gen_length": 16}})
    with pytest.raises(UsageError, match="made with --gen-length 16, this run has --gen-length 32; to continue it, "
                                         "rerun with --gen-length 16; to start over, drop --resume and pass another "
                                         "--run-file"):
        RunFile(path, {"limit": 5, "decode": {"gen_length": 32}}, resume=True)
    with open(path, "a") as fh:  # a crash in the middle of a line
        fh.write('{"kind": "example", "tau": 0.5, "ind')
    f = RunFile(path, {"limit": 5, "decode": {"gen_length": 16}}, resume=True)
    assert f.loaded == 1 and f.dropped_partial and f.get(None, 0)["x"] == 1
    f.add({"tau": 0.5, "index": 0, "x": 2})
    f.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]  # every line is whole again
    assert [ln["kind"] for ln in lines] == ["header", "example", "example"]


# --- the search over a real engine, interrupted and resumed ------------------------------------------


def run_calibrate(lm, tmp_path, name="run.jsonl", **kw):
    settings = resolve_settings(str(lm.path), {"gen_length": 16, "block_length": 8}, {"policy": "entropy"})
    kw = {"task": "list", "limit": 4, "metric": "fidelity", "grid": 3, "refine": 2, "max_drop": 100.0,
          "run_file": tmp_path / name, "out": tmp_path / "p.yaml", "chat": False, "quiet": True,
          "speed_check": False, **kw}  # the proxy's choice alone (the wall-clock check: test_speed_guard.py)
    opts = CalibrateOptions(**kw)
    return calibrate(lm, settings, get_task("list"), opts, err_console=None)


def comparable(outcome) -> list:
    keep = ("tau", "n", "score", "fidelity", "identical", "speedup", "refresh_rate", "nfe", "cost")
    return [{k: getattr(p, k) for k in keep} for p in [outcome.base, *outcome.points]] + [outcome.choice.point.tau]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_resume_after_interruption_reaches_the_same_answer(llada_lm, tmp_path, monkeypatch, profiles_dir, batch_size):
    full = run_calibrate(llada_lm, tmp_path, "full.jsonl", batch_size=batch_size)
    assert len(full.points) >= 3 and full.profile == tmp_path / "p.yaml"
    assert len({p.fidelity for p in full.points}) > 1  # the random model's τs really differ
    (tmp_path / "p.yaml").unlink()

    calls = {"n": 0, "fail_at": None}
    real = calib_mod.Evaluator._run_chunk

    def flaky(self, tau, c, idx):  # counts decoded batches; the fail_at-th one dies, as a crash or Ctrl-C would
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise KeyboardInterrupt
        return real(self, tau, c, idx)

    monkeypatch.setattr(calib_mod.Evaluator, "_run_chunk", flaky)
    run_calibrate(llada_lm, tmp_path, "count.jsonl", batch_size=batch_size)
    decoded = calls["n"]  # batches an uninterrupted run decodes (some τ batches are copied, not decoded)
    (tmp_path / "p.yaml").unlink()
    calls.update(n=0, fail_at=5)
    with pytest.raises(KeyboardInterrupt):
        run_calibrate(llada_lm, tmp_path, "cut.jsonl", batch_size=batch_size)
    assert not (tmp_path / "p.yaml").exists()
    with pytest.raises(UsageError, match="--resume"):
        run_calibrate(llada_lm, tmp_path, "cut.jsonl", batch_size=batch_size)
    before = calls["n"]
    resumed = run_calibrate(llada_lm, tmp_path, "cut.jsonl", batch_size=batch_size, resume=True)
    assert resumed.resumed_records == (4 if batch_size == 1 else 8)  # 4 batches of 1 row / 2 of (3, 1) rows
    assert comparable(resumed) == comparable(full)
    assert calls["n"] - before == decoded - 4  # only the batches not yet written ran

    # a run file cut after k records (and a torn line): same answer; a complete one decodes nothing
    lines = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "trunc.jsonl").write_text("".join(lines[:7]) + lines[7][:20])
    again = run_calibrate(llada_lm, tmp_path, "trunc.jsonl", batch_size=batch_size, resume=True)
    assert comparable(again) == comparable(full)
    before = calls["n"]
    done = run_calibrate(llada_lm, tmp_path, "full.jsonl", batch_size=batch_size, resume=True)
    assert calls["n"] == before and comparable(done) == comparable(full)


def test_same_decisions():
    assert same_decisions([0.1, 0.5, 2.0], 0.6, 1.9)  # no signal in (0.6, 1.9]
    assert not same_decisions([0.1, 0.5, 2.0], 0.4, 0.6)  # 0.5 refreshes under 0.4, not under 0.6
    assert not same_decisions([0.6], 0.6, 0.5) and same_decisions([0.6], 0.6, 0.7)  # the decision is s > τ
    assert same_decisions([None, 0.1], -5.0, 0.05)  # None: -inf, a step that committed nothing


def test_copied_batches_equal_decoded_ones(llada_lm, tmp_path, profiles_dir):
    out = run_calibrate(llada_lm, tmp_path, grid=6, refine=3)
    recs = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()[1:]]
    copied = [r for r in recs if "reused_from" in r]
    assert copied, "the grid should contain τs whose decisions coincide on some example"
    eng = Engine.from_loaded(llada_lm)
    settings = resolve_settings(str(llada_lm.path), {"gen_length": 16, "block_length": 8}, {"policy": "entropy"})
    task = get_task("list")
    for r in copied:
        ex = task.examples("test", 4, 0)[r["index"]]
        ids = eng.encode([task.prompt(ex, 0, 0)], chat=False)
        run = eng.start(ids, settings.decode, settings.policy("entropy", tau=r["tau"]), seed=r["chunk"])
        for _ in run:
            pass
        (res,) = run.results()
        assert res.token_ids == r["token_ids"] and res.stats["nfe"] == r["nfe"]
        assert res.stats["full_forwards"] == r["full_forwards"] and res.stats["tokens_computed"] == r["cost"]
    assert out.choice.point is not None and sum(p.copied for p in out.points) == len(copied)


def test_resume_with_other_settings_is_an_error(llada_lm, tmp_path, profiles_dir):
    run_calibrate(llada_lm, tmp_path, grid=1, refine=0)
    with pytest.raises(UsageError, match="made with --seed 0, this run has --seed 1; to continue it, rerun with "
                                         "--seed 0"):
        run_calibrate(llada_lm, tmp_path, grid=1, refine=0, seed=1, resume=True)


@pytest.mark.parametrize("name, old, new, words", [
    ("recent_k", 16, 32,
     "made with --recent-k 16, this run has --recent-k 32; to continue it, rerun with --recent-k 16"),
    ("shots", 4, [0, 4], "made with --shots 4, this run has --shots 0,4; to continue it, rerun with --shots 4"),
    ("chat", True, False, "made with --chat, this run has --no-chat; to continue it, rerun with --chat"),
    ("decode.ban_eos", False, True,
     "made with --allow-eos, this run has --ban-eos; to continue it, rerun with --allow-eos"),
    ("decode.steps", None, 8, "made with no --steps, this run has --steps 8; to continue it, rerun without --steps"),
    ("arms", None, [[16, False], [16, True]],
     "made with one --recent-k value and no --joint, this run has --recent-k 16 --joint"),
    ("arms", [[16, False], [32, False]], [[16, False]], "made with --recent-k 16,32, this run has --recent-k 16"),
    ("arms", [[16, False], [16, True], [0, False, 4], [0, False, 8]], [[16, False], [16, True]],
     "made with joint-search arms that no flags of this ecache version search (a --joint run file of an earlier "
     "version), so it cannot be continued"),
    ("arms", [[16, False], [16, True], [16, False, 4], [16, True, 4]], [[16, False], [16, True]],
     "made with --recent-k 16 --recent-steps 0,4 --joint, this run has --recent-k 16 --joint; to continue it, rerun "
     "with --recent-k 16 --recent-steps 0,4 --joint"),
    ("arms", [[k, b] for b in (False, True) for k in (16, 32, 64)] + [[0, False, 4], [0, False, 8], [0, True, 4],
     [0, False, 1, "high", True], [0, False, 1, "high", False]], [[16, False], [64, False], [16, True], [64, True]],
     "made with --joint, this run has --recent-k 16,64 --joint; to continue it, rerun with --joint;"),
    ("recent_steps", None, 4, "made with no --recent-steps, this run has --recent-steps 4"),
    ("weights", "abc", "def", "the model's weights changed (abc in the file, def now); to continue it, rerun with "
                              "the model it was made with"),
    ("block_tau", 0.3, None, "the profile's entropy block_tau changed (0.3 in the file, unset now); to continue "
                             "it, rerun with the profile it was made with"),
    ("refresh_prompt", None, False, "the profile's entropy refresh_prompt changed (true in the file, false now)"),
    ("decode.eps", None, 0.001, "decode setting eps changed (None in the file, 0.001 now); to continue it, rerun "
                                "with decode: {eps: null} in the profile"),
])
def test_resume_mismatch_names_the_option_both_values_and_the_fix(tmp_path, name, old, new, words):
    from ecache_cli.runs.calib_store import mismatch_message

    line = mismatch_message(tmp_path / "r.jsonl", name, old, new)
    assert line.startswith(f"run file {tmp_path / 'r.jsonl'} ") and words in line and "\n" not in line
    assert line.endswith(f"to start over, drop --resume and pass another --run-file (or delete {tmp_path / 'r.jsonl'})")
    assert "recent_k=" not in line and "decode." not in line  # user-facing option names, not run-key names


def test_cli_resume_with_another_recent_k_is_a_one_line_usage_error(cli, llada_dir, tmp_path):
    run = tmp_path / "run.jsonl"
    args = ["calibrate", "--model", llada_dir, "--task", "list", "--limit", 1, "--metric", "fidelity", "--max-drop",
            100, "--taus", "1", "--refine", 0, *SMALL, "--out", tmp_path / "p.yaml", "--run-file", run,
            "--no-speed-check"]
    first = cli(*args, "--recent-k", 4)
    assert first.exit_code == 0, first.stderr
    res = cli(*args, "--recent-k", 8, "--resume")
    one_line_error(res, 2, f"run file {run} was made with --recent-k 4, this run has --recent-k 8; to continue it, "
                           "rerun with --recent-k 4; to start over, drop --resume and pass another --run-file")


# --- the command end to end --------------------------------------------------------------------------


def test_calibrate_writes_a_profile_that_generate_uses(cli, llada_dir, profiles_dir, tmp_path):
    res = cli("calibrate", "--model", llada_dir, "--task", "list", "--limit", 3, "--metric", "fidelity",
              "--max-drop", 100, "--grid", 3, "--refine", 1, "--no-speed-check", *SMALL, "--json", tmp_path / "c.json",
              "--plot", tmp_path / "f.png")
    assert res.exit_code == 0, res.stderr
    assert "τ sweep" in res.stdout and "Pareto frontier" in res.stdout and "chosen τ=" in res.stdout
    prof = yaml.safe_load((profiles_dir / "llada-rand" / "list.yaml").read_text())
    doc = json.loads((tmp_path / "c.json").read_text())
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert prof["model"] == "llada-rand" and prof["task"] == "list"
    assert prof["decode"] == {"gen_length": 16, "block_length": 8, "steps": 16, "threshold": None}
    assert prof["cache"] == {"policy": "entropy", "tau": doc["choice"]["tau"], "recent_k": 64, "signal": "max-entropy"}
    m = prof["measured"]
    assert {"score", "score_none", "speedup", "fidelity", "date", "n", "seed"} <= set(m)
    assert m["n"] == 3 and m["seed"] == 0 and m["speedup"] == round(doc["choice"]["speedup"], 4) > 1
    best = max(p["speedup"] for p in doc["points"])  # --max-drop 100: every τ qualifies, the fastest wins
    assert doc["choice"]["speedup"] == best
    assert doc["manifest"]["model"] == str(llada_dir) and len(doc["points"]) == 4
    assert (profiles_dir / "llada-rand" / ".list.calib.jsonl").is_file()

    gen = cli("generate", "--model", llada_dir, "--task", "list", "--jsonl", "--no-chat", "-q", "Sort: 3 1 2")
    assert gen.exit_code == 0, gen.stderr
    settings = json.loads(gen.stdout)["settings"]
    assert settings["cache"] == "entropy" and settings["cache_params"]["tau"] == prof["cache"]["tau"]
    assert settings["decode"]["gen_length"] == 16
    gen = cli("generate", "--model", llada_dir, "--profile", "list", "--jsonl", "--no-chat", "-q", "Sort: 3 1 2")
    assert gen.exit_code == 0 and json.loads(gen.stdout)["settings"]["cache_params"]["tau"] == prof["cache"]["tau"]

    # the same target for another task is refused before any decoding; so is another model's file
    other = profiles_dir / "llada-rand" / "arith.yaml"
    other.write_text(yaml.safe_dump({"model": "someone-else", "task": "arith"}))
    res = cli("calibrate", "--model", llada_dir, "--task", "arith", "--limit", 2, "--metric", "fidelity", *SMALL)
    assert res.exit_code == 2 and "already holds a profile for model 'someone-else'" in res.stderr
    for text in ("precious\n", "{}\n"):  # a file that is no profile is named as such, not as model None
        other.write_text(text)
        res = cli("calibrate", "--model", llada_dir, "--task", "arith", "--limit", 2, "--metric", "fidelity", *SMALL)
        assert res.exit_code == 2 and res.stderr.strip().splitlines()[-1] == (
            f"error: {other} exists and is not a profile ecache wrote (no model: and task:); move it away or "
            "choose another --out"), res.stderr
        assert other.read_text() == text


def test_dry_run_writes_no_profile_and_no_run_file_but_the_reports_asked_for(cli, llada_dir, profiles_dir, tmp_path):
    res = cli("calibrate", "--model", llada_dir, "--task", "list", "--limit", 2, "--metric", "fidelity",
              "--max-drop", 100, "--grid", 2, "--refine", 0, "--no-speed-check", *SMALL, "--dry-run",
              "--json", tmp_path / "c.json", "--plot", tmp_path / "f.png")
    assert res.exit_code == 0, res.stderr
    assert "dry run: no profile written" in res.stdout
    assert list(profiles_dir.rglob("*")) == []  # no profile, no run file beside it
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["c.json", "f.png"]
    assert json.loads((tmp_path / "c.json").read_text())["points"]  # the search's report


def test_no_qualifying_tau_exits_1_and_writes_no_profile(cli, llada_dir, profiles_dir, tmp_path):
    # τ far above every signal: only the first step refreshes, so the random model's outputs change
    res = cli("calibrate", "--model", llada_dir, "--task", "list", "--limit", 3, "--metric", "fidelity",
              "--taus", "1000", "--refine", 0, "--max-drop", 0, *SMALL, "--json", tmp_path / "c.json")
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["points"][0]["fidelity"] < 1.0 and doc["choice"] is None
    assert res.exit_code == 1
    # a wall-clock warning may precede the error on a busy machine (timing noise), nothing else may
    err = [line for line in res.stderr.strip().splitlines() if not line.startswith("warning: the wall-clock")]
    assert len(err) == 1 and err[0].startswith("error: no τ keeps the fidelity score within 0 points") and \
        "no profile written" in err[0]
    assert "raise --max-drop" in err[0] and "--recent-k" not in err[0]  # rejected for the score: its knobs
    assert not (profiles_dir / "llada-rand" / "list.yaml").exists()


def test_a_tau_rejected_for_speed_gets_the_speed_knobs(cli, llada_dir, profiles_dir):
    """τ 0 refreshes at every step: it keeps the fidelity but saves no work, so the hint names what makes
    a setting faster (larger τ, --recent-k, --joint), not --max-drop."""
    res = cli("calibrate", "--model", llada_dir, "--task", "list", "--limit", 2, "--metric", "fidelity",
              "--taus", "0", "--refine", 0, *SMALL)
    assert res.exit_code == 1, res.stderr
    (err,) = [line for line in res.stderr.strip().splitlines() if not line.startswith("warning: the wall-clock")]
    assert "computes as much as none" in err and "larger τ (--taus)" in err and "--recent-k" in err, err
    assert "--max-drop" not in err, err


def test_the_failure_hint_follows_the_cause():
    from test_cli_errors import _point

    from ecache_cli.runs.tau_search import HINTS, choose

    base = _point(None, 1.0, 1.0, score=0.9)
    slow = choose([_point(0.1, 1.0, 1.0, score=0.9)], base, "task", 0.01)  # keeps the score, saves nothing
    lossy = choose([_point(2.0, 3.0, 2.0, score=0.5)], base, "task", 0.01)  # fast, loses the score
    both = choose([_point(0.1, 1.0, 1.0, score=0.9), _point(2.0, 3.0, 2.0, score=0.5)], base, "task", 0.01)
    assert (slow.point, slow.cause, lossy.cause, both.cause) == (None, "speed", "score", "both")
    assert "--max-drop" not in HINTS["speed"] and "--recent-k" in HINTS["speed"]
    assert "--max-drop" in HINTS["score"] and "--recent-k" not in HINTS["score"]
    one = dataclasses.replace(_point(None, 1.0, 1.0, score=0.9), nfe=1.0)  # none answered each in one forward
    assert choose([_point(0.1, 1.0, 1.0, score=0.9)], one, "task", 0.01).cause == "one_forward"
    assert "--taus" not in HINTS["one_forward"] and "--recent-k" not in HINTS["one_forward"]


def test_threshold_decoding_in_one_forward_is_named_as_the_cause_and_no_parallel_profile_suggested(cli, tmp_path):
    """At --threshold 0.9 the embedded model commits a 32-token list answer in one forward: no τ can be
    faster, and the error says so instead of naming τ or --recent-k; the plain run beside it never sends
    the user to that parallel calibration."""
    common = ("calibrate", "--task", "list", "--limit", 4, "--gen-length", 32, "-q")
    res = cli(*common, "--out", tmp_path / "p.yaml", "--run-file", tmp_path / "p.jsonl", "--threshold", 0.9)
    assert res.exit_code == 1, res.stderr
    (err,) = [line for line in res.stderr.strip().splitlines() if line.startswith("error:")]
    assert "none answers every example in one forward (NFE 1.0)" in err and "--recent-k" not in err, err
    assert not (tmp_path / "p.yaml").exists()
    res = cli(*common, "--out", tmp_path / "q.yaml", "--run-file", tmp_path / "q.jsonl")
    assert res.exit_code == 0, res.stderr
    assert "calibrate a parallel profile" not in res.stderr, res.stderr  # its threshold speed is noise around 1
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]  # -q: warnings and notes alone, so prefixed
    assert all(ln.startswith(("warning: ", "note: ")) for ln in lines), res.stderr


def test_zero_score_warning_says_the_tolerance_is_void_and_what_to_do():
    from ecache_cli.runs.calibrate import zero_score_warning

    task = CalibrateOptions(task="list", limit=4)
    line = zero_score_warning(pt(None, 0.0, 1.0), task)
    assert line == ("none scores 0% on the 50 examples of --task list, so --max-drop cannot reject any τ there; add "
                    "--min-fidelity 95 (agreement with none) or use --metric fidelity; for a score that tells τs "
                    "apart use more examples (--limit), more shots (--shots), another task or another model")
    with_fid = zero_score_warning(pt(None, 0.0, 1.0), CalibrateOptions(task="list", min_fidelity=90.0))
    assert "cannot reject any τ there (--min-fidelity 90 still can); for a score" in with_fid
    assert zero_score_warning(pt(None, 0.02, 1.0), task) is None  # one example right: the score means something
    assert zero_score_warning(pt(None, 0.0, 1.0), CalibrateOptions(task="list", metric="fidelity")) is None
    grouped = pt(None, 0.4, 1.0)
    grouped.parts = {"arith": pt(None, 0.8, 1.0), "list": pt(None, 0.0, 1.0)}  # list's tolerance is void alone
    assert zero_score_warning(grouped, CalibrateOptions(task="arith,list")).startswith(
        "none scores 0% on group list of --task arith,list, so --max-drop cannot reject any τ there")


def test_cli_warns_once_when_none_scores_0_and_goes_on(cli, llada_dir, tmp_path):
    res = cli("calibrate", "--model", llada_dir, "--task", "list", "--limit", 2, "--taus", "1", "--refine", 0,
              *SMALL, "--out", tmp_path / "p.yaml", "--json", tmp_path / "c.json", "--no-speed-check")
    assert res.exit_code == 0, res.stderr
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["none"]["score"] == 0.0  # the random model answers no list question right
    warned = [line for line in res.stderr.splitlines() if line.startswith("warning: none scores 0%")]
    assert warned == ["warning: none scores 0% on the 2 examples of --task list, so --max-drop cannot reject any τ "
                      "there; add --min-fidelity 95 (agreement with none) or use --metric fidelity; for a score that "
                      "tells τs apart use more examples (--limit), more shots (--shots), another task or another "
                      "model"]
    assert doc["choice"]["tau"] == 1  # the search went on


def test_code_tasks_need_consent_and_missing_data_is_one_line(cli, tmp_path):
    res = cli("calibrate", "--model", tmp_path / "no-such-model", "--task", "code", "--limit", 2)
    assert res.exit_code == 2 and "--allow-code-execution" in res.stderr  # before the model is looked up
    res = cli("calibrate", "--model", tmp_path / "no-such-model", "--task", "gsm8k", "--data", tmp_path / "none.jsonl")
    assert res.exit_code == 1
    assert res.stderr.strip().count("\n") == 0
    assert res.stderr.strip() == (f"error: --data {tmp_path / 'none.jsonl'}: no such file or folder; give the "
                                  "official gsm8k test.jsonl (or the folder holding it)")
    res = cli("calibrate", "--model", tmp_path / "no-such-model", "--task", "gsm8k", "--data", tmp_path)
    assert res.exit_code == 1 and res.stderr.strip() == (f"error: --data {tmp_path}: the folder has no test.jsonl; "
                                                         "give the official gsm8k test.jsonl (or the folder holding "
                                                         "it)"), res.stderr


MBPP = [  # hand-written records in the MBPP format (task_id, text, code, test_list, test_setup_code)
    {"task_id": 11, "text": "Write a function to add two numbers.", "code": "def add(a, b):\r\n  return a + b",
     "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"], "test_setup_code": ""},
    {"task_id": 12, "text": "Write a function to double a number.", "code": "def double(x):\r\n  return 2 * x",
     "test_list": ["assert double(2) == 4", "assert double(0) == 0", "assert double(-3) == -6"], "test_setup_code": ""},
    {"task_id": 13, "text": "Write a function to reverse a string.", "code": "def rev(s):\r\n  return s[::-1]",
     "test_list": ["assert rev('ab') == 'ba'", "assert rev('') == ''", "assert rev('x') == 'x'"],
     "test_setup_code": ""},
    {"task_id": 14, "text": "Write a function to find the maximum of a list.",
     "code": "def biggest(xs):\r\n  return max(xs)",
     "test_list": ["assert biggest([1, 3, 2]) == 3", "assert biggest([5]) == 5", "assert biggest([-1, -2]) == -1"],
     "test_setup_code": ""},
    {"task_id": 15, "text": "Write a function to count the vowels in a string.",
     "code": "def vowels(s):\r\n  return sum(c in 'aeiou' for c in s)",
     "test_list": ["assert vowels('abc') == 1", "assert vowels('xyz') == 0", "assert vowels('aeiou') == 5"],
     "test_setup_code": ""},
]


def test_mbpp_end_to_end_scores_in_the_sandbox(cli, llada_dir, profiles_dir, tmp_path, monkeypatch):
    data = tmp_path / "mbpp.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in MBPP))
    res = cli("calibrate", "--model", llada_dir, "--task", "mbpp", "--data", data, "--limit", 5, "--shots", 1, *SMALL)
    assert res.exit_code == 2 and "--allow-code-execution" in res.stderr

    import ecache_cli.tasks.mbpp as mbpp

    programs = []
    real = mbpp.run_program

    def spy(source, **kw):
        programs.append(source)
        return real(source, **kw)

    monkeypatch.setattr(mbpp, "run_program", spy)
    res = cli("calibrate", "--model", llada_dir, "--task", "mbpp", "--data", data, "--limit", 5, "--shots", 1,
              "--allow-code-execution", "--grid", 2, "--refine", 0, "--max-drop", 100, "--no-speed-check", *SMALL,
              "--json", tmp_path / "c.json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["none"]["n"] == 5 and doc["none"]["score"] == 0.0  # garbage code fails its asserts
    assert len(programs) == 5 * (1 + len(doc["points"]))  # every example of every setting ran in the sandbox
    assert all("assert " in p for p in programs)
    prof = yaml.safe_load((profiles_dir / "llada-rand" / "mbpp.yaml").read_text())
    assert prof["measured"]["score"] == 0.0 and prof["measured"]["metric"] == "task"


def test_json_dash_writes_the_document_to_stdout(cli, llada_dir, profiles_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = cli("calibrate", "--model", llada_dir, "--task", "list", "--limit", 2, "--metric", "fidelity",
              "--max-drop", 100, "--grid", 2, "--refine", 0, "--no-speed-check",
              *[a for a in SMALL if a != "-q"], "--json", "-")  # -q would drop the tables (the JSON holds them)
    assert res.exit_code == 0, res.stderr
    assert res.stdout.count("\n") == 1  # one line, as profile --json - prints it (| tail -1 | jq)
    doc = json.loads(res.stdout)  # stdout holds the JSON alone; the tables went to stderr
    assert doc["choice"] is not None and len(doc["points"]) >= 2
    assert not (tmp_path / "-").exists() and "chosen" in res.stderr
