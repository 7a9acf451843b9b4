"""The code sandbox: statuses, wall-clock kill, containment of destructive programs, bounded output, and
the modes (strict, auto, guard). The escape attempts are in test_sandbox_escapes.py."""

import time
from pathlib import Path

import pytest

from ecache_cli.errors import UsageError
from ecache_cli.tasks import sandbox
from ecache_cli.tasks.sandbox import TAIL_BYTES, SandboxUnavailable, run_program


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


# --- modes: strict, auto, guard ------------------------------------------------------------------------------


def _kernel_isolation() -> str | None:
    try:
        return sandbox.check("strict")
    except SandboxUnavailable:
        return None


def test_auto_takes_the_strongest_isolation_here_and_guard_takes_none():
    strict = _kernel_isolation()
    auto = run_program("print('ok')", mode="auto")
    guard = run_program("print('ok')", mode="guard")
    assert auto.passed and guard.passed and auto.stdout_tail == guard.stdout_tail == "ok\n"
    assert guard.isolation == "guard"
    if strict is not None:  # this machine has kernel isolation: auto uses all of it
        assert auto.isolation == strict and strict.startswith("namespaces") and strict.endswith("seccomp")
        assert run_program("import os\nprint(os.listdir('/tmp'))").stdout_tail.strip() != \
            run_program("import os\nprint(os.listdir('/tmp'))", mode="guard").stdout_tail.strip()


def test_strict_refuses_to_run_without_kernel_isolation(monkeypatch):
    monkeypatch.setattr(sandbox, "_TRY_LAYERS", ("landlock",))  # as on a machine without namespaces and seccomp
    start = time.perf_counter()
    with pytest.raises(SandboxUnavailable) as e:
        run_program("import time\ntime.sleep(3)", mode="strict")
    assert time.perf_counter() - start < 2.5  # refused before the program ran
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--sandbox strict: no kernel isolation")
    assert "namespaces (turned off)" in msg and "seccomp (turned off)" in msg and "--sandbox auto" in msg


def test_auto_warns_once_when_only_the_guard_is_left(monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "_TRY_LAYERS", ())
    monkeypatch.setitem(sandbox._state, "warned", False)
    results = [run_program("print(1)", mode="auto") for _ in range(2)]
    assert [r.isolation for r in results] == ["guard", "guard"] and all(r.passed for r in results)
    err = capsys.readouterr().err
    assert err.count("warning: model-written code runs under the in-process guard only") == 1, err
    run_program("print(1)", mode="guard")  # guard chosen on purpose: no warning
    assert "warning" not in capsys.readouterr().err


def test_unknown_mode_is_a_usage_error():
    with pytest.raises(UsageError, match="--sandbox 'none' is not a sandbox mode; use one of strict, auto, guard"):
        run_program("pass", mode="none")


def test_manifest_counts_programs_per_isolation_not_the_check(monkeypatch):
    monkeypatch.setattr(sandbox, "_state", {"mode": "auto", "isolation": {}, "warned": True})
    assert sandbox.configure(None, "guard", runs_code=True) == "guard"  # the profile's mode; checked, not counted
    assert sandbox.manifest_entry() is None
    run_program("pass")
    run_program("pass", mode="guard")
    assert sandbox.manifest_entry() == {"mode": "guard", "isolation": {"guard": 2}}
    assert sandbox.configure("auto", "guard") == "auto"  # the flag wins over the profile; a new count
    assert sandbox.manifest_entry() is None and sandbox.get_mode() == "auto"


def test_everyday_programs_run_in_every_mode():
    """What ordinary code does (a temporary file, renaming and removing in its folder, a socket pair,
    an asyncio loop; threads where seccomp stops processes) runs under the guard and the kernel alike."""
    src = ("import asyncio, os, socket, tempfile\n"
           "with tempfile.NamedTemporaryFile('w') as f:\n    f.write('x')\n"
           "open('a', 'w').write('1')\nos.rename('a', 'b')\nos.remove('b')\n"
           "a, b = socket.socketpair()\na.sendall(b'x')\nassert b.recv(1) == b'x'\n"
           "loop = asyncio.new_event_loop()\n"
           "print(loop.run_until_complete(asyncio.sleep(0, result=5)), sorted(os.listdir('.')))\n"
           "loop.close()\n")
    threads = ("import threading\nts = [threading.Thread(target=print, args=(i,)) for i in range(4)]\n"
               "[t.start() for t in ts]\n[t.join() for t in ts]\n")
    strict = _kernel_isolation()
    for mode in ["guard"] + (["strict"] if strict else []):
        r = run_program(src, mode=mode)
        assert r.passed, (mode, r.stderr_tail)
        assert r.stdout_tail.startswith("5 [") and "'a'" not in r.stdout_tail and "'b'" not in r.stdout_tail
    if strict:
        r = run_program(threads, mode="strict")
        assert r.passed and sorted(r.stdout_tail.split()) == ["0", "1", "2", "3"], r.stderr_tail
