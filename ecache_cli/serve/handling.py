"""What every generating route of ``ecache serve`` does, OpenAI's (``app.py``) and Ollama's
(``ollama.py``): the API key, the body, the request's :class:`~ecache_cli.serve.scheduler.Job`, the
queue, and the job's events as the engine posts them. ``app.state.server`` (a :class:`Server`) holds
what they share.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json

from fastapi import Request

from ..runs.inputs import not_text_words
from ..runs.settings import given_float
from .metrics import ServeMetrics
from .protocol import ApiError, ChatRequest, CompletionRequest, Resolver, parse
from .scheduler import Job, Result, Scheduler

#: Seconds a waiting handler sleeps between checks that its client is still connected.
POLL_S = 0.1


@dataclasses.dataclass
class ServeOptions:
    """Server settings (``ecache serve`` flags). ``model_name``: the id requests name and
    ``/v1/models`` lists (``--served-model-name``, default ``--model``). ``api_key``: None = no key
    (loopback by default). ``max_batch`` rows decode at once; ``max_queue`` requests wait;
    ``admission``: always | fcfs | auto (``serve/admission.py``). ``request_timeout`` seconds (None:
    none). ``max_body_bytes``: request bodies. ``max_prompt_tokens``: prompt ids. ``shutdown_grace``:
    seconds SIGTERM leaves running rows. ``retry_after``: seconds a 429 asks for. ``warmup``: rows of
    the engine's warm-up (0: none; ``/health/ready`` is 200 at once). ``seed``: ``--seed``, the stream
    the seeds of requests without one are drawn from (None: random; ``protocol.Limits``).
    ``prefix_cache``: reuse prompts' keys and values across requests (docs/SERVING.md, "Prefix reuse";
    None: where it is exact, on block-diffusion models), in a store of at most ``prefix_cache_mb`` MiB
    cut in chunks of ``prefix_chunk`` tokens."""

    model_name: str
    api_key: str | None = None
    max_batch: int = 32
    max_queue: int = 256
    admission: str = "auto"
    request_timeout: float | None = None
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 2048
    shutdown_grace: float = 30.0
    retry_after: int = 1
    warmup: int = 8
    seed: int | None = None
    prefix_cache: bool | None = None
    prefix_cache_mb: int = 1024
    prefix_chunk: int = 16


@dataclasses.dataclass
class Server:
    """What the routes share (``app.state.server``): the options, the engine's scheduler, the metrics,
    the request resolver, when the server started (``created``, Unix seconds) and the model's family."""

    opts: ServeOptions
    sched: Scheduler
    metrics: ServeMetrics
    resolver: Resolver
    created: int
    family: str = ""


# -- the pieces every generating route uses -----------------------------------------------------------


def check_key(request: Request, endpoint: str) -> None:
    """401 unless the request carries the server's API key (none set: every request passes)."""
    srv: Server = request.app.state.server
    if srv.opts.api_key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), srv.opts.api_key.encode()):
        srv.metrics.requests.labels(endpoint, "unauthorized").inc()
        raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
                            "server's --api-key", type="authentication_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"}, outcome="unauthorized")


async def read_json(request: Request, endpoint: str):
    """The request's JSON body: 413 over ``--max-body-bytes`` (declared or read), 400 not UTF-8 text or not
    JSON. A number that is not finite, or not written in its float's shortest form (``1e3``), comes as a
    ``contract.fields.GivenFloat`` keeping its text (``contract.fields.given_float``)."""
    srv: Server = request.app.state.server
    limit = srv.opts.max_body_bytes
    too_large = ApiError(413, f"the request body exceeds {limit} bytes (--max-body-bytes)", outcome="too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        srv.metrics.requests.labels(endpoint, "too_large").inc()
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            srv.metrics.requests.labels(endpoint, "too_large").inc()
            raise too_large
    # JSON between systems is UTF-8 (RFC 8259); a leading BOM is skipped. A byte that is not UTF-8 reads as
    # a lone surrogate, named with its byte and character as every input path names it
    text = bytes(body).decode("utf-8-sig", "surrogateescape")
    if (words := not_text_words(text)) is not None:
        srv.metrics.requests.labels(endpoint, "invalid").inc()
        raise ApiError(400, f"the request body is {words}; send UTF-8 JSON")
    try:  # a number that is not finite (1e400, NaN) or written otherwise (1e3) keeps its text for a refusal
        return json.loads(text, parse_float=given_float, parse_constant=given_float)
    except ValueError as e:
        srv.metrics.requests.labels(endpoint, "invalid").inc()
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:  # arrays or objects nested past the parser's recursion limit (~1000 deep)
        srv.metrics.requests.labels(endpoint, "invalid").inc()
        raise ApiError(400, "the request body nests arrays or objects too deeply to parse; send the "
                            "request's own JSON shape") from None


def resolve(request: Request, endpoint: str, body) -> tuple[ChatRequest | CompletionRequest, Job]:
    """The parsed request and its :class:`Job` (``endpoint``: chat | completions); a refusal is
    counted as ``invalid`` and raised."""
    srv: Server = request.app.state.server
    try:
        if endpoint == "chat":
            req = parse(ChatRequest, body)
            job = srv.resolver.job(req, endpoint, srv.resolver.chat_ids(req))
        else:
            req = parse(CompletionRequest, body)
            job = srv.resolver.job(req, endpoint, srv.resolver.completion_ids(req))
    except ApiError:
        srv.metrics.requests.labels(endpoint, "invalid").inc()
        raise
    job.request_id = request.state.request_id
    return req, job


def submit(request: Request, endpoint: str, job: Job) -> None:
    """Queue ``job`` for the engine: 429 when the queue is full, 503 while shutting down."""
    srv: Server = request.app.state.server
    job.bind(asyncio.get_running_loop())
    refused = srv.sched.submit(job)
    if refused == "queue_full":
        srv.metrics.requests.labels(endpoint, "queue_full").inc()
        raise ApiError(429, f"the queue is full ({srv.opts.max_queue} waiting, --max-queue {srv.opts.max_queue}); "
                            "retry later",
                       type="rate_limit_error", code="queue_full", headers={"Retry-After": str(srv.opts.retry_after)})
    if refused == "unavailable":
        srv.metrics.requests.labels(endpoint, "unavailable").inc()
        raise ApiError(503, "the server is shutting down; send the request to another replica",
                       type="server_error", code="shutting_down")


async def wait(request: Request, job: Job) -> Result:
    """The job's result; a client gone midway cancels it (finish reason ``cancelled``); an engine fault
    is a 500."""
    sched: Scheduler = request.app.state.server.sched
    try:
        while True:
            ev = await job.next_event(POLL_S)
            if ev is None:
                if await request.is_disconnected():
                    sched.cancel(job)
                    return Result("", "cancelled", len(job.prompt_ids), 0, {})
                continue
            if ev.kind == "done":
                return ev.result
            if ev.kind == "error":
                raise ApiError(ev.status, ev.text, type="server_error", code="engine_error", outcome="error")
    finally:
        sched.cancel(job)  # a no-op once done; a handler cancelled midway frees the row


async def events(request: Request, job: Job):
    """The job's events as they come (``delta``, then ``done`` or ``error``); ends early when the
    client goes away, and cancels the row then."""
    sched: Scheduler = request.app.state.server.sched
    try:
        while True:
            ev = await job.next_event(POLL_S)
            if ev is None:
                if await request.is_disconnected():
                    return
                continue
            yield ev
            if ev.kind != "delta":
                return
    finally:
        sched.cancel(job)  # a no-op once done; a client gone midway frees the row


def usage(res: Result) -> dict:
    """OpenAI's usage object of a result."""
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens}
