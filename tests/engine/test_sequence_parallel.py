"""Ulysses sequence parallelism: sp=2 on 2 ranks (gloo) gives the unsliced run's log-probs, loss, gradients
and updated weights, with packing, shared prompts, entropy, gradient checkpointing and token budgets."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from posttrain.config.schema import OptimConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.distributed import DistInfo, free_port
from posttrain.engine.sequence_parallel import (
    SequenceParallel,
    check_sequence_parallel,
    kept_on_ranks,
    slice_rows,
)
from posttrain.engine.train_engine import EngineConfig, TrainEngine
from posttrain.errors import ConfigError

from .helpers import grouped_rl_batch, synthetic_rl_batch

CASES = {
    # row_tokens 25: packed rows of odd width, padded to a multiple of sp
    "packed": {"pack_row_tokens": 25, "share_prompt": False},
    "shared_prompts": {"pack_row_tokens": 40, "share_prompt": True},
    "checkpointing_token_budget": {
        "pack_row_tokens": 31,
        "share_prompt": True,
        "gradient_checkpointing": True,
        "max_token_len": 40,
    },
}


def fake_sp(rank: int, size: int = 2) -> SequenceParallel:
    return SequenceParallel(group=None, size=size, rank=rank)


def test_rows_are_padded_to_a_multiple_of_sp_and_sliced() -> None:
    ids = torch.arange(1, 11).view(2, 5)
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    halves = [slice_rows(ids, pos, fake_sp(r)) for r in (0, 1)]
    assert halves[0].padded_width == 6 and halves[0].width == 5
    assert halves[0].input_ids.tolist() == [[1, 2, 3], [6, 7, 8]]
    assert halves[1].input_ids.tolist() == [[4, 5, 0], [9, 10, 0]]  # filler id 0
    assert halves[1].position_ids.tolist() == [[0, 1, 0], [3, 4, 0]]  # the filler restarts at 0
    assert halves[0].full_position_ids.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 0]]


def test_kept_positions_are_split_by_owner_and_put_back_in_order() -> None:
    ids, pos = torch.zeros((2, 5), dtype=torch.long), torch.zeros((2, 5), dtype=torch.long)
    keep = torch.tensor([9, 0, 4, 3, 5])  # flat over width 5: (1,4) (0,0) (0,4) (0,3) (1,0)
    local = []
    for rank in (0, 1):
        sliced = slice_rows(ids, pos, fake_sp(rank))
        flat, counts, order = kept_on_ranks(keep, sliced, fake_sp(rank))
        local.append(flat.tolist())
        assert counts == [2, 3]
        # what each rank computes, gathered in rank order, then `order` restores keep's order
        gathered = torch.tensor([0.0, 5.0, 9.0, 4.0, 3.0])  # rank 0: keep 0, 5; rank 1: keep 9, 4, 3
        assert gathered[order].tolist() == [9.0, 0.0, 4.0, 3.0, 5.0]
    assert local == [[0, 3], [4, 1, 0]]  # local flat index over the 3 local columns of each row


@pytest.mark.parametrize(
    ("sp", "world", "heads", "attn", "remove_padding", "message"),
    [
        (3, 4, 6, "sdpa", True, "must divide the ranks"),
        (4, 4, 6, "sdpa", True, "must divide the model's 6 attention heads"),
        (2, 2, 4, "eager", True, "attn_implementation=sdpa"),
        (2, 2, 4, "sdpa", False, "remove_padding=true"),
        (0, 2, 4, "sdpa", True, ">= 1"),
    ],
)
def test_impossible_settings_are_rejected(
    sp: int, world: int, heads: int, attn: str, remove_padding: bool, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_sequence_parallel(sp, world, heads, attn, remove_padding)


def weighted_loss(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: Batch) -> tuple:
    """A policy-gradient-like loss with an entropy bonus, normalised over the whole batch's tokens."""
    mask = mb[keys.RESPONSE_MASK]
    total = mb.meta[keys.GLOBAL_TOKENS]
    assert entropy is not None
    loss = (-(log_probs * mb[keys.ADVANTAGES]) - 0.01 * entropy) * mask
    return loss.sum() / total, {}


def run_case(model_dir: str, overrides: dict, dist_info: DistInfo | None, sp: int) -> dict:
    config = EngineConfig(
        model_path=model_dir,
        optim=OptimConfig(lr=1e-3, grad_clip=1e9),
        micro_batch_size=64,
        sequence_parallel_size=sp,
    )
    engine = TrainEngine(replace(config, **overrides), dist_info)
    batch = grouped_rl_batch(prompts=3, n=4, seed=5)
    batch.meta[keys.GLOBAL_TOKENS] = float(batch[keys.RESPONSE_MASK].sum())
    batch.meta[keys.GLOBAL_SEQS] = len(batch)
    log_probs = engine.compute_log_prob(batch)
    metrics = engine.forward_backward(batch, weighted_loss, with_entropy=True)
    grads = torch.cat([p.grad.full_tensor().flatten() for p in engine.model.parameters()])
    engine.optim_step()
    weights = torch.cat([p.full_tensor().detach().flatten() for p in engine.model.parameters()])
    # and the full-sequence pass (the SFT layout)
    plain = synthetic_rl_batch(rows=6, prompt_width=9, response_width=7, vocab=1000, seed=8)
    plain = plain.select([keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS], [])
    next_token = engine.compute_log_prob(plain)
    return {
        "log_probs": log_probs,
        "loss": metrics["loss"],
        "grads": grads,
        "weights": weights,
        "next_token": next_token,
    }


def _rank_main(rank: int, port: int, model_dir: str, out: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    info = DistInfo(rank=rank, world_size=2, master_port=port, device="cpu")
    results = {name: run_case(model_dir, CASES[name], info, sp=2) for name in names}
    if rank == 0:
        torch.save(results, out)


def assert_sp2_equals_sp1(model_dir: Path, tmp_path: Path, names: list[str]) -> None:
    """Every case on 2 spawned ranks with sp=2 (one dp group: both ranks get the same batch) against the
    same case in this process on 1 rank."""
    out = tmp_path / "sp2.pt"
    mp.start_processes(
        _rank_main, args=(free_port(), str(model_dir), str(out), names), nprocs=2, start_method="spawn"
    )
    sliced = torch.load(out)
    for name in names:
        ref = run_case(str(model_dir), CASES[name], None, sp=1)
        got = sliced[name]
        torch.testing.assert_close(got["log_probs"], ref["log_probs"], atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(got["next_token"], ref["next_token"], atol=1e-5, rtol=0, msg=name)
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-6), name
        torch.testing.assert_close(got["grads"], ref["grads"], atol=1e-6, rtol=1e-4, msg=name)
        torch.testing.assert_close(got["weights"], ref["weights"], atol=1e-4, rtol=0, msg=name)
        assert (got["weights"] - ref["weights"]).abs().mean() < 1e-6, name


def test_sp2_on_two_ranks_equals_the_unsliced_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert_sp2_equals_sp1(tiny_model_dir, tmp_path, ["checkpointing_token_budget"])


@pytest.mark.slow
def test_sp2_equals_the_unsliced_run_with_plain_packing_and_shared_prompts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert_sp2_equals_sp1(tiny_model_dir, tmp_path, ["packed", "shared_prompts"])
