"""Request bodies of ``ecache serve``: OpenAI's fields, the decoding extensions, their checks, and the
OpenAI error shape.

Accepted (OpenAI API reference, "Completions" and "Chat Completions", every field of their request
schemas): ``model``, ``prompt`` (completions: a string, a one-string list, a list of token ids or a
one-item list of those) or ``messages`` (chat: roles system, developer, user, assistant, tool; content a
string or a list of ``{"type": "text"}`` parts), ``max_tokens`` (and ``max_completion_tokens`` for chat),
``temperature`` (≥ 0, as the flag; default the server's), ``top_p`` (0 < p ≤ 1), ``seed``, ``stop`` (a
string or up to 4), ``n`` (1 only), ``stream``, ``stream_options.include_usage``. Fields that do not
change the answer are accepted and ignored, and the reply names them in a ``Warning`` header
(:data:`IGNORED`). Fields that would change the answer in a way this server cannot honour
(``logprobs``, ``echo``, ``best_of`` > 1, ``suffix``, penalties, ``logit_bias``, ``tools``,
``functions``, ``audio``, ``prediction``, ``reasoning_effort``, a non-text ``response_format`` ...)
are refused with one line unless they hold their neutral value (:meth:`Resolver._unsupported`).
A field that neither schema has is refused as unrecognized.

Extensions, beside the standard fields (the openai client sends them with ``extra_body``):
``policy`` (a cache policy: ``ecache_cli/cache``), ``tau`` (EntropyCache's threshold, nats),
``threshold`` (Fast-dLLM parallel decoding, (0, 1]), ``block_length``, ``steps`` (denoising steps of
the whole canvas), ``ignore_eos`` (never commit EOS/EOT, so the answer runs to ``max_tokens``;
vLLM's extension of that name) and ``top_k`` (≥ 1, as ``--top-k``; vLLM's extension of that name, and
Ollama's ``options.top_k``). Anything else is refused.

The canvas: ``gen_length`` = ``max_tokens`` (default: the server's ``--gen-length``) rounded up to
whole blocks; steps default to the server's steps per generated token times ``gen_length`` (at least
one a block). Every refusal is an :class:`ApiError`: HTTP status and OpenAI's
``{"error": {"message", "type", "param", "code"}}`` naming the field.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError

from ..cache import POLICIES, make_policy, policy_params, unknown_policy
from ..cache.entropy import DEFAULT_TAU
from ..decoding.schedule import default_steps
from ..errors import EcacheError
from ..runs.inputs import json_text_error
from ..runs.settings import GivenFloat, check_setting, fitting_example, option_ranges, policies_for, policy_takes
from .scheduler import PROMPT_BUCKET, GroupKey, Job

#: OpenAI's limit on stop sequences.
MAX_STOP = 4


class ApiError(Exception):
    """A refused request: ``status`` (HTTP), ``message`` (one line naming the value and the fix),
    ``param`` (the field), ``type`` and ``code`` (OpenAI's), ``headers`` (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None, outcome: str = "invalid"):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers, self.outcome = headers or {}, outcome

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: Optional[bool] = None
    include_obfuscation: Optional[bool] = None  # ignored: no obfuscation padding is sent


#: Fields accepted and ignored (they do not change the answer), by request schema, with why; a reply
#: to a request that gives one names it in a ``Warning: 299`` header.
IGNORED = {
    "user": "an end-user id for the provider's abuse monitoring",
    "store": "no completions are stored",
    "metadata": "no completions are stored",
    "service_tier": "one tier",
    "prompt_cache_key": "the server keeps no prompt cache between requests",
    "prompt_cache_retention": "the server keeps no prompt cache between requests",
    "prompt_cache_options": "the server keeps no prompt cache between requests",
    "safety_identifier": "an end-user id for the provider's abuse monitoring",
    "parallel_tool_calls": "no tools are called",
    "stream_options.include_obfuscation": "no obfuscation padding is sent",
}


#: A request's ``moderation``, whatever its value: this server runs no moderation model, and answering
#: unmoderated would not be what the client asked for.
MODERATION = "moderation is not supported (this server runs no moderation model); leave it out"

#: Why a field :meth:`Resolver._unsupported` refuses is ignored when given its neutral value (a 0 penalty,
#: ``best_of`` 1, ``modalities`` ``["text"]`` ...); the Warning header names it with this reason.
NEUTRAL = {
    "presence_penalty": "diffusion decoding has no per-token penalties",
    "frequency_penalty": "diffusion decoding has no per-token penalties",
    "tools": "no tools are called", "tool_choice": "no tools are called",
    "functions": "no functions are called", "function_call": "no functions are called",
    "best_of": "one candidate per choice", "modalities": "text is the only output",
    "response_format": "text is the only format", "logit_bias": "an empty bias changes nothing",
    "echo": "the prompt is not echoed", "logprobs": "no log-probabilities are returned",
    "suffix": "an empty suffix changes nothing",
}


class _Common(_Body):
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    n: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    # extensions
    policy: Optional[str] = None
    tau: Optional[float] = None
    threshold: Optional[float] = None
    block_length: Optional[int] = None
    steps: Optional[int] = None
    ignore_eos: Optional[bool] = None
    top_k: Optional[int] = None
    #: settings of this request that its run ignores, with why (``Resolver.job``), named in the Warning header
    #: beside :data:`IGNORED`'s: the command line's warnings (``tau`` a policy does not take, ``steps`` the
    #: threshold rule ignores)
    _ignored: list = PrivateAttr(default_factory=list)


class CompletionRequest(_Common):
    #: text, a one-element list of text, token ids, or a one-element list of token ids; a list's entries
    #: are checked by ``Resolver.completion_ids``, so a bad token id is named as every path names it
    prompt: Union[str, list]
    echo: Optional[bool] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    logprobs: Optional[int] = None


class ContentPart(BaseModel):
    """A part of a message's content: ``{"type": "text", "text": ...}`` is read; other types (image_url,
    input_audio, file, refusal) parse and are refused by the resolver, naming the part."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: Optional[str] = None


class Message(_Body):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None  # a tool message's call (the template reads the content)
    tool_calls: Optional[list[Any]] = None  # an assistant message's calls: refused (this server calls no tools)
    function_call: Optional[Any] = None
    refusal: Optional[str] = None
    audio: Optional[Any] = None


class ChatRequest(_Common):
    messages: list[Message]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    safety_identifier: Optional[str] = None
    moderation: Optional[dict[str, Any]] = None
    modalities: Optional[list[str]] = None
    audio: Optional[Any] = None
    prediction: Optional[Any] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None
    web_search_options: Optional[Any] = None


ROLES = ("system", "developer", "user", "assistant", "tool")


def ignored_fields(req: _Body) -> list[str]:
    """The :data:`IGNORED` fields ``req`` gives (not None), in the table's order."""
    def given(name: str) -> bool:
        obj: Any = req
        for part in name.split("."):
            obj = getattr(obj, part, None)
        return obj is not None

    return [f for f in IGNORED if given(f)] + list(getattr(req, "_ignored", None) or [])


def _text(text: str | None, where: str, param: str) -> str | None:
    """``text`` when it is UTF-8 text (or None); a 400 naming the field as an ``--input`` record's is named
    (``contract.text.json_text_error``) for one holding a lone surrogate (a JSON ``"\\ud800"`` escape)."""
    why = None if text is None else json_text_error(text, where)
    if why:
        raise ApiError(400, why, param)
    return text


def warning_header(fields: list[str]) -> dict:
    """The ``Warning`` header (RFC 7234 code 299) naming fields accepted and ignored; {} for none."""
    if not fields:
        return {}
    return {"Warning": f'299 ecache "accepted and ignored: {", ".join(fields)}"'}


def parse(model: type[_Body], body: Any) -> _Body:
    """Validate a JSON body against ``model``; the first problem becomes a 400 naming its field. A
    numeric field's bad value is refused first, in the words of the flag that sets it
    (:func:`check_numbers`)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_numbers(model, body)
    try:
        return model.model_validate(body, strict=True)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]
                       if not (isinstance(p, str) and (p.startswith(("list[", "dict[", "union[")) or p in (
                           "str", "int", "float", "bool", "function-after"))))
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"unrecognized request argument {loc!r}; see the OpenAI reference or the extensions "
                                "policy, tau, threshold, block_length, steps, ignore_eos, top_k", loc) from None
        if first["type"] == "missing":
            raise ApiError(400, f"{loc!r} is required", loc) from None
        parts = loc.split(".")
        if len(parts) == 3 and parts[0] == "messages" and parts[1].isdigit() and parts[2] == "content":
            content = body["messages"][int(parts[1])].get("content")  # --input's words for such a message
            raise ApiError(400, f"messages[{parts[1]}] 'content' must be a string or a list of text parts, not "
                                f"{shown(content)}", f"messages.{parts[1]}.content") from None
        if loc == "moderation":  # refused whatever its value (Resolver._unsupported's words), not for its type
            raise ApiError(400, MODERATION, loc) from None
        if loc == "prompt":  # a completion's prompt: text or token ids, the union's own words name only str
            raise ApiError(400, f"prompt must be a string or a list of token ids (got {shown(body['prompt'])})",
                           loc) from None
        raise ApiError(400, f"{loc}: {first['msg'].lower()} (got {shown(first.get('input'))})", loc) from None


#: Request fields checked in the range of a setting of another name (``config.option_ranges``).
_SETTING_OF = {"max_tokens": "gen_length", "max_completion_tokens": "gen_length"}
#: Request fields with the range and words of an ``ecache generate`` flag.
RANGED = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "tau", "threshold",
          "block_length", "steps")


def _number_kind(model: type[_Body], name: str) -> type | None:
    """``int`` or ``float`` for a numeric field of ``model`` (``Optional[int]`` ...), else None."""
    import typing

    field = model.model_fields.get(name)
    if field is None:
        return None
    kinds = [a for a in (typing.get_args(field.annotation) or (field.annotation,)) if a is not type(None)]
    return kinds[0] if kinds in ([int], [float]) else None


def check_numbers(model: type[_Body], body: dict) -> None:
    """400 for a top-level numeric field of ``model`` whose value is not a number of its kind, in the
    words every other place uses for the setting (``contract.fields.Range.not_finite``, after the field
    and the value as sent): ``max_tokens 1.5 must be a whole number ≥ 1 (e.g. 256)``, ``tau 1e400 must be
    a finite number ≥ 0 (...)``, ``top_k true ...``. A number sent as a string is refused as the Python API
    refuses it: ``temperature '0.5' must be a number, not a string (e.g. 0.5)`` (a string that is no number,
    or a number out of range, gets the range's words first). A field without a flag's range (``n``,
    ``presence_penalty`` ...) gets ``must be a whole number`` / ``must be a finite number``. A number of the
    right kind is checked against the flag's range as sent (``temperature -1 must be ≥ 0 ...``, as
    ``--temperature -1`` says), and again where the request is resolved, over the server's defaults."""
    import math

    # the canvas settings sent as whole numbers: a refused one's example fits them (`steps 0 … (e.g. 32)`
    # beside max_tokens 32), as the command line's does beside its other flags
    fit = {_SETTING_OF.get(k, k): v for k, v in body.items()
           if k in ("max_tokens", "max_completion_tokens", "block_length", "steps") and type(v) is int}
    for name, value in body.items():
        kind = _number_kind(model, name) if value is not None else None
        if kind is None:
            continue
        whole = kind is int
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        setting = _SETTING_OF.get(name, name) if name in RANGED else None
        if number and (isinstance(value, int) if whole else math.isfinite(value)):
            if setting:
                in_range(name, value, setting, fit)  # the number as sent (`-1`, not the float it becomes: `-1.0`)
            continue
        rng = option_ranges()[setting] if setting else None
        if rng is not None and fit:
            rng = dataclasses.replace(rng, example=fitting_example(setting, fit, rng.example))
        if isinstance(value, str):
            if setting:
                in_range(name, value, setting, fit)  # "abc", "nan", "0": the flag's words for what the text writes
            try:
                typed = int(value.strip()) if whole else float(value)
            except ValueError:
                typed = None
            if typed is not None and math.isfinite(typed):
                raise ApiError(400, f"{name} {value!r} must be a number, not a string (e.g. {typed!r})", name)
        words = rng.not_finite() if rng else "must be a whole number" if whole else "must be a finite number"
        plain = isinstance(value, str) and value and value.strip() == value  # a text as typed, as the flags' words
        raise ApiError(400, f"{name} {value if plain else shown(value)} {words}", name)


def in_range(field: str, value, setting: str | None = None, fit: dict | None = None) -> None:
    """400 naming ``field`` unless ``value`` is in the range of decode setting or policy parameter
    ``setting`` (default ``field``): ``config.check_setting``, the rule and the words ``ecache generate``
    checks its flag by (``--temperature -1.0 must be ≥ 0 (0 = greedy; e.g. 0.7)``), with the field for the
    flag; ``fit``: the other canvas settings sent, whose example a refused value gets. None passes."""
    if value is None:
        return
    try:
        check_setting(setting or field, value, field, fit)
    except EcacheError as e:
        raise ApiError(400, str(e), field) from None


#: ``ecache generate``'s flags as a request names them (the error of a shared check, in the API's words)
_FIELDS = (("--gen-length", "the canvas (max_tokens rounded up to whole blocks)"), ("--block-length", "block_length"),
           ("--steps", "steps"), ("--threshold", "threshold"), ("--cache", "policy"), ("--tau", "tau"),
           ("--top-p", "top_p"), ("--top-k", "top_k"), ("--temperature", "temperature"))


def api_words(msg: str) -> str:
    """A one-line error of a check the command line shares (``validate_decode``, ``CachePolicy.check_model``,
    ``make_policy``) with each flag replaced by the request field that sets it (``--cache block`` →
    ``policy block``), so a client reads the field it sent."""
    for flag, name in _FIELDS:
        msg = msg.replace(flag, name)
    return msg


def shown(v: Any) -> str:
    """``v`` as JSON text (a ``GivenFloat``, JSON's ``1e400``, as sent), cut to 60 characters."""
    import json

    if isinstance(v, GivenFloat):
        return v.text
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclasses.dataclass
class Limits:
    """Server-side bounds on a request: ``max_prompt_tokens`` (prompt ids), ``model_name`` (the id
    requests must name), ``request_timeout`` (seconds, None: none), ``seed`` (``ecache serve --seed``:
    the seeds of requests without one are drawn from a stream seeded by it, so a session replays; None:
    each such request draws a fresh random seed)."""

    max_prompt_tokens: int
    model_name: str
    request_timeout: float | None = None
    seed: int | None = None


class Resolver:
    """Turns a parsed request into a :class:`Job`: token ids through the model's tokenizer (and chat
    template for chat), decode settings over the server's (``settings``: a ``runs.settings.Settings``),
    the policy and the batching group."""

    def __init__(self, engine, lm, settings, limits: Limits):
        self.engine, self.lm, self.settings, self.limits = engine, lm, settings, limits
        self.seeds = random.Random(limits.seed) if limits.seed is not None else random  # seeds of requests without one

    # -- prompts --------------------------------------------------------------------------------------

    def completion_ids(self, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and all(isinstance(t, list) for t in p):  # a batch of token-id prompts
            if len(p) != 1:
                raise ApiError(400, f"prompt: a list of {len(p)} token-id lists is more than one prompt; send one "
                                    "prompt per request (requests are batched by the server)", "prompt")
            if not p[0]:
                raise ApiError(400, "prompt[0] is an empty list of token ids; give at least one token", "prompt")
            return self._token_ids(p[0])
        if isinstance(p, list) and p and not all(isinstance(t, str) for t in p):
            return self._token_ids(p)
        if isinstance(p, list):
            if not p:
                raise ApiError(400, "prompt is an empty list; give a string (or a list of token ids)", "prompt")
            if len(p) != 1:
                raise ApiError(400, f"prompt: {len(p)} prompts in one request; send one prompt per request "
                                    "(requests are batched by the server)", "prompt")
            p = p[0]
        if not p.strip():
            raise ApiError(400, "prompt is empty; give at least one token of text", "prompt")
        return self._encode(_text(p, "'prompt'", "prompt"), chat=False, param="prompt")

    def _token_ids(self, ids: list) -> list[int]:
        """``ids`` checked as every path checks a token-id prompt (``models.prompting.check_prompt_ids``:
        ``prompt: prompt_ids[1] = "a" is not an int token id; give ids of the model's tokenizer``)."""
        why = self.engine.check_prompt_ids(ids)
        if why:
            raise ApiError(400, f"prompt: {why}", "prompt")
        return list(ids)

    def chat_ids(self, req: ChatRequest) -> list[int]:
        if not self.lm.chat:
            raise ApiError(400, f"model {self.limits.model_name} has no chat template; use /v1/completions",
                           "messages")
        if not req.messages:
            raise ApiError(400, "messages is empty; give at least one {role, content} message", "messages")
        msgs = []
        for i, m in enumerate(req.messages):
            if m.role == "function":  # OpenAI's deprecated form of the tool role
                raise ApiError(400, f"messages[{i}].role 'function' is not supported: it answers a function call "
                                    "and this server calls no functions; send the text as a 'tool' or 'user' message",
                               f"messages.{i}.role")
            if m.role not in ROLES:
                raise ApiError(400, f"messages[{i}].role {m.role!r} is not supported; use one of {', '.join(ROLES)}",
                               f"messages.{i}.role")
            if m.tool_calls or m.function_call is not None:
                field = "tool_calls" if m.tool_calls else "function_call"
                raise ApiError(400, f"messages[{i}].{field}: this server calls no tools; leave the assistant's "
                                    "calls out", f"messages.{i}.{field}")
            if m.audio is not None:
                raise ApiError(400, f"messages[{i}].audio is not supported; this model reads text only",
                               f"messages.{i}.audio")
            if m.content is None and m.role != "assistant":  # OpenAI's schema: only an assistant's may be absent
                raise ApiError(400, f"messages[{i}].content is missing; a {m.role} message needs content (a string "
                                    "or a list of text parts)", f"messages.{i}.content")
            content = _text(m.content, f"messages[{i}] 'content'", f"messages.{i}.content") \
                if isinstance(m.content, str) or m.content is None else \
                "".join(self._part_text(part, i, j) for j, part in enumerate(m.content))
            msgs.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
        if not any(m["content"].strip() for m in msgs):
            named = [f"messages[{i}] ({req.messages[i].role})" for i in range(len(msgs))]
            if len(named) == 1:
                raise ApiError(400, f"{named[0]} has empty content; give it some text", "messages.0.content")
            shown = ", ".join(named[:4]) + (f" and {len(named) - 4} more" if len(named) > 4 else "")
            raise ApiError(400, f"every message has empty content ({shown}); give at least one of them some text",
                           "messages")
        return self._encode(msgs, chat=True, param="messages")

    @staticmethod
    def _part_text(part: ContentPart, i: int, j: int) -> str:
        """A text part's text; a text part without it, or any other part, is a 400 naming it."""
        if part.type == "text" and part.text is None:
            raise ApiError(400, f"messages[{i}].content[{j}]: a text part needs its 'text' ({{\"type\": \"text\", "
                                "\"text\": ...})", f"messages.{i}.content.{j}.text")
        if part.type != "text":
            raise ApiError(400, f"messages[{i}].content[{j}]: {part.type!r} parts are not supported; this model "
                                "reads text only ({\"type\": \"text\", \"text\": ...})", f"messages.{i}.content.{j}")
        return _text(part.text, f"messages[{i}].content[{j}] 'text'", f"messages.{i}.content.{j}.text")

    def _encode(self, prompt, chat: bool, param: str) -> list[int]:
        try:
            # OpenAI's tool messages reach the chat template (developer became system above)
            ids = self.engine.encode([prompt], chat=chat, roles=("system", "user", "assistant", "tool"))[0]
        except EcacheError as e:
            raise ApiError(400, f"{param}: {e}", param) from None
        if len(ids) > self.limits.max_prompt_tokens:
            raise ApiError(400, f"{param} has {len(ids)} tokens; this server takes at most "
                                f"{self.limits.max_prompt_tokens} (--max-prompt-tokens)", param,
                           code="context_length_exceeded")
        return ids

    # -- the job ----------------------------------------------------------------------------------------

    def job(self, req: _Common, endpoint: str, prompt_ids: list[int]) -> Job:
        """The :class:`Job` of a parsed request with its prompt ids. Raises ApiError (400) naming the field."""
        lim = self.limits
        if req.model != lim.model_name:
            raise ApiError(404, f"model {req.model!r} is not served here; this server serves {lim.model_name!r} "
                                "(GET /v1/models)", "model", code="model_not_found")  # OpenAI's (and every route's) 404
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options applies only with stream: true; set stream or leave stream_options out",
                           "stream_options")  # OpenAI's rule
        self._unsupported(req)
        base = self.settings.decode
        max_tokens = req.max_tokens
        if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
            if max_tokens is not None and max_tokens != req.max_completion_tokens:
                raise ApiError(400, "max_tokens and max_completion_tokens differ; give one", "max_completion_tokens")
            max_tokens = req.max_completion_tokens
        field = "max_completion_tokens" if isinstance(req, ChatRequest) and req.max_completion_tokens is not None \
            else "max_tokens"
        if max_tokens is None:
            max_tokens = base.gen_length
        in_range(field, max_tokens, "gen_length")
        block = base.block_length if req.block_length is None else req.block_length
        in_range("block_length", block)
        gen = -(-max_tokens // block) * block
        room = self.lm.spec.max_positions - len(prompt_ids)
        if block > room and req.block_length is not None:  # no number of tokens fits: the block is the problem
            raise ApiError(400, f"block_length {block}: one block and the prompt's {len(prompt_ids)} tokens exceed "
                                f"the model's {self.lm.spec.max_positions} positions; use at most {max(room, 0)} "
                                f"(e.g. 32)", "block_length", code="context_length_exceeded")
        if gen > room:  # the command line's words (engine.checks.prompt_too_long), the field for the flag
            from ..engine.checks import prompt_too_long

            asked = max_tokens if gen == max_tokens else f"{max_tokens} (in whole blocks of {block}: {gen})"
            why = prompt_too_long(self.lm.spec, len(prompt_ids), asked, block).replace("--gen-length", field)
            raise ApiError(400, api_words(why), field, code="context_length_exceeded")
        temperature = base.temperature if req.temperature is None else req.temperature
        in_range("temperature", temperature)  # ecache generate's range (≥ 0), which holds OpenAI's 0-2
        top_p = base.top_p if req.top_p is None else req.top_p
        in_range("top_p", top_p)
        top_k = base.top_k if req.top_k is None else req.top_k
        in_range("top_k", top_k)
        threshold = base.threshold if req.threshold is None else req.threshold
        in_range("threshold", threshold)
        parallel = threshold is not None or base.factor is not None
        steps = req.steps
        in_range("steps", steps)
        if steps is None:
            steps = self._default_steps(gen, block, parallel)
        cfg = dataclasses.replace(base, gen_length=gen, block_length=block, steps=steps, temperature=temperature,
                                  top_p=top_p, top_k=top_k, threshold=threshold,
                                  ban_eos=base.ban_eos if req.ignore_eos is None else req.ignore_eos)
        self._check_decode(cfg, req)
        self._ignored_decode(cfg, req)
        name, params = self._policy(req)
        stop = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if len(stop) > MAX_STOP or any(not s for s in stop):
            raise ApiError(400, f"stop: give at most {MAX_STOP} non-empty strings (got {shown(req.stop)})", "stop")
        width = min(-(-len(prompt_ids) // PROMPT_BUCKET) * PROMPT_BUCKET, self.lm.spec.max_positions - gen)
        key = GroupKey(cfg=cfg, policy=name, params=tuple(sorted(params.items())), prompt_width=width)
        if req.seed is not None:  # ecache generate --seed's range and words
            try:
                option_ranges()["seed"].check(req.seed)
            except ValueError as e:
                raise ApiError(400, f"seed {req.seed} {e}", "seed") from None
        seed = self.seeds.getrandbits(63) if req.seed is None else req.seed
        return Job(endpoint=endpoint, prompt_ids=prompt_ids, key=key,
                   make_policy=lambda: make_policy(name, strict=False, **params), max_tokens=max_tokens, stop=stop,
                   stream=bool(req.stream), seed=seed, timeout=lim.request_timeout)

    def _default_steps(self, gen: int, block: int, parallel: bool) -> int | None:
        """The server's steps per generated token × ``gen``, at least one a block; None in threshold
        mode without steps (a block runs until it has no masks)."""
        base = self.settings.decode
        base_parallel = base.parallel
        base_steps = default_steps(base.gen_length, base.steps, base_parallel)
        if base_steps is None:
            return None if parallel else gen
        per_block = max(1, round(block * base_steps / base.gen_length))
        return per_block * (gen // block)

    def _check_decode(self, cfg, req: _Common) -> None:
        """The schedule and remasking checks of ``ecache generate`` (``runs.settings.validate_decode``) and
        the decoder's build on the served model (``StepDecoder.build``), as 400s naming the field."""
        from ..decoding.step import StepDecoder
        from ..runs.settings import validate_decode

        try:
            validate_decode(cfg.as_dict())
            none = torch.zeros(0, dtype=torch.long)
            StepDecoder.build(cfg, self.lm.spec, none, none)  # the engine's checks against the model's rules
        except EcacheError as e:
            msg = str(e)
            param = next((f for f, flag in (("steps", "--steps"), ("block_length", "--block-length"),
                                            ("threshold", "--threshold"), ("top_p", "--top-p"), ("top_k", "--top-k"))
                          if flag in msg), None)
            raise ApiError(400, api_words(msg), param) from None

    def _ignored_decode(self, cfg, req: _Common) -> None:
        """A request's ``steps`` that its threshold or factor rule ignores (or that its blocks' masks run out
        before), and its ``top_p`` / ``top_k`` that greedy
        decoding drops (temperature 0 under LLaDA's rules), are named in the Warning header: the rules
        ``ecache generate`` warns ``--steps`` and ``--top-p`` by (``decoding.commit.ignored_steps``,
        ``ignored_sampling``)."""
        from ..decoding.commit import idle_steps, ignored_sampling, ignored_steps

        sampler = self.lm.spec.sampler
        whys = [rule(cfg, sampler) if req.steps is not None else None for rule in (ignored_steps, idle_steps)]
        whys += [ignored_sampling(cfg, self.lm.spec.sampler, (flag,)) for field, flag in (("top_p", "--top-p"),
                                                                                           ("top_k", "--top-k"))
                 if getattr(req, field) is not None]
        # the command line's warning, each flag named as the field sent (``steps 8 does nothing with threshold
        # 0.9: …``); "ignored" is the header's own word
        req._ignored += [api_words(why).replace("; ignored", "") for why in whys if why]

    def _policy(self, req: _Common) -> tuple[str, dict]:
        """The request's cache policy and parameters over the server's (``Settings.policy``'s rule)."""
        s = self.settings
        name = s.cache if req.policy is None else req.policy
        spec = self.lm.spec
        if isinstance(name, str) and ":" in name and name.split(":")[0] in POLICIES:  # chat's /cache NAME:k=v form
            raise ApiError(400, f"policy {name!r} gives parameters; send the policy's name alone (\"policy\": "
                                f"{name.split(':')[0]!r}): a request sets tau beside it, the server's flags and "
                                "profile set the others", "policy")
        if name not in POLICIES:
            raise ApiError(400, str(unknown_policy(name, "policy", policies_for(spec), hint=False)), "policy")
        try:  # a policy made for the other kind of attention: the engine's one line (CachePolicy.check_model)
            POLICIES[name].check_model(POLICIES[name], spec)
        except EcacheError as e:
            raise ApiError(400, api_words(str(e)), "policy") from None
        known = policy_params(name)
        if name == s.cache:
            params = dict(s.cache_params)
        else:
            params = {k: v for k, v in s.all_cache_params.items() if k in known}
        if name == "entropy" and "tau" not in params:
            params["tau"] = s.cache_params.get("tau", DEFAULT_TAU)
        if req.tau is not None:
            in_range("tau", req.tau)  # --tau's own range check and message
            if "tau" in known:
                params["tau"] = req.tau
            elif "entropy" not in policies_for(spec):  # ignored and named, as generate warns --tau
                req._ignored.append(f"tau (the {spec.family} model family takes no tau: block diffusion caches "
                                    "finished blocks exactly)")
            else:
                req._ignored.append(f"tau is not used by policy {name} ({policy_takes(name)})")  # --tau's words
        try:
            make_policy(name, strict=False, **params)
        except EcacheError as e:
            raise ApiError(400, f"policy {name}: {api_words(str(e))}", "tau" if req.tau is not None else "policy") \
                from None
        return name, params

    @staticmethod
    def _unsupported(req: _Common) -> None:
        """Refuse OpenAI fields this server cannot honour; their neutral values (``tool_choice`` ``"none"`` or
        ``"auto"`` with no tools, an empty ``tools`` list ...) pass and are named in the Warning header."""
        checks = [("n", req.n not in (None, 1), "n must be 1: one choice per request (send more requests; they are "
                                               "batched)")]
        checks += [(f, getattr(req, f) not in (None, 0, 0.0), f"{f} is not supported (diffusion decoding has no "
                                                              "per-token penalties); leave it out or 0")
                   for f in ("presence_penalty", "frequency_penalty")]
        checks.append(("logit_bias", bool(req.logit_bias), "logit_bias is not supported; leave it out"))
        if isinstance(req, CompletionRequest):
            checks += [("logprobs", req.logprobs is not None, "logprobs is not supported; leave it out"),
                       ("echo", bool(req.echo), "echo is not supported; leave it out"),
                       ("best_of", req.best_of not in (None, 1), "best_of must be 1"),
                       ("suffix", bool(req.suffix), "suffix (insertion) is not supported; leave it out")]
        if isinstance(req, ChatRequest):
            checks += [("logprobs", bool(req.logprobs), "logprobs is not supported; leave it out"),
                       ("top_logprobs", req.top_logprobs is not None, "top_logprobs is not supported; leave it out"),
                       ("tools", bool(req.tools), "tools are not supported; leave them out"),
                       ("tool_choice", req.tool_choice not in (None, "none", "auto"), "tool_choice is not supported "
                                                                                      "(this server calls no tools); "
                                                                                      "leave it out or use \"none\""),
                       ("functions", bool(req.functions), "functions are not supported; leave them out"),
                       ("function_call", req.function_call not in (None, "none", "auto"),
                        "function_call is not supported (this server calls no functions); leave it out or use "
                        "\"none\""),
                       ("response_format", req.response_format not in (None, {"type": "text"}),
                        "response_format: only {\"type\": \"text\"} is supported"),
                       ("modalities", req.modalities not in (None, ["text"]), "modalities: only [\"text\"] is "
                                                                              "supported"),
                       ("audio", req.audio is not None, "audio output is not supported; leave it out"),
                       ("prediction", req.prediction is not None, "prediction (predicted outputs) is not supported; "
                                                                  "leave it out"),
                       ("reasoning_effort", req.reasoning_effort is not None, "reasoning_effort is not supported "
                                                                              "(not a reasoning model); leave it out"),
                       ("verbosity", req.verbosity is not None, "verbosity is not supported; leave it out"),
                       ("web_search_options", req.web_search_options is not None, "web search is not supported; "
                                                                                  "leave it out"),
                       ("moderation", req.moderation is not None, MODERATION)]
        for field, bad, msg in checks:
            if bad:
                raise ApiError(400, msg, field)
        for field, _, _ in checks[1:]:  # given, neutral: accepted and ignored, as IGNORED's fields are (n=1 is kept)
            if getattr(req, field) is not None:
                req._ignored.append(f"{field} ({NEUTRAL[field]})")
