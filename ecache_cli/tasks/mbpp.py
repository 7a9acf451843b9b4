"""``mbpp``: Mostly Basic Python Problems (``mbpp.jsonl``: fields text, code, test_list; task_id,
test_setup_code optional), google-research/mbpp. The sanitized JSONL export (``prompt`` instead of
``text``) is accepted too.

Prompt: the standard MBPP format of Austin et al. 2021 (google-research/mbpp README)::

    You are an expert Python programmer, and here is your task: {text} Your code should pass these tests:

    {tests}
    [BEGIN]
    {code}
    [DONE]

with 3 shots, task_ids 2, 3 and 4 when the file has them (the paper's choice), else other items chosen
by the seed. Test split: task_ids 11-510 when the file is the full dump (it has ids below 11), else the
whole file. Score: the code between ``[BEGIN]`` and ``[DONE]`` (or the whole completion) with
``test_setup_code`` and ``test_list`` runs in the sandbox.
"""

from __future__ import annotations

from ecache_cli.errors import DataError
from ecache_cli.tasks.base import Example, strip_code_fences
from ecache_cli.tasks.files import FileTask
from ecache_cli.tasks.sandbox import run_program

PROMPT_IDS = (2, 3, 4)
TEST_IDS = range(11, 511)


def format_block(ex: Example, with_answer: bool) -> str:
    """Return one MBPP prompt block; with ``with_answer`` it ends in ``code\\n[DONE]``."""
    tests = "\n".join(ex.meta["tests"])
    head = (f"You are an expert Python programmer, and here is your task: {ex.question} "
            f"Your code should pass these tests:\n\n{tests}\n[BEGIN]\n")
    return head + (f"{ex.answer}\n[DONE]" if with_answer else "")


def extract_code(completion: str) -> str:
    """Return the code of a completion: after ``[BEGIN]`` if present, before ``[DONE]``, fences removed."""
    text = completion.split("[BEGIN]", 1)[-1].split("[DONE]", 1)[0]
    return strip_code_fences(text).strip("\n")


class MBPPTask(FileTask):
    """Entry-level Python problems; score: all ``test_list`` asserts pass in the sandbox."""

    name = "mbpp"
    kind = "code"
    default_shots = 3
    needs_code_execution = True
    filename = "mbpp.jsonl"
    alt_filenames = ("sanitized-mbpp.jsonl", "test.jsonl")
    fields = ("code", "test_list")  # and "text" (original) or "prompt" (sanitized)

    def to_example(self, index: int, row: dict) -> Example:
        """Question = text, answer = code (``\\r\\n`` normalised); ``meta`` keeps tests and setup code."""
        task_id = row.get("task_id", index)
        meta = {"task_id": task_id, "tests": list(row["test_list"]),
                "setup": row.get("test_setup_code") or ""}
        code = row["code"].replace("\r\n", "\n")
        text = row.get("text", row.get("prompt"))
        if text is None:
            raise DataError(f"{self.data_path()}: item {index} has neither 'text' nor 'prompt' (MBPP format)")
        return Example(f"mbpp/{task_id}", text, code, meta)

    def test_items(self) -> list[Example]:
        """Return task_ids 11-510 for the full dump, else every item."""
        items = self.items()
        if any(isinstance(e.meta["task_id"], int) and e.meta["task_id"] < 11 for e in items):
            return [e for e in items if e.meta["task_id"] in TEST_IDS]
        return items

    def shot_examples(self, ex: Example, shots: int, seed: int) -> list[Example]:
        """Return task_ids 2, 3, 4 (standard) when present, topped up by seeded other items."""
        if shots <= 0:
            return super().shot_examples(ex, shots, seed)  # validates shots
        by_id = {e.meta["task_id"]: e for e in self.items()}
        demos = [by_id[i] for i in PROMPT_IDS if i in by_id and by_id[i].id != ex.id][:shots]
        seen = {d.id for d in demos}
        extra = [d for d in super().shot_examples(ex, shots + len(demos), seed) if d.id not in seen]
        return demos + extra[: shots - len(demos)]

    def prompt(self, ex: Example, shots: int = 0, seed: int = 0) -> str:
        """Return the MBPP-format shots (one per line group) then the open ``[BEGIN]`` block for ``ex``."""
        demos = [format_block(d, True) for d in self.shot_examples(ex, shots, seed)]
        return "\n".join(demos + [format_block(ex, False)])

    def target(self, ex: Example) -> str:
        """Return the reference code followed by ``\\n[DONE]``."""
        return f"{ex.answer}\n[DONE]"

    def program(self, ex: Example, completion: str) -> str:
        """Return setup code, the extracted solution and the asserts as one program."""
        parts = [ex.meta["setup"], extract_code(completion), "\n".join(ex.meta["tests"])]
        return "\n\n".join(p for p in parts if p) + "\n"

    def score(self, ex: Example, completion: str, timeout_s: float = 5.0) -> float:
        """Return 1.0 if every test passes. Raises ``UsageError`` without code-execution consent."""
        self.require_consent()
        return float(run_program(self.program(ex, completion), timeout_s=timeout_s).passed)
