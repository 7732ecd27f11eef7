"""run_info.json: the resolved config, the posttrain version and git commit, and package versions."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import subprocess
from pathlib import Path

import torch

from posttrain.tracking import Tracker
from posttrain.tracking.run_info import KEY_PACKAGES, flatten, git_info, package_version

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Section:
    lr: float = 1e-6
    files: tuple[str, ...] = ("a.parquet",)
    path: Path = Path("/models/m")


def test_run_info_records_config_versions_and_commit(tmp_path: Path) -> None:
    with Tracker(["jsonl"], tmp_path, config={"actor": Section()}):
        pass
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["config"] == {"actor": {"lr": 1e-6, "files": ["a.parquet"], "path": "/models/m"}}
    assert info["posttrain_version"] == importlib.metadata.version("posttrain")
    assert set(KEY_PACKAGES) <= set(info["packages"])
    assert info["packages"]["torch"] == torch.__version__
    assert info["packages"]["transformers"] == importlib.metadata.version("transformers")
    assert info["packages"]["ray"] and info["packages"]["peft"]
    for name, version in info["packages"].items():  # one not installed (vllm on CPU) is null
        assert version == package_version(name)
    assert info["loggers"] == ["jsonl"] and info["started_at"] and info["python"]
    if (REPO / ".git").exists():  # an editable install in a checkout (this repository, CI's clone)
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
        assert info["git"]["commit"] == head.stdout.strip()
        assert isinstance(info["git"]["dirty"], bool)
    else:
        assert info["git"] is None


def test_git_info_outside_a_checkout_is_none(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr("posttrain.tracking.run_info._SOURCE_ROOT", tmp_path)
    assert git_info() is None


def test_no_config_no_run_info(tmp_path: Path) -> None:
    with Tracker(["jsonl"], tmp_path):
        pass
    assert not (tmp_path / "run_info.json").exists()


def test_flatten() -> None:
    tree = {"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}, "f": None}
    assert dict(flatten(tree)) == {"a.b": 1, "a.c.d": [1, 2], "e": {}, "f": None}
