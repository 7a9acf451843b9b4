"""The HTTP side of ``ecache serve``: the app, its routes as small functions, server-sent events,
limits, and uvicorn.

OpenAI routes (OpenAI API reference shapes; ``protocol.py`` lists the fields): ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /v1/completions``, ``POST /v1/chat/completions``; the stored-completions
routes (``GET /v1/chat/completions[/{id}[/messages]]``, ``POST|DELETE /v1/chat/completions/{id}``) answer a
404 saying no completion is stored. Ollama's
(``ollama.py``): ``GET /api/tags``, ``GET /api/version``, ``POST /api/generate``, ``POST /api/chat``.
Operations: ``GET /health`` (the state as JSON; 503 while shutting down), ``GET /health/live`` (200
while the process serves HTTP), ``GET /health/ready`` (200 once the model is loaded and the engine has
warmed up, 503 before and while shutting down), ``GET /metrics`` (Prometheus text format). With an
API key, ``/v1/*`` and ``/api/*`` need ``Authorization: Bearer <key>`` (401 otherwise); ``/health*``
and ``/metrics`` stay open for probes and scrapers.

Every reply carries ``x-request-id``: the client's (up to 128 characters of ``[A-Za-z0-9._:-]``) or a
new one; ``--access-log`` logs one line per request with it, the client, method, path and status. A reply to a request
that gave fields this server accepts and ignores (``protocol.IGNORED``) names them in a ``Warning:
299`` header.

Streaming (``stream: true``): ``text/event-stream`` chunks ``data: {json}`` carrying the answer's text
as its leading tokens become final (committed with no mask before them; text that may begin a stop
string is held back until it cannot), a last chunk with ``finish_reason``, a usage chunk with
``stream_options.include_usage``, then ``data: [DONE]``. A client that disconnects cancels its row
at its run's next step.

Errors are OpenAI's ``{"error": {...}}``: 400 a bad field, 401 no or a wrong key, 404 no such route or
model, 413 a body over ``--max-body-bytes``, 429 a full queue (with ``Retry-After``), 503 shutting
down, 500 an engine fault (the server keeps serving). Finish reasons: ``stop``, ``length`` and,
beyond OpenAI's, ``timeout`` (``--request-timeout``), ``cancelled`` and ``shutdown`` (SIGTERM's grace
ran out).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import sys
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import ollama
from .handling import ServeOptions, Server, check_key, events, read_json, resolve, submit, usage, wait
from .metrics import ServeMetrics
from .protocol import ApiError, CompletionRequest, Limits, Resolver, ignored_fields, parse, warning_header
from .scheduler import Job, Result, Scheduler

#: A client's x-request-id is echoed when it matches this; otherwise the server makes one.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
#: The logger of ``--access-log``'s request lines (with their x-request-id).
log = logging.getLogger("ecache.serve")


def create_app(lm, settings, opts: ServeOptions) -> FastAPI:
    """The FastAPI app over loaded model ``lm`` with server defaults ``settings`` (a ``runs.settings.Settings``).

    Raises UsageError when ``settings`` do not fit the model (``runs.settings.check_settings_fit``).
    The engine thread starts (and warms up) with the app's lifespan and stops with it;
    ``app.state.server`` holds what the routes share, ``app.state.scheduler``, ``app.state.metrics``
    and ``app.state.options`` expose its parts (tests, embedding)."""
    from ..runs.settings import check_settings_fit

    check_settings_fit(settings, lm.spec)  # UsageError for defaults no run on this model takes, before serving
    metrics = ServeMetrics()
    sched = Scheduler(lm, metrics, opts.max_batch, opts.max_queue, opts.admission, prefix_store(opts, lm.spec))
    resolver = Resolver(sched.engine, lm, settings,
                        Limits(max_prompt_tokens=opts.max_prompt_tokens, model_name=opts.model_name,
                               request_timeout=opts.request_timeout, seed=opts.seed))
    app = FastAPI(title="ecache", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = Server(opts, sched, metrics, resolver, int(time.time()), lm.spec.family)
    app.state.scheduler, app.state.metrics, app.state.options = sched, metrics, opts
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(RequestId)
    for path, route, methods in ROUTES + ollama.ROUTES:
        app.add_api_route(path, route, methods=methods)
    return app


def prefix_store(opts: ServeOptions, spec):
    """The prefix store ``opts`` ask for on a model with ``spec`` (docs/SERVING.md, "Prefix reuse"), or
    None: ``prefix_cache`` None turns it on where reuse is exact (block-causal attention)."""
    from ..prefixstore import PrefixStore

    on = spec.block_causal if opts.prefix_cache is None else opts.prefix_cache
    return PrefixStore(opts.prefix_chunk, opts.prefix_cache_mb << 20) if on else None


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    srv: Server = app.state.server
    srv.sched.start(warmup_jobs(srv))
    yield
    await asyncio.get_running_loop().run_in_executor(None, srv.sched.stop)


def warmup_jobs(srv: Server) -> list[Job]:
    """``opts.warmup`` (at most ``--max-batch``) completion requests of the server's defaults, for the
    engine's warm-up; none when such a request does not resolve (e.g. a canvas too long)."""
    n = min(srv.opts.warmup, srv.opts.max_batch)
    jobs = []
    try:
        for i in range(n):
            req = parse(CompletionRequest, {"model": srv.opts.model_name, "prompt": "warm up", "seed": i})
            jobs.append(srv.resolver.job(req, "completions", srv.resolver.completion_ids(req)))
    except ApiError:
        return []
    return jobs


# -- errors -------------------------------------------------------------------------------------------


async def _api_error(request: Request, e: ApiError):
    if request.url.path.startswith("/api/"):  # Ollama's error shape
        return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(request: Request, e: StarletteHTTPException):
    routes = dict.fromkeys(getattr(r, "path", "") for r in request.app.routes)  # every route served, in order
    served = ", ".join(path for path in routes if path and "{" not in path)
    msg = {404: f"no route {request.url.path}; the routes are {served}",
           405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
    return await _api_error(request, ApiError(e.status_code, msg))


async def _validation_error(request: Request, e: RequestValidationError):
    return await _api_error(request, ApiError(400, str(e)))


class RequestId:
    """ASGI middleware: the request's ``x-request-id`` (the client's when well-formed, else a new one)
    goes into ``request.state.request_id`` and every reply's headers, and, with ``--access-log``, the one
    log line of the request: ``<id> <client> "<method> <path> HTTP/<version>" <status>`` (uvicorn's access
    line with the id in front; uvicorn's own is off, so a request is one line)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        rid = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        status = []

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            client = scope.get("client")
            where = f"{client[0]}:{client[1]}" if client else "-"
            query = scope.get("query_string", b"").decode("latin-1")
            path = scope.get("path", "") + (f"?{query}" if query else "")
            log.info('%s %s "%s %s HTTP/%s" %s', rid, where, scope.get("method"), path,
                     scope.get("http_version", "1.1"), status[0] if status else "-")


# -- OpenAI routes ------------------------------------------------------------------------------------


async def completions(request: Request):
    """``POST /v1/completions``."""
    return await _openai(request, "completions")


async def chat_completions(request: Request):
    """``POST /v1/chat/completions``."""
    return await _openai(request, "chat")


async def _openai(request: Request, endpoint: str):
    check_key(request, endpoint)
    req, job = resolve(request, endpoint, await read_json(request, endpoint))
    submit(request, endpoint, job)
    headers = warning_header(ignored_fields(req))
    rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
    if job.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_sse(request, job, rid, endpoint, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
    res = await wait(request, job)
    return JSONResponse(_response(request.app.state.server, rid, endpoint, res), headers=headers)


async def stored_completions(request: Request):
    """OpenAI's stored chat completions (``GET /v1/chat/completions``, ``GET|POST|DELETE
    /v1/chat/completions/{id}``, ``GET /v1/chat/completions/{id}/messages``: the client's ``list``,
    ``retrieve``, ``update``, ``delete`` and ``messages.list``): a 404 in OpenAI's error shape saying this
    server stores none (``store`` is accepted and ignored), so the client raises ``NotFoundError`` with
    that message; not a 5xx, which the client would retry."""
    check_key(request, "chat")
    raise ApiError(404, "stored chat completions are not supported: this server keeps no completion (store is "
                        "accepted and ignored), so there is none to list, retrieve, update or delete",
                   code="stored_completions_not_supported")


def _chunk(srv: Server, rid: str, endpoint: str, text: str | None, finish: str | None, role: bool = False) -> dict:
    if endpoint == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": srv.opts.model_name, "choices": [choice]}


async def _sse(request: Request, job: Job, rid: str, endpoint: str, include_usage: bool):
    srv: Server = request.app.state.server

    def data(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    if endpoint == "chat":
        yield data(_chunk(srv, rid, endpoint, None, None, role=True))
    async for ev in events(request, job):
        if ev.kind == "delta":
            yield data(_chunk(srv, rid, endpoint, ev.text, None))
        elif ev.kind == "done":
            res = ev.result
            yield data(_chunk(srv, rid, endpoint, None if endpoint == "chat" else "", res.finish_reason)
                       | {"ecache": res.stats})
            if include_usage:
                yield data({"id": rid, "object": _chunk(srv, rid, endpoint, None, None)["object"],
                            "created": int(time.time()), "model": srv.opts.model_name, "choices": [],
                            "usage": usage(res)})
            yield "data: [DONE]\n\n"
        else:  # an engine fault after the headers went out: OpenAI's in-stream error
            yield data(ApiError(ev.status, ev.text, type="server_error", code="engine_error").body())
            yield "data: [DONE]\n\n"


def _response(srv: Server, rid: str, endpoint: str, res: Result) -> dict:
    if endpoint == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": res.text, "refusal": None},
                  "logprobs": None, "finish_reason": res.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": res.text, "logprobs": None, "finish_reason": res.finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": srv.opts.model_name, "choices": [choice],
            "usage": usage(res), "ecache": res.stats}


def _model_card(srv: Server) -> dict:
    return {"id": srv.opts.model_name, "object": "model", "created": srv.created, "owned_by": "ecache"}


async def models(request: Request):
    """``GET /v1/models``: the one model served."""
    check_key(request, "models")
    return {"object": "list", "data": [_model_card(request.app.state.server)]}


async def model(request: Request, model_id: str):
    """``GET /v1/models/{id}``: the model served, or 404 ``model_not_found``."""
    check_key(request, "models")
    srv: Server = request.app.state.server
    if model_id != srv.opts.model_name:
        raise ApiError(404, f"model {model_id!r} is not served here; this server serves {srv.opts.model_name!r} "
                            "(GET /v1/models)", "model", code="model_not_found")  # the generating routes' words
    return _model_card(srv)


# -- operations -----------------------------------------------------------------------------------------


async def health(request: Request):
    """``GET /health``: the server's state; 503 while shutting down."""
    srv: Server = request.app.state.server
    running, queued = srv.sched.counts()
    state = ("shutting_down" if srv.sched.draining else "warmup_failed" if srv.sched.warmup_error is not None
             else "ok" if srv.sched.ready.is_set() else "warming_up")
    body = {"status": state,
            "model": srv.opts.model_name, "running_rows": running, "queued": queued, "max_batch": srv.opts.max_batch,
            "admission": srv.opts.admission, "prefix_cache": prefix_state(srv.sched)}
    return JSONResponse(body, status_code=503 if srv.sched.draining else 200)


def prefix_state(sched: Scheduler) -> dict:
    """What ``/health`` and ``/health/ready`` say of prefix reuse (docs/SERVING.md, "Prefix reuse"):
    ``{"enabled": false}``, or ``enabled``, ``mode`` (``exact`` on block-causal attention, else
    ``approximate``), ``budget_mb`` (``--prefix-cache-mb``), ``entries`` (chunks stored) and ``bytes``
    (their keys' and values' bytes)."""
    store = sched.prefix
    if store is None:
        return {"enabled": False}
    return {"enabled": True, "mode": "exact" if sched.engine.spec.block_causal else "approximate",
            "budget_mb": store.max_bytes >> 20, "entries": len(store), "bytes": store.bytes}


async def live():
    """``GET /health/live``: 200 while the process answers HTTP (a liveness probe)."""
    return {"status": "live"}


async def ready(request: Request):
    """``GET /health/ready``: 200 once the model is loaded and the engine warm, 503 before, after a failed
    warm-up (``status`` ``warmup_failed`` with the ``error``) and while shutting down (a readiness probe:
    a load balancer sends requests only on 200)."""
    sched: Scheduler = request.app.state.server.sched
    if sched.draining:
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    if sched.warmup_error is not None:  # the engine failed its warm-up: requests would fail too
        return JSONResponse({"status": "warmup_failed", "error": sched.warmup_error}, status_code=503)
    if not sched.ready.is_set():
        return JSONResponse({"status": "warming_up"}, status_code=503)
    return {"status": "ready", "prefix_cache": prefix_state(sched)}


async def metrics_route(request: Request):
    """``GET /metrics``: Prometheus text format."""
    return Response(request.app.state.server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def root():
    """``GET /``: a one-line answer (Ollama clients probe it)."""
    return PlainTextResponse("ecache serve is running: the OpenAI API under /v1, Ollama's under /api")


#: (path, route, methods) of the OpenAI and operations routes.
ROUTES = [
    ("/v1/completions", completions, ["POST"]),
    ("/v1/chat/completions", chat_completions, ["POST"]),
    ("/v1/chat/completions", stored_completions, ["GET"]),
    ("/v1/chat/completions/{completion_id}", stored_completions, ["GET", "POST", "DELETE"]),
    ("/v1/chat/completions/{completion_id}/messages", stored_completions, ["GET"]),
    ("/v1/models", models, ["GET"]),
    ("/v1/models/{model_id:path}", model, ["GET"]),
    ("/health", health, ["GET"]),
    ("/health/live", live, ["GET"]),
    ("/health/ready", ready, ["GET"]),
    ("/metrics", metrics_route, ["GET"]),
    ("/", root, ["GET", "HEAD"]),
]


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

    if access_log:  # the request lines with their x-request-id (RequestId), on stderr
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("request %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    # uvicorn's access line stays off: RequestId's line is the request's one line, with its id
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=int(opts.shutdown_grace) + 5, timeout_keep_alive=5)
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
    except UnicodeError:  # a name the resolver cannot encode (an empty or over-long label: bogus..host)
        raise EcacheError(f"cannot listen on {host}:{port} (not a valid host name); pick another --host") from None
    sock.set_inheritable(True)
    return sock
