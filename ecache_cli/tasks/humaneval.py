"""``humaneval``: OpenAI HumanEval (``HumanEval.jsonl.gz`` or ``.jsonl``: fields task_id, prompt,
canonical_solution, test, entry_point).

Prompt: the item's ``prompt`` (signature + docstring), zero-shot by default; with shots, other items'
prompt + canonical solution come first. Completion handling: if it contains ``def <entry_point>(`` it is
a whole function and runs after the prompt (its definition replaces the prompt's stub, the prompt's
imports and helpers stay available); otherwise it is the body, cut at the Codex stop sequences
(``\\nclass``, ``\\ndef``, ``\\n#``, ``\\nif``, ``\\nprint``; Chen et al. 2021) and appended to the prompt.
Score: the program plus the item's ``test`` and ``check(entry_point)`` run in the sandbox.
"""

from __future__ import annotations

import re

from ecache_cli.tasks.base import Example, strip_code_fences
from ecache_cli.tasks.files import FileTask
from ecache_cli.tasks.sandbox import run_program

STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


def truncate_at_stops(text: str, stops: tuple[str, ...] = STOP_SEQUENCES) -> str:
    """Return ``text`` up to the first of ``stops`` (all of it if none occurs)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


class HumanEvalTask(FileTask):
    """Python function completion from a docstring; score: ``check(entry_point)`` passes in the sandbox."""

    name = "humaneval"
    kind = "code"
    needs_code_execution = True
    filename = "HumanEval.jsonl.gz"
    alt_filenames = ("HumanEval.jsonl",)
    fields = ("task_id", "prompt", "canonical_solution", "test", "entry_point")

    def to_example(self, index: int, row: dict) -> Example:
        """Question = prompt, answer = canonical solution; ``meta`` keeps test and entry_point."""
        return Example(row["task_id"], row["prompt"], row["canonical_solution"],
                       {"test": row["test"], "entry_point": row["entry_point"]})

    def prompt(self, ex: Example, shots: int = 0, seed: int = 0) -> str:
        """Return the solved shots (prompt + solution) then the item's prompt, as one Python text."""
        demos = [d.question + d.answer for d in self.shot_examples(ex, shots, seed)]
        return "\n\n".join([d.rstrip() for d in demos] + [ex.question]) if demos else ex.question

    def program(self, ex: Example, completion: str) -> str:
        """Return the program that scoring runs (rules in the module docstring)."""
        code = strip_code_fences(completion)
        entry = ex.meta["entry_point"]
        if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, flags=re.M):
            solution = ex.question + "\n    pass\n\n" + code  # the stub gets a body so it stays valid
        else:
            solution = ex.question + truncate_at_stops(code)
        return f"{solution}\n\n{ex.meta['test']}\n\ncheck({entry})\n"

    def score(self, ex: Example, completion: str, timeout_s: float = 5.0) -> float:
        """Return 1.0 if the tests pass. Raises ``UsageError`` without code-execution consent."""
        self.require_consent()
        return float(run_program(self.program(ex, completion), timeout_s=timeout_s).passed)
