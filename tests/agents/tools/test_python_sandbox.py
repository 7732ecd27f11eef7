"""The python tool's sandbox: each limit stopped and reported (wall time, CPU, output, memory, processes,
file size, disk), no network by a namespace (the tool refuses to start without one), nothing outliving a
call; the file system: host files neither readable nor writable, the view read-only (the code cannot undo
it), only the working directory writable, the interpreter and its standard library working."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from posttrain.agents.tools import PythonSandboxTool, ToolCall, ToolRunner, python_sandbox
from posttrain.agents.tools.base import ToolFailed
from posttrain.errors import ConfigError

from .sandbox_probe import needs_sandbox

pytestmark = needs_sandbox

REPO = Path(__file__).resolve().parents[3]


def run(tool: PythonSandboxTool, code: str) -> str:
    """What the model sees of a call: the program's output, and how it ended when not normally (a failed
    call raises ToolFailed carrying that text)."""
    try:
        return asyncio.run(tool.call({"code": code}, {}))
    except ToolFailed as failed:
        return failed.text


def alive(marker: str) -> list[int]:
    """Pids of live processes whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.fixture(scope="module")
def tool() -> PythonSandboxTool:
    return PythonSandboxTool(timeout_s=5, memory_mb=256, max_output_bytes=20_000, max_processes=8)


def test_runs_code_and_returns_what_it_printed(tool: PythonSandboxTool) -> None:
    assert run(tool, "print(sum(range(10)))\nimport sys\nprint('warn', file=sys.stderr)") == "45\nwarn\n"
    assert run(tool, "x = 1") == "(no output)"


def test_the_codes_errors_are_its_output(tool: PythonSandboxTool) -> None:
    out = run(tool, "print('before')\n1 / 0")
    assert out.startswith("before\nTraceback (most recent call last):")
    assert 'File "main.py", line 2' in out and "ZeroDivisionError: division by zero" in out
    assert out.endswith("[exit status 1]")
    assert run(tool, "import sys; sys.exit(3)").endswith("[exit status 3]")
    # the supervisor's setup-failure status, exited by the program itself: still the program's exit status
    assert run(tool, "import sys; sys.exit(120)").endswith("[exit status 120]")
    assert "SyntaxError" in run(tool, "def (:")
    # through the runner the model sees the same text, and the call counts as failed (no tool-use bonus for
    # code that crashes, tool_errors counts it); the program printing is a success
    out = asyncio.run(ToolRunner([tool]).run(ToolCall("python", {"code": "raise ValueError('bad')"})))
    assert not out.ok and not out.timed_out and "ValueError: bad" in out.text
    assert out.text.endswith("[exit status 1]") and not out.text.startswith("Error:")
    assert asyncio.run(ToolRunner([tool]).run(ToolCall("python", {"code": "print(1)"}))).ok


def test_each_call_is_a_fresh_process_in_a_fresh_directory(tool: PythonSandboxTool) -> None:
    code = "import os\nprint(os.getcwd(), sorted(os.listdir()))\nopen('note.txt', 'w').write('x')"
    first, second = run(tool, code), run(tool, code)
    assert "['main.py']" in first and "['main.py']" in second  # the file written by the first call is gone
    assert first.split()[0] == second.split()[0] == python_sandbox.WORKDIR == "/sandbox"


def test_no_network_not_even_to_a_server_on_this_hosts_loopback(tool: PythonSandboxTool) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        out = run(
            tool,
            f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))\nprint('connected')",
        )
    finally:
        server.close()
    assert "connected" not in out and "Network is unreachable" in out
    out = run(tool, "import socket\nprint(socket.getaddrinfo('example.com', 80))")
    assert "gaierror" in out


def test_no_environment_is_inherited(tool: PythonSandboxTool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "hunter2")
    out = run(tool, "import os\nprint(sorted(os.environ))")
    assert "POSTTRAIN_TEST_SECRET" not in out and "'PATH'" in out


def test_wall_clock_timeout_kills_a_sleeping_program() -> None:
    tool = PythonSandboxTool(timeout_s=0.5)
    start = time.monotonic()
    out = run(tool, "print('started', flush=True)\nimport time\ntime.sleep(60)")
    assert time.monotonic() - start < 4.0  # the program sleeps 60 s: killed long before
    assert out == "started\n[killed: ran longer than 0.5 s]"
    answer = asyncio.run(ToolRunner([tool]).run(ToolCall("python", {"code": "import time; time.sleep(60)"})))
    assert not answer.ok and answer.timed_out  # agent.end_on_tool_timeout sees the sandbox's own limit too


def test_infinite_loop_is_stopped_by_the_cpu_limit() -> None:
    tool = PythonSandboxTool(timeout_s=10, cpu_s=1)
    start = time.monotonic()
    out = run(tool, "while True:\n    pass")
    assert time.monotonic() - start < 9.0  # before the 10 s wall clock (1 s of CPU can take long under load)
    assert out == "(no output)\n[killed: CPU time limit of 1 s exceeded]"


def test_huge_output_is_capped_and_the_process_killed() -> None:
    tool = PythonSandboxTool(timeout_s=10, max_output_bytes=10_000)
    start = time.monotonic()
    out = run(tool, "while True:\n    print('x' * 1000)")
    assert time.monotonic() - start < 9.0  # killed at the cap, not at the 10 s timeout
    assert out.endswith("[killed: output exceeded 10000 bytes]")
    assert out.count("x") <= 10_000
    runner = ToolRunner([tool], max_response_chars=300, truncate_side="middle")
    answer = asyncio.run(runner.run(ToolCall("python", {"code": "print('y' * 50_000)"})))
    assert not answer.ok and answer.truncated and len(answer.text) <= 300
    assert answer.text.endswith("[killed: output exceeded 10000 bytes]")


def test_memory_bomb_gets_a_memory_error(tool: PythonSandboxTool) -> None:
    out = run(tool, "blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))")
    assert "MemoryError" in out and out.endswith("[exit status 1]")
    out = run(tool, "x = bytearray(1 << 34)")
    assert "MemoryError" in out


def test_fork_bomb_is_bounded_and_nothing_outlives_the_call(tool: PythonSandboxTool) -> None:
    marker = f"31.{os.getpid()}"
    code = (
        "import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        f"            os.execv('/bin/sleep', ['sleep', '{marker}'])\n        n += 1\n"
        "except OSError as exc:\n    print('forks', n, type(exc).__name__)"
    )
    start = time.monotonic()
    out = run(tool, code)
    assert time.monotonic() - start < 4.0  # the program sleeps 60 s: killed long before
    forks = int(out.split()[1])
    assert 1 <= forks <= tool.max_processes and "BlockingIOError" in out, out
    time.sleep(0.1)
    assert alive(marker) == []  # the sleeping children died with the namespace


def test_file_size_limit() -> None:
    tool = PythonSandboxTool(max_file_mb=1)
    out = run(tool, "open('big', 'wb').write(b'0' * (2 << 20))")
    assert "File too large" in out


def test_runner_timeout_kills_the_process(tool: PythonSandboxTool) -> None:
    marker = f"27.{os.getpid()}"
    runner = ToolRunner([PythonSandboxTool(timeout_s=30)], timeout_s=0.5)
    code = f"import os\nos.execv('/bin/sleep', ['sleep', '{marker}'])"
    start = time.monotonic()
    out = asyncio.run(runner.run(ToolCall("python", {"code": code})))
    assert out.timed_out and time.monotonic() - start < 4.0
    time.sleep(0.1)
    assert alive(marker) == []


def test_refuses_to_start_without_a_network_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    # a "sandbox" that does not isolate: the probe sees the host's network and the tool refuses
    monkeypatch.setattr(python_sandbox, "sandbox_prefix", lambda: ["/usr/bin/env"])
    with pytest.raises(ConfigError, match="cannot isolate code from the network.*does not fall back"):
        PythonSandboxTool()
    monkeypatch.setattr(python_sandbox, "sandbox_prefix", lambda: ["/bin/false"])
    with pytest.raises(ConfigError, match="failed: exit 1"):
        PythonSandboxTool()


def test_refuses_to_start_without_unshare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(python_sandbox.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="needs `unshare`"):
        PythonSandboxTool()


@pytest.fixture
def canaries(tmp_path: Path):
    """A secret in the repository and a file in /tmp, both readable and writable by this process."""
    secret = f"secret-{os.getpid()}-{time.time_ns()}"
    paths = [REPO / f".sandbox-canary-{os.getpid()}", tmp_path / "canary.txt"]
    for path in paths:
        path.write_text(secret)
    yield secret, paths
    for path in paths:
        path.unlink(missing_ok=True)


def test_host_files_cannot_be_read(tool: PythonSandboxTool, canaries: tuple[str, list[Path]]) -> None:
    secret, paths = canaries
    dotfiles = [p for p in (Path("/root/.bashrc"), Path.home() / ".bashrc") if os.access(p, os.R_OK)][:1]
    home = str(dotfiles[0].parent) if dotfiles else str(Path.home())
    targets = [str(p) for p in [*paths, *dotfiles, REPO / "README.md", python_sandbox.__file__]]
    hidden = ["/proc/self", "/sys", "/tmp", "/var", "/home", "/etc/ssh", "/etc/hostname", f"{REPO}/.git"]
    # a directory holding the interpreter (a clone in /tmp with its venv) is shown as the path to it, no more
    prefixes = (sys.prefix, sys.base_prefix)
    hidden = [h for h in hidden if not any(p.startswith(h + "/") for p in prefixes)]
    code = f"""import json, os
read = {{}}
for path in {targets!r}:
    try:
        read[path] = open(path).read()
    except OSError as exc:
        read[path] = type(exc).__name__
seen = [path for path in {hidden!r} if os.path.exists(path)]
home = os.listdir({home!r}) if os.path.isdir({home!r}) else []
print(json.dumps([read, sorted(os.listdir("/")), home, seen]))"""
    out = run(tool, code)
    assert secret not in out
    read, root, home_listing, seen = json.loads(out)
    assert read == {path: "FileNotFoundError" for path in targets}
    # / holds the system's directories and the interpreter's (here /root for ~/.pyenv and /work for the venv),
    # and a home directory only what the interpreter needs (here .pyenv)
    interpreter = {Path(p).parts[1] for p in (sys.prefix, sys.base_prefix)}
    system = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "sbin", "usr", "sandbox"}
    assert set(root) <= system | interpreter
    assert set(home_listing) <= {
        Path(p).relative_to(home).parts[0] for p in (sys.prefix, sys.base_prefix) if p.startswith(home + "/")
    }
    assert seen == []


def test_host_files_cannot_be_written(tool: PythonSandboxTool, canaries: tuple[str, list[Path]]) -> None:
    secret, paths = canaries
    new = [
        REPO / f".sandbox-new-{os.getpid()}",
        paths[1].parent / "new.txt",
        Path(f"/tmp/sbx-new-{os.getpid()}"),
    ]
    read_only = ["/etc/passwd", "/usr/bin/sandbox-new", f"{sys.base_prefix}/sandbox-new", "/"]
    code = f"""import os
for path in {[str(p) for p in [*paths, *new]] + read_only!r}:
    try:
        open(path, "w").write("pwned") if path != "/" else os.mkdir("/x")
        print("written")
    except OSError as exc:
        print(exc.strerror)"""
    try:
        out = run(tool, code).splitlines()
        # host paths are not there (creating one hits the read-only root); what is shown is read-only
        assert set(out[:5]) <= {"No such file or directory", "Read-only file system"}, out
        assert out[5:] == ["Read-only file system"] * 4
        assert all(path.read_text() == secret for path in paths)
        assert not any(path.exists() for path in new)
        assert "pwned" not in Path("/etc/passwd").read_text()
    finally:
        for path in new:
            path.unlink(missing_ok=True)


def test_etc_passwd_is_synthetic_and_read_only(tool: PythonSandboxTool) -> None:
    out = run(
        tool,
        "import os, pwd\nprint(open('/etc/passwd').read().strip())\nprint(pwd.getpwuid(os.getuid()).pw_name)",
    )
    assert out.splitlines() == ["nobody:x:65534:65534:nobody:/sandbox:/usr/sbin/nologin", "nobody"]


def test_the_code_cannot_undo_the_mounts(tool: PythonSandboxTool) -> None:
    code = (
        "import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "def err(r):\n    return 'done' if r == 0 else errno.errorcode[ctypes.get_errno()]\n"
        # MS_REMOUNT | MS_BIND without MS_RDONLY: writable again
        "print(err(libc.mount(None, b'/', None, 32 | 4096, None)))\n"
        "print(err(libc.mount(None, b'/usr', None, 32 | 4096, None)))\n"
        "print(err(libc.umount2(b'/usr', 2)))\n"
        "print(err(libc.mount(b'proc', b'/sandbox', b'proc', 0, None)))\n"
        "print(err(libc.unshare(0x10000000 | 0x20000)))\n"  # a user + mount namespace of its own
    )
    assert run(tool, code).split() == ["EPERM"] * 5


def test_working_directory_is_writable_and_capped() -> None:
    tool = PythonSandboxTool(workdir_mb=2, max_file_mb=16)
    code = (
        "import os, tempfile\nos.makedirs('d/e')\nopen('d/e/f', 'w').write('hello')\n"
        "print(open('d/e/f').read())\n"
        "print(tempfile.gettempdir(), os.path.expanduser('~'))\n"
        "n, fd = 0, os.open('big', os.O_WRONLY | os.O_CREAT)\ntry:\n    while True:\n"
        "        n += os.write(fd, b'0' * 65536)\nexcept OSError as exc:\n    print(exc.strerror, n)\n"
    )
    out = run(tool, code).splitlines()
    assert out[:2] == ["hello", "/sandbox /sandbox"]
    error, written = out[2].rsplit(" ", 1)
    assert error == "No space left on device" and 1 << 20 < int(written) <= 2 << 20


def test_interpreter_standard_library_and_subprocesses_work(tool: PythonSandboxTool) -> None:
    code = (
        "import collections, json, math, re, subprocess, sys\n"
        "print(json.dumps(collections.Counter('aab')), math.isqrt(17), re.findall(r'\\d+', 'a1b22'))\n"
        "print(subprocess.run([sys.executable, '-c', 'import math; print(math.pi)'], capture_output=True, "
        "text=True).stdout.strip())\n"
        "print(subprocess.run('echo shell', shell=True, capture_output=True, text=True).stdout.strip())"
    )
    assert run(tool, code).splitlines() == [
        "{\"a\": 2, \"b\": 1} 4 ['1', '22']",
        "3.141592653589793",
        "shell",
    ]


def test_refuses_to_start_without_a_mount_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    # user+net+pid namespaces but the host's mount namespace: the supervisor refuses to mount anything
    prefix = [a for a in python_sandbox.sandbox_prefix() if a not in ("--mount", "--propagation=private")]
    monkeypatch.setattr(python_sandbox, "sandbox_prefix", lambda: prefix)
    with pytest.raises(ConfigError, match="still in the host's mnt namespace.*does not fall back"):
        PythonSandboxTool()


def test_read_only_without_mount_setattr(monkeypatch: pytest.MonkeyPatch) -> None:
    # kernels before 5.12 have no mount_setattr (ENOSYS): each mount is remounted read-only instead
    supervisor = python_sandbox.SUPERVISOR.replace("SYS_MOUNT_SETATTR = 442", "SYS_MOUNT_SETATTR = 100000")
    assert supervisor != python_sandbox.SUPERVISOR
    monkeypatch.setattr(python_sandbox, "SUPERVISOR", supervisor)
    tool = PythonSandboxTool()
    code = f"""for path in ["/etc/passwd", "/usr/bin/sandbox-new", {sys.base_prefix + "/sandbox-new"!r}, "/new"]:
    try:
        open(path, "w").write("pwned")
    except OSError as exc:
        print(exc.strerror)
open("ok", "w").write("ok")
print(open("ok").read())"""
    assert run(tool, code).splitlines() == ["Read-only file system"] * 4 + ["ok"]


def test_refuses_to_start_when_the_probe_sees_host_files(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {"ifaces": ["lo"], "cwd": "/sandbox", "root": ["usr", "home"], "write": "Read-only file system"}
    monkeypatch.setattr(python_sandbox, "_probed", {})  # probed once per command: probe again
    monkeypatch.setattr(python_sandbox, "PROBE", f"print({json.dumps({**seen, 'host_file_seen': False})!r})")
    with pytest.raises(ConfigError, match=r"still saw the host's files \(/ holds \['home', 'usr'\]"):
        PythonSandboxTool()
