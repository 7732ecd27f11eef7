"""Whether this machine can run the python tool's sandbox (unprivileged user, mount and network namespaces).

Docker's default seccomp profile and Ubuntu >= 23.10 for non-root users block them; there the tool refuses
to start (rightly), and the tests that need a working sandbox are skipped with its reason, unless
POSTTRAIN_REQUIRE_SANDBOX=1 (CI sets it: there a refusal is a failure)."""

from __future__ import annotations

import os

import pytest

from posttrain.agents.tools import PythonSandboxTool
from posttrain.errors import ConfigError


def _refusal() -> str | None:
    try:
        PythonSandboxTool()
    except ConfigError as exc:
        return str(exc)
    return None


REFUSAL = _refusal()
needs_sandbox = pytest.mark.skipif(
    REFUSAL is not None and os.environ.get("POSTTRAIN_REQUIRE_SANDBOX") != "1",
    reason=f"no sandbox on this machine: {REFUSAL}",
)
