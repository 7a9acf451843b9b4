"""The admission model of ``ecache serve`` (``serve/admission.py``): the step-cost fit recovers a known
curve, and ``auto`` joins or holds a request as the expected completion times say, on step-cost curves
of the two kinds of machine (a CPU thread: time in proportion to rows; a GPU below its compute bound:
time mostly fixed per step)."""

from __future__ import annotations

import random

import pytest

from ecache_cli.serve.admission import CLIP, MIXED_PRIOR, NEIGHBOURS, Row, StepCost, StepHistory, admit, completions


@pytest.mark.parametrize("true", [(2e-3, 1e-4, 3e-5), (20e-3, 5e-4, 1e-6), (0.0, 2e-3, 0.0)])
def test_the_fit_recovers_the_step_cost_from_steps_of_several_widths(true):
    cost, rng = StepCost(), random.Random(0)
    for _ in range(400):
        n = rng.choice([1, 2, 3, 4, 8])
        positions = n * rng.uniform(30, 60) + rng.choice([0, 0, 0, 200])  # some steps carry a full forward
        cost.observe(true[0] + true[1] * n + true[2] * positions, n, positions)
    for n, positions in ((1, 40), (4, 400), (16, 700), (8, 3000)):
        want = true[0] + true[1] * n + true[2] * positions
        got = cost.base + cost.per_row * n + cost.per_position * positions
        assert got == pytest.approx(want, rel=0.01), (n, positions)
    terms = (cost.base, cost.per_row, cost.per_position)
    big = max(range(3), key=lambda i: true[i] * (1, 4, 200)[i])  # the term that dominates a step
    assert terms[big] == pytest.approx(true[big], rel=0.05), terms


def test_a_run_at_one_width_does_not_wash_out_what_other_widths_taught():
    """The steps are kept per row count: 2000 one-row steps leave the slope the warm-up measured."""
    def observe(n, full):  # a step of n rows of 40 positions each, one of them a full forward of 200
        positions = 40 * n + (160 if full else 0)
        cost.observe(1e-3 + 1e-3 * n + 1e-5 * positions, n, positions)

    cost = StepCost(prior=(5e-3, 0.0, 0.0))  # a prior far from the truth
    for n in (1, 2, 4, 8):
        for i in range(8):
            observe(n, i == 0)
    for i in range(2000):
        observe(1, i % 32 == 0)
    assert cost.base == pytest.approx(1e-3, rel=0.05) and cost.per_row == pytest.approx(1e-3, rel=0.05)
    assert cost.per_position == pytest.approx(1e-5, rel=0.05)
    assert cost.positions(3) == pytest.approx(3 * 40 + 160 / 8, rel=0.05)  # between the counts seen
    assert cost.step(16) == pytest.approx(1e-3 + 16e-3 + 1e-5 * cost.positions(16), rel=0.01)


def test_completions_sum_the_rows_end_times_round_robin_over_groups():
    def step(group, n):
        return {1: 1.0, 2: 1.5}[n]

    # two rows of one group: 2 steps together (1.5 s each), then 1 step alone (1 s)
    assert completions([Row(2, "a"), Row(3, "a")], step) == (3.0 + 4.0, 4.0)
    # two groups: each round steps both (1 + 1 s); the join's full forward adds 0.5 s to the first
    total, end = completions([Row(1, "a"), Row(2, "b")], step, first=0.5)
    assert (total, end) == (2.5 + 3.5, 3.5)


def cpu(group, n: int) -> float:
    """One CPU thread: a step's time in proportion to its rows."""
    return 2e-3 * n if n else 0.0


def gpu(group, n: int) -> float:
    """A GPU below its compute bound: a fixed 20 ms and 0.2 ms a row."""
    return 20e-3 + 2e-4 * n if n else 0.0


def test_on_a_cpu_a_request_like_the_running_ones_waits_and_a_short_one_joins_long_ones():
    # running rows with 20 steps left; a request of 32 steps would slow them by what it saves itself
    assert not admit([Row(20, "g"), Row(20, "g")], Row(32, "g"), 0.0, 0, cpu)
    # the running rows have 96 steps left: a 32-step request is done long before they are
    assert admit([Row(96, "g")], Row(32, "g"), 0.0, 0, cpu)
    # an idle engine takes the head whatever it is
    assert admit([], Row(32, "g"), 1.0, 0, cpu)


def test_on_a_gpu_a_request_joins_at_once():
    assert admit([Row(20, "g")] * 8, Row(32, "g"), 5e-3, 0, gpu)
    assert admit([Row(2, "g")], Row(64, "g"), 5e-3, 3, gpu)
    # another group does not share the running group's steps: each round pays both fixed costs
    assert not admit([Row(2, "g")], Row(64, "h"), 5e-3, 3, gpu)


def test_a_queue_behind_the_head_counts_what_batching_saves_it():
    """A fixed cost per step (0.5 ms) and 1 ms a row: alone the head waits; with 20 requests queued
    behind it, sharing steps ends the running work earlier for all of them, so it joins."""
    def step(group, n):
        return 0.5e-3 + 1e-3 * n if n else 0.0

    assert not admit([Row(30, "g")], Row(32, "g"), 0.0, 0, step)
    assert admit([Row(30, "g")], Row(32, "g"), 0.0, 20, step)
    # requests expected to arrive before the running rows end count as queued: 500/s over their 45 ms
    assert admit([Row(30, "g")], Row(32, "g"), 0.0, 0, step, arrivals=500.0)
    assert not admit([Row(30, "g")], Row(32, "g"), 0.0, 0, step, arrivals=5.0)
    assert not admit([Row(30, "g")], Row(32, "g"), 0.0, 0, cpu, arrivals=500.0)  # no fixed cost: nothing saved


def test_expected_remaining_steps_come_from_the_rows_that_ran_longer():
    h = StepHistory()
    assert h.remaining("g", 10, bound=64, per_block=32) == 54  # no history: to the canvas's end
    for steps in (32, 32, 32, 96):
        h.finished("g", steps)
    assert h.remaining("g", 0, 64, 32) == 48  # the mean
    assert h.remaining("g", 40, 64, 32) == 56  # past one block: only the long row ran that far
    assert h.remaining("g", 100, 64, 32) == 28  # longer than any: to the end of its block


def test_a_heads_lengths_come_from_the_rows_of_prompts_nearest_its_own():
    """Short prompts (from 20 tokens) took 32 steps and long ones (from ~70) 128, in one group: a short head
    is predicted at 32 steps, a long one at 128, a running short row past 40 steps is at its block's
    end rather than near the long rows' 128."""
    h = StepHistory()
    for i in range(NEIGHBOURS):  # short prompts 20 to 20 + NEIGHBOURS - 1 tokens, long ones from 50 + that
        h.finished("g", 32, prompt=20 + i)
        h.finished("g", 128, prompt=50 + NEIGHBOURS + i)
    near_short, near_long = 20 + NEIGHBOURS // 2, 50 + NEIGHBOURS + NEIGHBOURS // 2
    assert h.sizes("g", bound=128, prompt=near_short) == [32.0] * 8
    assert h.sizes("g", bound=128, prompt=near_long) == [128.0] * 8
    assert h.sizes("g", bound=128, k=4) == [32.0, 32.0, 128.0, 128.0]  # no prompt length: every row
    assert h.remaining("g", 0, 128, 32, prompt=near_short) == 32
    assert h.remaining("g", 40, 128, 32, prompt=near_short) == 24  # none of its neighbours ran that far
    assert h.remaining("g", 40, 128, 32) == 88  # every row: the long ones
    assert h.remaining("g", 40, 128, 32, prompt=near_long) == 88
    assert h.sizes("g", bound=128, prompt=20 + NEIGHBOURS + 5) == [32.0] * 8  # nearer every short prompt
    # a long prompt as near as the farthest short one counts too
    assert sorted(h.like("g", 35 + NEIGHBOURS // 2)) == [32] * NEIGHBOURS + [128]


def test_prompt_lengths_that_say_nothing_leave_the_prediction_as_every_rows():
    """With fewer remembered rows than neighbours, or rows of unknown prompt length, or neighbours all
    tied, the prediction is every row's, as without prompt lengths."""
    h = StepHistory()
    for steps, prompt in ((32, 30), (40, 31), (96, 90)):
        h.finished("g", steps, prompt=prompt)
    assert h.sizes("g", bound=128, prompt=30) == h.sizes("g", bound=128) == [32.0, 40.0, 96.0]
    one = StepHistory()
    for steps in (32, 64, 32, 96, 32, 64, 32, 64, 32, 96) * 2:
        one.finished("g", steps, prompt=30)  # one prompt length: all tied, all neighbours
    assert one.sizes("g", bound=128, prompt=30) == one.sizes("g", bound=128)
    assert one.remaining("g", 40, 128, 32, prompt=30) == one.remaining("g", 40, 128, 32) == pytest.approx(36.8)
    unknown = StepHistory()
    for steps in (32, 32, 128, 128) * 4:
        unknown.finished("g", steps)
    assert unknown.sizes("g", bound=128, k=4, prompt=20) == [32.0, 32.0, 128.0, 128.0]


def test_a_groups_own_steps_set_its_level_and_the_fit_its_shape():
    """Runs of a long prompt cost more per step than the positions they compute say: the group's own
    steps at one row count set the level, the fit's ratio the cost of the counts it has not run."""
    cost = StepCost()
    for n in (1, 2, 4):
        for full in (True, False, False, False) * 2:
            positions = 40 * n + (160 if full else 0)
            cost.observe(1e-3 + 1e-3 * n + 1e-5 * positions, n, positions, group="warm")
    assert not cost.seen("long", 1) and cost.curve("long", 2) == pytest.approx(cost.step(2))  # nothing own yet
    level = 2 * cost.step(1)  # twice what the fit says
    for _ in range(8):
        cost.observe(level, 1, 40.0, group="long")
    assert cost.seen("long", 1) and not cost.seen("long", 2)
    assert cost.curve("long", 1) == pytest.approx(level)
    assert cost.curve("long", 2) == pytest.approx(level * cost.step(2) / cost.step(1))
    assert cost.curve("long", 2) > 1.3 * cost.step(2)  # well above what the fit alone says
    partial, full = 1e-3 + 4e-3 + 1e-5 * 160, 1e-3 + 4e-3 + 1e-5 * 320
    assert partial < cost.curve("warm", 4) < (full + 3 * partial) / 4  # its own steps, the oldest weighing least


def test_the_head_is_judged_over_the_lengths_its_group_takes_not_their_mean():
    """Most answers of the group are short (8 steps), one in four long (200): joining a row with 100
    steps left saves a short answer most of its wait, which outweighs what a long one costs; a head of
    the mean length (56) would wait."""
    running = [Row(100, "g")]
    assert not admit(running, Row(56, "g"), 0.0, 0, cpu)
    assert admit(running, [Row(8, "g")] * 3 + [Row(200, "g")], 0.0, 0, cpu)
    h = StepHistory()
    for steps in (8, 8, 8, 200) * 4:
        h.finished("g", steps)
    assert h.sizes("g", bound=256, k=4) == [8.0, 8.0, 8.0, 200.0]
    assert h.sizes("new", bound=256) == [256.0]


def test_mixed_steps_are_kept_apart_from_the_fit_and_priced_by_their_own_ratio():
    """Steps of rows at different steps of their blocks cost more than the positions they compute say:
    they stay out of the fit, and a mixed step is the step in step times the measured ratio."""
    def observe(cost, n, mixed=False, scale=1.0, group="g"):
        positions = 40.0 * n
        cost.observe(scale * (1e-3 + 1e-3 * n + 1e-5 * positions), n, positions, group, mixed=mixed)

    plain, cost = StepCost(), StepCost()
    for c in (plain, cost):
        for n in (1, 2, 4):
            for _ in range(10):
                observe(c, n)
    assert cost.mixed_ratio(2) == MIXED_PRIOR  # no mixed step seen yet
    assert cost.curve("g", 2, True) == pytest.approx(cost.curve("g", 2) * MIXED_PRIOR)
    for _ in range(10):
        observe(cost, 2, mixed=True, scale=1.4)
    assert cost.coef == pytest.approx(plain.coef)  # the fit never saw them
    assert cost.mixed_ratio(2) == pytest.approx(1.4) and cost.mixed_ratio(4) == pytest.approx(1.4)  # nearest count
    assert cost.curve("g", 2, True) == pytest.approx(1.4 * cost.curve("g", 2))  # the group's own mixed steps
    assert cost.curve("g", 4, True) == pytest.approx(1.4 * cost.curve("g", 4))  # ratio × the step in step
    assert cost.curve("g", 1, True) == pytest.approx(cost.curve("g", 1))  # one row is always in step
    cheap = StepCost()
    for _ in range(10):
        observe(cheap, 2)
        observe(cheap, 2, mixed=True, scale=0.8)
    assert cheap.mixed_ratio(2) == 1.0  # never below the step in step


def test_a_stalled_step_counts_at_most_clip_times_its_kinds_mean():
    cost = StepCost()
    for _ in range(10):
        cost.observe(2e-3, 1, 40.0, group="g")
    cost.observe(1.0, 1, 40.0, group="g")  # the machine's other work held the CPU for a second
    w = sum(0.99 ** k for k in range(11))
    want = (0.99 * 2e-3 * sum(0.99 ** k for k in range(10)) + CLIP * 2e-3) / w
    assert cost.curve("g", 1) == pytest.approx(want)
    assert cost.curve("g", 1) < 2 * 2e-3  # unclipped, the one stall would make it 0.097 s


def test_a_count_whose_mean_falls_below_a_smaller_ones_is_pooled_so_rows_never_look_free():
    """Measured on the shared machine: 3 rows' mean (a few steps, two of them stalled) above 4 rows'. Per
    count, the 4th row would cost nothing (it lowers the step) and a join would always pay; pooled, the
    two counts take the fit's shape at their joint level, and the 4th row costs what the fit says."""
    cost = StepCost()
    for n in (1, 2, 3, 4):
        for i in range(10):
            stalled = n == 3 and i in (4, 8)
            cost.observe(cpu_phases("g", n) * (8.0 if stalled else 1.0), n, 40.0 * n, "g")
    means = {n: t / w for (n, _), (w, t, _) in cost._groups["g"].items()}
    assert means[3] > means[4]  # the raw means fall from 3 to 4 rows
    curve = [cost.curve("g", n) for n in (1, 2, 3, 4)]
    assert curve[:2] == pytest.approx([means[1], means[2]])  # counts in order keep their own means
    assert curve[3] - curve[2] == pytest.approx(cost.step(4) - cost.step(3), rel=0.5)  # the fit's marginal, scaled
    assert curve[0] < curve[1] < curve[2] < curve[3]
    w3, w4 = cost._groups["g"][(3, False)][0], cost._groups["g"][(4, False)][0]
    pooled = (means[3] * w3 + means[4] * w4) / (w3 * cost.step(3) + w4 * cost.step(4))  # the joint level
    assert curve[2] == pytest.approx(pooled * cost.step(3)) and curve[3] == pytest.approx(pooled * cost.step(4))


def test_completions_price_a_group_at_several_phases_as_mixed():
    def step(group, n, mixed=False):
        return {(1, False): 1.0, (2, False): 1.5, (2, True): 1.9}[(n, mixed)]

    # in step: 2 steps together (1.5 s each), then 1 alone
    assert completions([Row(2, "a", 0), Row(3, "a", 0)], step) == (3.0 + 4.0, 4.0)
    # one row joined mid-block (phase 0 against 7): the 2 shared steps cost 1.9 s each
    assert completions([Row(2, "a", 7), Row(3, "a", 0)], step) == pytest.approx((3.8 + 4.8, 4.8))
    # rows of two groups never share a step: each group steps in step on its own
    assert completions([Row(1, "a", 7), Row(1, "b", 0)], step) == (4.0, 2.0)


def cpu_phases(group, n: int, mixed: bool = False) -> float:
    """One CPU thread as measured (bench/serve_sim.py, embedded model): 2 rows in step 1.45× one row,
    2 rows at different steps of their blocks 1.9×; more rows in proportion."""
    if not n:
        return 0.0
    return 1e-3 * (1.0 + 0.45 * (n - 1)) * (1.9 / 1.45 if mixed and n > 1 else 1.0)


def test_on_a_cpu_a_request_joins_at_a_block_start_and_waits_mid_block():
    """A running row with 32 steps left; the head takes 32 or 64 steps. Joining at the running row's
    block start runs both in step (1.45× a row: sharing saves more than it costs); joining it 10
    steps into its block runs them mixed (1.9×: each would be better off one after the other)."""
    head = [Row(32, "g"), Row(64, "g")]
    assert admit([Row(32, "g", phase=0)], head, 0.0, 0, cpu_phases)
    assert not admit([Row(32, "g", phase=10)], head, 0.0, 0, cpu_phases)
    # the same for the fitted curves: a mixed ratio measured at 1.31 holds the head mid-block
    cost = StepCost()
    for _ in range(10):
        for n in (1, 2):
            cost.observe(cpu_phases("g", n), n, 40.0 * n, "g")
        cost.observe(cpu_phases("g", 2, True), 2, 80.0, "g", mixed=True)
    assert admit([Row(32, "g", 0)], head, 0.0, 0, cost.curve)
    assert not admit([Row(32, "g", 10)], head, 0.0, 0, cost.curve)


def test_a_mid_block_join_counts_the_requests_expected_before_the_running_rows_end():
    """Four rows 16 steps into their block; a 32-step head. Joining runs all mixed (1.27× a step); waiting
    starts the head, with the requests arriving meanwhile, in step once the four have left. On a GPU
    (20 ms a step, 0.2 ms a row) the head alone would wait (the mixed steps cost the four more than it
    saves), but with two requests queued behind it joining saves them the wait too; on one CPU thread
    (a step in proportion to its rows) it waits either way."""
    def mixed(base, row):
        return lambda g, n, m=False: (base + row * n) * (1.27 if m and n > 1 else 1.0) if n else 0.0

    running = [Row(16, "g", 16)] * 4
    on_gpu, on_cpu = mixed(20e-3, 2e-4), mixed(0.0, 2e-3)
    assert not admit(running, Row(32, "g"), 0.0, 0, on_gpu)
    assert admit(running, Row(32, "g"), 0.0, 2, on_gpu)
    assert admit(running, Row(32, "g"), 0.0, 0, on_gpu, arrivals=8.0)  # 8/s over the four's 0.33 s: ~3
    assert not admit(running, Row(32, "g"), 0.0, 0, on_cpu)
    assert not admit(running, Row(32, "g"), 0.0, 2, on_cpu)


def test_the_mixed_ratio_compares_each_kind_with_the_fits_expectation():
    """Steps whose time follows their positions (1 ms + 80 µs a position): in-step steps of 2 rows at 50-80
    positions, mixed steps 1.2× their expectation at 56, as beside a row near its end. Their mean per step
    is within 6 % of the in-step one's; against the fit's expectation of each kind's rows and positions
    the ratio is the 1.2 they cost more."""
    cost = StepCost()
    for _ in range(10):
        for n in (1, 3):
            cost.observe(1e-3 + 80e-6 * 33 * n, n, 33.0 * n, "g")
        for pos in (50.0, 66.0, 80.0):
            cost.observe(1e-3 + 80e-6 * pos, 2, pos, "g")
        cost.observe(1.2 * (1e-3 + 80e-6 * 56), 2, 56.0, "g", mixed=True)
    (wm, tm, _), (wa, ta, _) = cost._groups["g"][(2, True)], cost._groups["g"][(2, False)]
    assert (tm / wm) / (ta / wa) < 1.06  # per step: hardly dearer than in step
    assert cost.mixed_ratio(2, "g") == pytest.approx(1.2, rel=0.02)
    assert cost.curve("g", 2, True) == pytest.approx(cost.mixed_ratio(2, "g") * cost.curve("g", 2))
    # a group that has run no mixed step takes every group's ratio at the nearest count
    for _ in range(10):
        cost.observe(1e-3 + 80e-6 * 99, 3, 99.0, "h")
    assert cost.mixed_ratio(3, "h") == pytest.approx(cost.mixed_ratio(2, "g"))


def test_the_scheduler_reads_a_rows_phase_and_a_steps_mixedness():
    """``Scheduler._row``: a row's phase is its steps modulo its block's steps, its remaining steps those of
    the rows of prompts nearest its own in length; ``_observe``: a step
    whose rows are at different steps of their blocks goes to the mixed curve."""
    import collections
    import types

    import torch

    from ecache_cli.serve.scheduler import Scheduler

    Cfg = collections.namedtuple("Cfg", "steps gen_length block_length")
    key = collections.namedtuple("Key", "cfg")(Cfg(128, 128, 32))  # 4 blocks of 32 steps
    sched = types.SimpleNamespace(history=StepHistory(), _bound=Scheduler._bound, cost=StepCost(),
                                  metrics=types.SimpleNamespace(step_cost=lambda cost: None))
    assert [Scheduler._row(sched, key, done).phase for done in (0, 5, 32, 70)] == [0, 5, 0, 6]
    for i in range(NEIGHBOURS):  # short prompts took one block, long ones four: a row's prompt picks its own
        sched.history.finished(key, 32, 20 + i)
        sched.history.finished(key, 128, 100 + i)
    assert [Scheduler._row(sched, key, 10, prompt).remaining for prompt in (24, 103, None)] == [22, 118, 70]
    for sib, mixed in (([3, 3], False), ([0, 3], True), ([4], False)):
        rec = types.SimpleNamespace(step_in_block=torch.tensor(sib))
        Scheduler._observe(sched, 2e-3, len(sib), 80.0, "g", 0.0, rec)
        assert sched.cost._groups["g"][(len(sib), mixed)][0] == 1.0


def test_a_join_mid_block_counts_only_the_running_rows_and_the_head():
    """With 20 requests queued, a step's fixed cost makes joining in step pay for all of them; mid-block
    the group would step mixed, which that saving does not cover, so the head waits."""
    def step(group, n, mixed=False):
        return (0.5e-3 + 1e-3 * n) * (1.27 if mixed and n > 1 else 1.0) if n else 0.0

    assert admit([Row(30, "g", 0)], Row(32, "g"), 0.0, 20, step)
    assert not admit([Row(30, "g", 5)], Row(32, "g"), 0.0, 20, step)
    assert not admit([Row(30, "g", 5)], Row(32, "g"), 0.0, 0, step, arrivals=500.0)
    # a short head beside a long running row still joins mid-block: it saves itself the long wait
    assert admit([Row(96, "g", 5)], Row(8, "g"), 0.0, 20, step)


def test_the_curves_answers_are_kept_only_until_the_next_step():
    """``StepCost.curve`` remembers its answers for a decision's many calls; an observed step forgets them."""
    cost = StepCost()
    for _ in range(10):
        cost.observe(2e-3, 1, 40.0, "g")
    first = cost.curve("g", 1)
    assert cost.curve("g", 1) == first == pytest.approx(2e-3)
    for _ in range(30):
        cost.observe(4e-3, 1, 40.0, "g")
    assert cost.curve("g", 1) > 3e-3  # the newer steps' mean


def test_a_heads_equal_versions_count_as_often_as_they_occur():
    """``admit`` simulates each distinct version of the head once, weighted by how often it occurs: the
    decision of the sum over every version listed. A running row with 40 steps left on a CPU curve:
    joining saves a version of 8 steps 48 ms and costs one of 400 steps 80 ms, so the mix decides."""
    running, short, long = [Row(40, "g", 0)], Row(8, "g"), Row(400, "g")
    alone, end = completions(running, cpu)

    def by_each(heads):  # the sum over the versions, one simulation each
        return sum(completions(running + [h], cpu)[0] - alone - completions([h], cpu, start=end)[0]
                   for h in heads) <= 0

    mixes = ([short] * 7 + [long], [short] + [long] * 7, [short, long])
    decided = [admit(running, heads, 0.0, 0, cpu) for heads in mixes]
    assert decided == [by_each(h) for h in mixes] == [True, False, False]


def test_positions_never_fall_as_the_rows_grow():
    """2-row steps that carried more full forwards (300 positions on average) than the 4-row ones (160):
    the two counts are pooled at their joint mean, and the counts beyond follow the line to the nearest
    count of a different mean. Left as measured, the line through 2 and 4 rows fell to 0 positions at 8
    rows, and a step of more rows looked cheaper."""
    cost = StepCost()
    for n, positions in ((1, 40.0), (2, 300.0), (4, 160.0)):
        for _ in range(10):
            cost.observe(1e-3 + 1e-3 * n + 1e-5 * positions, n, positions)
    assert cost.positions(1) == pytest.approx(40.0)
    assert [cost.positions(n) for n in (2, 3, 4)] == pytest.approx([230.0] * 3)  # (300 + 160) / 2, equal weights
    assert cost.positions(8) == pytest.approx(230.0 + 4 * (230.0 - 40.0) / 3)  # the line through 1 and 4 rows
    steps = [cost.step(n) for n in range(1, 13)]
    assert steps == sorted(steps)


def test_a_count_the_group_has_not_run_lies_between_the_levels_of_those_around_it():
    """The group ran 1 row at 10 ms and 4 at 12 ms a step; the fit's shape scales 1 row's level to
    ~15 ms at 2 rows, above 4 rows' 12, and 4 rows' to ~9.6 ms at 3, below 1 row's 10: scaled from the
    nearest count alone, the rows in between would look free. Between two counts it has run, the curve
    goes from one level to the other along the fit's shape; beyond them, the nearest level scaled."""
    cost = StepCost()
    for n in (1, 2, 4):
        for _ in range(200):
            cost.observe(1e-3 + 1e-3 * n + 1e-5 * 40 * n, n, 40.0 * n, group="warm")
    for n, level in ((1, 10e-3), (4, 12e-3)):
        for _ in range(8):
            cost.observe(level, n, 40.0 * n, group="g")
    step = {n: cost.step(n) for n in range(1, 7)}
    assert 10e-3 * step[2] / step[1] > 12e-3 and 12e-3 * step[3] / step[4] < 10e-3  # scaled alone: out of order
    for n in (2, 3):
        frac = (step[n] - step[1]) / (step[4] - step[1])
        assert cost.curve("g", n) == pytest.approx(10e-3 + 2e-3 * frac)
    assert cost.curve("g", 2) == pytest.approx(10.67e-3, abs=0.01e-3)  # the fit is a straight line here
    assert cost.curve("g", 6) == pytest.approx(12e-3 * step[6] / step[4])
    curve = [cost.curve("g", n) for n in range(1, 7)]
    assert curve == sorted(curve) and curve[0] == pytest.approx(10e-3) and curve[3] == pytest.approx(12e-3)


def test_a_request_expected_to_end_before_the_running_rows_joins_them():
    """Shortest expected work first: a head whose mean length is below the longest running row's remaining
    steps joins (on a CPU thread, where sharing costs about what it saves, this is what lets a short request
    past a long one); a head as long as what runs, or a one-size workload's, does not."""
    from ecache_cli.serve.admission import ends_first, joins

    assert ends_first([Row(96, "g"), Row(10, "g")], [32.0]) and not ends_first([Row(31, "g")], [32.0] * 8)
    assert ends_first([Row(60, "g")], [32.0, 32.0, 64.0, 64.0])  # a mean of 48 steps
    assert not ends_first([Row(40, "g")], [32.0, 32.0, 64.0, 64.0]) and not ends_first([], [1.0])
    cost = StepCost()
    for _ in range(10):  # in step and mixed, both measured: a step's time in proportion to its rows
        for n in (1, 2):
            cost.observe(2e-3 * n, n, 40.0 * n, "g")
            cost.observe(2.2e-3 * n, n, 40.0 * n, "g", mixed=n > 1)
    # mid-block beside a row with 40 steps left: by the expected sum of completion times a 32-step head waits
    assert not admit([Row(40, "g", 5)], Row(32, "g"), 0.0, 0, cost.curve)
    assert joins([Row(40, "g", 5)], "g", [32.0], 0.0, 0, cost)
    assert not joins([Row(30, "g", 5)], "g", [32.0], 0.0, 0, cost)


def test_a_mid_block_join_is_tried_until_mixed_steps_are_measured():
    """The mixed ratio is the prior until the server has run mixed steps: the first head that would join
    mid-block joins, so that the next decisions rest on measured mixed steps; once they are, a costly one
    holds the head."""
    from ecache_cli.serve.admission import joins

    cost = StepCost()
    for _ in range(10):
        for n in (1, 2):
            cost.observe(2e-3 * n, n, 40.0 * n, "g")
    assert not cost.mixed_measured() and joins([Row(20, "g", 5)], "g", [32.0], 0.0, 0, cost)
    # beside rows already at two phases the comparison decides: a third phase would spread the mixed
    # steps over more row counts before any count is measured
    assert not joins([Row(20, "g", 5), Row(24, "g", 12)], "g", [32.0], 0.0, 0, cost)
    for _ in range(10):
        cost.observe(6e-3, 2, 80.0, "g", mixed=True)  # 1.5× a step in step
    assert cost.mixed_measured() and cost.mixed_ratio(2) == pytest.approx(1.5)
    assert not joins([Row(20, "g", 5)], "g", [32.0], 0.0, 0, cost)


def test_the_fit_is_the_non_negative_least_squares_solution():
    """``_solve`` is the ridge least squares with every term ≥ 0, the same optimum scipy's NNLS finds on the
    stacked system (rows √w·x, √(RIDGE·D)·I against √w·y, √(RIDGE·D)·prior), also where the unconstrained
    solution has a negative term."""
    from scipy.optimize import nnls

    from ecache_cli.serve.admission import RIDGE, _solve

    rng = random.Random(3)
    for case in range(20):
        xs = [(1.0, float(n), n * rng.choice([0.04, 0.58])) for n in (rng.randint(1, 16) for _ in range(40))]
        slope = rng.uniform(-0.004, 0.004)  # a negative one: positions that seem to lower a step's time
        ys = [0.018 + 0.0015 * x[1] + slope * x[2] + rng.gauss(0, 0.001) for x in xs]
        xx = [[sum(x[i] * x[j] for x in xs) for j in range(3)] for i in range(3)]
        xy = [sum(x[i] * y for x, y in zip(xs, ys)) for i in range(3)]
        prior = [1e-3, 1e-3, 1e-6 * 1024]
        got = _solve(xx, xy, prior)
        ridge = [(RIDGE * xx[i][i]) ** 0.5 for i in range(3)]
        a = [list(x) for x in xs] + [[ridge[i] if j == i else 0.0 for j in range(3)] for i in range(3)]
        want, _ = nnls(a, ys + [ridge[i] * prior[i] for i in range(3)])
        assert min(got) >= 0.0
        assert got == pytest.approx(list(want), rel=1e-6, abs=1e-9), case


def test_positions_that_seem_to_lower_a_step_do_not_raise_the_per_row_cost():
    """A GPU whose partial step (40 positions a row) costs 2 ms more than a full one (590 a row): the best
    fit with positions held at no cost predicts each width's mean step; clamping the unconstrained
    solution's negative position term left the per-row term it had compensated (~5 % high at 16 rows)."""
    rng = random.Random(0)
    cost = StepCost()
    for _ in range(400):
        n = rng.choice([1, 2, 4, 6, 8, 12, 16])
        full = rng.random() < 0.3
        cost.observe(0.018 + 0.0015 * n + (0.0 if full else 0.002 + 0.0002 * n) + rng.gauss(0, 0.001),
                     n, n * (590 if full else 40))
    assert cost.per_position == 0.0
    for n in (1, 4, 8, 16):
        mean = 0.018 + 0.0015 * n + 0.7 * (0.002 + 0.0002 * n)  # 70 % of steps partial
        assert cost.step(n) == pytest.approx(mean, rel=0.02), n
