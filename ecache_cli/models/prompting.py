"""Prompts to token ids: plain text, chat messages through the checkpoint's chat template, or ids.

The chat rule (LLaDA and Dream model cards): the tokenizer's chat template renders the messages with
the generation prompt appended, and the rendered text is tokenized without adding special tokens (the
template carries the BOS).
"""

from __future__ import annotations

import json
from typing import Sequence

from ..errors import DataError, UsageError

#: The roles a chat message may have: those of the LLaDA and Dream chat templates (tokenizer_config.json
#: ``chat_template``; the Hugging Face chat format).
CHAT_ROLES = ("system", "user", "assistant")

#: The fix a refused token-id prompt is told, in every path that takes ids (the command line's
#: ``--input`` records, the Python API, ``ecache serve``'s ``prompt``).
IDS_FIX = "give ids of the model's tokenizer"


def check_messages(messages: Sequence, roles: Sequence[str] = CHAT_ROLES) -> str | None:
    """Why a list of chat messages cannot be templated, as a one-line reason naming the message
    (``messages[1] has role 'tool'; use one of system, user, assistant``), or None if it can. Each
    message is a dict with a role of ``roles`` (:data:`CHAT_ROLES` unless a caller widens it: ``ecache
    serve`` takes OpenAI's ``tool`` messages) and a string ``content``. The one check of messages for
    ``--input`` records (``runs.inputs.prompt_of``) and the Python API (``engine.checks.check_prompts``),
    so both refuse the same messages with the same words."""
    if not len(messages):
        return "'messages' is empty; give at least one {role, content} message"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"messages[{i}] = {_shown(m)} is not a {{role, content}} message"
        if m["role"] not in roles:
            return f"messages[{i}] has role {m['role']!r}; use one of {', '.join(roles)}"
        if not isinstance(m["content"], str):
            return f"messages[{i}] 'content' must be a string, not {_shown(m['content'])}"
    return None


def _shown(value) -> str:
    """``value`` as JSON when it is JSON (as it was written in a record), else its repr."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def check_prompt_ids(spec, ids: Sequence[int]) -> str | None:
    """Why a prompt given as token ids cannot be decoded, as a one-line reason, or None if it can.

    Ids must be ints in [0, spec.vocab_size) (the embedding rows) and never the mask id (a masked
    prompt position would be generated). Non-int entries are reported too (:func:`not_token_id`). Each
    reason ends with its fix (:data:`IDS_FIX`).
    """
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            return not_token_id(i, t)
        if not 0 <= t < spec.vocab_size:
            return f"prompt_ids[{i}] = {t} is outside the model's vocabulary [0, {spec.vocab_size}); {IDS_FIX}"
        if t == spec.mask_id:
            return f"prompt_ids[{i}] = {t} is the mask id; a prompt holds no mask tokens; {IDS_FIX}"
    return None if len(ids) else "prompt_ids is empty; give at least one token id"


def not_token_id(index: int, value) -> str:
    """The reason entry ``index`` of a token-id prompt, ``value``, is no token id: shown as JSON where it
    is JSON (``prompt_ids[1] = "a" is not an int token id; give ids of the model's tokenizer``), the
    words of a record, a request and the Python API alike."""
    return f"prompt_ids[{index}] = {_shown(value)} is not an int token id; {IDS_FIX}"


def encode_prompts(tokenizer, spec, prompts: Sequence[str | list], chat: bool) -> list[list[int]]:
    """Token ids of each prompt: a string, a list of chat messages ({role, content} dicts), or a list of
    token ids (ints: used as they are, no chat template; checked with :func:`check_prompt_ids`).

    With ``chat`` a string prompt is one user message through the chat template, when the tokenizer has
    one. Raises UsageError for an empty prompt, a prompt of another type (None, a number), one string in
    place of the list, messages without a template, or text that encodes to the mask token (its literal
    spelling, :func:`mask_in_text`; numbered ``prompt N:`` among several prompts); DataError for bad ids.
    """
    if isinstance(prompts, (str, bytes)):
        raise UsageError("prompts must be a list of prompts, not one string: pass [prompt]")
    out = []
    for p in prompts:
        if not isinstance(p, (str, list, tuple)):
            raise UsageError(f"prompt {len(out) + 1} is {p!r}; a prompt is text, a list of chat messages or a list "
                             "of token ids")
        if isinstance(p, (list, tuple)) and not p:
            raise UsageError("a prompt is empty; give at least one token of text")
        if isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            why = check_prompt_ids(spec, p)
            if why:
                raise DataError(f"prompt {len(out) + 1}: {why}")
            out.append(list(p))
            continue
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(p, list):
            if not template:
                raise UsageError("chat messages need a checkpoint with a chat template; pass a plain prompt")
            text = tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
        elif chat and template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True)
        else:
            text = p
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise UsageError("a prompt is empty; give at least one token of text")
        if spec.mask_id in ids:
            where = f"prompt {len(out) + 1}: " if len(prompts) > 1 else ""
            raise UsageError(f"{where}{mask_in_text(tokenizer, spec, ids)}")
        out.append(list(ids))
    return out


def mask_in_text(tokenizer, spec, ids: Sequence[int], encoded: str = "prompt", remove_from: str = "the text") -> str:
    """The reason a prompt's text cannot be decoded when it encodes to ``spec.mask_id`` (``ids``: the token
    ids of the ``encoded`` text, holding it): the text spells the mask token, a position the model would
    generate, not read. ``remove_from``: what the fix tells the user to edit."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    spelling = f" {convert(spec.mask_id)!r}" if convert is not None else ""
    return (f"the text holds the mask token{spelling} (token id {spec.mask_id}, at position "
            f"{list(ids).index(spec.mask_id)} of the encoded {encoded}); a prompt holds no mask tokens; remove it "
            f"from {remove_from}")
