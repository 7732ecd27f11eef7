"""W&B (offline) and MLflow (local sqlite store) backends, read back through the run files and mlflow's client.

Each test needs its optional package (`pip install 'posttrain[wandb]'` / `'posttrain[mlflow]'`, which
scripts/setup.sh installs) and is skipped without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from posttrain.errors import ConfigError
from posttrain.tracking import Tracker
from posttrain.tracking.external import mlflow_name

CONFIG = {"trainer": {"run_dir": "runs/x", "loggers": ["jsonl", "wandb"]}, "actor": {"optim": {"lr": 1e-6}}}


def read_wandb_records(run_file: Path) -> list[Any]:
    """Every record of an offline run's `run-<id>.wandb` file (wandb's LevelDB-style log of protobufs:
    a 7-byte file header, then 32 KiB blocks of records, each with a 7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # zero padding up to the block's end
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST piece of a split one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.fixture(scope="module")
def empty_mlflow_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow store with its tables made, through the backend's own URI (mlflow's migrations take
    seconds: made once here, copied into each test's run directory)."""
    pytest.importorskip("mlflow")
    from posttrain.tracking.external import disable_mlflow_telemetry, mlflow_tracking_uri

    disable_mlflow_telemetry()
    from mlflow.tracking import MlflowClient

    folder = tmp_path_factory.mktemp("mlflow-template")
    MlflowClient(tracking_uri=mlflow_tracking_uri(folder)).search_experiments()  # creates the tables
    return folder / "mlflow.db"


@pytest.fixture
def mlflow_run_dir(tmp_path: Path, empty_mlflow_db: Path) -> Path:
    """A run directory whose mlflow.db has its tables but no experiment yet."""
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    return tmp_path


def finished_records(run_dir: Path) -> list[Any]:
    """The records of the one offline run under `run_dir`, once its exit record is written (wandb-core may
    write the end of the file just after `finish()` returns)."""
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 60
    while True:
        records = read_wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def items(update: Any) -> dict[str, Any]:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in update}


def test_wandb_offline_history_and_config_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "online")  # the backend is offline whatever the environment says
    monkeypatch.setenv("WANDB_API_KEY", "")
    with Tracker(["jsonl", "wandb"], tmp_path, run_name="wb", config=CONFIG) as tracker:
        for step in range(3):
            tracker.log({"reward/mean": 0.25 * step, "val/acc": 0.5, "vec": [1, 2]}, step=step)
    assert os.environ["WANDB_MODE"] == "offline"
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1  # files under the run dir, offline
    records = finished_records(tmp_path)
    history = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["reward/mean"], h["val/acc"]) for h in history] == [
        (0, 0, 0.5),
        (1, 0.25, 0.5),
        (2, 0.5, 0.5),
    ]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "wb" and run.project == "posttrain"
    config = items(run.config.update)
    assert config["actor"] == {"optim": {"lr": 1e-6}}
    info = config["run_info"]
    assert info["packages"]["wandb"] and info["packages"]["torch"]
    assert info["posttrain_version"]
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0


def test_wandb_run_of_a_failed_fit_exits_nonzero(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    with pytest.raises(ValueError, match="boom"):
        with Tracker(["wandb"], tmp_path, run_name="wb") as tracker:
            tracker.log({"x": 1.0}, step=1)
            raise ValueError("boom")
    (exit_record,) = [r.exit for r in finished_records(tmp_path) if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 1


def test_mlflow_run_read_back_from_sqlite_store(mlflow_run_dir: Path) -> None:
    tmp_path = mlflow_run_dir
    with Tracker(["jsonl", "mlflow"], tmp_path, run_name="ml", config=CONFIG) as tracker:
        for step in range(3):
            tracker.log({"reward/mean": 0.25 * step, "val/acc/openai/gsm8k": 0.5, "bad key!": 1.0}, step=step)
    # nothing may leave the machine: telemetry is off before mlflow is imported, and no client runs
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true" and os.environ["DO_NOT_TRACK"] == "true"
    from mlflow.telemetry.client import get_telemetry_client
    from mlflow.tracking import MlflowClient

    assert get_telemetry_client() is None
    assert (tmp_path / "mlflow.db").is_file()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("posttrain")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "ml" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert run.data.metrics["val/acc/openai/gsm8k"] == 0.5
    assert run.data.metrics["bad key_"] == 1.0  # a name MLflow refuses, made valid
    params = run.data.params
    assert params["actor.optim.lr"] == "1e-06"
    assert json.loads(params["trainer.loggers"]) == ["jsonl", "wandb"]
    assert params["run_info.packages.torch"]
    assert params["run_info.posttrain_version"] == run.data.tags["posttrain.version"]
    info = json.loads((tmp_path / "run_info.json").read_text())
    if info["git"]:
        assert run.data.tags["mlflow.source.git.commit"] == info["git"]["commit"]
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    assert artifacts.is_relative_to(tmp_path.resolve()) and (artifacts / "run_info.json").is_file()


def test_mlflow_run_of_a_failed_fit_is_failed(mlflow_run_dir: Path) -> None:
    tmp_path = mlflow_run_dir
    with pytest.raises(ValueError, match="boom"):
        with Tracker(["mlflow"], tmp_path, run_name="ml") as tracker:
            tracker.log({"x": 1.0}, step=1)
            raise ValueError("boom")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("posttrain").experiment_id])
    assert run.info.status == "FAILED"


def test_mlflow_telemetry_off_in_a_fresh_process(mlflow_run_dir: Path) -> None:
    """In a process where nothing imported mlflow before, the backend's import never starts telemetry."""
    tmp_path = mlflow_run_dir
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from posttrain.tracking import Tracker\n"
        "assert 'mlflow' not in sys.modules\n"
        "Tracker(['mlflow'], Path(sys.argv[1])).close()\n"
        "from mlflow.telemetry.client import get_telemetry_client\n"
        "assert get_telemetry_client() is None\n"
    )
    # without the variables by which mlflow would turn telemetry off by itself (CI, pytest)
    ours = ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS")
    env = {k: v for k, v in os.environ.items() if k not in ours}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env, timeout=300)


def test_several_backends_at_once(mlflow_run_dir: Path) -> None:
    pytest.importorskip("wandb")
    tmp_path = mlflow_run_dir
    with Tracker(["jsonl", "tensorboard", "wandb", "mlflow"], tmp_path, config=CONFIG) as tracker:
        tracker.log({"loss": 1.0}, step=1)
    assert (tmp_path / "metrics.jsonl").read_text().strip() == '{"step": 1, "loss": 1.0}'
    assert list((tmp_path / "tensorboard").iterdir())
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert (tmp_path / "mlflow.db").is_file()


def test_missing_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"'mlflow'.*pip install 'posttrain\[mlflow\]'"):
        Tracker(["jsonl", "mlflow"], tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists(), "refused before any backend opened a file"


def test_unknown_backend_lists_every_valid_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'wandbb'.*console, jsonl, tensorboard, wandb, mlflow"):
        Tracker(["console", "wandbb"], tmp_path)


@pytest.mark.parametrize(
    ("key", "name"),
    [("val/acc/openai/gsm8k", "val/acc/openai/gsm8k"), ("a b:c", "a b:c"), ("x!y", "x_y"), ("/a//b/", "a/b"),
     ("a/../b", "a/__/b"), ("timing/.", "timing/_")],
)  # fmt: skip
def test_mlflow_names(key: str, name: str) -> None:
    assert mlflow_name(key) == name
