"""The part of an answer that is final while it decodes: what ``ecache serve`` streams and ``ecache chat``
prints as it goes.

A diffusion model commits answer positions out of order, so a token is *final for the reader* only
when no masked position lies before it: the answer's final prefix is the generated positions before
the first mask (:func:`final_lengths`). :func:`cut_answer` reads such a prefix as the answer text (cut
at the end token, at ``max_tokens`` and before the first stop string) and says whether the answer is
decided; :func:`streamable` is the part of that text that can be shown now (no trailing partial UTF-8
character, no tail that may start a stop string). :class:`FinalText` follows one row of a run with
them and hands out the newly final text step by step.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def final_lengths(gen_masked: torch.Tensor) -> list[int]:
    """Per row, the answer positions before the first mask: ``gen_masked`` (B, G) bool (the generated
    positions still masked) → B ints in [0, G]."""
    G = gen_masked.shape[1]
    return torch.where(gen_masked.any(1), gen_masked.int().argmax(1), G).tolist()


def unsettled(run) -> torch.Tensor:
    """(B, T) bool: the canvas positions of ``run``'s rows that may still change: the masks, and with token
    editing (LLaDA2.1, ``decoding/editing.py``) every position of a row's current block until the block
    ends, since a later step may rewrite its committed tokens. What precedes a row's first such position is
    final. Read between steps (after a step, before the rows' clocks move on)."""
    st = run.state
    if run.decoder.editing is None:
        return st.masked
    return st.masked | st.in_block() & ~st.block_done[:, None]


def tokens_reaching(ids: list[int], chars: int, decode: Callable[[list[int]], str]) -> int:
    """The fewest leading tokens of ``ids`` whose decoded text has at least ``chars`` characters (a
    binary search: a prefix's text grows with it), i.e. the tokens that produced an answer cut there."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid])) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def cut_answer(ids: list[int], end_ids: set[int], decode: Callable[[list[int]], str], max_tokens: int,
               stop: Sequence[str] = ()) -> tuple[str, str | None, int]:
    """Read an answer's final prefix ``ids`` (generated positions before the first mask).

    Returns (text, reason, tokens): the text cut at the first end token (``end_ids``), at ``max_tokens``
    tokens and before the first ``stop`` string; ``reason`` ``stop`` (end token or stop string),
    ``length`` (``max_tokens`` reached) or None (not decided yet); ``tokens`` the answer tokens that
    produced the text (up to a stop string when one cut it). The rule of the OpenAI API's
    ``finish_reason`` (``ecache serve``)."""
    end = next((i for i, t in enumerate(ids) if t in end_ids), None)
    answer = (ids if end is None else ids[:end])[:max_tokens]
    text = decode(answer)
    cut = min((text.find(s) for s in stop if s in text), default=-1)
    if cut >= 0:
        return text[:cut], "stop", tokens_reaching(answer, cut, decode)
    if end is not None and end <= max_tokens:
        return text, "stop", len(answer)
    if len(ids) >= max_tokens:
        return text, "length", len(answer)
    return text, None, len(answer)


def streamable(text: str, reason: str | None, stop: Sequence[str] = ()) -> str:
    """The part of an answer's ``text`` that can be sent now: all of it once decided (``reason`` set),
    else without a trailing partial UTF-8 character (decoded as U+FFFD) or a tail that may be the start
    of a stop string."""
    if reason is not None:
        return text
    text = text.rstrip("\ufffd")
    hold = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[:len(text) - hold]


class FinalText:
    """One row of a run, read step by step as its answer becomes final (module docstring).

    ``end_ids``: the model's end tokens; ``decode``: token ids → text (special tokens skipped);
    ``max_tokens``: the answer's cut (the run's ``gen_length`` for a whole canvas). After each step,
    :meth:`advance` with the row's generated positions returns the text that became final (possibly
    empty); ``text`` / ``reason`` are the answer so far and whether it is decided.
    """

    def __init__(self, end_ids: set[int], decode: Callable[[list[int]], str], max_tokens: int,
                 stop: Sequence[str] = ()):
        self.end_ids, self.decode, self.max_tokens, self.stop = end_ids, decode, max_tokens, list(stop)
        self.seen = 0  # final positions at the last change
        self.text, self.reason, self.tokens = "", None, 0
        self.sent = ""

    def advance(self, gen_tokens: torch.Tensor, gen_masked: torch.Tensor) -> str:
        """``gen_tokens`` (G,) long and ``gen_masked`` (G,) bool: the row's generated positions now.
        Returns the newly final text (what was not returned before)."""
        n = final_lengths(gen_masked[None])[0]
        if n > self.seen:
            self.seen = n
            self.text, self.reason, self.tokens = cut_answer(gen_tokens[:n].tolist(), self.end_ids, self.decode,
                                                             self.max_tokens, self.stop)
        return self._new(streamable(self.text, self.reason, self.stop))

    def finish(self, gen_tokens: Sequence[int]) -> str:
        """The row's final canvas (``gen_tokens``, G ids): the rest of the answer not returned yet."""
        self.text, reason, self.tokens = cut_answer(list(gen_tokens), self.end_ids, self.decode, self.max_tokens,
                                                    self.stop)
        self.reason = reason or "length"
        return self._new(self.text)

    def _new(self, text: str) -> str:
        if len(text) > len(self.sent) and text.startswith(self.sent):
            new, self.sent = text[len(self.sent):], text
            return new
        return ""


def empty_reason(ended: Sequence[bool]) -> str:
    """Why every answer of a run is empty text, by whether each ``ended`` at once (no answer token before
    its end marker): the model ended them at once, or (none did) their tokens decode to no text, as special
    or reserved tokens do, or both. One wording for generate's and profile's warnings."""
    if all(ended):
        return "the model ended each answer at once"
    if not any(ended):
        return "their tokens decode to no text (special or reserved tokens)"
    return "the model ended some at once and wrote tokens that decode to no text in the others"
