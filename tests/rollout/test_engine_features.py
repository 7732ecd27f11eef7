"""The built-in engine's scheduling features: continuous batching, prefix sharing, per-request seeds and
errors, the async API, cache reuse and sleep/wake; and the HF engine on the same interface."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from posttrain.rollout.base import GenerationRequest, SamplingParams
from posttrain.rollout.hf_engine import HFRolloutEngine
from posttrain.rollout.native import NativeRolloutEngine

from .test_native import prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def test_continuous_batching_with_few_slots_equals_one_at_a_time(tiny_model_dir: Path) -> None:
    """2 cache slots for 6 requests: sequences join as others finish, and the results do not change."""
    ps = prompts(tiny_model_dir)
    small = NativeRolloutEngine(str(tiny_model_dir), max_batch_size=2)
    mixed = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(5, 9, 17, 23, 31))
    batched = small.generate(ps, mixed)
    single = [small.generate([p], mixed)[0] for p in ps]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    assert small.cache.slots == 2


def test_sequences_that_finish_early_leave_no_hole_in_the_cache(tiny_model_dir: Path) -> None:
    """Sequences finishing at scattered steps: the ones after them move down into the freed slots (so a decode
    step reads the cache through a view), and every result, log-probs included, is what it is alone."""
    ps = prompts(tiny_model_dir) * 2
    engine = NativeRolloutEngine(str(tiny_model_dir), max_batch_size=8)
    mixed = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(5, 9, 17, 23, 31, 40, 44))
    batched = engine.generate(ps, mixed)
    assert engine.stats["slot_moves"] > 0
    assert len({len(r.token_ids) for r in batched}) > 1  # they did finish at different steps
    single = [engine.generate([p], mixed)[0] for p in ps]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    for b, one in zip(batched, single, strict=True):
        assert b.log_probs == pytest.approx(one.log_probs, abs=1e-5)


def test_a_group_prompt_is_prefilled_once(tiny_model_dir: Path) -> None:
    engine = NativeRolloutEngine(str(tiny_model_dir))
    p = prompts(tiny_model_dir)[0]
    results = engine.generate([p] * 8, SamplingParams(max_tokens=6, temperature=1.0, seed=None))
    assert engine.stats["prefill_tokens"] == len(p)  # not 8 * len(p)
    assert len({tuple(r.token_ids) for r in results}) > 1, "the 8 samples differ"


def test_per_request_seed_is_independent_of_the_batch(tiny_model_dir: Path) -> None:
    engine = NativeRolloutEngine(str(tiny_model_dir))
    ps = prompts(tiny_model_dir)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=42)
    alone = engine.generate_requests([GenerationRequest(ps[0], seeded)])[0]
    others = [GenerationRequest(p, SamplingParams(max_tokens=8, temperature=1.0)) for p in ps[1:]]
    together = engine.generate_requests([*others, GenerationRequest(ps[0], seeded)])[-1]
    assert alone.token_ids == together.token_ids


def test_bad_requests_fail_alone(tiny_model_dir: Path) -> None:
    engine = NativeRolloutEngine(str(tiny_model_dir))
    p = prompts(tiny_model_dir)[0]
    results = engine.generate_requests(
        [
            GenerationRequest(p, GREEDY),
            GenerationRequest(p, SamplingParams(max_tokens=0)),
            GenerationRequest([5] * engine.max_context, GREEDY),
            GenerationRequest(p, SamplingParams(top_p=1.5)),
            GenerationRequest(p, GREEDY),
        ]
    )
    assert [r.stop_reason != "error" for r in results] == [True, False, False, False, True]
    assert "max_tokens must be > 0" in results[1].error
    assert "exceeds the model context" in results[2].error
    assert "top_p must be in (0, 1]" in results[3].error
    assert results[0].token_ids == results[4].token_ids and results[0].token_ids


def test_async_api_interleaves_requests(tiny_model_dir: Path) -> None:
    engine = NativeRolloutEngine(str(tiny_model_dir))
    ps = prompts(tiny_model_dir)

    async def main() -> list:
        return await asyncio.gather(*(engine.agenerate(p, GREEDY) for p in ps))

    results = asyncio.run(main())
    assert [r.token_ids for r in results] == [r.token_ids for r in engine.generate(ps, GREEDY)]


def test_cache_is_reused_across_steps_and_freed_by_sleep(tiny_model_dir: Path) -> None:
    engine = NativeRolloutEngine(str(tiny_model_dir))
    ps = prompts(tiny_model_dir)
    before = engine.generate(ps, GREEDY)
    pointer = engine.cache.k.data_ptr()
    engine.generate(ps, GREEDY)
    assert engine.cache.k.data_ptr() == pointer, "same-size steps reuse the preallocated cache"
    assert engine.cache_bytes() > 0
    engine.sleep()
    assert engine.cache_bytes() == 0
    engine.wake()
    assert [r.token_ids for r in engine.generate(ps, GREEDY)] == [r.token_ids for r in before]


def test_min_p_keeps_only_likely_tokens(tiny_model_dir: Path) -> None:
    engine = NativeRolloutEngine(str(tiny_model_dir))
    ps = prompts(tiny_model_dir)
    greedy = engine.generate(ps, GREEDY)
    nearly_greedy = engine.generate(ps, SamplingParams(max_tokens=10, temperature=1.0, min_p=0.999, seed=1))
    assert [r.token_ids for r in nearly_greedy] == [r.token_ids for r in greedy]


def test_hf_engine_matches_native_greedy(tiny_model_dir: Path) -> None:
    ps = prompts(tiny_model_dir)
    native = NativeRolloutEngine(str(tiny_model_dir)).generate(ps, GREEDY)
    hf = HFRolloutEngine(str(tiny_model_dir)).generate(ps, GREEDY)
    assert [r.token_ids for r in hf] == [r.token_ids for r in native]
    for a, b in zip(hf, native, strict=True):
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) < 1e-4


def test_hf_engine_stops_at_a_stop_string_with_its_tokens_as_native_does(tiny_model_dir: Path) -> None:
    """The tokens (what training sees) end with the one that completed the stop string, not at eos: the
    reward scored the cut text, so tokens past it would be trained on unscored."""
    ps = prompts(tiny_model_dir)
    native_engine, hf_engine = NativeRolloutEngine(str(tiny_model_dir)), HFRolloutEngine(str(tiny_model_dir))
    full = native_engine.generate(ps, SamplingParams(max_tokens=16, temperature=0.0))
    cut_any = False
    for prompt, whole in zip(ps, full, strict=True):
        if len(whole.text) < 4:  # an untrained model: some prompts give special tokens only
            continue
        stop = SamplingParams(max_tokens=16, temperature=0.0, stop=(whole.text[2:4],))
        (native,) = native_engine.generate([prompt], stop)
        (hf,) = hf_engine.generate([prompt], stop)
        assert (hf.token_ids, hf.text, hf.stop_reason) == (native.token_ids, native.text, native.stop_reason)
        assert len(hf.log_probs) == len(hf.token_ids)
        cut_any |= len(hf.token_ids) < len(whole.token_ids)
    assert cut_any


def test_unsupported_settings_error_on_the_request() -> None:
    with pytest.raises(Exception, match="min_p must be in"):
        SamplingParams(min_p=1.5).validate()


def test_hf_engine_samples_from_its_own_seed_and_leaves_the_global_rng_alone(tiny_model_dir: Path) -> None:
    sampling = SamplingParams(max_tokens=8, temperature=1.0)
    ps = prompts(tiny_model_dir)[:2]
    runs = []
    for _ in range(2):
        engine = HFRolloutEngine(str(tiny_model_dir), seed=3)
        torch.manual_seed(123)
        runs.append([r.token_ids for r in engine.generate(ps, sampling)])
        assert torch.rand(1).item() == _first(123)  # the global RNG did not move
    assert runs[0] == runs[1]  # the engine's seed, not the process's RNG, decides the samples
    other = HFRolloutEngine(str(tiny_model_dir), seed=4)
    assert [r.token_ids for r in other.generate(ps, sampling)] != runs[0]
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    assert [r.token_ids for r in other.generate(ps, seeded)] == [
        r.token_ids for r in engine.generate(ps, seeded)
    ]


def test_hf_engine_seeded_requests_depend_on_their_seed_only(tiny_model_dir: Path) -> None:
    """As the built-in engine's: two requests with one seed in one call sample alike, and as they do alone
    (one generator drove the whole batch: neither equalled the other nor itself alone)."""
    engine = HFRolloutEngine(str(tiny_model_dir), seed=0)
    prompt = prompts(tiny_model_dir)[0]
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    requests = [GenerationRequest(prompt, seeded), GenerationRequest(prompt, seeded)]
    together = [r.token_ids for r in engine.generate_requests(requests)]
    (alone,) = engine.generate_requests([GenerationRequest(prompt, seeded)])
    assert together[0] == together[1] == alone.token_ids


def _first(seed: int) -> float:
    """The first `torch.rand(1)` after `torch.manual_seed(seed)`."""
    return torch.rand(1, generator=torch.Generator().manual_seed(seed)).item()


def test_hf_engine_samples_only_as_sampling_params_say(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`generate` fills unset settings from the directory's generation_config.json (a repetition penalty, say):
    they must not shape the distribution whose log-probs the engine reports; nor may a top-k it was not given."""
    import shutil

    penalised = tmp_path / "penalised"
    shutil.copytree(tiny_model_dir, penalised)
    path = penalised / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    config.update(repetition_penalty=1000.0, no_repeat_ngram_size=1)
    path.write_text(json.dumps(config))
    ps = prompts(tiny_model_dir)
    native = [r.token_ids for r in NativeRolloutEngine(str(tiny_model_dir)).generate(ps, GREEDY)]
    assert [r.token_ids for r in HFRolloutEngine(str(penalised)).generate(ps, GREEDY)] == native
    hot = SamplingParams(max_tokens=1, temperature=5.0)  # nearly flat over 1024 tokens
    first = HFRolloutEngine(str(tiny_model_dir)).generate([ps[0]] * 300, hot)
    assert len({r.token_ids[0] for r in first}) > 50  # no top-50 cut


def test_both_engines_stop_at_the_configs_and_the_tokenizers_eos() -> None:
    from posttrain.rollout.base import eos_token_ids

    assert eos_token_ids(151643, 151645) == [151643, 151645]  # an int in generation_config: both still stop
    assert eos_token_ids([1, 2], 2) == [1, 2] and eos_token_ids(None, 7) == [7]
