"""Out-of-memory errors that name the settings that lower memory, instead of an allocator's message.

A failed allocation surfaces as `torch.OutOfMemoryError` (CUDA), a RuntimeError from the CPU allocator
("DefaultCPUAllocator: can't allocate memory", e.g. under an address-space limit) or a MemoryError; the
engine turns any of them into `posttrain.errors.OutOfMemoryError` listing the levers this engine does not use
yet, by their config keys. (When the kernel's OOM killer takes the process instead, nothing in it can
speak: the driver reports the worker as killed, see controller/failures.py.)
Imports nothing of the engine: the settings arrive as plain values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from posttrain.errors import OutOfMemoryError, is_out_of_memory


@dataclass(frozen=True)
class MemoryLevers:
    """An engine's memory-relevant settings; `section` is the config section holding its micro-batching
    (`actor`, `critic`, `optim`; "" = name the keys bare)."""

    section: str
    micro_batch_size: int
    max_token_len: int
    gradient_checkpointing: bool
    compute_dtype: str
    lora_rank: int
    offload: bool
    accelerator: bool
    token_budget: bool = True  # whether the section has max_token_len_per_worker (DPO, RM, distill do not)
    rows_per_unit: int = 1  # engine rows per configured unit: 2 when micro_batch_size counts pairs

    def advice(self, backward: bool) -> list[str]:
        """What to change, most effective first; only levers not already in use."""
        prefix = f"{self.section}." if self.section else ""
        if self.max_token_len > 0:
            steps = [
                f"lower {prefix}max_token_len_per_worker (now {self.max_token_len} tokens per micro-batch)"
            ]
        elif not self.token_budget:
            unit = "pairs" if self.rows_per_unit == 2 else "rows"
            count = self.micro_batch_size // self.rows_per_unit
            steps = [f"lower {prefix}micro_batch_size (now {count} {unit} per forward pass)"]
        else:
            steps = [
                f"lower {prefix}micro_batch_size (now {self.micro_batch_size} rows per forward pass) or set a "
                f"token budget per micro-batch with {prefix}max_token_len_per_worker"
            ]
        if backward and not self.gradient_checkpointing:
            steps.append("set model.gradient_checkpointing=true (recomputes activations in backward)")
        if self.accelerator and not self.compute_dtype:
            steps.append("set model.compute_dtype=bfloat16")
        if backward and self.lora_rank == 0:
            steps.append("train a LoRA adapter (model.lora.rank=16): no optimizer state for the base weights")
        if self.accelerator and not self.offload:
            steps.append("set model.offload=true (parameters and optimizer state in CPU memory)")
        return steps


@contextlib.contextmanager
def explain_out_of_memory(levers: MemoryLevers, what: str, rows: int, tokens: int) -> Iterator[None]:
    """Re-raise a failed allocation inside the block as OutOfMemoryError naming `what` ran on how much
    (`rows` sequences, `tokens` real tokens) and the settings that lower it."""
    try:
        yield
    except BaseException as exc:
        if not is_out_of_memory(exc):
            raise
        detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        advice = "; ".join(levers.advice(backward=what == "forward_backward"))
        raise OutOfMemoryError(
            f"out of memory in {what} on a micro-batch of {rows} sequences ({tokens} tokens): {advice} "
            f"[{detail}]"
        ) from exc
