"""``math500``: the MATH-500 subset of Hendrycks' MATH (``test.jsonl``: fields problem, answer; solution,
subject, level, unique_id optional), as published in HuggingFaceH4/MATH-500.

Prompt: zero-shot, the problem followed by the instruction commonly used with MATH-500 ("Please reason
step by step, and put your final answer within \\boxed{}."); with shots, ``Problem: ...\\nSolution: ...``
blocks from other items of the file (their ``solution``, or ``The answer is $\\boxed{answer}$.``).
Score: the last ``\\boxed{...}`` of the completion against ``answer`` (``tasks/answers.py``).
"""

from __future__ import annotations

from ecache_cli.tasks.answers import last_boxed, math_equal
from ecache_cli.tasks.base import Example
from ecache_cli.tasks.files import FileTask

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class Math500Task(FileTask):
    """Competition math; score: normalised last ``\\boxed{}`` equals the reference answer."""

    name = "math500"
    kind = "math"
    default_shots = 0
    filename = "test.jsonl"
    fields = ("problem", "answer")

    def to_example(self, index: int, row: dict) -> Example:
        """Question = problem; answer = the solution if present, else ``\\boxed{answer}``."""
        answer = row.get("solution") or f"The answer is $\\boxed{{{row['answer']}}}$."
        ex_id = str(row.get("unique_id") or f"math500/{index}")
        return Example(ex_id, row["problem"], answer, {"result": str(row["answer"])})

    def prompt(self, ex: Example, shots: int = 0, seed: int = 0) -> str:
        """Return solved ``Problem:/Solution:`` blocks, then the problem and the \\boxed{} instruction."""
        demos = self.shot_examples(ex, shots, seed)
        if not demos:
            return f"{ex.question}\n{INSTRUCTION}"
        blocks = [f"Problem: {d.question}\nSolution: {d.answer}" for d in demos]
        return "\n\n".join(blocks + [f"Problem: {ex.question}\n{INSTRUCTION}\nSolution:"])

    def score(self, ex: Example, completion: str) -> float:
        """Return 1.0 if the last ``\\boxed{}`` in the completion matches the reference answer."""
        return float(math_equal(last_boxed(completion), ex.meta["result"]))
