"""Run untrusted Python (model-written code and its tests) in a separate, limited process.

Best effort, not a security boundary: the program runs as the same user, without namespaces or seccomp.
What it gets:

- a separate ``python -I`` process (isolated mode: no user site, no PYTHON* variables, no cwd on
  sys.path) with a clean environment (PATH, LANG only) in a fresh empty temporary directory that is
  deleted afterwards;
- resource limits set by the child itself before the program runs: address space (``memory_mb``), CPU
  seconds, written file size (1 MiB, which also bounds captured output), no core files, and no new
  processes (RLIMIT_NPROC=0 for unprivileged users). They are set in the child rather than in a
  ``preexec_fn`` because ``preexec_fn`` can deadlock when the parent has threads (torch's pools);
- a wall-clock timeout that kills the whole process group;
- an in-process guard, applied before the program (the idea of OpenAI human-eval's
  ``reliability_guard``, written here from scratch): sockets raise, and destructive or escaping
  functions (file removal, renames, chmod/chown, chdir, process spawning, fork, kill, ``os._exit``)
  raise ``PermissionError``; ``open`` refuses to write outside the temp dir; ``ctypes`` cannot be
  imported. A program that exits early (``sys.exit``/``exit()``, even with status 0) does not pass:
  only running to the end does, so a completion cannot skip the tests that follow it.

stdout/stderr go to files in the temp directory (bounded by RLIMIT_FSIZE) and only their tails are read.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

TAIL_BYTES = 4096
MAX_FILE_BYTES = 1 << 20  # RLIMIT_FSIZE: caps every file the program writes, stdout/stderr included

_RUNNER = r'''
import builtins, io, os, resource, signal, sys

memory_mb, cpu_s, fsize = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
try:
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # not enforced for root; the guard below still is
except (ValueError, OSError):
    pass
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over-long writes raise OSError instead of killing us

source = open("program.py", encoding="utf-8").read()
ROOT = os.path.realpath(os.getcwd())


def _deny(name):
    def denied(*args, **kwargs):
        raise PermissionError(f"{name} is disabled in the ecache sandbox")
    return denied


import posix, shutil, socket, subprocess
OS_NAMES = (
    "remove unlink rmdir removedirs rename renames replace truncate ftruncate chmod fchmod chown "
    "fchown lchown link symlink chdir fchdir chroot system popen kill killpg fork forkpty "
    "execv execve execvp execvpe execl execle execlp execlpe spawnv spawnve spawnvp spawnvpe "
    "posix_spawn posix_spawnp setuid setgid _exit abort"
)
for mod, names in (
    (os, OS_NAMES),
    (posix, OS_NAMES),
    (shutil, "rmtree move chown copy copy2 copyfile copytree make_archive unpack_archive"),
    (subprocess, "Popen run call check_call check_output getoutput getstatusoutput"),
    (socket, "socket create_connection create_server socketpair fromfd getaddrinfo gethostbyname"),
):
    for name in names.split():
        if hasattr(mod, name):
            setattr(mod, name, _deny(f"{mod.__name__}.{name}"))

_open = builtins.open


def _inside(path):
    if isinstance(path, int):
        return path in (0, 1, 2)
    p = os.path.realpath(os.fsdecode(path))
    return p == ROOT or p.startswith(ROOT + os.sep)


def guarded_open(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+") and not _inside(file):
        raise PermissionError(f"writing {file!r} is disabled in the ecache sandbox")
    return _open(file, mode, *args, **kwargs)


builtins.open = io.open = guarded_open
_os_open = os.open


def guarded_os_open(path, flags, *args, **kwargs):
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    if flags & writes and not _inside(path):
        raise PermissionError(f"writing {path!r} is disabled in the ecache sandbox")
    return _os_open(path, flags, *args, **kwargs)


os.open = guarded_os_open
for name in ("ctypes", "_ctypes", "resource", "_posixsubprocess", "multiprocessing"):
    sys.modules[name] = None  # `import ctypes` -> ImportError
del _deny, mod, names, name
try:
    exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
except SystemExit as e:
    print(f"SandboxExit: the program exited early (status {e.code!r})", file=sys.stderr)
    sys.exit(3)
'''


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of ``run_program``.

    ``status`` is "passed" (exit code 0), "failed" (the program raised ``AssertionError``: a test
    failed), "timeout" (killed at the wall-clock or CPU limit) or "error" (any other exception, a crash,
    a limit hit). ``stdout_tail``/``stderr_tail`` hold at most the last 4 KiB of each stream.
    """

    passed: bool
    status: str
    stdout_tail: str
    stderr_tail: str


def run_program(source: str, timeout_s: float = 5.0, memory_mb: int = 512) -> SandboxResult:
    """Run ``source`` as ``__main__`` in a sandboxed ``python -I`` child and return a ``SandboxResult``.

    ``timeout_s`` is wall-clock (the process group is killed at the limit; CPU time is limited to the
    same number of seconds, rounded up); ``memory_mb`` caps the address space. Never raises for
    anything the program does; ``OSError`` only if the child cannot be started.
    """
    workdir = tempfile.mkdtemp(prefix="ecache-sandbox-")
    try:
        Path(workdir, "program.py").write_text(source, encoding="utf-8")
        runner = Path(workdir, "_runner.py")
        runner.write_text(_RUNNER, encoding="utf-8")
        out_path, err_path = Path(workdir, "stdout.txt"), Path(workdir, "stderr.txt")
        cpu_s = max(1, int(timeout_s + 0.999))
        cmd = [sys.executable, "-I", "-B", str(runner), str(memory_mb), str(cpu_s), str(MAX_FILE_BYTES)]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        timed_out = False
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=err, start_new_session=True, close_fds=True)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)
                proc.wait()
        stdout, stderr = _tail(out_path), _tail(err_path)
        rc = proc.returncode
        if timed_out or rc == -signal.SIGXCPU:
            status = "timeout"
        elif rc == 0:
            status = "passed"
        elif _last_line(stderr).startswith("AssertionError"):
            status = "failed"
        else:
            status = "error"
        return SandboxResult(status == "passed", status, stdout, stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # start_new_session=True: the group id is the child's pid
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - TAIL_BYTES))
        return f.read().decode("utf-8", errors="replace")


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


