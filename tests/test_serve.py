"""``ecache serve`` through the official ``openai`` client: endpoints, continuous batching, streaming,
limits, errors, the API key and SIGTERM, on the embedded model (CPU, float32).

Servers run in-process (uvicorn in a thread on a free 127.0.0.1 port, stopped at the end of the
module), except the SIGTERM test, which starts ``ecache serve`` as a process. Answers are compared
with ``ecache generate`` on the same prompt alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from ecache_cli.models.loader import load_model  # noqa: E402
from ecache_cli.runs.settings import resolve_settings  # noqa: E402
from ecache_cli.serve.app import ServeOptions, bind, create_app  # noqa: E402

KEY = "sk-test-key"
GEN = 64  # the servers' --gen-length; requests ask for at most this many tokens
PROMPTS = ["Sort: 9 3 7 1", "Reverse: 1 2 3", "Sort descending: 4 8 1 6", "Unique: 3 3 5 1 5",
           "Even: 1 2 3 4 5 6", "Odd: 7 2 9 4 1", "First 2: 5 6 7 8", "Last 3: 1 2 3 4 5",
           "Reverse: 9 8 7 6 5", "Sort: 5 2 8 2 9 1", "Greater than 4: 1 5 3 7 9", "Less than 5: 8 2 6 1 4",
           "Sort: 3 1 2", "Reverse: 7 7 1 0", "Unique: 1 1 2 2 3", "Even: 8 6 3 2 5 1"]
#: A completions prompt: the chat template written out (the embedded model answers only in that format).
SORT = ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nSort: 9 3 7 1<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


@contextlib.contextmanager
def serving(lm, settings, name: str = "tiny", ready: bool = True, **options):
    """An in-process server on a free loopback port, serving ``lm`` as ``name``; yields (base URL, app)
    once it answers (and, with ``ready``, once ``/health/ready`` says the engine is warm); stops it on exit."""
    app = create_app(lm, settings, ServeOptions(model_name=name, **options))
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    while ready and httpx.get(f"{url}/health/ready").status_code != 200:  # the engine's warm-up
        assert time.monotonic() < deadline, "the test server did not get ready"
        time.sleep(0.02)
    try:
        yield url, app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", "cpu", None)


@pytest.fixture(scope="module")
def settings():
    return resolve_settings("tiny", {"gen_length": GEN}, {})


@pytest.fixture(scope="module")
def server(tiny, settings):
    """The main server: API key, --max-batch 16, --admission always (requests share runs whatever the
    step-cost model would say, so that the exactness test sees rows join)."""
    with serving(tiny, settings, api_key=KEY, max_batch=16, max_prompt_tokens=200, admission="always") as s:
        yield s


@pytest.fixture(scope="module")
def small(tiny, settings):
    """A server for the limits: one row, no queue, 4 KiB bodies, a 1.5 s request timeout (long enough for a
    loaded machine to reach the checks, shorter than the 4096-step request that runs into it)."""
    with serving(tiny, settings, max_batch=1, max_queue=0, request_timeout=1.5, max_body_bytes=4096) as s:
        yield s


def client(url: str, key: str = KEY):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def generate(*args: str) -> list[dict]:
    """``ecache generate --jsonl`` in-process: each prompt decoded alone (batch size 1)."""
    from typer.testing import CliRunner

    from ecache_cli.cli import app

    res = CliRunner().invoke(app, ["generate", "--jsonl", "--quiet", "--gen-length", str(GEN), *args])
    assert res.exit_code == 0, res.output
    return [json.loads(line) for line in res.stdout.splitlines()]


def metric(url: str, name: str, **labels) -> float:
    """A sample's value from /metrics (0 when absent)."""
    text = httpx.get(f"{url}/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pat = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)"
    m = re.search(r"^" + pat + "$", text, flags=re.M)
    return float(m.group(1)) if m else 0.0


def wait_for(cond, what: str, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# --- endpoints and exact answers --------------------------------------------------------------------


def test_models_health_and_metrics_endpoints(server):
    url, _ = server
    assert [m.id for m in client(url).models.list().data] == ["tiny"]
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny" and health["max_batch"] == 16
    assert health["prefix_cache"] == {"enabled": False}  # bidirectional: reuse is off unless asked for
    assert httpx.get(f"{url}/health/ready").json() == {"status": "ready", "prefix_cache": {"enabled": False}}
    text = httpx.get(f"{url}/metrics").text
    for name in ("ecache_queue_depth", "ecache_running_rows", "ecache_generated_tokens_total"):
        assert re.search(rf"^{name} ", text, flags=re.M), name


def test_sixteen_concurrent_chats_get_what_generate_gives_each_prompt_alone(server):
    url, _ = server
    c = client(url)
    alone = generate(*PROMPTS)
    sampled_alone = generate("--cache", "none", "--temperature", "0.7", "--seed", "3", PROMPTS[0])[0]

    def chat(prompt):
        return c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=GEN)

    def sampled():  # another group (policy, temperature) running beside the 16
        return c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                         max_tokens=GEN, temperature=0.7, seed=3, extra_body={"policy": "none"})

    with ThreadPoolExecutor(18) as pool:
        other = [pool.submit(sampled) for _ in range(2)]
        got = list(pool.map(chat, PROMPTS))
    for prompt, ref, resp in zip(PROMPTS, alone, got):
        assert resp.choices[0].message.content == ref["text"], prompt
        assert resp.choices[0].finish_reason == ("stop" if ref["ended"] else "length")
        assert resp.usage.prompt_tokens == ref["stats"]["prompt_tokens"]
        assert resp.usage.completion_tokens == len(ref["token_ids"])
    assert max(r.model_extra["ecache"]["group_rows"] for r in got) > 1, "the requests never shared a run"
    for f in other:
        assert f.result().choices[0].message.content == sampled_alone["text"]
        assert f.result().model_extra["ecache"]["policy"] == "none"


def test_completion_is_the_prompt_as_given_like_generate_no_chat(server):
    url, _ = server
    ref = generate("--no-chat", SORT)[0]
    assert ref["text"] == "1 3 7 9"
    resp = client(url).completions.create(model="tiny", prompt=SORT, max_tokens=GEN)
    assert resp.object == "text_completion" and resp.choices[0].text == ref["text"]
    assert resp.usage.prompt_tokens == ref["stats"]["prompt_tokens"]


def test_max_tokens_cuts_the_answer_with_finish_reason_length(server):
    url, _ = server
    c = client(url)
    body = dict(model="tiny", prompt="Sort: 9 3 7 1", extra_body={"ignore_eos": True})
    full, cut = c.completions.create(max_tokens=32, **body), c.completions.create(max_tokens=5, **body)
    assert full.choices[0].finish_reason == cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == 5 and full.usage.completion_tokens == 32
    # 5 tokens get one whole block of 32 positions: the same canvas as 32 tokens, cut after 5
    assert cut.model_extra["ecache"]["gen_length"] == full.model_extra["ecache"]["gen_length"] == 32
    assert full.choices[0].text.startswith(cut.choices[0].text) and len(cut.choices[0].text) < len(full.choices[0].text)


def test_stop_string_ends_the_answer_before_it(server, tiny):
    url, _ = server
    c = client(url)
    ref = c.completions.create(model="tiny", prompt=SORT, max_tokens=GEN).choices[0].text
    assert ref == "1 3 7 9"
    resp = c.completions.create(model="tiny", prompt=SORT, max_tokens=GEN, stop=[" 7"])
    assert resp.choices[0].text == "1 3" and resp.choices[0].finish_reason == "stop"
    # usage counts the tokens of the text returned, whichever step found the stop string
    assert resp.usage.completion_tokens == len(tiny.tokenizer.encode("1 3", add_special_tokens=False)) == 3
    early = c.completions.create(model="tiny", prompt=SORT, max_tokens=GEN, stop="3")
    assert early.choices[0].text == "1 " and early.usage.completion_tokens == 2


# --- streaming -------------------------------------------------------------------------------------------


def test_streaming_sends_the_final_text_in_order_then_done(server):
    url, _ = server
    c = client(url)
    body = dict(model="tiny", messages=[{"role": "user", "content": "Sort: 5 2 8 2 9 1"}], max_tokens=32,
                extra_body={"ignore_eos": True})
    whole = c.chat.completions.create(**body).choices[0].message.content
    chunks = list(c.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    texts = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert "".join(texts) == whole and len(texts) > 3, texts  # many chunks, as tokens become final
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 32 and chunks[-1].choices == []
    raw = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": "tiny", "prompt": SORT, "max_tokens": 32, "stream": True}).text
    events = [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "1 3 7 9"


def test_a_client_that_disconnects_frees_its_row(small):
    url, app = small
    c = client(url)
    before = metric(url, "ecache_requests_total", endpoint="completions", outcome="cancelled")
    stream = c.completions.create(model="tiny", prompt=SORT, max_tokens=GEN, stream=True,
                                  extra_body={"ignore_eos": True, "steps": 4 * GEN})
    next(iter(stream))  # the row is decoding
    assert app.state.scheduler.counts()[0] == 1
    stream.close()
    wait_for(lambda: app.state.scheduler.counts() == (0, 0), "the cancelled row to leave")
    assert metric(url, "ecache_requests_total", endpoint="completions", outcome="cancelled") == before + 1
    assert metric(url, "ecache_running_rows") == 0
    # the one row is free again: the next request is served (not refused as queue_full), and answers unless this
    # server's 1.5 s request timeout ends it first on a loaded machine
    choice = c.completions.create(model="tiny", prompt=SORT, max_tokens=GEN).choices[0]
    assert choice.finish_reason == "timeout" or choice.text == "1 3 7 9", choice


# --- errors and limits ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"extra_body": {"policy": "lru"}}, "policy"),
    ({"extra_body": {"tau": -1.0}}, "tau"),
    ({"extra_body": {"threshold": 1.5}}, "threshold"),
    ({"extra_body": {"block_length": 0}}, "block_length"),
    ({"extra_body": {"block_length": 5000}}, "block_length"),  # one block is longer than the model's positions
    ({"max_tokens": 64, "extra_body": {"steps": 3}}, "steps"),  # 2 blocks of 32: steps must be a multiple of 2
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"extra_body": {"max_tokens": "ten"}}, "max_tokens"),
    ({"prompt": "x " * 300}, "prompt"),  # over --max-prompt-tokens 200
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"seed": -5}, "seed"),  # not wrapped modulo 2**64 into another stream
    ({"seed": 1 << 64}, "seed"),
])
def test_bad_values_are_400s_naming_the_field(server, kwargs, param):
    url, _ = server
    body = {"model": "tiny", "prompt": SORT, "max_tokens": 16, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client(url).completions.create(**body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]


def test_request_fields_take_the_flags_range_and_words(server):
    """A request's temperature and seed are checked as ``ecache generate --temperature/--seed`` are: the
    flag's range (temperature 3 is served, as the flag takes it) and its message after the field's name."""
    url, _ = server
    c = client(url)
    hot = c.completions.create(model="tiny", prompt=SORT, max_tokens=GEN, temperature=3.0, seed=1)
    assert hot.choices[0].finish_reason in ("stop", "length")
    for kwargs, message in (({"temperature": -1.0}, "temperature -1.0 must be ≥ 0 (0 = greedy; e.g. 0.7)"),
                            ({"seed": -1}, "seed -1 must be ≥ 0 (a 64-bit seed; e.g. 0)")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt=SORT, max_tokens=GEN, **kwargs)
        assert e.value.body["message"] == message, e.value.body


def test_chat_errors_name_the_field(server):
    url, _ = server
    c = client(url)
    for messages, param in (([], "messages"), ([{"role": "wizard", "content": "hi"}], "messages.0.role")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=messages)
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                  max_completion_tokens=16)
    assert e.value.body["param"] == "max_completion_tokens"
    resp = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Sort: 9 3 7 1"}],
                                     max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"


def test_api_key_is_required_when_set(server):
    url, _ = server
    with pytest.raises(openai.AuthenticationError) as e:
        client(url, key="wrong").models.list()
    assert e.value.status_code == 401
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi"})  # no Authorization header
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health").status_code == 200  # probes need no key


def test_body_too_large_is_413_and_bad_json_400(small):
    url, _ = small
    r = httpx.post(f"{url}/v1/completions", content=b'{"model": "tiny", "prompt": "' + b"x" * 5000 + b'"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("depth", [400, 900, 5000])
def test_deeply_nested_json_is_a_400_in_the_apis_shape(server, depth):
    """A small body of arrays nested thousands deep (past the JSON parser's recursion limit) or hundreds
    deep (parsed, then refused by the schema) is a 400 with an OpenAI error, on both APIs."""
    url, _ = server
    body = '{"model": "tiny", "messages": ' + "[" * depth + "]" * depth + "}"
    for path in ("/v1/chat/completions", "/api/chat"):
        r = httpx.post(f"{url}{path}", content=body.encode(), headers={"authorization": f"Bearer {KEY}",
                                                                      "content-type": "application/json"})
        assert r.status_code == 400, (path, depth, r.status_code, r.text[:200])
        message = r.json()["error"]["message"] if path.startswith("/v1") else r.json()["error"]
        assert "\n" not in message and len(message) < 400, message
        if depth == 5000:
            assert "nests arrays or objects too deeply" in message
    assert httpx.get(f"{url}/health").status_code == 200  # still serving


def test_text_that_spells_the_mask_token_is_a_400_as_the_command_line_says(server):
    """The mask token's literal text in a prompt encodes to the mask id: refused as `ecache generate` and
    a token-id prompt refuse it, on the chat, completion and Ollama routes."""
    url, _ = server
    mask = "<|mdm_mask|>"
    auth = {"authorization": f"Bearer {KEY}"}
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Sort: 3 1 {mask}"}],
                                                 "max_tokens": 8}),
                       ("/v1/completions", {"prompt": f"Sort: 3 1 {mask}", "max_tokens": 8}),
                       ("/api/generate", {"prompt": f"Sort: 3 1 {mask}", "stream": False,
                                          "options": {"num_predict": 8}})):
        r = httpx.post(f"{url}{path}", json={"model": "tiny", **body}, headers=auth, timeout=60)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        message = r.json()["error"]["message"] if path.startswith("/v1") else r.json()["error"]
        assert f"the text holds the mask token '{mask}' (token id 2, at position " in message, message
        assert message.endswith("a prompt holds no mask tokens; remove it from the text"), message


def test_full_queue_is_429_with_retry_after_and_timeout_ends_a_request(small):
    url, app = small
    c = client(url, key="unused")
    long = {"model": "tiny", "prompt": SORT, "max_tokens": 4 * GEN, "ignore_eos": True, "steps": 64 * GEN}
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(lambda: httpx.post(f"{url}/v1/completions", json=long, timeout=60).json())
        wait_for(lambda: app.state.scheduler.counts()[0] == 1, "the first request to run")
        with pytest.raises(openai.RateLimitError) as e:  # one row, no queue: refused at once
            c.completions.create(model="tiny", prompt="Reverse: 1 2 3", max_tokens=8)
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        done = first.result()
    # --request-timeout 1.5 s: 4096 steps take longer; the text so far comes back
    assert done["choices"][0]["finish_reason"] == "timeout", done
    assert 0 < done["usage"]["completion_tokens"] < 4 * GEN
    assert metric(url, "ecache_requests_total", endpoint="completions", outcome="queue_full") == 1


def test_an_engine_fault_fails_its_requests_with_500_and_the_server_keeps_serving(server, monkeypatch):
    from ecache_cli.engine.core import Run

    url, _ = server
    c = client(url)
    step = Run._step

    def faulty(self):
        if self.cfg.block_length == 16:  # only the group of block_length 16 breaks
            raise RuntimeError("injected fault")
        return step(self)

    monkeypatch.setattr(Run, "_step", faulty)
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model="tiny", prompt=SORT, max_tokens=16, extra_body={"block_length": 16})
    assert e.value.status_code == 500 and "injected fault" in e.value.body["message"]
    assert c.completions.create(model="tiny", prompt=SORT, max_tokens=GEN).choices[0].text == "1 3 7 9"
    monkeypatch.setattr(Run, "_step", step)
    ok = c.completions.create(model="tiny", prompt=SORT, max_tokens=16, extra_body={"block_length": 16})
    assert ok.choices[0].finish_reason in ("stop", "length")


# --- the command: loopback notice, SIGTERM ----------------------------------------------------------------


def test_serve_command_says_loopback_and_exits_0_on_sigterm_ending_running_requests(tmp_path):
    env = {**os.environ, "ECACHE_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "XDG_CONFIG_HOME": str(tmp_path / "config")}
    env.pop("ECACHE_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "ecache_cli", "serve", "--port", "0", "--gen-length", str(GEN),
                             "--shutdown-grace", "0.5", "--access-log"], cwd=tmp_path, env=env, stderr=subprocess.PIPE,
                            text=True)
    try:
        lines = []
        for line in proc.stderr:  # bounded by the process: it prints the address before serving
            lines.append(line)
            if "listening on" in line:
                break
        url = re.search(r"http://127\.0\.0\.1:\d+", "".join(lines)).group(0)
        body = {"model": "tiny", "prompt": SORT, "max_tokens": 1024, "stream": True, "ignore_eos": True,
                "steps": 4096}
        finish, draining = [], []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    if not finish:
                        proc.send_signal(signal.SIGTERM)  # the row is running
                        time.sleep(0.1)
                        # during the grace the socket stays open: a load balancer sees 503s, not refusals
                        draining.append(httpx.get(f"{url}/health", timeout=10).status_code)
                        draining.append(httpx.post(f"{url}/v1/completions", json={**body, "stream": False},
                                                   timeout=10).status_code)
                    finish.append(json.loads(line[6:])["choices"][0]["finish_reason"])
        assert finish[-1] == "shutdown" and set(finish[:-1]) == {None}
        assert draining == [503, 503]
        assert proc.wait(30) == 0
        rest = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "listening on loopback only" in "".join(lines) + rest and "stopped" in rest
    # --access-log: one line per request, on stderr, carrying its x-request-id (uvicorn's own line is off)
    health = [line for line in rest.splitlines() if '"GET /health HTTP/1.1" 503' in line]
    assert len(health) == 1 and re.fullmatch(r'request [0-9a-f]{32} 127\.0\.0\.1:\d+ "GET /health HTTP/1\.1" 503',
                                              health[0]), rest


def test_serve_quiet_drops_the_start_up_lines_and_keeps_warnings(monkeypatch):
    import socket

    from typer.testing import CliRunner

    import ecache_cli.serve.app as serve_app
    from ecache_cli.cli import app

    served = []
    monkeypatch.setattr(serve_app, "run_server", lambda app, sock, **kw: served.append(sock.close()))
    monkeypatch.delenv("ECACHE_API_KEY", raising=False)
    with socket.socket() as s:  # a port free now (the command binds it again)
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])

    def stderr(*args):
        res = CliRunner().invoke(app, ["serve", "--gen-length", str(GEN), "--port", port, *args])
        assert res.exit_code == 0, res.stderr
        return res.stderr.splitlines()

    loud = stderr()
    assert loud[0].startswith("using model tiny, cache entropy") and f"listening on http://127.0.0.1:{port} " in loud[1]
    assert loud[1].startswith("ecache serve: model tiny on cpu, ")
    named = stderr("--served-model-name", "mytiny")  # the name clients use, beside the model it serves
    assert named[1].startswith("ecache serve: model mytiny (--model tiny) on cpu, "), named
    assert loud[2].startswith("no --api-key: listening on loopback only") and loud[3:] == ["ecache serve: stopped"]
    assert stderr("-q") == [] and stderr("--quiet") == []
    opened = stderr("-q", "--host", "0.0.0.0")  # a warning is not progress: it stays
    assert len(opened) == 1 and opened[0].startswith("warning: no --api-key and --host 0.0.0.0")
    res = CliRunner().invoke(app, ["serve", "--gen-length", str(GEN), "--port", "0", "-q"])
    line = res.stderr.splitlines()  # --port 0: the address it picked is printed nowhere else, so it stays
    assert res.exit_code == 0 and len(line) == 1 and re.search(r"listening on http://127\.0\.0\.1:\d+ ", line[0])
    unused = stderr("--refresh-every", "0")  # a flag the policy ignores: warned after the first line, as elsewhere
    assert unused[0].startswith("using model tiny, cache entropy"), unused
    assert unused[1].startswith("warning: --refresh-every is not used by --cache entropy"), unused
    assert len(served) == 7  # every run reached the server loop


@pytest.mark.parametrize("host", ["bogus..host", "a" * 64 + ".example"])  # an empty label, one over 63 letters
def test_a_host_name_the_resolver_cannot_encode_is_one_line(host):
    from typer.testing import CliRunner

    from ecache_cli.cli import app

    res = CliRunner().invoke(app, ["serve", "--host", host, "--port", "0"])
    assert res.exit_code == 1 and res.stderr.strip() == (f"error: cannot listen on {host}:0 (not a valid host name); "
                                                         "pick another --host"), res.stderr


@pytest.mark.parametrize("args, needle", [
    (["--batching", "dynamic"], "--batching 'dynamic' is not a batching mode; use one of continuous, static"),
    (["--admission", "greedy"], "--admission 'greedy' is not an admission rule; use one of always, fcfs, auto"),
    (["--batching", "static", "--admission", "always"],
     "--batching static is --admission fcfs"),
    (["--served-model-name", " "], "--served-model-name is empty"),
    (["--max-batch", "0"], "--max-batch 0"),
    (["--request-timeout", "0"], "--request-timeout 0"),
    (["--request-timeout", "nan"], "--request-timeout nan"),
    (["--shutdown-grace", "inf"], "--shutdown-grace inf"),
    (["--max-body-bytes", str(1 << 40)],
     f"--max-body-bytes {1 << 40} must be ≤ 1073741824 (bytes, at most 1 GiB"),
    (["--gen-length", "4096", "-q"], "--gen-length 4096 leaves no room"),
    (["--api-key", " "], "--api-key is empty")])
def test_bad_serve_flags_are_one_line_usage_errors(args, needle):
    from typer.testing import CliRunner

    from ecache_cli.cli import app

    res = CliRunner().invoke(app, ["serve", *args])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr


def test_the_bound_socket_already_listens_so_an_early_client_waits_instead_of_being_refused():
    """The address is printed before the server's loop starts: a client connecting then is queued."""
    import socket

    from ecache_cli.serve.app import bind

    sock = bind("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname()[:2], timeout=5):  # refused if bind did not listen
            pass
    finally:
        sock.close()


# --- operations: health probes, request ids, the served name, auto admission -----------------------------


def test_ready_only_once_the_engine_has_warmed_up_while_live_at_once(tiny, settings, monkeypatch):
    from ecache_cli.serve.scheduler import Scheduler

    release, warm_up = threading.Event(), Scheduler._warm_up

    def slow_warm_up(self):
        release.wait(20)
        warm_up(self)

    monkeypatch.setattr(Scheduler, "_warm_up", slow_warm_up)
    with serving(tiny, settings, ready=False) as (url, _):
        assert httpx.get(f"{url}/health/live").status_code == 200
        r = httpx.get(f"{url}/health/ready")
        assert r.status_code == 503 and r.json()["status"] == "warming_up"
        assert httpx.get(f"{url}/health").json()["status"] == "warming_up"
        release.set()
        wait_for(lambda: httpx.get(f"{url}/health/ready").status_code == 200, "the warm-up to end")
        assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_x_request_id_is_echoed_or_made_and_logged(server, caplog):
    url, _ = server
    with caplog.at_level("INFO", logger="ecache.serve"):
        given = httpx.get(f"{url}/health", headers={"x-request-id": "trace-42.a:b"})
        made = httpx.get(f"{url}/health")
        odd = httpx.get(f"{url}/health", headers={"x-request-id": "two words"})
    assert given.headers["x-request-id"] == "trace-42.a:b"
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    assert re.fullmatch(r"[0-9a-f]{32}", odd.headers["x-request-id"])  # not echoed: it would break log lines
    assert re.search(r'trace-42\.a:b 127\.0\.0\.1:\d+ "GET /health HTTP/1\.1" 200', caplog.text), caplog.text
    bad = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}", "x-request-id": "e1"},
                     json={"model": "tiny", "prompt": SORT, "temperature": -9})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "e1"  # errors carry it too


@pytest.fixture(scope="module")
def named(tiny, settings):
    """--served-model-name my-model, --admission auto (the default), no key."""
    with serving(tiny, settings, name="my-model", max_batch=8) as s:
        yield s


def test_served_model_name_is_the_id_clients_use_and_retrieve(named):
    url, _ = named
    c = client(url, key="unused")
    assert [m.id for m in c.models.list().data] == ["my-model"]
    assert c.models.retrieve("my-model").id == "my-model"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("tiny")
    assert e.value.body["code"] == "model_not_found"
    resp = c.chat.completions.create(model="my-model", messages=[{"role": "user", "content": "Sort: 9 3 7 1"}])
    assert resp.model == "my-model" and resp.choices[0].message.content == "1 3 7 9"
    with pytest.raises(openai.NotFoundError) as e:  # 404 model_not_found on every route, as OpenAI's
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["param"] == "model" and "'my-model'" in e.value.body["message"]
    assert e.value.body["code"] == "model_not_found"


def test_auto_admission_gives_each_request_what_generate_gives_it_and_exports_its_model(named):
    url, app = named
    c = client(url, key="unused")
    prompts = PROMPTS[:6]
    alone = generate(*prompts)

    def chat(prompt):
        return c.chat.completions.create(model="my-model", messages=[{"role": "user", "content": prompt}],
                                         max_tokens=GEN).choices[0].message.content

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(chat, prompts))
    assert got == [ref["text"] for ref in alone]
    cost = app.state.scheduler.cost
    assert cost.steps > 0
    for term in ("base", "per_row", "per_position"):
        assert metric(url, "ecache_step_cost_seconds", term=term) == pytest.approx(getattr(cost, term))
    # every request was counted once as started (a new batch) or joined (running rows); held ones also once as held
    started = metric(url, "ecache_admissions_total", decision="started")
    joined = metric(url, "ecache_admissions_total", decision="joined")
    assert started >= 1 and started + joined >= len(prompts)
    assert metric(url, "ecache_admissions_total", decision="held") <= started + joined
    from cli_helpers import load_bench  # bench/serve_load.py reads the same counters per pass
    counted = load_bench("serve_load").admissions(url)
    for d in ("started", "joined", "held"):  # a decision never taken has no sample yet
        assert counted.get(d, 0.0) == metric(url, "ecache_admissions_total", decision=d)
    assert counted["started"] == started
    assert httpx.get(f"{url}/health").json()["admission"] == "auto"


# --- the current OpenAI request schema -----------------------------------------------------------------


def test_current_client_fields_are_accepted_and_the_ignored_ones_named_in_a_warning(named):
    url, _ = named
    c = client(url, key="unused")
    msg = [{"role": "user", "content": "Sort: 9 3 7 1"}]
    raw = c.chat.completions.with_raw_response.create(
        model="my-model", messages=msg, store=True, metadata={"team": "a"}, user="u1", service_tier="auto",
        prompt_cache_key="k", parallel_tool_calls=False, tool_choice="none", stream=False)
    assert raw.parse().choices[0].message.content == "1 3 7 9"
    warning = raw.headers["warning"]
    assert warning.startswith('299 ecache "accepted and ignored: ')
    for field in ("user", "store", "metadata", "service_tier", "prompt_cache_key", "parallel_tool_calls",
                  "tool_choice (no tools are called)"):
        assert field in warning
    plain = c.chat.completions.with_raw_response.create(model="my-model", messages=msg)
    assert "warning" not in plain.headers
    parts = c.chat.completions.create(model="my-model", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Sort: 9 3"}, {"type": "text", "text": " 7 1"}]}])
    assert parts.choices[0].message.content == "1 3 7 9"


def test_every_parameter_of_the_installed_client_is_a_field_the_server_knows():
    """Each parameter the installed ``openai`` client's ``chat.completions.create`` and ``completions.create``
    can send is a field of the server's request schema (accepted, ignored with a Warning, or refused with
    a reason), never "unrecognized"; the client's own transport options are not sent as fields."""
    import inspect

    from openai.resources.chat.completions import Completions as Chat
    from openai.resources.completions import Completions

    from ecache_cli.serve.protocol import ChatRequest, CompletionRequest

    transport = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
    for method, schema in ((Chat.create, ChatRequest), (Completions.create, CompletionRequest)):
        sent = set(inspect.signature(method).parameters) - transport
        assert sent and sent <= set(schema.model_fields), sorted(sent - set(schema.model_fields))


def test_prompt_cache_fields_are_ignored_and_moderation_refused_saying_why(named):
    url, _ = named
    c = client(url, key="unused")
    msg = [{"role": "user", "content": "Sort: 9 3 7 1"}]
    raw = c.chat.completions.with_raw_response.create(
        model="my-model", messages=msg, prompt_cache_retention="24h", prompt_cache_options={"mode": "implicit"},
        moderation=None)
    assert raw.parse().choices[0].message.content == "1 3 7 9"
    assert raw.headers["warning"] == '299 ecache "accepted and ignored: prompt_cache_retention, prompt_cache_options"'
    for moderation in ({"model": "omni-moderation-latest"}, True):  # refused for what it asks, not for its type
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "my-model", "messages": msg,
                                                           "moderation": moderation})
        assert r.status_code == 400 and r.json()["error"]["param"] == "moderation"
        assert r.json()["error"]["message"] == ("moderation is not supported (this server runs no moderation model); "
                                                "leave it out")
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "my-model", "messages": msg, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        'tool_choice is not supported (this server calls no tools); leave it out or use "none"')
    r = httpx.get(f"{url}/v1/models/nosuch")
    assert r.status_code == 404 and r.json()["error"]["message"] == (
        "model 'nosuch' is not served here; this server serves 'my-model' (GET /v1/models)")


def test_stored_completion_routes_say_stored_completions_are_not_supported(named):
    """The client's stored-completions methods (list, retrieve, update, delete, messages.list) reach routes
    that answer OpenAI's error shape with a 404 saying none is stored; the client raises NotFoundError with
    that message (not a bare 404/405, and not a 5xx it would retry)."""
    url, _ = named
    c = client(url, key="unused").chat.completions
    calls = {"list": lambda: c.list(), "retrieve": lambda: c.retrieve("chatcmpl-1"),
             "update": lambda: c.update("chatcmpl-1", metadata={"a": "b"}), "delete": lambda: c.delete("chatcmpl-1"),
             "messages.list": lambda: c.messages.list("chatcmpl-1")}
    for name, call in calls.items():
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.status_code == 404, name
        assert e.value.body["code"] == "stored_completions_not_supported", (name, e.value.body)
        assert e.value.body["message"].startswith("stored chat completions are not supported"), name
    assert httpx.post(f"{url}/v1/chat/completions", json={  # the create route is still POST's
        "model": "my-model", "messages": [{"role": "user", "content": "Sort: 9 3 7 1"}]}, timeout=60).status_code == 200


@pytest.mark.parametrize("messages,param,message", [
    ([{"role": "user", "content": ""}], "messages.0.content",
     "messages[0] (user) has empty content; give it some text"),
    ([{"role": "system", "content": " "}, {"role": "user", "content": [{"type": "text", "text": ""}]}], "messages",
     "every message has empty content (messages[0] (system), messages[1] (user)); give at least one of them some "
     "text"),
])
def test_messages_without_text_are_named(named, messages, param, message):
    """A message with no text is named by its place and role; one whose content is not text in --input's words."""
    url, _ = named
    with pytest.raises(openai.BadRequestError) as e:
        client(url, key="unused").chat.completions.create(model="my-model", messages=messages)
    assert e.value.body["param"] == param and e.value.body["message"] == message
    r = httpx.post(f"{url}/api/chat", json={"model": "my-model", "messages": messages[-1:] if param != "messages"
                                            else [{"role": "user", "content": ""}], "stream": False})
    assert r.status_code == 400 and r.json() == {"error": "messages[0] (user) has empty content; give it some text"}
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "my-model", "messages": [{"role": "user",
                                                                                         "content": 5}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == ("messages[0] 'content' must be a string or a "
                                                                     "list of text parts, not 5"), r.text
    no_text = [{"role": "user", "content": [{"type": "text"}]}]  # the cause named, not "not supported"
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "my-model", "messages": no_text})
    want = "messages[0].content[0]: a text part needs its 'text' ({\"type\": \"text\", \"text\": ...})"
    assert r.status_code == 400 and r.json()["error"]["message"] == want, r.text


def test_developer_and_tool_messages_reach_the_chat_template(named, tiny):
    url, _ = named
    c = client(url, key="unused")
    ask = {"role": "user", "content": "Sort: 9 3 7 1"}
    as_system = c.chat.completions.create(model="my-model", messages=[{"role": "system", "content": "Be brief."}, ask],
                                          max_tokens=8, extra_body={"ignore_eos": True})
    as_developer = c.chat.completions.create(model="my-model", messages=[{"role": "developer", "content": "Be brief."},
                                                                        ask], max_tokens=8,
                                             extra_body={"ignore_eos": True})
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens
    tool = c.chat.completions.create(model="my-model", max_tokens=8, messages=[
        ask, {"role": "assistant", "content": "1 3 7 9"}, {"role": "tool", "tool_call_id": "c1", "content": "42"}])
    template = tiny.tokenizer.apply_chat_template(
        [ask, {"role": "assistant", "content": "1 3 7 9"}, {"role": "tool", "content": "42"}],
        tokenize=True, add_generation_prompt=True)
    assert tool.usage.prompt_tokens == len(template)


@pytest.mark.parametrize("extra, param", [
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"service_tax": 1}, "service_tax"),  # in no schema: unrecognized
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]}, "messages.0.tool_calls"),
    ({"temperature": -1}, "temperature"),
])
def test_fields_that_would_change_the_answer_are_refused_in_one_line(named, extra, param):
    url, _ = named
    with pytest.raises(openai.BadRequestError) as e:  # extra_body: sent as given, over the typed arguments
        client(url, key="unused").chat.completions.create(
            model="my-model", messages=[{"role": "user", "content": "hi"}], extra_body=extra)
    err = e.value.body
    assert err["param"] == param and err["message"] and "\n" not in err["message"], err


def test_a_bad_temperature_gets_the_clis_message(named):
    from typer.testing import CliRunner

    from ecache_cli.cli import app

    url, _ = named
    r = httpx.post(f"{url}/v1/completions", json={"model": "my-model", "prompt": SORT, "temperature": -1})
    cli = CliRunner().invoke(app, ["generate", "--temperature", "-1", "hi"])  # each names the value as given
    message = r.json()["error"]["message"]
    assert message == "temperature -1 must be ≥ 0 (0 = greedy; e.g. 0.7)"
    assert cli.exit_code == 2 and cli.stderr.strip() == f"error: --{message}"


# --- Ollama's API ----------------------------------------------------------------------------------------


def ndjson(r) -> list[dict]:
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def test_ollama_tags_version_and_generate_give_the_openai_answer(named):
    url, _ = named
    tags = httpx.get(f"{url}/api/tags").json()["models"]
    assert [m["name"] for m in tags] == ["my-model"] and tags[0]["details"]["family"] == "llada"
    assert httpx.get(f"{url}/api/version").json()["version"]
    body = {"model": "my-model:latest", "prompt": "Sort: 9 3 7 1", "options": {"num_predict": 64, "temperature": 0}}
    one = httpx.post(f"{url}/api/generate", json={**body, "stream": False}, timeout=60).json()
    assert one["response"] == "1 3 7 9" and one["done"] is True and one["done_reason"] == "stop"
    assert one["eval_count"] > 0 and one["prompt_eval_count"] > 0 and one["total_duration"] > 0
    lines = ndjson(httpx.post(f"{url}/api/generate", json=body, timeout=60))  # stream: Ollama's default
    assert "".join(x["response"] for x in lines) == "1 3 7 9"
    assert [x["done"] for x in lines][-1] is True and not any(x["done"] for x in lines[:-1])
    raw = httpx.post(f"{url}/api/generate", json={"model": "my-model", "prompt": SORT, "raw": True,
                                                  "stream": False}, timeout=60).json()
    assert raw["response"] == "1 3 7 9"  # the prompt as given, like /v1/completions
    load = httpx.post(f"{url}/api/generate", json={"model": "my-model"}).json()
    assert load["done"] is True and load["done_reason"] == "load"


def test_ollama_chat_streams_the_answer_and_names_ignored_options(named):
    url, _ = named
    body = {"model": "my-model", "messages": [{"role": "user", "content": "Reverse: 1 2 3"}],
            "options": {"num_ctx": 4096, "seed": 1}, "keep_alive": "5m", "think": False}
    openai_answer = client(url, key="unused").chat.completions.create(
        model="my-model", messages=body["messages"]).choices[0].message.content
    r = httpx.post(f"{url}/api/chat", json=body, timeout=60)
    lines = ndjson(r)
    assert r.headers["content-type"].startswith("application/x-ndjson")
    assert "".join(x["message"]["content"] for x in lines) == openai_answer
    assert lines[-1]["done"] is True and lines[-1]["message"]["role"] == "assistant"
    assert r.headers["warning"] == '299 ecache "accepted and ignored: keep_alive, think, options.num_ctx"'


@pytest.mark.parametrize("route, extra, status, needle", [
    ("chat", {"options": {"mirostat": 2}}, 400, "options.mirostat is not supported"),
    ("chat", {"format": "json"}, 400, "format is not supported"),
    ("chat", {"think": True}, 400, "think is not supported by this server (the model does not think apart"),
    ("chat", {"options": {"top_k": 0}}, 400, "top_k 0 must be ≥ 1"),
    ("generate", {"images": ["aGk="]}, 400, "images is not supported"),
    ("generate", {"model": "llama3"}, 404, "model 'llama3' is not served here"),
    ("generate", {"options": {"temperature": -7.0}}, 400, "temperature -7.0 must be ≥ 0 (0 = greedy; e.g. 0.7)"),
    ("chat", {"frobnicate": 1}, 400, "unrecognized request argument 'frobnicate'"),
    ("chat", {"options": {"num_predict": 0}}, 400, "num_predict 0 must be ≥ 1"),
    ("generate", {"options": {"num_predict": 100000}}, 400, "+ num_predict 100000 exceeds the model's 4096 positions"),
    ("generate", {"model": None}, 400, "'model' is required"),  # as the OpenAI routes word it
    ("chat", {"model": None}, 400, "'model' is required"),
    ("generate", {"prompt": "9 " * 3000}, 400, "prompt has 60"),  # the field sent, not the messages it became
    ("generate", {"prompt": "9 " * 3000, "system": "Sort:"}, 400, "prompt and system have 60"),
])
def test_ollama_refusals_are_ollama_errors(named, route, extra, status, needle):
    """Each refusal is Ollama's ``{"error": ...}`` naming the field the client sent (``num_predict``, never
    the OpenAI ``max_tokens`` it is translated into)."""
    url, _ = named
    body = {"model": "my-model", "stream": False, **({"messages": [{"role": "user", "content": "hi"}]}
                                                     if route == "chat" else {"prompt": "hi"}), **extra}
    r = httpx.post(f"{url}/api/{route}", json=body)
    assert r.status_code == status and needle in r.json()["error"], r.text
    assert "max_tokens" not in r.json()["error"] and "messages" not in r.json()["error"]


def test_a_canvas_past_the_models_positions_is_worded_as_generate_words_it(named, cli):
    """``max_tokens`` that leaves the prompt no room: the command line's sentence (``engine.checks
    .prompt_too_long``) with the field for the flag, and the rounding up to whole blocks said where it
    matters; Ollama's ``num_predict`` the same."""
    url, _ = named
    said = cli("generate", "--no-chat", "--gen-length", "100000", "Sort: 9 3 7 1").stderr.strip().splitlines()[-1]
    r = httpx.post(f"{url}/v1/completions", json={"model": "my-model", "prompt": "Sort: 9 3 7 1", "max_tokens": 100000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert said == "error: " + r.json()["error"]["message"].replace("max_tokens", "--gen-length"), (said, r.text)
    r = httpx.post(f"{url}/v1/completions", json={"model": "my-model", "prompt": "9 " * 100, "max_tokens": 3900})
    assert r.status_code == 400 and "+ max_tokens 3900 (in whole blocks of 32: 3904) exceeds the model's 4096 " \
        "positions; lower max_tokens to at most" in r.json()["error"]["message"], r.text


def test_top_p_greedy_decoding_drops_is_named_on_every_route(named, llada2):
    """``top_p`` at temperature 0 (greedy decoding: ``ecache generate --top-p`` warns it) is named in the
    Warning header on chat, completions, Ollama's chat (as ``options.top_p``) and a block-diffusion model;
    with temperature > 0 it samples, and no header names it."""
    url, _ = named
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "my-model", "messages": msgs, "max_tokens": 8,
                                                       "top_p": 0.5}, timeout=60)
    assert r.status_code == 200 and "top_p does nothing at temperature 0" in r.headers["warning"], r.text
    r = httpx.post(f"{url}/api/chat", json={"model": "my-model", "messages": msgs, "stream": False,
                                            "options": {"top_p": 0.5, "num_predict": 8}}, timeout=60)
    assert r.status_code == 200, r.text
    want = '299 ecache "accepted and ignored: options.top_p does nothing at temperature 0'
    assert r.headers["warning"].startswith(want), r.headers
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "my-model", "messages": msgs, "max_tokens": 8,
                                                       "top_p": 0.5, "temperature": 0.7}, timeout=60)
    assert r.status_code == 200 and "warning" not in r.headers, r.text
    url2, _ = llada2
    r = httpx.post(f"{url2}/v1/completions", json={"model": "l2", "prompt": "hi", "max_tokens": 8, "top_p": 0.5},
                   timeout=60)
    assert r.status_code == 200 and "top_p does nothing at temperature 0" in r.headers["warning"], r.text


def test_steps_a_blocks_masks_run_out_before_are_named_in_the_warning_header(named):
    """``steps`` beyond a block's masks under LLaDA's schedule (``ecache generate --steps`` warns it: the
    blocks' masks are gone first) is named in the Warning header in the command line's words; steps the
    blocks use are not."""
    url, _ = named
    body = {"model": "my-model", "prompt": "hi", "max_tokens": 8, "block_length": 8}
    r = httpx.post(f"{url}/v1/completions", json={**body, "steps": 64}, timeout=60)
    want = ('299 ecache "accepted and ignored: steps 64 gives each block 64 steps for its 8 masks; LLaDA\'s schedule '
            'commits them in the first 8, so at most 8 steps run (steps 8 is the same decoding)"')
    assert r.status_code == 200 and r.headers["warning"] == want, (r.text, r.headers)
    r = httpx.post(f"{url}/v1/completions", json={**body, "steps": 8}, timeout=60)
    assert r.status_code == 200 and "warning" not in r.headers, r.headers


# --- settings that do not fit the model: refused before serving, or per request ---------------------------


@pytest.mark.parametrize("args,says", [
    (["--edit-threshold", "0.9"], "--edit-threshold is LLaDA2.1's token editing"),
    (["--cache", "block"], "--cache block does not apply to the llada model family"),
    (["--model", "tests/fixtures/sdar", "--cache", "entropy"], "--cache entropy does not apply to the sdar model")],
    ids=["edit-threshold-on-tiny", "block-on-tiny", "entropy-on-sdar"])
def test_serve_refuses_defaults_the_model_does_not_take_before_listening(cli, args, says):
    """The check a run of these settings meets (the policy's check_model, the decoder's build) runs before the
    server listens: exit 2 with the engine's one line, as ``ecache generate`` exits."""
    from pty_session import REPO

    args = [str(REPO / a) if a.startswith("tests/") else a for a in args]
    res = cli("serve", "--port", "0", "--quiet", *args)
    assert res.exit_code == 2, res.output
    assert says in res.stderr and "listening" not in res.stderr
    assert "Traceback" not in res.output


def test_a_failed_warm_up_leaves_the_server_unready(tiny, settings, monkeypatch):
    """A warm-up that fails (here every run's start) never reports ready: /health/ready stays 503 naming it."""
    from ecache_cli.engine.core import Engine

    def broken(self, *a, **k):
        raise RuntimeError("no engine today")

    monkeypatch.setattr(Engine, "start", broken)
    with serving(tiny, settings, ready=False) as (url, app):
        wait_for(lambda: app.state.scheduler.warmup_error is not None, "the warm-up to fail")
        r = httpx.get(f"{url}/health/ready")
        assert r.status_code == 503 and r.json() == {"status": "warmup_failed",
                                                     "error": "RuntimeError: no engine today"}
        assert httpx.get(f"{url}/health").json()["status"] == "warmup_failed"
        assert not app.state.scheduler.ready.is_set()


@pytest.mark.parametrize("stop_during_the_wait", [True, False])
def test_a_warm_up_failure_the_servers_stop_follows_is_not_reported(tiny, monkeypatch, stop_during_the_wait):
    """A Ctrl-C to the process group also ends the compiler --compile runs: the warm-up fails at the moment
    the server stops, and that failure is the stop's, not reported; a failure with no stop after it is."""
    import threading
    import types

    from ecache_cli.engine.core import Engine
    from ecache_cli.serve import scheduler as sched_mod
    from ecache_cli.serve.metrics import ServeMetrics

    failed = threading.Event()

    def broken(self, *a, **k):
        failed.set()
        raise RuntimeError("the compiler was interrupted")

    said = []
    monkeypatch.setattr(Engine, "start", broken)
    monkeypatch.setattr(sched_mod.err, "print", lambda text, **k: said.append(text))
    sched = sched_mod.Scheduler(tiny, ServeMetrics(), 4, 10, "auto")
    job = types.SimpleNamespace(key=types.SimpleNamespace(cfg=None, prompt_width=0), prompt_ids=[1],
                                make_policy=lambda: None)
    warm = threading.Thread(target=sched.prepare, args=([job],))
    warm.start()
    assert failed.wait(30)
    if stop_during_the_wait:
        sched.stop()
    warm.join(30)
    assert sched.warmup_error == "RuntimeError: the compiler was interrupted" and not sched.ready.is_set()
    assert said == ([] if stop_during_the_wait else
                    ["ecache serve: the warm-up failed (RuntimeError: the compiler was interrupted); /health/ready "
                     "stays 503"])


def test_an_engine_thread_that_outlives_the_stop_is_recorded(tiny, monkeypatch):
    """A stop that cannot end the engine thread in time (a ``--compile`` call it cannot leave) records the
    thread in ``interrupts.outliving``, so ``__main__`` ends the process without tearing it down; a thread
    that ends within the wait is not recorded."""
    import threading
    import types

    from ecache_cli import interrupts
    from ecache_cli.engine.core import Engine
    from ecache_cli.serve import scheduler as sched_mod
    from ecache_cli.serve.metrics import ServeMetrics

    inside, leave = threading.Event(), threading.Event()

    def compiling(self, *a, **k):
        inside.set()
        leave.wait(30)
        raise RuntimeError("the compiler was interrupted")

    monkeypatch.setattr(Engine, "start", compiling)
    monkeypatch.setattr(interrupts, "outliving", [])
    monkeypatch.setattr(sched_mod.err, "print", lambda text, **k: None)
    job = types.SimpleNamespace(key=types.SimpleNamespace(cfg=None, prompt_width=0), prompt_ids=[1],
                                make_policy=lambda: None)
    sched = sched_mod.Scheduler(tiny, ServeMetrics(), 4, 10, "auto")
    sched.start([job])
    assert inside.wait(30)
    sched.stop(timeout=0.2)
    assert interrupts.outliving == [sched._thread] and sched._thread.is_alive()
    leave.set()
    sched._thread.join(30)
    assert not sched._thread.is_alive()

    inside.clear()
    leave.clear()
    ended = sched_mod.Scheduler(tiny, ServeMetrics(), 4, 10, "auto")
    ended.start([job])
    assert inside.wait(30)
    threading.Timer(0.1, leave.set).start()
    ended.stop(timeout=30)
    assert interrupts.outliving == [sched._thread] and not ended._thread.is_alive()


@pytest.fixture(scope="module")
def llada2():
    """A server on the LLaDA2 block-diffusion fixture (cache block, the family's threshold)."""
    from pty_session import REPO

    path = REPO / "tests" / "fixtures" / "llada2-mini"
    lm = load_model(path, "cpu", "float32")
    with serving(lm, resolve_settings(str(path), {"gen_length": 16, "block_length": 8}, {}), name="l2", warmup=0) as s:
        yield s


@pytest.mark.parametrize("policy", ["entropy", "dual"])
def test_a_request_policy_the_model_does_not_take_is_a_400(llada2, policy):
    """On a block-diffusion model a request's approximate policy is refused as the CLI refuses --cache:
    400 naming ``policy``, also for a stream (before any event)."""
    url, _ = llada2
    want = (f"policy {policy} does not apply to the llada2 model family (its attention is block-causal, so the "
            "keys and values of finished blocks are cached exactly); use none or block")
    for stream in (False, True):
        r = httpx.post(f"{url}/v1/completions", json={"model": "l2", "prompt": "hi", "max_tokens": 8,
                                                     "policy": policy, "stream": stream}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "policy" and r.json()["error"]["message"] == want


def test_request_suggestions_fit_a_block_diffusion_model(llada2):
    """tau on a block-diffusion model says it does not apply (no 'use policy entropy'); an unknown policy
    lists the policies this model takes; a fitting request still answers."""
    url, _ = llada2

    def post(**extra):
        return httpx.post(f"{url}/v1/completions", json={"model": "l2", "prompt": "hi", "max_tokens": 8, **extra},
                          timeout=60)

    r = post(tau=0.5)  # ignored and named, as generate warns --tau on this model
    assert r.status_code == 200, r.text
    assert "tau (the llada2 model family takes no tau" in r.headers["warning"]
    r = post(policy="foo")
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "policy 'foo' is not a cache policy; use one of none, block"
    r = post(policy="block:x=1")  # chat's /cache NAME:k=v form: a policy this server lists, not refused as none
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "policy 'block:x=1' gives parameters; send the policy's name alone (\"policy\": 'block'): a request sets "
        "tau beside it, the server's flags and profile set the others")
    assert post(policy="none").status_code == 200


def test_serve_seed_draws_the_seeds_of_requests_without_one_from_one_stream(tiny, settings):
    """``ecache serve --seed S``: requests without a ``seed`` get the same seeds in every session with S
    (``generate --seed`` has one meaning for a command's own draws); a request's own seed is kept."""
    from ecache_cli.engine import Engine
    from ecache_cli.serve.protocol import CompletionRequest, Limits, Resolver, parse

    engine = Engine.from_loaded(tiny)

    def seeds(seed, given=None):
        r = Resolver(engine, tiny, settings, Limits(max_prompt_tokens=64, model_name="tiny", seed=seed))
        req = parse(CompletionRequest, {"model": "tiny", "prompt": "abc", **({"seed": given} if given else {})})
        return [r.job(req, "completions", [5, 6, 7]).seed for _ in range(3)]

    assert seeds(7) == seeds(7) and seeds(7) != seeds(8) and len(set(seeds(7))) == 3
    assert seeds(7, given=42) == [42, 42, 42]


# --- one rule with the command line ------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,flags", [
    ("tau", -1.0, ["--tau", "-1.0"]),  # the value as the request writes it
    ("tau", -1, ["--tau", "-1"]),
    ("threshold", 1.5, ["--threshold", "1.5"]),
    ("temperature", -1.0, ["--temperature", "-1.0"]),
    ("temperature", -1, ["--temperature", "-1"]),
    ("policy", "block", ["--cache", "block"]),
    ("max_tokens", 1.5, ["--gen-length", "1.5"]),  # not a whole number: the range's words, not pydantic's
    ("seed", 1.5, ["--seed", "1.5"]),
    ("top_k", 2.5, ["--top-k", "2.5"]),
    ("steps", "abc", ["--steps", "abc"]),
    ("seed", "abc", ["--seed", "abc"]),  # a text as typed, as every other field's
])
def test_a_bad_request_value_gets_generates_message_with_the_field_for_the_flag(named, field, value, flags):
    """README: every bad value is a 400 in ``ecache generate``'s words; the field the client sent stands
    where generate names its flag, and the message is otherwise the same, word for word."""
    from typer.testing import CliRunner

    from ecache_cli.cli import app

    url, _ = named
    r = httpx.post(f"{url}/v1/completions", json={"model": "my-model", "prompt": SORT, "max_tokens": 16,
                                                  field: value}, timeout=60)
    canvas = ["--gen-length", "16", "--block-length", "16"] if field == "steps" else []  # steps' example fits it
    cli = CliRunner().invoke(app, ["generate", *canvas, *flags, "hi"])
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert cli.exit_code == 2, cli.stderr
    assert cli.stderr.strip() == "error: " + r.json()["error"]["message"].replace(f"{field} ", f"{flags[0]} ", 1)


@pytest.mark.parametrize("route,body,param,message", [
    ("completions", '"max_tokens": 1.5', "max_tokens", "max_tokens 1.5 must be a whole number ≥ 1 (e.g. 256)"),
    ("completions", '"max_tokens": 32.0', "max_tokens", "max_tokens 32.0 must be a whole number ≥ 1 (e.g. 256)"),
    ("completions", '"block_length": true', "block_length", "block_length true must be a whole number ≥ 1 (e.g. 32)"),
    ("completions", '"temperature": "0.5"', "temperature",
     "temperature '0.5' must be a number, not a string (e.g. 0.5)"),
    ("completions", '"seed": "7"', "seed", "seed '7' must be a number, not a string (e.g. 7)"),
    ("completions", '"tau": "-1"', "tau", "tau -1 must be ≥ 0 (an entropy in nats; e.g. 0.5)"),  # the range first
    ("completions", '"tau": 1e400', "tau", "tau 1e400 must be a finite number ≥ 0 (an entropy in nats; e.g. 0.5)"),
    ("completions", '"threshold": NaN', "threshold",
     "threshold NaN must be a finite number in (0, 1] (a confidence; e.g. 0.9)"),
    ("completions", '"steps": 1e400', "steps", "steps 1e400 must be a whole number ≥ 1 (e.g. 256)"),
    ("completions", '"n": 1.5', "n", "n 1.5 must be a whole number"),  # no flag's range: the kind alone
    ("chat", '"max_completion_tokens": 2.5', "max_completion_tokens",
     "max_completion_tokens 2.5 must be a whole number ≥ 1 (e.g. 256)"),
    ("chat", '"tau": "0.5"', "tau", "tau '0.5' must be a number, not a string (e.g. 0.5)"),
    ("chat", '"top_p": -Infinity', "top_p", "top_p -Infinity must be a finite number in (0, 1] (a probability mass; "
                                            "e.g. 0.95)"),
    ("ollama_generate", '"options": {"num_predict": 1.5}', "options.num_predict",
     "num_predict 1.5 must be a whole number ≥ 1 (e.g. 256)"),
    ("ollama_generate", '"options": {"top_k": "5"}', "options.top_k",
     "top_k '5' must be a number, not a string (e.g. 5)"),
    ("ollama_chat", '"options": {"tau": 1e400}', "options.tau",
     "tau 1e400 must be a finite number ≥ 0 (an entropy in nats; e.g. 0.5)"),
    ("ollama_chat", '"options": {"seed": 2.0}', "options.seed",
     "seed 2.0 must be a whole number ≥ 0 (a 64-bit seed; e.g. 0)"),
    # a number written otherwise than its float's shortest form is named as sent, as --seed 1e3 is
    ("chat", '"seed": 1e3', "seed", "seed 1e3 must be a whole number ≥ 0 (a 64-bit seed; e.g. 0)"),
    ("completions", '"max_tokens": 1E3', "max_tokens", "max_tokens 1E3 must be a whole number ≥ 1 (e.g. 256)"),
    ("completions", '"temperature": -1e0', "temperature", "temperature -1e0 must be ≥ 0 (0 = greedy; e.g. 0.7)"),
    ("ollama_generate", '"options": {"seed": 1e3}', "options.seed",
     "seed 1e3 must be a whole number ≥ 0 (a 64-bit seed; e.g. 0)"),
])
def test_a_value_of_the_wrong_kind_gets_the_ranges_words_on_every_route(named, route, body, param, message):
    """A numeric field sent as a float where a whole number goes, as true, as a string or as a number
    that is not finite (1e400, which JSON readers take as inf) is a 400 in the words every other place
    uses for the setting, naming the value as sent; a number sent as a string is refused as OpenAI's API
    and ecache's Python API refuse it. The raw JSON text is sent, so ``1e400`` and ``NaN`` reach the server."""
    url, _ = named
    head = {"completions": '"prompt": "Sort: 9 3 7 1"', "ollama_generate": '"prompt": "Sort: 9 3 7 1", "stream": false',
            "chat": '"messages": [{"role": "user", "content": "hi"}]',
            "ollama_chat": '"messages": [{"role": "user", "content": "hi"}], "stream": false'}[route]
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "ollama_generate": "/api/generate",
            "ollama_chat": "/api/chat"}[route]
    r = httpx.post(url + path, content=f'{{"model": "my-model", {head}, {body}}}'.encode(),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    if route.startswith("ollama"):
        assert r.json() == {"error": message}
    else:
        assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param,
                                     "code": None}


def test_an_escaped_lone_surrogate_is_named_by_its_field_in_input_records_words(named, cli, tmp_path):
    """Valid JSON holding ``"\\ud800"`` is no text: the server names the field it is in (a message's content,
    a text part, the prompt) in the words ``--input`` names a record's field with (and ``--data`` a line's),
    not the tokenizer's ``prompt 1``."""
    url, _ = named
    cases = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]},
              "messages[0] 'content'", "messages.0.content", 2),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                 {"type": "text", "text": "ok"}, {"type": "text", "text": "\udc80"}]}]},
              "messages[0].content[1] 'text'", "messages.0.content.1.text", 1),
             ("/v1/completions", {"prompt": "a\ud800b"}, "'prompt'", "prompt", 2)]
    for route, body, where, param, at in cases:
        r = httpx.post(f"{url}{route}", content=json.dumps({"model": "my-model", **body}),
                       headers={"content-type": "application/json"})
        code = "D800" if "ud800" in json.dumps(body) else "DC80"
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["message"] == (f"{where} is not UTF-8 text (a lone surrogate U+{code} at character "
                                                f"{at}); write the text itself, not a surrogate escape")
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "a\\ud800b"}\n{"messages": [{"role": "user", "content": "a\\ud800b"}]}\n')
    res = cli("generate", "--input", f, "--gen-length", 16, "--block-length", 8)
    for where in ("1: 'prompt'", "2: messages[0] 'content'"):
        assert res.exit_code == 2 and (f"in.jsonl:{where} is not UTF-8 text (a lone surrogate U+D800 at character 2); "
                                       "write the text itself, not a surrogate escape") in res.stderr, res.stderr
    data = tmp_path / "gsm.jsonl"
    data.write_text('{"question": "a\\ud800b", "answer": "#### 2"}\n')
    res = cli("profile", "--task", "gsm8k", "--data", data, "--policies", "none")
    assert res.exit_code == 2 and (f"{data}:1: 'question' is not UTF-8 text (a lone surrogate U+D800 at character 2); "
                                   "write the text itself, not a surrogate escape") in res.stderr, res.stderr


def test_a_body_that_is_not_utf8_is_named_so_and_a_blank_ollama_prompt_names_prompt(named):
    """A non-UTF-8 byte is named as every reader of the command line names it (``not UTF-8 text``), in the
    route's error shape; ``/api/generate`` with a blank prompt names ``prompt`` (its chat template wraps it
    in a user message, which the route's client never sent), while an empty one still only loads the model."""
    url, _ = named
    raw = b'{"model": "my-model", "prompt": "caf\xe9 \xff"}'
    r = httpx.post(f"{url}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "the request body is not UTF-8 text (byte 0xe9 at character 37); send UTF-8 JSON"), r.text
    r = httpx.post(f"{url}/api/chat", content=raw)
    assert r.status_code == 400 and r.json() == {
        "error": "the request body is not UTF-8 text (byte 0xe9 at character 37); send UTF-8 JSON"}
    bom = httpx.post(f"{url}/v1/completions", content=b"\xef\xbb\xbf" + json.dumps(
        {"model": "my-model", "prompt": SORT, "max_tokens": 8}).encode(), timeout=60)
    assert bom.status_code == 200, bom.text  # a UTF-8 BOM is skipped
    for prompt, status, want in (("   ", 400, {"error": "prompt is empty; give at least one token of text"}),
                                 (7, 400, {"error": "prompt must be a string (got 7)"})):
        r = httpx.post(f"{url}/api/generate", json={"model": "my-model", "prompt": prompt, "stream": False})
        assert r.status_code == status and r.json() == want, r.text
    load = httpx.post(f"{url}/api/generate", json={"model": "my-model", "prompt": "", "stream": False})
    assert load.status_code == 200 and load.json()["done_reason"] == "load"
    system = httpx.post(f"{url}/api/generate", json={"model": "my-model", "prompt": " ", "system": "Sort: 3 1 2",
                                                     "stream": False, "options": {"num_predict": 8}}, timeout=60)
    assert system.status_code == 200, system.text  # a system prompt is text to answer


@pytest.mark.parametrize("extra,named_field", [
    ({"policy": "dual", "tau": 0.5}, "tau is not used by policy dual (it takes refresh_every)"),
    ({"policy": "none", "tau": 0.5}, "tau is not used by policy none (it takes no parameter)"),
    ({"threshold": 0.9, "steps": 4}, "steps 4 does nothing with threshold 0.9: a block runs until no mask is left"),
    ({"top_p": 0.5}, "top_p does nothing at temperature 0 with LLaDA's rules (greedy decoding); pass temperature > 0"),
    ({"top_k": 5}, "top_k does nothing at temperature 0 with LLaDA's rules (greedy decoding); pass temperature > 0"),
])
def test_a_request_setting_its_run_ignores_is_named_in_the_warning_header(named, extra, named_field):
    """Where ``ecache generate`` warns a flag and runs (``--cache dual --tau 0.5``, ``--steps`` under
    ``--threshold``), the server answers and names the field in its Warning header; without it, none."""
    url, _ = named
    body = {"model": "my-model", "prompt": SORT, "max_tokens": 16, "block_length": 16}
    r = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["warning"].startswith('299 ecache "accepted and ignored: ') and named_field in r.headers["warning"]
    assert "warning" not in httpx.post(f"{url}/v1/completions", json=body, timeout=60).headers


def test_unknown_model_stream_options_and_missing_content_as_openai_answers_them(named):
    """A model not served is a 404 model_not_found on every route (completions, chat, models, Ollama's);
    ``stream_options`` without ``stream`` and a user message without ``content`` are 400s naming the field."""
    url, _ = named
    msgs = [{"role": "user", "content": "hi"}]
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": msgs}),
                       ("/v1/completions", {"prompt": "hi", "stream": True}),
                       ("/api/generate", {"prompt": "hi", "stream": False})):
        r = httpx.post(f"{url}{path}", json={"model": "nope", **body}, timeout=60)
        assert r.status_code == 404, (path, r.text)
    assert httpx.get(f"{url}/v1/models/nope").status_code == 404
    r = httpx.get(f"{url}/v2/nothing")  # no such route: the message lists every route served, each of which answers
    listed = r.json()["error"]["message"].split("; the routes are ")[1].split(", ")
    assert r.status_code == 404 and {"/health/live", "/api/version", "/metrics", "/api/chat"} <= set(listed), r.text
    for path in listed:  # each is a route (GET /v1/chat/completions: OpenAI's list of stored ones, none here)
        assert "no route" not in httpx.get(f"{url}{path}").text, path
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "my-model", "messages": msgs,
                                                       "stream_options": {"include_usage": True}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "my-model", "messages": [{"role": "user"}]},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content", r.text
    assert "messages[0].content is missing" in r.json()["error"]["message"]


def test_top_k_is_read_per_request_as_generate_top_k_on_both_apis(named):
    """``top_k`` (OpenAI extension, as vLLM's; Ollama's ``options.top_k``) samples as ``ecache generate
    --top-k`` does: the same seed, temperature and top-k give generate's answer on both routes (on a prompt
    outside the embedded model's domains, where sampling at temperature 2 with and without top-k 1 differ)."""
    url, _ = named
    prompt = "Tell me a story"
    msgs = [{"role": "user", "content": prompt}]
    flags = ["--temperature", "2", "--seed", "3"]
    alone = generate(*flags, "--top-k", "1", prompt)[0]["text"]
    wild = generate(*flags, prompt)[0]["text"]
    assert alone != wild  # top-k changes this answer (else the test could not fail)
    extra = {"top_k": 1}
    c = client(url, key="unused")
    got = c.chat.completions.with_raw_response.create(model="my-model", messages=msgs, max_tokens=GEN,
                                                      temperature=2, seed=3, extra_body=extra)
    assert got.parse().choices[0].message.content == alone and "warning" not in got.headers
    r = httpx.post(f"{url}/api/chat", json={"model": "my-model", "messages": msgs, "stream": False,
                                            "options": {"top_k": 1, "temperature": 2, "seed": 3, "num_predict": GEN}},
                   timeout=60)
    assert r.status_code == 200 and r.json()["message"]["content"] == alone, r.text


def test_neutral_values_of_unsupported_fields_are_named_in_the_warning_header(named):
    """A 0 penalty, ``best_of`` 1 and ``modalities`` ``["text"]`` are accepted with the answer a request
    without them gets, and named in the Warning header as ``store`` and ``user`` are."""
    url, _ = named
    body = {"model": "my-model", "prompt": SORT, "max_tokens": 16}
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    r = httpx.post(f"{url}/v1/completions", json={**body, "frequency_penalty": 0, "presence_penalty": 0.0,
                                                  "best_of": 1, "user": "u1"}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"] == "1 3 7 9"
    assert r.headers["warning"] == ('299 ecache "accepted and ignored: user, presence_penalty (diffusion decoding has '
                                    'no per-token penalties), frequency_penalty (diffusion decoding has no per-token '
                                    'penalties), best_of (one candidate per choice)"')
    chat = httpx.post(f"{url}/v1/chat/completions", json={
        "model": "my-model", "messages": [{"role": "user", "content": "Sort: 9 3 7 1"}], "modalities": ["text"],
        "response_format": {"type": "text"}}, timeout=60)
    assert chat.json()["choices"][0]["message"]["content"] == "1 3 7 9"
    assert chat.headers["warning"] == ('299 ecache "accepted and ignored: response_format (text is the only format), '
                                       'modalities (text is the only output)"')


def test_a_batch_of_token_id_prompts_is_refused_saying_why_and_one_is_read(named, tiny):
    url, _ = named
    ids = tiny.tokenizer(SORT, add_special_tokens=False)["input_ids"]
    r = httpx.post(f"{url}/v1/completions", json={"model": "my-model", "prompt": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"] == "prompt must be a string or a list of token ids (got 7)"
    r = httpx.post(f"{url}/v1/completions", json={"model": "my-model", "prompt": [[1, 2], [3, 4]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"] == ("prompt: a list of 2 token-id lists is more than one prompt; send one "
                                            "prompt per request (requests are batched by the server)")
    flat = httpx.post(f"{url}/v1/completions", json={"model": "my-model", "prompt": ids, "max_tokens": 16}, timeout=60)
    one = httpx.post(f"{url}/v1/completions", json={"model": "my-model", "prompt": [ids], "max_tokens": 16},
                     timeout=60)
    assert one.json()["choices"][0]["text"] == flat.json()["choices"][0]["text"] == "1 3 7 9"


@pytest.mark.parametrize("prompt", [[5, "a"], [[5, True]], [5, 10 ** 6], [5, None], "MASK"])
def test_a_bad_token_id_prompt_is_named_as_records_and_the_api_name_it(named, tiny, cli, tmp_path, prompt):
    """A token-id prompt the model cannot take gets one reason, with its fix, from the server (one list or
    a batch of one), an ``--input`` record's ``prompt_ids`` and ``Engine.start``
    (``models.prompting.check_prompt_ids``)."""
    from ecache_cli.cache import make_policy
    from ecache_cli.decoding.config import DecodeConfig
    from ecache_cli.engine.core import Engine
    from ecache_cli.errors import UsageError
    from ecache_cli.models.prompting import check_prompt_ids

    prompt = [5, tiny.spec.mask_id] if prompt == "MASK" else prompt
    ids = prompt[0] if isinstance(prompt[0], list) else prompt
    why = check_prompt_ids(tiny.spec, ids)
    assert why.startswith(f"prompt_ids[1] = {json.dumps(ids[1])} ") and why.endswith(
        "; give ids of the model's tokenizer"), why
    url, _ = named
    r = httpx.post(f"{url}/v1/completions", json={"model": "my-model", "prompt": prompt})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"] == f"prompt: {why}"
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"prompt_ids": ids}) + "\n")
    res = cli("generate", "--input", f, "--gen-length", 16, "--block-length", 8)
    assert res.exit_code == 2 and f"{f}:1: {why}; fix them, or pass --skip-invalid" in res.stderr, res.stderr
    with pytest.raises(UsageError) as api:
        Engine.from_loaded(tiny).start([ids], DecodeConfig(gen_length=16, block_length=8), make_policy("none"))
    assert str(api.value) == f"prompt 1: {why}"


def test_the_function_role_is_refused_saying_why(named):
    url, _ = named
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "my-model", "messages": [
        {"role": "user", "content": "hi"}, {"role": "function", "name": "f", "content": "42"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.role"
    assert r.json()["error"]["message"] == ("messages[1].role 'function' is not supported: it answers a function call "
                                            "and this server calls no functions; send the text as a 'tool' or 'user' "
                                            "message")


def test_ollama_options_take_the_decoding_extensions_of_the_openai_routes(named):
    """``options.policy``/``options.tau`` give the answer the OpenAI route gives for ``policy``/``tau``; a tau
    the policy does not take is named as ``options.tau``; ``tau`` at the top level says to put it in options."""
    url, _ = named
    msgs = [{"role": "user", "content": "Sort: 9 3 7 1"}]
    want = client(url, key="unused").chat.completions.create(
        model="my-model", messages=msgs, extra_body={"policy": "entropy", "tau": 0.5}).choices[0].message.content
    r = httpx.post(f"{url}/api/chat", json={"model": "my-model", "messages": msgs, "stream": False,
                                            "options": {"policy": "entropy", "tau": 0.5}}, timeout=60)
    assert r.status_code == 200 and r.json()["message"]["content"] == want == "1 3 7 9"
    assert "warning" not in r.headers
    dual = httpx.post(f"{url}/api/generate", json={"model": "my-model", "prompt": "Sort: 9 3 7 1", "stream": False,
                                                   "options": {"policy": "dual", "tau": 0.5}}, timeout=60)
    assert dual.status_code == 200
    assert "options.tau is not used by policy dual (it takes refresh_every)" in dual.headers["warning"]
    top = httpx.post(f"{url}/api/chat", json={"model": "my-model", "messages": msgs, "tau": 0.5})
    assert top.status_code == 400 and top.json()["error"] == ("unrecognized request argument 'tau'; ecache's "
                                                              "extensions go in options (options.tau)")
    bad = httpx.post(f"{url}/api/chat", json={"model": "my-model", "messages": msgs, "options": {"policy": "bogus"}})
    assert bad.status_code == 400 and "bogus" in bad.json()["error"]
