"""Hints that lead somewhere: every value an error message suggests is one the same command accepts.

Each case runs ``ecache generate`` with one bad value, reads the values its one-line error suggests
(``e.g. X``, ``use --steps A or B``, ``use one of ...``) and runs the same command again with each of them
in place of the bad one: every rerun must succeed."""

from __future__ import annotations

import re

import pytest

BASE = ["--gen-length", "16", "--block-length", "8"]

# (flag, bad value, the other flags of the command, the pattern whose groups are the suggested values)
CASES = [
    ("--gen-length", "20", ["--block-length", "8"], r"e\.g\. (\d+) or (\d+)"),
    ("--gen-length", "0", ["--block-length", "8", "--steps", "2"], r"e\.g\. (\d+)"),
    ("--block-length", "0", ["--gen-length", "16"], r"e\.g\. (\d+)"),
    ("--steps", "3", BASE, r"use --steps (\d+) or (\d+)"),
    ("--steps", "1", BASE, r"use --steps ≥ (\d+)"),
    ("--threshold", "1.5", BASE, r"e\.g\. ([\d.]+)"),
    ("--temperature", "-1", BASE, r"e\.g\. ([\d.]+)"),
    ("--top-p", "2", BASE, r"e\.g\. ([\d.]+)"),
    ("--top-k", "0", BASE, r"e\.g\. (\d+)"),
    ("--factor", "0", BASE, r"e\.g\. ([\d.]+)"),
    ("--alg-temp", "-1", [*BASE, "--schedule", "dream"], r"e\.g\. ([\d.]+)"),
    ("--tau", "-1", BASE, r"e\.g\. ([\d.]+)"),
    ("--recent-k", "-2", BASE, r"e\.g\. (\d+)"),
    ("--cache", "lru", BASE, r"use one of ([\w, -]+)$"),
    ("--remasking", "bogus", BASE, r"choose one of ([\w, ]+), or origin"),
    ("--remasking", "bogus", [*BASE, "--schedule", "dream"], r"or (origin) with --schedule dream"),
    ("--remasking", "random", [*BASE, "--threshold", "0.9"], r"use --remasking (\w+)$"),
]


@pytest.mark.parametrize("flag,bad,others,pattern", CASES, ids=[f"{c[0]}={c[1]}" for c in CASES])
def test_every_suggested_value_is_accepted_by_the_same_command(cli, flag, bad, others, pattern):
    r = cli("generate", *others, flag, bad, "Sort: 3 1 2")
    assert r.exit_code == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    m = re.search(pattern, line)
    assert m, line
    values = [v.strip() for g in m.groups() for v in g.split(",")]
    assert values
    for value in values:
        again = cli("generate", *others, flag, value, "Sort: 3 1 2")
        assert again.exit_code == 0, (flag, value, again.stderr)


def test_the_note_of_a_dropped_family_threshold_suggests_an_accepted_value(cli):
    """``--remasking random`` on SDAR drops the family's default threshold with a note; the remasking it
    suggests to keep the threshold rule is accepted by the same command."""
    from pathlib import Path

    sdar = str(Path(__file__).resolve().parent / "fixtures" / "sdar")
    r = cli("generate", "--model", sdar, "--gen-length", "16", "--remasking", "random", "Sort: 3 1 2")
    assert r.exit_code == 0, r.stderr
    (note,) = [line for line in r.stderr.splitlines() if line.startswith("note: ")]
    value = re.search(r"pass --remasking (\w+) to keep", note).group(1)
    again = cli("generate", "--model", sdar, "--gen-length", "16", "--remasking", value, "Sort: 3 1 2")
    assert again.exit_code == 0 and "note: " not in again.stderr, again.stderr
