"""`SamplingClient`: samples and prompt log-probs from one snapshot of weights, as tinker's.

A sampler is a rollout engine on the workers holding the weights it was made with; training afterwards does
not change them. It is closed on the workers when the client is garbage-collected (a new snapshot per RL
step does not pile up engines).
"""

from __future__ import annotations

import functools
import weakref

from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from posttrain.client.backend import Backend, ResolvedFuture, SampleRequest
from posttrain.client.batching import prompt_rows
from posttrain.client.model_inputs import ModelInputReader
from posttrain.client.prompt_scores import prompt_options
from posttrain.data import keys
from posttrain.models import load_text_config, load_tokenizer
from posttrain.rollout.base import SamplingParams as EngineSampling


def engine_sampling(params: types.SamplingParams, prompt_length: int, context: int) -> EngineSampling:
    """tinker's SamplingParams as the rollout engine's; what the engine cannot honour is a ValueError."""
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    if isinstance(params.stop, str):
        stop = (params.stop,)
    elif params.stop is not None:
        if len(params.stop) == 0:
            raise ValueError("stop=[] (nothing stops, not even the end-of-sequence token) is not supported")
        if all(isinstance(s, int) for s in params.stop):
            stop_ids = tuple(int(s) for s in params.stop)
        elif all(isinstance(s, str) for s in params.stop):
            stop = tuple(str(s) for s in params.stop)
        else:
            raise ValueError("stop must be strings or token ids, not both")
    max_tokens = params.max_tokens if params.max_tokens is not None else context - prompt_length
    if max_tokens <= 0 and params.max_tokens is not None:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_tokens <= 0 or prompt_length + max_tokens > context:
        raise ValueError(
            f"prompt ({prompt_length} tokens) + max_tokens ({max_tokens}) exceed the model's context ({context})"
        )
    sampling = EngineSampling(
        max_tokens=max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0 if params.top_k == -1 else params.top_k,
        stop=stop,
        stop_token_ids=stop_ids,
        seed=params.seed,
    )
    try:
        sampling.validate()
    except Exception as exc:
        raise ValueError(str(exc)) from None
    return sampling


@functools.lru_cache(maxsize=16)
def _model_facts(base_model: str) -> tuple[int, int | None, ModelInputReader]:
    """(context length, vocabulary size, the reader of its ModelInputs: image chunks through the model's own
    processor) of a base model, read once per process: an RL loop on the API makes a sampler every step, and
    parsing the config (and loading the processor) for each cost milliseconds per step."""
    config = load_text_config(base_model)
    context = int(getattr(config, "max_position_embeddings", 2048))
    vocab = getattr(config, "vocab_size", None)
    return context, None if vocab is None else int(vocab), ModelInputReader(base_model)


def context_length(base_model: str) -> int:
    """The model's context in tokens (its max_position_embeddings): what a sample without max_tokens may fill."""
    return _model_facts(base_model)[0]


class SamplingClient(ResolvedFuture):
    """Samples from one sampler (`sampler_id`) of a backend; `base_model` is the model directory."""

    def __init__(self, backend: Backend, sampler_id: str, base_model: str) -> None:
        self._backend = backend
        self.sampler_id = sampler_id
        self._base_model = base_model
        self._context, self._vocab, self._inputs = _model_facts(base_model)
        weakref.finalize(self, _close_sampler, backend, sampler_id)

    def get_base_model(self) -> str:
        return self._base_model

    def get_tokenizer(self):  # noqa: ANN201
        return load_tokenizer(self._base_model)

    def sample(
        self,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: types.TensorData | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> AwaitableConcurrentFuture[types.SampleResponse]:
        """`num_samples` responses to `prompt` (tokens, the sampled tokens' log-probs, stop reason). The
        prompt-side options (its own log-probs, top-k, target and alternative-token log-probs, the last n
        positions only) are tinker 0.38's, computed in one forward over the prompt (client/prompt_scores.py).
        On a vision-language model the prompt may hold ImageChunks (client/model_inputs.py): each is its
        image tokens, and the sampler's model sees the image.

        `topk_sample_logprobs` is not implemented: asking for it is a ValueError, never ignored.
        """
        check_sample_options(num_samples, topk_sample_logprobs)
        row = self._inputs.row(prompt, "prompt")
        if not row.tokens:
            raise ValueError("the prompt is empty")
        options = prompt_options(
            len(row.tokens), include_prompt_logprobs, topk_prompt_logprobs, target_prompt_logprobs,
            prompt_alt_tokens_k, prompt_logprobs_last_n, self._vocab,
        )  # fmt: skip
        sampling = engine_sampling(sampling_params, len(row.tokens), self._context)
        request = SampleRequest(row, num_samples, options, self._backend.new_id("sample"))
        return self._backend.submit_sample(self.sampler_id, sampling, request)

    def compute_logprobs(
        self, prompt: types.ModelInput, temperature: float = 1.0
    ) -> AwaitableConcurrentFuture[list[float | None]]:
        """log p(token i | tokens < i) of every prompt token (None at position 0), at `temperature`
        (tinker's takes none and means 1.0: a KL between policies sampled at T != 1 needs the tempered one)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        row = self._inputs.row(prompt, "prompt")
        group, sampler, rows = self._backend.group, self.sampler_id, self._backend.world_size

        def run() -> list[float | None]:
            scored = group.prompt_log_probs(sampler, prompt_rows(row, rows), temperature)
            values = scored[keys.API_LOGPROBS][0].tolist()
            return [None, *values[1:]]

        return self._backend.submit(run, f"sampler {sampler}")


def check_sample_options(num_samples: int, topk_sample_logprobs: int) -> None:
    """`sample`'s options checked before its prompt is read; `topk_sample_logprobs`, which no backend here
    implements, is a ValueError when asked for, never ignored."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if topk_sample_logprobs != 0:
        raise ValueError(
            "topk_sample_logprobs: top-k log-probs of sampled tokens are not supported by this backend; leave "
            "it at 0 (each sampled token's own log-prob is returned; score a sequence's top-k with "
            "topk_prompt_logprobs on it as the prompt)"
        )


def _close_sampler(backend: Backend, sampler_id: str) -> None:
    """Free a dropped client's sampler on the workers (after the calls already submitted)."""
    try:
        backend.close_sampler(sampler_id)
    except RuntimeError:  # the backend is closed (interpreter exit): its workers are gone with it
        pass
