"""Out of memory says which settings lower it (issue 19 item 7). On CPU the kernel's OOM killer would take the
process, so the child runs under an address-space limit (RLIMIT_AS): torch's allocation then fails with
"DefaultCPUAllocator: can't allocate memory", which the engine must turn into posttrain's error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.engine.memory import MemoryLevers, explain_out_of_memory
from posttrain.errors import OutOfMemoryError, is_out_of_memory
from tests.address_space import linux_only, run_limited

CHILD = r"""
import sys
import torch
from posttrain.config.schema import OptimConfig
from posttrain.data.batch import Batch
from posttrain.data import keys
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import OutOfMemoryError
from posttrain.workers.losses import LossSpec, build_loss
from tests.engine.helpers import synthetic_rl_batch, with_global_totals

cfg = EngineConfig(model_path=sys.argv[1], optim=OptimConfig(lr=1e-3), micro_batch_size=64, config_section="actor")
engine = TrainEngine(cfg)
loss = build_loss(LossSpec("ppo", {}), 1)
small = synthetic_rl_batch(rows=2, prompt_width=4, response_width=4, vocab=1000, seed=0)
small = small.union(Batch.from_dict({keys.OLD_LOG_PROBS: torch.zeros(2, 4)}))
engine.forward_backward(with_global_totals(small), loss)  # warm: lazy allocations done before the limit
big = synthetic_rl_batch(rows=64, prompt_width=512, response_width=512, vocab=1000, seed=1)
big = big.union(Batch.from_dict({keys.OLD_LOG_PROBS: torch.zeros(64, 512)}))
limit_address_space(256)
try:
    engine.forward_backward(with_global_totals(big), loss)  # logits alone: 64 x 1024 x 1024 x 4 B = 256 MiB
except OutOfMemoryError as exc:
    print("OOM:", exc)
"""


@linux_only
def test_cpu_allocation_failure_names_the_settings_to_lower(tiny_model_dir: Path) -> None:
    out = run_limited(CHILD, str(tiny_model_dir))
    line = next((x for x in out.splitlines() if x.startswith("OOM:")), None)
    assert line is not None, f"no OutOfMemoryError; stdout: {out[-2000:]}"
    assert "out of memory in forward_backward on a micro-batch of 64 sequences" in line
    assert "lower actor.micro_batch_size (now 64 rows" in line and "actor.max_token_len_per_worker" in line
    assert "model.gradient_checkpointing=true" in line
    assert "can't allocate memory" in line  # the allocator's own words, at the end


def levers(**changes: object) -> MemoryLevers:
    base = dict(
        section="critic", micro_batch_size=8, max_token_len=0, gradient_checkpointing=False, compute_dtype="",
        lora_rank=0, offload=False, accelerator=True,
    )  # fmt: skip
    return MemoryLevers(**{**base, **changes})  # type: ignore[arg-type]


def test_advice_names_only_the_levers_not_in_use() -> None:
    everything = " ".join(levers().advice(backward=True))
    for key in ("critic.micro_batch_size", "gradient_checkpointing", "compute_dtype", "lora.rank", "offload"):
        assert key in everything
    used = " ".join(
        levers(
            max_token_len=4096,
            gradient_checkpointing=True,
            compute_dtype="bfloat16",
            lora_rank=8,
            offload=True,
        ).advice(backward=True)  # fmt: skip
    )
    assert used == "lower critic.max_token_len_per_worker (now 4096 tokens per micro-batch)"
    assert "gradient_checkpointing" not in " ".join(levers().advice(backward=False))  # no backward, no lever


def test_pair_trainers_name_pairs_and_no_token_budget() -> None:
    """DPO and RM count micro-batches in pairs (two engine rows each) and have no token budget."""
    advice = levers(section="optim", micro_batch_size=16, token_budget=False, rows_per_unit=2).advice(True)
    assert advice[0] == "lower optim.micro_batch_size (now 8 pairs per forward pass)"
    assert "max_token_len_per_worker" not in " ".join(advice)


@pytest.mark.parametrize(
    "exc",
    [
        MemoryError(),
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    ],
)
def test_allocation_failures_are_translated(exc: BaseException) -> None:
    assert is_out_of_memory(exc)
    with pytest.raises(OutOfMemoryError, match=r"out of memory in compute_values .*critic\.micro_batch_size"):
        with explain_out_of_memory(levers(), "compute_values", rows=8, tokens=100):
            raise exc


def test_other_errors_pass_through() -> None:
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    with pytest.raises(ValueError, match="unrelated"):
        with explain_out_of_memory(levers(), "forward_backward", rows=1, tokens=1):
            raise ValueError("unrelated")
