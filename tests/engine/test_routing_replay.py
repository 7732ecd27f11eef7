"""Routing replay (R3): the built-in sampler records each token's top-k experts per sparse layer, the Batch
carries them aligned with input_ids, and the training engine forces its routers to them in every layout
(padded, packed, shared prompts), forward and backward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.config.schema import OptimConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.train_engine import EngineConfig, TrainEngine
from posttrain.errors import ConfigError
from posttrain.models.routing import RoutingRecorder
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeRolloutEngine
from posttrain.workers.losses import LossSpec, build_loss
from posttrain.workers.sampling import batch_prompts, concat_padded, results_batch

from .helpers import grouped_rl_batch, synthetic_rl_batch, with_global_totals

PPO = LossSpec("ppo", {"use_kl_loss": False, "loss_agg_mode": "token-mean"})
FORWARD = [keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, keys.RESPONSES]
LAYOUTS = {
    "padded": {"remove_padding": False, "share_prompt": False},
    "packed": {"share_prompt": False},
    "shared_prompts": {},
}


def prompt_rows(n_prompts: int, n: int, seed: int = 1) -> Batch:
    """`n_prompts` x `n` left-padded prompt rows (the n samples of a prompt adjacent, as a GRPO rollout)."""
    full = grouped_rl_batch(prompts=n_prompts, n=n, seed=seed)
    width = full[keys.INPUT_IDS].shape[1] - full[keys.RESPONSES].shape[1]
    order = sorted(range(len(full)), key=lambda i: full[keys.INPUT_IDS][i, :width].tolist())
    full = full.index(order)
    return Batch.from_dict(
        {k: full[k][:, :width] for k in (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS)}
    )


def sampled(model_dir: Path, prompts: Batch, max_tokens: int = 8, weights=None) -> Batch:
    sampler = NativeRolloutEngine(str(model_dir), seed=0, record_routing=True)
    if weights is not None:
        sampler.load_weights(weights)
    results = sampler.generate(batch_prompts(prompts), SamplingParams(max_tokens=max_tokens, seed=7))
    return results_batch(prompts, results, sampler.pad_id, max_tokens, 0.0, 1.0)


def gap(engine: TrainEngine, batch: Batch) -> float:
    diff = (engine.compute_log_prob(batch) - batch[keys.ROLLOUT_LOG_PROBS]).abs() * batch[keys.RESPONSE_MASK]
    return float(diff.max())


def test_the_sampler_records_every_fed_token_on_the_input_grid(tiny_moe_dir: Path) -> None:
    prompts = prompt_rows(3, 2)
    batch = sampled(tiny_moe_dir, prompts)
    routed = batch[keys.ROUTED_EXPERTS]
    rows, total = batch[keys.INPUT_IDS].shape
    assert routed.shape == (rows, total, 4, 2) and routed.dtype == torch.int16  # 4 sparse layers, top-2
    mask = batch[keys.ATTENTION_MASK].bool()
    fed = mask.clone()
    fed[torch.arange(rows), mask.cumsum(1).argmax(1)] = False  # the last response token is never fed back
    assert bool((routed[fed] >= 0).all()) and bool((routed[~fed] == -1).all())
    assert bool((routed[fed] < 4).all())
    # the experts a plain HF forward of the same tokens picks (fp32: no near-ties on this model)
    from posttrain.models import load_causal_lm

    model = load_causal_lm(tiny_moe_dir)
    recorder = RoutingRecorder(model)
    with torch.no_grad(), recorder.record() as calls:
        model(input_ids=batch[keys.INPUT_IDS], attention_mask=batch[keys.ATTENTION_MASK])
    hf = RoutingRecorder.stacked(calls).unflatten(1, (rows, total)).permute(1, 2, 0, 3)
    same = (hf[fed].sort(-1).values == routed[fed].sort(-1).values).all(-1).float().mean()
    assert float(same) > 0.99
    # concatenating rollouts of different prompt widths keeps each token's experts with it
    both = concat_padded([batch, sampled(tiny_moe_dir, prompt_rows(1, 2, seed=5))], pad_id=0)
    assert both[keys.ROUTED_EXPERTS].shape[1] == both[keys.INPUT_IDS].shape[1]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replaying_the_own_routing_changes_nothing_and_other_routing_is_forced(
    tiny_moe_dir: Path, layout: str
) -> None:
    batch = sampled(tiny_moe_dir, prompt_rows(3, 2))
    engine = TrainEngine(
        EngineConfig(model_path=str(tiny_moe_dir), trainable=False, micro_batch_size=4, **LAYOUTS[layout])
    )
    plain = engine.compute_log_prob(batch.select(FORWARD, []))
    replayed = engine.compute_log_prob(batch)
    mask = batch[keys.RESPONSE_MASK]
    assert float(((replayed - plain) * mask).abs().max()) < 1e-5
    assert gap(engine, batch) < 1e-4
    # other experts than the router's: the log-probs follow the recorded ones
    shifted = batch.select()
    routed = shifted[keys.ROUTED_EXPERTS]
    shifted.set(keys.ROUTED_EXPERTS, torch.where(routed >= 0, (routed + 1) % 4, routed))
    assert float(((engine.compute_log_prob(shifted) - plain) * mask).abs().max()) > 1e-2


def test_the_update_replays_forward_and_backward(tiny_moe_dir: Path) -> None:
    """forward_backward under replay: the loss's log-probs are the replayed ones, with gradient checkpointing
    (the recomputed layers replay too) the same gradients."""
    batch = sampled(tiny_moe_dir, prompt_rows(2, 2))
    batch.set(keys.ADVANTAGES, torch.randn(batch[keys.RESPONSE_MASK].shape) * batch[keys.RESPONSE_MASK])
    batch.set(keys.OLD_LOG_PROBS, batch[keys.ROLLOUT_LOG_PROBS])
    routed = batch[keys.ROUTED_EXPERTS]
    batch.set(keys.ROUTED_EXPERTS, torch.where(routed >= 0, (routed + 1) % 4, routed))
    norms = []
    for checkpointing in (False, True):
        engine = TrainEngine(
            EngineConfig(
                model_path=str(tiny_moe_dir),
                optim=OptimConfig(lr=1e-3, grad_clip=0.0),
                micro_batch_size=4,
                gradient_checkpointing=checkpointing,
                router_aux_loss_coef=0.0,
            )
        )
        metrics = engine.forward_backward(with_global_totals(batch), build_loss(PPO, 1))
        assert metrics["actor/ratio_max"] > 1.01  # forced experts: not the sampler's own log-probs
        norms.append(engine.optim_step()["grad_norm"])
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)


def test_a_batch_of_another_model_is_refused(tiny_moe_dir: Path) -> None:
    batch = synthetic_rl_batch(rows=2, vocab=1000)
    rows, total = batch[keys.INPUT_IDS].shape
    batch.set(keys.ROUTED_EXPERTS, torch.zeros((rows, total, 3, 2), dtype=torch.int16))
    engine = TrainEngine(EngineConfig(model_path=str(tiny_moe_dir), trainable=False))
    with pytest.raises(ConfigError, match="does not fit this model's 4 sparse layers of top-2"):
        engine.compute_log_prob(batch)
