"""The `python` tool: the model's code run in a fresh, limited process with no network.

Each call writes the code to a temporary directory and runs it there as

    [setpriv --ruid 65534]  unshare --user --map-root-user --net --pid --fork --kill-child  python -I -u -c SUPERVISOR

- **No network**: a new network namespace has only a loopback device, and it is down, so every connect
  fails (even to 127.0.0.1). It is the kernel that refuses, not a patched `socket` module. The tool probes
  this once per process when it is built and refuses to start (ConfigError) where user namespaces are not
  available; there is no unsandboxed fallback.
- **Processes**: a new PID namespace whose init is a small supervisor (not the model's code, which would
  then ignore default signals as an init does); when the supervisor exits every process left in the
  namespace is killed, so nothing outlives a call. On a timeout or an output flood the whole process group
  is killed (SIGKILL). `RLIMIT_NPROC` bounds fork bombs: the kernel counts it per user per user namespace,
  but never enforces it on real uid 0, so when posttrain runs as root the real uid (not the effective one,
  which keeps file access) is set to `nobody` with `setpriv` first.
- **Limits** (set in the child before the code runs): CPU seconds (`RLIMIT_CPU`, SIGXCPU then SIGKILL),
  address space (`RLIMIT_AS`: allocation fails with MemoryError), file size (`RLIMIT_FSIZE`, writes fail
  with EFBIG), processes (`RLIMIT_NPROC`), no core dumps; a wall-clock timeout; an output cap (the process
  is killed once stdout+stderr exceed it); the code runs at `nice` 10 so that generation wins a contended
  core (see `runner.py` on sharing the 2 cores). Keep the runner's `timeout_s` above this tool's, so that
  the model reads "killed: ran longer than ..." with the output so far rather than the runner's timeout
  (which also kills the process: a cancelled call never leaves it running).
- **Environment**: `-I` (no user site, no PYTHON* variables), a minimal environment (no secrets inherited),
  the temporary directory as working directory and HOME, removed afterwards, stdin empty, one thread for
  BLAS/OpenMP.

Not isolated: the file system. The code runs with the user's file permissions outside its directory (a
mount namespace with read-only binds, as bubblewrap does, would be the next step). The code's own errors
(a traceback, a non-zero exit, a limit reached) are its output, returned normally; only a sandbox failure is
a ToolError.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from posttrain.agents.tools.base import FunctionTool, ToolError
from posttrain.errors import ConfigError

NOBODY_UID = 65534
SETUP_FAILED = 120  # the supervisor's exit code when the limits could not be set

# pid 1 of the namespace: forks the child that sets the limits and runs main.py, and exits with its status
# (128 + signal when it was killed); its exit takes everything else in the namespace with it.
SUPERVISOR = r"""
import os, resource, signal, sys, traceback
cpu_s, mem_b, fsize_b, nproc, nice = (int(a) for a in sys.argv[1:6])
pid = os.fork()
if pid == 0:
    try:
        os.nice(nice)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_b, fsize_b))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_AS, (mem_b, mem_b))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        with open("main.py", encoding="utf-8") as f:
            source = f.read()
        sys.argv = ["main.py"]
    except BaseException as exc:
        os.write(2, f"sandbox setup failed: {exc!r}\n".encode())
        os._exit(120)
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
_, status = os.waitpid(pid, 0)
os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""

PROBE = (
    "import os, socket\nprint(os.readlink('/proc/self/ns/net'), sorted(n for _, n in socket.if_nameindex()))"
)

_probed: dict[tuple[str, ...], None] = {}


@dataclass(frozen=True)
class RunResult:
    output: str
    returncode: int | None  # the supervisor's exit code; None when we killed it
    timed_out: bool = False
    output_capped: bool = False


def sandbox_prefix(unshare: str = "unshare") -> list[str]:
    """The command that puts a program into fresh user, network and PID namespaces."""
    path = shutil.which(unshare)
    if path is None:
        raise ConfigError(
            "the python tool needs `unshare` (util-linux) to run code without network; it is not installed. "
            "posttrain does not run model code unsandboxed: install util-linux or leave out the python tool."
        )
    prefix = [path, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"]
    if os.geteuid() == 0 or os.getuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise ConfigError(
                "the python tool runs as root here, where RLIMIT_NPROC does not apply; it needs `setpriv` "
                "(util-linux) to run code with an unprivileged real uid. Install util-linux or run as a user."
            )
        prefix = [setpriv, f"--ruid={NOBODY_UID}", *prefix]
    return prefix


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
        max_processes: int = 16,
        nice: int = 10,
        python: str | None = None,
    ) -> None:
        checks = {"timeout_s": timeout_s, "memory_mb": memory_mb, "max_output_bytes": max_output_bytes}
        checks |= {"max_file_mb": max_file_mb, "max_processes": max_processes}
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
        self.max_processes = int(max_processes)
        self.nice = int(nice)
        self.python = python or sys.executable
        self._prefix = sandbox_prefix()
        self._running: set[asyncio.subprocess.Process] = set()
        description = (
            "Run Python 3 code in a fresh process and return what it prints (stdout and stderr). Each call "
            f"starts from scratch (no state is kept between calls); no network; at most {self.timeout_s:g} s "
            f"and {self.memory_mb} MB. Print the values you need."
        )
        super().__init__(self.python_tool, name="python", description=description)
        self._probe()

    def command(self) -> list[str]:
        mem_b, fsize_b = self.memory_mb << 20, self.max_file_mb << 20
        limits = [str(v) for v in (self.cpu_s, mem_b, fsize_b, self.max_processes + 1, self.nice)]
        return [*self._prefix, self.python, "-I", "-u", "-c", SUPERVISOR, *limits]

    def environment(self, workdir: str) -> dict[str, str]:
        env = {"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        env |= {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
        return env

    def _probe(self) -> None:
        """Once per process and command: run the sandbox and check that it is in its own network namespace."""
        key = tuple(self.command())
        if key in _probed:
            return
        with tempfile.TemporaryDirectory(prefix="posttrain-py-probe-") as workdir:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(PROBE)
            try:
                done = subprocess.run(
                    self.command(), cwd=workdir, env=self.environment(workdir), stdin=subprocess.DEVNULL,
                    capture_output=True, text=True, timeout=30,
                )  # fmt: skip
                problem = (
                    "" if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[-500:]}"
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                done, problem = None, str(exc)
        ours = os.readlink("/proc/self/ns/net")
        if done is not None and not problem:
            fields = done.stdout.split(maxsplit=1)
            if len(fields) != 2 or fields[0] == ours or fields[1].strip() != "['lo']":
                problem = f"the code still saw the host's network ({done.stdout.strip()!r})"
        if problem:
            raise ConfigError(
                "the python tool cannot isolate code from the network on this machine: running it in a new "
                f"user+network namespace (`{' '.join(self._prefix)}`) failed: {problem}. Enable unprivileged "
                "user namespaces (sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1, or "
                "the AppArmor/SELinux policy that blocks them) or leave out the python tool; posttrain does not "
                "fall back to running model code with network access."
            )
        _probed[key] = None

    async def python_tool(self, code: str) -> str:
        """Run Python code.

        Args:
            code: a complete Python program; use print() to show results
        """
        result = await self.run_code(code)
        return format_result(result, self)

    async def run_code(self, code: str) -> RunResult:
        """Runs `code` in the sandbox; the process is killed on timeout, output flood or cancellation."""
        workdir = tempfile.mkdtemp(prefix="posttrain-py-")
        proc: asyncio.subprocess.Process | None = None
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self.command(), cwd=workdir, env=self.environment(workdir), stdin=subprocess.DEVNULL,
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
    if code == SETUP_FAILED:
        raise ToolError("python: the sandbox could not set its limits: " + result.output.strip()[-300:])
    if code > 128 and code - 128 in signal.Signals._value2member_map_:
        sig = signal.Signals(code - 128)
        if sig == signal.SIGXCPU:
            return f"killed: CPU time limit of {tool.cpu_s} s exceeded"
        if sig == signal.SIGKILL:
            return f"killed (SIGKILL): CPU time limit of {tool.cpu_s} s exceeded or out of memory"
        return f"killed by {sig.name}"
    return f"exit status {code}"
