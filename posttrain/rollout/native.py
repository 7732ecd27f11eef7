"""The built-in rollout engine: batched sampling with a KV cache on the HF model loaded from its directory.

Prompts are left-padded into batches of at most `max_batch_size` rows; each batch is prefilled once and
decoded token by token with the model's cache. Finished rows are masked until the batch ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from transformers import DynamicCache

from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.rollout.base import GenerationResult, SamplingParams
from posttrain.rollout.sampling import sample_tokens


class NativeRolloutEngine:
    """Generation for the hybrid engine: weights arrive in-process via `load_weights`."""

    def __init__(
        self,
        model_path: str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 256,
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
        self.eos_ids = self._eos_ids()
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        )
        self.sleeping = False

    def _eos_ids(self) -> list[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        return sorted(ids)

    # ---- interface -----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerationResult]:
        sampling.validate()
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"request {i}: empty prompt")
            if len(prompt) + sampling.max_tokens > self.max_context:
                raise ValueError(
                    f"request {i}: prompt of {len(prompt)} tokens + max_tokens {sampling.max_tokens} exceeds "
                    f"the model context of {self.max_context}"
                )
        generator = self.generator
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        results: list[GenerationResult] = []
        for start in range(0, len(prompts), self.max_batch_size):
            results.extend(
                self._generate_batch(prompts[start : start + self.max_batch_size], sampling, generator)
            )
        return results

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the model's parameters in place, one at a time (no second model copy)."""
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
        """The KV cache lives only inside `generate`, so sleeping frees it by construction."""
        self.sleeping = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        self.sleeping = False

    # ---- generation ----------------------------------------------------------------------------
    @torch.no_grad()
    def _generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, generator: torch.Generator
    ) -> list[GenerationResult]:
        rows, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((rows, width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            attention_mask[i, width - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        stop_ids = torch.tensor(sorted(set(self.eos_ids) | set(sampling.stop_token_ids)), device=self.device)

        cache = DynamicCache()
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
        next_pos = position_ids[:, -1] + 1
        finished = torch.zeros(rows, dtype=torch.bool, device=self.device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=self.device)
        tokens_out: list[torch.Tensor] = []
        logps_out: list[torch.Tensor] = []
        texts: list[str | None] = [None] * rows
        lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        for _ in range(sampling.max_tokens):
            tokens, log_probs = sample_tokens(
                logits, sampling.temperature, sampling.top_p, sampling.top_k, generator
            )
            tokens = torch.where(finished, torch.full_like(tokens, self.pad_id), tokens)
            tokens_out.append(tokens)
            logps_out.append(torch.where(finished, torch.zeros_like(log_probs), log_probs))
            lengths += (~finished).long()
            hit_stop = torch.isin(tokens, stop_ids) & ~finished
            stopped |= hit_stop
            finished |= hit_stop
            if sampling.stop:
                self._check_stop_strings(tokens_out, finished, stopped, texts, sampling.stop)
            if bool(finished.all()):
                break
            attention_mask = torch.cat(
                [attention_mask, torch.ones((rows, 1), dtype=torch.long, device=self.device)], 1
            )
            logits = self.model(
                input_ids=tokens[:, None],
                attention_mask=attention_mask,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            next_pos = next_pos + 1
        del cache
        token_matrix = torch.stack(tokens_out, 1).cpu()
        logp_matrix = torch.stack(logps_out, 1).cpu()
        lengths = lengths.cpu()
        return [
            self._result(
                token_matrix[i, : lengths[i]], logp_matrix[i, : lengths[i]], bool(stopped[i]), texts[i]
            )
            for i in range(rows)
        ]

    def _check_stop_strings(
        self,
        tokens_out: list[torch.Tensor],
        finished: torch.Tensor,
        stopped: torch.Tensor,
        texts: list[str | None],
        stop: tuple[str, ...],
    ) -> None:
        matrix = torch.stack(tokens_out, 1).cpu()
        for i in (~finished).nonzero().flatten().tolist():
            text = self.tokenizer.decode(matrix[i].tolist(), skip_special_tokens=False)
            cut = min((text.find(s) for s in stop if s in text), default=-1)
            if cut >= 0:
                texts[i] = text[:cut]
                finished[i] = True
                stopped[i] = True

    def _result(
        self, tokens: torch.Tensor, log_probs: torch.Tensor, stopped: bool, text: str | None
    ) -> GenerationResult:
        ids = tokens.tolist()
        if text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return GenerationResult(
            token_ids=ids,
            log_probs=log_probs.tolist(),
            text=text,
            stop_reason="stop" if stopped else "length",
        )
