"""The engine loop of ``ecache serve``: one thread owns the model and batches requests step by step.

Rows and groups. A request is one row of a run (``engine/core.py`` ``Run``). Rows of one run share
its ``DecodeConfig``, its policy object and its canvas width, so a request joins a run only of its
*group*: equal decode settings (gen length = ``max_tokens`` rounded up to whole blocks, block length,
steps, threshold, temperature, top-p, ignore_eos), equal cache policy and parameters (τ ...), and
equal prompt width bucket (the prompt's tokens rounded up to a multiple of :data:`PROMPT_BUCKET`).
The seed is per row (:class:`RequestStreams`), so it never splits a group. Each policy keeps its
state per row, so every row makes its own cache decisions whatever else runs beside it.

Admission (``--admission``, ``admission.py``). Between two steps the loop moves queued requests
(first come, first served, while fewer than ``--max-batch`` rows run) into the newest run of their
group with :meth:`Run.add` (they join at that run's next step, with their own full forward, in a free
row slot of the run's KV store, whose buffers grow by doubling up to ``--max-batch`` rows:
``kvstore.py``) or start a new run for them. ``always`` moves the head whenever there is room;
``auto`` (the default) moves it when :func:`~ecache_cli.serve.admission.joins` finds that lowers the
expected sum of completion times under the step-cost model the loop fits to its own steps (else the
head waits, and everything behind it, and is simulated again only once something the decision rests
on changes: :meth:`Scheduler._hold_key`), and an idle engine takes what waits as one batch, whose rows
start together and so stay at the same step of their blocks (a row that joins mid-block widens every
partial forward of its run to its own targets); ``fcfs`` (``--batching static``, the baseline of
``bench/serve_load.py``) takes, when no run is active, the first queued request and up to
``--max-batch`` − 1 more of its group in queue order, and runs them to completion before taking more
(dInfer's demo server). Runs of different groups are stepped round-robin, one denoising step each, by
this one thread. A row leaves its run right after the step that finished it (end of answer,
``max_tokens``, a stop string, a client that went away, ``--request-timeout``, or the end of the
shutdown grace), through ``record.finished`` (``docs/ARCHITECTURE.md``, "Row lifecycle"). A run takes
at most :data:`RUN_ROW_LIMIT` rows over its life (its ledger keeps every row), then its group starts a
new run for later requests.

With a prefix store (docs/SERVING.md, "Prefix reuse"), a request admitted with others whose prompt
shares a prefix with an earlier one's that is not stored yet joins one step after it, once its first
step has stored that prefix (:meth:`Scheduler._defers`), so rows admitted together do not all miss.

Before it serves, the loop warms up (:meth:`Scheduler.start` with warm-up jobs): a few steps of one
row and of several rows, which also give the step-cost model its first points; ``ready`` is set then
(``GET /health/ready``).

Results go back to the asyncio side through :class:`Job` events (``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from typing import Callable

import torch

from .. import interrupts
from ..cache.base import ReusedPrefix
from ..console import err
from ..decoding.config import DecodeConfig
from ..decoding.streams import RowStreams, row_generator
from ..engine.core import Engine
from ..runs.final_text import cut_answer, final_lengths, streamable, unsettled
from .admission import MODES, Row, StepCost, StepHistory, ends_first, joins

#: Seconds a failed warm-up waits for the server's stop before reporting the failure (a Ctrl-C stops
#: the server within a few tenths of a second; a failure of its own is reported after this wait).
STOP_RACE = 0.5

#: Prompt widths are rounded up to a multiple of this many tokens, so prompts of similar length share a run.
PROMPT_BUCKET = 64
#: Rows one run takes over its life before its group starts a fresh run (bounds the run's ledger).
RUN_ROW_LIMIT = 512
#: Recent arrivals the arrival rate of ``auto`` admission is measured over.
ARRIVALS = 16
#: Steps of each warm-up run (:meth:`Scheduler.start`).
WARMUP_STEPS = 8
#: Finish reasons beyond OpenAI's ``stop`` and ``length``.
TIMEOUT, CANCELLED, SHUTDOWN = "timeout", "cancelled", "shutdown"


@dataclasses.dataclass(frozen=True)
class GroupKey:
    """What rows must share to be in one run: decode settings, policy and its parameters, prompt width."""

    cfg: DecodeConfig
    policy: str
    params: tuple
    prompt_width: int

    def __hash__(self) -> int:
        # Computed once per key: ``auto``'s every decision looks its groups up in dicts thousands of
        # times, on the engine thread between two steps. Not pickled (a string's hash is per process).
        if "_hash" not in self.__dict__:
            object.__setattr__(self, "_hash", hash((self.cfg, self.policy, self.params, self.prompt_width)))
        return self.__dict__["_hash"]

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}


@dataclasses.dataclass
class Event:
    """A message from the engine thread to a request's handler. ``kind``: ``delta`` (``text``: newly
    final answer text, streaming only), ``done`` (``result``: the :class:`Result`) or ``error``
    (``status`` HTTP status, ``text`` message)."""

    kind: str
    text: str = ""
    result: "Result | None" = None
    status: int = 500


@dataclasses.dataclass
class Result:
    """A finished request: ``text`` (the answer, cut at ``max_tokens`` and before a stop string),
    ``finish_reason`` (stop, length, timeout, cancelled, shutdown), ``prompt_tokens``,
    ``completion_tokens`` (the tokens of the text returned: up to a stop string, when one cut it) and
    ``stats`` (the row's nfe, full_forwards, partial_forwards, refresh_share, gen_length, steps, policy,
    group_rows: rows its run held when it left)."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict


@dataclasses.dataclass(eq=False)
class Job:
    """One request on its way through the engine.

    Set by the handler: ``endpoint`` (``completions`` | ``chat``), ``prompt_ids`` (token ids),
    ``key`` (its :class:`GroupKey`), ``make_policy`` (a fresh policy object for a new run),
    ``max_tokens`` (the answer's cut), ``stop`` (strings that end the answer, not returned),
    ``stream``, ``seed`` (its random stream: ``row_generator(seed, 0)``, as ``ecache generate --seed``
    gives the first prompt), ``timeout`` (seconds from arrival, None: none).
    The engine thread fills the rest; ``cancelled`` is set by the handler when the client goes away.
    """

    endpoint: str
    prompt_ids: list[int]
    key: GroupKey
    make_policy: Callable[[], object]
    max_tokens: int
    stop: list[str]
    stream: bool
    seed: int
    timeout: float | None = None
    request_id: str = ""  # the HTTP request's x-request-id (logs)
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    cancelled: bool = False
    done: bool = False
    # engine-side progress
    uid: int = -1
    seen: int = 0  # answer positions already final (no mask before them) at the last check
    text: str = ""
    n_answer: int = 0
    reason: str | None = None
    sent: str = ""  # streamed so far
    first_token_at: float | None = None
    in_run: bool = False
    steps: int = 0  # denoising steps its row has run
    held: bool = False  # auto admission kept it waiting at least once
    _loop: asyncio.AbstractEventLoop | None = None
    _events: asyncio.Queue | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver this job's events to ``loop`` (the handler's event loop)."""
        self._loop, self._events = loop, asyncio.Queue()

    async def next_event(self, timeout: float) -> Event | None:
        """The next event, or None after ``timeout`` seconds without one."""
        try:
            return await asyncio.wait_for(self._events.get(), timeout)
        except asyncio.TimeoutError:
            return None

    def post(self, event: Event) -> None:
        """Hand ``event`` to the handler (from any thread); a closed loop (server gone) drops it."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:
            pass

    def update(self, ids: list[int], end_ids: set[int], decode: Callable[[list[int]], str]) -> None:
        """Read the answer's final prefix ``ids`` (generated positions before the first mask): set
        ``text``, ``n_answer`` and, when the answer is decided, ``reason`` (``runs/final_text.cut_answer``:
        ``stop`` at an end token or stop string, ``length`` at ``max_tokens``)."""
        self.text, reason, self.n_answer = cut_answer(ids, end_ids, decode, self.max_tokens, self.stop)
        if reason is not None:
            self.reason = reason

    def streamable(self) -> str:
        """The part of ``text`` that can be sent now (``runs/final_text.streamable``)."""
        return streamable(self.text, self.reason, self.stop)


class RequestStreams(RowStreams):
    """Each row's random stream from its request's seed: row ``uid`` draws from
    ``row_generator(seeds[uid], 0)``, what ``ecache generate --seed S`` gives its first prompt."""

    def __init__(self, device):
        super().__init__(0, device)
        self.seeds: dict[int, int] = {}
        self._by_uid: dict[int, torch.Generator] = {}

    def generator(self, row_id: int) -> torch.Generator:
        if row_id not in self._by_uid:
            self._by_uid[row_id] = row_generator(self.seeds[row_id], 0, self.device)
        return self._by_uid[row_id]

    def forget(self, row_id: int) -> None:
        """Drop a finished row's stream."""
        self._by_uid.pop(row_id, None)
        self.seeds.pop(row_id, None)


class _Group:
    """One run and the jobs of its rows (by run row index); ``reuse``: its rows read and fill the prefix
    store (its policy is wrapped in ``ReusedPrefix``)."""

    def __init__(self, key: GroupKey, run, joinable: bool, reuse: bool = False):
        self.key, self.run, self.joinable, self.reuse = key, run, joinable, reuse
        self.it = iter(run)
        self.jobs: dict[int, Job] = {}
        self.streams = RequestStreams(run.engine.device)
        run.streams = self.streams

    def add(self, job: Job, r: int) -> None:
        self.jobs[r] = job
        self.streams.seeds[job.uid] = job.seed

    @property
    def accepts(self) -> bool:
        return self.joinable and len(self.jobs) < RUN_ROW_LIMIT


class Scheduler:
    """The queue and the engine thread (module docstring).

    ``lm``: the loaded model. ``metrics``: a :class:`~ecache_cli.serve.metrics.ServeMetrics`.
    ``max_batch``: rows running at once (≥ 1). ``max_queue``: requests waiting (≥ 0; more: 429).
    ``admission``: ``always`` | ``fcfs`` | ``auto`` (module docstring). ``cost`` (a
    :class:`~ecache_cli.serve.admission.StepCost`) is the step-cost estimate ``auto`` decides by, fitted
    to every step the loop runs; ``ready`` is set once the warm-up has run. Start with :meth:`start`,
    end with :meth:`stop`.

    ``clock``: seconds, the one clock the scheduler reads, for a step's seconds (the step-cost model's
    and the metrics'), the arrival rate, timeouts and the shutdown grace; a job's ``arrived`` must be on
    it (the handlers stamp ``time.monotonic``, the default). A clock of one thread's CPU time
    (``bench/serve_sim.py --clock cpu``) needs the loop driven on that thread: :meth:`prepare`, then
    :meth:`iterate` again and again, instead of :meth:`start`.
    """

    def __init__(self, lm, metrics, max_batch: int, max_queue: int, admission: str = "auto", prefix=None,
                 clock: Callable[[], float] = time.monotonic):
        assert admission in MODES, admission
        self.clock = clock
        self.prefix = prefix  # a prefixstore.PrefixStore, or None: no reuse across requests
        self.prefix_frozen = True  # reused positions stay frozen for the whole request (``ReusedPrefix``)
        self.batch_prefix = True  # a job sharing a prefix with one admitted before it waits for its first step
        self._unstepped: list[Job] = []  # jobs in reusing runs whose first step has not run (``_defers``)
        self._deferred: list[Job] = []  # admitted jobs waiting for such a job's first step, counted as running
        self._reuses: dict[GroupKey, bool] = {}  # whether runs of a group reuse stored prefixes
        self.engine = Engine.from_loaded(lm)
        self.tokenizer = lm.tokenizer
        self.end_ids = set(self.engine.end_ids.tolist())
        self.metrics, self.max_batch, self.max_queue, self.admission = metrics, max_batch, max_queue, admission
        self.cost, self.history = StepCost(), StepHistory()
        self._held: tuple | None = None  # ``_hold_key`` of the last head ``auto`` held
        self.ready = threading.Event()
        self.warmup_error: str | None = None  # the warm-up's fault, one line; ``ready`` then stays unset
        self._arrivals: collections.deque[float] = collections.deque(maxlen=ARRIVALS)  # monotonic seconds
        self._warmup: list[Job] = []
        self._cv = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._groups: list[_Group] = []
        self._rr = 0
        self._running = 0
        self._uid = 0
        self._draining = False
        self._grace_end: float | None = None
        self._stopping = False
        self._threads = torch.get_num_threads()  # the engine thread uses the command's --threads
        self._thread = threading.Thread(target=self._main, name="ecache-engine", daemon=True)

    # -- the handlers' side -------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    def counts(self) -> tuple[int, int]:
        """(rows running, requests queued)."""
        with self._cv:
            return self._running, len(self._queue)

    def submit(self, job: Job) -> str | None:
        """Queue ``job``; returns None, or why it is refused: ``queue_full`` or ``unavailable`` (shutting down)."""
        with self._cv:
            if self._draining:
                return "unavailable"
            if len(self._queue) >= self.max_queue and self._running + len(self._queue) >= self.max_batch:
                return "queue_full"
            self._queue.append(job)
            self._arrivals.append(job.arrived)
            self.metrics.queue_depth.set(len(self._queue))
            self._cv.notify()
        return None

    def cancel(self, job: Job) -> None:
        """The client went away: the job's row leaves after its run's next step (queued: at once)."""
        if not job.done:
            job.cancelled = True
            with self._cv:
                self._cv.notify()

    def start(self, warmup: list[Job] | None = None) -> None:
        """Start the engine thread; it first runs :data:`WARMUP_STEPS` steps of ``warmup``'s first job
        alone, then of all of them together (requests built as a client's would be), then sets ``ready``."""
        self._warmup = list(warmup or [])
        self._thread.start()

    def drain(self, grace: float) -> None:
        """Stop taking requests: queued ones end at once with ``shutdown``, running rows get ``grace``
        more seconds to finish, then end with ``shutdown`` (the text decoded so far)."""
        with self._cv:
            self._draining = True
            end = self.clock() + max(grace, 0.0)
            self._grace_end = end if self._grace_end is None else min(self._grace_end, end)
            self._cv.notify()

    def stop(self, timeout: float = 10.0) -> None:
        """End the engine thread (after :meth:`drain` with no grace left) and wait for it up to ``timeout``
        seconds; one still running then (inside a step or a ``--compile`` call, which it cannot leave) is
        recorded with ``interrupts.outlived``, so the command's process ends without tearing it down."""
        self.drain(0.0)
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                interrupts.outlived(self._thread)

    # -- the engine thread --------------------------------------------------------------------------

    def _main(self) -> None:
        # One inference-mode context around every run's steps: the runs' generators are suspended between
        # steps, and their own inference_mode contexts nest inside this one whatever order they end in.
        with torch.inference_mode():
            self.prepare(self._warmup)
            while self.iterate(wait=0.5):
                pass

    def prepare(self, warmup: list[Job] | None = None) -> None:
        """(The engine thread, inside ``torch.inference_mode``.) Set its torch threads, run the warm-up
        of ``warmup`` (as :meth:`start`'s) and set ``ready``, unless the warm-up failed."""
        torch.set_num_threads(self._threads)
        self._warmup = list(warmup or [])
        self._warm_up()
        if self.warmup_error is None:  # a failed warm-up never reports ready (/health/ready stays 503)
            self.ready.set()

    def iterate(self, wait: float = 0.0) -> bool:
        """(The engine thread, inside ``torch.inference_mode``.) One turn of the engine loop: end the
        queued jobs that expired, admit what the admission rule takes, and run one step of the next run,
        round-robin. Returns whether to call it again: False when there was nothing to do (no run,
        nothing taken or deferred), except that with ``wait`` > 0 an idle scheduler that is not stopping
        first waits up to ``wait`` seconds for a request (or :meth:`stop`) and returns True."""
        with self._cv:
            self._expire_queue()
            taken = self._take()
            if not self._groups and not taken and not self._deferred:
                if wait <= 0 or self._stopping:
                    return False
                self._cv.wait(wait)
                return True
        try:
            self._admit(taken)
            if self._groups:
                self._rr %= len(self._groups)
                group = self._groups[self._rr]
                self._rr += 1
                self._step(group)
        except Exception as e:  # a fault outside one run's step: fail what is in flight, keep serving
            self._fail_all(e)
        return True

    def _warm_up(self) -> None:
        """:data:`WARMUP_STEPS` steps of one row, again, then of 2, 4, 8 ... rows up to the warm-up jobs:
        the first calls' one-time costs are paid before a request waits on them, and the step-cost model
        gets points at several widths (the first run's steps, which carry those costs, are not counted)."""
        jobs = self._warmup
        sizes = [1, 1] + [n for n in (2, 4, 8, 16) if n <= len(jobs)] if jobs else []
        for i, batch in enumerate(jobs[:n] for n in sizes):
            k = batch[0].key
            try:
                run = self.engine.start([j.prompt_ids for j in batch], k.cfg, batch[0].make_policy(), seed=0,
                                        prompt_width=k.prompt_width)
                for _, rec in zip(range(WARMUP_STEPS), _timed(run, self.clock)):
                    if i:
                        self._observe(*rec)
            except Exception as e:  # the server still answers HTTP, but is never ready (/health/ready 503)
                self.warmup_error = f"{type(e).__name__}: {e}"
                # a Ctrl-C to the process group also ends the C++ compiler that --compile runs: a failure
                # that the server's stop follows within STOP_RACE seconds is the stop's, not reported
                with self._cv:
                    stopped = self._cv.wait_for(lambda: self._stopping, timeout=STOP_RACE)
                if not stopped:
                    err.print(f"ecache serve: the warm-up failed ({self.warmup_error}); /health/ready stays 503",
                              markup=False, highlight=False)
                return

    def _observe(self, seconds: float, rows: int, positions: float, group=None, joins: float = 0.0,
                 rec=None) -> None:
        """One step (of a run of ``group``; ``joins``: the seconds its joining rows' full forwards are
        expected to add, charged apart by ``admit``; ``rec``: its ``StepRecord``, whose rows' steps of
        their blocks tell a mixed step from one in step) into the step-cost model (and its gauges)."""
        mixed = rec is not None and rows > 1 and bool((rec.step_in_block != rec.step_in_block[0]).any())
        self.cost.observe(seconds, rows, positions, group, joins, mixed)
        self.metrics.step_cost(self.cost)

    def _expire_queue(self) -> None:
        """(Lock held.) End queued jobs that were cancelled, timed out, or meet a shutdown."""
        if not self._queue:
            return
        now, keep = self.clock(), collections.deque()
        for job in self._queue:
            if job.cancelled:
                self._finish(job, CANCELLED, {}, running=False)
            elif self._draining:
                self._finish(job, SHUTDOWN, {}, running=False)
            elif job.timeout is not None and now - job.arrived > job.timeout:
                self._finish(job, TIMEOUT, {}, running=False)
            else:
                keep.append(job)
        self._queue = keep
        self.metrics.queue_depth.set(len(keep))

    def _take(self) -> list[Job]:
        """(Lock held.) The queued jobs to admit now, in queue order, counted as running."""
        taken: list[Job] = []
        running_before = self._running
        if self.admission == "fcfs":
            if self._groups or not self._queue:
                return taken
            key = self._queue[0].key
            rest = collections.deque()
            for job in self._queue:
                (taken if job.key == key and len(taken) < self.max_batch else rest).append(job)
            self._queue = rest
        else:
            running = self._rows() if self.admission == "auto" and self._queue else []
            idle = not running  # an idle engine starts what waits as one batch, its rows in step
            held, i = None, 0  # held: the queue's head auto kept waiting; i: the queued job looked at
            while i < len(self._queue) and self._running + len(taken) < self.max_batch:
                job = self._queue[i]
                if self.admission == "auto" and not idle:
                    key = self._hold_key(job, running) if held is None and not taken else None
                    if key is not None and key == self._held:  # the head: nothing its decision rests on changed
                        held, i = job, i + 1
                        continue
                    sizes = self.history.sizes(job.key, self._bound(job.key), prompt=len(job.prompt_ids))
                    if held is not None:  # behind a held head: a request that ends before the running rows passes it
                        if not ends_first(running, sizes):
                            i += 1
                            continue
                        # and the head starts with it: the steps it waits for are the ones the passing
                        # request shares, so a stream of short requests would keep it waiting without end
                        running.append(self._row(held.key, 0, len(held.prompt_ids)))
                        taken.append(held)
                        self._queue.remove(held)
                        held, i = None, i - 1
                        if self._running + len(taken) >= self.max_batch:
                            break
                    elif not joins(running, job.key, sizes, self._join_cost(job.key), len(self._queue) - 1,
                                   self.cost, self._rate()):
                        self._held, held, i = key, job, i + 1
                        if not job.held:
                            job.held = True
                            self.metrics.admissions.labels("held").inc()
                        continue
                    running.append(self._row(job.key, 0, len(job.prompt_ids)))
                taken.append(job)
                del self._queue[i]
        self._running += len(taken)
        if taken:  # into rows already running, or as a new batch of an idle engine
            self.metrics.admissions.labels("joined" if running_before else "started").inc(len(taken))
        self.metrics.queue_depth.set(len(self._queue))
        self.metrics.running_rows.set(self._running)
        return taken

    def _hold_key(self, head: Job, running: list[Row]) -> tuple:
        """(Lock held.) What ``auto``'s decision for a held ``head`` rests on, apart from the steps that
        pass: the head, the queue's length (an arrival), the running rows and each one's expected
        length (which moves only when the row outlives one of its group's past lengths,
        :meth:`StepHistory.remaining`), and whether a running row of the head's group is at the start
        of a block (where the head would join in step). Between two steps with the same key the
        comparison moves only by the running rows' remaining steps shrinking together, which scales
        joining's cost and waiting's alike, and the slowly moving step-cost estimate: the head stays
        held without simulating again (on one CPU thread a decision's ~0.1 ms delays the next step,
        ~1-2 % of a step, paid at every step while a request waits)."""
        rows = tuple((id(job), round(job.steps + self.history.remaining(g.key, job.steps, self._bound(g.key), 1,
                                                                        len(job.prompt_ids)), 6))
                     for g in self._groups for job in g.jobs.values() if not job.done)
        start = any(r.phase == 0 for r in running if r.group == head.key)
        return id(head), len(self._queue), rows, start

    def _rate(self) -> float:
        """(Lock held.) Requests arriving per second: the last :data:`ARRIVALS` arrivals over the time
        from the first of them to now (so it falls while none arrive); 0 before two."""
        if len(self._arrivals) < 2:
            return 0.0
        return (len(self._arrivals) - 1) / max(self.clock() - self._arrivals[0], 1e-3)

    @staticmethod
    def _bound(key: GroupKey) -> int:
        """The most steps a row of ``key`` runs: its steps, or in threshold mode one a token."""
        return key.cfg.steps if key.cfg.steps is not None else key.cfg.gen_length

    def _row(self, key: GroupKey, done: int, prompt: int | None = None) -> Row:
        """A row of group ``key`` (a prompt of ``prompt`` tokens) that has run ``done`` steps, as the
        admission model sees it: its expected remaining steps (:meth:`StepHistory.remaining`), and its
        phase, the step of its block it runs next (with a fixed step count a block takes
        ``steps / blocks`` steps; in threshold mode the block length is taken as its step count, so rows
        that joined apart count as mixed)."""
        bound, blocks = self._bound(key), max(key.cfg.gen_length // key.cfg.block_length, 1)
        per_block = max(bound // blocks, 1)
        return Row(self.history.remaining(key, done, bound, per_block, prompt), key, done % per_block)

    def _join_cost(self, key: GroupKey) -> float:
        """Seconds a joining row's first full forward (its whole canvas) adds to its first step, beyond
        a row's usual positions."""
        full = key.prompt_width + key.cfg.gen_length
        return self.cost.per_position * max(full - self.cost.positions(1), 0.0)

    def _rows(self) -> list[Row]:
        """The rows running now, as the admission model sees them."""
        return [self._row(g.key, job.steps, len(job.prompt_ids))
                for g in self._groups for job in g.jobs.values() if not job.done]

    def _admit(self, jobs: list[Job]) -> None:
        """Put each job into the newest joinable run of its group, or start a run for it; a job whose
        prompt shares a prefix with a job admitted before it whose first step has not run yet waits for
        that step (:meth:`_defers`), and is put in here at a later call."""
        for job in self._undeferred() + jobs:
            if self._defers(job):
                self._deferred.append(job)
                continue
            if job.uid < 0:
                job.uid, self._uid = self._uid, self._uid + 1
            group = next((g for g in reversed(self._groups) if g.key == job.key and g.accepts), None)
            try:
                if group is not None:
                    kv = self._lookup(job) if group.reuse else None
                    group.add(job, group.run.add(job.prompt_ids, row_id=job.uid, reuse=kv))
                else:
                    k, policy = job.key, job.make_policy()
                    reuse = self.prefix is not None and ReusedPrefix.wraps(policy)
                    policy = ReusedPrefix(policy, self.prefix_frozen) if reuse else policy
                    run = self.engine.start([job.prompt_ids], k.cfg, policy, seed=0, row_ids=[job.uid],
                                            prompt_width=k.prompt_width,
                                            reuse=[self._lookup(job)] if reuse else None)
                    run.store.max_rows = self.max_batch  # its KV store's buffers grow by doubling up to it
                    group = _Group(k, run, joinable=True, reuse=reuse)
                    group.add(job, 0)
                    self._groups.append(group)
                if group.reuse and self._may_defer():
                    self._unstepped.append(job)
            except Exception as e:  # e.g. a policy that cannot be built: this request fails alone
                self._error(job, e)
        if self.admission == "fcfs":  # the batch is complete: no row joins it later
            for group in self._groups:
                group.joinable = False

    # -- prefix reuse (docs/SERVING.md, "Prefix reuse") ---------------------------------------------

    def _reach(self, key: GroupKey) -> int:
        """The unit of a prompt's reusable positions: a block-causal model's block length (a whole prompt
        block's keys and values depend only on the tokens up to its end, so a stored prefix is reused in
        whole blocks, each matched to its last token), 1 on bidirectional attention (the approximation:
        any prompt position)."""
        return key.cfg.block_length if self.engine.spec.block_causal else 1

    def _root(self, key: GroupKey):
        """What a prompt's keys and values depend on beyond its tokens (the prefix store's ``root``)."""
        return ("block", key.cfg.block_length) if self.engine.spec.block_causal else ("bidirectional",)

    def _final(self, job: Job) -> int:
        """The prompt's leading tokens whose keys and values may be stored and reused (``_reach``)."""
        reach = self._reach(job.key)
        return len(job.prompt_ids) // reach * reach

    def _defers(self, job: Job) -> bool:
        """Whether ``job`` waits for the first step of a job admitted before it (``_unstepped``: in a
        reusing run, not yet stepped) whose prompt shares more of its reusable prefix (whole chunks,
        whole ``_reach`` units) than the store holds now: after that step the store holds it and the
        job's first forward skips it (docs/SERVING.md, "Prefix reuse": requests admitted together)."""
        self._unstepped = [j for j in self._unstepped if j.steps == 0 and not j.done]
        if not self._may_defer():
            return False
        if not self._unstepped or not self._reusable(job):
            return False
        n, root, unit = self._final(job), self._root(job.key), self._reach(job.key)
        have = self.prefix.stored(job.prompt_ids[:n], root) // unit * unit
        for lead in self._unstepped:
            if self._root(lead.key) != root:
                continue
            common = _common(job.prompt_ids[:n], lead.prompt_ids[:self._final(lead)])
            if common // self.prefix.chunk * self.prefix.chunk // unit * unit > have:
                return True
        return False

    def _may_defer(self) -> bool:
        """Whether jobs may wait for another's first step: a prefix store, not shutting down, and not
        ``fcfs`` (a static batch starts and ends together, in one run)."""
        return self.prefix is not None and self.batch_prefix and not self._draining and self.admission != "fcfs"

    def _undeferred(self) -> list[Job]:
        """The deferred jobs in queue order, taken out of ``_deferred`` (``_admit`` defers again those that
        still wait)."""
        jobs, self._deferred = self._deferred, []
        return jobs

    def _reusable(self, job: Job) -> bool:
        """Whether runs of ``job``'s group reuse stored prefixes (their policy keeps no hidden states)."""
        if job.key not in self._reuses:
            try:
                self._reuses[job.key] = ReusedPrefix.wraps(job.make_policy())
            except Exception:  # a policy that cannot be built: the job fails alone when it is put in a run
                return False
        return self._reuses[job.key]

    def _lookup(self, job: Job):
        """The stored keys and values of ``job``'s prompt's longest stored prefix in whole ``_reach``
        units, or None."""
        kv = self.prefix.lookup(job.prompt_ids, self._root(job.key), limit=self._final(job), unit=self._reach(job.key))
        self.metrics.prefix_cache(self.prefix)
        return kv

    def _store_prefixes(self, group: _Group, rec) -> None:
        """After the first step of rows of a reusing run: their prompts' final keys and values into the store."""
        run = group.run
        for b, r in enumerate(rec.rows.tolist()):
            job = group.jobs[r]
            n = self._final(job)
            if job.steps or n < self.prefix.chunk:
                continue
            ids, root = job.prompt_ids[:n], self._root(job.key)
            if self.prefix.stored(ids, root) < n // self.prefix.chunk * self.prefix.chunk:
                self.prefix.add(ids, run.store.read_span(b, run.P - len(job.prompt_ids), n), root)
        self.metrics.prefix_cache(self.prefix)

    def _step(self, group: _Group) -> None:
        """One denoising step of ``group``'s run, then every row's answer checked."""
        run = group.run
        t0 = self.clock()
        try:
            rec = next(group.it)
        except StopIteration:
            self._sweep(group, set())
            self._groups.remove(group)
            return
        except Exception as e:  # the run is broken: its requests fail, the server keeps serving
            self._drop(group, e)
            return
        _settle(rec)
        seconds = self.clock() - t0
        self.metrics.step(group.key.policy, seconds, int(rec.rows.numel()), int(rec.refresh.sum()))
        joins = sum(group.jobs[r].steps == 0 for r in rec.rows.tolist())  # rows whose first step this was
        if group.reuse and joins:
            self._store_prefixes(group, rec)
        self._observe(seconds, int(rec.rows.numel()), float(rec.computed.sum()), group.key,
                      joins * self._join_cost(group.key), rec)
        st, P = run.state, run.P
        rows = rec.rows.tolist()
        first = final_lengths(unsettled(run)[:, P:P + run.G])  # (B,) final prefix lengths of the answers
        engine_done = rec.finished.tolist()
        leave = [False] * len(rows)
        now = self.clock()
        grace_over = self._grace_end is not None and now >= self._grace_end
        for b, (r, n) in enumerate(zip(rows, first)):
            job = group.jobs[r]
            job.in_run = True
            job.steps += 1
            if n > job.seen:
                job.seen = n
                job.update(st.tokens[b, P:P + n].tolist(), self.end_ids, self._decode)
            reason = job.reason
            if reason is None and engine_done[b]:
                reason = "length"
            if reason is None:
                if job.cancelled:
                    reason = CANCELLED
                elif job.timeout is not None and now - job.arrived > job.timeout:
                    reason = TIMEOUT
                elif grace_over:
                    reason = SHUTDOWN
            if reason is not None:
                leave[b] = True
                if reason in ("stop", "length"):
                    self.history.finished(group.key, job.steps, len(job.prompt_ids))
                self._finish(job, reason, self._row_stats(group, r))
                group.streams.forget(job.uid)
            elif job.stream:
                self._send(job)
        if any(leave):
            rec.finished = rec.finished | torch.tensor(leave, device=rec.finished.device)
        self._sweep(group, set(rows))

    def _sweep(self, group: _Group, stepped: set[int]) -> None:
        """Finish jobs whose rows the run retired on its own (a canvas used up without an end marker)."""
        for r, job in group.jobs.items():
            if not job.done and job.in_run and r not in stepped:
                ids = group.run.ledger.final[r, group.run.P:].tolist()
                job.update(ids, self.end_ids, self._decode)
                self.history.finished(group.key, job.steps, len(job.prompt_ids))
                self._finish(job, job.reason or "length", self._row_stats(group, r))
                group.streams.forget(job.uid)

    def _send(self, job: Job) -> None:
        text = job.streamable()
        if len(text) > len(job.sent) and text.startswith(job.sent):
            if job.first_token_at is None:
                job.first_token_at = self.clock()
                self.metrics.ttft_seconds.labels(job.endpoint).observe(job.first_token_at - job.arrived)
            job.post(Event("delta", text=text[len(job.sent):]))
            job.sent = text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _row_stats(self, group: _Group, r: int) -> dict:
        led, run = group.run.ledger, group.run
        nfe = int(led.nfe[r])
        return {"nfe": nfe, "full_forwards": int(led.n_full[r]), "partial_forwards": int(led.n_partial[r]),
                "refresh_share": int(led.n_full[r]) / max(nfe, 1), "policy": group.key.policy,
                "gen_length": run.G, "block_length": run.cfg.block_length, "steps": run.cfg.steps,
                "prompt_width": run.P, "group_rows": int(run.state.batch)}

    def _finish(self, job: Job, reason: str, stats: dict, running: bool = True) -> None:
        """Deliver ``job``'s result and count it (its row, when ``running``, is freed)."""
        if job.done:
            return
        job.done, job.reason = True, reason
        now = self.clock()
        if job.stream and job.text != job.sent:  # the rest of the answer, before the final chunk
            if job.first_token_at is None and job.text:
                job.first_token_at = now
                self.metrics.ttft_seconds.labels(job.endpoint).observe(now - job.arrived)
            if job.text.startswith(job.sent):
                job.post(Event("delta", text=job.text[len(job.sent):]))
                job.sent = job.text
        result = Result(text=job.text, finish_reason=reason, prompt_tokens=len(job.prompt_ids),
                        completion_tokens=job.n_answer, stats=stats)
        job.post(Event("done", result=result))
        m = self.metrics
        m.requests.labels(job.endpoint, reason).inc()
        m.generated_tokens.inc(job.n_answer)
        m.request_seconds.labels(job.endpoint).observe(now - job.arrived)
        if running:
            with self._cv:
                self._running -= 1
                m.running_rows.set(self._running)

    def _error(self, job: Job, exc: BaseException, running: bool = True) -> None:
        """Fail ``job`` with a 500 naming ``exc``."""
        if job.done:
            return
        job.done = True
        job.post(Event("error", text=f"the engine failed on this request: {type(exc).__name__}: {exc}", status=500))
        self.metrics.requests.labels(job.endpoint, "error").inc()
        if running:
            with self._cv:
                self._running -= 1
                self.metrics.running_rows.set(self._running)

    def _drop(self, group: _Group, exc: BaseException) -> None:
        """A run's step raised: fail every request of the run and forget the run."""
        ids = ", ".join(j.request_id for j in group.jobs.values() if j.request_id and not j.done)
        err.print(f"ecache serve: a run failed ({type(exc).__name__}: {exc}); its {len(group.jobs)} request(s) "
                  f"get a 500, the server keeps serving{f' (x-request-id {ids})' if ids else ''}",
                  markup=False, highlight=False)
        for job in group.jobs.values():
            self._error(job, exc)
        if group in self._groups:
            self._groups.remove(group)

    def _fail_all(self, exc: BaseException) -> None:
        for job in self._undeferred():
            self._error(job, exc)
        for group in list(self._groups):
            self._drop(group, exc)


def _common(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of token lists ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _timed(run, clock: Callable[[], float]):
    """(seconds by ``clock``, rows, positions computed) of each step of ``run``."""
    it = iter(run)
    while True:
        t0 = clock()
        try:
            rec = next(it)
        except StopIteration:
            return
        _settle(rec)
        yield clock() - t0, int(rec.rows.numel()), float(rec.computed.sum())


def _settle(rec) -> None:
    """Wait for the kernels of a CUDA step (``rec``: its ``StepRecord``) before its time is read: a step
    returns once its work is queued (its one host sync is before the forwards), so without the wait a
    step's seconds would be its launch time and the step-cost model would not see the device's curve.
    The scheduler reads the record's tensors right after, which waits as long, so this costs nothing."""
    if rec.rows.is_cuda:
        torch.cuda.synchronize(rec.rows.device)
