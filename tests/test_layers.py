"""The house rules of ARCHITECTURE.md, checked on the source: lower layers never import higher ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "posttrain"
# top to bottom; a module may import its own layer and the ones below it
ORDER = [
    "cli",
    "demo",
    "trainers",
    "serve",
    "agents",  # on client/'s SamplingClient (ARCHITECTURE.md); used by trainers/
    "client",
    "controller",
    "workers",
    "engine",
    "rollout",
    "rewards",
    "algorithms",
    "data",
    "models",
    "config",
    "tracking",
]
EXTRA_FORBIDDEN = {
    # engine and rollout know nothing of each other, of Ray or of the RL loop
    "engine": {"rollout"},
    "rollout": {"engine"},
}


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "posttrain" and len(parts) > 1 else None


@pytest.mark.parametrize("layer", [name for name in ORDER if (PACKAGE / name).is_dir()])
def test_layer_imports_only_downwards(layer: str) -> None:
    allowed = set(ORDER[ORDER.index(layer) :]) | {"errors"}
    for path in (PACKAGE / layer).rglob("*.py"):
        for module in imports(path):
            if module.split(".")[0] == "ray" and layer != "controller":
                pytest.fail(f"{path.relative_to(PACKAGE)} imports ray; only controller/ may")
            target = layer_of(module)
            if target is None or target in ("errors",):
                continue
            assert target in allowed, (
                f"{path.relative_to(PACKAGE)} imports posttrain.{target} (a higher layer)"
            )
            assert target not in EXTRA_FORBIDDEN.get(layer, set()), (
                f"{path.relative_to(PACKAGE)} imports {target}"
            )


def test_trainers_call_typed_verbs_never_strings() -> None:
    """A trainer reaches its workers through the role groups' methods (controller/roles.py), never through
    the generic `call("verb", ...)` dispatch, which stays inside controller/."""
    for path in (PACKAGE / "trainers").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "call"
            ):
                pytest.fail(f"{path.relative_to(PACKAGE)}:{node.lineno} calls a worker verb by name (.call)")
