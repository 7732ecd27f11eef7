"""A resumable, deterministic loader of `Batch`es over a prompt or SFT dataset.

The order of epoch `e` is a permutation drawn from numpy's Generator seeded with (seed, e), so the
position (epoch, batches consumed) is the whole state: a run resumed from `state_dict()` sees exactly
the batches the uninterrupted run would. Must not import engine, rollout, worker, Ray or model code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from posttrain.data.batch import Batch
from posttrain.errors import DataError

# Called as collate_fn(items, uids=[...]): bind the pad id with functools.partial, e.g.
# partial(collate_prompts, pad_token_id=tok.pad_token_id) or partial(collate_sft, pad_token_id=...).
CollateFn = Callable[..., Batch]


class IndexedDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict[str, Any]: ...


class PromptDataLoader:
    """Batches of `batch_size` rows; `for b in loader` runs the rest of the current epoch,
    `next_batch()` / `next(loader)` wraps to the next epoch by itself. uid of a row: f"{epoch}-{index}"."""

    def __init__(
        self,
        dataset: IndexedDataset,
        batch_size: int,
        collate_fn: CollateFn,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if batch_size <= 0:
            raise DataError(f"batch_size must be positive, got {batch_size}")
        if batch_size > len(dataset):
            raise DataError(f"batch_size={batch_size} is larger than the dataset ({len(dataset)} rows)")
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # batches already taken from the current epoch

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def _make_batch(self, order: np.ndarray, k: int) -> Batch:
        rows = order[k * self.batch_size : (k + 1) * self.batch_size]
        items = [self.dataset[int(i)] for i in rows]
        uids = [f"{self.epoch}-{it['index']}" for it in items]
        return self.collate_fn(items, uids=uids)

    def _roll_over_if_done(self) -> None:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0

    def __iter__(self) -> Iterator[Batch]:
        """The remaining batches of the current epoch; afterwards the loader is at the next epoch."""
        self._roll_over_if_done()
        order = self._order(self.epoch)
        while self.position < len(self):
            k = self.position
            self.position += 1  # count the batch as taken before handing it out, so state_dict is exact
            yield self._make_batch(order, k)
        self._roll_over_if_done()

    def next_batch(self) -> Batch:
        """The next batch, moving into the next epoch when the current one is used up."""
        self._roll_over_if_done()
        k = self.position
        self.position += 1
        return self._make_batch(self._order(self.epoch), k)

    __next__ = next_batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("epoch", "position"):
            if not isinstance(state.get(key), int) or state[key] < 0:
                raise DataError(
                    f"dataloader state: {key!r} must be a non-negative int, got {state.get(key)!r}"
                )
        self.epoch, self.position = state["epoch"], state["position"]
