"""The explicit API's samplers on one rank, by id: what a `SamplingClient` samples from.

A sampler of a LoRA model is a frozen copy of its adapter on one base engine that every LoRA sampler of the
rank shares (with the built-in engine): N tenants' samplers cost one copy of the base plus N small adapters,
and the `sample` calls of different tenants that wait together run as one batch over that base, each row
under its own adapter (`NativeRolloutEngine.enable_adapters`). Any other sampler (full weights, weights from
a directory, another rollout engine) is an engine of its own holding a copy of the weights it was made with.
Training afterwards changes no sampler.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.mm_dataset import MULTI_MODAL_INPUTS
from posttrain.engine.adapter_model import AdapterModel
from posttrain.engine.engine_config import DTYPES
from posttrain.engine.lora import untie_output_embeddings
from posttrain.engine.multi_lora import AdapterSpec, MultiLora
from posttrain.engine.multimodal import has_images, image_model
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError, PosttrainError
from posttrain.rollout import make_rollout_engine
from posttrain.rollout.base import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams
from posttrain.workers.prompt_scoring import PromptScoring, score_prompt
from posttrain.workers.sampling import batch_prompts, results_batch

ADAPTER_DIR = "posttrain_adapter"  # in a LoRA model's sampler weights: the adapter in peft's format


@dataclass(frozen=True)
class SamplerSettings:
    """How this rank builds rollout engines (from `ApiWorkerSpec`)."""

    rollout_name: str
    device: str
    dtype: str
    max_batch_size: int
    attn_implementation: str
    seed: int  # this rank's sampler seed; each new engine offsets it, so no two engines replay each other


@dataclass(frozen=True)
class Sampler:
    engine: RolloutEngine
    adapter: str | None = None  # its adapter on the shared engine; None: the engine's own weights


class ApiSamplers:
    def __init__(self, settings: SamplerSettings) -> None:
        self.settings = settings
        self.samplers: dict[str, Sampler] = {}
        self._shared: RolloutEngine | None = None  # the base every LoRA sampler shares (built-in engine)
        self._router: MultiLora | None = None
        self._shared_base = ""  # the base model directory of the shared engine
        self._engines_made = itertools.count()

    def _new_engine(self, path: str) -> RolloutEngine:
        s = self.settings
        return make_rollout_engine(
            s.rollout_name,
            path,
            device=s.device,
            dtype=DTYPES[s.dtype],
            max_batch_size=s.max_batch_size,
            # every new engine draws new numbers (an RL step's fresh snapshot must not replay the last one's)
            seed=s.seed + 104_729 * next(self._engines_made),
            attn_implementation=s.attn_implementation,
        )

    def _shared_engine(self, base_model: str) -> tuple[RolloutEngine, MultiLora] | None:
        """The engine LoRA samplers share, built on first use; None if the rollout engine takes no adapters."""
        if self.settings.rollout_name != "native":
            return None
        if self._shared is not None and Path(self._shared_base).resolve() != Path(base_model).resolve():
            return None  # the shared engine is another base's: an adapter on it would sample from that base
        if self._shared is None:
            engine = self._new_engine(base_model)
            router = MultiLora(engine.model)  # type: ignore[attr-defined]
            engine.enable_adapters(router)  # type: ignore[attr-defined]
            self._shared, self._router, self._shared_base = engine, router, base_model
        assert self._router is not None
        return self._shared, self._router

    def snapshot(self, sampler_id: str, model: TrainEngine | AdapterModel) -> dict[str, float]:
        """A sampler with `model`'s current weights, copied in-process (no disk)."""
        start = time.perf_counter()
        self._check_new(sampler_id)
        shared = self._shared_engine(model.config.model_path) if isinstance(model, AdapterModel) else None
        if shared is not None and isinstance(model, AdapterModel):
            engine, router = shared
            router.add_frozen_copy(sampler_id, model.adapter)
            self.samplers[sampler_id] = Sampler(engine, adapter=sampler_id)
            loaded = 2 * len(model.adapter.module_names)
        else:
            engine = self._new_engine(model.config.model_path)
            if model.lora and getattr(engine, "model", None) is not None:
                untie_output_embeddings(engine.model)  # type: ignore[attr-defined]  # lm_head adapted alone
            loaded = engine.load_weights(model.named_tensors_for_rollout())
            self.samplers[sampler_id] = Sampler(engine)
        return {"sync/tensors": float(loaded), "sync/seconds": time.perf_counter() - start}

    def open(self, sampler_id: str, path: str) -> None:
        """A sampler on the weights of a Hugging Face directory (a base model or exported sampler weights).
        Sampler weights of a LoRA model on this rank's shared base are a frozen adapter on the shared engine
        (their ADAPTER_DIR; tinker-cookbook's save_weights_for_sampler -> create_sampling_client(path)), else
        an engine of their own on the merged weights."""
        self._check_new(sampler_id)
        if self._open_as_adapter(sampler_id, Path(path)):
            return
        self.samplers[sampler_id] = Sampler(self._new_engine(path))

    def _open_as_adapter(self, sampler_id: str, path: Path) -> bool:
        config_file = path / ADAPTER_DIR / "adapter_config.json"
        if self.settings.rollout_name != "native" or not config_file.is_file():
            return False
        config = json.loads(config_file.read_text())
        base = str(config.get("base_model_name_or_path") or "")
        if not Path(base).is_dir():
            return False
        shared = self._shared_engine(base)
        if shared is None:
            return False
        engine, router = shared
        spec = AdapterSpec(int(config["r"]), float(config["lora_alpha"]), tuple(config["target_modules"]))
        adapter = router.add(sampler_id, spec, torch.float32, next(engine.model.parameters()).device, seed=0)  # type: ignore[attr-defined]
        try:
            adapter.load_peft(path / ADAPTER_DIR)
        except Exception:
            router.remove(sampler_id)
            raise
        adapter.requires_grad_(False)
        self.samplers[sampler_id] = Sampler(engine, adapter=sampler_id)
        return True

    def close(self, sampler_id: str) -> None:
        sampler = self.samplers.pop(sampler_id, None)
        if sampler is None:
            return
        if sampler.adapter is not None:
            assert self._router is not None
            self._router.remove(sampler.adapter)
        elif hasattr(sampler.engine, "close"):
            sampler.engine.close()

    def free_caches(self) -> None:
        """Free every sampler engine's KV cache (the next `sample` allocates it again): a training pass must
        not run beside caches sized for the last sample call (tinker's default max_tokens reserves the whole
        context per sample). An engine generating for another caller keeps its cache."""
        engines = {id(s.engine): s.engine for s in self.samplers.values()}
        if self._shared is not None:
            engines[id(self._shared)] = self._shared
        for engine in engines.values():
            sleep = getattr(engine, "sleep", None)
            if sleep is None:
                continue
            try:
                sleep()
            except PosttrainError:  # sequences in flight (refused, never freed under them)
                continue

    def _check_new(self, sampler_id: str) -> None:
        if sampler_id in self.samplers:
            raise ConfigError(f"sampler {sampler_id!r} exists already")

    def get(self, sampler_id: str) -> Sampler:
        if sampler_id not in self.samplers:
            raise ConfigError(f"no sampler {sampler_id!r} on this backend")
        return self.samplers[sampler_id]

    def sample(self, sampler_ids: list[str], batch: Batch, samplings: list[SamplingParams]) -> Batch:
        """One response per prompt row; row i runs on sampler `sampler_ids[batch.api_adapter[i]]` with
        `samplings[...]`, seeded with `batch.api_seed[i]` if >= 0. Rows of samplers that share an engine are
        generated together (continuous batching over all of them). A row's images (`multi_modal_inputs`)
        go with its request."""
        samplers = [self.get(s) for s in sampler_ids]
        which = batch[keys.API_ADAPTER].tolist()
        seeds = batch[keys.API_SEED].tolist()
        prompts = batch_prompts(batch)
        images = list(batch[MULTI_MODAL_INPUTS]) if MULTI_MODAL_INPUTS in batch else [{}] * len(batch)
        by_engine: dict[int, list[int]] = {}
        for row, k in enumerate(which):
            by_engine.setdefault(id(samplers[k].engine), []).append(row)
        results: list[GenerationResult | None] = [None] * len(batch)
        start = time.perf_counter()
        for rows in by_engine.values():
            engine = samplers[which[rows[0]]].engine
            engine.wake()
            requests = []
            for row in rows:
                sampler, sampling = samplers[which[row]], samplings[which[row]]
                seeded = (
                    replace(sampling, seed=seeds[row]) if seeds[row] >= 0 else replace(sampling, seed=None)
                )
                requests.append(
                    GenerationRequest(
                        prompts[row], seeded, adapter=sampler.adapter, images=images[row] or None
                    )
                )
            for row, result in zip(rows, engine.generate_requests(requests), strict=True):  # type: ignore[attr-defined]
                if result.error is not None:
                    raise ValueError(f"sampler {sampler_ids[which[row]]}: {result.error}")
                results[row] = result
        done = [r for r in results if r is not None]
        width = max(s.max_tokens for s in samplings)
        pad_id = samplers[0].engine.pad_id  # type: ignore[attr-defined]  # one tokenizer for every sampler
        return results_batch(
            batch, done, pad_id, width, time.perf_counter() - start, samplings[0].temperature
        )

    @torch.no_grad()
    def prompt_log_probs(
        self, sampler_id: str, batch: Batch, temperature: float = 1.0, scoring: PromptScoring | None = None
    ) -> Batch:
        """log p(token i | tokens < i) of each row's tokens under the sampler's weights, at `temperature`
        (0 at position 0, which nothing predicts), and the scores `scoring` asks for from the same logits
        (workers/prompt_scoring.py). Rows are right-padded. Rows with images (`multi_modal_inputs`) are
        scored with them, the model computing its multimodal positions."""
        sampler = self.get(sampler_id)
        model = getattr(sampler.engine, "model", None)
        if model is None:
            raise ConfigError("this rollout engine cannot score prompts (it exposes no model)")
        if has_images(batch):
            device = next(model.parameters()).device
            model = image_model(model, batch, getattr(model.config, "image_token_id", None), device)
        ids, mask = batch[keys.INPUT_IDS], batch[keys.ATTENTION_MASK]
        if sampler.adapter is not None:
            assert self._router is not None
            with self._router.use(sampler.adapter):
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        else:
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        scores = score_prompt(logits, scoring) if scoring is not None else {}
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature
        lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        lp = torch.nn.functional.pad(lp * mask[:, 1:], (1, 0))
        return Batch.from_dict({keys.API_LOGPROBS: lp, **scores})
