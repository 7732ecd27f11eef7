"""Run code in a child process that can be given an address-space limit (RLIMIT_AS), so that an allocation
fails with the CPU allocator's error instead of the kernel's OOM killer taking the process (or the machine's
other jobs). The child calls `limit_address_space(room_mib)` once its imports and warm-up are done."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PREAMBLE = '''
import resource

def limit_address_space(room_mib):
    """Allow `room_mib` MiB more virtual memory than the process maps now."""
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + room_mib * 2**20, resource.RLIM_INFINITY))
'''

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's"
)


def run_limited(code: str, *args: str, timeout_s: float = 120) -> str:
    """The child's stdout; fails the test (with its stderr) if it exits non-zero."""
    root = Path(__file__).parents[1]  # the repository: `tests` importable from the child
    proc = subprocess.run(
        [sys.executable, "-c", PREAMBLE + code, *args], cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
