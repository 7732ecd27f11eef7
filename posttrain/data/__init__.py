"""Data: the `Batch` container, verl-format datasets, the dataloader and built-in tasks.

Imports no engine, rollout, worker, Ray or model code.
"""

from posttrain.data.batch import Batch

__all__ = ["Batch"]
