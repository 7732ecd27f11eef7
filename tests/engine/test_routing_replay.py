"""Routing replay. R3: the built-in sampler records each token's top-k experts per sparse layer, the Batch
carries them aligned with input_ids, and the training engine forces its routers to them in every layout
(padded, packed, shared prompts), forward and backward. R2: the training engine's own log-prob pass records them
(every layout, micro-batches, token budgets, 2 FSDP ranks) and the update passes replay them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from posttrain.config.schema import OptimConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.train_engine import TrainEngine
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
        # every fed token's cell, counted once (a layer recomputed under checkpointing does not count again)
        assert metrics["replayed_tokens"] == int((batch[keys.ROUTED_EXPERTS] >= 0).all(-1).any(-1).sum()) > 0
        norms.append(engine.optim_step()["grad_norm"])
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)


def test_a_batch_of_another_model_is_refused(tiny_moe_dir: Path) -> None:
    batch = synthetic_rl_batch(rows=2, vocab=1000)
    rows, total = batch[keys.INPUT_IDS].shape
    batch.set(keys.ROUTED_EXPERTS, torch.zeros((rows, total, 3, 2), dtype=torch.int16))
    engine = TrainEngine(EngineConfig(model_path=str(tiny_moe_dir), trainable=False))
    engine.model.train()
    with pytest.raises(ConfigError, match="does not fit this model's 4 sparse layers of top-2"):
        engine.compute_log_prob(batch)
    assert engine.model.training  # the failed pass's eval mode does not outlive it


def hf_routing(model_dir: Path, batch: Batch) -> torch.Tensor:
    """(B, T, L, k) experts a plain transformers forward of `batch`'s padded rows chooses."""
    from posttrain.models import load_causal_lm

    model = load_causal_lm(model_dir)
    recorder = RoutingRecorder(model)
    with torch.no_grad(), recorder.record() as calls:
        model(input_ids=batch[keys.INPUT_IDS], attention_mask=batch[keys.ATTENTION_MASK])
    return RoutingRecorder.stacked(calls).unflatten(1, batch[keys.INPUT_IDS].shape).permute(1, 2, 0, 3)


def experts(routed: torch.Tensor) -> torch.Tensor:
    return routed.sort(-1).values  # a token's set of experts, whatever order the router listed them in


@pytest.mark.parametrize(
    "layout", [*LAYOUTS, "token_budget"]
)  # token_budget: micro-batches of rows out of order
def test_r2_records_what_a_plain_forward_chooses_and_replaying_it_changes_nothing(
    tiny_moe_dir: Path, layout: str
) -> None:
    batch = grouped_rl_batch(prompts=3, n=2)
    options = {"max_token_len": 24} if layout == "token_budget" else LAYOUTS[layout]
    engine = TrainEngine(
        EngineConfig(model_path=str(tiny_moe_dir), trainable=False, micro_batch_size=4, **options)
    )
    log_probs, routed = engine.compute_log_prob_and_routing(batch)
    mask = batch[keys.ATTENTION_MASK].bool()
    assert routed.shape == (*mask.shape, 4, 2) and routed.dtype == torch.int16
    assert bool((routed[~mask] == -1).all()) and bool((routed[mask] >= 0).all())
    assert torch.equal(experts(routed[mask]), experts(hf_routing(tiny_moe_dir, batch)[mask]))
    assert torch.equal(log_probs, engine.compute_log_prob(batch))  # recording does not change the pass
    replayed = batch.select()
    replayed.set(keys.ROUTED_EXPERTS, routed)
    assert float((engine.compute_log_prob(replayed) - log_probs).abs().max()) < 1e-6


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_r2_recording_a_replayed_pass_records_what_it_replayed(
    tiny_moe_dir: Path, tmp_path: Path, layout: str
) -> None:
    """Rows carrying routed_experts through compute_log_prob_and_routing (the old-log-prob pass of an R3 run
    that records for R2): the recording is the replayed experts, not the ones the moved router would choose."""
    batch = grouped_rl_batch(prompts=3, n=2)
    _, routed = TrainEngine(
        EngineConfig(model_path=str(tiny_moe_dir), trainable=False, micro_batch_size=4, **LAYOUTS[layout])
    ).compute_log_prob_and_routing(batch)
    moved = TrainEngine(
        EngineConfig(
            model_path=str(moved_router(tiny_moe_dir, tmp_path / "moved")),
            trainable=False,
            micro_batch_size=4,
            **LAYOUTS[layout],
        )
    )
    _, own = moved.compute_log_prob_and_routing(batch)
    mask = batch[keys.ATTENTION_MASK].bool()
    assert not torch.equal(experts(own[mask]), experts(routed[mask]))  # replaying has something to force
    replay = batch.select()
    replay.set(keys.ROUTED_EXPERTS, routed)
    _, recorded = moved.compute_log_prob_and_routing(replay)
    assert bool((recorded[~mask] == -1).all())
    assert torch.equal(experts(recorded[mask]), experts(routed[mask]))


def moved_router(model_dir: Path, out: Path, scale: float = 0.005) -> Path:
    """`model_dir` with noise on the last sparse layer's router: some tokens change experts there, and only
    there (no later layer), so a token's log-prob changes exactly when the position predicting it flips."""
    from posttrain.models import load_causal_lm

    model = load_causal_lm(model_dir)
    gate = model.model.layers[3].mlp.gate.weight
    with torch.no_grad():
        gate.add_(torch.randn(gate.shape, generator=torch.Generator().manual_seed(0)) * scale)
    model.save_pretrained(out)
    for f in model_dir.iterdir():
        if not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return out


def test_r2_after_a_weight_change_the_replayed_pass_differs_only_through_routing(
    tiny_moe_dir: Path, tmp_path: Path
) -> None:
    """Old weights record (the old-log-prob pass), new weights replay (the update): where the new router keeps a
    token's experts the replayed log-prob equals the unreplayed one, where it flips they differ; the update's
    loss sees the replayed log-probs (ratio 1 against them), not the unreplayed ones."""
    batch = with_global_totals(grouped_rl_batch(prompts=3, n=2))
    old = TrainEngine(EngineConfig(model_path=str(tiny_moe_dir), trainable=False, micro_batch_size=4))
    _, routed = old.compute_log_prob_and_routing(batch)
    new = TrainEngine(
        EngineConfig(
            model_path=str(moved_router(tiny_moe_dir, tmp_path / "moved")),
            optim=OptimConfig(lr=1e-3),
            micro_batch_size=2,
            router_aux_loss_coef=0.0,
        )
    )
    plain, own = new.compute_log_prob_and_routing(batch)
    replay = batch.select()
    replay.set(keys.ROUTED_EXPERTS, routed)
    replayed = new.compute_log_prob(replay)
    responses = batch[keys.RESPONSE_MASK].bool()
    width, total = responses.shape[1], routed.shape[1]
    flipped = (experts(own) != experts(routed)).any(-1)  # (B, T, L)
    assert not bool(flipped[..., :3].any())  # only the moved router's layer changes
    # response token j is predicted at position total - width + j - 1
    predicted_by_flip = flipped[:, total - width - 1 : total - 1, 3] & responses
    assert 0 < int(predicted_by_flip.sum()) < int(responses.sum())
    diff = (replayed - plain).abs()
    assert float(diff[responses & ~predicted_by_flip].max()) < 1e-6
    assert float(diff[predicted_by_flip].min()) > 1e-4
    # the update's log-probs are the replayed ones: ratio 1 against them, not against the unreplayed ones
    for b in (batch, replay):
        b.set(keys.ADVANTAGES, torch.randn(responses.shape, generator=torch.Generator().manual_seed(1)))
        b.set(keys.OLD_LOG_PROBS, replayed)
    metrics = new.forward_backward(replay, build_loss(PPO, 1))
    assert metrics["actor/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # mean = max = 1: every ratio is 1
    unreplayed = new.forward_backward(batch, build_loss(PPO, 1))
    assert abs(unreplayed["actor/ratio_max"] - 1) + abs(unreplayed["actor/ratio_mean"] - 1) > 1e-4


@pytest.mark.slow
def test_r2_on_two_fsdp_ranks_records_and_replays_as_one_rank(tiny_moe_dir: Path, ray_cluster: None) -> None:
    """The recording pass on 2 gloo ranks (each its half of the rows, packed, 2 micro-batches) gives 1 rank's
    experts and log-probs; the update replaying them on 2 ranks gives 1 rank's loss (ratio 1 on both)."""
    from posttrain.controller.worker_group import RayWorkerGroup
    from posttrain.workers.actor_rollout_ref import ActorRolloutRefSpec, ActorRolloutRefWorker

    engine = EngineConfig(
        model_path=str(tiny_moe_dir), optim=OptimConfig(lr=1e-3), micro_batch_size=2, router_aux_loss_coef=0.0
    )
    spec = ActorRolloutRefSpec(engine=engine, with_rollout=False, threads=1)
    batch = grouped_rl_batch(prompts=4, n=2)
    local_log_probs, local_routed = TrainEngine(
        EngineConfig(model_path=str(tiny_moe_dir), trainable=False)
    ).compute_log_prob_and_routing(batch)
    groups = {
        world: RayWorkerGroup(ActorRolloutRefWorker, spec, world_size=world, role="actor", device="cpu")
        for world in (1, 2)
    }
    try:
        metrics = {}
        for world, group in groups.items():
            old = group.call("forward", batch.select(FORWARD, []), "actor", 1.0, True)
            assert torch.equal(old[keys.ROUTED_EXPERTS], local_routed)
            assert float((old[keys.OLD_LOG_PROBS] - local_log_probs).abs().max()) < 1e-5
            update = with_global_totals(batch.union(old))
            advantages = torch.randn(
                update[keys.RESPONSE_MASK].shape, generator=torch.Generator().manual_seed(2)
            )
            update.set(keys.ADVANTAGES, advantages * update[keys.RESPONSE_MASK])
            metrics[world] = group.call("forward_backward", update, PPO)
    finally:
        for group in groups.values():
            group.shutdown()
    assert metrics[1]["loss"] == pytest.approx(metrics[2]["loss"], abs=1e-5)
    for m in metrics.values():
        assert m["actor/ratio_max"] == pytest.approx(1.0, abs=1e-5)


SP_LAYOUTS = {  # row_tokens 25: packed rows of odd width, padded to a multiple of sp
    "packed": {"pack_row_tokens": 25, "share_prompt": False},
    "shared_prompts": {"pack_row_tokens": 25, "share_prompt": True},
}


def sp_routing_case(moe_dir: str, moved_dir: str, routed_ref: torch.Tensor, dist_info, sp: int) -> dict:
    """Per layout: R2's recording, the replay of a given recording (log-probs, the recording of that replayed
    pass) and an update under it (loss, replayed tokens, gradients), on the moved router's weights."""
    import torch.distributed as dist

    out = {}
    for name, layout in SP_LAYOUTS.items():
        fields = {"micro_batch_size": 4, "sequence_parallel_size": sp, **layout}
        batch = with_global_totals(grouped_rl_batch(prompts=3, n=2))
        old = TrainEngine(EngineConfig(model_path=moe_dir, trainable=False, **fields), dist_info)
        _, routed = old.compute_log_prob_and_routing(batch)
        new = TrainEngine(
            EngineConfig(
                model_path=moved_dir, optim=OptimConfig(lr=1e-3), router_aux_loss_coef=0.0, **fields
            ),
            dist_info,
        )
        replay = batch.select()
        replay.set(keys.ROUTED_EXPERTS, routed_ref)
        replayed = new.compute_log_prob(replay)
        _, rerecorded = new.compute_log_prob_and_routing(replay)
        metrics = new.forward_backward(replay, build_loss(PPO, 1))
        grads = torch.cat(
            [
                (p.grad.full_tensor() if dist.is_initialized() else p.grad).flatten()
                for p in new.model.parameters()
                if p.grad is not None
            ]
        )
        out[name] = {
            "routed": routed,
            "replayed": replayed,
            "rerecorded": rerecorded,
            "loss": metrics["loss"],
            "replayed_tokens": metrics["replayed_tokens"],
            "grads": grads,
        }
    return out


def _sp_rank_main(rank: int, port: int, moe_dir: str, moved_dir: str, ref_path: str, out: str) -> None:
    from posttrain.engine.distributed import DistInfo, shutdown_distributed

    torch.set_num_threads(1)
    info = DistInfo(rank=rank, world_size=2, master_port=port, device="cpu")
    results = sp_routing_case(moe_dir, moved_dir, torch.load(ref_path), info, 2)
    if rank == 0:
        torch.save(results, out)
    shutdown_distributed()


def test_routing_replay_under_sequence_parallelism_equals_the_unsliced_run(
    tiny_moe_dir: Path, tmp_path: Path
) -> None:
    """sp=2 on 2 spawned gloo ranks (one dp group) against sp=1 in this process, packed rows of odd width and
    shared prompts: R2 records every real cell's experts (each rank's slice gathered back), replaying a
    recording gives the same log-probs, records what it replayed, and the update under it has the same loss
    and gradients."""
    import torch.multiprocessing as mp

    from posttrain.engine.distributed import free_port

    moved = moved_router(tiny_moe_dir, tmp_path / "moved")
    batch = grouped_rl_batch(prompts=3, n=2)
    _, routed_ref = TrainEngine(
        EngineConfig(model_path=str(tiny_moe_dir), trainable=False, micro_batch_size=4)
    ).compute_log_prob_and_routing(batch)
    ref_path, out = str(tmp_path / "routed.pt"), str(tmp_path / "sp2.pt")
    torch.save(routed_ref, ref_path)
    mp.start_processes(
        _sp_rank_main,
        args=(free_port(), str(tiny_moe_dir), str(moved), ref_path, out),
        nprocs=2,
        start_method="spawn",
    )
    sliced = torch.load(out)
    unsliced = sp_routing_case(str(tiny_moe_dir), str(moved), routed_ref, None, 1)
    mask = batch[keys.ATTENTION_MASK].bool()
    for name in SP_LAYOUTS:
        got, ref = sliced[name], unsliced[name]
        assert bool((got["routed"][~mask] == -1).all())
        same = (experts(got["routed"][mask]) == experts(ref["routed"][mask])).all(-1).float().mean()
        assert float(same) > 0.99, name  # discrete top-k of equal logits up to float noise
        torch.testing.assert_close(got["replayed"], ref["replayed"], atol=1e-5, rtol=0, msg=name)
        assert torch.equal(experts(got["rerecorded"][mask]), experts(routed_ref[mask])), name
        assert got["replayed_tokens"] == ref["replayed_tokens"] > 0, name
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-6), name
        torch.testing.assert_close(got["grads"], ref["grads"], atol=1e-6, rtol=1e-4, msg=name)
