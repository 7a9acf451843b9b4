"""What the repository tracks: no file over 1 MB outside the package data, no training state.

The clone carries every version of every tracked file, so one large file committed keeps costing
every later clone. The only large files allowed are the package data under ``ecache_cli/data/`` (the
shipped model export, ``ecache_cli/data/tiny/model.safetensors``). Training states (about 20 MB each)
are kept outside the repository (``ecache_cli/data/tiny/README.md`` says where).

Sizes are those of the staged blobs (``git ls-files --stage``), so a file fails here once it is
added, before it is committed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAX_BYTES = 1_000_000  # 1 MB
ALLOWED = "ecache_cli/data/"  # package data: the shipped model export


def _git(*args: str, stdin: str | None = None) -> str:
    r = subprocess.run(["git", "-C", str(REPO), *args], input=stdin, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"not a git checkout ({' '.join(['git', *args])}: {r.stderr.strip()[:200]})")
    return r.stdout


@pytest.fixture(scope="module")
def tracked() -> dict[str, int]:
    """{path: size in bytes} of every file in git's index."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    entries = [line.split("\t", 1) for line in _git("ls-files", "--stage", "-z").split("\0") if line]
    paths = {meta.split()[1]: path for meta, path in entries if meta.split()[0] != "160000"}  # not submodules
    sizes = _git("cat-file", "--batch-check=%(objectname) %(objectsize)", stdin="\n".join(paths) + "\n")
    by_blob = dict(line.split() for line in sizes.splitlines())
    return {path: int(by_blob[blob]) for blob, path in paths.items()}


def test_no_tracked_file_over_1_mb_outside_the_package_data(tracked):
    assert "pyproject.toml" in tracked and tracked["pyproject.toml"] > 0  # the listing works
    big = sorted((size, path) for path, size in tracked.items() if size > MAX_BYTES and not path.startswith(ALLOWED))
    assert not big, ("tracked files over 1 MB outside ecache_cli/data/ (keep them out of git: "
                     "git rm --cached PATH, and add PATH to .gitignore): "
                     + ", ".join(f"{path} ({size / 1e6:.1f} MB)" for size, path in big))


def test_the_training_state_is_not_tracked(tracked):
    assert "scripts/tiny_train_state.pt" not in tracked, (
        "scripts/tiny_train_state.pt is tracked: training states stay out of git (git rm --cached it)")
    states = [p for p in tracked if p.endswith((".pt", ".ckpt")) or ".pt.part" in p]
    assert not states, f"training states or checkpoints are tracked: {states}"
