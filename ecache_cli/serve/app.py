"""The HTTP side of ``ecache serve``: FastAPI routes, server-sent events, limits, and uvicorn.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (OpenAI API
reference shapes; ``protocol.py`` lists the fields), ``GET /health`` and ``GET /metrics``
(Prometheus text format). With an API key, ``/v1/*`` needs ``Authorization: Bearer <key>`` (401
otherwise); ``/health`` and ``/metrics`` stay open for probes and scrapers.

Streaming (``stream: true``): ``text/event-stream`` chunks ``data: {json}`` carrying the answer's text
as its leading tokens become final (committed with no mask before them; text that may begin a stop
string is held back until it cannot), a last chunk with ``finish_reason``, a usage chunk with
``stream_options.include_usage``, then ``data: [DONE]``. A client that disconnects cancels its row
at its run's next step.

Errors are OpenAI's ``{"error": {...}}``: 400 a bad field, 401 no or a wrong key, 413 a body over
``--max-body-bytes``, 429 a full queue (with ``Retry-After``), 503 shutting down, 500 an engine fault
(the server keeps serving). Finish reasons: ``stop``, ``length`` and, beyond OpenAI's, ``timeout``
(``--request-timeout``), ``cancelled`` and ``shutdown`` (SIGTERM's grace ran out).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import signal
import sys
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import ServeMetrics
from .protocol import ApiError, ChatRequest, CompletionRequest, Limits, Resolver, parse
from .scheduler import Job, Result, Scheduler

#: Seconds a waiting handler sleeps between checks that its client is still connected.
POLL_S = 0.1


@dataclasses.dataclass
class ServeOptions:
    """Server settings (``ecache serve`` flags). ``model_name``: the id requests name and
    ``/v1/models`` lists. ``api_key``: None = no key (loopback by default). ``max_batch`` rows decode
    at once; ``max_queue`` requests wait; ``batching``: continuous | static. ``request_timeout``
    seconds (None: none). ``max_body_bytes``: request bodies. ``max_prompt_tokens``: prompt ids.
    ``shutdown_grace``: seconds SIGTERM leaves running rows. ``retry_after``: seconds a 429 asks for."""

    model_name: str
    api_key: str | None = None
    max_batch: int = 32
    max_queue: int = 256
    batching: str = "continuous"
    request_timeout: float | None = None
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 2048
    shutdown_grace: float = 30.0
    retry_after: int = 1


def create_app(lm, settings, opts: ServeOptions) -> FastAPI:
    """The FastAPI app over loaded model ``lm`` with server defaults ``settings`` (a ``runs.settings.Settings``).

    The engine thread starts with the app's lifespan and stops with it; ``app.state.scheduler`` and
    ``app.state.metrics`` expose them (tests, embedding)."""
    metrics = ServeMetrics()
    sched = Scheduler(lm, metrics, opts.max_batch, opts.max_queue, opts.batching)
    resolver = Resolver(sched.engine, lm, settings,
                        Limits(max_prompt_tokens=opts.max_prompt_tokens, model_name=opts.model_name,
                               request_timeout=opts.request_timeout))
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        sched.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, sched.stop)

    app = FastAPI(title="ecache", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.options = sched, metrics, opts

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        msg = {404: f"no route {request.url.path}; see /v1/models, /v1/completions, /v1/chat/completions",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return JSONResponse(ApiError(e.status_code, msg).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(ApiError(400, str(e)).body(), status_code=400)

    def check_key(request: Request, endpoint: str) -> None:
        if opts.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), opts.api_key.encode()):
            metrics.requests.labels(endpoint, "unauthorized").inc()
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
                                "server's --api-key", type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"}, outcome="unauthorized")

    async def read_json(request: Request, endpoint: str):
        limit = opts.max_body_bytes
        too_large = ApiError(413, f"the request body exceeds {limit} bytes (--max-body-bytes)", outcome="too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            metrics.requests.labels(endpoint, "too_large").inc()
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                metrics.requests.labels(endpoint, "too_large").inc()
                raise too_large
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            metrics.requests.labels(endpoint, "invalid").inc()
            raise ApiError(400, f"the request body is not valid JSON ({e})") from None

    async def handle(request: Request, endpoint: str):
        check_key(request, endpoint)
        body = await read_json(request, endpoint)
        try:
            if endpoint == "chat":
                req = parse(ChatRequest, body)
                job = resolver.job(req, endpoint, resolver.chat_ids(req))
            else:
                req = parse(CompletionRequest, body)
                job = resolver.job(req, endpoint, resolver.completion_ids(req))
        except ApiError:
            metrics.requests.labels(endpoint, "invalid").inc()
            raise
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        job.bind(asyncio.get_running_loop())
        refused = sched.submit(job)
        if refused == "queue_full":
            metrics.requests.labels(endpoint, "queue_full").inc()
            raise ApiError(429, f"the queue is full ({opts.max_queue} requests waiting, --max-queue); retry later",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": str(opts.retry_after)})
        if refused == "unavailable":
            metrics.requests.labels(endpoint, "unavailable").inc()
            raise ApiError(503, "the server is shutting down; send the request to another replica",
                           type="server_error", code="shutting_down")
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
        if job.stream:
            return StreamingResponse(_sse(request, job, rid, endpoint, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        result = await _wait(request, job)
        return JSONResponse(_response(rid, endpoint, result))

    async def _wait(request: Request, job: Job) -> Result:
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

    def _chunk(rid: str, endpoint: str, text: str | None, finish: str | None, role: bool = False) -> dict:
        if endpoint == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": opts.model_name, "choices": [choice]}

    async def _sse(request: Request, job: Job, rid: str, endpoint: str, include_usage: bool):
        def data(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            if endpoint == "chat":
                yield data(_chunk(rid, endpoint, None, None, role=True))
            while True:
                ev = await job.next_event(POLL_S)
                if ev is None:
                    if await request.is_disconnected():
                        return
                    continue
                if ev.kind == "delta":
                    yield data(_chunk(rid, endpoint, ev.text, None))
                elif ev.kind == "done":
                    res = ev.result
                    yield data(_chunk(rid, endpoint, None if endpoint == "chat" else "", res.finish_reason)
                               | {"ecache": res.stats})
                    if include_usage:
                        yield data({"id": rid, "object": _chunk(rid, endpoint, None, None)["object"],
                                    "created": int(time.time()), "model": opts.model_name, "choices": [],
                                    "usage": _usage(res)})
                    yield "data: [DONE]\n\n"
                    return
                else:  # an engine fault after the headers went out: OpenAI's in-stream error
                    yield data(ApiError(ev.status, ev.text, type="server_error", code="engine_error").body())
                    yield "data: [DONE]\n\n"
                    return
        finally:
            sched.cancel(job)  # a no-op once done; a client gone midway frees the row

    def _response(rid: str, endpoint: str, res: Result) -> dict:
        if endpoint == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": res.text}, "logprobs": None,
                      "finish_reason": res.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": res.text, "logprobs": None, "finish_reason": res.finish_reason}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": opts.model_name, "choices": [choice],
                "usage": _usage(res), "ecache": res.stats}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request, "models")
        return {"object": "list", "data": [{"id": opts.model_name, "object": "model", "created": created,
                                            "owned_by": "ecache"}]}

    @app.get("/health")
    async def health():
        running, queued = sched.counts()
        body = {"status": "shutting_down" if sched.draining else "ok", "model": opts.model_name,
                "running_rows": running, "queued": queued, "max_batch": opts.max_batch, "batching": opts.batching}
        return JSONResponse(body, status_code=503 if sched.draining else 200)

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _usage(res: Result) -> dict:
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens}


def run_server(app: FastAPI, sock, log_level: str = "warning", access_log: bool = False) -> None:
    """Serve ``app`` on the bound socket ``sock`` until SIGINT or SIGTERM (blocking).

    SIGTERM: stop taking requests (new ones and ``/health`` get 503 while the socket stays open, so a
    load balancer sees the replica leave), end queued ones (``shutdown``), give running rows the app's
    ``shutdown_grace`` seconds, then close once no row runs, and return (the command exits 0). SIGINT:
    uvicorn's own fast exit."""
    import uvicorn

    opts: ServeOptions = app.state.options
    sched: Scheduler = app.state.scheduler

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM:  # a graceful stop that exits 0 (uvicorn would re-raise the signal)
                sched.drain(opts.shutdown_grace)
                threading.Thread(target=self._exit_when_idle, name="ecache-drain", daemon=True).start()
                return
            super().handle_exit(sig, frame)

        def _exit_when_idle(self) -> None:
            """Close the server once no request runs or waits (at the latest a second after the grace)."""
            end = time.monotonic() + opts.shutdown_grace + 1.0
            while any(sched.counts()) and time.monotonic() < end:
                time.sleep(0.02)
            self.should_exit = True

    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=int(opts.shutdown_grace) + 5, timeout_keep_alive=5)
    if access_log:  # uvicorn logs each request at INFO (below the server's own level) and on stdout
        access = logging.getLogger("uvicorn.access")
        access.setLevel(logging.INFO)
        for handler in access.handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(sys.stderr)
    _Server(config).run(sockets=[sock])


#: connections the bound socket queues before the server accepts them (uvicorn's default backlog)
BACKLOG = 2048


def bind(host: str, port: int):
    """A TCP socket bound to ``host``:``port`` (0: any free port) and listening, for :func:`run_server`,
    so a busy port or a bad address fails before the model loads, and a client that connects as soon
    as the address is printed waits in the backlog instead of being refused. Raises EcacheError (exit 1)
    naming the address."""
    import socket

    from ..errors import EcacheError

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError as e:
        raise EcacheError(f"cannot listen on {host}:{port} ({e.strerror or e}); "
                          "pick another --port or --host") from None
    sock.set_inheritable(True)
    return sock
