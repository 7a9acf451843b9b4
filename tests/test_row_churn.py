"""bench/row_churn.py: every bad option is a one-line error (exit 2) before the model loads."""

from __future__ import annotations

import pytest
from cli_helpers import bench_usage_error, load_bench


@pytest.fixture(scope="module")
def rc():
    return load_bench("row_churn")


@pytest.mark.parametrize("argv, words", [
    (["--every", "0"], "--every 0 must be ≥ 1"),
    (["--every", "57"], "--every 57 must be ≤ --steps 56"),
    (["--steps", "40", "--gen-length", "32"], "--steps 40 + --warmup 8 exceed --gen-length 32"),
    (["--policies", "foo"], "--policies 'foo' is not a cache policy; use one of none, "),
    (["--policies", "none,"], "--policies none, has an empty entry; remove the extra comma: --policies none"),
    (["--policies", "none,none"], "--policies none,none lists none twice; give each value once: --policies none"),
    (["--repeats", "0"], "--repeats 0 must be ≥ 1"),
    (["--threads", "0"], "--threads 0 must be ≥ 1"),
    (["--gen-length", "8"], "--gen-length 8 is not a multiple of --block-length 32"),
    (["--prompt-width", "0"], "--prompt-width 0 must be ≥ 1"),
    (["--swap", "3", "--batch", "2"], "--swap 3 must be < --batch 2"),
    (["--swap", "0"], "--swap 0 must be ≥ 1"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--pack-below", "1.5"], "--pack-below 1.5 must be in [0, 1] (0: never pack)"),
])
def test_bad_options_exit_2_with_one_line(rc, capsys, argv, words):
    assert words in bench_usage_error(rc.parse, argv, capsys)


def test_good_options_parse_to_the_runs_values(rc):
    args = rc.parse(["--steps", "4", "--warmup", "2", "--every", "2", "--batch", "3", "--swap", "2",
                     "--gen-length", "32", "--block-length", "16", "--policies", "none,dual"])
    assert args.steps == 6 and args.policies == ["none", "dual"] and args.block_length == 16
    assert rc.parse([]).policies == ["none", "entropy"]  # the defaults pass their own checks
    from ecache_cli.engine import forward

    assert rc.parse([]).pack_below == forward.PACK_BELOW and rc.parse(["--pack-below", "0"]).pack_below == 0


def test_help_fits_80_columns_and_names_defaults(rc, capsys):
    with pytest.raises(SystemExit) as e:
        rc.parse(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "(default: 16)" in out and "(default: none,entropy)" in out
