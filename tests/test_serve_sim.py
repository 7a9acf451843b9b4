"""bench/serve_sim.py: one-line option errors, a real pass of each admission mode that serves every request,
the random-checkpoint form that bench/gpu_check.sh step 8 runs, and the scheduler's CUDA step timing."""

from __future__ import annotations

import json
import re
import shlex
import types

import pytest
import torch
from cli_helpers import REPO, bench_usage_error, load_bench


@pytest.fixture(scope="module")
def sim():
    return load_bench("serve_sim")


@pytest.mark.parametrize("argv, words", [
    (["--rates", "4,x"], "--rates '4,x' is not a list of numbers; give requests/s, e.g. --rates 4,8"),
    (["--rates", "4,0"], "--rates 4,0: every rate must be a finite number > 0 requests/s"),
    (["--rates", "4,inf"], "--rates 4,inf: every rate must be a finite number > 0 requests/s"),
    (["--rates", "nan"], "--rates nan: every rate must be a finite number > 0 requests/s"),
    (["--n", "1"], "--n 1 must be ≥ 2"),
    (["--schedules", "0"], "--schedules 0 must be ≥ 1"),
    (["--max-batch", "0"], "--max-batch 0 must be ≥ 1"),
    (["--shots", "-1"], "--shots -1 must be ≥ 0"),
    (["--policy", "fast"], "--policy 'fast' is not a cache policy; use one of none, "),
    (["--admission", "always,static"], "--admission 'static' is not an admission rule; use one of always, fcfs, "
                                       "auto (comma-separated)"),
    (["--rates", "0.5x,0x"], "--rates 0.5x,0x: every rate must be a finite number > 0 requests/s"),
    (["--size", "2b"], "--size '2b' is not a size; use one of 1b, tiny"),
    (["--device", "gpu0"], "--device 'gpu0' is not a device; use one of auto, cpu, cuda, cuda:N"),
    (["--dtype", "float8"], "--dtype 'float8' is not a dtype; use one of "),
    (["--clock", "gpu"], "--clock 'gpu' is not a clock; use one of wall, cpu"),
    (["--clock", "cpu", "--threads", "2"], "--clock cpu counts one thread's CPU time; --threads 2 would leave"),
    (["--domains", "list,nope"], "--domains 'nope' is not a task; use one of arith, code, list, "),
    (["--steps-log", "."], "--steps-log . is a folder; name a file in it, e.g. steps.jsonl"),
    (["--unloaded"], "--unloaded serves the requests one at a time, long apart, which on the wall clock waits "
                     "the time between them: use --clock cpu"),
])
def test_bad_options_exit_2_with_one_line(sim, capsys, argv, words):
    assert words in bench_usage_error(sim.parse, argv, capsys)


def test_each_mode_serves_every_request_and_counts_its_steps(sim, monkeypatch):
    args = sim.parse(["--n", "4", "--rates", "50", "--shots", "0", "--max-tokens", "32", "--profile", "list",
                      "--domains", "list,arith"])
    lm, settings, prompts = sim.build(args)
    assert [d for d, _ in prompts[:4]] == ["list", "arith", "list", "arith"]  # interleaved
    two = {}
    for mode in ("always", "fcfs", "auto"):
        r = sim.one_pass(lm, settings, prompts, args, mode, 50.0, 0, 4)
        assert r["mode"] == mode and r["steps"] >= 1 and r["rows_per_step"] >= 1
        assert 0 < r["p50"] <= r["p95"] and r["throughput"] > 0
        assert set(r["p95_by_domain"]) == {"list", "arith"} and max(r["p95_by_domain"].values()) == r["p95"]
        assert r["cost"]["per_position"] > 0  # the model the scheduler fitted to its warm-up and steps
        # one 32-token block: at most 32 steps per request, however the requests overlap
        assert r["steps"] <= 4 * 32
        assert r["busy_s"] > 0 and r["ms_per_step"] == pytest.approx(1000 * r["busy_s"] / r["steps"])
        assert 0 <= r["joined_running"] <= 3  # the first request finds nothing running
        if mode == "fcfs":
            assert r["joined_running"] == 0  # static batches: no request joins running rows
        two[mode] = (r["two_forward"], r["joined_running"])
    # a row that joins running ones refreshes while they do not: a step of two forwards, unless merged
    assert all(0 <= v < 1 for v, _ in two.values()) and (two["always"][0] > 0 or two["always"][1] == 0), two
    from ecache_cli.engine import forward

    monkeypatch.setattr(forward, "MERGE_REFRESH", True)
    assert sim.one_pass(lm, settings, prompts, args, "always", 50.0, 0, 4)["two_forward"] == 0.0


def test_spread_is_each_modes_slowest_over_fastest_pass(sim):
    rows = [{"mode": "fcfs", "rate": 8.0, "p50": 0.2, "p95": 0.5},
            {"mode": "fcfs", "rate": 8.0, "p50": 0.3, "p95": 0.4},
            {"mode": "auto", "rate": 8.0, "p50": 0.25, "p95": 0.5},
            {"mode": "auto", "rate": 4.0, "p50": 9.0, "p95": 9.0}]
    spread = sim.spread_at(rows, 8.0)
    assert spread["fcfs"] == pytest.approx({"p50": 1.5, "p95": 1.25})
    assert spread["auto"] == {"p50": 1.0, "p95": 1.0}  # one pass at this rate


def test_rates_take_numbers_and_fractions_of_the_measured_capacity(sim):
    assert sim.parse(["--rates", "4,0.9x"]).rates == [(4.0, False), (0.9, True)]
    assert sim.parse([]).rates == [(4.0, False), (8.0, False)]  # the default run is unchanged


def test_gpu_check_step_8_options_parse(sim, tmp_path):
    """bench/gpu_check.sh step 8's serve_sim command, with the dry run's values, is one serve_sim accepts."""
    script = (REPO / "bench" / "gpu_check.sh").read_text().replace("\\\n", " ")
    cmd = re.search(r"bench/serve_sim\.py (.*?) 2>&1", script).group(1)
    cmd = re.sub(r'"\$\(\[.*?\)"', "1", cmd)  # --threads "$([ "$DEVICE" = cpu ] && echo 1 || echo 4)"
    cmd = cmd.replace('"$SIZE"', "tiny").replace('"$DEVICE"', "cpu").replace('"$DTYPE"', "float32")
    cmd = cmd.replace("$DEST", str(tmp_path))
    args = sim.parse(shlex.split(cmd))
    assert (args.size, args.device, args.dtype, args.threads) == ("tiny", "cpu", "float32", 1)
    assert args.steps_log == tmp_path / "serve_steps.jsonl"
    assert args.admission == ["always", "fcfs", "auto"] and all(frac for _, frac in args.rates)


def test_random_checkpoint_serves_the_embedded_tokens_and_a_burst_is_one_batch(sim, tmp_path):
    from ecache_cli.models.loader import load_model

    args = sim.parse(["--size", "tiny", "--n", "4", "--max-batch", "4", "--shots", "0", "--max-tokens", "32"])
    lm, settings, prompts = sim.build(args, tmp_path)
    assert args.model == str(tmp_path / "llada-tiny-random")
    emb = load_model("tiny", device="cpu", dtype="float32")
    # gpu_speed.py's tiny shape has 128 rows; widened to the embedded model's, so its token ids fit
    assert (lm.spec.vocab_size, lm.spec.d_model) == (emb.spec.vocab_size, 64)
    text = prompts[0][1]
    assert lm.tokenizer.encode(text) == emb.tokenizer.encode(text)  # the embedded model's tokens
    assert settings.profile is None and settings.decode.gen_length == 32  # defaults: no profile of the embedded model
    r = sim.one_pass(lm, settings, prompts, args, "fcfs", 1.0, 0, 4, burst=True)
    # the 4 requests queued before the scheduler started run as one batch: a 32-token block's steps at
    # 4 rows (an answer that samples an end marker leaves earlier), never one row after another
    assert r["steps"] <= 33 and r["rows_per_step"] > 2 and r["throughput"] > 0
    # --steps-log: what the step-cost model was given, the warm-up's runs of 1, 2 and 4 rows (8 steps each)
    # first, then each of the pass's steps with its rows
    seen = r["observed"]
    assert [rows for _, rows, *_ in seen[:24]] == [1] * 8 + [2] * 8 + [4] * 8
    assert len(seen) == 24 + r["steps"] and all(s > 0 and p > 0 for s, _, p, *_ in seen)


def test_continuous_over_static_is_the_ratio_of_the_pooled_p95s(sim):
    # 20 latencies a mode: the p95 is the largest
    lat = {("always", 5.0): [(0.1 * i, "list") for i in range(1, 21)],  # p95 2.0
           ("fcfs", 5.0): [(0.2 * i, "list") for i in range(1, 21)]}   # p95 4.0
    assert sim.continuous_over_static(lat, 5.0) == {"always_p95_over_fcfs": pytest.approx(0.5), "met": True}
    lat[("always", 5.0)] = [(0.19 * i, "list") for i in range(1, 21)]
    assert sim.continuous_over_static(lat, 5.0) == {"always_p95_over_fcfs": pytest.approx(0.95), "met": False}
    assert sim.continuous_over_static(lat, 6.0) == {}


def test_targets_read_each_modes_latencies_pooled_over_its_passes(sim):
    """Two passes of `auto` whose own p95s are both above `fcfs`'s meet the target once pooled: the p95 of
    the pooled requests is not the median of the passes' p95s."""
    fast = [(0.1 * i, "list") for i in range(1, 20)]  # 19 latencies 0.1 .. 1.9
    # pooled over two passes (40 latencies): the p95 is the 38th smallest, 1.9 for fcfs, p50 1.0
    lat = {("fcfs", 8.0): [(0.1 * i, "list") for i in range(1, 21)] * 2,
           ("always", 8.0): [(0.2 * i, "list") for i in range(1, 21)] * 2,
           ("auto", 8.0): fast + [(5.0, "list")] + fast + [(4.0, "list")]}
    # each auto pass alone (20 latencies: the p95 is the largest) is far above fcfs's pass (2.0)
    assert [sim.pct([t for t, _ in fast + [(x, "list")]], 0.95) for x in (5.0, 4.0)] == [5.0, 4.0]
    assert sim.pct([0.1 * i for i in range(1, 21)], 0.95) == pytest.approx(2.0)
    t = sim.targets_at(lat, 8.0, ["list"])
    assert t["auto_p95_over_best"] == pytest.approx(1.9 / 1.9) and t["auto_p50_over_best"] == pytest.approx(1.0)
    assert t["met"] is True
    lat[("auto", 8.0)] = [(x * 1.1, d) for x, d in lat[("fcfs", 8.0)]]
    t = sim.targets_at(lat, 8.0, ["list"])
    assert t["auto_p50_over_best"] == pytest.approx(1.1) and t["met"] is False
    # mixed lengths: the first domain's p95 under auto against fcfs's
    lat = {(m, 3.0): [(1.0, "list"), (2.0, "arith")] * 10 for m in ("always", "fcfs")}
    lat[("auto", 3.0)] = [(0.7, "list"), (2.0, "arith")] * 10
    t = sim.targets_at(lat, 3.0, ["list", "arith"])
    assert t["auto_short_p95_over_fcfs"] == pytest.approx(0.7) and t["met"] is True
    assert sim.targets_at({("auto", 3.0): [(1.0, "list")]}, 3.0, ["list"]) == {}  # a mode missing


def test_spread_is_taken_within_each_schedule(sim):
    """Two schedules of one mode differ by their arrivals, not by the machine: the spread compares the
    passes of one schedule only."""
    rows = [{"mode": "fcfs", "rate": 8.0, "schedule": 0, "p50": 0.2, "p95": 0.4},
            {"mode": "fcfs", "rate": 8.0, "schedule": 0, "p50": 0.22, "p95": 0.4},
            {"mode": "fcfs", "rate": 8.0, "schedule": 1, "p50": 0.6, "p95": 0.9},
            {"mode": "fcfs", "rate": 8.0, "schedule": 1, "p50": 0.6, "p95": 0.99}]
    assert sim.spread_at(rows, 8.0)["fcfs"] == pytest.approx({"p50": 1.1, "p95": 1.1})


def test_schedules_rotate_the_prompts_and_draw_new_arrivals(sim, tiny_cpu):
    """Schedule k asks the prompts from k·n on (offset) and draws its own Poisson arrivals."""
    args, lm, settings, prompts = tiny_cpu
    assert sim.parse(["--schedules", "3"]).schedules == 3 and sim.parse([]).schedules == 1
    p0 = sim.Pass(lm, settings, prompts, args, "fcfs", 6, sim.CpuClock())
    p1 = sim.Pass(lm, settings, prompts, args, "fcfs", 3, sim.CpuClock(), offset=3)
    assert p1.domains == p0.domains[3:6]
    assert [p1.request(i).prompt_ids for i in range(3)] == [p0.request(i).prompt_ids for i in range(3, 6)]
    assert p1.request(0).prompt_ids != p0.request(0).prompt_ids
    assert sim.arrival_times(5, 8.0, 1) != sim.arrival_times(5, 8.0, 1 + 7919)


def test_scheduler_waits_for_a_cuda_steps_kernels_before_timing_it(monkeypatch):
    """A CUDA step returns with its kernels queued: its time is read after a synchronize of its device."""
    from ecache_cli.serve import scheduler

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    scheduler._settle(types.SimpleNamespace(rows=types.SimpleNamespace(is_cuda=True, device="cuda:1")))
    assert calls == ["cuda:1"]
    scheduler._settle(types.SimpleNamespace(rows=torch.zeros(2)))  # CPU: nothing to wait for
    assert calls == ["cuda:1"]


@pytest.fixture(scope="module")
def tiny_cpu(sim):
    """The tiny model and its settings, one-block answers, with ``--clock cpu``."""
    args = sim.parse(["--clock", "cpu", "--n", "3", "--shots", "0", "--max-tokens", "32", "--profile", "list",
                      "--max-batch", "4"])
    return (args, *sim.build(args))


def test_unloaded_requests_run_one_at_a_time_and_the_load_is_static_p95_over_them(sim, tiny_cpu, monkeypatch):
    args, lm, settings, prompts = tiny_cpu
    passes = []
    one_pass = sim.one_pass
    monkeypatch.setattr(sim, "one_pass", lambda *a, **k: passes.append(one_pass(*a, **k)) or passes[-1])
    alone = sim.unloaded_latency(lm, settings, prompts, args)
    (r,) = passes
    assert r["mode"] == "fcfs" and r["rows_per_step"] == 1.0 and r["joined_running"] == 0  # never two at once
    assert (alone["p50"], alone["p95"]) == (r["p50"], r["p95"]) and 0 < alone["p50"] <= alone["p95"]
    # the same three requests queued together: one batch, whose steps are wider, so each takes longer
    burst = one_pass(lm, settings, prompts, args, "fcfs", 1.0, 0, args.n, burst=True)
    assert burst["rows_per_step"] > 1 and burst["p50"] > alone["p50"]
    lat = {("fcfs", 4.0): [(0.1 * i, "list") for i in range(1, 21)]}  # p95 2.0
    assert sim.load_at(lat, 4.0, {"p50": 0.5, "p95": 1.0}) == {"over_unloaded_p50": pytest.approx(4.0),
                                                              "over_unloaded_p95": pytest.approx(2.0)}


@pytest.mark.parametrize("change, words", [
    ({"policy": "block"}, "(--shots 0, --max-tokens 32, --policy block) is one the server refuses: policy block "
                          "does not apply to the llada model family"),
    ({"shots": 400}, "this server takes at most 4096; use fewer --shots"),
])
def test_a_request_the_server_refuses_ends_the_run_in_one_line_before_any_pass(sim, tiny_cpu, capsys, change,
                                                                                  words):
    args, lm, settings, prompts = tiny_cpu
    sim.check_requests(lm, settings, prompts, args)  # the fixture's own requests: accepted, nothing printed
    assert capsys.readouterr().err == ""
    bad = types.SimpleNamespace(**{**vars(args), **change})
    if "shots" in change:
        bad_prompts = sim.build(bad)[2]
    else:
        bad_prompts = prompts
    with pytest.raises(SystemExit) as e:
        sim.check_requests(lm, settings, bad_prompts, bad)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("serve_sim.py: a request of --domains list")
    assert words in err, err


def test_the_cpu_clock_gives_one_schedule_and_skips_the_idle_engines_wait(sim, tiny_cpu):
    """Arrivals at 0, 0.1 ms (inside the first step: it joins under always) and 1000 s (the idle engine's
    clock jumps to it): two always passes and a fcfs pass run together give the same answers, the
    same joins and steps, and the last request's latency is its own service, not the idle gap."""
    args, lm, settings, prompts = tiny_cpu
    passes = [sim.Pass(lm, settings, prompts, args, mode, 3, sim.CpuClock()) for mode in ("always", "always", "fcfs")]
    for p in passes:
        p.warmup = p.warmup[:1]  # a shorter warm-up: one row
    sim.drive(passes, [0.0, 1e-4, 1000.0])
    a, b, f = passes
    answers = [[j.text for j in p.jobs] for p in passes]
    assert answers[0] == answers[1] == answers[2] and all(answers[0])
    joined = [p.result(1.0)["joined_running"] for p in passes]
    assert joined == [1, 1, 0]  # the second request joined the first's row; fcfs never joins
    assert len(a.steps) == len(b.steps)
    for p in passes:
        last = p.jobs[2]
        assert last.arrived - p.jobs[0].arrived == pytest.approx(1000.0)
        assert 0 < p.done_at[id(last)] - last.arrived < 5.0  # served alone: seconds of CPU, not the 1000 s gap
        assert all(p.done_at[id(j)] > j.arrived for j in p.jobs)


def test_time_the_engine_thread_is_not_running_does_not_pass_on_the_cpu_clock(sim, tiny_cpu):
    """Each step of one pass also sleeps 50 ms (as if the engine thread were preempted): its latencies are
    its CPU seconds (the steps' own, a few ms each), far below the sleeps."""
    import time

    args, lm, settings, prompts = tiny_cpu
    p = sim.Pass(lm, settings, prompts, args, "always", 2, sim.CpuClock())
    p.warmup = p.warmup[:1]
    inner = p.sched._step

    def preempted(group):
        time.sleep(0.05)
        inner(group)

    p.sched._step = preempted
    sim.drive([p], [0.0, 0.0])
    slept = 0.05 * len(p.steps)
    assert slept > 1.0 and max(p.done_at[id(j)] - j.arrived for j in p.jobs) < slept / 2


def test_the_schedulers_clock_times_its_steps_and_its_timeouts(sim, tiny_cpu):
    """``Scheduler(clock=...)``: a clock that moves 0.5 s at each read makes every step 0.5 s (the metrics
    and the step-cost model see it) and ends a request of a 3 s timeout after a few steps, which the real
    clock would never do in this test's fraction of a second."""
    args, lm, settings, prompts = tiny_cpu

    class Ticks:  # 0.5 s a read; resume, pause and skip_to as CpuClock's
        t = 0.0

        def __call__(self):
            self.t += 0.5
            return self.t

        def resume(self):
            pass

        pause = resume

        def skip_to(self, t):
            self.t = max(self.t, t)

    p = sim.Pass(lm, settings, prompts, args, "fcfs", 1, Ticks())
    p.warmup = []
    sched = p.sched
    reasons = []
    finish = sched._finish
    sched._finish = lambda job, reason, *a, **k: (reasons.append(reason), finish(job, reason, *a, **k))
    job = p.request(0)
    job.timeout = 3.0
    p.request = lambda i: job
    sim.drive([p], [0.0])
    n = sched.metrics.registry.get_sample_value("ecache_step_seconds_count", {"policy": "entropy"})
    total = sched.metrics.registry.get_sample_value("ecache_step_seconds_sum", {"policy": "entropy"})
    assert 1 <= n < 32 and total == pytest.approx(0.5 * n)
    assert reasons == ["timeout"]
    w, *_ = sched.cost._all[(1, False)]
    assert w == pytest.approx(sum(0.99 ** i for i in range(int(n))))  # every step observed, on that clock


def test_auto_simulates_a_held_head_again_only_when_what_it_rests_on_changes(sim, tiny_cpu, monkeypatch):
    """A decision that holds every head (``joins`` stubbed): with ``Scheduler._hold_key`` the held head is
    simulated again only when the queue or the running rows change (two arrivals behind a running row: two
    decisions, the second 20 ms in); without it, at every step the head waits. The schedule is the same."""
    import ecache_cli.serve.scheduler as scheduler

    args, lm, settings, prompts = tiny_cpu
    calls = []
    monkeypatch.setattr(scheduler, "joins", lambda *a, **k: calls.append(len(a[0])) or False)
    counts, answers = [], []
    for keyed in (True, False):
        calls.clear()
        p = sim.Pass(lm, settings, prompts, args, "auto", 3, sim.CpuClock())
        p.warmup = p.warmup[:1]
        if not keyed:
            p.sched._hold_key = lambda head, running: None  # simulate at every step
        sim.drive([p], [0.0, 1e-4, 0.02])
        counts.append(len(calls))
        answers.append([j.text for j in p.jobs])
        assert p.result(1.0)["joined_running"] == 0 and all(answers[-1])
    assert answers[0] == answers[1]
    assert counts[0] == 2, counts  # the second request's arrival, then the third's (the queue grew)
    assert counts[1] > 10 * counts[0]  # one a step while the first row runs its block


def test_auto_lets_a_request_expected_to_end_first_pass_a_held_head(sim, tiny_cpu, monkeypatch):
    """Behind a head ``auto`` holds (``joins`` stubbed to hold), a request expected to end before the running
    row does (its predicted steps, stubbed by prompt length, below the row's remaining ones) joins at once,
    as a backfilled job does, and ends before the held head, which starts with it (passed again and again
    by short requests it would wait without end); one not expected to end first waits behind it."""
    import ecache_cli.serve.scheduler as scheduler

    args, lm, settings, _ = tiny_cpu
    prompts = [("list", "Sort: 3 1 2 5 4"), ("list", "Sort: 9 8 7 6 5 4 3 2 1 0 9 8"), ("list", "Sort: 2 1")]
    monkeypatch.setattr(scheduler, "joins", lambda *a, **k: False)
    orders, joined = [], []
    for short in (1.0, 64.0):  # the third request's predicted steps
        p = sim.Pass(lm, settings, prompts, args, "auto", 3, sim.CpuClock())
        p.warmup = p.warmup[:1]
        third = len(p.request(2).prompt_ids)
        p.sched.history.sizes = lambda key, bound, k=8, prompt=None, s=short, t=third: [s if prompt == t else 32.0]
        sim.drive([p], [0.0, 1e-4, 2e-4])
        assert all(j.text for j in p.jobs)
        orders.append(sorted(range(3), key=lambda i: p.done_at[id(p.jobs[i])]))
        joined.append(p.result(1.0)["joined_running"])
    assert orders == [[0, 2, 1], [0, 1, 2]] and joined == [2, 0], (orders, joined)


def test_step_fit_reads_a_steps_log_per_count_and_replays_the_fit(tmp_path, capsys):
    """``bench/step_fit.py`` on a ``--steps-log`` line: each count's steps (in step and mixed apart) and the
    fit the scheduler's ``StepCost`` reaches on them, which on exact ``2 ms + 1 ms a row`` steps predicts
    that line; a missing file is one line, exit 2."""
    fit = load_bench("step_fit")
    steps = [[0.002 + 0.001 * n, n, 32.0 * n, False, 0.0] for n in [1] * 8 + [2] * 8 + [4] * 8 + [1, 2, 4, 8] * 10]
    steps.append([0.05, 8, 256.0, True, 0.0])
    log = tmp_path / "steps.jsonl"
    log.write_text(json.dumps({"mode": "auto", "rate": 5.0, "repeat": 0, "steps": steps}) + "\n")
    counts = fit.by_count(steps)
    assert counts[(8, False)]["n"] == 10 and counts[(8, False)]["mean_ms"] == pytest.approx(10.0)
    assert counts[(8, True)] == {"n": 1, "mean_ms": pytest.approx(50.0), "max_ms": pytest.approx(50.0),
                                 "positions": 256.0}
    *_, (when, _, predicted) = fit.replay(steps)
    assert when == "end" and predicted == pytest.approx([0.003, 0.006, 0.010, 0.018], rel=0.02)
    assert fit.main([str(log), "--mode", "auto"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("auto at 5/s, pass 0: 65 steps (24 of the warm-up)") and "8   mixed     1" in out
    with pytest.raises(SystemExit) as e:
        fit.main([str(tmp_path / "none.jsonl")])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_a_missing_serve_extra_is_one_line_exit_1(monkeypatch, capsys):
    """Without the server's extra the serving benches say which module is missing and how to install it."""
    import importlib.util

    import bench_args

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "prometheus_client" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        bench_args.require_serve_extra("serve_sim.py")
    assert e.value.code == ("serve_sim.py: needs the 'serve' extra (prometheus_client is missing): "
                            "pip install -e \".[serve]\"")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    bench_args.require_serve_extra("serve_sim.py")  # installed here: nothing happens
