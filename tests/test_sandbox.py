"""The code sandbox: statuses, wall-clock kill, containment of destructive programs, bounded output."""

import time
from pathlib import Path

from ecache_cli.tasks.sandbox import TAIL_BYTES, run_program


def test_passing_program_and_stdout():
    r = run_program("print(sum(range(10)))")
    assert r.passed and r.status == "passed"
    assert r.stdout_tail == "45\n"


def test_failed_assertion_is_failed():
    r = run_program("def f(x):\n    return x\nassert f(1) == 2\n")
    assert not r.passed and r.status == "failed"
    assert "AssertionError" in r.stderr_tail


def test_crash_is_error():
    r = run_program("raise ValueError('boom')")
    assert r.status == "error" and not r.passed
    assert "ValueError: boom" in r.stderr_tail
    assert run_program("def f(:\n  pass").status == "error"  # syntax error


def test_infinite_loop_is_killed_within_limit():
    limit = 1.0
    start = time.perf_counter()
    r = run_program("while True:\n    pass\n", timeout_s=limit)
    elapsed = time.perf_counter() - start
    assert r.status == "timeout" and not r.passed
    assert elapsed < limit + 2.0, elapsed


def test_sleeping_program_is_killed_by_wall_clock():
    start = time.perf_counter()
    r = run_program("import time\ntime.sleep(30)\n", timeout_s=1.0)
    assert r.status == "timeout"
    assert time.perf_counter() - start < 3.0


def test_destructive_program_leaves_outside_files_alone(tmp_path):
    keep_dir = tmp_path / "keep"
    keep_dir.mkdir()
    sentinel = keep_dir / "sentinel.txt"
    sentinel.write_text("precious")
    attacks = [
        f"import os\nos.remove({str(sentinel)!r})",
        f"import os\nos.unlink({str(sentinel)!r})",
        f"import shutil\nshutil.rmtree({str(keep_dir)!r})",
        f"import pathlib\npathlib.Path({str(sentinel)!r}).unlink()",
        f"open({str(sentinel)!r}, 'w').write('gone')",
        f"import os\nos.system('rm -rf {keep_dir}')",
        f"import subprocess\nsubprocess.run(['rm', '-f', {str(sentinel)!r}])",
    ]
    for src in attacks:
        r = run_program(src)
        assert not r.passed and r.status == "error", (src, r)
        assert "PermissionError" in r.stderr_tail, (src, r.stderr_tail)
        assert sentinel.read_text() == "precious", src


def test_program_may_use_its_own_temp_dir_which_is_removed():
    src = "import os\nopen('scratch.txt', 'w').write('x')\nos.makedirs('d')\nprint(os.getcwd())"
    r = run_program(src)
    assert r.passed, r
    workdir = Path(r.stdout_tail.strip())
    assert workdir.name.startswith("ecache-sandbox-")
    assert not workdir.exists()


def test_megabytes_of_output_fail_with_bounded_tails():
    r = run_program("import sys\nfor _ in range(50):\n    sys.stdout.write('x' * 100_000 + '\\n')\n")
    assert not r.passed
    assert len(r.stdout_tail) <= TAIL_BYTES and len(r.stderr_tail) <= TAIL_BYTES
    r = run_program("import sys\nsys.stderr.write('e' * 5_000_000)\n")
    assert not r.passed and len(r.stderr_tail) <= TAIL_BYTES


def test_network_fork_and_ctypes_are_blocked():
    for src in ["import socket\nsocket.socket()",
                "import socket\nsocket.create_connection(('127.0.0.1', 80))",
                "import os\nos.fork()",
                "import ctypes"]:
        r = run_program(src)
        assert r.status == "error", (src, r)


def test_early_exit_does_not_count_as_passed():
    for src in ["import sys\nsys.exit(0)\nassert False", "exit()\nassert False",
                "import os\nos._exit(0)\nassert False"]:
        assert not run_program(src).passed, src


def test_memory_limit():
    r = run_program("x = bytearray(3 * 1024 ** 3)", memory_mb=256)
    assert r.status == "error" and "MemoryError" in r.stderr_tail


def test_environment_is_clean(monkeypatch):
    monkeypatch.setenv("ECACHE_TEST_SECRET", "hunter2")
    r = run_program("import os\nprint(sorted(os.environ))")
    assert r.passed
    assert "ECACHE_TEST_SECRET" not in r.stdout_tail and "HOME" not in r.stdout_tail


def test_signalling_other_processes_is_blocked():
    r = run_program("import os\nos.kill(os.getpid(), 0)  # signal 0: harmless if the guard failed")
    assert r.status == "error" and "PermissionError" in r.stderr_tail
