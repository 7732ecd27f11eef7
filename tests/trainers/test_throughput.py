"""Throughput, time shares and MFU of an RL step: the arithmetic on a known batch, and a real run logging them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.tracking.flops import forward_flops, generation_flops, train_flops
from posttrain.trainers.rl import RLTrainer
from posttrain.trainers.throughput import PerfMeter

MODEL = {
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 50,
    "tie_word_embeddings": True,
}
PHASES = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor")


def test_metrics_of_a_known_step() -> None:
    # 2 samples of one prompt: left-padded prompt of 3 real tokens, responses of 2 and 1 tokens
    attention = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]])
    batch = Batch.from_dict({keys.ATTENTION_MASK: attention, keys.RESPONSE_MASK: attention[:, 4:].float()})
    timings = {f"timing/{p}": 0.5 for p in PHASES} | {"timing/adv": 0.25, "timing/step": 4.0}
    meter = PerfMeter(
        actor_model=MODEL,
        critic_model=MODEL,
        actor_epochs=2,
        critic_epochs=1,
        actor_frozen=False,
        samples_per_prompt=2,
        peak_flops_per_worker=1e6,
        n_workers=2,
    )
    m = meter.metrics(batch, timings, {"throughput/gen_tokens_total": 3.0})
    assert m["throughput/tokens_per_s"] == 9 / 4.0
    assert m["throughput/gen_tokens_per_s"] == 3 / 0.5
    assert m["throughput/ref_tokens_per_s"] == 9 / 0.5
    assert m["throughput/update_actor_tokens_per_s"] == 2 * 9 / 0.5, "ppo_epochs passes are counted"
    assert m["throughput/update_critic_tokens_per_s"] == 9 / 0.5
    assert m["timing_share/adv"] == 0.25 / 4.0
    assert sum(v for k, v in m.items() if k.startswith("timing_share/")) == pytest.approx(3.25 / 4.0)
    lens = torch.tensor([5, 4])
    shape = {"prompt_lens": [3, 3], "samples_per_prompt": 2}  # the shared prompt counted once
    flops = {
        "gen": generation_flops(MODEL, [3, 3], [2, 1], samples_per_prompt=2),
        "old_log_prob": forward_flops(MODEL, lens, **shape),
        "ref": forward_flops(MODEL, lens, **shape),
        "values": forward_flops(MODEL, lens, head="value", **shape),
        "update_critic": train_flops(MODEL, lens, head="value", **shape),
        "update_actor": 2 * train_flops(MODEL, lens, **shape),
    }
    for phase, f in flops.items():
        assert m[f"perf/mfu/{phase}"] == pytest.approx(f / (0.5 * 2e6)), phase
    assert m["perf/mfu"] == pytest.approx(sum(flops.values()) / (4.0 * 2e6))
    assert m["perf/peak_flops_per_worker"] == 1e6


def test_asynchronous_generation_is_timed_by_the_producer_and_left_out_of_the_trainers_mfu() -> None:
    # k >= 1: timing/gen is the trainer's short wait for a batch generated on the rollout pool meanwhile
    attention = torch.ones(2, 4, dtype=torch.long)
    batch = Batch.from_dict({keys.ATTENTION_MASK: attention, keys.RESPONSE_MASK: attention[:, 2:].float()})
    meter = PerfMeter(MODEL, None, 1, 1, False, 1, 1e6, 1)
    timings = {"timing/gen": 0.001, "timing/update_actor": 1.0, "timing/step": 1.5}
    gen = {"throughput/gen_tokens_total": 4.0, "async/gen_seconds": 2.0, "async/staleness": 1.0}
    m = meter.metrics(batch, timings, gen)
    assert m["throughput/gen_tokens_per_s"] == 4.0 / 2.0, "the producer's generation time, not the wait"
    assert "perf/mfu/gen" not in m
    work = meter.phase_work(batch, 4.0, timings)
    assert set(work) == {"gen", "update_actor"}
    assert m["perf/mfu"] == pytest.approx(work["update_actor"][1] / (1.5 * 1e6)), (
        "the trainer's own work only"
    )


def test_phases_that_did_not_run_are_not_logged_and_no_peak_means_no_mfu() -> None:
    attention = torch.ones(2, 4, dtype=torch.long)
    batch = Batch.from_dict({keys.ATTENTION_MASK: attention, keys.RESPONSE_MASK: attention[:, 2:].float()})
    meter = PerfMeter(MODEL, None, 1, 1, False, 1, 0.0, 1)
    m = meter.metrics(batch, {"timing/gen": 1.0, "timing/old_log_prob": 1.0, "timing/step": 2.0}, {})
    assert m["throughput/gen_tokens_per_s"] == 4.0  # falls back to the batch's response tokens
    assert "throughput/ref_tokens_per_s" not in m and "throughput/update_actor_tokens_per_s" not in m
    assert not any(k.startswith("perf/") for k in m)


def test_a_real_step_logs_throughput_shares_and_mfu(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cfg = load_config(
        RLConfig,
        "rl",
        [
            "algorithm=ppo",  # critic: values and update_critic run too
            "actor.use_kl_loss=true",  # and the reference pass
            "actor.reuse_log_probs_on_policy=false",  # keep the old-log-prob pass
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arithmetic_data['train']}]",
            f"trainer.run_dir={run}",
            "data.train_batch_prompts=4",
            "data.max_response_length=6",
            "rollout.n=2",
            "trainer.total_steps=1",
            "trainer.backend=local",
            "trainer.val_before_train=false",
            "trainer.val_every=0",
            "trainer.loggers=[jsonl]",
        ],
    )
    RLTrainer(cfg).fit()
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    expected = [
        "throughput/tokens_per_s",
        "perf/mfu",
        "perf/peak_flops_per_worker",
        *(f"throughput/{p}_tokens_per_s" for p in PHASES),
        *(f"perf/mfu/{p}" for p in PHASES),
        *(f"timing_share/{p}" for p in (*PHASES, "adv", "sync")),
    ]
    for key in expected:
        assert key in row, key
        assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert row["perf/mfu"] < 1.0 and all(row[f"perf/mfu/{p}"] < 1.0 for p in PHASES)
    shares = sum(v for k, v in row.items() if k.startswith("timing_share/"))
    assert shares <= 1.0 + 1e-6
