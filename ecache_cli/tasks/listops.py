"""``list``: sequence manipulation on short lists of one-digit integers, for the embedded tiny model.

Prompt ``<Op>: 9 3 7 1`` (e.g. ``Sort: 9 3 7 1``), answer the resulting list space-separated
(``1 3 7 9``). Operations: sort, sort descending, reverse, unique (keep first occurrences), even, odd,
greater than k, less than k, first n, last n. Every answer is non-empty. The partition key is the
operation, its argument and the list.
"""

from __future__ import annotations

import random

from ecache_cli.tasks.base import Example, SyntheticTask, first_block, normalize_ws


def _unique(xs: list[int]) -> list[int]:
    return list(dict.fromkeys(xs))


# name -> (needs an argument, function(xs, k) -> result)
OPS = {
    "Sort": (False, lambda xs, k: sorted(xs)),
    "Sort descending": (False, lambda xs, k: sorted(xs, reverse=True)),
    "Reverse": (False, lambda xs, k: xs[::-1]),
    "Unique": (False, lambda xs, k: _unique(xs)),
    "Even": (False, lambda xs, k: [x for x in xs if x % 2 == 0]),
    "Odd": (False, lambda xs, k: [x for x in xs if x % 2 == 1]),
    "Greater than": (True, lambda xs, k: [x for x in xs if x > k]),
    "Less than": (True, lambda xs, k: [x for x in xs if x < k]),
    "First": (True, lambda xs, k: xs[:k]),
    "Last": (True, lambda xs, k: xs[-k:]),
}


class ListTask(SyntheticTask):
    """List manipulation; score: exact match of the answer after whitespace normalisation."""

    name = "list"
    kind = "list"

    def make(self, rng: random.Random) -> Example:
        """Draw one operation and a list of 3-8 one-digit integers with a non-empty result."""
        while True:
            op = rng.choice(sorted(OPS))
            has_arg, fn = OPS[op]
            xs = [rng.randint(0, 9) for _ in range(rng.randint(3, 8))]
            if op == "Unique" and len(set(xs)) == len(xs):  # make sure there is something to remove
                xs[rng.randrange(1, len(xs))] = xs[0]
            k = rng.randint(1, len(xs) - 1) if op in ("First", "Last") else rng.randint(1, 8)
            result = fn(xs, k)
            if result:
                break
        head = f"{op} {k}" if has_arg else op
        question = f"{head}: {' '.join(map(str, xs))}"
        answer = " ".join(map(str, result))
        meta = {"key": f"list:{head}:{','.join(map(str, xs))}", "op": op}
        return Example("", question, answer, meta)

    def score(self, ex: Example, completion: str) -> float:
        """Return 1.0 if the first block of ``completion`` equals the answer up to whitespace."""
        return float(normalize_ws(first_block(completion)) == normalize_ws(ex.answer))
