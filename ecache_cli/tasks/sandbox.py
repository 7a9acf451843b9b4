"""Run untrusted Python (model-written code and its tests) in a separate, limited process.

Threat model: the program is arbitrary Python written by a model, run to score it. It must not change
or read anything outside its own folder, reach the network, start processes, signal other processes,
or exhaust the machine; it runs as the same user as ecache (often root on GPU machines).

Isolation, chosen per run by the mode (``--sandbox``, profile key ``sandbox``; :data:`MODES`):

- ``strict``: kernel isolation or nothing: Linux namespaces (own mount, network, PID, IPC, UTS
  namespaces; a read-only filesystem view holding only what the interpreter needs plus the work folder,
  a size-limited tmpfs; root becomes ``nobody``) and a seccomp filter (no new processes, no sockets, no
  signals to other processes, no mounts), plus Landlock (reads and writes limited to those paths, no TCP,
  no signals out) where the kernel has it. Without namespaces or seccomp :func:`run_program` raises
  :class:`SandboxUnavailable` before the program runs;
- ``auto`` (default): every kernel layer that works on this machine; one warning per process when none
  does and only the in-process guard is left;
- ``guard``: no kernel layer (for machines without namespaces): the in-process guard and limits only.

Every mode keeps: a separate ``python -I`` process (no user site, no PYTHON* variables, no cwd on
sys.path) with a clean environment (PATH, LANG only) in a fresh temporary folder deleted afterwards;
resource limits set by the child itself (address space ``memory_mb``, CPU seconds, 1 MiB per written
file, which also bounds captured output, no core files, no processes; in the child rather than in a
``preexec_fn``, which can deadlock when the parent has threads); a wall-clock timeout that kills the whole
process group; and the in-process guard (``PermissionError`` for destructive, spawning and network
functions, ``open`` refusing writes outside the folder, ``ctypes`` not importable). The guard alone is no
security boundary: ``tests/test_sandbox_escapes.py`` lists what an ordinary program still gets past it.
A program that exits early (``sys.exit``/``exit()``, even with status 0) does not pass: only running to
the end does, so a completion cannot skip the tests that follow it.

How each layer is built: ``tasks/_sandbox_runner.py`` (the child's side). stdout/stderr go to files
outside the sandbox (bounded by RLIMIT_FSIZE) and only their tails are read. Each result names the
isolation that ran (``SandboxResult.isolation``); :func:`manifest_entry` gives the run manifest's record.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import EcacheError, UsageError

TAIL_BYTES = 4096
MAX_FILE_BYTES = 1 << 20  # RLIMIT_FSIZE: caps every file the program writes, stdout/stderr included
DISK_BYTES = 16 << 20  # size of the work folder's tmpfs under namespaces: all files together
MODES = ("strict", "auto", "guard")
KERNEL_LAYERS = ("namespaces", "landlock", "seccomp")  # in SandboxResult.isolation, "+"-joined
STRICT_NEEDS = ("namespaces", "seccomp")
_TRY_LAYERS = KERNEL_LAYERS  # what run_program tries by default (tests narrow it to simulate a bare machine)
_RUNNER = Path(__file__).with_name("_sandbox_runner.py")

_state: dict = {"mode": "auto", "isolation": {}, "warned": False}


class SandboxUnavailable(EcacheError):
    """``--sandbox strict`` on a machine without the kernel isolation it needs (exit 1)."""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of ``run_program``.

    ``status`` is "passed" (exit code 0), "failed" (the program raised ``AssertionError``: a test
    failed), "timeout" (killed at the wall-clock or CPU limit) or "error" (any other exception, a crash,
    a limit hit). ``stdout_tail``/``stderr_tail`` hold at most the last 4 KiB of each stream.
    ``isolation``: the kernel layers that held the program, "+"-joined in :data:`KERNEL_LAYERS` order
    (e.g. "namespaces+landlock+seccomp"), or "guard" when none did (in-process guard and limits only).
    """

    passed: bool
    status: str
    stdout_tail: str
    stderr_tail: str
    isolation: str = "guard"


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`MODES`, else ``UsageError`` (exit 2) naming the choices."""
    if mode not in MODES:
        raise UsageError(f"--sandbox {mode!r} is not a sandbox mode; use one of {', '.join(MODES)}")
    return mode


def set_mode(mode: str) -> None:
    """Make ``mode`` the default of :func:`run_program` in this process (the CLI's ``--sandbox``)."""
    _state["mode"] = check_mode(mode)


def get_mode() -> str:
    """The process default mode (``auto`` unless :func:`set_mode` changed it)."""
    return _state["mode"]


def check(mode: str | None = None) -> str:
    """Run an empty program in ``mode`` (default: the process default) and return its isolation.

    For commands to call before loading a model: ``strict`` raises :class:`SandboxUnavailable` here,
    ``auto`` warns here (once a process) when only the guard is left. The empty program is not counted
    in :func:`manifest_entry`.
    """
    counts = dict(_state["isolation"])
    try:
        return run_program("pass", timeout_s=10.0, mode=mode).isolation
    finally:
        _state["isolation"] = counts


def configure(flag: str | None, profile_value: str | None = None, runs_code: bool = False) -> str:
    """The CLI's ``--sandbox``: flag > profile key ``sandbox`` > ``auto``; sets the process default and,
    when the command will run model-written code, checks it now (:func:`check`: strict fails, auto
    warns, before any model loads); a ``--sandbox`` given to a run that executes no code is warned as
    ignored, as a cache flag the policy does not take is. Returns the mode; ``UsageError`` for an unknown
    one."""
    mode = check_mode(flag or profile_value or "auto")
    set_mode(mode)
    _state["isolation"] = {}  # a new command: its manifest counts its own programs
    if runs_code:
        check(mode)
    elif flag is not None:  # plain stderr, as console.warn prints (the tasks package imports nothing but errors)
        print(f"warning: --sandbox {flag} is used only when model-written code runs (a code task scored with "
              "--allow-code-execution); ignored", file=sys.stderr, flush=True)
    return mode


def manifest_entry() -> dict | None:
    """The run manifest's ``sandbox`` record: the mode and how many programs ran under each isolation
    (``{"mode": "auto", "isolation": {"namespaces+landlock+seccomp": 40}}``); None when no program ran."""
    if not _state["isolation"]:
        return None
    return {"mode": _state["mode"], "isolation": dict(_state["isolation"])}


def run_program(source: str, timeout_s: float = 5.0, memory_mb: int = 512, mode: str | None = None,
                layers: tuple[str, ...] | None = None, guard: bool = True) -> SandboxResult:
    """Run ``source`` as ``__main__`` in a sandboxed ``python -I`` child and return a ``SandboxResult``.

    ``timeout_s`` is wall-clock (the process group is killed at the limit; CPU time is limited to the
    same number of seconds, rounded up); ``memory_mb`` caps the address space; ``mode``: one of
    :data:`MODES`, default the process default (:func:`set_mode`, else ``auto``); ``layers``: the kernel
    layers to try (default all of :data:`KERNEL_LAYERS`; fewer for benchmarks and tests); ``guard=False``
    leaves out the in-process guard (only to test what the kernel layers hold alone). Never raises for
    anything the program does; ``SandboxUnavailable`` in strict mode without kernel isolation (the
    program did not run), ``UsageError`` for an unknown mode, ``OSError`` if the child cannot be started.
    """
    mode = check_mode(mode or _state["mode"])
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="ecache-sandbox-"))
    read_fd, write_fd = os.pipe()
    try:
        Path(workdir, "program.py").write_text(source, encoding="utf-8")
        out_path, err_path = Path(workdir, "stdout.txt"), Path(workdir, "stderr.txt")
        cpu_s = max(1, int(timeout_s + 0.999))
        config = {"mode": mode, "memory_mb": memory_mb, "cpu_s": cpu_s, "fsize": MAX_FILE_BYTES,
                  "disk": DISK_BYTES, "report_fd": write_fd, "workdir": workdir,
                  "layers": list(_TRY_LAYERS if layers is None else layers), "guard": guard}
        cmd = [sys.executable, "-I", "-B", str(_RUNNER), json.dumps(config)]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        timed_out = False
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=err, start_new_session=True, close_fds=True, pass_fds=(write_fd,))
            os.close(write_fd)
            write_fd = -1
            try:
                timed_out = not _wait(proc, timeout_s)
            finally:
                _kill_group(proc.pid)
                proc.wait()
        report = _read_report(read_fd)
        if report.get("refused"):
            raise SandboxUnavailable(_refusal(report))
        stdout, stderr = _tail(out_path), _tail(err_path)
        rc = os.waitstatus_to_exitcode(report["status"]) if "status" in report else proc.returncode
        if timed_out or rc == -signal.SIGXCPU:
            status = "timeout"
        elif rc == 0:
            status = "passed"
        elif _last_line(stderr).startswith("AssertionError"):
            status = "failed"
        else:
            status = "error"
        isolation = _isolation(report)
        _record(mode, isolation, report)
        return SandboxResult(status == "passed", status, stdout, stderr, isolation)
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
        shutil.rmtree(workdir, ignore_errors=True)


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for ``proc`` at most ``timeout_s`` seconds; False on timeout. A pidfd (Linux >= 5.3) wakes
    at the exit itself; ``Popen.wait(timeout)`` polls with sleeps growing to 50 ms, which would add up to
    50 ms to every program."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(pidfd)


def _read_report(fd: int) -> dict:
    """Merge the runner's JSON lines (its layers, then the program's wait status from the PID
    namespace's init); every writer has exited, so the pipe ends."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    report: dict = {}
    for line in b"".join(chunks).decode("utf-8", errors="replace").splitlines():
        try:
            report.update(json.loads(line))
        except (json.JSONDecodeError, TypeError):
            continue
    return report


def _isolation(report: dict) -> str:
    if "layers" not in report:
        return "unknown"  # the runner died before reporting: the program never ran
    kernel = [k for k in KERNEL_LAYERS if k in report["layers"]]
    return "+".join(kernel) or "guard"


def _missing(report: dict, names) -> str:
    missing = report.get("missing", {})
    return ", ".join(f"{k} ({missing.get(k, 'unavailable')})" for k in names)


def _refusal(report: dict) -> str:
    return (f"--sandbox strict: no kernel isolation for model-written code here, missing "
            f"{_missing(report, report['refused'])}; use --sandbox auto to run with what this machine has "
            "(see README, Running model-written code)")


def _record(mode: str, isolation: str, report: dict) -> None:
    """Count the isolation for the manifest; in auto mode warn once when only the guard is left."""
    _state["isolation"][isolation] = _state["isolation"].get(isolation, 0) + 1
    if mode == "auto" and isolation == "guard" and not _state["warned"]:
        _state["warned"] = True
        # plain stderr, as console.warn prints (the tasks package imports nothing but errors)
        print(f"warning: model-written code runs under the in-process guard only, no kernel isolation (missing "
              f"{_missing(report, STRICT_NEEDS)}); the guard is no security boundary (--sandbox strict refuses "
              "to run without kernel isolation; README, Running model-written code)", file=sys.stderr, flush=True)


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


