"""Comma-list option values (``--task arith,code``, ``--taus 0.1,0.5``, ``--recent-k 16,32``,
``--shots 0,4``, ``--policies none,dual``): one parser for every command and benchmark, so each refuses an
empty entry and a repeated value the same way, with a usage error that names the flag, the value and
the fix."""

from __future__ import annotations

import shlex
from typing import Callable, TypeVar

from ..errors import UsageError

T = TypeVar("T")


def parse_list(text: str, flag: str, kind: Callable[[str], T] = str, what: str = "", example: str = "",
               rng=None) -> list[T]:
    """The entries of the comma list ``text`` (each stripped, then converted by ``kind``), in order.

    ``what`` names an entry for the error of one that ``kind`` refuses (e.g. ``"a number"``);
    ``example`` is a good value of ``flag`` for the error of a list that names nothing. ``rng``: the
    entries' ``contract.fields.Range``; an entry outside it, or no number of its kind, gets the words of
    the flag that takes one value, naming the entry as typed: ``--taus nan must be a finite number ≥ 0
    (an entropy in nats; e.g. 0.5)``, ``--recent-k 1.5 must be a whole number ≥ 0 (e.g. 64)``.
    Raises UsageError (exit 2), one line naming ``flag``, ``text`` and the fix, when the list names
    nothing (``''``, ``,``), has an empty entry (``16,,32``, ``arith,``), an entry ``kind`` refuses
    (``4,x``), or a value given twice (``0.1,0.1``; values compare after ``kind``, so ``0,00`` too).
    """
    shown = shlex.quote(text)  # as typed in a shell: quoted only when it must be
    items = [t.strip() for t in text.split(",")]
    if not any(items):
        raise UsageError(f"{flag} {shown} names nothing; give a comma list, e.g. {flag} {example or 'a,b'}")
    given = [t for t in items if t]
    if rng is not None:
        _check_ranges(given, flag, rng)
    values: list[T] = []
    for item in given:
        try:
            values.append(kind(item))
        except ValueError:
            raise UsageError(f"{flag} {shown}: {item!r} is not {what or 'a valid entry'}; "
                             f"e.g. {flag} {example or 'a,b'}") from None
    once = [i for i, v in enumerate(values) if v not in values[:i]]  # each value's first entry
    fix = f"{flag} {shlex.quote(','.join(given[i] for i in once))}"
    if len(given) < len(items):
        raise UsageError(f"{flag} {shown} has an empty entry; remove the extra comma: {fix}")
    if len(once) < len(values):
        first = next(i for i, v in enumerate(values) if v in values[:i])
        v = values[first]
        n = sum(1 for u in values if u == v)
        times = "twice" if n == 2 else f"{n} times"
        raise UsageError(f"{flag} {shown} lists {given[values.index(v)]} {times}; give each value once: {fix}")
    return values


def _check_ranges(given: list[str], flag: str, rng) -> None:
    """UsageError naming every entry outside ``rng`` (or no number of its kind), those with the same reason
    together: ``--taus abc and nan: each must be a finite number ≥ 0 (…)``; one entry alone is worded as the flag that
    takes one value words it (``--tau -1 must be …``)."""
    reasons: dict[str, list[str]] = {}
    for item in given:
        try:
            rng.check_given(item)
        except ValueError as e:
            reasons.setdefault(str(e), []).append(item)
    if reasons:
        raise UsageError("; ".join(f"{flag} {items[0]} {reason}" if len(items) == 1 else
                                   f"{flag} {and_list(items)}: each {reason}" for reason, items in reasons.items()))


def and_list(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``: the entries an error names together."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
