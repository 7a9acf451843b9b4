"""What the library refuses before a run starts, with the command line's messages (UsageError): the
Python API (``Engine.encode``, ``Engine.start``, ``Run.add``) checks what the commands check."""

from __future__ import annotations

from typing import Sequence

from ..contract.fields import SEED, text_number
from ..contract.text import not_text_words
from ..decoding.config import DecodeConfig
from ..errors import UsageError
from ..models.prompting import CHAT_ROLES, check_messages, check_prompt_ids


def check_prompts(spec, prompts: Sequence, roles: Sequence[str] = CHAT_ROLES, chat: bool = False) -> None:
    """UsageError for one string where the list of prompts belongs, a text prompt that is empty or only
    white space (the chat template would make a prompt of it), or chat messages ``--input`` refuses
    (``models.prompting.check_messages``: a role not in ``roles``, by default system, user, assistant as
    for ``--input``; a content that is not a string; the same words as the command line's); token-id
    prompts and prompts of other types are checked by ``models.prompting.encode_prompts``; ``chat`` that is
    not True or False (``chat="yes"``, which would read as True)."""
    if not isinstance(chat, bool):
        raise UsageError(f"chat {chat!r} must be True or False")
    if isinstance(prompts, (str, bytes)):
        raise UsageError("prompts must be a list of prompts, not one string: pass [prompt]")
    for n, p in enumerate(prompts, 1):
        if isinstance(p, str) and not p.strip():
            raise UsageError(f"prompt {n} {p!r}: a prompt is empty; give at least one token of text")
        texts = [p] if isinstance(p, str) else [m.get("content") for m in p if isinstance(m, dict)] \
            if isinstance(p, (list, tuple)) else []
        for text in texts:
            _check_utf8(text, f"prompt {n}")
        if isinstance(p, (list, tuple)) and p and not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            why = check_messages(p, roles)
            if why:
                raise UsageError(f"prompt {n}: {why}")


def _check_utf8(text, where: str) -> None:
    """UsageError for a string that is not UTF-8 text (:func:`~ecache_cli.contract.text.not_text_words`),
    in the command line's words for such a prompt argument: ``prompt 1: not UTF-8 text (byte 0xe9 at
    character 4)``."""
    words = not_text_words(text) if isinstance(text, str) else None
    if words:
        raise UsageError(f"{where}: {words}; pass UTF-8 text")


def gen_length_fit(spec, prompt_len: int, block_length: int) -> int:
    """The largest ``--gen-length`` (whole blocks of ``block_length`` tokens) that fits beside a prompt of
    ``prompt_len`` tokens in the model's ``spec.max_positions``: a block-diffusion model's last block decodes
    whole, so its canvas is ``block_length - 1`` positions wider (``engine/canvas.py``). ≤ 0 when none fits."""
    room = spec.max_positions - prompt_len - (block_length - 1) * spec.block_causal
    return room // block_length * block_length


def room_fix(spec, prompt_len: int, block_length: int) -> str:
    """How to make room for a prompt of ``prompt_len`` tokens, as flags the same run accepts: ``lower
    --gen-length to at most N`` (:func:`gen_length_fit`, whole blocks of ``block_length``); where no whole
    block of that length fits (one block as long as the model's positions), the longest gen-length in whole
    blocks of a smaller power-of-two length, ``use --gen-length N --block-length B``; "" where none fits."""
    fit = gen_length_fit(spec, prompt_len, block_length)
    if fit > 0:
        return f"lower --gen-length to at most {fit}"
    for block in (32, 16, 8, 4, 2, 1):
        if block < block_length and (fit := gen_length_fit(spec, prompt_len, block)) > 0:
            return f"use --gen-length {fit} --block-length {block}"
    return ""


def prompt_too_long(spec, prompt_len: int, gen_length: int | str, block_length: int, which: str = "prompt") -> str:
    """The one wording of a prompt of ``prompt_len`` tokens (a batch's longest) that leaves no room for
    ``gen_length`` in ``spec.max_positions``, with a gen-length the same run accepts (:func:`room_fix`);
    ``which``: how the prompt is named (``prompt 2`` among several). ``gen_length`` may be given as the
    text to show (the server's ``max_tokens 50 (in whole blocks of 32: 64)``)."""
    fix = room_fix(spec, prompt_len, block_length)
    fix = f"{fix} or shorten the prompt" if fix else "shorten the prompt (fewer shots or less context)"
    return f"{which} ({prompt_len} tokens) + --gen-length {gen_length} exceeds the model's {spec.max_positions} " \
           f"positions; {fix}"


def check_ids(spec, ids: Sequence[int], where: str, width: int | None = None) -> None:
    """UsageError (``where: reason; fix``) for token ids the model cannot take, none, or (``width``: a
    run's prompt width) more than fit the run."""
    if not len(ids):
        raise UsageError(f"{where}: a prompt is empty; give at least one token id")
    if width is not None and len(ids) > width:
        raise UsageError(f"{where} of {len(ids)} tokens exceeds this run's prompt width {width}; "
                         "start a run with a larger prompt_width")
    why = check_prompt_ids(spec, list(ids))
    if why:
        raise UsageError(f"{where}: {why}")


def check_start(cfg: DecodeConfig, prompt_ids: Sequence[Sequence[int]], prompt_width: int | None = None,
                spec=None, policy=None, seed: int = 0) -> None:
    """A run's arguments before anything is built: some prompts, a DecodeConfig (its values are checked
    by the decoder it builds), a ``policy`` with the cache-policy interface (``reset``, ``plan``,
    ``observe``: ``cache.make_policy``'s, not a policy's name), a ``seed`` in ``--seed``'s range
    (``contract.fields.SEED``: ``seed -1 must be ≥ 0 (a 64-bit seed; e.g. 0)``) and a ``prompt_width`` that
    is None or a whole number ≥ 1 (the canvas's prompt positions; a prompt longer than it is refused by
    ``Run.add``) that leaves the model's positions room for ``cfg.gen_length``, unless the longest prompt
    already does not (then the prompt is named, ``Run``). With the model's ``spec``, each prompt's ids too
    (:func:`check_ids`), named by the place it was passed in, counted from 1 as ``Engine.encode`` and the
    command line count prompts:
    ``prompt 2: a prompt is empty; give at least one token id``."""
    if not prompt_ids:
        raise UsageError("no prompts to generate from")
    if not isinstance(cfg, DecodeConfig):
        raise UsageError(f"cfg must be a DecodeConfig, not {type(cfg).__name__}")
    number = text_number(seed)  # a number as text: its range first, as the server checks one
    if number is None and (isinstance(seed, bool) or not isinstance(seed, int)):  # --seed's range and words
        raise UsageError(f"seed {seed!r} {SEED.not_finite()}")
    try:
        SEED.check(seed if number is None else number)
    except ValueError as e:
        raise UsageError(f"seed {seed!r} {e}") from None
    if number is not None:
        raise UsageError(f"seed {seed!r} must be a number, not a string (e.g. {number!r})")
    if not all(callable(getattr(policy, m, None)) for m in ("reset", "plan", "observe")):  # the policy interface
        fix = f"make_policy({policy!r})" if isinstance(policy, str) else "make_policy(name)"
        raise UsageError(f"policy must be a CachePolicy, not {type(policy).__name__}: pass {fix} (ecache_cli.cache)")
    if prompt_width is not None and (isinstance(prompt_width, bool) or not isinstance(prompt_width, int)
                                     or prompt_width < 1):
        raise UsageError(f"prompt_width {prompt_width!r} must be a whole number ≥ 1 (the canvas's prompt "
                         "positions; leave it unset for the longest prompt's)")
    for n, ids in enumerate(prompt_ids if spec is not None else [], 1):
        check_ids(spec, ids, f"prompt {n}")
    if spec is not None and prompt_width is not None:
        longest = max(len(p) for p in prompt_ids)
        room = spec.max_positions - cfg.gen_length - (cfg.block_length - 1) * spec.block_causal
        if prompt_width > max(longest, room):  # the width, not a prompt, leaves no room for the generation
            raise UsageError(f"prompt_width {prompt_width} + gen_length {cfg.gen_length} exceeds the model's "
                             f"{spec.max_positions} positions; use a prompt_width of at most {room} (the longest "
                             f"prompt has {longest} tokens) or leave it unset")
