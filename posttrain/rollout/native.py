"""The built-in rollout engine: continuous batching over a slotted KV cache, with prefix sharing.

Requests wait in a queue; whenever cache slots are free, waiting prompts are prefilled (a prompt repeated
for the n samples of a GRPO group is prefilled once and its keys/values copied to the other slots) and
join the running batch. Each decode step advances every running sequence by one token; a finished
sequence frees its slot at once, so a long answer never holds the batch. A background thread runs the
loop, so `submit`/`agenerate` return futures and callers (agents) can interleave generation with tools.

Many LoRA adapters can sample on one engine (`enable_adapters`): each request names its adapter, and the
prefills and decode steps of requests of different adapters run as one batch over the shared base, each
row's adapter delta added on its own tokens (`MultiLora.routed`; the explicit API's tenants sample together
as they train together). A sequence never mixes adapters, so every row is what its adapter alone gives.

A vision-language model (Qwen2-VL) takes requests with images (`GenerationRequest.images`): the prefill runs the
model's vision module once per distinct prompt and its M-RoPE positions (`rollout.multimodal`), decoding then
continues at the model's rope delta. Prompts share a prefill only when their images are equal too. The image-pad
and video-pad tokens are never sampled (a response holding one would be read as an image placeholder by the
model); the reported log-prob is still over the whole vocabulary, as the trainer computes it.

`record_routing` (routing replay, `models.routing`): every prefill and decode step records the top-k experts
its routers chose, and each result carries those of its prompt and fed-back tokens (`routed_experts`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from posttrain.errors import ConfigError, ModelError, OutOfMemoryError, PosttrainError, is_out_of_memory
from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.models.attention import sliding_window
from posttrain.models.routing import RoutingRecorder
from posttrain.rollout.base import (
    AdapterRouter,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    context_error,
    eos_token_ids,
    results_or_raise,
    stopped_text,
)
from posttrain.rollout.decoder import SUPPORTED, DecoderRunner, supports
from posttrain.rollout.multimodal import check_images, image_token_ids, prefill_inputs, same_images
from posttrain.rollout.sampling import check_finite, sample_tokens

THREAD_NAME = "posttrain-rollout"


@dataclass
class _Sequence:
    request: GenerationRequest
    future: Future
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None
    text: str | None = None
    stop_reason: str = ""
    rope_delta: int = 0  # rotary position - cache position of generated tokens (M-RoPE image prompts)
    routing: list[torch.Tensor] = field(
        default_factory=list
    )  # (layers, positions, k) pieces (record_routing)

    @property
    def position(self) -> int:
        """Position of the last token (prompt tokens then generated ones)."""
        return len(self.request.prompt_ids) + len(self.tokens) - 1


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
        max_prefill_tokens: int = 4096,
        record_routing: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.model = load_causal_lm(model_path, dtype=dtype, attn_implementation=attn_implementation)
        self.model.to(self.device).eval().requires_grad_(False)
        if not supports(self.model):
            raise ConfigError(
                f"rollout.name=native supports {', '.join(SUPPORTED)}; {model_path} is "
                f"'{self.model.config.model_type}': use the HF engine (rollout.name=hf; posttrain eval --rollout hf; "
                "the explicit API: ApiWorkerSpec(rollout_name='hf'))"
            )
        self.tokenizer = load_tokenizer(model_path)
        self.runner = DecoderRunner(self.model)
        # never sampled: a vision-language model reads these tokens as image placeholders (rollout.multimodal)
        self.unsampled = torch.tensor(image_token_ids(self.model), dtype=torch.long, device=self.device)
        self.vision = getattr(self.model.config, "vision_config", None) is not None
        self.cache = self.runner.new_cache(dtype, self.device)
        self.max_batch_size = max_batch_size  # cache slots = sequences decoded together
        self.max_prefill_tokens = max_prefill_tokens
        text_config = getattr(self.model.config, "text_config", None) or self.model.config
        self.max_context = int(getattr(text_config, "max_position_embeddings", 1 << 30))
        self.window = sliding_window(self.model.config)  # within it, full attention is the same attention
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.eos_ids = eos_token_ids(self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id)
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        )
        self.sleeping = False
        self._lock = threading.Lock()  # one step or one weight load at a time
        self._mid_sequence = 0  # sequences decoded part way (their keys and values in the cache)
        self._wakeup = threading.Condition()
        self._incoming: deque[_Sequence] = deque()
        self._thread: threading.Thread | None = None
        self._closing = False
        self_ref = weakref.ref(self)
        atexit.register(lambda: (engine := self_ref()) is not None and engine.close())
        self.stats = {"prefill_tokens": 0, "decode_steps": 0, "generated_tokens": 0, "slot_moves": 0}
        self.adapters: AdapterRouter | None = None
        self.recorder = RoutingRecorder(self.model) if record_routing else None

    def enable_adapters(self, router: AdapterRouter) -> None:
        """LoRA adapters over this engine's model (`router`, e.g. a `MultiLora(engine.model)`), picked per
        request by `GenerationRequest.adapter`; requests without one sample the base weights."""
        self.adapters = router

    # ---- public API ----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerationResult]:
        """One response per prompt; raises (naming the request) if any request was invalid."""
        return results_or_raise(
            self.generate_requests([GenerationRequest(list(p), sampling) for p in prompts])
        )

    def generate_requests(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Results in request order; an invalid request gets an error result, the others complete.

        When no scheduler thread is running, the calling thread runs the scheduler itself until all work
        is done (same batching; no second thread competing for the cores).
        """
        return [future.result() for future in self.submit_many(requests, run_here=True)]

    def submit(self, request: GenerationRequest) -> Future:
        """Queue one request; the future resolves to its GenerationResult."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: Sequence[GenerationRequest], run_here: bool = False) -> list[Future]:
        """Queue requests together (so the scheduler sizes its batch for all of them).

        `run_here`: if no scheduler is running, run it in this thread until it is idle, then return.
        """
        futures: list[Future] = []
        sequences: list[_Sequence] = []
        for request in requests:
            future: Future = Future()
            futures.append(future)
            error = self._check(request)
            if error is not None:
                future.set_result(GenerationResult([], [], "", "error", error=error))
                continue
            generator = None
            if request.sampling.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(request.sampling.seed)
            sequences.append(_Sequence(request, future, generator=generator))
        if sequences:
            with self._wakeup:
                if self._closing:
                    raise PosttrainError("the rollout engine is closed")
                self._incoming.extend(sequences)
                inline = run_here and (self._thread is None or not self._thread.is_alive())
                if inline:
                    self._thread = threading.current_thread()  # later submits join this scheduler
                else:
                    self._ensure_thread()
                self._wakeup.notify()
            if inline:
                self._loop()
        return futures

    async def agenerate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> GenerationResult:
        """Awaitable generation of one request (runs on the engine's thread, not the event loop)."""
        return await asyncio.wrap_future(self.submit(GenerationRequest(list(prompt_ids), sampling)))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the model's parameters in place, one at a time (no second model copy)."""
        params = dict(self.model.state_dict(keep_vars=True))
        loaded = 0
        with self._lock, torch.no_grad():
            self._refuse_mid_sequence("load_weights", "its responses would mix two weight versions")
            for name, tensor in named_tensors:
                if name not in params:
                    raise KeyError(f"load_weights: the rollout model has no tensor named '{name}'")
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))
                loaded += 1
        return loaded

    def close(self) -> None:
        """Stop the engine's thread (at interpreter exit too: a thread left waiting aborts the process)."""
        with self._wakeup:
            self._closing = True
            self._wakeup.notify_all()
        thread = self._thread
        # a caller running the scheduler itself (generate_requests) returns on its own; join only ours
        if thread is not None and thread is not threading.current_thread() and thread.name == THREAD_NAME:
            thread.join(timeout=10)

    def sleep(self) -> None:
        """Free the KV cache while the trainer runs; `wake` (or the next request) reallocates it."""
        with self._lock:
            self._refuse_mid_sequence("sleep", "their cache would be freed under them")
            self.cache.free()
            self.sleeping = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _refuse_mid_sequence(self, what: str, why: str) -> None:
        """Between requests only (called with `_lock` held, so no step runs meanwhile)."""
        if self._mid_sequence:
            raise PosttrainError(
                f"{what}() while {self._mid_sequence} sequences are being generated: {why}; wait for their "
                "results first (partial rollouts take new weights between chunks)"
            )

    def wake(self) -> None:
        self.sleeping = False

    def cache_bytes(self) -> int:
        return self.cache.nbytes()

    # ---- validation ----------------------------------------------------------------------------
    def _check(self, request: GenerationRequest) -> str | None:
        try:
            request.sampling.validate()
        except ConfigError as exc:
            return str(exc)
        if len(request.prompt_ids) == 0:
            return "empty prompt"
        if request.adapter is not None and (
            self.adapters is None or request.adapter not in self.adapters.adapters
        ):
            return f"no adapter {request.adapter!r} on this engine"
        if request.images or self.vision:
            error = check_images(request.prompt_ids, request.images, self.model)
            if error is not None:
                return error
        total = len(request.prompt_ids) + request.sampling.max_tokens
        if total > self.max_context:
            return context_error(len(request.prompt_ids), request.sampling.max_tokens, self.max_context)
        if self.window is not None and total > self.window:
            return (
                f"prompt of {len(request.prompt_ids)} tokens + max_tokens {request.sampling.max_tokens} = {total} "
                f"is over the model's sliding attention window of {self.window} tokens, which rollout.name=native "
                "does not implement (it attends to the whole context): use rollout.name=hf, or shorter requests"
            )
        return None

    # ---- the scheduler loop --------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        """Start the scheduler thread if none is running (called with `_wakeup` held).

        The thread ends as soon as it has no work: a live thread that has run torch ops keeps its own
        OpenMP thread team, which slowed the trainer's passes on the same cores by ~50% (measured on 2
        cores); starting a thread per batch of requests costs far less.
        """
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        waiting: deque[_Sequence] = deque()
        running: list[_Sequence] = []
        free: list[int] = []
        taken: list[_Sequence] = []  # every sequence this loop holds, admitted part way ones included
        while True:
            with self._wakeup:
                if self._closing:
                    return
                if not self._incoming and not waiting and not running:
                    self._thread = None  # idle: end (see _ensure_thread); the next submit starts another
                    return
                while self._incoming:
                    waiting.append(self._incoming.popleft())
                    taken.append(waiting[-1])
            if len(taken) > 2 * (len(running) + len(waiting)) + 64:
                taken = [seq for seq in taken if not seq.future.done()]
            try:
                with self._lock:
                    if not running:
                        free = self._prepare_cache(waiting)
                    self._admit(waiting, running, free)
                    if running:
                        self._decode_step(running, free)
                    self._mid_sequence = len(running)
            except Exception as exc:  # a crash must reach every caller, not hang them
                self._mid_sequence = 0
                error = (
                    self._out_of_memory(exc, len(running) + len(waiting))
                    if is_out_of_memory(exc)
                    else exc
                    if isinstance(exc, ModelError)  # says what went wrong itself (non-finite logits)
                    else None
                )
                for seq in taken:  # a sequence being admitted is in neither list yet: it must not hang
                    if not seq.future.done():
                        seq.future.set_exception(
                            error or PosttrainError(f"rollout engine failed: {type(exc).__name__}: {exc}")
                        )
                running.clear()
                waiting.clear()
                taken.clear()

    def _out_of_memory(self, exc: BaseException, sequences: int) -> OutOfMemoryError:
        """What lowers generation memory: the KV cache holds prompt + response positions per sequence."""
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return OutOfMemoryError(
            f"rollout engine out of memory with {sequences} sequences to decode: lower rollout.max_batch_size "
            f"(now {self.max_batch_size} sequences decoded together) or data.max_response_length (the KV cache "
            f"holds prompt + response positions for each of them) [{detail}]"
        )

    def _prepare_cache(self, waiting: deque[_Sequence]) -> list[int]:
        """Size the cache for what is waiting (reusing it when big enough) and mark every slot free."""
        slots = max(self.cache.slots, min(self.max_batch_size, len(waiting)))
        longest = max(len(s.request.prompt_ids) + s.request.sampling.max_tokens for s in waiting)
        self.cache.ensure(slots, longest)
        return list(range(self.cache.slots - 1, -1, -1))

    def _admit(self, waiting: deque[_Sequence], running: list[_Sequence], free: list[int]) -> None:
        """Prefill waiting prompts into free slots; identical consecutive prompts share one prefill."""
        groups: list[list[_Sequence]] = []
        budget = self.max_prefill_tokens
        while waiting and free:
            seq = waiting[0]
            if len(seq.request.prompt_ids) + seq.request.sampling.max_tokens > self.cache.max_len:
                break  # needs a bigger cache: wait until the running batch drains
            prompt = seq.request.prompt_ids
            last = groups[-1][0].request if groups else None
            same_as_last = (
                last is not None
                and last.prompt_ids == prompt
                and last.adapter == seq.request.adapter
                and same_images(last.images, seq.request.images)
            )
            if not same_as_last and groups and budget < len(prompt):
                break
            waiting.popleft()
            seq.slot = free.pop()
            if same_as_last:
                groups[-1].append(seq)
            else:
                groups.append([seq])
                budget -= len(prompt)
        if not groups:
            return
        lengths = torch.tensor([len(g[0].request.prompt_ids) for g in groups], device=self.device)
        tokens = torch.full(
            (len(groups), int(lengths.max())), self.pad_id, dtype=torch.long, device=self.device
        )
        for i, group in enumerate(groups):
            tokens[i, : lengths[i]] = torch.tensor(group[0].request.prompt_ids, device=self.device)
        members = [seq for group in groups for seq in group]
        rows = torch.tensor([i for i, group in enumerate(groups) for _ in group], device=self.device)
        slots = torch.tensor([seq.slot for seq in members], device=self.device)
        try:
            embeds = rope = None
            if self.vision:  # image features in place of the image tokens; the model's M-RoPE positions
                images = [g[0].request.images for g in groups]
                embeds, rope, deltas = prefill_inputs(
                    self.model, self.runner.base.embed_tokens, tokens, lengths, images
                )
                for seq, row in zip(members, rows.tolist(), strict=True):
                    seq.rope_delta = int(deltas[row])
            # one prefill per distinct prompt, its keys/values written to the slot of every sample of it
            with self._adapter_routes([g[0].request.adapter for g in groups], tokens.shape[1]):
                with self._routing() as calls:
                    logits = self.runner.prefill(self.cache, tokens, lengths, slots, rows, embeds, rope)
            if calls is not None:  # (layers, groups, width, k): each sample gets its prompt's
                routes = RoutingRecorder.stacked(calls).unflatten(1, tokens.shape)
                for seq, row in zip(members, rows.tolist(), strict=True):
                    seq.routing.append(routes[:, row, : len(seq.request.prompt_ids)])
        except Exception:
            waiting.extendleft(reversed(members))  # so the loop's handler fails their futures too
            raise
        self.stats["prefill_tokens"] += int(lengths.sum())
        self._append_tokens(members, logits[rows], running, free)

    def _compact(self, running: list[_Sequence], free: list[int]) -> None:
        """Keep the running sequences in slots 0..len(running)-1, in slot order, so a decode step reads the
        cache through a view: each sequence past that prefix moves into a free slot inside it (a copy of its
        own keys and values, once; gathering every sequence's at each step cost more). Free slots stay
        sorted so that the next admitted prompt takes the lowest."""
        count = len(running)
        holes = sorted(slot for slot in free if slot < count)
        if holes:
            outside = sorted((s for s in running if s.slot >= count), key=lambda s: s.slot)
            taken = set(holes)
            for hole, seq in zip(holes, outside, strict=True):
                self.cache.move(seq.slot, hole, seq.position)
                free.append(seq.slot)
                seq.slot = hole
            free[:] = [slot for slot in free if slot not in taken]
            self.stats["slot_moves"] += len(holes)
        free.sort(reverse=True)  # `free.pop()` gives the lowest
        running.sort(key=lambda s: s.slot)

    def _decode_step(self, running: list[_Sequence], free: list[int]) -> None:
        self._compact(running, free)
        tokens = torch.tensor([s.tokens[-1] for s in running], device=self.device)
        positions = torch.tensor([s.position for s in running], device=self.device)
        rope = None
        if self.vision:
            rope = positions + torch.tensor([s.rope_delta for s in running], device=self.device)
        with self._adapter_routes([s.request.adapter for s in running], 1), self._routing() as calls:
            logits = self.runner.decode(self.cache, tokens, positions, None, rope)
        if calls is not None:
            routes = RoutingRecorder.stacked(calls)  # (layers, running, k)
            for i, seq in enumerate(running):
                seq.routing.append(routes[:, i : i + 1])
        self.stats["decode_steps"] += 1
        members = list(running)
        running.clear()
        self._append_tokens(members, logits, running, free)

    @contextlib.contextmanager
    def _routing(self) -> Iterator[list[list[torch.Tensor]] | None]:
        """The routers' choices in the pass inside (None when this engine does not record them)."""
        if self.recorder is None:
            yield None
            return
        with self.recorder.record() as calls:
            yield calls

    @contextlib.contextmanager
    def _adapter_routes(self, row_adapters: list[str | None], width: int) -> Iterator[None]:
        """The next pass over rows of `width` tokens runs each row under its adapter (None: the base)."""
        names = sorted({a for a in row_adapters if a is not None})
        if not names:
            yield
            return
        assert self.adapters is not None  # requests naming an adapter were checked in `_check`
        index = {name: k for k, name in enumerate(names)}
        slots = torch.tensor([-1 if a is None else index[a] for a in row_adapters], device=self.device)
        with self.adapters.routed(names):
            # the model's input is (rows, width) positions; its LM head sees one position per row
            self.adapters.set_routes(slots.repeat_interleave(width), slots)
            yield

    def _append_tokens(
        self, members: list[_Sequence], logits: torch.Tensor, running: list[_Sequence], free: list[int]
    ) -> None:
        """Sample one token for each sequence, then finish or keep running each one."""
        tokens, log_probs = self._sample(members, logits)
        for seq, token, log_prob in zip(members, tokens.tolist(), log_probs.tolist(), strict=True):
            seq.tokens.append(token)
            seq.log_probs.append(log_prob)
            self.stats["generated_tokens"] += 1
            if self._finished(seq):
                free.append(seq.slot)
                seq.future.set_result(self._result(seq))
            else:
                running.append(seq)

    def _sample(self, members: list[_Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows with the same sampling settings are sampled together; seeded requests use their own RNG."""
        check_finite(logits)
        tokens = torch.empty(len(members), dtype=torch.long, device=self.device)
        log_probs = torch.empty(len(members), dtype=torch.float32, device=self.device)
        batches: dict[tuple, list[int]] = {}
        for i, seq in enumerate(members):
            sp = seq.request.sampling
            key = (sp.temperature, sp.top_p, sp.top_k, sp.min_p, i if seq.generator is not None else -1)
            batches.setdefault(key, []).append(i)
        for (temperature, top_p, top_k, min_p, _), rows in batches.items():
            index = torch.tensor(rows, device=self.device)
            generator = members[rows[0]].generator or self.generator
            t, lp = sample_tokens(
                logits[index], temperature, top_p, top_k, generator, min_p=min_p, exclude=self.unsampled
            )
            tokens[index], log_probs[index] = t, lp.float()
        return tokens, log_probs

    def _finished(self, seq: _Sequence) -> bool:
        sp = seq.request.sampling
        if seq.tokens[-1] in self.eos_ids or seq.tokens[-1] in sp.stop_token_ids:
            seq.stop_reason = "stop"
            return True
        if sp.stop and self._stop_in_tail(seq.tokens, sp.stop):
            seq.text, seq.stop_reason = stopped_text(self.tokenizer, seq.tokens, sp.stop), "stop"
            return True
        if len(seq.tokens) >= sp.max_tokens:
            seq.stop_reason = "length"
            return True
        return False

    def _stop_in_tail(self, tokens: list[int], stops: tuple[str, ...] | list[str]) -> bool:
        """Whether a stop string occurs in the text of the response's last tokens. Checked after every token,
        a stop string first appears ending in the newest token, so a window of 4 tokens per character of the
        longest stop (a character may take 4 byte-level tokens) and a margin holds it: each check costs a
        bounded decode, not the whole response's (which made long responses quadratic: 2.6 s of decoding per
        4,096-token response)."""
        window = 4 * max(len(stop) for stop in stops) + 8
        tail = self.tokenizer.decode(tokens[-window:], skip_special_tokens=False)
        return any(stop in tail for stop in stops)

    def _result(self, seq: _Sequence) -> GenerationResult:
        text = (
            seq.text if seq.text is not None else self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        )
        routed = torch.cat(seq.routing, dim=1).transpose(0, 1).cpu() if seq.routing else None
        return GenerationResult(
            list(seq.tokens), list(seq.log_probs), text, seq.stop_reason, routed_experts=routed
        )
