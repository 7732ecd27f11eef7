"""What the trainers on preference pairs (`posttrain dpo`, `posttrain rm`) share: the checks on how pairs are
batched, and the pair datasets with their loader (rows 2i chosen, 2i+1 rejected; data/preference_dataset.py)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from posttrain.config.schema import DPOConfig, RMConfig
from posttrain.data.dataloader import PromptDataLoader
from posttrain.data.dataset import ChatTokenizer
from posttrain.data.preference_dataset import PreferenceDataset, collate_pairs
from posttrain.errors import ConfigError


def check_pair_batches(cfg: DPOConfig | RMConfig, command: str) -> None:
    """A pair never splits across micro-batches or workers; SFT-only keys stay unset. Errors name the key."""
    if cfg.optim.max_token_len_per_worker:
        raise ConfigError(
            f"optim.max_token_len_per_worker must be 0 for {command}: a token budget would split a "
            "chosen/rejected pair across micro-batches; use optim.micro_batch_size (pairs)"
        )
    if cfg.optim.micro_batch_size <= 0:
        raise ConfigError(f"optim.micro_batch_size must be > 0 pairs, got {cfg.optim.micro_batch_size}")
    if cfg.trainer.stop_at_val_nll:
        raise ConfigError(
            f"trainer.stop_at_val_nll is an SFT setting; {command} has no NLL to stop at (leave it 0)"
        )
    if cfg.optim.batch_size % cfg.trainer.world_size:
        raise ConfigError(
            f"optim.batch_size={cfg.optim.batch_size} pairs must be divisible by the "
            f"{cfg.trainer.world_size} workers"
        )


def pair_data(
    cfg: DPOConfig | RMConfig,
    tokenizer: ChatTokenizer,
    pad_token_id: int,
    *,
    with_reference: bool = False,
    margin_column: str = "",
) -> tuple[PreferenceDataset, PreferenceDataset | None, PromptDataLoader]:
    """The train pairs, the held-out pairs (None without `data.val_files`) and the train loader of
    `optim.batch_size` pairs. `with_reference`: read precomputed reference columns (DPO); `margin_column`: a
    per-pair margin column (RM)."""

    def make(files: Sequence[str]) -> PreferenceDataset:
        return PreferenceDataset(
            files, tokenizer, cfg.data.max_length, cfg.data.overlong, with_reference, margin_column
        )

    train_set = make(cfg.data.train_files)
    val_set = make(cfg.data.val_files) if cfg.data.val_files else None
    loader = PromptDataLoader(
        train_set,
        cfg.optim.batch_size,
        partial(collate_pairs, pad_token_id=pad_token_id),
        shuffle=cfg.data.shuffle,
        seed=cfg.trainer.seed,
    )
    return train_set, val_set, loader
