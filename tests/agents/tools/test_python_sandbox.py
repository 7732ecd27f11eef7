"""The python tool's sandbox: each limit stopped and reported (wall time, CPU, output, memory, processes,
file size), no network by a namespace (the tool refuses to start without one), nothing outliving a call."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest

from posttrain.agents.tools import PythonSandboxTool, ToolCall, ToolRunner, python_sandbox
from posttrain.errors import ConfigError


def run(tool: PythonSandboxTool, code: str) -> str:
    return asyncio.run(tool.call({"code": code}, {}))


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
    assert "SyntaxError" in run(tool, "def (:")
    # through the runner the call itself succeeded: the model's code failing is not a tool error
    out = asyncio.run(ToolRunner([tool]).run(ToolCall("python", {"code": "raise ValueError('bad')"})))
    assert out.ok and "ValueError: bad" in out.text


def test_each_call_is_a_fresh_process_in_a_fresh_directory(tool: PythonSandboxTool) -> None:
    code = "import os\nprint(os.getcwd(), sorted(os.listdir()))\nopen('note.txt', 'w').write('x')"
    first, second = run(tool, code), run(tool, code)
    assert "['main.py']" in first and "['main.py']" in second  # the file written by the first call is gone
    workdir = first.split()[0]
    assert not Path(workdir).exists()


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
    assert time.monotonic() - start < 2.0
    assert out == "started\n[killed: ran longer than 0.5 s]"


def test_infinite_loop_is_stopped_by_the_cpu_limit() -> None:
    tool = PythonSandboxTool(timeout_s=10, cpu_s=1)
    start = time.monotonic()
    out = run(tool, "while True:\n    pass")
    assert time.monotonic() - start < 3.0
    assert out == "(no output)\n[killed: CPU time limit of 1 s exceeded]"


def test_huge_output_is_capped_and_the_process_killed() -> None:
    tool = PythonSandboxTool(timeout_s=10, max_output_bytes=10_000)
    start = time.monotonic()
    out = run(tool, "while True:\n    print('x' * 1000)")
    assert time.monotonic() - start < 2.0  # killed at the cap, not at the timeout
    assert out.endswith("[killed: output exceeded 10000 bytes]")
    assert out.count("x") <= 10_000
    runner = ToolRunner([tool], max_response_chars=300, truncate_side="middle")
    answer = asyncio.run(runner.run(ToolCall("python", {"code": "print('y' * 50_000)"})))
    assert answer.ok and answer.truncated and len(answer.text) <= 300
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
    assert time.monotonic() - start < 2.0
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
    assert out.timed_out and time.monotonic() - start < 2.0
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
