"""Preference optimisation (`posttrain dpo`): the SFT trainer's engine, worker and packing with a pairwise loss.

A step: a batch of pairs (rows 2i chosen, 2i+1 rejected), the reference's summed completion log-probs
(the frozen initial weights run now, precomputed at start, or read from the data), one forward/backward of
the `preference` loss (workers/preference.py; formulas in algorithms/preference_losses.py), one optimizer
step. Validation reports the same loss and its reward metrics on held-out pairs. The result is written as a
Hugging Face directory.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from posttrain.algorithms.preference_losses import (
    PairLogps,
    PreferenceOptions,
    check_preference,
    needs_reference,
    preference_loss,
)
from posttrain.config.schema import DPOConfig
from posttrain.controller.placement import (
    RoleRequest,
    check_worker_settings,
    start_role_groups,
    threads_per_worker,
)
from posttrain.controller.resource_pool import ResourcePool
from posttrain.controller.roles import ActorGroup
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.preference_dataset import (
    PAIR_CHOSEN,
    PAIR_INDEX,
    REF_SEQ_LOG_PROB,
    collate_pairs,
)
from posttrain.errors import ConfigError
from posttrain.models import check_model_dir, load_tokenizer
from posttrain.tracking.progress import RunProgress
from posttrain.trainers.checks import check_files, check_model_options
from posttrain.trainers.pairs import check_pair_batches, pair_data
from posttrain.trainers.settings_in_effect import check_offline_settings_in_effect
from posttrain.trainers.setup import engine_config
from posttrain.trainers.sft import optim_only
from posttrain.trainers.step_loop import StepResult, StepTrainer
from posttrain.workers.actor_rollout_ref import ActorRolloutRefSpec
from posttrain.workers.losses import LossSpec
from posttrain.workers.preference import PreferenceWorker, sequence_log_probs
from posttrain.workers.process import seed_everything

TRAIN_COLUMNS = [
    keys.INPUT_IDS,
    keys.ATTENTION_MASK,
    keys.POSITION_IDS,
    keys.LOSS_MASK,
    PAIR_INDEX,
    PAIR_CHOSEN,
]


def check_dpo_config(cfg: DPOConfig) -> None:
    """What cannot work is rejected before any model loads, naming the key."""
    check_model_dir(cfg.model.path)
    check_model_options(cfg.model, cfg.data.max_length, {})
    check_files(cfg.data.train_files, "data.train_files")
    d = cfg.dpo
    check_preference(d.loss_type, d.loss_weights, PreferenceOptions(d.beta, d.label_smoothing, d.simpo_gamma))
    if d.reference != "model" and not needs_reference(d.loss_type):
        raise ConfigError(
            f"dpo.reference={d.reference} is set, but no loss in dpo.loss_type={list(d.loss_type)} uses a "
            "reference model's log-probs: it would be ignored"
        )
    if cfg.model.share_prompt:
        raise ConfigError(
            "model.share_prompt=true is for RL (n samples of a prompt); set model.share_prompt=false"
        )
    check_pair_batches(cfg, "dpo")
    if cfg.model.sequence_parallel_size != 1:
        raise ConfigError(
            f"model.sequence_parallel_size={cfg.model.sequence_parallel_size}: posttrain dpo does not support "
            "sequence parallelism yet (posttrain sft and posttrain train do): leave it 1"
        )
    check_worker_settings(cfg.trainer)
    check_offline_settings_in_effect(cfg, "dpo")


class DPOTrainer(StepTrainer[ActorGroup]):
    run_name = "dpo"
    progress_keys = ("loss", "val/loss")

    def __init__(self, cfg: DPOConfig) -> None:
        check_dpo_config(cfg)
        self.cfg = cfg
        seed_everything(cfg.trainer.seed)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.uses_reference = needs_reference(cfg.dpo.loss_type)
        columns = self.uses_reference and cfg.dpo.reference == "columns"
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.train_set, self.val_set, self.loader = pair_data(
            cfg, self.tokenizer, self.pad_id, with_reference=columns
        )
        d = cfg.dpo
        self.loss = LossSpec(
            "preference",
            {
                "loss_type": tuple(d.loss_type),
                "loss_weights": tuple(d.loss_weights),
                "beta": d.beta,
                "label_smoothing": d.label_smoothing,
                "simpo_gamma": d.simpo_gamma,
            },
        )
        # precompute: the initial weights' sums per (split, pair index, chosen?), filled before step 1
        self.precomputed: dict[tuple[str, int, int], float] = {}

    def start(self) -> tuple[ActorGroup, dict[str, ResourcePool]]:
        cfg = self.cfg
        spec = ActorRolloutRefSpec(
            engine=engine_config(
                cfg.model,
                optim=optim_only(cfg.optim),
                total_steps=cfg.trainer.total_steps,
                micro_batch_size=2 * cfg.optim.micro_batch_size,  # rows: two per pair
                max_token_len=0,
                config_section="optim",
                token_budget_key=False,
                rows_per_unit=2,
            ),
            with_rollout=False,
            with_ref=self.uses_reference and cfg.dpo.reference == "model",
            seed=cfg.trainer.seed,
            threads=threads_per_worker(cfg.trainer),
        )
        request = RoleRequest("actor_rollout_ref", PreferenceWorker, spec)
        started, pools = start_role_groups(cfg.trainer, cfg.ray, [request])
        return ActorGroup(started[request.role]), pools

    def before_steps(self, group: ActorGroup, progress: RunProgress) -> None:
        if self.uses_reference and self.cfg.dpo.reference == "precompute":
            with progress.stage("reference log-probs"):
                self._precompute(group)

    def train_step(self, group: ActorGroup, progress: RunProgress) -> StepResult:
        batch = self.loader.next_batch()
        with progress.stage("reference"):
            batch = self._with_reference(group, batch, "train")
        batch = batch.select(TRAIN_COLUMNS + ([REF_SEQ_LOG_PROB] if self.uses_reference else []), [])
        batch.meta[keys.GLOBAL_SEQS] = len(batch) // 2
        batch.meta[keys.GLOBAL_TOKENS] = float(batch[keys.LOSS_MASK][0::2].sum())
        with progress.stage("update"):
            metrics = group.forward_backward(batch, self.loss)
            metrics.update(group.optim_step())
        return StepResult(metrics, float(batch[keys.ATTENTION_MASK].sum()))

    # ---- the reference ---------------------------------------------------------------------------
    def _sums(self, group: ActorGroup, batch: Batch, model: str) -> torch.Tensor:
        """(B,) summed completion log-probs under the actor or the reference; rows padded to the workers."""
        pad = -(len(batch) // 2) % group.world_size  # pairs to add so every worker gets whole pairs
        inputs = batch.select([keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS], [])
        if pad:
            inputs = Batch.concat([inputs, inputs.index(list(range(2 * pad)))])
        if model == "ref":
            per_token = group.forward(inputs, model="ref")[keys.REF_LOG_PROB]
        else:
            per_token = group.forward(inputs, model="actor")[keys.OLD_LOG_PROBS]
        return sequence_log_probs(per_token[: len(batch)], batch[keys.LOSS_MASK])[0]

    def _with_reference(self, group: ActorGroup, batch: Batch, split: str) -> Batch:
        if not self.uses_reference or self.cfg.dpo.reference == "columns":
            return batch
        if self.cfg.dpo.reference == "model":
            batch.set(REF_SEQ_LOG_PROB, self._sums(group, batch, "ref"))
            return batch
        rows = zip(batch[PAIR_INDEX].tolist(), batch[PAIR_CHOSEN].tolist(), strict=True)
        ref = [self.precomputed[(split, int(i), int(c))] for i, c in rows]
        batch.set(REF_SEQ_LOG_PROB, torch.tensor(ref, dtype=torch.float64))
        return batch

    def _precompute(self, group: ActorGroup) -> None:
        """One pass of the initial weights over every pair (train and validation) before any update."""
        splits = {"train": self.train_set, "val": self.val_set}
        for split, dataset in splits.items():
            if dataset is None:
                continue
            size = 2 * self.cfg.optim.batch_size
            for begin in range(0, len(dataset), size):
                batch = collate_pairs(
                    [dataset[i] for i in range(begin, min(begin + size, len(dataset)))], self.pad_id
                )
                sums = self._sums(group, batch, "actor").tolist()
                rows = zip(batch[PAIR_INDEX].tolist(), batch[PAIR_CHOSEN].tolist(), sums, strict=True)
                self.precomputed.update({(split, int(i), int(c)): s for i, c, s in rows})

    # ---- validation ------------------------------------------------------------------------------
    def validate(self, group: ActorGroup) -> dict[str, float]:
        """The loss and its metrics (`val/rewards_accuracy`, margins, ...) on held-out pairs, no update."""
        assert self.val_set is not None
        n = (
            len(self.val_set)
            if not self.cfg.data.val_max_pairs
            else min(len(self.val_set), self.cfg.data.val_max_pairs)
        )
        batch = collate_pairs([self.val_set[i] for i in range(n)], self.pad_id)
        batch = self._with_reference(group, batch, "val")
        sums = self._sums(group, batch, "actor")
        tokens = batch[keys.LOSS_MASK].to(torch.float64).sum(-1)
        ref = batch[REF_SEQ_LOG_PROB].to(torch.float64) if REF_SEQ_LOG_PROB in batch else None
        pairs = PairLogps(
            sums[0::2],
            sums[1::2],
            tokens[0::2],
            tokens[1::2],
            None if ref is None else ref[0::2],
            None if ref is None else ref[1::2],
        )
        d = self.cfg.dpo
        options = PreferenceOptions(
            **{k: v for k, v in asdict(d).items() if k in ("beta", "label_smoothing", "simpo_gamma")}
        )
        losses, metrics = preference_loss(pairs, d.loss_type, d.loss_weights, options)
        out = {f"val/{k}": float(v.mean()) for k, v in metrics.items()}
        out["val/loss"] = float(losses.mean())
        return out
