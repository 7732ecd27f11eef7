"""The built-in rollout engine against HF generate, the training engine's log-probs, and its own contract."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.rollout.base import GenerationRequest, SamplingParams
from posttrain.rollout.native import NativeRolloutEngine
from tests.address_space import linux_only, run_limited


def prompts(model_dir: Path, n: int = 6) -> list[list[int]]:
    tok = load_tokenizer(model_dir)
    texts = [f"What is {i * 7}+{i * 13 + 5}?" for i in range(n)]
    return [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        + [40 + i] * (i % 3)  # ragged lengths, so batches need padding
        for i, t in enumerate(texts)
    ]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> NativeRolloutEngine:
    return NativeRolloutEngine(str(tiny_model_dir), seed=0)


def test_greedy_equals_hf_generate(engine: NativeRolloutEngine, tiny_model_dir: Path) -> None:
    model = load_causal_lm(tiny_model_dir)
    ps = prompts(tiny_model_dir)
    ours = engine.generate(ps, SamplingParams(max_tokens=12, temperature=0.0))
    for prompt, result in zip(ps, ours, strict=True):
        hf = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=engine.eos_ids,
            pad_token_id=engine.pad_id,
        )[0, len(prompt) :].tolist()
        if hf and hf[-1] == engine.pad_id and engine.pad_id not in engine.eos_ids:
            hf = hf[: hf.index(engine.pad_id)]
        assert result.token_ids == hf[: len(result.token_ids)] and len(result.token_ids) == len(hf)


def test_batched_equals_one_at_a_time(engine: NativeRolloutEngine, tiny_model_dir: Path) -> None:
    ps = prompts(tiny_model_dir)
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    batched = engine.generate(ps, greedy)
    single = [engine.generate([p], greedy)[0] for p in ps]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]


def test_seeded_sampling_is_reproducible(engine: NativeRolloutEngine, tiny_model_dir: Path) -> None:
    ps = prompts(tiny_model_dir)
    a = engine.generate(ps, SamplingParams(max_tokens=10, temperature=1.0, seed=11))
    b = engine.generate(ps, SamplingParams(max_tokens=10, temperature=1.0, seed=11))
    c = engine.generate(ps, SamplingParams(max_tokens=10, temperature=1.0, seed=12))
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_top_k_one_is_greedy(engine: NativeRolloutEngine, tiny_model_dir: Path) -> None:
    ps = prompts(tiny_model_dir)
    greedy = engine.generate(ps, SamplingParams(max_tokens=8, temperature=0.0))
    top1 = engine.generate(ps, SamplingParams(max_tokens=8, temperature=0.7, top_k=1, seed=3))
    assert [r.token_ids for r in greedy] == [r.token_ids for r in top1]


def test_stop_string_cuts_the_text(engine: NativeRolloutEngine, tiny_model_dir: Path) -> None:
    p = prompts(tiny_model_dir)[:1]
    full = engine.generate(p, SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert len(full.text) >= 4
    stop = full.text[2:4]
    cut = engine.generate(p, SamplingParams(max_tokens=16, temperature=0.0, stop=(stop,)))[0]
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.stop_reason == "stop"
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]


def test_rollout_log_probs_match_training_engine(engine: NativeRolloutEngine, tiny_model_dir: Path) -> None:
    """The log-probs returned with each sampled token equal the FSDP engine's recomputation (fp32)."""
    from posttrain.data import keys
    from posttrain.data.batch import Batch
    from posttrain.engine.engine_config import EngineConfig
    from posttrain.engine.train_engine import TrainEngine

    ps = prompts(tiny_model_dir)
    temperature = 0.8
    results = engine.generate(ps, SamplingParams(max_tokens=10, temperature=temperature, seed=5))
    width_p, width_r = max(map(len, ps)), 10
    rows = len(ps)
    ids = torch.zeros((rows, width_p + width_r), dtype=torch.long)
    mask = torch.zeros_like(ids)
    response_mask = torch.zeros((rows, width_r))
    rollout_lp = torch.zeros((rows, width_r))
    for i, (p, r) in enumerate(zip(ps, results, strict=True)):
        ids[i, width_p - len(p) : width_p] = torch.tensor(p)
        mask[i, width_p - len(p) : width_p] = 1
        n = len(r.token_ids)
        ids[i, width_p : width_p + n] = torch.tensor(r.token_ids)
        mask[i, width_p : width_p + n] = 1
        response_mask[i, :n] = 1
        rollout_lp[i, :n] = torch.tensor(r.log_probs)
    batch = Batch.from_dict(
        {
            keys.INPUT_IDS: ids,
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
            keys.RESPONSES: ids[:, width_p:],
        }
    )
    trained = TrainEngine(EngineConfig(model_path=str(tiny_model_dir), trainable=False, micro_batch_size=4))
    recomputed = trained.compute_log_prob(batch, temperature=temperature)
    diff = ((recomputed - rollout_lp).abs() * response_mask).max().item()
    print(f"rollout vs training log-prob max abs diff: {diff:.3e}")
    assert diff < 1e-4


def test_load_weights_changes_output_and_restores(tiny_model_dir: Path) -> None:
    engine = NativeRolloutEngine(str(tiny_model_dir))
    p = prompts(tiny_model_dir)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    before = [r.token_ids for r in engine.generate(p, greedy)]
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    perturbed = ((k, v + 0.5 * torch.randn(v.shape, generator=gen)) for k, v in original.items())
    assert engine.load_weights(perturbed) == len(original)
    assert [r.token_ids for r in engine.generate(p, greedy)] != before
    engine.load_weights(original.items())
    engine.sleep()
    engine.wake()
    assert [r.token_ids for r in engine.generate(p, greedy)] == before
    with pytest.raises(KeyError, match="no tensor named 'nope'"):
        engine.load_weights([("nope", torch.zeros(1))])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(max_tokens=0), "max_tokens must be > 0"),
        (SamplingParams(temperature=-0.5), "temperature must be >= 0"),
        (SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (SamplingParams(top_k=-1), "top_k must be >= 0"),
    ],
)
def test_bad_sampling_params_are_named(
    engine: NativeRolloutEngine, params: SamplingParams, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        engine.generate([[1, 2, 3]], params)


def test_prompt_longer_than_context_names_the_request(engine: NativeRolloutEngine) -> None:
    too_long = [5] * engine.max_context
    with pytest.raises(ValueError, match="request 1: prompt of"):
        engine.generate([[5, 6], too_long], SamplingParams(max_tokens=4))


def test_no_scheduler_thread_outlives_its_work(engine: NativeRolloutEngine, tiny_model_dir: Path) -> None:
    """An idle thread that ran torch ops slows the trainer's OpenMP compute: none may linger."""
    import threading
    import time

    from posttrain.rollout.native import THREAD_NAME

    def scheduler_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == THREAD_NAME]

    batch = prompts(tiny_model_dir, 3)
    engine.generate(batch, SamplingParams(temperature=1.0, max_tokens=4))
    assert scheduler_threads() == []  # the batch API ran the scheduler in the calling thread
    future = engine.submit(GenerationRequest(batch[0], SamplingParams(temperature=0.0, max_tokens=4)))
    assert future.result(timeout=30).token_ids
    deadline = time.monotonic() + 5
    while scheduler_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler_threads() == []


NATIVE_OOM_CHILD = r"""
import sys
from posttrain.errors import OutOfMemoryError
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeRolloutEngine

engine = NativeRolloutEngine(sys.argv[1], max_batch_size=256)
engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))  # warm: lazy allocations done before the limit
limit_address_space(128)
try:  # a KV cache of 256 slots x ~1000 positions: 4 layers x 2 heads x 32 dims x 4 B x 2 (K, V) = 0.5 GiB
    engine.generate([[5, 6, 7]] * 256, SamplingParams(max_tokens=1000))
except OutOfMemoryError as exc:
    print("OOM:", exc)
"""


@linux_only
def test_out_of_memory_names_the_rollout_settings(tiny_model_dir: Path) -> None:
    out = run_limited(NATIVE_OOM_CHILD, str(tiny_model_dir))
    line = next((x for x in out.splitlines() if x.startswith("OOM:")), None)
    assert line is not None, f"no OutOfMemoryError; stdout: {out[-2000:]}"
    assert "rollout engine out of memory with 256 sequences" in line
    assert "lower rollout.max_batch_size (now 256 sequences decoded together)" in line
    assert "data.max_response_length" in line and "can't allocate memory" in line


def test_a_stop_string_late_in_a_long_response_keeps_the_tokens_up_to_the_one_completing_it(
    engine: NativeRolloutEngine, tiny_model_dir: Path
) -> None:
    """The engine looks for stop strings in its last tokens' text only (not the whole response's, which was
    quadratic); the result equals the whole-text answer: the shortest prefix whose text holds the stop."""
    from posttrain.rollout.base import stop_string_prefix

    tokenizer = load_tokenizer(tiny_model_dir)
    p = prompts(tiny_model_dir)[:1]
    sampling = SamplingParams(max_tokens=200, temperature=1.0, seed=11)
    full = engine.generate(p, sampling)[0]
    assert len(full.token_ids) > 60, "a long response to search in"
    late = tokenizer.decode(full.token_ids[50:], skip_special_tokens=True)
    stop = next(
        late[i : i + 3] for i in range(len(late) - 3) if late[i : i + 3] not in full.text[: -len(late)]
    )
    cut = engine.generate(p, SamplingParams(**{**sampling.__dict__, "stop": (stop,)}))[0]

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    assert cut.stop_reason == "stop" and len(cut.token_ids) > 50
    assert len(cut.token_ids) == stop_string_prefix(decode, full.token_ids, (stop,))
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert cut.text == full.text[: full.text.find(stop)]


def test_stopped_text_skips_special_tokens_and_a_special_token_stop(tiny_model_dir: Path) -> None:
    from posttrain.rollout.base import stopped_text

    tokenizer = load_tokenizer(tiny_model_dir)
    special = tokenizer.eos_token
    tokens = tokenizer.encode("12+3=15", add_special_tokens=False)
    with_special = [
        tokenizer.convert_tokens_to_ids(special),
        *tokens,
        tokenizer.convert_tokens_to_ids(special),
    ]
    assert stopped_text(tokenizer, with_special, ("=",)) == "12+3"  # the text without special tokens
    assert stopped_text(tokenizer, with_special, (special,)) == "12+3=15"  # a special token's text as a stop


def test_non_finite_logits_are_a_model_error_naming_them(tiny_model_dir: Path) -> None:
    from posttrain.errors import ModelError
    from posttrain.rollout.sampling import check_finite

    check_finite(torch.tensor([[0.0, float("-inf")]]))  # a masked token is fine
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ModelError, match="non-finite logits .* 1 of 2 sequences"):
            check_finite(torch.tensor([[0.0, 1.0], [bad, 0.0]]))
    diverged = NativeRolloutEngine(str(tiny_model_dir), seed=0)
    norm = diverged.model.model.norm.weight
    diverged.load_weights([("model.norm.weight", torch.full_like(norm, float("nan")))])
    for temperature in (1.0, 0.0):  # sampled (was an out-of-range index) and greedy (was NaN log-probs)
        with pytest.raises(ModelError, match="non-finite logits"):
            diverged.generate(
                prompts(tiny_model_dir)[:2], SamplingParams(max_tokens=3, temperature=temperature)
            )


def test_sleep_and_load_weights_wait_for_no_sequence_being_generated(tiny_model_dir: Path) -> None:
    import time

    from posttrain.errors import PosttrainError

    engine = NativeRolloutEngine(str(tiny_model_dir), seed=0)
    requests = [
        GenerationRequest(p, SamplingParams(max_tokens=400, temperature=1.0)) for p in prompts(tiny_model_dir)
    ]
    futures = engine.submit_many(requests)
    deadline = time.monotonic() + 60
    while engine.stats["decode_steps"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with pytest.raises(PosttrainError, match=r"sleep\(\) while \d+ sequences are being generated"):
        engine.sleep()
    with pytest.raises(PosttrainError, match=r"load_weights\(\) while .* mix two weight versions"):
        engine.load_weights([])
    assert all(len(f.result(timeout=120).token_ids) > 0 for f in futures)  # none of them was harmed
    engine.sleep()  # between requests: fine
    assert engine.cache_bytes() == 0
