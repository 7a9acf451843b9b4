"""Helpers shared by the tests (the in-process ``cli`` fixture itself lives in conftest.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_bench(name: str):
    """``bench/<name>.py`` imported as module ``name`` (registered in ``sys.modules``, as its dataclasses
    need), with ``bench/`` on ``sys.path`` for the scripts that import each other."""
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def bench_usage_error(parse, argv: list[str], capsys) -> str:
    """Assert that a bench script's ``parse(argv)`` exits 2 with one ``error: ...`` line on stderr; return it."""
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def records(result) -> list[dict]:
    """The JSON records on a CLI result's stdout, one per line."""
    return [json.loads(line) for line in result.stdout.splitlines()]


def one_line_error(result, code: int, *needles: str) -> str:
    """Assert exit ``code`` and exactly one ``error: ...`` line on stderr containing every needle."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def table_rows(text: str) -> dict[str, list[str]]:
    """The body rows of a rich table in printed ``text``: each row's first cell → its cells, stripped."""
    rows = {}
    for line in text.splitlines():
        if line.strip().startswith("│"):
            cells = [c.strip() for c in line.strip().strip("│").split("│")]
            rows[cells[0]] = cells
    return rows


CUT = "did not end within --gen-length"  # the warning for answers that filled the canvas (runs/generate.py)


def without_cut_warning(stderr: str) -> str:
    """``stderr`` without generate's cut-answer warning line: the random test checkpoints seldom write an
    end token within a 16-token canvas, so most generate runs on them end with that warning; tests of
    other warnings look past it."""
    return "".join(line for line in stderr.splitlines(keepends=True) if CUT not in line)


def step_layer_positions(lm, run) -> tuple[list, list[int]]:
    """Iterate ``run`` to its end; return (its StepRecords, per step the positions that every layer's
    attention norm saw, summed over layers), counted by forward hooks removed afterwards."""
    seen: list[int] = []

    def hook(module, args, out):
        seen[-1] += args[0].shape[:-1].numel()  # (B, S, d), or (N, d) packed

    handles = [lm.model.parts(i).attn_norm.register_forward_hook(hook) for i in range(lm.spec.n_layers)]
    records = []
    try:
        it = iter(run)
        while True:
            seen.append(0)  # this step's layer-positions
            try:
                records.append(next(it))
            except StopIteration:
                seen.pop()
                break
    finally:
        for h in handles:
            h.remove()
    return records, seen


def no_model(tmp_path: Path) -> Path:
    """A ``--model`` folder that holds no checkpoint but a config.json naming no model family: it passes
    the checks before the first line (``runs.models.check_model_name``: a folder with config.json) and
    fails at the load, so a test with it shows that a bad flag is refused before anything loads."""
    folder = tmp_path / "no-model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}\n")
    return folder
