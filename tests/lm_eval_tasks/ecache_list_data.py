"""Datasets of the test tasks ``ecache_list`` and ``ecache_list_mc``: held-out ``list`` examples of the
embedded model's domain (``ecache_cli.tasks.listops``), built in memory so no file or download is needed.

``load(n=6, seed=0)`` returns a ``datasets.DatasetDict`` with a ``test`` split of ``n`` rows:
``question`` (the prompt, e.g. "Sort: 9 3 7 1"), ``answer`` (e.g. "1 3 7 9") and ``wrong`` (a garbage
continuation for the multiple-choice variant: the answer's characters turned into letters).
"""

import datasets

from ecache_cli.tasks import get_task


def load(n: int = 6, seed: int = 0, **_):
    rows = [{"question": ex.question, "answer": ex.answer, "wrong": "zq xv kw zq xv kw"}
            for ex in get_task("list").examples("test", n, seed)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
