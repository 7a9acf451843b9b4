"""Child side of the code sandbox (``tasks/sandbox.py``); run as ``python -I -B _sandbox_runner.py CONFIG``.

Never imported: it is a script, standard library only, started by ``sandbox.run_program`` in a fresh
temporary folder (the work folder) holding ``program.py``. ``CONFIG`` is a JSON object: ``mode``
(strict, auto, guard), ``layers`` (kernel layers to try), ``guard`` (install the in-process guard),
``memory_mb``, ``cpu_s``, ``fsize`` and ``disk`` (bytes), ``report_fd`` (the write end of a pipe to the
parent) and ``workdir``. Linux interfaces used: unshare(2), mount(2), pivot_root(2), capset(2),
landlock(7), seccomp(2) with the uapi headers' constants, written out here.

Order of work (each kernel layer in ``layers`` is tried when the mode is not ``guard``; which worked and
why the others did not goes to the parent as JSON lines on ``report_fd``, closed before the program runs):

1. namespaces (unshare(2), mount_namespaces(7), pivot_root(2)): new mount, network, PID, IPC and UTS
   namespaces (a user namespace too when the plain call is refused, i.e. without root); a new root on a
   small tmpfs holding, read-only, only what the interpreter needs (``sys.path``, the library folders,
   ``/etc/ld.so.cache``, ``/etc/localtime``, ``/dev/null`` and the random devices) plus the work folder, a
   size-limited tmpfs at the same path (bounds the disk the program can fill). Then two forks: the first
   child is the namespace's init (PID 1, it waits and reports the program's wait status), the second
   runs the program, so that it gets ordinary signal semantics. Privileges: uid/gid nobody (65534) when
   started as root and every read-only folder is world-readable (then ``RLIMIT_NPROC`` holds too),
   otherwise all capabilities cleared (capset(2));
2. Landlock (landlock(7), ABI 1-6): reads only under the read-only paths, writes only under the work
   folder; with ABI >= 4 no TCP bind/connect, with ABI >= 6 no signals to and no abstract Unix sockets of
   processes outside the sandbox;
3. seccomp (seccomp(2), a classic BPF filter built here): no ``fork``/``vfork``/``clone`` without
   ``CLONE_THREAD``, no ``execve``, no ``socket`` (``socketpair`` stays), ``kill``/``tgkill`` only to its own
   pid, no ``ptrace``, mounts, namespaces, kernel modules, io_uring, keyrings, BPF, ``TIOCSTI``; another
   architecture's syscalls (i386, x32 on x86-64) kill the process;
4. resource limits (setrlimit(2)): address space, CPU seconds, file size, no core files, and no
   processes where seccomp does not already refuse them;
5. the in-process guard (the idea of OpenAI human-eval's ``reliability_guard``, written from scratch):
   spawning, network and destructive functions raise ``PermissionError`` (removing and renaming only
   outside the work folder, so that ``tempfile`` works), ``open``/``os.open``/``FileIO`` refuse writing
   outside the work folder, ``ctypes``, ``resource``, ``multiprocessing`` cannot be imported.

In ``strict`` mode a missing namespace or seccomp layer stops the runner before the program runs (exit
status 97, the reason in the report).
"""

import json
import os
import sys

CFG = json.loads(sys.argv[1])
MODE, WORKDIR, REPORT = CFG["mode"], CFG["workdir"], CFG["report_fd"]
NOBODY = 65534
STRICT_EXIT = 97


def report(**fields):
    os.write(REPORT, (json.dumps(fields) + "\n").encode())


def oserror(what):
    import ctypes

    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


# --- 1. namespaces -----------------------------------------------------------------------------------------

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
KEEP_FLAGS = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096  # + noatime, nodiratime, relatime
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def libc():
    import ctypes

    lib = ctypes.CDLL(None, use_errno=True)
    lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    lib.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.unshare.argtypes = [ctypes.c_int]
    lib.syscall.restype = ctypes.c_long
    lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return lib


def read_only_paths():
    """What the interpreter may read: its import path inside its own installation (not folders a
    ``.pth`` file adds, such as a project checkout), the shared-library folders, a few files."""
    trees = {os.path.realpath(t) for t in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix)}
    paths = [p for p in sys.path if p and any((os.path.realpath(p) + "/").startswith(t + "/") for t in trees)]
    paths += [os.path.join(sys.base_prefix, "lib"), "/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib",
              "/usr/share/zoneinfo", "/etc/ld.so.cache", "/etc/localtime"]
    real = sorted({os.path.realpath(p) for p in paths if os.path.exists(p)})
    keep = []
    for p in real:  # sorted: a folder comes before everything under it
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in keep):
            keep.append(p)
    return [p for p in paths if os.path.exists(p)], keep


def mount(lib, src, target, fstype, flags, data=None):
    def enc(s):
        return None if s is None else s.encode()

    if lib.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
        raise oserror(f"mount {src or fstype} on {target}")


def mirror_links(newroot, path):
    """Recreate, in the new root, the symbolic links on the way to ``path`` (e.g. /lib -> usr/lib)."""
    for _ in range(40):
        cur, parts = "/", path.strip("/").split("/")
        for i, part in enumerate(parts):
            nxt = os.path.join(cur, part)
            if os.path.islink(nxt):
                inside = newroot + nxt
                if not os.path.lexists(inside):
                    os.makedirs(os.path.dirname(inside), exist_ok=True)
                    os.symlink(os.readlink(nxt), inside)
                path = os.path.join(os.path.realpath(nxt), *parts[i + 1:])
                break
            cur = nxt
        else:
            return


def enter_namespaces(lib, uid, gid, workdir, source):
    """unshare, build the new root, pivot into it; returns whether the program is to run as nobody."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    userns = False
    if lib.unshare(flags) != 0:
        if lib.unshare(flags | CLONE_NEWUSER) != 0:
            raise oserror("unshare")
        userns = True
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    mount(lib, None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    newroot = os.path.join(workdir, "root")
    os.mkdir(newroot)
    mount(lib, "tmpfs", newroot, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    originals, binds = read_only_paths()
    nobody = drop_to_nobody(userns, binds)
    owner = NOBODY if nobody else uid
    for src in binds + [d for d in DEVICES if os.path.exists(d)]:
        target = newroot + src
        if os.path.isdir(src):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "w").close()
        mount(lib, src, target, None, MS_BIND | MS_REC)
        if src not in DEVICES:  # read-only, keeping the flags a user namespace may not clear
            keep = os.statvfs(src).f_flag & KEEP_FLAGS
            mount(lib, None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | keep)
    for p in originals + [workdir]:
        mirror_links(newroot, p)
    inside = newroot + workdir
    os.makedirs(inside, exist_ok=True)
    mount(lib, "tmpfs", inside, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={CFG['disk']},nr_inodes=4096,mode=0700,uid={owner},gid={NOBODY if nobody else gid}")
    with open(os.path.join(inside, "program.py"), "w", encoding="utf-8") as f:
        f.write(source)
    os.chdir(newroot)
    if lib.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b".") != 0:
        raise oserror("pivot_root")
    if lib.umount2(b".", MNT_DETACH) != 0:  # the old root, stacked on "/" by pivot_root(".", ".")
        raise oserror("umount old root")
    os.chdir("/")
    mount(lib, None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(workdir)
    return nobody


def drop_to_nobody(userns, binds):
    """Root outside a user namespace becomes nobody when nobody can read every read-only path."""
    if userns or os.geteuid() != 0:
        return False
    import stat

    for p in binds:
        mode = os.stat(p).st_mode
        if stat.S_ISDIR(mode) and mode & 0o005 != 0o005 or not stat.S_ISDIR(mode) and not mode & 0o004:
            return False
    return True


def fork_into_pid_namespace(lib):
    """Outer runner -> init (PID 1: waits, reports the program's wait status) -> program (PID 2)."""
    import signal

    PR_SET_PDEATHSIG = 1
    pid = os.fork()
    if pid:  # outside the PID namespace: wait for init, exit as it did
        os.close(REPORT)
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 1)
    lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    pid = os.fork()
    if pid:  # init: its death kills everything in the namespace
        _, status = os.waitpid(pid, 0)
        report(status=status)
        os._exit(0)
    lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def drop_privileges(lib, nobody):
    import ctypes

    if nobody:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)  # from root to non-zero ids: every capability goes
        return
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all zero
    if lib.syscall(SYS_CAPSET[os.uname().machine], header, data) != 0:
        raise oserror("capset")


# --- 2. Landlock -------------------------------------------------------------------------------------------

LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
LL_TRUNCATE, LL_IOCTL_DEV = 1 << 14, 1 << 15
LL_FILE_RIGHTS = LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | LL_TRUNCATE | LL_IOCTL_DEV
SYS_LANDLOCK_CREATE, SYS_LANDLOCK_ADD, SYS_LANDLOCK_RESTRICT = 444, 445, 446  # the same on every architecture


def landlock(lib, read_paths, write_path):
    """Reads under ``read_paths``, everything under ``write_path``, no TCP, no signals out; returns the ABI."""
    import ctypes
    import struct

    abi = lib.syscall(SYS_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # _VERSION
    if abi < 1:
        raise oserror("landlock_create_ruleset")
    fs = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (LL_TRUNCATE if abi >= 3 else 0) \
        | (LL_IOCTL_DEV if abi >= 5 else 0)
    net = 3 if abi >= 4 else 0  # LANDLOCK_ACCESS_NET_BIND_TCP | CONNECT_TCP, with no rule allowing any port
    scoped = 3 if abi >= 6 else 0  # LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    attr = ctypes.create_string_buffer(struct.pack("QQQ", fs, net, scoped)[:size], size)
    ruleset = lib.syscall(SYS_LANDLOCK_CREATE, attr, ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise oserror("landlock_create_ruleset")
    try:
        rules = [(p, LL_EXECUTE | LL_READ_FILE | LL_READ_DIR) for p in read_paths]
        rules += [(d, LL_READ_FILE | LL_WRITE_FILE | LL_TRUNCATE) for d in DEVICES if os.path.exists(d)]
        rules.append((write_path, fs))
        for path, access in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                if not os.path.isdir(path):
                    access &= LL_FILE_RIGHTS
                rule = ctypes.create_string_buffer(struct.pack("=Qi", access & fs, fd), 12)
                if lib.syscall(SYS_LANDLOCK_ADD, ruleset, 1, rule, 0) != 0:  # LANDLOCK_RULE_PATH_BENEATH
                    raise oserror(f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        if lib.syscall(SYS_LANDLOCK_RESTRICT, ruleset, 0) != 0:
            raise oserror("landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi


# --- 3. seccomp --------------------------------------------------------------------------------------------

# Syscall numbers: Linux uapi asm/unistd_64.h (x86-64) and asm-generic/unistd.h (arm64).
SYSCALLS = {
    "x86_64": dict(
        fork=57, vfork=58, clone=56, clone3=435, execve=59, execveat=322, socket=41, kill=62, tkill=200,
        tgkill=234, rt_sigqueueinfo=129, rt_tgsigqueueinfo=297, pidfd_open=434, pidfd_send_signal=424,
        pidfd_getfd=438, ptrace=101, process_vm_readv=310, process_vm_writev=311, process_madvise=440, kcmp=312,
        unshare=272, setns=308, mount=165, umount2=166, pivot_root=155, chroot=161, fsopen=430, fsmount=432,
        fsconfig=431, move_mount=429, open_tree=428, fspick=433, mount_setattr=442, bpf=321, perf_event_open=298,
        kexec_load=246, kexec_file_load=320, init_module=175, finit_module=313, delete_module=176, reboot=169,
        swapon=167, swapoff=168, acct=163, syslog=103, quotactl=179, keyctl=250, add_key=248, request_key=249,
        userfaultfd=323, io_uring_setup=425, io_uring_enter=426, io_uring_register=427, open_by_handle_at=304,
        name_to_handle_at=303, iopl=172, ioperm=173, mknod=133, mknodat=259, settimeofday=164, clock_settime=227,
        clock_adjtime=305, adjtimex=159, sethostname=170, setdomainname=171, setsid=112, setpgid=109, ioctl=16),
    "aarch64": dict(
        clone=220, clone3=435, execve=221, execveat=281, socket=198, kill=129, tkill=130, tgkill=131,
        rt_sigqueueinfo=138, rt_tgsigqueueinfo=240, pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438,
        ptrace=117, process_vm_readv=270, process_vm_writev=271, process_madvise=440, kcmp=272, unshare=97,
        setns=268, mount=40, umount2=39, pivot_root=41, chroot=51, fsopen=430, fsmount=432, fsconfig=431,
        move_mount=429, open_tree=428, fspick=433, mount_setattr=442, bpf=280, perf_event_open=241,
        kexec_load=104, kexec_file_load=294, init_module=105, finit_module=273, delete_module=106, reboot=142,
        swapon=224, swapoff=225, acct=89, syslog=116, quotactl=60, keyctl=219, add_key=217, request_key=218,
        userfaultfd=282, io_uring_setup=425, io_uring_enter=426, io_uring_register=427, open_by_handle_at=265,
        name_to_handle_at=264, mknodat=33, settimeofday=170, clock_settime=112, clock_adjtime=266, adjtimex=171,
        sethostname=161, setdomainname=162, setsid=157, setpgid=154, ioctl=29),
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # linux/audit.h
SPECIAL = {"clone", "clone3", "kill", "tgkill", "ioctl"}


def seccomp_program(machine, pid):
    """The filter as (code, jt, jf, k) tuples: classic BPF over ``struct seccomp_data`` (nr at 0, arch at
    4, args at 16 + 8 i, little-endian: the low word first)."""
    import errno

    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    ALLOW, KILL = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS
    EPERM, ENOSYS = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS  # SECCOMP_RET_ERRNO | errno
    nr = SYSCALLS[machine]
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, AUDIT_ARCH[machine]), (RET, 0, 0, KILL), (LD, 0, 0, 0)]
    if machine == "x86_64":  # x32 syscalls (bit 30) would bypass the numbers below
        prog += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, EPERM)]
    for name, number in nr.items():
        if name not in SPECIAL:
            prog += [(JEQ, 0, 1, number), (RET, 0, 0, EPERM)]
    prog += [(JEQ, 0, 1, nr["clone3"]), (RET, 0, 0, ENOSYS)]  # ENOSYS: glibc falls back to clone for threads
    prog += [(JEQ, 0, 4, nr["clone"]), (LD, 0, 0, 16), (JSET, 0, 1, 0x00010000),  # CLONE_THREAD: a thread
             (RET, 0, 0, ALLOW), (RET, 0, 0, EPERM)]
    for name in ("kill", "tgkill"):  # only to itself: pid (arg 0) == ours, high word 0
        prog += [(JEQ, 0, 6, nr[name]), (LD, 0, 0, 20), (JEQ, 0, 3, 0), (LD, 0, 0, 16), (JEQ, 0, 1, pid),
                 (RET, 0, 0, ALLOW), (RET, 0, 0, EPERM)]
    prog += [(JEQ, 0, 5, nr["ioctl"]), (LD, 0, 0, 24), (JEQ, 2, 0, 0x5412), (JEQ, 1, 0, 0x541C),  # TIOCSTI, TIOCLINUX
             (RET, 0, 0, ALLOW), (RET, 0, 0, EPERM)]
    prog.append((RET, 0, 0, ALLOW))
    return prog


def seccomp(lib):
    import ctypes
    import struct

    machine = os.uname().machine
    if machine not in SYSCALLS:
        raise OSError(f"no syscall table for {machine}")
    prog = seccomp_program(machine, os.getpid())
    filt = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *ins) for ins in prog))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog), ctypes.addressof(filt))
    if lib.prctl(22, 2, ctypes.addressof(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise oserror("seccomp")


# --- setup -------------------------------------------------------------------------------------------------


def isolate(source):
    """Apply every kernel layer the mode and ``CFG["layers"]`` ask for; returns (layers, missing)."""
    layers, missing = [], {}
    wanted = set(CFG["layers"]) if MODE != "guard" else set()
    for name in ("namespaces", "landlock", "seccomp"):
        if name not in wanted:
            missing[name] = "guard mode" if MODE == "guard" else "turned off"
    if not wanted:
        return layers, missing
    if sys.platform != "linux":
        return layers, {name: "not Linux" for name in wanted}
    lib = libc()
    uid, gid = os.geteuid(), os.getegid()
    workdir, nobody = WORKDIR, False
    if "namespaces" in wanted:
        try:
            nobody = enter_namespaces(lib, uid, gid, workdir, source)
            layers.append("namespaces")
        except OSError as e:
            missing["namespaces"] = str(e)
            os.chdir(workdir)
    if "namespaces" in layers:
        fork_into_pid_namespace(lib)
    try:
        drop_privileges(lib, nobody)
    except OSError as e:
        missing["privileges"] = str(e)
    PR_SET_NO_NEW_PRIVS = 38
    if lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        missing["no_new_privs"] = str(oserror("prctl"))
    if "landlock" in wanted:
        try:
            layers.append("landlock")
            report(landlock_abi=landlock(lib, read_only_paths()[1], workdir))
        except OSError as e:
            layers.remove("landlock")
            missing["landlock"] = str(e)
    if "seccomp" in wanted:
        try:
            seccomp(lib)
            layers.append("seccomp")
        except OSError as e:
            missing["seccomp"] = str(e)
    return layers, missing


# --- 4. resource limits ------------------------------------------------------------------------------------


def set_limits(seccomp_holds):
    """Address space, CPU, file size, core files; and no processes (RLIMIT_NPROC=0, which also stops
    threads, enforced for every user but root) unless seccomp already refuses new processes: then
    threads stay possible, bounded by the address space (a stack each)."""
    import resource
    import signal

    memory_mb, cpu_s, fsize = CFG["memory_mb"], CFG["cpu_s"], CFG["fsize"]
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if not seccomp_holds:
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # not enforced for uid 0 of the first user namespace
        except (ValueError, OSError):
            pass
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over-long writes raise OSError instead of killing us


# --- 5. the in-process guard -------------------------------------------------------------------------------

OS_NAMES = (
    "remove unlink rmdir removedirs rename renames replace truncate ftruncate chmod fchmod chown "
    "fchown lchown link symlink chdir fchdir chroot system popen kill killpg fork forkpty "
    "execv execve execvp execvpe execl execle execlp execlpe spawnv spawnve spawnvp spawnvpe "
    "posix_spawn posix_spawnp setuid setgid setsid _exit abort"
)
INSIDE_ONLY = {"remove": 1, "unlink": 1, "rmdir": 1, "rename": 2, "replace": 2}  # allowed inside the folder only


def install_guard():
    import _io
    import _socket
    import builtins
    import io
    import posix
    import shutil
    import socket
    import subprocess

    root = os.path.realpath(os.getcwd())
    originals = {name: getattr(os, name) for name in INSIDE_ONLY}

    def deny(name):
        def denied(*args, **kwargs):
            raise PermissionError(f"{name} is disabled in the ecache sandbox")
        return denied

    def inside_only(name, n_paths):
        fn = originals[name]

        def checked(*args, **kwargs):
            if any(kwargs.get(k) is not None for k in ("dir_fd", "src_dir_fd", "dst_dir_fd")) \
                    or not all(inside(p) for p in args[:n_paths]):
                raise PermissionError(f"os.{name} outside the sandbox folder is disabled in the ecache sandbox")
            return fn(*args, **kwargs)
        return checked

    for mod, names in (
        (os, OS_NAMES),
        (posix, OS_NAMES),
        (shutil, "rmtree move chown copy copy2 copyfile copytree make_archive unpack_archive"),
        (subprocess, "Popen run call check_call check_output getoutput getstatusoutput"),
        (socket, "create_connection create_server fromfd getaddrinfo gethostbyname"),
        (_socket, "getaddrinfo gethostbyname"),
    ):
        for name in names.split():
            if hasattr(mod, name):
                setattr(mod, name, deny(f"{mod.__name__}.{name}"))
    for name, n_paths in INSIDE_ONLY.items():
        os.__dict__[name] = posix.__dict__[name] = inside_only(name, n_paths)
    for mod in (socket, _socket):  # subclasses, so that modules subclassing them still import; a new
        # socket is refused, wrapping an existing descriptor (socket.socketpair, asyncio's self-pipe) is not
        def init(self, family=-1, type=-1, proto=-1, fileno=None, _base=mod.socket, _name=f"{mod.__name__}.socket"):
            if fileno is None:
                raise PermissionError(f"{_name} is disabled in the ecache sandbox")
            _base.__init__(self, family, type, proto, fileno)
        mod.socket = type("socket", (mod.socket,), {"__init__": init})

    def inside(path):
        if isinstance(path, int):
            return path in (0, 1, 2)
        p = os.path.realpath(os.fsdecode(path))
        return p == root or p.startswith(root + os.sep)

    def check_write(file, mode):
        if any(c in mode for c in "wax+") and not inside(file):
            raise PermissionError(f"writing {file!r} is disabled in the ecache sandbox")

    real_open, real_os_open = builtins.open, os.open

    def guarded_open(file, mode="r", *args, **kwargs):
        check_write(file, mode)
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND) and not inside(path):
            raise PermissionError(f"writing {path!r} is disabled in the ecache sandbox")
        return real_os_open(path, flags, *args, **kwargs)

    class FileIO(_io.FileIO):
        def __init__(self, file, mode="r", *args, **kwargs):
            check_write(file, mode)
            super().__init__(file, mode, *args, **kwargs)

    builtins.open = io.open = guarded_open
    os.open = posix.open = guarded_os_open
    io.FileIO = _io.FileIO = FileIO
    for name in ("ctypes", "_ctypes", "resource", "_posixsubprocess", "multiprocessing"):
        sys.modules[name] = None  # `import ctypes` -> ImportError


def main():
    source = open("program.py", encoding="utf-8").read()
    layers, missing = isolate(source)
    need = [k for k in ("namespaces", "seccomp") if k not in layers] + [k for k in ("privileges",) if k in missing]
    if MODE == "strict" and need:
        report(layers=layers, missing=missing, refused=need)
        sys.exit(STRICT_EXIT)
    report(layers=layers, missing=missing, uid=os.geteuid())
    os.close(REPORT)
    set_limits("seccomp" in layers)
    os.environ["TMPDIR"] = WORKDIR  # tempfile's default folder: the work folder
    if CFG["guard"]:
        install_guard()
    import builtins

    code = compile(source, "program.py", "exec")
    try:
        exec(code, {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as e:
        print(f"SandboxExit: the program exited early (status {e.code!r})", file=sys.stderr)
        sys.exit(3)


main()
