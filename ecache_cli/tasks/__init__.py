"""Task registry: synthetic domains of the embedded tiny model and file-backed real benchmarks.

``TASKS`` maps a name to its class; ``get_task`` builds one. Model-written code is only executed when a
code task is built with ``allow_code_execution=True`` (the CLI's ``--allow-code-execution``).
"""

from __future__ import annotations

from ecache_cli.errors import UsageError
from ecache_cli.tasks.arith import ArithTask
from ecache_cli.tasks.base import Example, Task
from ecache_cli.tasks.codefn import CodeTask
from ecache_cli.tasks.gsm8k import GSM8KTask
from ecache_cli.tasks.humaneval import HumanEvalTask
from ecache_cli.tasks.listops import ListTask
from ecache_cli.tasks.math500 import Math500Task
from ecache_cli.tasks.mbpp import MBPPTask

TASKS: dict[str, type[Task]] = {
    "arith": ArithTask,
    "code": CodeTask,
    "list": ListTask,
    "gsm8k": GSM8KTask,
    "math500": Math500Task,
    "humaneval": HumanEvalTask,
    "mbpp": MBPPTask,
}


def check_task_name(name: str, label: str = "--task") -> None:
    """The one refusal of a name that is no task, for every command that takes ``--task`` and the Python
    API (checked before the "using model …" line, like the other usage errors): UsageError ``--task 'foo'
    is not a task; use one of arith, code, …`` (``label``: how the caller named it)."""
    if name not in TASKS:
        raise UsageError(f"{label} {name!r} is not a task; use one of {', '.join(TASKS)}")


def get_task(name: str, data: str | None = None, *, allow_code_execution: bool = False) -> Task:
    """Return the task ``name`` built with ``data`` (a file or folder for the real benchmarks).

    Raises ``UsageError`` listing the valid names for an unknown task, or when ``data`` is given to a
    synthetic task. A missing data file raises ``DataError`` when examples are first requested.
    """
    check_task_name(name)
    return TASKS[name](data=data, allow_code_execution=allow_code_execution)


__all__ = ["TASKS", "Example", "Task", "check_task_name", "get_task"]
