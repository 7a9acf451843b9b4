"""``ecache generate --input``: every record read and checked before anything is decoded.

A record is invalid when its line is not UTF-8, not JSON, has no usable prompt field (``prompt``,
``messages`` or ``prompt_ids``: ``inputs.prompt_of``), holds token ids the model cannot take
(``Engine.check_prompt_ids``), cannot be templated or tokenized (``Engine.encode``), or does not fit
the canvas: its token count after the chat template plus ``--gen-length`` must not exceed the
model's positions (``ModelSpec.max_positions``; the engine's own rule, ``engine/core.py`` ``Run``).
Without ``--skip-invalid`` one error names every invalid line with its fix and nothing is decoded.

A ``--task`` run's prompts are built from benchmark records (``tasks``); :func:`encode_task_prompts`
encodes them and names the ``--data`` line whose text the model cannot take.
"""

from __future__ import annotations

from pathlib import Path

from ..engine.checks import gen_length_fit, room_fix
from ..errors import EcacheError, UsageError
from .inputs import FIX, SKIP_FIX, Item, invalid_error, read_records, source_head

__all__ = ["FIX", "SKIP_FIX", "Item", "check_items", "check_prompts", "encode_task_prompts", "invalid_error",
           "read_input"]


def read_input(input_file: Path, engine, chat: bool, gen_length: int, block_length: int) -> list[Item]:
    """Every record of ``--input`` (``-``: stdin) as an :class:`Item`, each checked (module docstring).

    Raises DataError when the file cannot be read at all."""
    return check_items(read_records(input_file), engine, chat, gen_length, block_length)


def check_items(items: list[Item], engine, chat: bool, gen_length: int, block_length: int) -> list[Item]:
    """The model's checks of every still-valid item (token ids, template and tokenizer, the canvas),
    the one place every command checks its prompts (generate, profile, trace-drift): an invalid one
    gets its ``error`` (``source:line: reason; fix``) and loses its ``prompt``; a valid one keeps its
    encoded ``ids``. Items already invalid (``inputs.read_records``) keep their error. Returns ``items``."""
    for item in items:
        if item.error is None:
            prompt, item.prompt = item.prompt, None
            where = f"{item.source}:{item.line}" if item.source else f"line {item.line}"
            item.error = _model_error(item, prompt, engine, chat, (gen_length, block_length), where)
    return items


def check_prompts(items: list[Item], engine, chat: bool, gen_length: int, block_length: int,
                  input_file: Path | None) -> None:
    """The model's checks (:func:`check_items`) of every item of ``inputs.read_items`` (read with
    ``raise_invalid=False``) before anything is decoded: UsageError (exit 2) naming every invalid
    prompt, those the reading refused and those the model cannot decode, with its fix, as for
    generate's ``--input`` (profile and trace-drift have no ``--skip-invalid``)."""
    check_items(items, engine, chat, gen_length, block_length)
    head, what = source_head(items, input_file)
    error = invalid_error(items, head, what=what, fix=FIX)
    if error is not None:
        raise error


def _model_error(item: Item, prompt, engine, chat: bool, canvas: tuple[int, int], where: str) -> str | None:
    """Why the model cannot decode ``prompt`` with ``canvas`` (gen_length, block_length) (None: it can,
    and ``item`` gets its prompt and ids)."""
    gen_length, block_length = canvas
    rec = item.rec if isinstance(item.rec, dict) else {}
    if isinstance(rec.get("prompt_ids"), list):
        why = engine.check_prompt_ids(prompt)
        if why:
            return f"{where}: {why}"
    try:
        (ids,) = engine.encode([prompt], chat)
    except EcacheError as e:
        return f"{where}: {e}"
    limit = engine.spec.max_positions
    fit_gen = gen_length_fit(engine.spec, len(ids), block_length)  # whole blocks, as the run needs
    if gen_length > fit_gen:
        templated = isinstance(rec.get("messages"), list) or (chat and "prompt_ids" not in rec)
        templ = " after the chat template" if templated else ""
        fit = limit - gen_length - (block_length - 1) * engine.spec.block_causal
        fixes = [f"shorten it to at most {fit} tokens" if fit > 0 else "",
                 room_fix(engine.spec, len(ids), block_length)]
        fix = " or ".join(f for f in fixes if f) or "lower --gen-length"
        return (f"{where}: the prompt ({len(ids)} tokens{templ}) + --gen-length {gen_length} exceeds the "
                f"model's {limit} positions; {fix}")
    item.prompt, item.ids = prompt, ids
    return None


def encode_task_prompts(engine, prompts: list, records: list[list], chat: bool) -> list[list[int]]:
    """Token ids of each ``--task`` prompt (``prompts``: ``task.prompt``'s texts; ``records[i]``: the
    benchmark examples whose text prompt i holds, ``Task.prompt_examples``), as ``engine.encode`` gives
    them, before anything is decoded.

    Raises UsageError as ``engine.encode`` does, except that a prompt whose text spells the mask token
    names the record it comes from (the question's, or a shot's placed before it): its ``--data`` line
    (``FILE:LINE``), else ``example <id>``, so every command (profile, calibrate, trace-drift) points at
    the same line."""
    out = []
    for prompt, examples in zip(prompts, records):
        try:
            (ids,) = engine.encode([prompt], chat)
        except UsageError as e:
            raise UsageError(_record_with_mask(engine, examples) or str(e)) from None
        out.append(ids)
    return out


def _record_with_mask(engine, examples: list) -> str | None:
    """The mask-token error naming the first of ``examples`` (shots, then the question) whose text in the
    prompt spells it, or None."""
    from ..models.prompting import mask_in_text

    for ex in examples:
        for text in (ex.question, ex.answer) if ex is not examples[-1] else (ex.question,):  # shots are solved
            ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
            if engine.spec.mask_id in ids:
                return f"{ex.named()}: {mask_in_text(engine.tokenizer, engine.spec, ids, 'record', 'that record')}"
    return None
