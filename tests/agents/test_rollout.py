"""The agent loop on the tiny model: tokens in, tokens out; masks; limits; concurrency with a slow env."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from posttrain import client as tinker
from posttrain.agents.env import SingleTurnGroup
from posttrain.agents.rollout import EpisodeLimits, run_episode, run_groups
from posttrain.agents.samplers import ClientSampler, EngineSampler
from posttrain.agents.training_data import sequence_datum, sequences_batch, trajectory_sequences
from posttrain.agents.types import Completion, StepResult, Trajectory, Transition
from posttrain.client import types
from posttrain.data import keys
from posttrain.models import load_tokenizer
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeRolloutEngine


@dataclass
class EchoEnv:
    """Appends a fixed observation after each action; done after `turns` turns; `delay` s per step."""

    prompt: list[int]
    observation: list[int]
    turns: int = 3
    delay: float = 0.0
    eos: int = 2
    seen: list[list[int]] = field(default_factory=list)

    async def initial_observation(self) -> list[int]:
        self.context = list(self.prompt)
        return self.context

    async def step(self, action: list[int]) -> StepResult:
        self.seen.append(list(action))
        await asyncio.sleep(self.delay)
        if len(self.seen) >= self.turns:
            return StepResult(reward=1.0, done=True, metrics={"tool_calls": 1.0})
        self.context = self.context + action + self.observation
        return StepResult(reward=0.5, done=False, next_observation=self.context, metrics={"tool_calls": 1.0})

    def stop_tokens(self) -> list[int]:
        return [self.eos]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tinker.ServiceClient]:
    with tinker.ServiceClient(backend="local", root_dir=tmp_path_factory.mktemp("api")) as svc:
        yield svc


def test_sequences_keep_the_sampled_ids_and_mask_observations() -> None:
    a1, a2 = Completion([7, 8, 2], [-0.1, -0.2, -0.3], "stop"), Completion([9, 2], [-0.4, -0.5], "stop")
    prompt, tool = [1, 5, 6], [3, 4]
    trajectory = Trajectory(
        [Transition(prompt, a1, 0.0), Transition(prompt + a1.tokens + tool, a2, 1.0)], "completed"
    )
    (seq,) = trajectory_sequences(trajectory)  # the second observation extends the first: one sequence
    assert seq.tokens == [1, 5, 6, 7, 8, 2, 3, 4, 9, 2]
    assert seq.mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert seq.logprobs == [0, 0, 0, -0.1, -0.2, -0.3, 0, 0, -0.4, -0.5]
    datum = sequence_datum(seq, advantage=2.0)
    assert datum.loss_fn_inputs["advantages"].tolist() == [0, 0, 2, 2, 2, 0, 0, 2, 2]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == seq.tokens[1:]
    batch = sequences_batch([seq], pad_id=0)
    assert batch[keys.RESPONSES][0].tolist() == [7, 8, 2, 3, 4, 9, 2]
    assert batch[keys.RESPONSE_MASK][0].tolist() == [1, 1, 1, 0, 0, 1, 1]
    # an observation that does not extend the context starts a new sequence
    summary = Trajectory([Transition(prompt, a1, 0.0), Transition([1, 9], a2, 1.0)], "completed")
    assert [s.tokens for s in trajectory_sequences(summary)] == [[1, 5, 6, 7, 8, 2], [1, 9, 9, 2]]


def test_multi_turn_episodes_train_on_exactly_the_sampled_tokens(
    service: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    tok = load_tokenizer(tiny_model_dir)
    prompt = tok.encode("<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n")
    observation = tok.encode("\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n")
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=0)
    sampler = ClientSampler(tc.save_weights_and_get_sampling_client(), types.SamplingParams(temperature=1.0))
    envs = [EchoEnv(prompt, observation, eos=tok.eos_token_id) for _ in range(4)]
    limits = EpisodeLimits(max_turns=5, max_tokens_per_turn=6, max_total_tokens=256)

    async def main() -> list[Trajectory]:
        return list(await asyncio.gather(*(run_episode(e, sampler, limits) for e in envs)))

    for env, trajectory in zip(envs, asyncio.run(main()), strict=True):
        (seq,) = trajectory_sequences(trajectory)
        actions = [t.action.tokens for t in trajectory.transitions]
        assert actions == env.seen[: len(actions)]  # what the env saw is what was sampled
        model_tokens = [t for t, m in zip(seq.tokens, seq.mask, strict=True) if m == 1]
        assert model_tokens == [t for a in actions for t in a]
        assert seq.tokens[: len(prompt)] == prompt
        # the sampler's log-probs are the trained model's log-probs of exactly these tokens
        datum = sequence_datum(seq, 1.0)
        out = tc.forward([datum], "importance_sampling").result().loss_fn_outputs[0]["logprobs"].to_torch()
        mask = datum.loss_fn_inputs["advantages"].to_torch() != 0
        lp = datum.loss_fn_inputs["logprobs"].to_torch()
        assert mask.sum() == len(model_tokens)
        assert (out[mask] - lp[mask]).abs().max() < 1e-3
        assert trajectory.stop_reason in ("completed", "max_tokens")


def test_a_slow_environment_does_not_stall_the_others(tiny_model_dir: Path) -> None:
    engine = NativeRolloutEngine(str(tiny_model_dir), seed=0)
    sampler = EngineSampler(engine, SamplingParams(max_tokens=4, temperature=1.0))
    tok = load_tokenizer(tiny_model_dir)
    prompt = tok.encode("<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n")
    slow = EchoEnv(prompt, [5], turns=2, delay=1.5, eos=-1)
    fast = [EchoEnv(prompt, [5], turns=3, eos=-1) for _ in range(3)]
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=4, max_total_tokens=128)

    async def main() -> float:
        start = time.perf_counter()
        slow_task = asyncio.create_task(run_episode(slow, sampler, limits))
        await asyncio.gather(*(run_episode(e, sampler, limits) for e in fast))
        fast_done = time.perf_counter() - start
        await slow_task
        return fast_done

    assert asyncio.run(main()) < 1.5  # the fast episodes finished while the slow one waited


def test_limits_end_episodes_with_their_reason(tiny_model_dir: Path) -> None:
    engine = NativeRolloutEngine(str(tiny_model_dir), seed=0)
    sampler = EngineSampler(engine, SamplingParams(max_tokens=4, temperature=1.0))
    tok = load_tokenizer(tiny_model_dir)
    prompt = tok.encode("<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n")
    never_done = EchoEnv(prompt, [5], turns=99, eos=-1)
    t = asyncio.run(run_episode(never_done, sampler, EpisodeLimits(max_turns=2, max_tokens_per_turn=3)))
    assert t.stop_reason in ("max_turns", "max_tokens")
    room = len(prompt) + 2
    t = asyncio.run(run_episode(EchoEnv(prompt, [5] * 50, turns=99, eos=-1), sampler, EpisodeLimits(
        max_turns=9, max_tokens_per_turn=2, max_total_tokens=room)))  # fmt: skip
    assert t.stop_reason in ("context_overflow", "max_tokens")


def test_a_single_turn_cut_at_its_token_limit_is_recorded_as_max_tokens(tiny_model_dir: Path) -> None:
    """SingleTurnEnv calls every answer complete; one cut at max_tokens is still scored (as the non-agent
    path scores cut answers) but its stop reason says it was cut (agent/stop/max_tokens, clip_frac)."""
    engine = NativeRolloutEngine(str(tiny_model_dir), seed=0)
    sampler = EngineSampler(engine, SamplingParams(max_tokens=2, temperature=1.0))
    tok = load_tokenizer(tiny_model_dir)
    prompt = tok.encode("<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n")
    env = SingleTurnGroup(prompt, tok.decode, lambda text, gt: 0.5, "2", ()).make_envs(1)[0]
    t = asyncio.run(run_episode(env, sampler, EpisodeLimits(max_tokens_per_turn=2)))
    assert t.transitions[0].action.stop_reason == "length"  # no eos to stop at: cut at 2 tokens
    assert t.stop_reason == "max_tokens" and t.total_reward == 0.5


def test_single_turn_groups_are_the_same_loop(service: tinker.ServiceClient, tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=1)
    sampler = ClientSampler(tc.save_weights_and_get_sampling_client(), types.SamplingParams(temperature=1.0))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "2+2="}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok.encode(text, add_special_tokens=False)
    groups = [
        SingleTurnGroup(prompt, tok.decode, lambda text, gt: float(gt in text), "4", (tok.eos_token_id,))
        for _ in range(3)
    ]
    result, metrics = asyncio.run(run_groups(groups, 4, sampler, EpisodeLimits(max_tokens_per_turn=8)))
    assert [len(g) for g in result] == [4, 4, 4]
    assert all(len(t.transitions) == 1 for g in result for t in g)
    assert metrics["agent/turns_mean"] == 1.0
    cut = [t.transitions[0].action.stop_reason == "length" for g in result for t in g]
    assert metrics["agent/stop/completed"] == 1.0 - sum(cut) / len(cut)  # the rest were cut at 8 tokens
    assert metrics.get("agent/stop/max_tokens", 0.0) == sum(cut) / len(cut)
