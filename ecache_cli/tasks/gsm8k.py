"""``gsm8k``: GSM8K test problems (openai/grade-school-math ``test.jsonl``: fields question, answer).

Prompt: the lm-eval-harness few-shot format ``Question: ...\\nAnswer: ...`` with shots separated by a
blank line and ending in ``Question: <q>\\nAnswer:``; shots are other items of the same file (8 by
default, the usual 8-shot chain-of-thought setting). The ``<<48/2=24>>`` calculator annotations are
removed from shown and target answers. Score: the number after ``####``, else the last number, compared
exactly as rationals (``tasks/answers.py``).
"""

from __future__ import annotations

import re

from ecache_cli.tasks.answers import extract_final_number, numbers_equal
from ecache_cli.tasks.base import Example
from ecache_cli.tasks.files import FileTask

_CALC = re.compile(r"<<[^<>]*>>")


def clean_solution(answer: str) -> str:
    """Return a GSM8K solution without its ``<<expr=value>>`` calculator annotations."""
    return _CALC.sub("", answer)


class GSM8KTask(FileTask):
    """GSM8K grade-school math word problems scored on the final number."""

    name = "gsm8k"
    kind = "math"
    default_shots = 8
    filename = "test.jsonl"
    fields = ("question", "answer")

    def to_example(self, index: int, row: dict) -> Example:
        """Keep question and the annotation-free worked answer; ``meta["result"]`` is the number after ####."""
        answer = clean_solution(row["answer"])
        result = answer.split("####")[-1].strip().replace(",", "")
        return Example(f"gsm8k/{index}", row["question"], answer, {"result": result})

    def prompt(self, ex: Example, shots: int = 0, seed: int = 0) -> str:
        """Return ``Question: q\\nAnswer: a`` blocks for the shots, then ``Question: <q>\\nAnswer:``."""
        blocks = [f"Question: {d.question}\nAnswer: {d.answer}" for d in self.shot_examples(ex, shots, seed)]
        return "\n\n".join(blocks + [f"Question: {ex.question}\nAnswer:"])

    def target(self, ex: Example) -> str:
        """Return the worked answer with a leading space (it follows ``Answer:``)."""
        return " " + ex.answer

    def score(self, ex: Example, completion: str) -> float:
        """Return 1.0 if the completion's final number (cut at a new ``Question:``) equals the reference."""
        got = extract_final_number(completion.split("Question:")[0])
        return float(numbers_equal(got, ex.meta["result"]))
