"""``ecache calibrate`` on block-diffusion models: the decoder's threshold is searched instead of τ (the
``block`` cache is exact there), against the one-token-per-step reference, and the profile it writes
is the one ``generate`` then uses. Runs on the tiny official-code fixtures (``tests/fixtures/sdar``,
``tests/fixtures/llada2-mini``); their random weights make garbage answers, so the choice runs under
``--metric fidelity`` (agreement with the reference)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cli_helpers import one_line_error

from ecache_cli.runs.calib_sweep import DEFAULT_THRESHOLDS, ignored_flags, threshold_decode
from ecache_cli.runs.tau_search import Point, choose, hint, refine_threshold

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SDAR = FIXTURES / "sdar"
#: fast and meaningful on the fixtures: 4 list examples, a 16-token canvas, thresholds on both sides of
#: the fidelity tolerance (on SDAR 0.5 keeps ~97% agreement, 0.2 ~70%)
RUN = ["--task", "list", "--limit", 4, "--gen-length", 16, "--no-chat", "--metric", "fidelity", "--max-drop", 10,
       "--thresholds", "0.9,0.5,0.3,0.2,0.1"]


def pt(threshold, fidelity, speedup):
    """A threshold sweep's point with the fields the choice rule reads."""
    return Point(tau=threshold, n=4, score=None, fidelity=fidelity, identical=fidelity, speedup=speedup,
                 speedup_wall=speedup, tokens_per_s=10.0, refresh_rate=0.0, nfe=10.0, cost=100, wall_s=1.0,
                 tpf=2 * speedup, knob="threshold")


REF = pt(None, 1.0, 1.0)


def _qualifies(p: dict, base: dict, max_drop: float) -> bool:
    """calibrate's acceptance rule under --metric fidelity, from the JSON report's numbers."""
    return p["speedup"] > 1 and base["fidelity"] - p["fidelity"] <= max_drop + 1e-9


@pytest.mark.parametrize("fixture,extra", [("sdar", []), ("llada2-mini", ["--block-length", 8])])
def test_calibrate_searches_the_threshold_and_generate_uses_the_profile(cli, profiles_dir, tmp_path, fixture, extra):
    model = FIXTURES / fixture
    res = cli("calibrate", "--model", model, *RUN, *extra, "--refine", 1, "--no-speed-check", "--recent-k", 16,
              "--json", tmp_path / "c.json")
    assert res.exit_code == 0, res.stderr
    assert f"using model {model}, cache block, threshold searched on --task list (calibrate)" in res.stderr
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning: --recent-k")]
    assert len(warnings) == 1 and "does not apply to a block-diffusion model" in warnings[0]
    assert "τ" not in res.stdout + res.stderr  # every message names the threshold
    assert "threshold sweep" in res.stdout and "TPF" in res.stdout and "chosen threshold=" in res.stdout

    doc = json.loads((tmp_path / "c.json").read_text())
    base, points, chosen = doc["reference"], doc["points"], doc["choice"]
    assert doc["calibrate"]["sweep"] == "threshold" and doc["calibrate"]["thresholds"] == [0.9, 0.5, 0.3, 0.2, 0.1]
    assert len(points) == 6 and all(p["tpf"] > 0 and "tau" not in p for p in points)  # 5 listed + 1 refinement
    ok = [p for p in points if _qualifies(p, base, 0.10)]
    assert ok and len(ok) < len(points)  # the tolerance splits the sweep, so the rule decides something
    fastest = max(p["speedup"] for p in ok)
    assert chosen["speedup"] == fastest and _qualifies(chosen, base, 0.10)
    assert chosen["threshold"] == max(p["threshold"] for p in ok if p["speedup"] == fastest)  # ties: the safer
    assert all(not _qualifies(p, base, 0.10) for p in points if p["speedup"] > fastest)
    assert chosen["tpf"] > base["tpf"]  # more tokens per forward than one per step

    prof = yaml.safe_load((profiles_dir / fixture / "list.yaml").read_text())
    assert prof["cache"] == {"policy": "block"}
    assert prof["decode"]["threshold"] == chosen["threshold"] in [p["threshold"] for p in points]
    assert prof["decode"]["gen_length"] == 16 and prof["decode"]["steps"] is None  # as measured
    m = prof["measured"]
    assert m["n"] == 4 and m["tpf"] == round(chosen["tpf"], 4) and m["tpf_reference"] == round(base["tpf"], 4)
    assert m["speedup"] == round(chosen["speedup"], 4) and m["fidelity"] == round(chosen["fidelity"], 4)

    gen = cli("generate", "--model", model, "--task", "list", "--jsonl", "--no-chat", "Sort: 3 1 2")
    assert gen.exit_code == 0, gen.stderr
    settings = json.loads(gen.stdout.splitlines()[-1])["settings"]
    assert settings["decode"]["threshold"] == prof["decode"]["threshold"] and settings["cache"] == "block"
    assert settings["profile"] == str(profiles_dir / fixture / "list.yaml")
    assert f"from profile {profiles_dir / fixture / 'list.yaml'}" in gen.stderr

    again = cli("calibrate", "--model", model, *RUN, *extra, "--refine", 1, "--no-speed-check", "--resume",
                "--json", tmp_path / "again.json")  # every record read back: the same choice, nothing decoded
    assert again.exit_code == 0, again.stderr
    assert json.loads((tmp_path / "again.json").read_text())["choice"] == chosen


def test_the_speed_check_times_the_choice_against_the_reference(cli, profiles_dir, tmp_path):
    res = cli("calibrate", "--model", SDAR, *RUN[:-2], "--thresholds", "0.1", "--max-drop", 100, "--refine", 0,
              "--speed-check-limit", 2, "--json", tmp_path / "c.json")
    assert res.exit_code in (0, 1), res.stderr  # the wall clock decides; either way the report names the reference
    doc = json.loads((tmp_path / "c.json").read_text())
    sc = doc["speed_check"]
    assert sc["mode"] == "reference" and sc["examples"] == 2 and sc["threshold"] is None
    assert [t["threshold"] for t in sc["timed"]] == [0.1] and set(sc["timed"][0]) == {"setting", "threshold",
                                                                                       "speedup", "passed"}
    if res.exit_code == 0:
        prof = yaml.safe_load((profiles_dir / "sdar" / "list.yaml").read_text())
        assert prof["measured"]["speed_check"]["speedup"] == round(sc["timed"][0]["speedup"], 4)
        assert "tokens/s over the reference" in res.stdout
    else:
        assert "runs at least as fast as the reference" in res.stderr and "τ" not in res.stderr


def test_a_threshold_outside_0_1_is_a_one_line_usage_error(cli, tmp_path):
    res = cli("calibrate", "--model", SDAR, "--task", "list", "--thresholds", "0.9,1.5", "--out", tmp_path / "p.yaml")
    assert one_line_error(res, 2) == "error: --thresholds 1.5 must be in (0, 1] (a confidence; e.g. 0.9)"


# --- the rules on hand-made sweeps ----------------------------------------------------------------


def test_the_choice_takes_the_lowest_qualifying_threshold_and_ties_go_to_the_higher_one():
    sweep = [pt(0.9, 1.0, 1.0), pt(0.8, 0.99, 1.3), pt(0.7, 0.99, 1.3), pt(0.5, 0.95, 1.8), pt(0.3, 0.7, 2.5)]
    c = choose(sweep, REF, "fidelity", max_drop=0.05)
    assert c.point.tau == 0.5 and c.reason.startswith("threshold=0.5: 1.80× (cost proxy), 3.60 tokens per forward")
    assert "for the reference (one token per step)" in c.reason
    assert choose(sweep, REF, "fidelity", max_drop=0.01).point.tau == 0.8  # 0.8 and 0.7 tie: the safer, higher one
    none = choose(sweep, REF, "fidelity", max_drop=0.0)
    assert none.point is None and none.reason.startswith("no threshold keeps the fidelity score within 0 points of "
                                                         "the reference (one token per step)")
    assert "τ" not in hint("threshold", none.cause) and "--thresholds" in hint("threshold", "speed")


def test_the_hint_suggests_only_thresholds_beyond_the_swept_ones():
    """The advice after a failed sweep names thresholds the sweep did not reach (below its lowest when the
    ones that keep the score save nothing, above its highest when those that save lose the score), or says
    none is left; never one the table just showed."""
    assert hint("threshold", "speed", [0.9, 0.3, 0.1]).endswith("try lower thresholds (--thresholds 0.08,0.06,0.04)")
    assert hint("threshold", "speed", [0.9, 0.05]).endswith(
        "no lower threshold is left to try (the sweep went down to 0.05): on this model and task the threshold "
        "rule gains nothing over the reference")
    assert hint("threshold", "score", [0.9, 0.95]).endswith(
        ", or try higher thresholds (--thresholds 0.975,0.9875,0.995)")
    assert hint("threshold", "score", [0.5, 0.999]).endswith(
        "(no higher threshold is left to try: the sweep went up to 0.999)")


def test_refinement_bisects_between_the_choice_and_the_next_lower_threshold():
    sweep = [pt(0.9, 1.0, 1.1), pt(0.5, 0.99, 1.5), pt(0.3, 0.8, 2.0)]
    assert refine_threshold(sweep, REF, "fidelity", 0.02) == 0.4  # (0.3 fails, 0.5 chosen)
    assert refine_threshold([*sweep, pt(0.4, 0.99, 1.7)], REF, "fidelity", 0.02) == 0.35
    assert refine_threshold(sweep, REF, "fidelity", 0.5) is None  # the lowest one qualifies: nothing below
    slow = [pt(0.9, 1.0, 1.0), pt(0.5, 0.9, 1.5)]  # 0.9 saves nothing, 0.5 loses too much
    assert refine_threshold(slow, REF, "fidelity", 0.0) == 0.95  # nothing qualifies: towards one per step


def test_the_reference_decodes_one_token_per_step_and_the_points_keep_the_other_settings():
    from ecache_cli.decoding.config import DecodeConfig

    d = DecodeConfig(gen_length=16, block_length=4, threshold=0.85, edit_threshold=0.9)
    ref = threshold_decode(d, None)
    assert (ref.threshold, ref.factor, ref.steps, ref.edit_threshold) == (None, None, 16, 0.9)
    at = threshold_decode(d, 0.5)
    assert (at.threshold, at.steps, at.edit_threshold) == (0.5, None, 0.9)
    assert list(DEFAULT_THRESHOLDS) == sorted(DEFAULT_THRESHOLDS, reverse=True)
    assert all(0 < t < 1 for t in DEFAULT_THRESHOLDS)
    assert ignored_flags({"--grid": False}) is None
    assert ignored_flags({"--grid": True, "--joint": True}).startswith("--grid, --joint do not apply")
    p = pt(0.5, 0.9, 1.2)
    assert p.label() == "threshold=0.5" and REF.label() == "reference"
    assert p.as_dict()["threshold"] == 0.5 and "tau" not in p.as_dict() and "recent_k" not in p.as_dict()
