"""Task base: what a task is (examples, prompt, target, score) and the helpers the tasks share.

A task turns examples into plain-text prompts and scores completions; it knows nothing about tokens or
models. Two families live under ``tasks/``:

- synthetic domains (``arith``, ``code``, ``list``) that generate unlimited examples from a seed, with a
  hash partition of the problem space so the same problem can never be in both the train and test split;
- real benchmarks (``gsm8k``, ``math500``, ``humaneval``, ``mbpp``) read from local JSONL files.

Scoring model-written code runs it (in ``tasks/sandbox.py``), which needs the user's explicit consent:
tasks with ``needs_code_execution`` refuse to score unless built with ``allow_code_execution=True``.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field

from ecache_cli.errors import UsageError

SPLITS = ("train", "test")
TEST_FRACTION_PER_MILLE = 200  # 20% of the synthetic problem space is held out for the test split
CONSENT_MESSAGE = (
    "running model-written code needs --allow-code-execution (scoring {name} executes the completion "
    "in the sandbox: kernel isolation where the machine has it, see --sandbox)"
)


@dataclass(frozen=True)
class Example:
    """One problem: ``question`` is what the model sees, ``answer`` the reference solution text.

    ``meta`` carries what the scorer needs (e.g. the tests of a code problem, the partition key of a
    synthetic problem); it is excluded from hashing so examples stay usable in sets and dict keys.
    ``source``: where a file-backed example was read (``FILE:LINE``, ``stdin:LINE``), so an error about its
    text can name the line; empty for generated examples. It takes no part in equality.
    """

    id: str
    question: str
    answer: str
    meta: dict = field(default_factory=dict, hash=False)
    source: str = field(default="", compare=False)

    def named(self) -> str:
        """How an error names the example: its ``source`` line, else ``example <id>``."""
        return self.source or f"example {self.id}"


class Task:
    """Base class of every task (the contract in docs/ARCHITECTURE.md, "Task API").

    Subclasses set ``name`` and ``kind`` and implement ``examples`` and ``score``; ``prompt`` and
    ``target`` have defaults suited to the synthetic domains. ``default_shots`` is the number of solved
    examples the CLI should use when the user does not choose.
    """

    name: str = ""
    kind: str = ""  # "math" | "code" | "list"
    default_shots: int = 0
    needs_code_execution: bool = False
    synthetic: bool = False

    def __init__(self, data: str | None = None, allow_code_execution: bool = False) -> None:
        if self.synthetic and data is not None:
            raise UsageError(f"task {self.name!r} is synthetic and takes no --data (got {data!r}); drop --data")
        self.data = data
        self.allow_code_execution = allow_code_execution

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """Return ``n`` examples of ``split`` ("train" | "test"), deterministic for a given ``seed``."""
        raise NotImplementedError

    def prompt(self, ex: Example, shots: int = 0, seed: int = 0) -> str:
        """Return the plain-text prompt: ``shots`` solved train examples (chosen from ``seed``), then ``ex``.

        Default format (synthetic domains): each shot is ``question\\nanswer``, shots and the final
        question are separated by one blank line; with ``shots=0`` the prompt is just the question.
        """
        demos = self.shot_examples(ex, shots, seed)
        return join_shots([(d.question, d.answer) for d in demos], ex.question)

    def shot_examples(self, ex: Example, shots: int, seed: int) -> list[Example]:
        """Return the ``shots`` solved examples placed before ``ex`` (never ``ex`` itself)."""
        if shots < 0:
            raise UsageError(f"shots must be >= 0, got {shots}")
        return []

    def prompt_examples(self, ex: Example, shots: int, seed: int) -> list[Example]:
        """The examples whose text :meth:`prompt` puts in ``ex``'s prompt: its shots, then ``ex``."""
        return [*self.shot_examples(ex, shots, seed), ex]

    def target(self, ex: Example) -> str:
        """Return the answer text to train on (the reference solution)."""
        return ex.answer

    def score(self, ex: Example, completion: str) -> float:
        """Return 1.0 if ``completion`` solves ``ex``, else 0.0."""
        raise NotImplementedError

    @property
    def can_score(self) -> bool:
        """Whether :meth:`score` may run: always, unless the task runs model-written code and was built
        without ``allow_code_execution=True``."""
        return not self.needs_code_execution or self.allow_code_execution

    def require_consent(self) -> None:
        """Raise ``UsageError`` unless this task was built with ``allow_code_execution=True``."""
        if not self.allow_code_execution:
            raise UsageError(CONSENT_MESSAGE.format(name=self.name))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, data={self.data!r})"


# --- synthetic domains ------------------------------------------------------------------------------


def stable_hash(text: str) -> int:
    """Return a 64-bit hash of ``text`` that is the same on every run and platform (blake2b)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def split_of(key: str) -> str:
    """Return the split ("train" | "test") that owns the problem identified by ``key``.

    The partition is a hash of the problem key, so membership does not depend on the seed or on the
    order of generation: the same problem always lands in the same split.
    """
    return "test" if stable_hash(key) % 1000 < TEST_FRACTION_PER_MILLE else "train"


class SyntheticTask(Task):
    """A task whose examples come from ``make(rng) -> Example`` draws filtered by the split partition.

    Example ``i`` of (split, seed) is drawn from ``random.Random(f"{name}:{split}:{seed}:{i}:{attempt}")``
    for attempt = 0, 1, ... until the drawn problem's ``meta["key"]`` belongs to ``split``
    (``split_for``). Seeding
    ``random.Random`` with a string is stable across runs (it hashes the string with SHA-512).
    """

    synthetic = True

    def make(self, rng: random.Random) -> Example:
        """Draw one problem; ``meta["key"]`` must identify the problem (not its surface wording)."""
        raise NotImplementedError

    def split_for(self, key: str) -> str:
        """Return the split that owns problem ``key`` (default: the hash partition ``split_of``)."""
        return split_of(key)

    def draw(self, split: str, index: int, seed: int | str) -> Example:
        """Return example ``index`` of (``split``, ``seed``); same arguments, same example."""
        check_split(split)
        for attempt in range(1000):
            ex = self.make(random.Random(f"{self.name}:{split}:{seed}:{index}:{attempt}"))
            if self.split_for(ex.meta["key"]) == split:
                return Example(f"{self.name}/{split}/{seed}/{index}", ex.question, ex.answer, ex.meta)
        raise AssertionError(f"{self.name}: no {split} problem in 1000 draws")  # p ~ 0.8**1000

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """Return ``n`` fresh examples of ``split``; deterministic in (split, n, seed)."""
        if n is None or n < 0:
            raise UsageError(f"{self.name} is synthetic: pass a number of examples (got n={n!r})")
        return [self.draw(split, i, seed) for i in range(n)]

    def shot_examples(self, ex: Example, shots: int, seed: int) -> list[Example]:
        """Return ``shots`` train examples drawn from ``seed`` alone, skipping ``ex``'s own problem.

        The shots are distinct problems; the same seed gives the same shots for every question.
        """
        super().shot_examples(ex, shots, seed)
        demos: list[Example] = []
        keys = {ex.meta.get("key")}
        i = 0
        while len(demos) < shots:
            if i > 100 * shots + 1000:
                raise UsageError(f"{self.name}: cannot find {shots} distinct train problems for the shots")
            d = self.draw("train", i, f"shots-{seed}")
            i += 1
            if d.meta["key"] not in keys:
                keys.add(d.meta["key"])
                demos.append(d)
        return demos


# --- helpers ----------------------------------------------------------------------------------------


def check_split(split: str) -> None:
    """Raise ``UsageError`` unless ``split`` is "train" or "test"."""
    if split not in SPLITS:
        raise UsageError(f"split {split!r} is not a split; use one of {', '.join(SPLITS)}")


def join_shots(shots: list[tuple[str, str]], question: str, sep: str = "\n") -> str:
    """Return ``q1 sep a1 \\n\\n q2 sep a2 \\n\\n ... question`` (blank line between blocks)."""
    blocks = [f"{q}{sep}{a}" for q, a in shots] + [question]
    return "\n\n".join(blocks)


def first_block(completion: str) -> str:
    """Return ``completion`` up to its first blank line, without surrounding blank lines.

    Synthetic answers never contain a blank line, so anything after one is the model starting another
    few-shot block and is not part of the answer.
    """
    text = completion.replace("\r\n", "\n").strip("\n")
    return re.split(r"\n[ \t]*\n", text, maxsplit=1)[0]


def normalize_ws(text: str) -> str:
    """Return ``text`` with runs of whitespace collapsed to one space and ends stripped."""
    return " ".join(text.split())


def strip_code_fences(text: str) -> str:
    """Return the body of the first Markdown code fence in ``text``, or ``text`` if there is none."""
    m = re.search(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:\n```|$)", text, flags=re.S)
    return m.group(1) if m else text


def sample_indices(total: int, n: int | None, seed: int) -> list[int]:
    """Return ``n`` indices of ``range(total)`` chosen by ``seed``, in increasing order (all if n is None).

    Used by the file-backed benchmarks: the seed fixes the subset, file order is kept.
    """
    if n is None or n >= total:
        return list(range(total))
    if n < 0:
        raise UsageError(f"number of examples must be >= 0, got {n}")
    return sorted(random.Random(f"subset:{seed}").sample(range(total), n))

