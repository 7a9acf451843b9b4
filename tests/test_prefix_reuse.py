"""Prefix reuse across requests (``ecache serve --prefix-cache``, docs/SERVING.md "Prefix reuse"): the
store's lookups and least-recently-used eviction, block-diffusion answers equal to ``generate``'s with
the shared prompt blocks read from the store, bidirectional reuse off by default and equal to no reuse
when no prefix is shared, the metrics and the flags' checks.

The serving tests drive the scheduler in-process (no HTTP: the routes are tested in test_serve.py) on
the tiny official-format block-diffusion fixtures and the embedded model."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from ecache_cli.engine import Engine  # noqa: E402
from ecache_cli.models.loader import load_model  # noqa: E402
from ecache_cli.prefixstore import PrefixStore  # noqa: E402
from ecache_cli.runs.settings import resolve_settings  # noqa: E402
from ecache_cli.serve.app import ServeOptions, create_app, prefix_store  # noqa: E402
from ecache_cli.serve.protocol import CompletionRequest, parse  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GEN = 16


def _kv(fill: float, n: int = 4) -> torch.Tensor:
    """(2, L=2, H=1, n, D=2) keys and values filled with ``fill``: 128 bytes per 4 tokens in float32."""
    return torch.full((2, 2, 1, n, 2), float(fill))


def test_the_store_finds_the_longest_stored_prefix_of_whole_chunks_and_counts_it():
    s = PrefixStore(chunk=4, max_bytes=1 << 20)
    ids = list(range(10, 22))  # three chunks
    kv = torch.arange(2 * 2 * 1 * 12 * 2, dtype=torch.float32).view(2, 2, 1, 12, 2)
    assert s.add(ids[:10], kv) == 2  # whole chunks only: 8 of 10 tokens
    got = s.lookup(ids + [99])
    assert torch.equal(got, kv[:, :, :, :8])
    assert s.lookup([10, 11, 12, 0] + ids[4:]) is None  # the first chunk differs: nothing after it matches
    assert s.lookup(ids, limit=7).shape[3] == 4  # at most 7 tokens: one chunk
    assert torch.equal(s.lookup(ids, unit=3), kv[:, :, :, :6])  # whole units of 3 tokens: 6 of the 8 found
    assert s.lookup(ids, unit=9) is None  # no whole unit of 9 in the 8 found
    assert s.lookup(ids, root="other") is None  # another root: other keys and values
    assert (s.stats.lookups, s.stats.hits, s.stats.reused_tokens) == (6, 3, 18)
    assert s.stats.prompt_tokens == 13 + 12 * 5
    assert s.stored(ids) == 8 and len(s) == 2 and s.bytes == 2 * 128


def test_the_store_evicts_least_recently_used_chunks_within_its_bytes():
    s = PrefixStore(chunk=4, max_bytes=3 * 128)  # room for three chunks
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]
    s.add(a, torch.cat([_kv(1), _kv(2)], 3))
    s.add(b[:4], _kv(3))
    assert s.lookup(a) is not None  # a is now more recent than b
    s.add(b, torch.cat([_kv(3), _kv(4)], 3))  # b's second chunk needs room: the least recently used chunk
    # not on b's own chain, a's first, goes, and a's second with it (unreachable without it)
    assert s.bytes == 2 * 128 and s.stats.evictions == 2
    assert s.lookup(a) is None
    assert float(s.lookup(b)[0, 0, 0, 4, 0]) == 4.0
    c, d = [20, 21, 22, 23], [30, 31, 32, 33]
    s.add(c, _kv(5))  # fits
    s.add(d, _kv(6))  # evicts b's chunks (the least recently used, the child with its parent), not c
    assert s.lookup(b) is None and s.lookup(c) is not None and s.lookup(d) is not None
    assert s.bytes == 2 * 128 and s.stats.evictions == 4
    assert PrefixStore(chunk=4, max_bytes=64).add(a, torch.cat([_kv(1), _kv(2)], 3)) == 0  # a chunk over the bound


def _serve(lm, settings, first: list[list[int]], later: list[list[int]], chunk: int = 8, admission: str = "always",
           **options):
    """Serve ``first`` together, then (once the first row has run a step) ``later``, through the scheduler
    in-process, with a prefix store of ``chunk``-token chunks; returns (answers in order, the scheduler)."""
    app = create_app(lm, settings, ServeOptions(model_name="m", warmup=0, admission=admission, prefix_chunk=chunk,
                                                **options))
    srv, sched = app.state.server, app.state.scheduler

    def job(ids):
        req = parse(CompletionRequest, {"model": "m", "prompt": ids, "max_tokens": GEN})
        return srv.resolver.job(req, "completions", srv.resolver.completion_ids(req))

    jobs = [job(p) for p in first]
    for j in jobs:  # queued before the engine thread starts: taken together
        assert sched.submit(j) is None
    sched.start([])
    try:
        deadline = time.monotonic() + 120
        while jobs[0].steps == 0 and not jobs[0].done:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        more = [job(p) for p in later]
        for j in more:
            assert sched.submit(j) is None
        jobs += more
        while not all(j.done for j in jobs):
            assert time.monotonic() < deadline, "the scheduler did not finish"
            time.sleep(0.01)
    finally:
        sched.stop()
    return [j.text for j in jobs], sched


def _prompts(seed: int, shared: int, tails: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 150, (shared,), generator=g).tolist()
    return [head + torch.randint(3, 150, (n,), generator=g).tolist() for n in tails]


@pytest.mark.parametrize("name,block,chunk,shared", [("sdar", 4, 6, 24), ("llada2-mini", 8, 10, 20)])
def test_block_diffusion_answers_with_reused_prompt_blocks_equal_generate(name, block, chunk, shared):
    """Requests sharing a prefix, of different lengths (so different left padding in their run), two
    admitted together (the second waits for the first's first step, which stores the shared prefix) and
    three joining mid-run: every one but the first reads the shared prompt's whole blocks within whole
    chunks from the store and answers exactly as ``generate`` does for its prompt alone. Chunks need not
    end on block ends: with chunks of 10 and blocks of 8 the 20 shared tokens are found, but only 16 are
    reused (the block 16-24 holds tokens that differ, so its keys and values do too)."""
    lm = load_model(FIXTURES / name, device="cpu", dtype="float32")
    settings = resolve_settings(str(FIXTURES / name), {"gen_length": GEN, "block_length": block}, {})
    prompts = _prompts(7, shared, [3 + 24 - shared, 9, 5, 14, 6])
    eng = Engine.from_loaded(lm)
    want = [eng.generate([p], settings.decode, settings.policy(), chat=False)[0].text
            for p in prompts]
    got, sched = _serve(lm, settings, prompts[:2], prompts[2:], chunk=chunk)
    assert got == want
    st = sched.prefix.stats
    reused = shared // chunk * chunk // block * block  # the shared tokens in whole chunks, then in whole blocks
    assert st.hits == 4 and st.reused_tokens == 4 * reused > 0  # all but the first prompt
    assert st.lookups == 5 and sched.prefix.bytes > 0
    text = sched.metrics.render().decode()
    assert 'ecache_prefix_cache_lookups_total{result="hit"} 4.0' in text
    assert 'ecache_prefix_cache_lookups_total{result="miss"} 1.0' in text
    assert f'ecache_prefix_cache_tokens_total{{kind="reused"}} {4 * reused}.0' in text
    assert f"ecache_prefix_cache_bytes {float(sched.prefix.bytes)}" in text


@pytest.mark.parametrize("admission", ["auto", "fcfs"])
def test_requests_admitted_together_share_the_first_ones_prefix_except_in_a_static_batch(admission):
    """Four requests sharing 16 prompt tokens queued on an idle engine are admitted together: under
    ``auto`` the first runs its first step alone, which stores the shared blocks, and the other three
    join its run at the next step reading them (answers still equal ``generate``'s); ``fcfs`` starts its
    batch in one run, so nothing is stored before the rows' first forward."""
    lm = load_model(FIXTURES / "sdar", device="cpu", dtype="float32")
    settings = resolve_settings(str(FIXTURES / "sdar"), {"gen_length": GEN, "block_length": 4}, {})
    prompts = _prompts(11, 16, [5, 2, 9, 4])
    eng = Engine.from_loaded(lm)
    want = [eng.generate([p], settings.decode, settings.policy(), chat=False)[0].text for p in prompts]
    got, sched = _serve(lm, settings, prompts, [], chunk=8, admission=admission)
    assert got == want
    st = sched.prefix.stats
    joined = 3 if admission == "auto" else 0
    assert (st.lookups, st.hits, st.reused_tokens) == (4, joined, 16 * joined)
    assert not sched._deferred and sched.counts() == (0, 0)
    assert admission == "auto" or not sched._unstepped  # fcfs keeps no job for later ones to wait on


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", "cpu", None)


def test_reuse_is_off_by_default_on_a_bidirectional_model_and_on_by_default_for_block_diffusion(tiny):
    assert prefix_store(ServeOptions(model_name="m"), tiny.spec) is None
    assert prefix_store(ServeOptions(model_name="m", prefix_cache=True), tiny.spec) is not None
    sdar = load_model(FIXTURES / "sdar", device="cpu", dtype="float32")
    store = prefix_store(ServeOptions(model_name="m", prefix_cache_mb=3), sdar.spec)
    assert store.max_bytes == 3 << 20
    assert prefix_store(ServeOptions(model_name="m", prefix_cache=False), sdar.spec) is None


def test_bidirectional_reuse_runs_and_without_a_shared_prefix_equals_no_reuse(tiny):
    """On the embedded (bidirectional) model with --prefix-cache: prompts whose first chunks all differ
    answer as without reuse (nothing is found); prompts sharing a prefix run and read it from the store."""
    settings = resolve_settings("tiny", {"gen_length": GEN, "block_length": GEN}, {})
    distinct = _prompts(3, 0, [12, 17, 10, 20])
    plain, _ = _serve(tiny, settings, distinct[:2], distinct[2:], prefix_cache=False)
    got, sched = _serve(tiny, settings, distinct[:2], distinct[2:], prefix_cache=True)
    assert got == plain and sched.prefix.stats.hits == 0 and len(sched.prefix) > 0
    shared = _prompts(4, 16, [5, 9, 3])
    got, sched = _serve(tiny, settings, shared[:1], shared[1:], prefix_cache=True)
    assert all(isinstance(t, str) for t in got) and sched.prefix.stats.reused_tokens == 2 * 16
    together, sched = _serve(tiny, settings, shared, [], prefix_cache=True)  # the 2nd and 3rd wait one step
    assert together == got and sched.prefix.stats.hits == 2 and sched.prefix.stats.reused_tokens == 2 * 16


def test_health_reports_prefix_reuse_its_mode_budget_and_what_it_holds(tiny):
    """``/health`` and ``/health/ready`` say whether prefix reuse is on, exact or approximate, its budget
    and the chunks and bytes stored (real HTTP requests through the app's ASGI interface)."""
    from starlette.testclient import TestClient

    sdar = load_model(FIXTURES / "sdar", device="cpu", dtype="float32")
    settings = resolve_settings(str(FIXTURES / "sdar"), {"gen_length": GEN, "block_length": 4}, {})
    app = create_app(sdar, settings, ServeOptions(model_name="m", warmup=0, prefix_chunk=4, prefix_cache_mb=3))
    http = TestClient(app)  # no lifespan: the engine thread does not start, the routes answer
    state = {"enabled": True, "mode": "exact", "budget_mb": 3, "entries": 0, "bytes": 0}
    assert http.get("/health").json()["prefix_cache"] == state
    app.state.scheduler.prefix.add(list(range(3, 11)), torch.zeros(2, 2, 1, 8, 2))  # two chunks of 128 bytes
    assert http.get("/health").json()["prefix_cache"] == state | {"entries": 2, "bytes": 256}
    app.state.scheduler.ready.set()
    assert http.get("/health/ready").json() == {"status": "ready", "prefix_cache": state | {"entries": 2, "bytes": 256}}
    tiny_settings = resolve_settings("tiny", {"gen_length": GEN, "block_length": GEN}, {})
    on = create_app(tiny, tiny_settings, ServeOptions(model_name="m", warmup=0, prefix_cache=True))
    assert TestClient(on).get("/health").json()["prefix_cache"] == {
        "enabled": True, "mode": "approximate", "budget_mb": 1024, "entries": 0, "bytes": 0}
    off = create_app(sdar, settings, ServeOptions(model_name="m", warmup=0, prefix_cache=False))
    assert TestClient(off).get("/health").json()["prefix_cache"] == {"enabled": False}


@pytest.mark.parametrize("mb, what", [("0", "≥ 1"), ("2000000", "≤ 1048576")])
def test_prefix_cache_mb_out_of_range_is_one_line_naming_the_value(cli, mb, what):
    r = cli("serve", "--prefix-cache-mb", mb)
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [f"error: --prefix-cache-mb {mb} must be {what} (MiB; --no-prefix-cache keeps "
                                     "no prefixes; e.g. 1024)"], r.stderr


def test_prefix_cache_mb_without_reuse_is_warned_as_ignored(monkeypatch):
    """``--prefix-cache-mb`` does nothing where prefix reuse is off: with ``--no-prefix-cache``, and on a
    bidirectional model without ``--prefix-cache`` (off by default there); each says so once and the server
    starts. With reuse on, its budget is the one the start line names."""
    from typer.testing import CliRunner

    import ecache_cli.serve.app as serve_app
    from ecache_cli.cli import app

    monkeypatch.setattr(serve_app, "run_server", lambda app, sock, **kw: sock.close())
    monkeypatch.delenv("ECACHE_API_KEY", raising=False)

    def warnings(*args):
        res = CliRunner().invoke(app, ["serve", "--gen-length", str(GEN), "--block-length", str(GEN), "--port", "0",
                                       "-q", *args])
        assert res.exit_code == 0, res.stderr
        return [line for line in res.stderr.splitlines() if line.startswith("warning:")], res.stderr

    assert warnings("--no-prefix-cache", "--prefix-cache-mb", "5")[0] == [
        "warning: --prefix-cache-mb is used only with --prefix-cache; ignored"]
    assert warnings("--prefix-cache-mb", "5")[0] == [
        "warning: --prefix-cache-mb is used only with --prefix-cache (off by default on bidirectional models); "
        "ignored"]
    said, stderr = warnings("--prefix-cache", "--prefix-cache-mb", "5")
    assert said == [] and "at most 5 MiB" in stderr
    assert warnings()[0] == warnings("--prefix-cache")[0] == []


def test_the_start_line_names_reuse_and_whether_it_is_exact():
    from ecache_cli.commands.serve import _prefix_line

    assert _prefix_line(None, True, 1024) == "--prefix-cache (exact; at most 1024 MiB)"
    assert _prefix_line(None, False, 1024) == "--no-prefix-cache"
    assert _prefix_line(False, True, 1024) == "--no-prefix-cache"
    assert _prefix_line(True, False, 64).startswith("--prefix-cache (approximate: ")


def test_every_bidirectional_policy_runs_with_reused_prefixes_but_those_that_keep_hidden_states(tiny):
    """The frozen-prefix rule fits every policy's plans (the positions a step needs stay computed; the
    engine's check would fail otherwise); a policy that keeps hidden states runs without reuse."""
    from ecache_cli.cache import POLICIES, policies_for

    shared = _prompts(4, 16, [5, 9, 3])
    for name in policies_for(False):
        settings = resolve_settings("tiny", {"gen_length": GEN, "block_length": GEN}, {"policy": name})
        got, sched = _serve(tiny, settings, shared[:1], shared[1:], prefix_cache=True)
        assert len(got) == 3 and all(isinstance(t, str) for t in got)
        want = 0 if POLICIES[name].keeps_hidden else 2 * 16
        assert sched.prefix.stats.reused_tokens == want, name
