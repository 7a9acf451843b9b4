"""``code``: MBPP-shaped function-writing problems for the embedded tiny model.

A question is one sentence (``Write a function add_3(xs) that adds 3 to every element of the list.``)
followed by three ``assert`` tests, as in MBPP; the answer is a short function (no blank lines). There
are 22 function families; each problem varies the function name, the argument name and the family's
constants, and the tests' inputs. The partition key is (family, function name, argument, constants): a
function that is in the test split is never in the train split, whatever its test inputs; the hash
partition is stratified per family so every family has test functions.
Scoring runs the completion against the tests in ``tasks/sandbox.py`` (needs ``allow_code_execution``).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Callable

from ecache_cli.tasks.base import (
    TEST_FRACTION_PER_MILLE,
    Example,
    SyntheticTask,
    first_block,
    stable_hash,
    strip_code_fences,
)
from ecache_cli.tasks.sandbox import run_program

ARG_NAMES = {"list": ("xs", "nums", "items", "values"), "str": ("s", "text", "word"),
             "int": ("n", "x", "num")}
WORDS = ("apple", "level", "banana", "noon", "hello", "racecar", "tree", "data", "radar", "code", "moon",
         "kayak", "sky", "test", "idea", "stats", "tot", "sees", "refer", "python", "river", "civic",
         "stone", "madam", "table", "rotor", "paper", "deed", "orange", "east")


@dataclass(frozen=True)
class Family:
    """One function family: names and ``doc``/``body`` templates filled with ``{a}`` (argument) and the
    constants ``{k}``/``{lo}``/``{hi}``/``{c}``; ``ref(x, **consts)`` computes test outputs."""

    names: tuple[str, ...]
    arg: str  # "list" | "str" | "int"
    doc: str
    body: str
    ref: Callable
    consts: tuple[dict, ...] = ({},)  # the family's whole constant space
    inputs: Callable[[random.Random], object] | None = None


def _k(lo: int, hi: int) -> tuple[dict, ...]:
    return tuple({"k": k} for k in range(lo, hi + 1))


def _ints(lo: int, hi: int) -> Callable[[random.Random], int]:
    return lambda rng: rng.randint(lo, hi)


RANGES = tuple({"lo": lo, "hi": lo + width} for lo in range(6) for width in range(3, 10))


def _fact(n: int) -> int:
    out = 1
    for i in range(2, n + 1):
        out *= i
    return out


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


FAMILIES = {
    "add_k": Family(("add_{k}", "plus_{k}", "shift_by_{k}"), "list",
                    "adds {k} to every element of the list", "return [x + {k} for x in {a}]",
                    lambda xs, k: [x + k for x in xs], _k(1, 9)),
    "mul_k": Family(("times_{k}", "scale_by_{k}", "multiply_by_{k}"), "list",
                    "multiplies every element of the list by {k}", "return [x * {k} for x in {a}]",
                    lambda xs, k: [x * k for x in xs], _k(2, 9)),
    "greater_k": Family(("greater_than_{k}", "above_{k}", "filter_gt_{k}"), "list",
                        "returns the elements of the list that are greater than {k}",
                        "return [x for x in {a} if x > {k}]", lambda xs, k: [x for x in xs if x > k],
                        _k(1, 7)),
    "evens": Family(("evens", "get_even", "keep_even"), "list", "returns the even elements of the list",
                    "return [x for x in {a} if x % 2 == 0]", lambda xs: [x for x in xs if x % 2 == 0]),
    "count_gt": Family(("count_above_{k}", "num_greater_{k}", "count_gt_{k}"), "list",
                       "returns how many elements of the list are greater than {k}",
                       "return sum(1 for x in {a} if x > {k})", lambda xs, k: sum(1 for x in xs if x > k),
                       _k(1, 7)),
    "total": Family(("total", "list_sum", "sum_all"), "list", "returns the sum of the list",
                    "result = 0\nfor x in {a}:\n    result += x\nreturn result", sum),
    "largest": Family(("largest", "max_value", "biggest"), "list", "returns the largest element of the list",
                      "best = {a}[0]\nfor x in {a}[1:]:\n    if x > best:\n        best = x\nreturn best", max),
    "squares": Family(("squares", "square_all", "squared"), "list",
                      "returns the squares of the elements of the list", "return [x * x for x in {a}]",
                      lambda xs: [x * x for x in xs]),
    "first_k": Family(("first_{k}", "head_{k}", "take_{k}"), "list",
                      "returns the first {k} elements of the list", "return {a}[:{k}]",
                      lambda xs, k: xs[:k], _k(2, 3)),
    "last_k": Family(("last_{k}", "tail_{k}", "end_{k}"), "list", "returns the last {k} elements of the list",
                     "return {a}[-{k}:]", lambda xs, k: xs[-k:], _k(2, 3)),
    "reverse": Family(("reverse_string", "backwards", "flip_text"), "str", "returns the string reversed",
                      "return {a}[::-1]", lambda s: s[::-1]),
    "palindrome": Family(("is_palindrome", "reads_same", "check_palindrome"), "str",
                         "checks whether the string reads the same backwards", "return {a} == {a}[::-1]",
                         lambda s: s == s[::-1]),
    "count_char": Family(("count_{c}", "num_{c}", "how_many_{c}"), "str",
                         "counts how many times the letter '{c}' appears in the string",
                         "return {a}.count('{c}')", lambda s, c: s.count(c),
                         tuple({"c": c} for c in "aeost")),
    "repeat": Family(("repeat_{k}", "copy_{k}", "echo_{k}"), "str", "returns the string repeated {k} times",
                     "return {a} * {k}", lambda s, k: s * k, _k(2, 3)),
    "upper": Family(("shout", "to_upper", "make_upper"), "str", "returns the string in upper case",
                    "return {a}.upper()", str.upper),
    "vowels": Family(("count_vowels", "vowel_count", "num_vowels"), "str", "counts the vowels in the string",
                     "count = 0\nfor c in {a}:\n    if c in 'aeiou':\n        count += 1\nreturn count",
                     lambda s: sum(c in "aeiou" for c in s)),
    "divisible": Family(("divisible_by_{k}", "is_multiple_of_{k}", "check_div_{k}"), "int",
                        "checks whether the number is divisible by {k}", "return {a} % {k} == 0",
                        lambda n, k: n % k == 0, _k(2, 9), _ints(1, 60)),
    "clamp": Family(("clamp_{lo}_{hi}", "limit_{lo}_{hi}", "bound_{lo}_{hi}"), "int",
                    "returns the number limited to the range from {lo} to {hi}",
                    "return min(max({a}, {lo}), {hi})", lambda n, lo, hi: min(max(n, lo), hi),
                    RANGES, _ints(0, 20)),
    "power": Family(("power_{k}", "pow_{k}", "raise_to_{k}"), "int", "returns the number raised to the power {k}",
                    "return {a} ** {k}", lambda n, k: n**k, _k(2, 4), _ints(0, 6)),
    "factorial": Family(("factorial", "fact", "product_up_to"), "int", "returns the factorial of the number",
                        "result = 1\nfor i in range(2, {a} + 1):\n    result *= i\nreturn result", _fact,
                        inputs=_ints(0, 7)),
    "fib": Family(("fib", "fibonacci", "nth_fib"), "int",
                  "returns the Fibonacci number at that index, starting from 0 and 1",
                  "a, b = 0, 1\nfor _ in range({a}):\n    a, b = b, a + b\nreturn a", _fib, inputs=_ints(0, 12)),
    "digit_sum": Family(("digit_sum", "sum_digits", "add_digits"), "int",
                        "returns the sum of the digits of the number",
                        "total = 0\nwhile {a} > 0:\n    total += {a} % 10\n    {a} //= 10\nreturn total",
                        lambda n: sum(map(int, str(n))), inputs=_ints(0, 999)),
}


def _input(fam: Family, rng: random.Random):
    if fam.inputs is not None:
        return fam.inputs(rng)
    if fam.arg == "list":
        return [rng.randint(0, 9) for _ in range(rng.randint(2, 4))]
    return rng.choice(WORDS)


def _key(fid: str, fname: str, arg: str, consts: dict) -> str:
    return f"code:{fid}:{fname}:{arg}:{sorted(consts.items())}"


@functools.cache
def _test_keys() -> frozenset[str]:
    # Per family, the variants (name x argument x constants) ordered by hash; the first 20% (at least
    # one) form the test split. A hash partition like split_of(), stratified because the families
    # without constants have only ~10 variants and could otherwise miss a split entirely.
    keys = set()
    for fid, fam in FAMILIES.items():
        variants = sorted({_key(fid, n.format(**c), a, c) for n in fam.names for a in ARG_NAMES[fam.arg]
                           for c in fam.consts}, key=stable_hash)
        keys.update(variants[: max(1, round(len(variants) * TEST_FRACTION_PER_MILLE / 1000))])
    return frozenset(keys)


class CodeTask(SyntheticTask):
    """MBPP-shaped function problems; score: the completion passes the shown tests in the sandbox."""

    name = "code"
    kind = "code"
    needs_code_execution = True

    def make(self, rng: random.Random) -> Example:
        """Draw a family, its name/argument/constants, and three distinct test inputs (outputs not all equal)."""
        fid = rng.choice(sorted(FAMILIES))
        fam = FAMILIES[fid]
        consts = rng.choice(fam.consts)
        fname = rng.choice(fam.names).format(**consts)
        arg = rng.choice(ARG_NAMES[fam.arg])
        inputs: list = []
        for _ in range(100):  # three distinct inputs whose outputs are not all the same
            inputs = []
            while len(inputs) < 3:
                x = _input(fam, rng)
                if x not in inputs:
                    inputs.append(x)
            if len({repr(fam.ref(x, **consts)) for x in inputs}) > 1:
                break
        tests = [f"assert {fname}({x!r}) == {fam.ref(x, **consts)!r}" for x in inputs]
        doc = fam.doc.format(a=arg, **consts)
        question = "\n".join([f"Write a function {fname}({arg}) that {doc}."] + tests)
        body = fam.body.format(a=arg, **consts).replace("\n", "\n    ")
        answer = f"def {fname}({arg}):\n    {body}"
        key = _key(fid, fname, arg, consts)
        return Example("", question, answer, {"key": key, "family": fid, "entry_point": fname,
                                              "tests": tests})

    def split_for(self, key: str) -> str:
        """Return the split of a function: stratified per family so that every family is in both splits."""
        return "test" if key in _test_keys() else "train"

    def program(self, ex: Example, completion: str) -> str:
        """Return the program that scoring runs: the extracted function, then the example's tests."""
        code = first_block(strip_code_fences(completion))
        return code + "\n\n" + "\n".join(ex.meta["tests"]) + "\n"

    def score(self, ex: Example, completion: str, timeout_s: float = 5.0) -> float:
        """Return 1.0 if all tests pass in the sandbox. Raises ``UsageError`` without code-execution consent."""
        self.require_consent()
        return float(run_program(self.program(ex, completion), timeout_s=timeout_s).passed)
