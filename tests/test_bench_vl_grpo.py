"""bench/vl_grpo.py records the code commit it ran on (`common.code_commit()`), in its JSON and in each seed's
figures, as the other benches do. The training is replaced by fakes: the bench itself is not run here."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def vl_grpo(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.syspath_prepend(str(BENCH))  # the benches import their `common` module by name
    yield importlib.import_module("vl_grpo")
    for name in ("vl_grpo", "common"):  # bench modules are not packages: leave no such names behind
        sys.modules.pop(name, None)


def test_the_json_records_the_code_commit(vl_grpo: ModuleType, monkeypatch, tmp_path: Path) -> None:
    written: dict[str, Any] = {}

    def fake_grpo(model, files, run_dir: Path, seed: int, steps: int, args) -> list[dict]:  # noqa: ANN001
        run_dir.mkdir(parents=True, exist_ok=True)
        step = {"step": 1, "reward/mean": 0.5, "rollout/logprob_diff_max": 1e-6, "timing/step": 1.0}
        return [{"step": 0, "val/acc": 0.25}, step, {"step": 1, "val/acc": 0.75}]

    def fake_write(filename: str, result: dict) -> Path:
        written[filename] = json.loads(json.dumps(result))
        return tmp_path / filename

    monkeypatch.setattr(vl_grpo, "code_commit", lambda: "abc1234")
    monkeypatch.setattr(vl_grpo, "write_shapes_dataset", lambda *a, **k: None)
    monkeypatch.setattr(vl_grpo, "warm_start", lambda *a, **k: tmp_path / "model")
    monkeypatch.setattr(vl_grpo, "grpo", fake_grpo)
    monkeypatch.setattr(vl_grpo, "write_result", fake_write)
    monkeypatch.setattr(vl_grpo, "plot", lambda *a, **k: None)
    monkeypatch.setattr(sys, "argv", ["vl_grpo.py", "--seeds", "2", "--work", str(tmp_path / "work")])
    vl_grpo.main()
    result = written["vl_grpo_count.json"]
    assert result["code"] == "abc1234"
    assert [run["code"] for run in result["runs"]] == ["abc1234", "abc1234"]
    assert result["rows"][0]["value"] == 0.75 and result["rows"][0]["baseline_value"] == 0.25
