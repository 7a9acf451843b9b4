"""Typed, range-checked settings: what a dataclass field of a policy or of the decoding settings takes.

A class declares the range of each numeric field in a ``ranges`` class attribute (name → :class:`Range`),
beside the field itself; :func:`field_types` attaches it and :func:`check_value` enforces type and range,
so a flag, a profile value, a ``--policies name:key=value`` variant and an lm-eval model_arg are checked
alike. This module imports nothing of ecache.
"""

from __future__ import annotations

import dataclasses

#: The largest count or length any setting takes (tokens, steps, positions, threads): 2**31 − 1, what a
#: 32-bit index holds; far above any canvas a model takes, and a 64-bit overflow never reaches torch.
INT_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric setting takes: ``lo``/``hi`` bounds (None = unbounded), each inclusive
    unless ``lo_open``/``hi_open``; never NaN, never ±inf. ``example``: a good value, for the message."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    example: str = ""
    why: str = ""
    integer: bool = False

    def describe(self) -> str:
        """The range in words: ``in [0, 1]``, ``≥ 1``, ``> 0``, ``in 1..2147483647`` (whole numbers)."""
        if self.lo is not None and self.hi is not None:
            if self.integer:
                return f"in {self.lo}..{self.hi}"
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '≥'} {self.lo:g}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '≤'} {self.hi:g}"
        return "a finite number"

    def hint(self) -> str:
        """`` (an entropy in nats; e.g. 0.5)``: what the value means and a good one, or ""."""
        hint = "; ".join(x for x in (self.why, f"e.g. {self.example}" if self.example else "") if x)
        return f" ({hint})" if hint else ""

    def not_finite(self) -> str:
        """The one message of a value that is no finite number (NaN, ±inf, a text that is no number) for
        every setting of this range, whoever passed it (a flag, a chat command, a request field, a
        Python argument, a profile key): ``must be a finite number ≥ 0 (an entropy in nats; e.g. 0.5)``;
        a whole-number range's (a text, a float, a string from Python) ``must be a whole number ≥ 1 (e.g. 256)``."""
        if self.integer:  # a count: a whole number, from its lower bound (the upper one is the index limit)
            what = f"≥ {self.lo}" if self.hi is None or self.hi >= INT_MAX else self.describe()
            return f"must be a whole number {what}{self.hint()}"
        what = self.describe()
        return f"must be {what if what == 'a finite number' else 'a finite number ' + what}{self.hint()}"

    def check_given(self, value) -> None:
        """:meth:`check` of a value as a user typed or sent it: a text is read as the number it writes
        (``"0.5"``; ``"nan"``, ``"abc"``: :meth:`not_finite`), for a flag, a chat command or a request
        field; a whole-number range's text is read as a whole number (``"8"``; ``"abc"``, ``"0.5"``:
        :meth:`not_finite`)."""
        if isinstance(value, str):
            try:
                value = int(value.strip()) if self.integer else float(value)
            except ValueError:
                raise ValueError(self.not_finite()) from None
        self.check(value)

    def check(self, value) -> None:
        """Raise ValueError (``must be in [0, 1] (e.g. 0.9)``) for a value outside the range, NaN or ±inf."""
        import math

        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        finite = not isinstance(value, float) or math.isfinite(value)
        bad = not finite
        if not bad and self.lo is not None:
            bad = value <= self.lo if self.lo_open else value < self.lo
        if not bad and self.hi is not None:
            bad = value >= self.hi if self.hi_open else value > self.hi
        if bad and not finite:
            raise ValueError(self.not_finite())
        if bad:
            what = self.describe()
            if self.integer:  # a count: name the side it fell off
                what = f"≥ {self.lo}" if self.lo is not None and value < self.lo else f"≤ {self.hi}"
            raise ValueError(f"must be {what}{self.hint()}")


#: A run's seed (``--seed``, a request's ``seed``, ``Engine.start(seed=)``): the random streams' 64-bit seed.
SEED = Range(0, 2**64 - 1, integer=True, example="0", why="a 64-bit seed")


class GivenFloat(float):
    """A float that remembers the text it was read from (``1e400`` read as inf), so that the range
    message of a value that is no finite number names it as the user typed it: ``--tau 1e400 must be a
    finite number ≥ 0 …``, not ``--tau inf``. ``str`` and ``repr`` give that text (quoted when it has
    surrounding spaces, as the message of a text that is no number shows it); it is a float otherwise."""

    text: str

    def __new__(cls, text: str):
        self = super().__new__(cls, text)
        self.text = text
        return self

    def __str__(self) -> str:
        return self.text if self.text.strip() == self.text else repr(self.text)

    __repr__ = __str__


def given_float(text: str) -> float:
    """``float(text)``, as a :class:`GivenFloat` when the text reads as no finite number (``1e400``, ``-1e999``)
    or is written otherwise than the float's own shortest form (``1e3``, ``0.50``: 1000.0 and 0.5), so that a
    message names the number as it was sent (``seed 1e3 must be a whole number …``); a plain float otherwise
    (what a request's numbers almost always are). ValueError as ``float`` for a text that is no number."""
    import math

    value = float(text)
    return value if math.isfinite(value) and repr(value) == text else GivenFloat(text)


def count(lo: int = 0, example: str = "", why: str = "") -> Range:
    """A whole-number count from ``lo`` up to :data:`INT_MAX`."""
    return Range(lo, INT_MAX, example=example, why=why, integer=True)


def dataclass_defaults(cls) -> dict:
    """Field defaults of a dataclass as a dict."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def field_types(cls) -> dict:
    """``{field name: type}`` of a dataclass (annotations resolved, e.g. ``int | None``); a field with a
    declared :class:`Range` (the class's ``ranges`` mapping) comes as ``Annotated[type, Range]``, which
    :func:`check_value` enforces."""
    import typing

    hints = typing.get_type_hints(cls)
    ranges = getattr(cls, "ranges", {})
    out = {}
    for f in dataclasses.fields(cls):
        kind, rng = hints.get(f.name), ranges.get(f.name)
        out[f.name] = typing.Annotated[kind, rng] if rng is not None and kind is not None else kind
    return out


def text_number(value) -> int | float | None:
    """The finite number a text writes (``'5'`` → 5, ``' 0.5'`` → 0.5), else None (not a text, or no finite
    number): a number passed as a string, which the Python API refuses as the server does (``top_k '5' must
    be a number, not a string (e.g. 5)``) once the number itself is checked."""
    import math

    if not isinstance(value, str):
        return None
    try:
        return int(value.strip())
    except ValueError:
        pass
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def takes_text(kind) -> bool:
    """Whether a field of type ``kind`` (``field_types``: maybe ``Annotated``) keeps a string as it is: ``str``,
    ``str | float`` (es-dllm's ``proportions``, a comma list or one number), ``str | None``. A number written
    in such a field's text is its text, not a number given as a string (:func:`text_number`)."""
    import typing

    if typing.get_origin(kind) is typing.Annotated:
        kind = typing.get_args(kind)[0]
    return kind is str or str in typing.get_args(kind)


def check_value(kind, value):
    """``value`` as a field of type ``kind`` wants it (an int is a valid float), or ValueError saying
    what it must be. Booleans are not numbers here, and NaN is no number: both would be silently
    meaningless as a threshold or a count. Types other than bool/int/float/str pass unchecked.
    ``Annotated[type, Range]`` (:func:`field_types`) also checks the value's range."""
    import typing

    rng = None
    if typing.get_origin(kind) is typing.Annotated:  # field_types' declared range
        kind, *meta = typing.get_args(kind)
        rng = next((m for m in meta if isinstance(m, Range)), None)
    try:
        value = _check_type(kind, value)
    except ValueError:
        if rng is not None and (rng.integer or (float in (kind, *typing.get_args(kind))
                                                 and isinstance(value, (str, float, bool)))):
            raise ValueError(rng.not_finite()) from None  # NaN, a text or a bool: the range's words, as the server's
        raise
    if rng is not None and value is not None:
        rng.check(value)
    return value


def _check_type(kind, value):
    """:func:`check_value` without the range: the type alone."""
    import math
    import types
    import typing

    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args:
        if value is None:
            return None
        rest = [a for a in args if a is not type(None)]
        kind = rest[0] if len(rest) == 1 else None
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError("must be true or false")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("must be a whole number (e.g. 8)")
    elif kind is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("must be a number (e.g. 0.5)")
        if math.isnan(value):
            raise ValueError("must be a number, not NaN (e.g. 0.5)")
        return float(value)
    elif kind is str and not isinstance(value, str):
        raise ValueError("must be a string")
    return value


def fitting_example(name: str, values: dict, example: str) -> str:
    """A range's example value that also fits the other options given (``values``): a block length that
    divides the given ``--gen-length``, a gen-length that the given ``--block-length`` divides, the given
    gen-length's steps (one token a step), so that a suggested value is one the same command accepts."""
    gen, block = values.get("gen_length"), values.get("block_length")
    if name == "block_length" and isinstance(gen, int) and gen >= 1:
        return str(next(b for b in (32, 16, 8, 4, 2, 1) if gen % b == 0)) if gen > 32 else str(gen)
    if name == "steps" and isinstance(gen, int) and gen >= 1:  # one token a step: a multiple of the blocks
        return str(gen)
    if name == "gen_length" and isinstance(block, int) and block >= 1:
        steps = values.get("steps")  # each block needs a whole number of the steps
        return str(block * steps if isinstance(steps, int) and steps >= 1 else -(-256 // block) * block)
    return example


def fitted_kind(name: str, kind, values: dict):
    """``kind`` (a setting's type, ``Annotated`` with its :class:`Range`, as :func:`field_types` gives it)
    with the range's example fitted to the other settings ``values`` (:func:`fitting_example`; only their
    whole numbers count), for :func:`check_value`; any other ``kind`` as it is."""
    import typing

    args = typing.get_args(kind) if typing.get_origin(kind) is typing.Annotated else ()
    rng = next((a for a in args[1:] if isinstance(a, Range)), None)
    if rng is None:
        return kind
    whole = {k: v for k, v in values.items() if type(v) is int}
    return typing.Annotated[args[0], dataclasses.replace(rng, example=fitting_example(name, whole, rng.example))]
