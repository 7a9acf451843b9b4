"""Data parallelism (``ecache_cli.distributed``): sharding rules, honest speed aggregation, and
``torchrun --nproc_per_node 2`` (gloo, CPU) of ``profile`` and ``calibrate`` against one process.

The torchrun tests (profile, calibrate with --resume, the lm-eval model) start two processes that each
load the embedded model, 1.5-2 min together on two cores: they are marked ``slow`` and run by ``.ci/run``
with the other slow tests, in a separate pytest call (``python -m pytest -m slow``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ecache_cli.distributed import DistEnv, aggregate_speed, from_environment
from ecache_cli.errors import EcacheError, UsageError


def test_round_robin_shards_cover_every_item_once():
    items = list(range(11))
    shards = [DistEnv(rank=r, world_size=3).shard(items) for r in range(3)]
    assert shards == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]]
    assert [DistEnv(rank=1, world_size=3).owns(i) for i in range(4)] == [False, True, False, False]
    assert DistEnv().shard(items) == items and not DistEnv().active and DistEnv().is_main


def test_environment_is_read_and_checked():
    env = from_environment({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0"})
    assert (env.rank, env.world_size, env.local_rank, env.active, env.is_main) == (2, 4, 0, True, False)
    assert from_environment({}) == DistEnv()
    with pytest.raises(UsageError, match="RANK=4 is outside WORLD_SIZE=4"):
        from_environment({"WORLD_SIZE": "4", "RANK": "4"})
    with pytest.raises(UsageError, match="must be integers"):
        from_environment({"WORLD_SIZE": "two"})
    with pytest.raises(UsageError, match="--device cuda:1 under 2 ranks"):
        DistEnv(rank=0, world_size=2).device("cuda:1")
    assert DistEnv().device("cuda:1") == "cuda:1"  # one process: untouched


def test_speed_is_total_tokens_over_the_slowest_rank():
    agg = aggregate_speed([{"generated_tokens": 30, "wall_s": 2.0}, {"generated_tokens": 50, "wall_s": 4.0}])
    assert agg["generated_tokens"] == 80 and agg["wall_s"] == 4.0 and agg["tokens_per_s"] == 20.0
    assert agg["world_size"] == 2 and aggregate_speed([])["tokens_per_s"] == 0.0


def test_agree_raises_on_the_failing_rank_and_passes_values_through():
    env = DistEnv()
    assert env.agree(lambda: 7, "testing") == 7

    def fail():
        raise EcacheError("boom")

    with pytest.raises(EcacheError, match="boom"):
        env.agree(fail, "testing")


def test_calibrate_wall_figures_use_the_slowest_rank():
    from ecache_cli.runs.calibrate import parallel_wall
    from ecache_cli.runs.tau_search import aggregate

    def rec(i, chunk, wall, gen=4):
        return {"index": i, "chunk": chunk, "token_ids": [1, 2, 3, 9], "answer_len": 3, "score": 1.0, "nfe": 4,
                "full_forwards": 1, "partial_forwards": 3, "cost": 100, "generated_tokens": gen, "wall_s": wall}

    base = [rec(0, 0, 1.0), rec(1, 1, 3.0), rec(2, 2, 1.0), rec(3, 3, 1.0)]  # ranks: 0 → 2.0 s, 1 → 4.0 s
    tau = [rec(0, 0, 0.5), rec(1, 1, 0.5), rec(2, 2, 0.5), rec(3, 3, 1.5)]  # ranks: 0 → 1.0 s, 1 → 2.0 s
    b = parallel_wall(aggregate(None, base, base), base, aggregate(None, base, base), base, 2)
    p = parallel_wall(aggregate(0.5, tau, base), tau, b, base, 2)
    assert (b.wall_s, b.tokens_per_s, b.speedup_wall) == (4.0, 16 / 4.0, 1.0)
    assert (p.wall_s, p.tokens_per_s, p.speedup_wall) == (2.0, 16 / 2.0, 2.0)
    assert p.speedup == aggregate(0.5, tau, base).speedup  # the cost proxy (and so the choice) is untouched


# --- torchrun ------------------------------------------------------------------------------------

SMALL = ["--gen-length", "32", "-q"]


def ecache(args: list[str], tmp_path, nproc: int = 1) -> subprocess.CompletedProcess:
    """``ecache ARGS`` in a fresh process (``nproc`` > 1: under torchrun, gloo on CPU)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ECACHE_PROFILES": str(tmp_path / "profiles")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    launch = [sys.executable, "-m", "ecache_cli"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
        "-m", "ecache_cli"]
    return subprocess.run(launch + args, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)


def run_records(path) -> dict:
    recs = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "example":
            recs[(r["tau"], r["index"])] = r["token_ids"]
    return recs


@pytest.mark.slow
def test_torchrun_profile_gives_the_tokens_of_one_process(tmp_path):
    args = ["profile", "--task", "list", "--limit", "4", "--policies", "none,entropy", "--warmup", "0", *SMALL]
    one = ecache(args + ["--json", str(tmp_path / "one.json")], tmp_path)
    two = ecache(args + ["--json", str(tmp_path / "two.json")], tmp_path, nproc=2)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    key = lambda d: sorted((r["policy"], r["prompt"], tuple(r["answer_ids"]), r["nfe"]) for r in d["requests"])  # noqa: E731
    assert key(a) == key(b) and len(a["requests"]) == 8
    assert b["world_size"] == 2 and a["world_size"] == 1
    for p in ("none", "entropy"):
        s = b["policies"][p]
        assert len(s["ranks"]) == 2 and s["generated_tokens"] == sum(r["generated_tokens"] for r in s["ranks"])
        assert s["wall_s"] == max(r["wall_s"] for r in s["ranks"])
        assert s["tokens_per_s"] == pytest.approx(s["generated_tokens"] / s["wall_s"])
    assert two.stdout.count("ecache profile") == 1  # one table, printed by rank 0


@pytest.mark.slow
def test_torchrun_calibrate_reproduces_the_single_process_choice_and_resumes(tmp_path):
    args = ["calibrate", "--task", "list", "--limit", "8", "--no-speed-check", *SMALL]  # the proxy's choice: exact
    one = ecache(args + ["--out", str(tmp_path / "one.yaml")], tmp_path)
    two = ecache(args + ["--out", str(tmp_path / "two.yaml")], tmp_path, nproc=2)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr[-3000:]
    chosen = [line for line in one.stdout.splitlines() if line.startswith("chosen")]
    assert chosen and chosen[0].split(":")[0] in two.stdout  # "chosen τ=<same value>"
    import yaml

    pa, pb = (yaml.safe_load((tmp_path / f).read_text()) for f in ("one.yaml", "two.yaml"))
    assert pa["cache"] == pb["cache"] and pa["decode"] == pb["decode"]
    ra, rb = run_records(tmp_path / ".one.calib.jsonl"), run_records(tmp_path / ".two.calib.jsonl")
    assert ra == rb and len(ra) >= 8 * 2  # none + at least one τ, every example, the same tokens

    # a run cut short (as when a rank dies): --resume under torchrun decodes only what is missing
    lines = (tmp_path / ".two.calib.jsonl").read_text().splitlines(keepends=True)
    keep = 1 + 8 + 3  # header, none's 8 records, 3 of the first τ
    (tmp_path / ".two.calib.jsonl").write_text("".join(lines[:keep]))
    (tmp_path / "two.yaml").unlink()
    loud = [a for a in args if a != "-q"]  # "resuming from ...: N records" is a progress line
    again = ecache(loud + ["--out", str(tmp_path / "two.yaml"), "--resume"], tmp_path, nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr and f"{keep - 1} records" in again.stderr
    assert run_records(tmp_path / ".two.calib.jsonl") == ra
    assert yaml.safe_load((tmp_path / "two.yaml").read_text())["cache"] == pa["cache"]

    # an existing run file without --resume: every rank refuses it before the model loads (as one process does)
    fail = ecache(args + ["--out", str(tmp_path / "two.yaml")], tmp_path, nproc=2)
    assert fail.returncode != 0
    assert f"error: run file {tmp_path / '.two.calib.jsonl'} already exists; pass --resume" in fail.stderr
    assert "using model" not in fail.stderr, fail.stderr[-2000:]


@pytest.mark.slow
def test_torchrun_lm_eval_gathers_the_answers_of_one_process(tmp_path):
    pytest.importorskip("lm_eval")
    from pathlib import Path

    tasks = Path(__file__).parent / "lm_eval_tasks"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1"}
    args = ["-m", "lm_eval", "--model", "ecache", "--model_args", "model=tiny,mc_num=8,mc_batch_size=8",
            "--tasks", "ecache_list,ecache_list_mc", "--include_path", str(tasks), "--log_samples"]
    outs = {}
    for name, launch in (("one", []),
                         ("two", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"])):
        cmd = [sys.executable, *launch, *(args if not launch else args[1:]), "--output_path", str(tmp_path / name)]
        if launch:
            cmd.insert(cmd.index("--nproc_per_node") + 2, "-m")  # torchrun ... -m lm_eval
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.count("|ecache_list   |") == 1  # one table (rank 0)
        samples = sorted((tmp_path / name).glob("*/samples_ecache_list_2*.jsonl"))
        outs[name] = sorted((json.loads(line)["doc_id"], json.dumps(json.loads(line)["resps"]))
                            for line in samples[0].read_text().splitlines())
        speed = json.loads(next((tmp_path / name).glob("ecache_speed_*.json")).read_text())
        outs[name + "_speed"] = speed
    assert outs["one"] == outs["two"] and len(outs["one"]) == 6
    one, two = outs["one_speed"]["speed"]["generate_until"], outs["two_speed"]["speed"]["generate_until"]
    assert two["world_size"] == 2 and [r["requests"] for r in two["ranks"]] == [3, 3]
    assert two["generated_tokens"] == one["generated_tokens"] and two["nfe"] == one["nfe"]
    assert two["wall_s"] == max(r["wall_s"] for r in two["ranks"])


def test_generate_under_ranks_needs_an_input_and_an_output_file(cli, monkeypatch, tmp_path):
    from cli_helpers import one_line_error

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    res = cli("generate", "Sort: 3 1 2", "-q")
    one_line_error(res, 2, "generate under 2 ranks needs --input FILE and --output FILE")
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "a"}\n')
    one_line_error(cli("generate", "--input", f, "-q"), 2, "under 2 ranks")


@pytest.mark.slow
def test_torchrun_generate_writes_each_record_once_in_input_order_and_resumes(tmp_path):
    prompts = ["Sort: 9 3 7 1", "Reverse: 1 2 3", "Sort: 5 2 8", "Reverse: 4 5", "Sort: 6 1", "Reverse: 7 8 9 1",
               "Sort: 2 2 1"]
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    args = ["generate", "--input", str(f), "-b", "2", *SMALL]
    one = ecache(args + ["--output", str(tmp_path / "one.jsonl")], tmp_path)
    two = ecache(args + ["--output", str(tmp_path / "two.jsonl")], tmp_path, nproc=2)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr[-3000:]

    def decided(path):
        return [(r["index"], r["line"], r["id"], r["text"], r["token_ids"]) for r in
                (json.loads(line) for line in path.read_text().splitlines())]

    want = decided(tmp_path / "one.jsonl")
    assert [w[0] for w in want] == list(range(7)) and want[0][3] == "1 3 7 9"
    assert decided(tmp_path / "two.jsonl") == want
    # a run killed while rank 0 wrote the fourth record: --resume under two ranks completes the same file
    lines = (tmp_path / "two.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "two.jsonl").write_text("".join(lines[:3]) + lines[3][:20])
    again = ecache(args + ["--output", str(tmp_path / "two.jsonl"), "--resume"], tmp_path, nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert decided(tmp_path / "two.jsonl") == want
    assert (tmp_path / "two.jsonl").read_text().splitlines(keepends=True)[:3] == lines[:3]  # kept as they were
