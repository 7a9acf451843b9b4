"""Several task domains, or one domain at several shot counts, calibrated as one setting.

``ecache calibrate --task arith,code,list`` (or ``--shots 0,4``) looks for the one EntropyCache setting
that meets the tolerance on every group: a group is a (task, shots) pair, named ``task`` (or
``task@shots`` when several shot counts are calibrated). :class:`TaskGroups` presents the groups as one
task to the calibration: its test examples are each group's ``--limit`` examples in turn (ids prefixed
with the group's name), its prompts and scores are the group's own task's, and ``groups`` tells which
examples belong to which group, so the search aggregates a point per group (``tau_search.Point.parts``)
and the choice requires every group to qualify (``tau_search.qualifies``).
"""

from __future__ import annotations

from ..errors import UsageError
from ..tasks.base import Example
from .comma_lists import parse_list as comma_list

#: The profile task name a multi-domain calibration writes: the model's default settings (config.py).
DEFAULT_PROFILE_TASK = "default"


def parse_list(text: str, flag: str) -> list[str]:
    """The names of a comma list such as ``--task arith,code,list``; UsageError as
    :func:`comma_lists.parse_list` (nothing named, an empty entry, a name given twice)."""
    return comma_list(text, flag, example="arith,code,list")


def parse_shots(text: str | None) -> list[int] | None:
    """``--shots``: None, one count (``4``) or a comma list (``0,4``) of distinct whole numbers ≥ 0; an entry
    outside that range gets the words of ``profile --shots`` (``config.option_ranges``: ``--shots -1 must be
    ≥ 0 (e.g. 4)``)."""
    if text is None:
        return None
    from ..config import option_ranges

    return comma_list(str(text), "--shots", int, what="a whole number", example="0,4", rng=option_ranges()["shots"])


class TaskGroups:
    """(name, task, shots) groups seen as one task by ``runs/calibrate.py``; see the module docstring.

    ``examples("test", n, seed)`` must be called before ``prompt`` or ``score`` (it records which task
    and shot count each returned example belongs to). ``default_shots`` is the list of the groups'
    shot counts (what the run key and the profile record); ``prompt`` ignores the shots it is given.
    """

    def __init__(self, groups: list[tuple[str, object, int]]):
        if not groups:
            raise UsageError("no task to calibrate; e.g. --task arith,code,list")
        self.parts = groups
        self.name = ",".join(dict.fromkeys(t.name for _, t, _ in groups))
        self._where: dict[str, tuple[str, object, Example, int]] = {}

    @classmethod
    def build(cls, tasks: list[str], shots: list[int] | None, get) -> "TaskGroups":
        """Groups of every task (``get(name)`` builds one) at every shot count of ``shots`` (None: the
        task's default); named ``task`` with one shot count, ``task@shots`` with several."""
        groups = []
        for name in tasks:
            task = get(name)
            for k in shots if shots is not None else [task.default_shots]:
                groups.append((name if shots is None or len(shots) == 1 else f"{name}@{k}", task, k))
        return cls(groups)

    @property
    def tasks(self) -> list:
        return list({id(t): t for _, t, _ in self.parts}.values())

    @property
    def can_score(self) -> bool:
        return all(t.can_score for t in self.tasks)

    @property
    def needs_code_execution(self) -> bool:
        return any(t.needs_code_execution for t in self.tasks)

    @property
    def default_shots(self) -> list[int]:
        return list(dict.fromkeys(k for _, _, k in self.parts))

    def require_consent(self) -> None:
        for t in self.tasks:
            if t.needs_code_execution:
                t.require_consent()

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """``n`` examples of each group in turn (each task's own seeded draw), ids ``<group>:<id>``."""
        out = []
        for group, task, k in self.parts:
            for ex in task.examples(split, n, seed):
                wrapped = Example(id=f"{group}:{ex.id}", question=ex.question, answer=ex.answer, meta=ex.meta)
                self._where[wrapped.id] = (group, task, ex, k)
                out.append(wrapped)
        return out

    def prompt(self, ex: Example, shots=None, seed: int = 0) -> str:
        _, task, orig, k = self._where[ex.id]
        return task.prompt(orig, k, seed)

    def prompt_examples(self, ex: Example, shots=None, seed: int = 0) -> list[Example]:
        """The examples whose text :meth:`prompt` puts in ``ex``'s prompt (its group's task's, at the
        group's shot count): ``Task.prompt_examples``."""
        _, task, orig, k = self._where[ex.id]
        return task.prompt_examples(orig, k, seed)

    def score(self, ex: Example, completion: str) -> float:
        _, task, orig, _ = self._where[ex.id]
        return task.score(orig, completion)

    def groups(self, examples: list[Example]) -> dict[str, list[int]]:
        """{group name: indices into ``examples``}, groups in their order."""
        out: dict[str, list[int]] = {g: [] for g, _, _ in self.parts}
        for i, ex in enumerate(examples):
            out[self._where[ex.id][0]].append(i)
        return out

    def data_files(self) -> list:
        """The data files of the groups' file tasks (for the run key's fingerprint)."""
        return [t.data_path() for t in self.tasks
                if getattr(t, "synthetic", False) is False and hasattr(t, "data_path")]
