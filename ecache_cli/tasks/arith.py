"""``arith``: GSM8K-shaped multi-step word problems for the embedded tiny model.

Nine templates of 2-3 steps with small integers (+, -, *, exact /), names and objects varied. Answers are
worked solutions in GSM8K style, one step per line ("... so he has 3 * 12 = 36 pens."), ending in
``#### <number>`` (openai/grade-school-math format, without the ``<<...>>`` calculator annotations).
The partition key is (template, numbers): the same arithmetic never appears in both splits, whatever the
names and objects.
"""

from __future__ import annotations

import random

from ecache_cli.tasks.answers import extract_final_number, numbers_equal
from ecache_cli.tasks.base import Example, SyntheticTask, first_block

NAMES = {"Tom": "he", "Anna": "she", "Ben": "he", "Maya": "she", "Leo": "he", "Sara": "she",
         "Sam": "he", "Lily": "she", "Max": "he", "Emma": "she", "Jack": "he", "Nina": "she",
         "Omar": "he", "Zoe": "she", "Ravi": "he", "Mia": "she", "Carlos": "he", "Hana": "she",
         "Felix": "he", "Grace": "she"}
OBJECTS = ["pens", "apples", "stickers", "marbles", "books", "cards", "shells", "coins", "pencils",
           "candies", "stamps", "buttons"]
FRUITS = ["apples", "oranges", "pears", "plums", "lemons", "peaches", "cherries", "mangoes"]
ITEMS = [("notebook", "notebooks"), ("toy car", "toy cars"), ("ticket", "tickets"),
         ("sandwich", "sandwiches"), ("book", "books"), ("cup of tea", "cups of tea"),
         ("puzzle", "puzzles"), ("pair of socks", "pairs of socks")]
THINGS = ["game", "book", "ball", "kite", "lamp", "watch", "bike bell", "backpack"]


def _people(rng: random.Random) -> tuple[str, str, str]:
    name, friend = rng.sample(sorted(NAMES), 2)
    return name, NAMES[name], friend


def _boxes(rng: random.Random):
    a, b, c = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 20)
    d = rng.randint(1, a * b + c - 1)
    s, r = a * b + c, a * b + c - d
    n, p, f = _people(rng)
    o = rng.choice(OBJECTS)
    q = (f"{n} has {a} boxes of {b} {o}. {p.capitalize()} buys {c} more {o} and gives {d} {o} to {f}. "
         f"How many {o} does {n} have now?")
    steps = [f"{n} has {a} boxes of {b} {o}, so {p} has {a} * {b} = {a * b} {o}.",
             f"After buying {c} more, {p} has {a * b} + {c} = {s} {o}.",
             f"After giving {d} to {f}, {p} has {s} - {d} = {r} {o}."]
    return (a, b, c, d), q, steps, r


def _share(rng: random.Random):
    k, r = rng.randint(2, 6), rng.randint(2, 10)
    s = k * r
    a = rng.randint(1, s - 1)
    b = s - a
    n, p, _ = _people(rng)
    o = rng.choice(FRUITS)
    q = (f"{n} picks {a} {o} in the morning and {b} {o} in the afternoon. {p.capitalize()} shares them "
         f"equally among {k} friends. How many {o} does each friend get?")
    steps = [f"{n} picks {a} + {b} = {s} {o} in total.", f"Each friend gets {s} / {k} = {r} {o}."]
    return (a, b, k), q, steps, r


def _change(rng: random.Random):
    price, count = rng.randint(2, 15), rng.randint(2, 6)
    total = price * count
    bill = rng.choice([b for b in (20, 50, 100) if b > total])
    n, _, _ = _people(rng)
    one, many = rng.choice(ITEMS)
    q = (f"A {one} costs ${price}. {n} buys {count} {many} and pays with a ${bill} bill. "
         f"How much change does {n} get?")
    steps = [f"{count} {many} cost {count} * {price} = ${total}.",
             f"The change is {bill} - {total} = ${bill - total}."]
    return (price, count, bill), q, steps, bill - total


def _reading(rng: random.Random):
    a, d, b = rng.randint(5, 30), rng.randint(2, 7), rng.randint(1, 40)
    n, p, _ = _people(rng)
    q = (f"{n} reads {a} pages every day for {d} days. Then {p} reads {b} more pages on the weekend. "
         f"How many pages does {n} read in total?")
    steps = [f"In {d} days {n} reads {a} * {d} = {a * d} pages.",
             f"With the weekend, {p} reads {a * d} + {b} = {a * d + b} pages."]
    return (a, d, b), q, steps, a * d + b


def _teams(rng: random.Random):
    a, b, g = rng.randint(2, 6), rng.randint(10, 30), rng.randint(2, 6)
    c = rng.choice([c for c in range(1, 13) if (a * b - c) % g == 0])
    s = a * b - c
    q = (f"A school has {a} classes with {b} students each. {c} students are absent today. "
         f"The rest are split into {g} equal teams. How many students are on each team?")
    steps = [f"There are {a} * {b} = {a * b} students.",
             f"Without the absent ones there are {a * b} - {c} = {s} students.",
             f"Each team has {s} / {g} = {s // g} students."]
    return (a, b, c, g), q, steps, s // g


def _times(rng: random.Random):
    a, k = rng.randint(2, 20), rng.randint(2, 6)
    n, _, f = _people(rng)
    o = rng.choice(OBJECTS)
    q = (f"{n} has {a} {o}. {f} has {k} times as many {o} as {n}. "
         f"How many {o} do they have together?")
    steps = [f"{f} has {k} * {a} = {k * a} {o}.", f"Together they have {a} + {k * a} = {a + k * a} {o}."]
    return (a, k), q, steps, a + k * a


def _savings(rng: random.Random):
    a, w = rng.randint(2, 20), rng.randint(2, 10)
    b = rng.randint(1, a * w - 1)
    n, p, _ = _people(rng)
    t = rng.choice(THINGS)
    q = (f"{n} saves ${a} every week for {w} weeks. Then {p} spends ${b} on a {t}. "
         f"How much money does {n} have left?")
    steps = [f"{n} saves {a} * {w} = ${a * w}.",
             f"After buying the {t}, {p} has {a * w} - {b} = ${a * w - b} left."]
    return (a, w, b), q, steps, a * w - b


def _bakery(rng: random.Random):
    a, b, d = rng.randint(2, 6), rng.randint(6, 12), rng.randint(2, 6)
    c = rng.choice([c for c in range(1, a * b - d + 1) if (a * b - c) % d == 0])
    s = a * b - c
    n, p, _ = _people(rng)
    q = (f"{n} bakes {a} trays of {b} cookies. {p.capitalize()} sells {c} cookies and packs the rest "
         f"into bags of {d}. How many bags does {p} fill?")
    steps = [f"{n} bakes {a} * {b} = {a * b} cookies.",
             f"After selling {c}, {a * b} - {c} = {s} cookies are left.",
             f"{p.capitalize()} fills {s} / {d} = {s // d} bags."]
    return (a, b, c, d), q, steps, s // d


def _orchard(rng: random.Random):
    a, b, k = rng.randint(2, 6), rng.randint(3, 12), rng.randint(2, 5)
    c = rng.randint(1, a * b - 1)
    s = a * b - c
    q = (f"A farm has {a} rows of {b} apple trees. {c} trees get sick, and each healthy tree gives "
         f"{k} baskets of apples. How many baskets does the farm get?")
    steps = [f"The farm has {a} * {b} = {a * b} trees.", f"{a * b} - {c} = {s} trees are healthy.",
             f"They give {s} * {k} = {s * k} baskets."]
    return (a, b, c, k), q, steps, s * k


TEMPLATES = {"boxes": _boxes, "share": _share, "change": _change, "reading": _reading, "teams": _teams,
             "times": _times, "savings": _savings, "bakery": _bakery, "orchard": _orchard}


class ArithTask(SyntheticTask):
    """GSM8K-shaped word problems; score: the number after the first ``####`` (else the last number)."""

    name = "arith"
    kind = "math"

    def make(self, rng: random.Random) -> Example:
        """Draw one problem from a random template (see ``TEMPLATES``)."""
        tid = rng.choice(sorted(TEMPLATES))
        nums, question, steps, result = TEMPLATES[tid](rng)
        answer = "\n".join(steps + [f"#### {result}"])
        meta = {"key": f"arith:{tid}:{','.join(map(str, nums))}", "template": tid, "result": str(result)}
        return Example("", question, answer, meta)

    def score(self, ex: Example, completion: str) -> float:
        """Return 1.0 if the completion's final number equals the reference (GSM8K rule, answers.py)."""
        got = extract_final_number(first_block(completion))
        return float(numbers_equal(got, ex.meta["result"]))
