"""Reward-model training (`posttrain rm`): a sequence classifier of the policy's family on preference pairs.

A step: a batch of pairs (rows 2i chosen, 2i+1 rejected, tokenized as `posttrain dpo` tokenizes them:
data/preference_dataset.py), one forward/backward of the `bradley_terry` loss (workers/reward_model.py; formula
in algorithms/reward_model_loss.py) over each row's score, one optimizer step. Validation scores the held-out
pairs: pairwise accuracy (the share of pairs whose chosen scores higher), the loss, margins. The result is a
Hugging Face directory that `AutoModelForSequenceClassification.from_pretrained` loads and `reward.model.path`
takes in RL.
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import torch

from posttrain.algorithms.reward_model_loss import bradley_terry_loss, check_center_coefficient
from posttrain.config.load import to_dict
from posttrain.config.schema import RMConfig
from posttrain.controller.placement import (
    RoleRequest,
    check_worker_settings,
    start_role_groups,
    threads_per_worker,
)
from posttrain.controller.resource_pool import ResourcePool
from posttrain.controller.roles import RewardModelGroup
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.dataloader import PromptDataLoader
from posttrain.data.preference_dataset import (
    PAIR_CHOSEN,
    PAIR_INDEX,
    PAIR_MARGIN,
    PreferenceDataset,
    collate_pairs,
)
from posttrain.engine.reward_engine import REWARD_HEAD
from posttrain.errors import ConfigError
from posttrain.models import check_model_dir, load_tokenizer
from posttrain.tracking import Tracker
from posttrain.trainers.setup import check_files, check_model_options, engine_config
from posttrain.trainers.sft import optim_only
from posttrain.workers.losses import LossSpec
from posttrain.workers.process import seed_everything
from posttrain.workers.reward_model import RM_SCORE, RewardModelSpec, RewardModelWorker

TRAIN_COLUMNS = [keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, PAIR_INDEX, PAIR_CHOSEN]
EVAL_FILE = "rm_eval.json"  # in the run directory: the last validation's metrics


def check_rm_config(cfg: RMConfig) -> None:
    """What cannot work, or would be ignored, is rejected before any model loads, naming the key."""
    check_model_dir(cfg.model.path)
    check_model_options(cfg.model, cfg.data.max_length, {})
    check_files(cfg.data.train_files, "data.train_files")
    if cfg.data.val_files:
        check_files(cfg.data.val_files, "data.val_files")
    elif cfg.trainer.val_every:
        raise ConfigError(f"trainer.val_every={cfg.trainer.val_every} needs held-out pairs in data.val_files")
    check_center_coefficient(cfg.rm.center_rewards_coefficient)
    m = cfg.model
    for key, value in (
        ("model.remove_padding", m.remove_padding),
        ("model.share_prompt", m.share_prompt),
    ):
        if value:
            raise ConfigError(
                f"{key}=true: the reward model runs right-padded rows (no packing); set it false"
            )
    if m.lora.rank:
        raise ConfigError("model.lora.rank must be 0: the reward model (a new score head) trains fully")
    if cfg.optim.max_token_len_per_worker:
        raise ConfigError(
            "optim.max_token_len_per_worker must be 0 for rm: a token budget would split a chosen/rejected "
            "pair across micro-batches; use optim.micro_batch_size (pairs)"
        )
    if cfg.trainer.stop_at_val_nll:
        raise ConfigError("trainer.stop_at_val_nll is an SFT setting; rm has no NLL to stop at (leave it 0)")
    if cfg.optim.micro_batch_size <= 0:
        raise ConfigError(f"optim.micro_batch_size must be > 0 pairs, got {cfg.optim.micro_batch_size}")
    if cfg.model.sequence_parallel_size != 1:
        raise ConfigError(
            f"model.sequence_parallel_size={cfg.model.sequence_parallel_size}: the reward model runs right-padded "
            "rows, which sequence parallelism (packed rows only) does not split: leave it 1"
        )
    if cfg.optim.batch_size % cfg.trainer.world_size:
        raise ConfigError(
            f"optim.batch_size={cfg.optim.batch_size} pairs must be divisible by the {cfg.trainer.world_size} workers"
        )
    check_worker_settings(cfg.trainer)


class RMTrainer:
    def __init__(self, cfg: RMConfig) -> None:
        check_rm_config(cfg)
        self.cfg = cfg
        seed_everything(cfg.trainer.seed)
        self.tokenizer = load_tokenizer(cfg.model.path)
        make = partial(
            PreferenceDataset,
            tokenizer=self.tokenizer,
            max_length=cfg.data.max_length,
            overlong=cfg.data.overlong,
            margin_column=cfg.data.margin_column,
        )
        self.train_set = make(cfg.data.train_files)
        self.val_set = make(cfg.data.val_files) if cfg.data.val_files else None
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.loader = PromptDataLoader(
            self.train_set,
            cfg.optim.batch_size,
            partial(collate_pairs, pad_token_id=self.pad_id),
            shuffle=cfg.data.shuffle,
            seed=cfg.trainer.seed,
        )
        self.run_dir = Path(cfg.trainer.run_dir)
        self.hf_dir = Path(cfg.trainer.save_hf_dir or self.run_dir / "hf")
        self.coef = cfg.rm.center_rewards_coefficient
        self.loss = LossSpec("bradley_terry", {"center_rewards_coefficient": self.coef})
        self.final_eval: dict[str, float] = {}  # the last validation (held-out pairwise accuracy, ...)

    def _start(self) -> tuple[RewardModelGroup, dict[str, ResourcePool]]:
        cfg = self.cfg
        spec = RewardModelSpec(
            engine=engine_config(
                cfg.model,
                head=REWARD_HEAD,
                optim=optim_only(cfg.optim),
                total_steps=cfg.trainer.total_steps,
                micro_batch_size=2 * cfg.optim.micro_batch_size,  # rows: two per pair
                max_token_len=0,
                config_section="optim",
                token_budget_key=False,
                rows_per_unit=2,
            ),
            seed=cfg.trainer.seed,
            threads=threads_per_worker(cfg.trainer),
        )
        request = RoleRequest("reward_model", RewardModelWorker, spec)
        started, pools = start_role_groups(cfg.trainer, cfg.ray, [request])
        return RewardModelGroup(started[request.role]), pools

    def fit(self) -> dict[str, float]:
        """Train `trainer.total_steps` optimizer steps, validate, write the HF directory; the last metrics."""
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        group, pools = self._start()
        tracker = Tracker(
            cfg.trainer.loggers, self.run_dir, run_name="rm", config=to_dict(cfg), plots=cfg.trainer.plots
        )
        metrics: dict[str, float] = {}
        try:
            for step in range(1, cfg.trainer.total_steps + 1):
                start = time.perf_counter()
                batch = self.loader.next_batch()
                margin = [PAIR_MARGIN] if PAIR_MARGIN in batch else []
                batch = batch.select(TRAIN_COLUMNS + margin, [])
                batch.meta[keys.GLOBAL_SEQS] = len(batch) // 2
                metrics = group.forward_backward(batch, self.loss)
                metrics.update(group.optim_step())
                seconds = time.perf_counter() - start
                metrics["timing/step"] = seconds
                metrics["throughput/tokens_per_s"] = float(batch[keys.ATTENTION_MASK].sum()) / seconds
                last = step == cfg.trainer.total_steps
                if self.val_set is not None and (
                    (cfg.trainer.val_every and step % cfg.trainer.val_every == 0) or last
                ):
                    metrics.update(self.validate(group))
                tracker.log(metrics, step)
            if self.final_eval:
                (self.run_dir / EVAL_FILE).write_text(json.dumps(self.final_eval, indent=1))
            group.export_hf(self.hf_dir)
        finally:
            tracker.close()
            group.shutdown()
            for pool in pools.values():
                pool.remove()
        return metrics

    def scores(self, group: RewardModelGroup, dataset: PreferenceDataset, n: int) -> torch.Tensor:
        """(2n,) scores of the first `n` pairs of `dataset` (rows 2i chosen, 2i+1 rejected), no update."""
        out = []
        size = 2 * self.cfg.optim.batch_size  # pairs per call
        for begin in range(0, n, size):
            batch = collate_pairs([dataset[i] for i in range(begin, min(begin + size, n))], self.pad_id)
            rows = len(batch)
            inputs = batch.select([keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS], [])
            extra = -rows % group.world_size  # every rank gets as many rows
            if extra:
                inputs = Batch.concat([inputs, inputs.index([rows - 1] * extra)])
            out.append(group.score(inputs)[RM_SCORE][:rows])
        return torch.cat(out)

    def validate(self, group: RewardModelGroup) -> dict[str, float]:
        """`val/accuracy` (held-out pairwise accuracy; ties count as wrong), the loss, scores and margins."""
        assert self.val_set is not None
        limit = self.cfg.data.val_max_pairs
        n = min(len(self.val_set), limit) if limit else len(self.val_set)
        scores = self.scores(group, self.val_set, n).to(torch.float64)
        margins = [self.val_set[i]["margin"] for i in range(n)] if self.val_set.has_margin else None
        margin = torch.tensor(margins, dtype=torch.float64) if margins is not None else None
        losses, per_pair = bradley_terry_loss(scores[0::2], scores[1::2], margin, self.coef)
        out = {f"val/{k}": float(v.mean()) for k, v in per_pair.items()}
        out["val/loss"] = float(losses.mean())
        out["val/pairs"] = float(n)
        self.final_eval = out
        return out
