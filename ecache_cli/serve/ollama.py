"""Ollama's API beside OpenAI's, so Ollama clients and the web front-ends that speak it work.

Routes (Ollama's docs/api.md): ``GET /api/tags`` (the one model), ``GET /api/version``,
``POST /api/generate`` (``prompt`` with ``system``; the chat template unless ``raw: true``, then the
prompt as given like ``/v1/completions``) and ``POST /api/chat`` (``messages``). Each request is
translated into the OpenAI request of the same meaning and goes through the same checks
(``protocol.py``), queue and engine. ``stream`` defaults to true as in Ollama: newline-delimited JSON
objects, ``{"response": text, "done": false}`` (chat: ``{"message": {"role": "assistant",
"content": text}, ...}``) as the answer's text becomes final, then one with ``"done": true``,
``done_reason`` and the counts (``prompt_eval_count``, ``eval_count``, durations in nanoseconds).

``options``: ``temperature``, ``top_p``, ``top_k`` (the OpenAI route's ``top_k``, as ``--top-k``), ``seed``,
``stop``, ``num_predict`` (→ ``max_tokens``; < 0: the server's default), ``presence_penalty`` and
``frequency_penalty`` (refused unless 0) are read, and so are ecache's extensions of the OpenAI routes
(:data:`EXTENSIONS`: ``policy``, ``tau``, ``threshold``, ``block_length``, ``steps``, ``ignore_eos``); the
runtime ones (:data:`IGNORED_OPTIONS`: context size, threads, GPU layers ...) and ``keep_alive`` are
accepted and ignored (a ``Warning`` header names them); any other option is refused with one line, and so
are ``format``, ``images``, ``tools``, ``template``, ``context``, ``suffix`` and ``think`` (and a message's
fields beyond role and content) unless empty or false: then they are accepted, ignored and named in the
``Warning`` header too, as an OpenAI field that would change the answer is refused and its neutral value
named. Errors are Ollama's ``{"error": message}``. The model is the served name, with or without the tag
``:latest``. An empty ``prompt`` (or no messages) only loads the model: ``done_reason`` ``load``, as Ollama answers it.
"""

from __future__ import annotations

import datetime
import json
import re
import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .. import __version__
from .handling import Server, check_key, events, read_json, resolve, submit, wait
from .protocol import ApiError, ignored_fields, shown, warning_header

#: Ollama options that tune the runtime, not the answer: accepted and ignored.
IGNORED_OPTIONS = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock", "numa",
                   "low_vram", "vocab_only", "num_keep")
#: Ollama options read, and the OpenAI field each becomes.
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed", "stop": "stop",
           "num_predict": "max_tokens", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty"}
#: ecache's decoding extensions of the OpenAI routes (``protocol.py``), read from ``options`` under the same names.
EXTENSIONS = ("policy", "tau", "threshold", "block_length", "steps", "ignore_eos")
OPTIONS.update({name: name for name in EXTENSIONS})
#: Top-level fields of each route: read, ignored, or refused unless empty.
FIELDS = {"generate": {"model", "prompt", "system", "stream", "raw", "options", "keep_alive", "format", "images",
                       "template", "context", "suffix", "think"},
          "chat": {"model", "messages", "stream", "options", "keep_alive", "format", "tools", "think"}}


def ollama_words(e: ApiError, prompt: str | None = None) -> ApiError:
    """``e`` (a refusal of the translated OpenAI request) with each OpenAI field that an Ollama option
    became named as the option the client sent (:data:`OPTIONS`: ``max_tokens 0 must be ≥ 1`` →
    ``num_predict 0 must be ≥ 1``; its ``param`` ``options.num_predict``), and, for ``/api/generate``
    (``prompt``: what its messages were made of, ``prompt`` or ``prompt and system``), the messages named
    as those fields (``prompt has 100 tokens; this server takes at most 40``)."""
    msg, param = e.message, e.param
    if prompt is not None and param is not None and param.split(".")[0] == "messages":
        named = f"{prompt} have" if " and " in prompt else f"{prompt} has"
        msg, param = re.sub(r"^messages(\[\d+\])? has", named, re.sub(r"^messages(\[\d+\])?(?! has)", prompt, msg)), \
            "prompt"
    for option, field in OPTIONS.items():
        if option != field:
            msg = re.sub(rf"\b{field}\b", option, msg)
        if param == field:
            param = f"options.{option}"
    e.message, e.param = msg, param
    e.args = (msg,)
    return e


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def translate(srv: Server, route: str, body) -> tuple[dict | None, bool, list[str]]:
    """(the OpenAI body of an Ollama request, or None for a load-only request; whether it is chat;
    the fields accepted and ignored). Raises ApiError (400) naming a refused field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS[route])
    if unknown:
        where = f"ecache's extensions go in options (options.{unknown[0]})" if unknown[0] in EXTENSIONS else \
            "see Ollama's API (docs/api.md)"
        raise ApiError(400, f"unrecognized request argument {unknown[0]!r}; {where}", unknown[0])
    ignored = ["keep_alive"] if "keep_alive" in body else []
    for field in ("format", "images", "tools", "template", "context", "suffix", "think"):
        if body.get(field) not in (None, "", [], False):
            why = " (the model does not think apart from its answer)" if field == "think" else ""
            raise ApiError(400, f"{field} is not supported by this server{why}; leave it out", field)
        if body.get(field) is not None:  # given, empty or false: accepted and ignored, named
            ignored.append(field)
    name = body.get("model")
    if name is None:  # the OpenAI routes' words for a missing field
        raise ApiError(400, "'model' is required", "model")
    if not isinstance(name, str) or name.removesuffix(":latest") != srv.opts.model_name:
        raise ApiError(404, f"model {name!r} is not served here; this server serves {srv.opts.model_name!r} "
                            "(GET /api/tags)", "model")
    out: dict = {"model": srv.opts.model_name, "stream": body.get("stream", True)}
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, f"options must be an object (got {options!r})", "options")
    for key, value in options.items():
        if key in IGNORED_OPTIONS:
            ignored.append(f"options.{key}")
        elif key not in OPTIONS:
            raise ApiError(400, f"options.{key} is not supported by this server; leave it out (read: "
                                f"{', '.join(OPTIONS)})", f"options.{key}")
        elif key == "num_predict":  # < 0: the server's default; not a whole number: max_tokens's words
            if not isinstance(value, int) or isinstance(value, bool) or value >= 0:
                out["max_tokens"] = value
        else:
            out[OPTIONS[key]] = value
    if route == "chat":
        messages = body.get("messages") or []
        if not isinstance(messages, list):
            raise ApiError(400, "messages must be a list of {role, content} objects", "messages")
        for i, m in enumerate(messages):
            extra = sorted(set(m) - {"role", "content"}) if isinstance(m, dict) else []
            for field in extra:
                if m[field] not in (None, "", []):
                    raise ApiError(400, f"messages[{i}].{field} is not supported by this server; leave it out",
                                   f"messages.{i}.{field}")
                if m[field] is not None:
                    ignored.append(f"messages[{i}].{field}")
        if not messages:
            return None, True, ignored
        out["messages"] = [{"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict) else m
                           for m in messages]
        return out, True, ignored
    prompt, system = body.get("prompt"), body.get("system")
    if prompt in (None, ""):
        return None, False, ignored
    if body.get("raw"):
        if system:
            raise ApiError(400, "system is not applied with raw: true; put it in the prompt", "system")
        out["prompt"] = prompt
        return out, False, ignored
    for field, value in (("prompt", prompt), ("system", system)):
        if value is not None and not isinstance(value, str):
            raise ApiError(400, f"{field} must be a string (got {shown(value)})", field)
    if not prompt.strip() and not (system or "").strip():  # /v1/completions' words, naming this route's field
        raise ApiError(400, "prompt is empty; give at least one token of text", "prompt")
    out["messages"] = ([{"role": "system", "content": system}] if system else []) + [{"role": "user",
                                                                                       "content": prompt}]
    return out, True, ignored


async def generate(request: Request):
    """``POST /api/generate``."""
    return await _ollama(request, "generate")


async def chat(request: Request):
    """``POST /api/chat``."""
    return await _ollama(request, "chat")


async def _ollama(request: Request, route: str):
    srv: Server = request.app.state.server
    endpoint = f"ollama_{route}"
    check_key(request, endpoint)
    body = await read_json(request, endpoint)
    try:
        openai_body, is_chat, ignored = translate(srv, route, body)
    except ApiError:
        srv.metrics.requests.labels(endpoint, "invalid").inc()
        raise
    if openai_body is None:  # Ollama's "load the model" request
        done = {"model": srv.opts.model_name, "created_at": _now(), "done": True, "done_reason": "load"}
        return JSONResponse(done | ({"message": {"role": "assistant", "content": ""}} if route == "chat"
                                    else {"response": ""}))
    stream = bool(openai_body.get("stream"))
    try:
        req, job = resolve(request, "chat" if is_chat else "completions", openai_body)
    except ApiError as e:
        made_of = None  # /api/generate's prompt (and system) became chat messages: name them as sent
        if route == "generate" and is_chat:
            made_of = "prompt and system" if body.get("system") else "prompt"
        raise ollama_words(e, made_of) from None
    job.endpoint = endpoint  # metrics count Ollama's routes apart
    submit(request, endpoint, job)
    renamed = {field: option for option, field in OPTIONS.items()}  # the run's ignored settings, as options
    headers = warning_header(ignored + [f"options.{renamed[w.split(' ')[0]]}{w[len(w.split(' ')[0]):]}"
                                        if w.split(" ")[0] in renamed else w for w in ignored_fields(req)])
    started = time.perf_counter_ns()
    if not stream:
        res = await wait(request, job)
        return JSONResponse(_piece(srv, route, res.text) | _final(res, started), headers=headers)

    async def lines():
        async for ev in events(request, job):
            if ev.kind == "delta":
                yield json.dumps(_piece(srv, route, ev.text), ensure_ascii=False) + "\n"
            elif ev.kind == "done":
                yield json.dumps(_piece(srv, route, "") | _final(ev.result, started)) + "\n"
            else:
                yield json.dumps({"error": ev.text}) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson", headers=headers)


def _piece(srv: Server, route: str, text: str) -> dict:
    obj = {"model": srv.opts.model_name, "created_at": _now()}
    obj |= {"message": {"role": "assistant", "content": text}} if route == "chat" else {"response": text}
    return obj | {"done": False}


def _final(res, started_ns: int) -> dict:
    total = time.perf_counter_ns() - started_ns
    return {"done": True, "done_reason": res.finish_reason, "total_duration": total, "load_duration": 0,
            "prompt_eval_count": res.prompt_tokens, "eval_count": res.completion_tokens, "eval_duration": total}


async def tags(request: Request):
    """``GET /api/tags``: the one model served, in Ollama's shape."""
    check_key(request, "ollama_tags")
    srv: Server = request.app.state.server
    modified = datetime.datetime.fromtimestamp(srv.created, datetime.timezone.utc).isoformat()
    return {"models": [{"name": srv.opts.model_name, "model": srv.opts.model_name, "modified_at": modified,
                        "size": 0, "digest": "", "details": {"format": "ecache", "family": srv.family,
                                                             "parameter_size": "", "quantization_level": ""}}]}


async def version():
    """``GET /api/version``: ecache's version (Ollama clients ask for it)."""
    return {"version": __version__}


#: (path, route, methods) of Ollama's routes.
ROUTES = [
    ("/api/tags", tags, ["GET"]),
    ("/api/version", version, ["GET"]),
    ("/api/generate", generate, ["POST"]),
    ("/api/chat", chat, ["POST"]),
]
