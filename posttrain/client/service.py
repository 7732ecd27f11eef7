"""`ServiceClient`: the entry point of the explicit API, with tinker 0.38's names, in this process or on Ray
(or, with `backend="http"`, on a `posttrain serve` server: posttrain/client/http.py).

    from posttrain.client import ServiceClient, types
    service = ServiceClient(backend="local")                      # or backend="ray", n_workers=2
    training = service.create_lora_training_client("models/tiny", rank=8)
    sampler = training.save_weights_and_get_sampling_client()

`base_model` is a local Hugging Face directory (loaded with from_pretrained). LoRA training clients of one
ServiceClient share its backend and base model, each with its own adapter, optimizer and checkpoints;
`create_training_client` trains the full weights (tinker has no such call) and has its backend to itself.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from tinker import types

from posttrain.algorithms.api_losses import API_LOSS_NAMES
from posttrain.client.backend import (
    MAX_LORA_RANK,
    MODEL_ID,
    Backend,
    BackendName,
    RaySettings,
    check_user_metadata,
)
from posttrain.client.sampling import SamplingClient
from posttrain.client.training import TrainingClient, _open_sampler
from posttrain.config.schema import RayConfig
from posttrain.models import load_config
from posttrain.workers.api_worker import ApiWorkerSpec, ModelSpec


def default_root() -> Path:
    return Path(tempfile.gettempdir()) / f"posttrain-api-{os.getuid()}"


def check_lora_args(rank: int, train_mlp: bool, train_attn: bool, train_unembed: bool, hint: str) -> None:
    """create_lora_training_client's arguments, as tinker checks them (`hint`: what rank 0 would mean)."""
    if not (train_mlp or train_attn or train_unembed):
        raise ValueError("At least one of train_mlp, train_attn, or train_unembed must be True")
    if rank < 1:
        raise ValueError(f"rank must be >= 1 (got {rank}); {hint}")


class ServiceClient:
    def __new__(
        cls, backend: BackendName | Literal["http"] = "local", *args: Any, **kwargs: Any
    ) -> ServiceClient:
        """`backend="http"` makes an `HttpServiceClient` (posttrain/client/http.py): the same methods, run by
        a `posttrain serve` server at `base_url` (default TINKER_BASE_URL) with `api_key`."""
        if backend not in ("local", "ray", "http"):
            raise ValueError(f"unknown backend {backend!r}; valid: local, ray, http")
        if backend == "http" and cls is ServiceClient:
            from posttrain.client.http import HttpServiceClient

            return super().__new__(HttpServiceClient)
        return super().__new__(cls)

    def __init__(
        self,
        backend: BackendName = "local",
        *,
        root_dir: str | Path | None = None,
        base_models: Sequence[str] = (),
        n_workers: int = 1,
        seed: int | None = None,
        worker: ApiWorkerSpec | None = None,
        ray: RayConfig | None = None,
        **ray_settings: Any,
    ) -> None:
        """`root_dir`: where saved states go (default: a folder in the system temp dir). `base_models`:
        the model directories to list as served (any directory may be used). `seed`: the workers' random
        streams (unseeded sampling draws from them; a seeded request repeats exactly). With `backend="ray"`,
        `n_workers` data-parallel ranks; `ray_settings` are RaySettings' fields (device, cpus_per_worker...)."""
        if backend == "local" and n_workers != 1:
            raise ValueError("backend='local' runs one in-process worker (n_workers=1); use backend='ray'")
        settings = RaySettings(n_workers_per_node=n_workers, **ray_settings) if backend == "ray" else None
        spec = worker or ApiWorkerSpec()
        if seed is not None:
            if worker is not None and worker.seed not in (0, seed):
                raise ValueError(f"seed={seed} and worker.seed={worker.seed} disagree: give one")
            spec = replace(spec, seed=seed)
        self.backend = Backend(backend, root_dir or default_root(), spec, settings, ray)
        self.base_models = list(base_models)

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.backend.close()

    # ---- training clients ----------------------------------------------------------------------
    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
    ) -> TrainingClient:
        """A new LoRA adapter of `rank` on `base_model` (its B matrices zero: it starts as the base model);
        `user_metadata` is kept with its training run."""
        return self.create_lora_training_client_as(
            None, base_model, rank, seed, train_mlp, train_attn, train_unembed, user_metadata
        )

    def create_training_client(self, base_model: str, seed: int | None = None) -> TrainingClient:
        """Full fine-tuning of `base_model` (every weight trains); the backend then serves this client only."""
        return self._create(ModelSpec(str(base_model), 0, seed=seed))

    def create_lora_training_client_as(
        self,
        model_id: str | None,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
    ) -> TrainingClient:
        """`create_lora_training_client` under an id its caller chose (None: the backend's next): for a server
        that names its models itself (`posttrain serve`), so a model's checkpoints stay under one
        `tinker://<model_id>/...` run however often its adapter is released and loaded again."""
        check_lora_args(
            rank, train_mlp, train_attn, train_unembed, "create_training_client trains the full weights"
        )
        model = ModelSpec(str(base_model), rank, train_attn, train_mlp, train_unembed, seed)
        return self._create(model, model_id, check_user_metadata(user_metadata))

    def create_training_client_from_state_as(
        self,
        model_id: str,
        path: str,
        with_optimizer: bool = True,
        user_metadata: dict[str, str] | None = None,
    ) -> TrainingClient:
        """`create_training_client_from_state(_with_optimizer)` under an id its caller chose (see
        `create_lora_training_client_as`); `user_metadata` None keeps what the id's run has (a reload)."""
        return self._from_state(path, with_optimizer, model_id, user_metadata)

    def _create(
        self, model: ModelSpec, model_id: str | None = None, user_metadata: dict[str, str] | None = None
    ) -> TrainingClient:
        """A new training model; its run's facts (RUN_FILE) written with it, `user_metadata` among them (None:
        a model loaded again under its own id keeps the facts its run has)."""
        backend = self.backend
        backend.check_new_model(model)
        if model_id is None:
            model_id = backend.new_id("train")
        elif not MODEL_ID.fullmatch(model_id) or model_id in backend.models:
            raise ValueError(f"model id {model_id!r} is malformed or in use")
        if user_metadata is not None or not backend.read_run(model_id):
            facts = {"base_model": model.base_model, "lora_rank": model.lora_rank}
            backend.write_run(model_id, {**facts, "user_metadata": user_metadata or {}})
        backend.models[model_id] = model
        future = backend.submit(lambda: backend.group.create_model(model_id, model))
        try:
            future.result()
        except Exception:
            backend.models.pop(model_id, None)
            raise
        return TrainingClient(backend, model_id, model)

    def create_training_client_from_state(
        self, path: str, user_metadata: dict[str, str] | None = None
    ) -> TrainingClient:
        """A new client with the weights of a saved state (a fresh optimizer); `user_metadata` kept with its
        run, as tinker's (the cookbook keeps its renderer there)."""
        return self._from_state(path, False, None, user_metadata)

    def create_training_client_from_state_with_optimizer(
        self, path: str, user_metadata: dict[str, str] | None = None
    ) -> TrainingClient:
        """A new client with the weights and optimizer state of a saved state; `user_metadata` as above."""
        return self._from_state(path, True, None, user_metadata)

    def _from_state(
        self,
        path: str,
        with_optimizer: bool,
        model_id: str | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> TrainingClient:
        if user_metadata is not None:
            check_user_metadata(user_metadata)
        _, folder = self.backend.resolve(path, "weights")
        saved = json.loads((folder / "model_spec.json").read_text())
        saved["target_modules"] = tuple(saved.get("target_modules", ()))
        client = self._create(ModelSpec(**saved), model_id, user_metadata)
        loading = client.load_state_with_optimizer(path) if with_optimizer else client.load_state(path)
        loading.result()
        return client

    # ---- sampling clients ----------------------------------------------------------------------
    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> SamplingClient:
        """A sampler on saved sampler weights (`model_path`, a tinker:// path) or on a base model."""
        if model_path is None and base_model is None:
            raise ValueError("Either model_path or base_model must be provided")
        if model_path is not None:
            return _open_sampler(self.backend, model_path)
        assert base_model is not None
        if not Path(base_model).is_dir():
            raise ValueError(f"base_model {base_model!r} is not a model directory on this machine")
        sampler_id = self.backend.new_id("sampler")
        group = self.backend.group
        self.backend.create_sampler(
            sampler_id, lambda: group.open_sampler(sampler_id, Path(base_model)), None
        )
        return SamplingClient(self.backend, sampler_id, base_model)

    # ---- capabilities --------------------------------------------------------------------------
    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        """The listed base models (trainable and sampleable, with their context length)."""
        models = [
            types.SupportedModel(
                model_name=path,
                max_context_length=getattr(load_config(path), "max_position_embeddings", None),
                trainable=True,
                sampleable=True,
            )
            for path in self.base_models
        ]
        return types.GetServerCapabilitiesResponse(supported_models=models)

    @staticmethod
    def loss_names() -> tuple[str, ...]:
        """The loss functions `forward_backward` knows by name."""
        return API_LOSS_NAMES

    @staticmethod
    def limits() -> dict[str, int]:
        return {"max_lora_rank": MAX_LORA_RANK}
