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
from pathlib import Path

import torch

from posttrain.algorithms.reward_model_loss import bradley_terry_loss, check_center_coefficient
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
from posttrain.tracking.progress import RunProgress
from posttrain.trainers.checks import check_files, check_model_options
from posttrain.trainers.pairs import check_pair_batches, pair_data
from posttrain.trainers.rm_scoring import RM_INFO_FILE
from posttrain.trainers.settings_in_effect import check_offline_settings_in_effect
from posttrain.trainers.setup import engine_config
from posttrain.trainers.sft import optim_only
from posttrain.trainers.step_loop import StepResult, StepTrainer
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
    if m.router_aux_loss_coef:
        raise ConfigError(
            f"model.router_aux_loss_coef={m.router_aux_loss_coef} is set, but the reward model adds no router "
            "load-balancing loss (a mixture-of-experts policy's update does): leave it null"
        )
    check_pair_batches(cfg, "rm")
    if cfg.model.sequence_parallel_size != 1:
        raise ConfigError(
            f"model.sequence_parallel_size={cfg.model.sequence_parallel_size}: the reward model runs right-padded "
            "rows, which sequence parallelism (packed rows only) does not split: leave it 1"
        )
    check_worker_settings(cfg.trainer)
    check_offline_settings_in_effect(cfg, "rm")


class RMTrainer(StepTrainer[RewardModelGroup]):
    run_name = "rm"
    progress_keys = ("rm/loss", "val/accuracy")

    def __init__(self, cfg: RMConfig) -> None:
        check_rm_config(cfg)
        self.cfg = cfg
        seed_everything(cfg.trainer.seed)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.train_set, self.val_set, self.loader = pair_data(
            cfg, self.tokenizer, self.pad_id, margin_column=cfg.data.margin_column
        )
        self.coef = cfg.rm.center_rewards_coefficient
        self.loss = LossSpec("bradley_terry", {"center_rewards_coefficient": self.coef})
        self.final_eval: dict[str, float] = {}  # the last validation (held-out pairwise accuracy, ...)

    def start(self) -> tuple[RewardModelGroup, dict[str, ResourcePool]]:
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

    def train_step(self, group: RewardModelGroup, progress: RunProgress) -> StepResult:
        batch = self.loader.next_batch()
        margin = [PAIR_MARGIN] if PAIR_MARGIN in batch else []
        batch = batch.select(TRAIN_COLUMNS + margin, [])
        batch.meta[keys.GLOBAL_SEQS] = len(batch) // 2
        with progress.stage("update"):
            metrics = group.forward_backward(batch, self.loss)
            metrics.update(group.optim_step())
        return StepResult(metrics, float(batch[keys.ATTENTION_MASK].sum()))

    def describe_export(self, folder: Path) -> None:
        """`posttrain_rm.json`: how its training pairs were written (text or chat). RL scores a response as
        the prompt's messages plus the response rendered with the chat template, so a model trained on text
        pairs is refused there (trainers/rm_scoring.py) rather than scored on a format it never saw."""
        formats = sorted(self.train_set.formats)
        fmt = formats[0] if len(formats) == 1 else "mixed"
        (folder / RM_INFO_FILE).write_text(json.dumps({"input_format": fmt}) + "\n")

    def after_steps(self) -> None:
        if self.final_eval:
            (self.run_dir / EVAL_FILE).write_text(json.dumps(self.final_eval, indent=1))

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
