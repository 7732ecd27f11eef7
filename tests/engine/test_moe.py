"""Mixtures of experts in the training engine: the router's load-balancing loss (equal to transformers' own,
counted on real tokens only, added with its coefficient), FSDP2 over the fused 3-D experts, LoRA."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

from posttrain.config.schema import LoraConfig, OptimConfig
from posttrain.data import keys
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.moe import RouterAuxLoss, load_balancing_loss, resolve_aux_loss_coef
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError
from posttrain.models import load_causal_lm, load_config
from posttrain.workers.losses import LossSpec, build_loss

from .helpers import grouped_rl_batch, synthetic_rl_batch, with_global_totals

PPO = LossSpec("ppo", {"use_kl_loss": False, "loss_agg_mode": "token-mean"})


def hf_aux_loss(model_dir: Path, batch, shared_prompts: bool = False) -> float:
    """transformers' own load-balancing loss on the padded rows (padding excluded by the attention mask);
    `shared_prompts`: each distinct prompt counted once, as the shared-prompt pass runs it once."""
    model = load_causal_lm(model_dir)
    mask = batch[keys.ATTENTION_MASK]
    with torch.no_grad():
        out = model(
            input_ids=batch[keys.INPUT_IDS],
            attention_mask=mask,
            position_ids=batch[keys.POSITION_IDS],
            output_router_logits=True,
        )
    if shared_prompts:
        prompt_width = mask.shape[1] - batch[keys.RESPONSES].shape[1]
        mask, seen = mask.clone(), set()
        for i, row in enumerate(batch[keys.INPUT_IDS][:, :prompt_width].tolist()):
            if tuple(row) in seen:
                mask[i, :prompt_width] = 0
            seen.add(tuple(row))
    return float(load_balancing_loss_func(out.router_logits, 4, 2, mask))


def test_load_balancing_loss_equals_transformers(tiny_moe_dir: Path) -> None:
    model = load_causal_lm(tiny_moe_dir)
    ids = torch.randint(3, 1000, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    expected = load_balancing_loss_func(out.router_logits, 4, 2)
    torch.testing.assert_close(load_balancing_loss(out.router_logits, 2), expected)
    # perfectly balanced routing gives k
    assert float(load_balancing_loss([torch.zeros(8, 4)], 2)) == pytest.approx(2.0)


@pytest.mark.parametrize("layout", ["packed", "shared_prompts", "padded"])
def test_captured_aux_loss_counts_real_tokens_only(tiny_moe_dir: Path, layout: str) -> None:
    """Packed rows (filler at each row's tail), shared prompts (one pass per prompt) and padded rows all give
    transformers' aux loss over the tokens the pass runs (padding and filler excluded)."""
    shared = layout == "shared_prompts"
    batch = grouped_rl_batch(prompts=3, n=2) if shared else synthetic_rl_batch(rows=6, vocab=1000)
    packed = layout != "padded"
    engine = TrainEngine(
        EngineConfig(
            model_path=str(tiny_moe_dir), remove_padding=packed, share_prompt=packed, pack_row_tokens=64
        )
    )
    assert engine.router_aux_loss_coef == pytest.approx(0.001)  # the model config's own
    assert engine.router_aux is not None
    with engine.router_aux.capture(), torch.no_grad():
        engine._log_probs(batch, 1.0, False)
    got = float(engine.router_aux.loss())
    assert got == pytest.approx(hf_aux_loss(tiny_moe_dir, batch, shared), abs=1e-5)


def engine_step(model_dir: Path, batch, coef: float | None, **fields) -> tuple[dict, TrainEngine]:
    config = EngineConfig(
        model_path=str(model_dir),
        optim=OptimConfig(lr=1e-3, grad_clip=0.0),
        micro_batch_size=4,
        router_aux_loss_coef=coef,
        **fields,
    )
    engine = TrainEngine(config)
    metrics = engine.forward_backward(with_global_totals(batch), build_loss(PPO, 1))
    return metrics, engine


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def router_grad(engine: TrainEngine) -> torch.Tensor:
    return next(
        full(p.grad) for n, p in engine.model.named_parameters() if n.endswith("layers.0.mlp.gate.weight")
    )


def test_forward_backward_adds_the_coefficient_times_the_aux_loss(tiny_moe_dir: Path) -> None:
    batch = grouped_rl_batch(prompts=3, n=2)  # shared prompts: the shared-prompt packing path too
    off, engine_off = engine_step(tiny_moe_dir, batch, 0.0)
    on, engine_on = engine_step(tiny_moe_dir, batch, 0.5)
    assert "router_aux_loss" not in off and engine_off.router_aux is None
    aux = on["router_aux_loss"]
    assert 2.0 <= aux < 2.5  # k = 2 when balanced; a fresh router is close to it
    assert on["loss"] == pytest.approx(off["loss"] + 0.5 * aux, abs=1e-5)
    assert on["actor/pg_loss"] == pytest.approx(off["actor/pg_loss"], abs=1e-6)
    # the aux term reaches the router's weights; with 0 it is absent, and the policy gradient is unchanged
    assert not torch.allclose(router_grad(engine_on), router_grad(engine_off))
    grads_off = {n: full(p.grad) for n, p in engine_off.model.named_parameters() if "embed" in n}
    none, engine_none = engine_step(tiny_moe_dir, batch, 0.0)
    for n, p in engine_none.model.named_parameters():
        if n in grads_off:
            torch.testing.assert_close(full(p.grad), grads_off[n])
    assert none["loss"] == off["loss"]


def test_gradient_checkpointing_keeps_the_aux_loss(tiny_moe_dir: Path) -> None:
    batch = synthetic_rl_batch(rows=4, vocab=1000)
    plain, engine_plain = engine_step(tiny_moe_dir, batch, 0.5)
    ckpt, engine_ckpt = engine_step(tiny_moe_dir, batch, 0.5, gradient_checkpointing=True)
    assert ckpt["router_aux_loss"] == pytest.approx(plain["router_aux_loss"], abs=1e-6)
    torch.testing.assert_close(router_grad(engine_ckpt), router_grad(engine_plain), atol=1e-6, rtol=1e-4)


def test_coefficient_checks(tiny_model_dir: Path, tiny_moe_dir: Path) -> None:
    dense, moe = load_config(tiny_model_dir), load_config(tiny_moe_dir)
    assert resolve_aux_loss_coef(dense, None) == 0.0
    assert resolve_aux_loss_coef(moe, None) == pytest.approx(0.001)
    assert resolve_aux_loss_coef(moe, 0.0) == 0.0
    with pytest.raises(ConfigError, match="model.router_aux_loss_coef=0.1 needs a mixture-of-experts"):
        resolve_aux_loss_coef(dense, 0.1)
    with pytest.raises(ConfigError, match="must be >= 0"):
        resolve_aux_loss_coef(moe, -1.0)
    with pytest.raises(ConfigError, match="no router logits"):
        RouterAuxLoss(load_causal_lm(tiny_model_dir), 2)
    frozen = TrainEngine(EngineConfig(model_path=str(tiny_moe_dir), trainable=False))
    assert frozen.router_aux is None  # the reference policy needs no aux loss


def test_lora_on_attention_trains_and_experts_are_refused(tiny_moe_dir: Path) -> None:
    batch = synthetic_rl_batch(rows=4, vocab=1000)
    lora = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "up_proj"))
    metrics, engine = engine_step(tiny_moe_dir, batch, 0.1, lora=lora)
    assert metrics["router_aux_loss"] > 0
    engine.optim_step()
    merged = dict(engine.named_tensors_for_rollout())
    assert "model.layers.0.self_attn.q_proj.weight" in merged
    assert "model.layers.0.mlp.shared_expert.up_proj.weight" in merged
    experts = replace(lora, target_modules=("q_proj", "gate_up_proj"))
    with pytest.raises(ConfigError, match="gate_up_proj.*fused 3-D expert"):
        TrainEngine(EngineConfig(model_path=str(tiny_moe_dir), lora=experts))


@pytest.mark.slow
def test_fsdp_two_ranks_equal_one_rank_with_the_aux_loss(
    tiny_moe_dir: Path, tmp_path: Path, ray_cluster: None
) -> None:
    """FSDP2 shards the fused (experts, out, in) tensors along the experts: 2 gloo ranks give 1 rank's loss,
    aux loss, gradient norm and updated weights."""
    from posttrain.controller.worker_group import RayWorkerGroup
    from posttrain.workers.actor_rollout_ref import ActorRolloutRefSpec, ActorRolloutRefWorker

    from .test_train_engine import assert_same_weights, exported, one_step

    engine = EngineConfig(
        model_path=str(tiny_moe_dir),
        optim=OptimConfig(lr=1e-3, grad_clip=1e9),
        micro_batch_size=2,
        router_aux_loss_coef=0.5,
    )
    spec = ActorRolloutRefSpec(engine=engine, with_rollout=False, with_ref=True, threads=1)
    groups = {
        world: RayWorkerGroup(ActorRolloutRefWorker, spec, world_size=world, role="actor", device="cpu")
        for world in (1, 2)
    }
    try:
        for seed in (3, 4):
            batch = synthetic_rl_batch(rows=8, seed=seed, vocab=1000)
            m1, m2 = (one_step(groups[world], batch) for world in (1, 2))
            assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-5)
            assert m1["actor/router_aux_loss"] == pytest.approx(m2["actor/router_aux_loss"], abs=1e-5)
            assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
        w1, w2 = (exported(groups[world], tmp_path / f"w{world}") for world in (1, 2))
    finally:
        for group in groups.values():
            group.shutdown()
    # transformers writes the fused experts back in the per-expert layout of Qwen's checkpoints
    assert w1["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (128, 128)
    assert_same_weights(w2, w1)


# Ulysses sequence parallelism: each rank routes one slice of every packed row's columns
SP_CASES = {
    # rows of odd width: the padding to a multiple of sp is filler that must not count
    "packed": {"pack_row_tokens": 25, "share_prompt": False},
    # shared prompts, recomputation in backward, and a token budget (several micro-batches)
    "shared_prompts_checkpointing": {
        "pack_row_tokens": 31,
        "share_prompt": True,
        "gradient_checkpointing": True,
        "max_token_len": 40,
    },
    # one packed row: rows are trimmed to their tokens (partition.trimmed_width), so its only filler is sp's
    # padding to an even width (a rank holding nothing but filler, whose aux-loss sums are zeros made on the
    # call's device, can no longer come out of the packers)
    "one_trimmed_row": {"pack_row_tokens": 256, "share_prompt": False},
}


def next_token_nll(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb) -> tuple:
    """The SFT layout's loss: mean negative log-likelihood of the tokens that have a context."""
    mask = mb[keys.ATTENTION_MASK].bool() & (mb[keys.ATTENTION_MASK].cumsum(1) > 1)
    return -(log_probs * mask).sum() / mask.sum(), {}


def no_main_loss(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb) -> tuple:
    """A main loss of zero: the gradients are the aux term's alone (its scale under sp cannot hide)."""
    return 0.0 * log_probs.sum(), {}


def all_grads(engine: TrainEngine) -> torch.Tensor:
    return torch.cat([full(p.grad).flatten() for p in engine.model.parameters() if p.grad is not None])


def sp_case(model_dir: str, overrides: dict, dist_info, sp: int) -> dict:
    """One RL update (response log-probs), one SFT pass (every next token) and one pass whose main loss is
    zero, with the aux loss at 0.5."""
    config = EngineConfig(
        model_path=model_dir,
        optim=OptimConfig(lr=1e-3, grad_clip=1e9),
        micro_batch_size=64,
        sequence_parallel_size=sp,
        router_aux_loss_coef=0.5,
        **overrides,
    )
    engine = TrainEngine(config, dist_info)
    rl = engine.forward_backward(
        with_global_totals(grouped_rl_batch(prompts=3, n=4, seed=5)), build_loss(PPO, 1)
    )
    rl_grads = all_grads(engine)
    engine.optim_step()
    plain = synthetic_rl_batch(rows=6, prompt_width=9, response_width=7, vocab=1000, seed=8)
    sft = engine.forward_backward(
        plain.select([keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS], []), next_token_nll
    )
    sft_grads = all_grads(engine)
    engine.optim_step()
    aux = engine.forward_backward(
        plain.select([keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS], []), no_main_loss
    )
    return {
        "rl": rl,
        "rl_grads": rl_grads,
        "sft": sft,
        "sft_grads": sft_grads,
        "aux": aux,
        "aux_grads": all_grads(engine),
    }


def _sp_rank_main(rank: int, port: int, model_dir: str, out: str) -> None:
    from posttrain.engine.distributed import DistInfo, shutdown_distributed

    torch.set_num_threads(1)
    info = DistInfo(rank=rank, world_size=2, master_port=port, device="cpu")
    results = {name: sp_case(model_dir, overrides, info, 2) for name, overrides in SP_CASES.items()}
    torch.save(results, f"{out}.{rank}")
    shutdown_distributed()


@pytest.mark.slow  # 18-29 s of worker processes on 2 cores; CI runs it with -m slow
def test_sp2_aux_loss_equals_the_unsliced_run(tiny_moe_dir: Path, tmp_path: Path) -> None:
    """sp=2 on 2 spawned gloo ranks (one dp group) against sp=1 in this process: the same aux loss on both
    ranks, the same total loss and the same gradients, router weights included."""
    import torch.multiprocessing as mp

    from posttrain.engine.distributed import free_port

    out = str(tmp_path / "sp2")
    mp.start_processes(
        _sp_rank_main, args=(free_port(), str(tiny_moe_dir), out), nprocs=2, start_method="spawn"
    )
    ranks = [torch.load(f"{out}.{rank}") for rank in (0, 1)]
    for name, overrides in SP_CASES.items():
        ref = sp_case(str(tiny_moe_dir), overrides, None, 1)
        assert ref["aux"]["loss"] == pytest.approx(0.5 * ref["aux"]["router_aux_loss"])
        for part in ("rl", "sft", "aux"):
            aux = ref[part]["router_aux_loss"]
            assert 1.9 < aux < 2.5, (name, part)  # top-2 of 4 experts near balance: about 2
            for got in ranks:
                assert got[name][part]["router_aux_loss"] == pytest.approx(aux, abs=1e-6), (name, part)
                assert got[name][part]["loss"] == pytest.approx(ref[part]["loss"], abs=1e-6), (name, part)
                torch.testing.assert_close(
                    got[name][f"{part}_grads"],
                    ref[f"{part}_grads"],
                    # fp32 sums in another order, through one AdamW step before the sft and aux passes: at most
                    # 2.9e-6 measured on one CPU, 7.1e-6 on another (an AMD EPYC; grads up to 0.87)
                    atol=2e-5,
                    rtol=1e-4,
                    msg=f"{name} {part}",
                )
