"""When a queued request joins the running rows: the step-cost model and the ``--admission`` rules.

``always``: a queued request joins at the next step whenever fewer than ``--max-batch`` rows run
(continuous batching as vLLM and SGLang do it). ``fcfs``: batches in arrival order: an idle engine
takes the queue's head and the queued requests of its group, and no request joins them until they
have all left (``--batching static``, dInfer's demo server). ``auto`` (the default): a request
joins when that lowers the expected sum of completion times, by the model below; otherwise it waits
and starts with the next group (docs/SERVING.md gives the model and its evidence).

The model. A step of a run whose rows are in step (at the same step of their blocks) costs
``t = base + per_row·rows + per_position·positions`` seconds (``positions``: the positions the step's
forwards computed, ``StepRecord.computed`` summed over its rows; a joining row's first full forward
computes its whole canvas, so its cost is in the last term). :class:`StepCost` fits the three
coefficients by exponentially weighted least squares over those steps (a ridge term keeps them
defined while the rows do not vary), and keeps apart the *mixed* steps, of rows at different steps of
their blocks (a row that joined mid-block), which cost more (two rows 1.9× one, against 1.5× in
step, on one CPU thread). The curves never fall as the rows grow (a count's mean is over the steps it
happened to run, and one with more block starts among them can lie above a larger count's). A running
row still needs ``remaining`` steps, the mean over the last finished rows of its group whose prompts
were nearest its own in length that ran longer than it has (:class:`StepHistory`), and is at a
``phase`` of its block. :func:`joins` / :func:`admit` compare, for the queue's head, the sum of the
completion times of the running rows and the head (and, for a join in step, of the requests queued
behind it) between "join now" and "start when the running rows have left". On one CPU thread a
step's time grows about in proportion to its rows, so a request of the size of the running ones
waits mid-block (sharing mixed steps would slow the running rows by more than it saves the joiner),
joins at their block start, and a short one joins long ones (:func:`ends_first`: a request expected
to end before the running rows joins them, also from behind a held head); on a GPU below its compute
bound ``base`` dominates and a request joins at once. ``bench/admission_model.py`` runs these rules
on a modelled engine.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable

MODES = ("always", "fcfs", "auto")
#: Positions are counted in units of this many in the least-squares fit (keeps its terms of one scale).
POSITION_UNIT = 1024.0
#: A step's weight decays by this factor with each newer step of the same row count (~100 steps a count).
FORGET = 0.99
#: Ridge weight that pulls the fit toward its prior while the steps do not vary enough to fix it.
RIDGE = 1e-4
#: Weight (≈ steps) of a group's steps at a row count before their mean replaces the fit's
#: (:meth:`StepCost.curve`): eight steps (0.99-decayed weights sum to 7.7), a quarter of a 32-step block,
#: so that one block start's full forwards do not set the level alone.
MIN_SEEN = 7.5
#: A step counts at most this many times the mean of its kind (group, rows, mixed) once that is
#: :data:`MIN_SEEN`: a block start's full forwards take up to ~4× a partial step, while a step the
#: machine's other work stalled (a shared CPU) can take 40×, and would set a mean of a few steps alone.
CLIP = 8.0
#: Finished rows per group remembered for the expected remaining steps.
HISTORY = 64
#: Remembered rows, those of prompt lengths nearest a request's, whose steps predict its own
#: (:meth:`StepHistory.like`): an eighth of :data:`HISTORY`, few enough that a kind of request with a
#: few rows of its own in the history is predicted from them, enough for its lengths' spread.
NEIGHBOURS = 8
#: A step of rows at different steps of their blocks (``mixed``) over one of as many rows in step, until
#: measured: the embedded model on one CPU thread, 2 rows, 5.6 ms mixed against 4.4 ms in step (means
#: over a ``bench/serve_sim.py`` mixed-length pass each of ``always`` and ``fcfs``).
MIXED_PRIOR = 1.25


class StepCost:
    """The running estimate of a step's seconds: ``base + per_row·rows + per_position·positions``.

    :meth:`observe` adds one step. The steps are kept per row count, each count's exponentially
    weighted (:data:`FORGET` per newer step of that count), so the widths the engine runs most do not
    wash out the others (the warm-up's, say) and the three terms stay defined while the load runs at
    one width; the coefficients solve the weighted least squares over every count with a ridge of
    each term's own scale (:data:`RIDGE`) toward the prior, each term ≥ 0 (:func:`_solve`). The prior
    (seconds): 1 ms a step, 1 ms a row, 1 µs a position, until the warm-up's steps replace it. :meth:`step` predicts a
    step of ``n`` rows at the positions such steps computed (each count's weighted mean; between and
    beyond the counts seen, by the straight line through the nearest two).

    Rows that started together stay at the same step of their blocks; a row that joined later is at
    another, and a step of such *mixed* rows costs more than one of as many rows in step (its partial
    forward runs at the widest row's targets, and each row's block start and refreshes run as forwards
    of their own). Mixed steps are kept apart: they do not enter the fit, and :meth:`curve` prices them
    as the aligned curve times :meth:`mixed_ratio`, measured against the fit's expectation of each step."""

    def __init__(self, prior: tuple[float, float, float] = (1e-3, 1e-3, 1e-6)):
        self.prior = [prior[0], prior[1], prior[2] * POSITION_UNIT]
        self._by_rows: dict[int, list] = {}  # rows -> [xx (3×3), xy (3), weight, weighted positions]
        self.steps = 0
        self.coef = list(self.prior)
        # group -> (rows, mixed) -> [weight, weighted seconds, weighted positions]
        self._groups: dict[object, dict[tuple[int, bool], list[float]]] = {}
        self._all: dict[tuple[int, bool], list[float]] = {}  # the same over every group
        # what :meth:`curve` and :meth:`positions` answered since the last step observed: a decision asks
        # for the same few curves hundreds of times, and on one CPU thread its time delays the next step
        self._memo: dict = {}

    def observe(self, seconds: float, rows: int, positions: float, group=None, joins: float = 0.0,
                mixed: bool = False) -> None:
        """One step of ``rows`` rows that computed ``positions`` positions in ``seconds`` (of a run of
        ``group``: its own steps are also kept per row count, :meth:`curve`, less ``joins``, the seconds
        its joining rows' first full forwards are charged apart). ``mixed``: its rows were not all at
        the same step of their blocks (kept apart from the fit)."""
        self._memo.clear()
        own = max(seconds - joins, 0.0)
        # the positions those first forwards computed come out with their seconds (priced per position)
        left = max(positions - joins / self.per_position, 0.0) if joins and self.per_position > 0 else positions
        for table in ([self._all] + ([self._groups.setdefault(group, {})] if group is not None else [])):
            w, t, p = table.get((rows, mixed), (0.0, 0.0, 0.0))
            cut = min(own, CLIP * t / w) if w >= MIN_SEEN else own
            table[(rows, mixed)] = [FORGET * w + 1.0, FORGET * t + cut, FORGET * p + left]
        if mixed:
            return
        x = (1.0, float(rows), positions / POSITION_UNIT)
        xx, xy, w, pos = self._by_rows.get(rows) or ([[0.0] * 3 for _ in range(3)], [0.0] * 3, 0.0, 0.0)
        for i in range(3):
            xy[i] = FORGET * xy[i] + x[i] * seconds
            for j in range(3):
                xx[i][j] = FORGET * xx[i][j] + x[i] * x[j]
        self._by_rows[rows] = [xx, xy, FORGET * w + 1.0, FORGET * pos + positions]
        self.steps += 1
        sxx = [[sum(b[0][i][j] for b in self._by_rows.values()) for j in range(3)] for i in range(3)]
        sxy = [sum(b[1][i] for b in self._by_rows.values()) for i in range(3)]
        self.coef = _solve(sxx, sxy, self.prior)

    @property
    def base(self) -> float:
        """Seconds a step costs whatever its rows."""
        return self.coef[0]

    @property
    def per_row(self) -> float:
        """Seconds each row adds to a step."""
        return self.coef[1]

    @property
    def per_position(self) -> float:
        """Seconds each computed position adds to a step."""
        return self.coef[2] / POSITION_UNIT

    def positions(self, rows: int) -> float:
        """The positions a step of ``rows`` rows computes, from the steps seen (0 before any)."""
        if ("positions", rows) not in self._memo:
            self._memo[("positions", rows)] = self._positions(rows)
        return self._memo[("positions", rows)]

    def _positions(self, rows: int) -> float:
        if "rising" not in self._memo:
            self._memo["rising"] = _rising([(n, b[2], b[3]) for n, b in sorted(self._by_rows.items()) if b[2] > 0])
        seen = self._memo["rising"]
        if not seen:
            return 0.0
        if len(seen) == 1:
            n, p = seen[0]
            return p * rows / n
        lo = max([s for s in seen if s[0] <= rows] or seen[:1], key=lambda s: s[0])
        hi = min([s for s in seen if s[0] > rows] or seen[-1:], key=lambda s: s[0])
        if lo[0] == hi[0]:  # beyond the counts seen: the line through the nearest two of different means
            edge = lo
            other = [p for p in seen if p[1] != edge[1]]
            if not other:  # one level throughout: in proportion to the rows, from the nearest count
                return edge[1] * rows / edge[0]
            lo, hi = sorted([edge, min(other, key=lambda p: abs(p[0] - edge[0]))])
        slope = (hi[1] - lo[1]) / (hi[0] - lo[0])
        return max(lo[1] + slope * (rows - lo[0]), 0.0)

    def step(self, rows: int) -> float:
        """The expected seconds of a step of ``rows`` rows (0 for none), by the fit."""
        if rows <= 0:
            return 0.0
        return self.base + self.per_row * rows + self.per_position * self.positions(rows)

    def seen(self, group, rows: int, mixed: bool = False) -> bool:
        """Whether runs of ``group`` have stepped ``rows`` rows (``mixed`` or in step) often enough
        (:data:`MIN_SEEN` steps) for :meth:`curve` to use their own time."""
        return self._groups.get(group, {}).get((rows, mixed), (0.0,))[0] >= MIN_SEEN

    def mixed_measured(self) -> bool:
        """Whether :meth:`mixed_ratio` rests on measured steps (at some count, :data:`MIN_SEEN` mixed
        steps and as many in step), not on :data:`MIXED_PRIOR`."""
        return any(m and _both_seen(self._all, n) for n, m in self._all)

    def mixed_ratio(self, rows: int, group=None) -> float:
        """A mixed step of ``rows`` rows over one of as many rows in step (≥ 1), each kind's seconds taken
        over what the fit expects of its steps' rows and positions: the group's own at that
        count when it has run both there (:data:`MIN_SEEN` steps each), else every group's at the nearest
        count where both were seen; :data:`MIXED_PRIOR` before. Against the fit, because the mixed steps a
        server runs are not a fair sample of its steps: ``auto`` joins mid-block mostly beside a row near
        its end, whose steps compute fewer positions (2 rows: 56 positions a mixed step against 66 in step,
        one CPU thread), so their mean per step priced a mixed step at 1.00-1.07× one in step where
        ``always``'s, which mixes every phase, measured 1.15×."""
        own = self._groups.get(group, {})
        if _both_seen(own, rows):
            return self._over_fit(own, rows)
        both = [n for (n, m) in self._all if m and _both_seen(self._all, n)]
        if not both:
            return MIXED_PRIOR
        return self._over_fit(self._all, min(both, key=lambda k: (abs(k - rows), k)))

    def _over_fit(self, table: dict, rows: int) -> float:
        """At ``rows`` rows in ``table``: the mixed steps' seconds over what the fit expects of their rows
        and positions, over the same for the steps in step (≥ 1)."""
        def over(mixed: bool) -> float:
            w, t, p = table[(rows, mixed)]
            return t / max(w * (self.base + self.per_row * rows) + self.per_position * p, 1e-12)

        return max(over(True) / max(over(False), 1e-12), 1.0)

    def curve(self, group, rows: int, mixed: bool = False) -> float:
        """The expected seconds of a step of ``rows`` rows of a run of ``group`` (``mixed``: not all
        at the same step of their blocks): for a mixed step, the step in step times :meth:`mixed_ratio`. In step:
        the group's own steps at that count when :meth:`seen`; else its own at the nearest count seen,
        scaled by the fit's ratio between the two counts (the fit gives the shape, the group its level:
        a long prompt's steps cost more than the positions they compute say); else the fit."""
        if rows <= 0:
            return 0.0
        key = ("curve", group, rows, mixed)
        if key not in self._memo:
            self._memo[key] = self._curve(group, rows, mixed)
        return self._memo[key]

    def _curve(self, group, rows: int, mixed: bool) -> float:
        if mixed and rows > 1:
            return self.curve(group, rows) * self.mixed_ratio(rows, group)
        if ("own", group) not in self._memo:
            self._memo[("own", group)] = self._own(group)
        own = self._memo[("own", group)]
        if rows in own:
            return own[rows]
        if not own:
            return self.step(rows)
        lo = max((n for n in own if n < rows), default=None)
        hi = min((n for n in own if n > rows), default=None)
        if lo is None or hi is None:  # beyond the counts it has run: the nearest one's level, the fit's shape
            near = hi if lo is None else lo
            return own[near] * self.step(rows) / max(self.step(near), 1e-12)
        # between two counts it has run: from one level to the other along the fit's shape, so that a
        # step of more rows never costs less (each count's level scaled alone can fall below the
        # other's, and the rows between would look free)
        span = self.step(hi) - self.step(lo)
        frac = (self.step(rows) - self.step(lo)) / span if span > 0 else (rows - lo) / (hi - lo)
        return own[lo] + (own[hi] - own[lo]) * frac

    def _own(self, group) -> dict[int, float]:
        """The group's own in-step step seconds per row count it has run (:meth:`seen`), kept growing
        with the rows: a count's mean over a few steps moves with the machine's other work, and a mean
        below a smaller count's would make the rows between them look free (a stalled step at 3 rows
        pricing 4 below 3). Counts whose means fall as the rows grow are pooled (pool-adjacent-violators,
        each count weighted by its steps), and a pooled run of counts takes the fit's shape at the
        pooled level: its seconds over the fit's for the same steps."""
        blocks: list[list] = []  # [counts, weight, weighted seconds, the fit's weighted seconds]
        for (n, m), (w, t, _) in sorted(self._groups.get(group, {}).items()):
            if m or w < MIN_SEEN:
                continue
            blocks.append([[n], w, t, w * self.step(n)])
            while len(blocks) > 1 and blocks[-2][2] / blocks[-2][1] > blocks[-1][2] / blocks[-1][1]:
                counts, w2, t2, f2 = blocks.pop()
                blocks[-1][0] += counts
                blocks[-1][1] += w2
                blocks[-1][2] += t2
                blocks[-1][3] += f2
        own: dict[int, float] = {}
        for counts, w, t, fit in blocks:
            for n in counts:
                own[n] = t / w if len(counts) == 1 else t / max(fit, 1e-12) * self.step(n)
        return own


def _both_seen(table: dict, rows: int) -> bool:
    """Whether ``table`` ((rows, mixed) -> [weight, weighted seconds, weighted positions]) has
    :data:`MIN_SEEN` steps of ``rows`` rows both mixed and in step."""
    return all(table.get((rows, m), (0.0,))[0] >= MIN_SEEN for m in (True, False))


def _rising(points: list[tuple[int, float, float]]) -> list[tuple[int, float]]:
    """(count, mean) per count from ``(count, weight, weighted sum)`` in rising count order, kept
    non-decreasing: counts whose means fall as the count grows are pooled (pool-adjacent-violators,
    each weighted by its weight) and all take the pooled mean. A step of more rows computes at least
    the positions of one of fewer; a count's mean over the steps it happened to run (one count's with
    more block starts and full forwards among them) can say otherwise, and a line through two such
    means would make the rows beyond them cost nothing."""
    blocks: list[list] = []  # [counts, weight, weighted sum]
    for n, w, t in points:
        blocks.append([[n], w, t])
        while len(blocks) > 1 and blocks[-2][2] / blocks[-2][1] > blocks[-1][2] / blocks[-1][1]:
            counts, w2, t2 = blocks.pop()
            blocks[-1][0] += counts
            blocks[-1][1] += w2
            blocks[-1][2] += t2
    return [(n, t / w) for counts, w, t in blocks for n in counts]


def _solve(xx, xy, prior) -> list[float]:
    """The θ ≥ 0 that minimises θᵀAθ − 2bᵀθ, A = xx + RIDGE·D and b = xy + RIDGE·D·prior, D the diagonal
    of xx (a ridge of each term's own scale): non-negative least squares over the normal equations. Each
    set of free terms (the others held at 0) is solved exactly and the best non-negative solution kept,
    since the optimum solves the equations of its own free terms. Clamping an unconstrained solution
    instead keeps the other terms at values that made up for the negative one (a GPU's partial step can
    cost as much as a full one: positions then seem to lower a step's time, and the per-row term rises
    to compensate). The prior when nothing was observed."""
    d = [max(xx[i][i], 1e-12) for i in range(3)]
    a = [[xx[i][j] + (RIDGE * d[i] if i == j else 0.0) for j in range(3)] for i in range(3)]
    b = [xy[i] + RIDGE * d[i] * prior[i] for i in range(3)]
    if all(xx[i][i] <= 0.0 for i in range(3)):
        return list(prior)
    best, best_value = [0.0, 0.0, 0.0], 0.0  # all terms held at 0: the objective is 0
    for free in ([0, 1, 2], [0, 1], [0, 2], [1, 2], [0], [1], [2]):
        sub = _gauss([[a[i][j] for j in free] for i in free], [b[i] for i in free])
        if sub is None or min(sub) < 0.0:
            continue
        theta = [0.0, 0.0, 0.0]
        for i, v in zip(free, sub):
            theta[i] = v
        value = sum(theta[i] * a[i][j] * theta[j] for i in range(3) for j in range(3)) \
            - 2.0 * sum(t * v for t, v in zip(theta, b))
        if value < best_value:
            best, best_value = theta, value
    return best


def _gauss(a: list[list[float]], b: list[float]) -> list[float] | None:
    """The solution of the square system ``a x = b`` by Gaussian elimination with partial pivoting (None
    when singular)."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-18:
            return None
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [v - f * w for v, w in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


class StepHistory:
    """How many steps the rows of each group took (the last :data:`HISTORY` that finished with an
    answer), each with its prompt's length in tokens.

    A request's length is not known until it ends, but its prompt's is known when it arrives, and the
    two go together where a group mixes kinds of requests (a short list task and a word problem share
    one batching group, yet answer in ~1 block and up to 4). So a request of ``prompt`` tokens is
    predicted from the :data:`NEIGHBOURS` remembered rows whose prompts are nearest its own (every row
    as near as the last of them counts, so ties do not depend on order), not from all of its group's
    rows. Where prompt length says nothing (requests of one kind), the nearest rows are a sample of
    the same lengths, and with at most :data:`NEIGHBOURS` rows remembered they are all of them."""

    def __init__(self):
        self._steps: dict[object, collections.deque[tuple[int, int | None]]] = {}
        # (key, prompt) -> the steps its neighbours took; cleared when a row finishes (a decision asks
        # for the same few prompts at every step, on the engine thread between two steps)
        self._memo: dict[tuple, list[int]] = {}

    def finished(self, key, steps: int, prompt: int | None = None) -> None:
        """A row of group ``key`` whose prompt had ``prompt`` tokens (None: not known) finished its
        answer after ``steps`` steps."""
        self._steps.setdefault(key, collections.deque(maxlen=HISTORY)).append((steps, prompt))
        self._memo.clear()

    def like(self, key, prompt: int | None = None) -> list[int]:
        """The steps taken by the remembered rows of ``key`` that predict a request of ``prompt``
        tokens: those with the :data:`NEIGHBOURS` nearest prompt lengths, ties at the farthest of them
        included; every remembered row when ``prompt`` is None or fewer than :data:`NEIGHBOURS` rows
        have a known prompt length; ``[]`` with no history."""
        seen = self._steps.get(key)
        if not seen:
            return []
        if (key, prompt) in self._memo:
            return self._memo[(key, prompt)]
        known = sorted((abs(p - prompt), s) for s, p in seen if p is not None) if prompt is not None else []
        if len(known) < NEIGHBOURS:
            out = [s for s, _ in seen]
        else:
            cut = known[NEIGHBOURS - 1][0]
            out = [s for d, s in known if d <= cut]
        self._memo[(key, prompt)] = out
        return out

    def remaining(self, key, done: int, bound: int, per_block: int, prompt: int | None = None) -> float:
        """Expected steps a row of ``key`` (a prompt of ``prompt`` tokens) still runs after ``done``:
        the mean over the rows that predict it (:meth:`like`) that ran longer, less ``done``; with
        none, to the end of its current block (of ``per_block`` steps); with no history, to ``bound``
        (its canvas's steps)."""
        seen = self.like(key, prompt)
        if not seen:
            return float(max(bound - done, 1))
        longer = [s for s in seen if s > done]
        if longer:
            return sum(longer) / len(longer) - done
        return float(max(per_block - done % per_block, 1))

    def sizes(self, key, bound: int, k: int = 8, prompt: int | None = None) -> list[float]:
        """Up to ``k`` evenly spaced quantiles of the steps taken by the rows that predict a request
        of ``prompt`` tokens (:meth:`like`; its length is one of them, each as likely); ``[bound]``
        with no history."""
        seen = sorted(self.like(key, prompt))
        if not seen:
            return [float(bound)]
        n = min(k, len(seen))
        return [float(seen[(2 * i + 1) * len(seen) // (2 * n)]) for i in range(n)]


@dataclasses.dataclass
class Row:
    """A row as :func:`admit` sees it: ``remaining`` expected steps; ``group`` (its run's group: rows
    of one group share a step, each group steps in turn); ``phase``: the step of its block it runs
    next (a joining row: 0). Rows of one group at one phase stay in step; a group whose live rows are
    at several phases steps *mixed* (:meth:`StepCost.curve`)."""

    remaining: float
    group: object
    phase: int = 0


def completions(rows: list[Row], step: Callable[..., float], first: float = 0.0,
                start: float = 0.0) -> tuple[float, float]:
    """(sum of the rows' completion times, when the last ends), all starting at ``start``, their groups
    stepped round-robin: a round costs ``step(group, n)`` for each group with ``n`` rows left, at one
    phase, or ``step(group, n, True)`` when they are at several (mixed); the first round ``first``
    more (a joining row's full forward)."""
    if not rows:
        return 0.0, start
    order = sorted(rows, key=lambda r: r.remaining)
    alive = collections.Counter((r.group, r.phase) for r in order)

    def round_cost() -> float:
        by_group: dict[object, list[int]] = {}
        for (g, _), n in alive.items():
            by_group.setdefault(g, []).append(n)
        return sum(step(g, sum(ns), True) if len(ns) > 1 else step(g, ns[0]) for g, ns in by_group.items())

    t, done_steps, total = start + first, 0.0, 0.0
    for r in order:
        span = max(r.remaining, 1.0) - done_steps
        if span > 0:
            t += span * round_cost()
            done_steps += span
        total += t
        alive[(r.group, r.phase)] -= 1
        if not alive[(r.group, r.phase)]:
            del alive[(r.group, r.phase)]
    return total, t


def admit(running: list[Row], head: Row | list[Row], join_cost: float, behind: int,
          step: Callable[..., float], arrivals: float = 0.0) -> bool:
    """Whether the queue's ``head`` should join the ``running`` rows now (``auto``).

    ``head``: the head's row, or its equally likely versions (one per length its group's rows have
    taken: a request's length is not known until it ends), over which the sums are averaged (so a
    group of short and long answers counts what joining saves a short one, not what it would save
    one of the mean length).
    ``join_cost``: seconds its first full forward adds to the step it joins; ``behind``: requests
    queued after it; ``arrivals``: requests arriving per second (recent); ``step(group, n[, mixed])``:
    the expected seconds of a step of ``n`` rows of a run of ``group``, mixed or in step
    (:meth:`StepCost.curve`). The head joins at phase 0: in step with the running rows of its group
    only when they are at the start of a block, mixed otherwise, for as long as both live.
    Compares the sum of completion times between joining now and starting once the running rows have
    left, of the running rows, the head, and the requests after it (those queued behind it, and those
    expected to arrive before the running rows end). For a join in step they start after the last row
    ends in either schedule, and each counts that end once, so what sharing steps saves in fixed
    per-step cost counts for them. For a join mid-block, as many rows of the head's length (rounded)
    either join mixed with it now or start in step with it when the running rows have left: on a GPU
    the wait they would share decides for joining (four rows mid-block, 20 ms a step: the head alone
    waits, two behind it join), on one CPU thread the mixed steps decide against it (the modelled
    engine of ``bench/admission_model.py``: ``auto`` within 0.4 % of the better mode in both).
    Joins when the first sum is no larger (always, when nothing runs)."""
    if not running:
        return True
    heads = head if isinstance(head, list) else [head]
    alone, end_running = completions(running, step)
    mixed = bool({r.phase for r in running if r.group == heads[0].group} - {heads[0].phase})
    expected_later = behind + arrivals * end_running
    later = 0.0 if mixed else expected_later
    extra = int(round(expected_later)) if mixed else 0
    diff = 0.0
    # equal versions of the head counted once each, times how often they occur: on one CPU thread the
    # decision's own time delays the next step, and a group's lengths repeat
    versions = collections.Counter((h.remaining, h.group, h.phase) for h in heads)
    for (remaining, group, phase), times in versions.items():
        new_rows = [Row(remaining, group, phase)] * (1 + extra)
        joined, end_joined = completions(running + new_rows, step, first=join_cost * len(new_rows))
        mine, end_waited = completions(new_rows, step, first=join_cost * len(new_rows), start=end_running)
        diff += times * ((joined + later * end_joined) - (alone + mine + later * end_waited))
    return diff <= 0 or not math.isfinite(diff)


def ends_first(running: list[Row], sizes: list[float]) -> bool:
    """Whether a request of the equally likely lengths ``sizes`` (steps) is expected to end before the
    ``running`` rows do: its mean length below the longest running row's ``remaining``. Such a request
    joins (shortest expected work first, as SRPT orders it; it also joins from behind a held head, as a
    backfilled job does: it ends before the rows the head waits for, so it takes nothing from the head
    but the share of their steps it uses). Where a step's time grows in proportion to its rows (a CPU
    thread) the expected sum of completion times is about the same either way, and this is what lets a
    short request past long ones; on one-size workloads no request is shorter than what runs, so it
    never applies. False when nothing runs."""
    if not running or not sizes:
        return False
    return sum(sizes) / len(sizes) < max(r.remaining for r in running)


def joins(running: list[Row], group, sizes: list[float], join_cost: float, behind: int, cost: StepCost,
          arrivals: float = 0.0) -> bool:
    """``auto``'s decision for the queue's head, of ``group``, while ``running`` rows run: join now?

    ``sizes``: the steps taken by its group's rows of prompts nearest its own in length
    (:meth:`StepHistory.sizes`: its equally likely lengths); ``join_cost``, ``behind``, ``arrivals``
    as :func:`admit`, which decides by ``cost``'s curves. Before that, a head joins that would join its
    group's rows at the start of their blocks (in step) at a width the group has not run
    (:meth:`StepCost.seen`), or mid-block beside rows all at one phase while no mixed step has been
    measured (:meth:`StepCost.mixed_measured`), so that the next decision rests on measured steps rather
    than on the fit's shape or the mixed prior alone (one such join makes the mixed steps it needs; a
    third phase would spread them over more row counts, and on one CPU thread up to 10 heads a pass joined
    so before the first count was measured); and a head expected to end before the running rows
    (:func:`ends_first`) joins."""
    mine = [r for r in running if r.group == group]
    n = len(mine) + 1
    if n > 1 and all(r.phase == 0 for r in mine) and not cost.seen(group, n):
        return True
    phases = {r.phase for r in mine}
    if len(phases) == 1 and 0 not in phases and not cost.mixed_measured():  # one phase, mid-block
        return True
    if ends_first(running, sizes):
        return True
    return admit(running, [Row(s, group) for s in sizes], join_cost, behind, cost.curve, arrivals)
