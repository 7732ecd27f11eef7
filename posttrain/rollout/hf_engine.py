"""The reference engine: Hugging Face `generate` on the same model, behind the same interface.

Simple and slow (no continuous batching, a cache that grows by concatenation, every prompt prefilled once
per sample), kept as the fallback for architectures the built-in engine does not cover and as the
baseline the built-in engine is measured against. It samples as the built-in engine does: temperature, then
min-p, top-k, top-p (`sampling.truncate_logits`, as a logits processor: HF's own warpers apply top-p before
min-p), and a seeded request is generated alone, so its samples depend on its seed only, not on the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from posttrain.errors import ConfigError
from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.rollout.base import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    context_error,
    eos_token_ids,
    results_or_raise,
    stop_string_prefix,
    stopped_text,
    text_before_stop,
)
from posttrain.rollout.sampling import truncate_logits


class HFRolloutEngine:
    def __init__(
        self,
        model_path: str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 512,
        seed: int = 0,
        attn_implementation: str = "sdpa",
    ) -> None:
        self.device = torch.device(device)
        self.model = load_causal_lm(model_path, dtype=dtype, attn_implementation=attn_implementation)
        self.model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(model_path)
        self.max_batch_size = max_batch_size
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # the same stop tokens as the native engine (an int in generation_config used to leave out the tokenizer's)
        self.eos_ids = eos_token_ids(self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id)
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        )
        # only SamplingParams shape the distribution: `generate` fills every setting left unset from the
        # directory's generation_config.json (Qwen2.5-Instruct's repetition_penalty 1.05, say), so it is
        # replaced by one that sets nothing but the special tokens
        self.model.generation_config = GenerationConfig(eos_token_id=self.eos_ids, pad_token_id=self.pad_id)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerationResult]:
        return results_or_raise(
            self.generate_requests([GenerationRequest(list(p), sampling) for p in prompts])
        )

    def generate_requests(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        results: list[GenerationResult | None] = [None] * len(requests)
        by_sampling: dict[tuple[SamplingParams, int], list[int]] = {}
        for i, request in enumerate(requests):
            try:
                request.sampling.validate()
                if len(request.prompt_ids) + request.sampling.max_tokens > self.max_context:
                    raise ValueError(
                        context_error(len(request.prompt_ids), request.sampling.max_tokens, self.max_context)
                    )
                if not request.prompt_ids:
                    raise ValueError("empty prompt")
                if request.images:
                    raise ConfigError(
                        "rollout.name=hf does not take image prompts; image prompts must be sampled with "
                        "rollout.name=native"
                    )
            except (ConfigError, ValueError) as exc:
                results[i] = GenerationResult([], [], "", "error", error=str(exc))
                continue
            # a seeded request alone: one generator drives a whole `generate` call
            by_sampling.setdefault(
                (request.sampling, i if request.sampling.seed is not None else -1), []
            ).append(i)
        for (sampling, _), indices in by_sampling.items():
            for start in range(0, len(indices), self.max_batch_size):
                chunk = indices[start : start + self.max_batch_size]
                outs = self._generate_batch([requests[i].prompt_ids for i in chunk], sampling)
                for i, out in zip(chunk, outs, strict=True):
                    results[i] = out
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], sampling: SamplingParams) -> list[GenerationResult]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        stop_ids = sorted(set(self.eos_ids) | set(sampling.stop_token_ids))
        greedy = sampling.temperature == 0
        # `generate` samples from the global RNG: run it on a forked one, seeded by the request's seed or by
        # this engine's own stream, so that sampling is repeatable from the engine's seed and never moves the
        # process's RNG (the trainer's, in a colocated worker)
        seed = sampling.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=sampling.max_tokens,
                do_sample=not greedy,
                # HF's warpers off (explicitly, not left unset for a generation config's default to fill):
                # the built-in engine's truncation runs as a processor instead
                temperature=None if greedy else 1.0,
                top_p=1.0,
                top_k=0,
                min_p=None,
                logits_processor=None if greedy else LogitsProcessorList([_Truncation(sampling)]),
                eos_token_id=stop_ids,
                pad_token_id=self.pad_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # raw logits, before any processor
        scale = 1.0 if greedy else sampling.temperature
        log_probs = F.log_softmax(logits / scale, -1).gather(-1, new[..., None])[..., 0]
        results = []
        for row, row_lp in zip(new, log_probs, strict=True):
            tokens = row.tolist()
            length, reason = len(tokens), "length"
            for j, token in enumerate(tokens):
                if token in stop_ids:
                    length, reason = j + 1, "stop"
                    break
            tokens = tokens[:length]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            if sampling.stop:  # keep the tokens up to the one that completed the stop string, as native does

                def decode(ids: list[int]) -> str:
                    return self.tokenizer.decode(ids, skip_special_tokens=False)

                kept = stop_string_prefix(decode, tokens, sampling.stop)
                if text_before_stop(decode(tokens[:kept]), sampling.stop) is not None:
                    length, tokens, reason = kept, tokens[:kept], "stop"
                    text = stopped_text(self.tokenizer, tokens, sampling.stop)
            results.append(GenerationResult(tokens, row_lp[:length].tolist(), text, reason))
        return results

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        params = dict(self.model.state_dict(keep_vars=True))
        loaded = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    raise KeyError(f"load_weights: the rollout model has no tensor named '{name}'")
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))
                loaded += 1
        return loaded

    def sleep(self) -> None:
        """Nothing persists between calls: HF's cache lives inside `generate`."""

    def wake(self) -> None:
        """See `sleep`."""


class _Truncation(LogitsProcessor):
    """The built-in engine's sampling distribution: logits / temperature, then min-p, top-k, top-p."""

    def __init__(self, sampling: SamplingParams) -> None:
        self.sampling = sampling

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        s = self.sampling
        return truncate_logits(scores.float() / s.temperature, s.top_k, s.top_p, s.min_p).to(scores.dtype)  # type: ignore[return-value]
