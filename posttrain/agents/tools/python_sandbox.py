"""The `python` tool: the model's code run in a fresh, limited process with no network and no host files.

Each call writes the code to a host temporary directory and runs, from there,

    [setpriv --ruid 65534]  unshare --user --map-root-user --mount --propagation=private --net --pid --ipc
        --fork --kill-child  python -I -u -c SUPERVISOR CONFIG

(SUPERVISOR is `sandbox_init.py`, which builds the code's file system and runs it.)

- **No network**: a new network namespace has only a loopback device, and it is down, so every connect
  fails (even to 127.0.0.1). It is the kernel that refuses, not a patched `socket` module. The tool probes
  this once per process when it is built and refuses to start (ConfigError) where user namespaces are not
  available; there is no unsandboxed fallback.
- **File system**: in a new mount namespace the supervisor mounts a small tmpfs as the new root and puts in
  it, read-only (bind mounts, then `mount_setattr(MOUNT_ATTR_RDONLY, AT_RECURSIVE)`): `/usr` (and
  `/bin`, `/lib`... as symlinks or binds, as on the host), the interpreter's prefixes (its venv and the
  installation it points to, e.g. `~/.pyenv/versions/3.11.7`: standard library, extension modules,
  site-packages), the dynamic loader's cache and `/etc/localtime`, a synthetic `/etc/passwd` (`nobody`
  only), `/dev/{null,zero,full,random,urandom}`. The working directory `/sandbox` (also HOME, TMPDIR and,
  through a symlink, `/dev/shm`) is the only writable place: a tmpfs of `workdir_mb` (16 MB) and 4096
  inodes holding `main.py`, gone with the namespace. Then `pivot_root` and the old root detached: the
  rest of the machine (home directories such as /root, /home, /work and this repository, /tmp, /var, the
  rest of /etc, /proc, /sys, other devices) is not there at all. The code runs in a further, nested user
  namespace, so it holds no capability over these mounts: it cannot remount them writable or unmount them
  (tested). The probe at build time checks the view (root listing, a host file hidden, / not writable), and
  the supervisor refuses to mount anything unless it is pid 1 in namespaces other than the host's.
- **Processes**: a new PID namespace whose init is the supervisor (not the model's code, which would then
  ignore default signals as an init does); when the supervisor exits every process left in the namespace
  is killed, so nothing outlives a call. On a timeout or an output flood the whole process group is killed
  (SIGKILL). `RLIMIT_NPROC` bounds fork bombs: the kernel counts it per user per user namespace, but never
  enforces it on real uid 0, so when posttrain runs as root the real uid is set to `nobody` with `setpriv`
  first (the effective uid stays: it is what the supervisor needs to bind the interpreter from /root). A
  new IPC namespace hides the host's System V IPC and message queues. The supervisor is not dumpable (the
  code cannot ptrace it) and the code runs with no_new_privs.
- **Limits** (set in the child before the code runs): CPU seconds (`RLIMIT_CPU`, SIGXCPU then SIGKILL),
  address space (`RLIMIT_AS`: allocation fails with MemoryError), file size (`RLIMIT_FSIZE`, writes fail
  with EFBIG), processes (`RLIMIT_NPROC`), no core dumps; disk: the working directory's tmpfs size (writes
  fail with ENOSPC); a wall-clock timeout; an output cap (the process is killed once stdout+stderr exceed
  it); the code runs at `nice` 10 so that generation wins a contended core (see `runner.py` on sharing the
  2 cores). Keep the runner's `timeout_s` above this tool's, so that the model reads "killed: ran longer
  than ..." with the output so far rather than the runner's timeout (which also kills the process: a
  cancelled call never leaves it running).
- **Environment**: `-I` (no user site, no PYTHON* variables), a minimal environment (no secrets inherited),
  stdin empty, one thread for BLAS/OpenMP.

Not isolated: what the interpreter's prefixes hold is readable (the whole venv's site-packages, with the
path of an editable install but not its files); the code's file accesses are still checked with the
caller's uid (root when posttrain runs as root), which matters only for the read-only files shown; no
/proc (so no `ps`, `/proc/self/...`; `os.cpu_count()` works); no cgroup (memory is bounded by RLIMIT_AS
plus the 16 MB tmpfs per call). The code's own errors (a traceback, a non-zero exit, a limit reached) are
its output, returned normally; only a sandbox failure is a ToolError.
"""

from __future__ import annotations

import asyncio
import functools
import json
import marshal
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from posttrain.agents.tools.base import FunctionTool, ToolError, ToolFailed
from posttrain.errors import ConfigError

NOBODY_UID = 65534
SETUP_FAILED = 120  # the supervisor's exit code when the file system or the limits could not be set up
SETUP_FAILED_TEXT = "sandbox setup failed:"  # what it prints first then (sandbox_init.py)
WORKDIR = "/sandbox"  # the code's working directory inside the sandbox: its only writable place
SUPERVISOR = (Path(__file__).parent / "sandbox_init.py").read_text(encoding="utf-8")  # run as pid 1
NAMESPACES = ("user", "mnt", "net", "pid", "ipc")

# what the code sees besides the interpreter: the system's programs and libraries, the dynamic loader's
# configuration, a few device nodes, and an /etc/passwd naming only `nobody` (its uid inside)
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives")
DEVICES = ("null", "zero", "full", "random", "urandom")
PASSWD = f"nobody:x:{NOBODY_UID}:{NOBODY_UID}:nobody:{WORKDIR}:/usr/sbin/nologin\n"
GROUP = f"nogroup:x:{NOBODY_UID}:\n"

PROBE = """import json, os, socket
found = {"ifaces": sorted(n for _, n in socket.if_nameindex()), "cwd": os.getcwd(), "root": os.listdir("/")}
try:
    open("/probe", "w")
    found["write"] = "written"
except OSError as exc:
    found["write"] = exc.strerror
found["host_file_seen"] = os.path.exists(HOST_FILE)
print(json.dumps(found))
"""

_probed: dict[tuple[str, ...], None] = {}


@dataclass(frozen=True)
class RunResult:
    output: str
    returncode: int | None  # the supervisor's exit code; None when we killed it
    timed_out: bool = False
    output_capped: bool = False


def sandbox_prefix(unshare: str = "unshare") -> list[str]:
    """The command that puts a program into fresh user, mount, network, PID and IPC namespaces."""
    path = shutil.which(unshare)
    if path is None:
        raise ConfigError(
            "the python tool needs `unshare` (util-linux) to run code without network; it is not installed. "
            "posttrain does not run model code unsandboxed: install util-linux or leave out the python tool."
        )
    prefix = [path, "--user", "--map-root-user", "--mount", "--propagation=private", "--net", "--pid"]
    prefix += ["--ipc", "--fork", "--kill-child"]
    if os.geteuid() == 0 or os.getuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise ConfigError(
                "the python tool runs as root here, where RLIMIT_NPROC does not apply; it needs `setpriv` "
                "(util-linux) to run code with an unprivileged real uid. Install util-linux or run as a user."
            )
        prefix = [setpriv, f"--ruid={NOBODY_UID}", *prefix]
    return prefix


@functools.lru_cache(maxsize=8)
def filesystem_view(python: str) -> tuple[tuple[str, str, str], ...]:
    """What the sandbox's root holds besides its working directory, as (kind, value, path) entries for
    `sandbox_init.py`: ("bind", host path, path) read-only, ("symlink", target, path), ("file", text, path).

    The interpreter's prefixes (a venv and the installation it points to, wherever they are: /usr/local,
    ~/.pyenv, ...) are bound whole (the standard library, extension modules and site-packages); nothing
    else of the home directories, /tmp, /var, /etc, /proc, /sys or the repository is there."""
    script = (
        "import json, sys\n"
        "print(json.dumps([sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]))"
    )
    try:
        done = subprocess.run(
            [python, "-I", "-c", script], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
        )
        prefixes = [str(p) for p in json.loads(done.stdout)]
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"python tool: could not run the interpreter {python!r}: {exc}") from None
    entries: list[tuple[str, str, str]] = []
    bound: list[str] = []  # host paths visible at the same path inside
    linked: list[str] = []

    def under(path: str, tops: list[str]) -> bool:
        return any(path == top or path.startswith(top.rstrip("/") + "/") for top in tops)

    def bind(source: str, path: str) -> None:
        entries.append(("bind", source, path))
        if source == path:
            bound.append(path)

    for name in SYSTEM_DIRS:
        path = "/" + name
        if os.path.islink(path):
            entries.append(("symlink", os.readlink(path), path))
            linked.append(path)
        elif os.path.isdir(path):
            bind(path, path)
    for name in ETC_FILES:
        path = "/etc/" + name
        if os.path.islink(path):
            entries.append(("symlink", os.readlink(path), path))
        elif os.path.exists(path):
            bind(path, path)
    entries += [("file", PASSWD, "/etc/passwd"), ("file", GROUP, "/etc/group")]
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            bind("/dev/" + name, "/dev/" + name)
    entries.append(("symlink", WORKDIR, "/dev/shm"))  # POSIX shared memory and semaphores (multiprocessing)
    executable = os.path.abspath(python)
    for path in sorted({os.path.abspath(p) for p in prefixes}, key=len) + [executable]:
        real = os.path.realpath(path)
        if not under(real, bound) and any(
            under(os.path.realpath(private), [real])
            for private in ("/", os.path.expanduser("~"), os.getcwd())
        ):
            raise ConfigError(
                f"python tool: the interpreter {python!r} lives in {path}, which holds the home or the "
                "working directory; the sandbox would have to show them. Use an interpreter (or venv) "
                "installed elsewhere."
            )
        if not under(real, bound):
            bind(real, real)
        if path != real and not under(path, bound + linked):
            bind(real, path)
    return tuple(entries)


def host_namespaces() -> dict[str, str]:
    return {name: os.readlink(f"/proc/self/ns/{name}") for name in NAMESPACES}


class PythonSandboxTool(FunctionTool):
    """`python(code)`: runs the code in a fresh sandboxed process and returns what it printed."""

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        cpu_s: int | None = None,
        memory_mb: int = 512,
        max_output_bytes: int = 65536,
        max_file_mb: int = 16,
        workdir_mb: int = 16,
        max_processes: int = 16,
        nice: int = 10,
        python: str | None = None,
    ) -> None:
        checks = {"timeout_s": timeout_s, "memory_mb": memory_mb, "max_output_bytes": max_output_bytes}
        checks |= {"max_file_mb": max_file_mb, "workdir_mb": workdir_mb, "max_processes": max_processes}
        for key, value in checks.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"python tool: {key} must be a positive number, got {value!r}")
        if memory_mb < 64:
            raise ConfigError(
                f"python tool: memory_mb must be >= 64 (the interpreter needs it), got {memory_mb}"
            )
        self.timeout_s = float(timeout_s)
        self.cpu_s = int(cpu_s) if cpu_s is not None else max(1, math.ceil(timeout_s))
        self.memory_mb = int(memory_mb)
        self.max_output_bytes = int(max_output_bytes)
        self.max_file_mb = int(max_file_mb)
        self.workdir_mb = int(workdir_mb)
        self.max_processes = int(max_processes)
        self.nice = int(nice)
        self.python = shutil.which(python) or python if python else sys.executable
        self._prefix = sandbox_prefix()
        self._config = {
            "entries": filesystem_view(self.python),
            "workdir": WORKDIR,
            "workdir_bytes": self.workdir_mb << 20,
            "workdir_inodes": 4096,
            "host_namespaces": host_namespaces(),
        }
        self._running: set[asyncio.subprocess.Process] = set()
        description = (
            "Run Python 3 code in a fresh process and return what it prints (stdout and stderr). Each call "
            f"starts from scratch (no state is kept between calls); no network; at most {self.timeout_s:g} s "
            f"and {self.memory_mb} MB. Files can be written only in the working directory (at most "
            f"{self.workdir_mb} MB, gone after the call). Print the values you need."
        )
        super().__init__(self.python_tool, name="python", description=description)
        self._probe()

    def command(self) -> list[str]:
        mem_b, fsize_b = self.memory_mb << 20, self.max_file_mb << 20
        limits = [self.cpu_s, mem_b, fsize_b, self.max_processes + 1, self.nice]
        config = marshal.dumps({**self._config, "limits": limits}).hex()
        return [*self._prefix, self.python, "-I", "-u", "-c", SUPERVISOR, config]

    def environment(self) -> dict[str, str]:
        env = {"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": WORKDIR, "TMPDIR": WORKDIR}
        env |= {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
        return env

    def _probe(self) -> None:
        """Once per process and command: run the sandbox and check what the code sees (only a down loopback
        device, the expected root, no host file, nothing writable outside its directory). The supervisor
        itself refuses to run outside fresh namespaces."""
        key = tuple(self.command())
        if key in _probed:
            return
        with tempfile.TemporaryDirectory(prefix="posttrain-py-probe-") as workdir:
            host_file = os.path.join(workdir, "main.py")
            with open(host_file, "w", encoding="utf-8") as f:
                f.write(f"HOST_FILE = {host_file!r}\n{PROBE}")
            try:
                done = subprocess.run(
                    self.command(), cwd=workdir, env=self.environment(), stdin=subprocess.DEVNULL,
                    capture_output=True, text=True, timeout=30,
                )  # fmt: skip
                problem = (
                    "" if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[-500:]}"
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                done, problem = None, str(exc)
        if done is not None and not problem:
            problem = self._check_probe(done.stdout)
        if problem:
            raise ConfigError(
                "the python tool cannot isolate code from the network and the file system on this machine: "
                "running it in new user, mount, network, PID and IPC namespaces "
                f"(`{' '.join(self._prefix)}`) failed: {problem}. Enable unprivileged user namespaces (sysctl "
                "user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1, or the AppArmor/SELinux "
                "policy that blocks them) or leave out the python tool; posttrain does not fall back to "
                "running model code unisolated."
            )
        _probed[key] = None

    def _check_probe(self, stdout: str) -> str:
        """What is wrong with what the probe saw ("" when nothing)."""
        try:
            found = json.loads(stdout)
        except ValueError:
            found = None
        if not isinstance(found, dict) or set(found) != {"ifaces", "cwd", "root", "write", "host_file_seen"}:
            return f"unexpected probe output {stdout.strip()[-300:]!r}"
        expected_root = {path.split("/")[1] for _, _, path in self._config["entries"]}
        expected_root.add(WORKDIR.split("/")[1])
        if found["ifaces"] != ["lo"]:
            return f"the code still saw the host's network (devices {found['ifaces']})"
        if found["host_file_seen"] or not set(found["root"]) <= expected_root or found["cwd"] != WORKDIR:
            return (
                f"the code still saw the host's files (/ holds {sorted(found['root'])}, cwd {found['cwd']})"
            )
        if found["write"] == "written":
            return "the code could write to /"
        return ""

    async def python_tool(self, code: str) -> str:
        """Run Python code.

        Args:
            code: a complete Python program; use print() to show results
        """
        result = await self.run_code(code)
        text = format_result(result, self)
        if run_status(result, self):  # an error exit or a kill: the model sees the same text, the call failed
            raise ToolFailed(text, timed_out=result.timed_out)
        return text

    async def run_code(self, code: str) -> RunResult:
        """Runs `code` in the sandbox; the process is killed on timeout, output flood or cancellation."""
        workdir = tempfile.mkdtemp(prefix="posttrain-py-")
        proc: asyncio.subprocess.Process | None = None
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self.command(), cwd=workdir, env=self.environment(), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            except OSError as exc:
                raise ToolError(f"python: could not start the sandbox: {exc}") from None
            self._running.add(proc)
            output = bytearray()  # filled as it comes: what was printed before a timeout is kept
            try:
                capped = await asyncio.wait_for(self._collect(proc, output), self.timeout_s)
                timed_out = False
            except TimeoutError:
                _kill(proc)
                capped, timed_out = False, True
                if proc.stdout is not None:
                    output += await _drain(proc.stdout, self.max_output_bytes - len(output))
            text = bytes(output[: self.max_output_bytes]).decode("utf-8", errors="replace")
            returncode = None if timed_out or capped else proc.returncode
            return RunResult(text, returncode, timed_out=timed_out, output_capped=capped)
        finally:
            if proc is not None:
                if proc.returncode is None:
                    _kill(proc)
                    await proc.wait()
                self._running.discard(proc)
            shutil.rmtree(workdir, ignore_errors=True)

    async def _collect(self, proc: asyncio.subprocess.Process, output: bytearray) -> bool:
        """Reads the output into `output` until EOF (False) or past the cap (True, the process killed)."""
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(65536):
            output += chunk
            if len(output) > self.max_output_bytes:
                _kill(proc)
                await proc.wait()
                return True
        await proc.wait()
        return False

    async def close(self) -> None:
        """Kills the calls still running (their coroutines then return)."""
        for proc in list(self._running):
            _kill(proc)


async def _drain(stream: asyncio.StreamReader, max_bytes: int) -> bytes:
    """What is left in a killed process's pipe (bounded: the writers are dead, EOF comes at once)."""
    if max_bytes <= 0:
        return b""
    try:
        return (await asyncio.wait_for(stream.read(max_bytes), 1.0))[:max_bytes]
    except (TimeoutError, OSError):
        return b""


def _kill(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL to the process group (setpriv/unshare and the namespace's init: the rest dies with it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def format_result(result: RunResult, tool: PythonSandboxTool) -> str:
    """The output, and a last line saying why the run ended when it did not end normally."""
    output = result.output if result.output else "(no output)"
    status = run_status(result, tool)
    return output if not status else f"{output.rstrip()}\n[{status}]"


def run_status(result: RunResult, tool: PythonSandboxTool) -> str:
    if result.timed_out:
        return f"killed: ran longer than {tool.timeout_s:g} s"
    if result.output_capped:
        return f"killed: output exceeded {tool.max_output_bytes} bytes"
    code = result.returncode
    if code is None or code == 0:
        return ""
    if code == SETUP_FAILED and result.output.lstrip().startswith(SETUP_FAILED_TEXT):
        # the supervisor's own failure; a program that exits 120 itself is that program's exit status
        raise ToolError("python: the sandbox could not be set up: " + result.output.strip()[-300:])
    if code > 128 and code - 128 in signal.Signals._value2member_map_:
        sig = signal.Signals(code - 128)
        if sig == signal.SIGXCPU:
            return f"killed: CPU time limit of {tool.cpu_s} s exceeded"
        if sig == signal.SIGKILL:
            return f"killed (SIGKILL): CPU time limit of {tool.cpu_s} s exceeded or out of memory"
        return f"killed by {sig.name}"
    return f"exit status {code}"
