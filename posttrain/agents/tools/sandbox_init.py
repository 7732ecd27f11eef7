"""pid 1 of the python tool's sandbox (see `python_sandbox.py`): builds the code's file system, then runs it.

Run by the tool as `python -I -u -c <this file's text> CONFIG` (CONFIG: a marshal dump in hex, read without
an import) inside fresh user, mount, network, PID and IPC namespaces, with the host's temporary directory
holding `main.py` as working directory. Standard library only. In order:

1. reads `main.py`; checks that it is pid 1 and that its namespaces are not the host's (so that it never
   mounts anything in the host's mount namespace, e.g. when started without `unshare`); marks itself not
   dumpable (the code cannot ptrace it to borrow its capabilities);
2. mounts a small tmpfs on the working directory as the new root and fills it: synthetic files
   (`/etc/passwd`), symlinks (`/bin -> usr/bin`), device nodes and directories bound from the host (`/usr`,
   the interpreter's prefixes; recursive binds), the empty working directory; makes all of it read-only
   (`mount_setattr` with AT_RECURSIVE, or a remount of each mount on kernels older than 5.12); then a
   size-capped tmpfs, writable, on the working directory, with `main.py` in it;
3. `pivot_root` into it and detaches the old root: nothing else of the host's file system is reachable;
4. forks the child that enters a nested user namespace without a uid map (no capability left over these
   mounts: the code cannot remount them writable or unmount them, and with its uid unmapped it cannot make
   a user namespace of its own), sets no_new_privs and the limits and runs the code; exits with its status
   (128 + signal if killed).

Exit status 120 (SETUP_FAILED) with "sandbox setup failed: ..." on stderr when any step fails.
"""

from __future__ import annotations

import ctypes
import marshal
import os
import resource
import signal
import stat
import sys
import traceback

SETUP_FAILED = 120
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
MNT_DETACH, CLONE_NEWUSER, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 2, 0x10000000, 4, 38
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = -100, 0x8000, 1, 2
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (added after the syscall tables merged)
SYS_PIVOT_ROOT = {
    "x86_64": 155,
    "aarch64": 41,
    "riscv64": 41,
    "loongarch64": 41,
    "ppc64le": 203,
    "s390x": 217,
}
# statvfs f_flag bits -> mount flags a bind remount has to repeat (the kernel refuses to clear locked ones)
KEPT_FLAGS = ((MS_NOSUID, MS_NOSUID), (MS_NODEV, MS_NODEV), (MS_NOEXEC, MS_NOEXEC), (1024, MS_NOATIME))
KEPT_FLAGS += ((2048, MS_NODIRATIME), (4096, MS_RELATIME))

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    check(libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]), f"mount {target}")


class MountAttr(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def make_read_only(top: str) -> None:
    """Every mount at or below `top` read-only and nosuid (device nodes keep working)."""
    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    done = libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), top.encode(), ctypes.c_uint(AT_RECURSIVE),
        ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
    )  # fmt: skip
    if done == 0:
        return
    if ctypes.get_errno() != 38:  # ENOSYS: before Linux 5.12, remount each mount below
        check(done, f"mount_setattr {top}")
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        points = [decode(line.split()[4]) for line in f]
    for point in points:
        if point == top or point.startswith(top + "/"):
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
            kept = os.statvfs(point).f_flag
            flags |= sum(ms for st, ms in KEPT_FLAGS if kept & st)
            if not kept & (1024 | 4096):
                flags |= MS_STRICTATIME
            mount(None, point, None, flags)


def decode(field: str) -> str:
    """A mountinfo path (spaces, tabs, newlines and backslashes are octal escapes)."""
    import re

    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def inside(root: str, root_dev: int, path: str) -> str:
    """`root + path`, after checking that what exists of it is plain directories of the new root's tmpfs: no
    symlink (makedirs would follow it) and no bound tree (it would create files in the host's)."""
    full = root
    for part in path.strip("/").split("/"):
        full = os.path.join(full, part)
        try:
            found = os.lstat(full)
        except FileNotFoundError:
            break
        if stat.S_ISLNK(found.st_mode) or found.st_dev != root_dev:
            raise OSError(f"{path}: would be created through a symlink or inside a host directory")
    return root + path


def build_root(config: dict, source: str) -> None:
    root = os.getcwd()
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
    root_dev = os.stat(root).st_dev
    for kind, value, path in config["entries"]:
        full = inside(root, root_dev, path)
        os.makedirs(os.path.dirname(full), mode=0o755, exist_ok=True)
        if kind == "dir":
            os.makedirs(full, mode=0o755, exist_ok=True)
        elif kind == "symlink":
            os.symlink(value, full)
        elif kind == "file":
            with open(full, "w", encoding="utf-8") as f:
                f.write(value)
        elif kind == "bind":
            if os.path.isdir(value):
                os.makedirs(full, mode=0o755, exist_ok=True)
            else:
                open(full, "a").close()
            mount(value, full, None, MS_BIND | MS_REC)
        else:
            raise ValueError(f"unknown entry {kind!r}")
    workdir = inside(root, root_dev, config["workdir"])
    os.makedirs(workdir, mode=0o755, exist_ok=True)
    make_read_only(root)
    data = f"size={config['workdir_bytes']},nr_inodes={config['workdir_inodes']},mode=0700"
    mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, data)
    with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
        f.write(source)
    os.chdir(root)
    pivot = SYS_PIVOT_ROOT.get(os.uname().machine)
    if pivot is None:
        raise OSError(f"pivot_root: unknown syscall number on {os.uname().machine}")
    check(libc.syscall(ctypes.c_long(pivot), b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    os.chdir(config["workdir"])


def setup(config: dict) -> str:
    """Steps 1-3; returns the code."""
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    if os.getpid() != 1:
        raise OSError("not pid 1 of a new PID namespace")
    for name, host in config["host_namespaces"].items():
        if os.readlink(f"/proc/self/ns/{name}") == host:
            raise OSError(f"still in the host's {name} namespace")
    check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    build_root(config, source)
    return source


def run_code(source: str, limits: list[int]) -> None:
    """Step 4, in the forked child: never returns."""
    try:
        check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        cpu_s, mem_b, fsize_b, nproc, nice = limits
        os.nice(nice)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_b, fsize_b))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_AS, (mem_b, mem_b))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        sys.argv = ["main.py"]
    except BaseException as exc:
        os.write(2, f"sandbox setup failed: {exc!r}\n".encode())
        os._exit(SETUP_FAILED)
    scope = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    status = 0
    try:
        exec(compile(source, "main.py", "exec"), scope)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            status = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            status = 1
    except BaseException as exc:
        scope.clear()  # frees what the code held (a MemoryError leaves the heap full)
        try:
            traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        except BaseException:
            os.write(2, f"{type(exc).__name__}\n".encode())
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(status & 0xFF)


def main() -> None:
    try:
        config = marshal.loads(bytes.fromhex(sys.argv[1]))
        source = setup(config)
    except BaseException as exc:
        os.write(2, f"sandbox setup failed: {exc!r}\n".encode())
        os._exit(SETUP_FAILED)
    pid = os.fork()
    if pid == 0:
        run_code(source, config["limits"])
    _, status = os.waitpid(pid, 0)
    os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
