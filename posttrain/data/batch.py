"""`Batch`: the one container that flows from the dataloader to the update, and between Ray processes.

Tensors live in a batch-first `TensorDict`; per-row Python objects (strings, dicts) live in numpy
object arrays of the same length; `meta` holds batch-level values. Column names: `posttrain.data.keys`.
This module must not import engine, rollout, worker, Ray or model code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from posttrain.errors import DataError

Index = Sequence[int] | torch.Tensor | np.ndarray | slice | int


def _object_array(values: Sequence | np.ndarray) -> np.ndarray:
    """A 1-D object array holding `values` as they are (numpy would turn equal-length lists into 2-D)."""
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


def _equal(a: Any, b: Any) -> bool:
    """Value equality for tensors, arrays and plain objects (used to detect conflicting columns/meta)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a_arr, b_arr = np.asarray(a, dtype=object), np.asarray(b, dtype=object)
        return a_arr.shape == b_arr.shape and all(
            _equal(x, y) for x, y in zip(a_arr.ravel(), b_arr.ravel(), strict=True)
        )
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects whose == is not a plain bool are treated as different
        return False


def _numpy_index(idx: Index) -> slice | np.ndarray:
    """The same row selection as `idx`, in a form numpy object arrays accept."""
    if isinstance(idx, slice):
        return idx
    if isinstance(idx, torch.Tensor):
        return idx.cpu().numpy()
    return np.asarray(idx)


@dataclass(eq=False)
class Batch:
    """Tensors (`TensorDict`, batch_size=[B]) + non-tensor columns (object arrays of length B) + meta."""

    tensors: TensorDict
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.tensors.batch_size) != 1:
            raise DataError(f"Batch tensors must have batch_size [B], got {list(self.tensors.batch_size)}")
        n = len(self)
        for key, arr in self.non_tensors.items():
            if not isinstance(arr, np.ndarray) or arr.dtype != object or arr.ndim != 1:
                self.non_tensors[key] = arr = _object_array(arr)
            if len(arr) != n:
                raise DataError(f"non-tensor {key!r} has {len(arr)} rows, the batch has {n}")

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Sequence] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Batch:
        """Build a Batch from plain columns; every column must have the same number of rows."""
        tensors = dict(tensors or {})
        non_tensors = {k: _object_array(v) for k, v in (non_tensors or {}).items()}
        lengths = {f"tensor {k!r}": _rows(k, v) for k, v in tensors.items()}
        lengths |= {f"non-tensor {k!r}": len(v) for k, v in non_tensors.items()}
        if len(set(lengths.values())) > 1:
            detail = ", ".join(f"{k}: {n}" for k, n in lengths.items())
            raise DataError(f"Batch columns have different numbers of rows ({detail})")
        n = next(iter(lengths.values()), 0)
        return cls(TensorDict(tensors, batch_size=[n]), non_tensors, dict(meta or {}))

    # --- access -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    def __getitem__(self, key: str | Index) -> Any:
        """`b["key"]` is a column (tensor or object array); any other index selects rows (see `index`)."""
        if not isinstance(key, str):
            return self.index(key)
        if key in self.tensors.keys():
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise DataError(f"Batch has no column {key!r}; columns: {self.keys()}")

    def __contains__(self, key: object) -> bool:
        return key in self.tensors.keys() or key in self.non_tensors

    def keys(self) -> list[str]:
        """Tensor column names, then non-tensor column names."""
        return [*self.tensors.keys(), *self.non_tensors]

    def __repr__(self) -> str:
        cols = [f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items()]
        cols += [f"{k}: object" for k in self.non_tensors]
        return f"Batch(len={len(self)}, {{{', '.join(cols)}}}, meta={sorted(self.meta)})"

    # --- mutation -----------------------------------------------------------------------------

    def set(self, key: str, value: torch.Tensor | Sequence) -> None:
        """Add or replace a column: a tensor goes to `tensors`, anything else to `non_tensors`."""
        if isinstance(value, torch.Tensor):
            if _rows(key, value) != len(self):
                raise DataError(f"tensor {key!r} has {value.shape[0]} rows, the batch has {len(self)}")
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
            return
        arr = _object_array(value)
        if len(arr) != len(self):
            raise DataError(f"non-tensor {key!r} has {len(arr)} rows, the batch has {len(self)}")
        if key in self.tensors.keys():
            del self.tensors[key]
        self.non_tensors[key] = arr

    def pop(self, key: str) -> torch.Tensor | np.ndarray:
        """Remove a column and return it."""
        if key in self.tensors.keys():
            return self.tensors.pop(key)
        if key in self.non_tensors:
            return self.non_tensors.pop(key)
        raise DataError(f"Batch has no column {key!r}; columns: {self.keys()}")

    # --- row operations (all return new Batches with a shallow copy of meta) ---

    def index(self, idx: Index) -> Batch:
        """Rows selected by a list / LongTensor / bool mask / slice (an int selects one row, kept 2-D)."""
        if isinstance(idx, int):
            idx = [idx]
        if isinstance(idx, list | tuple):
            idx = torch.as_tensor(idx) if len(idx) else torch.empty(0, dtype=torch.long)
        elif isinstance(idx, np.ndarray):
            idx = torch.from_numpy(idx)
        if isinstance(idx, torch.Tensor) and idx.dtype != torch.bool:
            idx = idx.long()
        if isinstance(idx, torch.Tensor):
            if idx.dtype == torch.bool and idx.shape != (len(self),):
                raise DataError(f"bool mask has shape {tuple(idx.shape)}, the batch has {len(self)} rows")
            if (
                idx.dtype != torch.bool
                and idx.numel()
                and not (-len(self) <= int(idx.min()) and int(idx.max()) < len(self))
            ):
                raise DataError(f"row index out of range for a batch of {len(self)} rows")
        np_idx = _numpy_index(idx)
        return Batch(
            self.tensors[idx],
            {k: v[np_idx] for k, v in self.non_tensors.items()},
            dict(self.meta),
        )

    def chunk(self, n: int) -> list[Batch]:
        """`n` equal parts, one per data-parallel rank; the length must be divisible by `n`."""
        if n <= 0 or len(self) % n:
            raise DataError(f"cannot chunk a batch of {len(self)} rows into {n} equal parts")
        return self.split(len(self) // n) if len(self) else [self.index(slice(0, 0)) for _ in range(n)]

    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of `size` rows; the last may be smaller."""
        if size <= 0:
            raise DataError(f"split size must be positive, got {size}")
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row `n` times in a row (interleave, like GRPO groups) or the whole batch `n` times."""
        if n <= 0:
            raise DataError(f"repeat count must be positive, got {n}")
        rows = torch.arange(len(self))
        idx = rows.repeat_interleave(n) if interleave else rows.repeat(n)
        return self.index(idx)

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        """Rows of all batches in order; columns and widths must agree; meta comes from the first."""
        batches = list(batches)
        if not batches:
            raise DataError("cannot concat an empty list of batches")
        first = batches[0]
        t_keys, nt_keys = set(first.tensors.keys()), set(first.non_tensors)
        for i, b in enumerate(batches[1:], start=1):
            if set(b.tensors.keys()) != t_keys or set(b.non_tensors) != nt_keys:
                diff = sorted((t_keys | nt_keys) ^ set(b.keys()))
                raise DataError(f"cannot concat: batch {i} differs from batch 0 in columns {diff}")
            for key in t_keys:
                a, c = first.tensors[key], b.tensors[key]
                if a.shape[1:] != c.shape[1:]:
                    raise DataError(
                        f"cannot concat tensor {key!r}: batch 0 has row shape {tuple(a.shape[1:])}, "
                        f"batch {i} has {tuple(c.shape[1:])}"
                    )
        tensors = torch.cat([b.tensors for b in batches], dim=0)
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors}
        return Batch(tensors, non_tensors, dict(first.meta))

    # --- column operations --------------------------------------------------------------------

    def select(
        self, tensor_keys: Iterable[str] | None = None, non_tensor_keys: Iterable[str] | None = None
    ) -> Batch:
        """Only the named columns; `None` keeps every column of that kind, an unknown key is an error."""
        t_keys = list(self.tensors.keys()) if tensor_keys is None else list(tensor_keys)
        nt_keys = list(self.non_tensors) if non_tensor_keys is None else list(non_tensor_keys)
        missing = [k for k in t_keys if k not in self.tensors.keys()]
        missing += [k for k in nt_keys if k not in self.non_tensors]
        if missing:
            raise DataError(f"cannot select unknown columns {missing}; columns: {self.keys()}")
        return Batch(self.tensors.select(*t_keys), {k: self.non_tensors[k] for k in nt_keys}, dict(self.meta))

    def union(self, other: Batch) -> Batch:
        """Columns and meta of both; a key present in both must hold equal values."""
        if len(self) != len(other):
            raise DataError(f"cannot union batches of {len(self)} and {len(other)} rows")
        tensors = self.tensors.clone(recurse=False)
        non_tensors = dict(self.non_tensors)
        meta = dict(self.meta)
        for key, value in other.tensors.items():
            _check_same(f"tensor {key!r}", key in tensors.keys(), lambda k=key: tensors[k], value)
            if key in non_tensors:
                raise DataError(
                    f"cannot union: {key!r} is a non-tensor in one batch and a tensor in the other"
                )
            tensors[key] = value
        for key, value in other.non_tensors.items():
            _check_same(f"non-tensor {key!r}", key in non_tensors, lambda k=key: non_tensors[k], value)
            if key in tensors.keys():
                raise DataError(
                    f"cannot union: {key!r} is a tensor in one batch and a non-tensor in the other"
                )
            non_tensors[key] = value
        for key, value in other.meta.items():
            _check_same(f"meta {key!r}", key in meta, lambda k=key: meta[k], value)
            meta[key] = value
        return Batch(tensors, non_tensors, meta)

    def __or__(self, other: Batch) -> Batch:
        return self.union(other)

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with tensors on `device` (non-tensors and meta are shared)."""
        return Batch(self.tensors.to(device), dict(self.non_tensors), dict(self.meta))


def _rows(key: str, value: torch.Tensor) -> int:
    """Number of rows of a tensor column; a 0-d tensor has none and is rejected."""
    if not isinstance(value, torch.Tensor):
        raise DataError(f"tensor column {key!r} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() == 0:
        raise DataError(f"tensor column {key!r} is 0-d; columns are batch-first (put scalars in meta)")
    return int(value.shape[0])


def _check_same(what: str, present: bool, current: Any, new: Any) -> None:
    """Raise if `what` already exists with a value different from `new` (`current` is a thunk)."""
    if present and not _equal(current(), new):
        raise DataError(f"cannot union: {what} is present in both batches with different values")
