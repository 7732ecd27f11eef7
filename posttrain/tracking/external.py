"""Weights & Biases and MLflow backends of the Tracker; both stay on this machine.

- wandb: an offline run (WANDB_MODE=offline) under `<log_dir>/wandb/offline-run-*`; its history is in the
  run's `run-<id>.wandb` file. `wandb sync <that folder>` uploads it later, if the user wants to.
- mlflow: a local store `sqlite:///<log_dir>/mlflow.db` (artifacts in `<log_dir>/mlflow-artifacts`), telemetry
  off (MLFLOW_DISABLE_TELEMETRY and DO_NOT_TRACK are set before mlflow is imported). `mlflow ui
  --backend-store-uri sqlite:///<log_dir>/mlflow.db` (with the full `mlflow` package) browses it.

Each start of a run (a resume too) is a new W&B / MLflow run. The resolved config goes to W&B's run config and
MLflow's params (dotted keys), with the run info (versions, git commit) under `run_info`.
Both packages are optional extras (`pip install 'posttrain[wandb]'`, `'posttrain[mlflow]'`).
Must not import anything from posttrain except errors (tracking is the bottom layer).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttrain.errors import ConfigError
from posttrain.tracking.run_info import RUN_INFO_FILE, flatten

PROJECT = "posttrain"  # the W&B project and MLflow experiment runs are filed under

# backend -> (the module it imports, the extra that installs it)
EXTRAS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


def missing_package(backend: str) -> str | None:
    """A one-line hint when `backend` needs a package that is not installed, else None."""
    if backend not in EXTRAS:
        return None
    module, extra = EXTRAS[backend]
    if importlib.util.find_spec(module) is not None:
        return None
    return f"the {backend} logger needs the {module} package: pip install 'posttrain[{extra}]'"


def _require(backend: str) -> None:
    hint = missing_package(backend)
    if hint:
        raise ConfigError(hint)


def _exit_status() -> str:
    """FINISHED, FAILED or KILLED: how the code around `Tracker.close()` is ending (an exception in flight
    is visible to a `finally` block through sys.exc_info())."""
    import sys

    exc = sys.exc_info()[1]
    if exc is None:
        return "FINISHED"
    return "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"


class WandbBackend:
    """An offline W&B run in `<log_dir>/wandb`."""

    def __init__(self, log_dir: Path, run_name: str, run_config: Mapping[str, Any] | None) -> None:
        _require("wandb")
        os.environ["WANDB_MODE"] = "offline"  # for anything else in the process that reads it, too
        import wandb

        self.run = wandb.init(
            mode="offline",
            dir=str(log_dir),
            project=PROJECT,
            name=run_name,
            config=dict(run_config or {}),
            reinit="create_new",  # its own run object; the global wandb.run of user code is left alone
            # quiet, stdout left alone; git: run_info records posttrain's commit (W&B would look at the cwd)
            settings=wandb.Settings(silent=True, console="off", disable_git=True),
        )
        self.run_dir = Path(self.run.dir).parent  # <log_dir>/wandb/offline-run-<time>-<id>

    def log(self, metrics: Mapping[str, float | int], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish(exit_code=0 if _exit_status() == "FINISHED" else 1)


_BAD_NAME_CHARS = re.compile(r"[^/\w.\- :]")


def mlflow_name(key: str) -> str:
    """`key` as a valid MLflow metric/param name: characters MLflow refuses become `_`, no leading `/`."""
    parts = [p for p in _BAD_NAME_CHARS.sub("_", key).split("/") if p]  # no empty path parts
    name = "/".join("_" * len(p) if p in (".", "..") else p for p in parts)  # nor . and ..
    return name[:250] or "_"


def mlflow_tracking_uri(log_dir: Path) -> str:
    return f"sqlite:///{(log_dir / 'mlflow.db').resolve()}"


def disable_mlflow_telemetry() -> None:
    """Set MLflow's telemetry switches; if mlflow was imported before they were set, drop its client."""
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    os.environ["DO_NOT_TRACK"] = "true"
    try:
        from mlflow.telemetry.client import set_telemetry_client

        set_telemetry_client()  # re-reads the switches: no client when telemetry is disabled
    except Exception:  # noqa: BLE001 - an mlflow without this module has no telemetry to drop
        pass


class MlflowBackend:
    """An MLflow run in the local store `sqlite:///<log_dir>/mlflow.db`, experiment `posttrain`."""

    def __init__(
        self,
        log_dir: Path,
        run_name: str,
        run_config: Mapping[str, Any] | None,
        run_info: Mapping[str, Any] | None,
    ) -> None:
        _require("mlflow")
        disable_mlflow_telemetry()  # before the import: mlflow starts its telemetry client when imported
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.tracking_uri = mlflow_tracking_uri(log_dir)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self.client.get_experiment_by_name(PROJECT)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = (log_dir / "mlflow-artifacts").resolve().as_uri()
            experiment_id = self.client.create_experiment(PROJECT, artifact_location=artifacts)
        tags = {"posttrain.run_dir": str(log_dir.resolve())}
        info = dict(run_info or {})
        if info.get("posttrain_version"):
            tags["posttrain.version"] = str(info["posttrain_version"])
        if info.get("git"):
            tags["mlflow.source.git.commit"] = str(info["git"]["commit"])
        run = self.client.create_run(experiment_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id

        params: dict[str, str] = {}
        for key, value in flatten(dict(run_config or {})):
            if value is not None:
                params[mlflow_name(key)] = _param_value(value)
        entries = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(entries), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=entries[start : start + 100])
        self.client.log_batch(
            self.run_id, tags=[RunTag("posttrain.loggers", ",".join(info.get("loggers", [])))]
        )
        if (log_dir / RUN_INFO_FILE).exists():
            self.client.log_artifact(self.run_id, str(log_dir / RUN_INFO_FILE))

    def log(self, metrics: Mapping[str, float | int], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(mlflow_name(k), float(v), now, step) for k, v in metrics.items()]
        for start in range(0, len(entries), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=entries[start : start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status=_exit_status())


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 6000 else text[:5997] + "..."  # MLflow's limit on a param's value
