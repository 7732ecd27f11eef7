"""Where the explicit API's work runs: an `ApiWorker` group in this process (`local`) or on Ray (`ray`).

A backend owns the worker group, one thread that runs every call in submission order (so a client's
`forward_backward` then `optim_step` pipeline without the caller waiting, and never reorder), the ids of
models and samplers, the tenancy rule (LoRA clients share one base model; a full-weight client has the
backend to itself) and the folder of saved states. tinker paths (`tinker://<model_id>/weights/<name>`) are
resolved inside that folder only: ids and names are checked, never joined as given.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from posttrain.config.schema import RayConfig
from posttrain.controller.placement import RoleRequest, start_role_groups
from posttrain.controller.roles import ApiGroup
from posttrain.controller.worker_group import LocalWorkerGroup
from posttrain.workers.api_worker import ApiWorker, ApiWorkerSpec, ModelSpec

T = TypeVar("T")
BackendName = Literal["local", "ray"]
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MODEL_ID = re.compile(r"^[a-z0-9]{8}:train:[0-9]+$")
CHECKPOINT_KINDS = ("weights", "sampler_weights")
MAX_LORA_RANK = 256


@dataclass(frozen=True)
class RaySettings:
    """The placement settings of a `ray` backend (controller/placement.py's WorkerSettings)."""

    n_workers_per_node: int = 1
    nnodes: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 1.0
    device: str = "auto"
    collective_timeout_s: float = 1800.0
    threads_per_worker: int = 0
    backend: str = "ray"


class Backend:
    def __init__(
        self,
        name: BackendName,
        root_dir: str | Path,
        worker: ApiWorkerSpec,
        ray: RaySettings | None = None,
        ray_config: RayConfig | None = None,
    ) -> None:
        if name not in ("local", "ray"):
            raise ValueError(f"unknown backend {name!r}; valid: local, ray")
        self.name = name
        self.root = Path(root_dir).resolve()
        self.session = uuid.uuid4().hex[:8]
        self._ids = itertools.count()
        if name == "local":
            self.group = ApiGroup(LocalWorkerGroup(ApiWorker, worker, role="api", device="cpu"))
        else:
            request = RoleRequest("api", ApiWorker, worker)
            started, self._pools = start_role_groups(
                ray or RaySettings(), ray_config or RayConfig(), [request]
            )
            self.group = ApiGroup(started["api"])
        self.world_size = self.group.world_size
        self.models: dict[str, ModelSpec] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="posttrain-api")

    # ---- ordering ------------------------------------------------------------------------------
    def submit(self, fn: Callable[[], T]) -> AwaitableConcurrentFuture[T]:
        """Run `fn` on the backend's thread after everything submitted before it; a future at once."""
        return AwaitableConcurrentFuture(self._executor.submit(fn))

    def new_id(self, kind: str) -> str:
        return f"{self.session}:{kind}:{next(self._ids)}"

    # ---- tenancy -------------------------------------------------------------------------------
    def check_new_model(self, model: ModelSpec) -> None:
        """LoRA clients on one base model together; a full-weight client only alone."""
        if model.lora_rank < 0 or model.lora_rank > MAX_LORA_RANK:
            raise ValueError(f"rank={model.lora_rank} is outside 1..{MAX_LORA_RANK} (0 = full weights)")
        if not Path(model.base_model).is_dir():
            raise ValueError(f"base_model {model.base_model!r} is not a model directory on this machine")
        for model_id, other in self.models.items():
            if model.lora_rank == 0 or other.lora_rank == 0:
                raise ValueError(
                    f"a full-weight training client cannot share a backend with other clients ({model_id} "
                    "exists): each would hold and update its own copy of the model; use LoRA clients, or "
                    "another ServiceClient"
                )
            if Path(other.base_model).resolve() != Path(model.base_model).resolve():
                raise ValueError(
                    f"LoRA clients of one backend share one base model: {model_id} trains on "
                    f"{other.base_model}, not {model.base_model}"
                )

    # ---- paths ---------------------------------------------------------------------------------
    def checkpoint_dir(self, model_id: str, kind: str, name: str) -> Path:
        if not NAME.match(name) or name in (".", ".."):
            raise ValueError(f"checkpoint name {name!r}: use letters, digits, '.', '_' or '-' (at most 128)")
        return self.root / model_id.replace(":", "_") / kind / name

    def tinker_path(self, model_id: str, kind: str, name: str) -> str:
        return f"tinker://{model_id}/{kind}/{name}"

    def resolve(self, path: str, kind: str) -> tuple[str, Path]:
        """(model id, folder) of a `tinker://<model_id>/<kind>/<name>` path that exists here."""
        match = re.fullmatch(r"tinker://([^/]+)/([^/]+)/([^/]+)", path)
        if match is None or match.group(2) != kind or not MODEL_ID.match(match.group(1)):
            raise ValueError(f"{path!r} is not a tinker://<model_id>/{kind}/<name> path")
        folder = self.checkpoint_dir(match.group(1), kind, match.group(3))
        if not folder.is_dir():
            raise ValueError(f"{path!r}: no such checkpoint under {self.root}")
        return match.group(1), folder

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.group.shutdown()
        for pool in getattr(self, "_pools", {}).values():
            pool.remove()
