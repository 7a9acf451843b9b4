"""The server's Prometheus metrics (``GET /metrics``), one registry per app.

Names follow Prometheus' conventions (``_total`` counters, ``_seconds`` histograms). What to scale
on: ``ecache_queue_depth`` (requests waiting for a row) and ``ecache_running_rows`` against
``--max-batch``; latency SLOs from ``ecache_request_seconds`` and ``ecache_time_to_first_token_seconds``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Seconds buckets for latencies of whole requests (tiny model on a CPU to an 8B model on a GPU).
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
#: Seconds buckets for one denoising step (one forward of a batch).
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServeMetrics:
    """The metrics of one server; every update is thread-safe (prometheus-client's own locks).

    - ``requests`` ``ecache_requests_total{endpoint, outcome}``: finished requests by finish reason
      (stop, length, timeout, cancelled, shutdown) or rejection (invalid, unauthorized, too_large,
      queue_full, unavailable, error).
    - ``queue_depth`` ``ecache_queue_depth``: requests waiting for a row.
    - ``running_rows`` ``ecache_running_rows``: rows in the engine's runs (at most ``--max-batch``).
    - ``generated_tokens`` ``ecache_generated_tokens_total``: completion tokens returned.
    - ``step_seconds`` ``ecache_step_seconds{policy}``: wall time of one denoising step of one run.
    - ``request_seconds`` ``ecache_request_seconds{endpoint}``: arrival to last token.
    - ``ttft_seconds`` ``ecache_time_to_first_token_seconds{endpoint}``: arrival to the first final
      answer text.
    - ``row_steps`` / ``row_refreshes`` ``ecache_row_steps_total{policy}``,
      ``ecache_row_refreshes_total{policy}``: rows stepped and rows that ran a full forward (refresh);
      ``refresh_share`` ``ecache_refresh_share{policy}`` is their ratio since the start.
    - ``step_cost_seconds`` ``ecache_step_cost_seconds{term}``: the admission model's step-cost
      estimate (``serve/admission.py``): ``base`` (seconds a step), ``per_row`` (seconds a row adds),
      ``per_position`` (seconds a computed position adds).
    - ``admissions`` ``ecache_admissions_total{decision}``: queued requests that started a batch on an
      idle engine (``started``), that joined rows already running (``joined``; never under ``fcfs``),
      and those ``--admission auto`` kept waiting at least once (``held``).
    - prefix reuse (``--prefix-cache``, docs/SERVING.md "Prefix reuse"):
      ``ecache_prefix_cache_lookups_total{result}`` prompts looked up (``hit``: at least one chunk found,
      ``miss``), ``ecache_prefix_cache_tokens_total{kind}`` their tokens (``prompt``) and those whose keys
      and values came from the store (``reused``), ``ecache_prefix_cache_hit_rate`` reused over prompt
      tokens since the start, ``ecache_prefix_cache_bytes`` / ``ecache_prefix_cache_entries`` what the
      store holds, ``ecache_prefix_cache_evictions_total`` chunks evicted (least recently used first).
    """

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ecache_requests", "Requests by endpoint and outcome (finish reason or rejection).",
                                ["endpoint", "outcome"], registry=r)
        self.queue_depth = Gauge("ecache_queue_depth", "Requests waiting for a row.", registry=r)
        self.running_rows = Gauge("ecache_running_rows", "Rows in the engine's runs.", registry=r)
        self.generated_tokens = Counter("ecache_generated_tokens", "Completion tokens returned.", registry=r)
        self.step_seconds = Histogram("ecache_step_seconds", "Wall time of one denoising step of one run.",
                                      ["policy"], buckets=STEP_BUCKETS, registry=r)
        self.request_seconds = Histogram("ecache_request_seconds", "Request latency, arrival to last token.",
                                         ["endpoint"], buckets=REQUEST_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("ecache_time_to_first_token_seconds",
                                      "Arrival to the first final answer text.", ["endpoint"],
                                      buckets=REQUEST_BUCKETS, registry=r)
        self.row_steps = Counter("ecache_row_steps", "Rows stepped, by cache policy.", ["policy"], registry=r)
        self.row_refreshes = Counter("ecache_row_refreshes", "Rows that ran a full forward (refresh), by cache policy.",
                                     ["policy"], registry=r)
        self.refresh_share = Gauge("ecache_refresh_share",
                                   "Refreshed rows over rows stepped since the start, by policy.",
                                   ["policy"], registry=r)
        self.step_cost_seconds = Gauge("ecache_step_cost_seconds", "The admission model's step-cost estimate: "
                                       "base + per_row * rows + per_position * positions.", ["term"], registry=r)
        self.admissions = Counter("ecache_admissions", "Queued requests that started a batch on an idle "
                                  "engine, that joined running rows, and that auto admission kept waiting at least "
                                  "once.", ["decision"], registry=r)
        self.prefix_lookups = Counter("ecache_prefix_cache_lookups", "Prompts looked up in the prefix store, by "
                                      "result (hit: at least one chunk found).", ["result"], registry=r)
        self.prefix_tokens = Counter("ecache_prefix_cache_tokens", "Prompt tokens looked up (prompt) and those "
                                     "whose keys and values the prefix store gave (reused).", ["kind"], registry=r)
        self.prefix_hit_rate = Gauge("ecache_prefix_cache_hit_rate", "Reused over prompt tokens looked up since "
                                     "the start.", registry=r)
        self.prefix_bytes = Gauge("ecache_prefix_cache_bytes", "Bytes the prefix store's keys and values take.",
                                  registry=r)
        self.prefix_entries = Gauge("ecache_prefix_cache_entries", "Chunks the prefix store holds.", registry=r)
        self.prefix_evictions = Counter("ecache_prefix_cache_evictions", "Chunks evicted from the prefix store "
                                        "(least recently used first).", registry=r)
        self._prefix_seen = (0, 0, 0, 0, 0)  # lookups, hits, prompt tokens, reused tokens, evictions exported
        self._counts: dict[str, list[int]] = {}

    def prefix_cache(self, store) -> None:
        """Export a ``prefixstore.PrefixStore``'s counts and size (only the engine thread calls it)."""
        st = store.stats
        now = (st.lookups, st.hits, st.prompt_tokens, st.reused_tokens, st.evictions)
        d = [a - b for a, b in zip(now, self._prefix_seen)]
        self._prefix_seen = now
        self.prefix_lookups.labels("hit").inc(d[1])
        self.prefix_lookups.labels("miss").inc(d[0] - d[1])
        self.prefix_tokens.labels("prompt").inc(d[2])
        self.prefix_tokens.labels("reused").inc(d[3])
        self.prefix_evictions.inc(d[4])
        self.prefix_hit_rate.set(st.reused_tokens / max(st.prompt_tokens, 1))
        self.prefix_bytes.set(store.bytes)
        self.prefix_entries.set(len(store))

    def step_cost(self, cost) -> None:
        """Export ``cost`` (a ``serve.admission.StepCost``) as ``ecache_step_cost_seconds{term}``."""
        for term in ("base", "per_row", "per_position"):
            self.step_cost_seconds.labels(term).set(getattr(cost, term))

    def step(self, policy: str, seconds: float, rows: int, refreshed: int) -> None:
        """One denoising step of a run of ``policy``: ``rows`` rows stepped, ``refreshed`` of them refreshed."""
        self.step_seconds.labels(policy).observe(seconds)
        self.row_steps.labels(policy).inc(rows)
        self.row_refreshes.labels(policy).inc(refreshed)
        c = self._counts.setdefault(policy, [0, 0])  # only the engine thread steps
        c[0] += rows
        c[1] += refreshed
        self.refresh_share.labels(policy).set(c[1] / max(c[0], 1))

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
