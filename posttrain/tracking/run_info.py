"""What a run records about itself: its resolved config, the posttrain version and git commit, package versions.

`collect_run_info` gives the `<run dir>/run_info.json` document the Tracker writes at the start of every run
(and passes to W&B's run config and MLflow's params). Package versions come from the installed distributions'
metadata (`importlib.metadata`), so nothing is imported to read them. The git commit is the one of the
checkout posttrain itself is imported from, when it is one (an editable install); a wheel install has none.
Must not import anything from posttrain except errors (tracking is the bottom layer).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import platform
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

RUN_INFO_FILE = "run_info.json"

# the distributions whose versions decide what a run does; one not installed is recorded as null
KEY_PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "tensordict",
    "ray",
    "peft",
    "accelerate",
    "datasets",
    "vllm",
    "sglang",
    "flash-attn",
    "liger-kernel",
    "numpy",
    "safetensors",
    "tinker",
    "wandb",
    "mlflow-skinny",
    "mlflow",
    "matplotlib",
)

_SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the posttrain package


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(_SOURCE_ROOT), *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_info() -> dict[str, Any] | None:
    """{commit, dirty (tracked files changed since it), root} of posttrain's own checkout; None outside one.

    Only a checkout whose root holds the posttrain package counts: an install inside some other repository
    (a virtualenv in a project's folder) does not report that project's commit as posttrain's."""
    if not (_SOURCE_ROOT / ".git").exists():
        return None
    commit = _git("rev-parse", "HEAD")
    if not commit:
        return None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": commit,
        "dirty": bool(status) if status is not None else None,
        "root": str(_SOURCE_ROOT),
    }


def to_plain(config: Any) -> Any:
    """A config (mapping or dataclass) as JSON-able data: dataclasses as dicts, tuples as lists, other
    non-JSON values (paths, enums) as strings."""
    return json.loads(json.dumps(config, default=_json_default))


def _json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


def collect_run_info(config: Any = None, backends: tuple[str, ...] = ()) -> dict[str, Any]:
    """The run_info.json document: versions, commit, platform, command line, start time and the config."""
    import torch  # already imported by every trainer; its CUDA build is part of what a run ran on

    return {
        "posttrain_version": package_version("posttrain"),
        "git": git_info(),
        "packages": {name: package_version(name) for name in KEY_PACKAGES},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_cuda": torch.version.cuda,
        "argv": list(sys.argv),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "loggers": list(backends),
        "config": to_plain(config) if config is not None else None,
    }


def flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Dotted keys of a nested mapping: {"a": {"b": 1}} -> ("a.b", 1). Lists stay values."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from flatten(value, f"{name}.")
        else:
            yield name, value
