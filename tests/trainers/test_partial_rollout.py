"""Partial rollouts: weights published between the chunks of a generation; each token records its version."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from posttrain.config.schema import RLConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeRolloutEngine
from posttrain.trainers.async_rollout import RolloutProducer, staleness_metrics, versions_column
from posttrain.trainers.partial_rollout import continuation_batch, sample_in_chunks
from posttrain.workers.sampling import sample_batch

TEMPERATURE = 0.9


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Another policy: every floating tensor moved by noise large enough to change the log-probs."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: t + 0.05 * torch.randn(t.shape, generator=gen) if t.is_floating_point() else t.clone()
        for name, t in state.items()
    }


def recomputed(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log softmax(logits / T) of each response token, one unpadded sequence (what the trainer computes)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(1, torch.tensor(response)[:, None])[:, 0]


def test_weights_published_mid_generation_tag_each_token_with_its_version(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    engine = NativeRolloutEngine(str(tiny_model_dir), seed=3)
    base = {k: v.clone() for k, v in engine.model.state_dict().items()}
    weights = [base, perturbed(base, 1), perturbed(base, 2)]  # versions 0, 1, 2
    prompts = [tok.encode(f"What is {i}+{2 * i + 1}?", add_special_tokens=False) for i in range(4)]
    rows = continuation_batch(prompts, engine.pad_id).repeat(2, interleave=True)
    calls: list[int] = []

    def run_chunk(batch: Batch, sampling: SamplingParams) -> tuple[Batch, int]:
        # the trainer publishes a new version after each of the first two chunks
        version = min(len(calls), len(weights) - 1)
        engine.load_weights(weights[version].items())
        calls.append(version)
        return sample_batch(engine, batch, sampling), version

    sampling = SamplingParams(max_tokens=10, temperature=TEMPERATURE)
    out = sample_in_chunks(rows, sampling, 4, run_chunk, engine.pad_id, tok.decode)

    versions, mask = out[keys.ROLLOUT_VERSIONS], out[keys.RESPONSE_MASK]
    assert versions.shape == mask.shape == (8, 10)
    assert bool((versions[mask == 0] == -1).all()) and bool((versions[mask > 0] >= 0).all())
    for row in versions:
        tagged = row[row >= 0]
        assert bool((tagged[1:] >= tagged[:-1]).all()), "versions never go back within a response"
        assert tagged[: min(4, len(tagged))].eq(0).all(), "the first chunk is sampled by version 0"
    full = mask.sum(dim=1) == 10
    assert bool(full.any()), "some responses ran to the length limit"
    assert versions[full].tolist()[0] == [0] * 4 + [1] * 4 + [2] * 2, "chunks of 4: 0,0,0,0,1,1,1,1,2,2"

    # each token's behaviour log-prob is the log-prob under the weights of its own version (and not another's)
    models = []
    for state in weights:
        model = load_causal_lm(tiny_model_dir).eval()
        model.load_state_dict(state)
        models.append(model)
    prompt_lists = [p for p in prompts for _ in range(2)]
    checked = 0
    for i, prompt in enumerate(prompt_lists):
        n = int(mask[i].sum())
        response = out[keys.RESPONSES][i, :n].tolist()
        behaviour = out[keys.ROLLOUT_LOG_PROBS][i, :n]
        tags = versions[i, :n]
        under = [recomputed(model, prompt, response) for model in models]
        for v in tags.unique().tolist():
            at = tags == v
            torch.testing.assert_close(behaviour[at], under[v][at], atol=2e-4, rtol=1e-4)
            other = under[(v + 1) % len(models)][at]
            assert float((behaviour[at] - other).abs().max()) > 1e-3, "the versions' policies differ"
            checked += int(at.sum())
    assert checked == int(mask.sum())
    # the response text is the whole response, decoded once
    assert out.non_tensors[keys.RESPONSE_TEXT][0] == tok.decode(
        out[keys.RESPONSES][0, : int(mask[0].sum())].tolist(), skip_special_tokens=True
    )


def test_staleness_counts_the_oldest_token_of_each_sample() -> None:
    versions = torch.tensor(
        [
            [3, 3, 4, 4, -1],  # mixed: oldest 3
            [4, 4, 4, -1, -1],
            [2, 3, 3, 4, 4],  # oldest 2
        ]
    )
    batch = Batch.from_dict({keys.ROLLOUT_VERSIONS: versions})
    m = staleness_metrics(batch, version=4, k=2)
    assert m["async/staleness_max"] == 2.0
    assert m["async/staleness_mean"] == pytest.approx(1.0)
    assert [m[f"async/staleness_count_{a}"] for a in range(3)] == [1.0, 1.0, 1.0]
    assert m["async/mixed_version_samples"] == 2.0
    assert m["async/token_staleness_mean"] == pytest.approx(
        (1 + 1 + 0 + 0 + 0 + 0 + 0 + 2 + 1 + 1 + 0 + 0) / 12
    )


def test_a_batch_sampled_by_one_version_is_tagged_on_its_tokens_only() -> None:
    batch = Batch.from_dict({keys.RESPONSE_MASK: torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])})
    assert versions_column(batch, 5)[keys.ROLLOUT_VERSIONS].tolist() == [[5, 5, -1], [5, -1, -1]]


class SlowPool:
    """A rollout pool that takes `delay_s` per call and never stops early (every response fills its chunk)."""

    world_size = 1

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls: list[int] = []  # max_tokens of each call

    def sample(self, batch: Batch, sampling: SamplingParams) -> Batch:
        time.sleep(self.delay_s)
        self.calls.append(sampling.max_tokens)
        rows, n = len(batch), sampling.max_tokens
        return Batch.from_dict(
            {
                keys.RESPONSES: torch.full((rows, n), 7),
                keys.RESPONSE_MASK: torch.ones(rows, n),
                keys.ROLLOUT_LOG_PROBS: torch.zeros(rows, n),
            },
            non_tensors={keys.STOP_REASON: ["length"] * rows},
        )


class Prompts:
    """A dataloader of two-row prompt batches."""

    def __init__(self) -> None:
        self.position = 0

    def next_batch(self) -> Batch:
        self.position += 1
        return Batch.from_dict(
            {keys.INPUT_IDS: torch.tensor([[1, 2], [3, 4]]), keys.ATTENTION_MASK: torch.ones(2, 2).long()},
            non_tensors={keys.UID: [f"{self.position}-0", f"{self.position}-1"]},
        )

    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def test_the_producer_takes_weights_between_the_chunks_of_a_batch() -> None:
    """Weights handed over while a batch generates are loaded by the producer before its next chunk (the trainer
    does not wait for the chunk in flight, let alone the batch); the chunks after it are tagged with the new
    version, and the batch's staleness counts from its oldest token."""
    cfg = RLConfig()
    cfg = replace(
        cfg,
        rollout=replace(cfg.rollout, n=1),
        async_rl=replace(cfg.async_rl, staleness=1, partial_rollout=True, partial_chunk_tokens=2),
    )
    pool = SlowPool(delay_s=0.2)
    producer = RolloutProducer(cfg, pool, Prompts(), SamplingParams(max_tokens=8), 0, pad_id=0)  # type: ignore[arg-type]
    loads: list[tuple[str, int]] = []  # (thread, sample calls made before the load)
    try:
        first, _ = producer.take(0)  # batch 0: 4 chunks with version 0 (nothing published yet)
        assert first.batch[keys.ROLLOUT_VERSIONS].unique().tolist() == [0]
        time.sleep(0.3)  # batch 1 is generating (gated on version 0), its second chunk in flight
        start = time.perf_counter()
        producer.hand_weights(1, lambda: loads.append((threading.current_thread().name, len(pool.calls))))
        assert time.perf_counter() - start < 0.05, "the hand-over returns at once"
        producer.settle_weights()
        assert time.perf_counter() - start < 0.35, "loaded after the chunk in flight (0.2 s), not the batch"
        assert producer.published == 1 and loads == [("rollout-producer", loads[0][1])]
        assert loads[0][1] < 8, "loaded before batch 1's last chunk"
        second, metrics = producer.take(1)
        row = second.batch[keys.ROLLOUT_VERSIONS][0].tolist()
        assert row[0] == 0 and row[-1] == 1 and row == sorted(row), row
        assert second.version == 0 and metrics["async/staleness"] == 1.0
        assert metrics["async/weight_load_s"] >= 0.0
        m = staleness_metrics(second.batch, 1, 1)
        assert m["async/staleness_max"] == 1.0 and m["async/mixed_version_samples"] == 2.0
    finally:
        producer.stop()
    assert all(tokens == 2 for tokens in pool.calls)
