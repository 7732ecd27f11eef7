"""Distillation (`posttrain distill`): GKD, the SFT trainer's data and engine with a teacher's distributions.

A step: a batch of SFT rows; with probability `distill.lmbda` its prompts are answered by the student itself
(the worker's sampler at `distill.temperature`, up to `data.max_response_length` tokens), else the data's
responses are kept; one forward/backward of the generalised Jensen-Shannon divergence between the frozen
teacher's and the student's full next-token distributions on the response tokens (workers/distill.py,
algorithms/distillation.py), one optimizer step, and new weights to the sampler when it is used.
Validation reports `val/jsd` and `val/kl_to_teacher` on held-out responses. The student is written as a
Hugging Face directory.
"""

from __future__ import annotations

import math
import random
from functools import partial
from typing import Any

import torch

from posttrain.config.schema import DistillConfig, LoraConfig
from posttrain.controller.placement import (
    RoleRequest,
    check_worker_settings,
    start_role_groups,
    threads_per_worker,
)
from posttrain.controller.resource_pool import ResourcePool
from posttrain.controller.roles import DistillGroup
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.dataloader import PromptDataLoader
from posttrain.data.dataset import position_ids_from_mask
from posttrain.data.sft_dataset import SFTDataset, collate_sft
from posttrain.data.template_options import with_template_kwargs
from posttrain.errors import ConfigError, DataError
from posttrain.models import check_model_dir, load_tokenizer
from posttrain.models.shared_tokenizer import check_same_tokenizer
from posttrain.rollout.base import SamplingParams
from posttrain.tracking.progress import RunProgress
from posttrain.trainers.checkpoint import DriverState
from posttrain.trainers.checks import check_files, check_model_options
from posttrain.trainers.pixel_bounds import pixel_bounds_set
from posttrain.trainers.settings_in_effect import check_offline_settings_in_effect
from posttrain.trainers.setup import engine_config
from posttrain.trainers.sft import optim_only
from posttrain.trainers.step_loop import StepResult, StepTrainer
from posttrain.workers.actor_rollout_ref import ActorRolloutRefSpec
from posttrain.workers.distill import DistillWorker
from posttrain.workers.process import seed_everything

LOSS_COLUMNS = [keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, keys.LOSS_MASK]


def check_distill_config(cfg: DistillConfig) -> None:
    """What cannot work, or would be ignored, is rejected before any model loads, naming the key."""
    check_model_dir(cfg.model.path)
    check_model_options(cfg.model, cfg.data.max_prompt_length + cfg.data.max_response_length, {})
    check_files(cfg.data.train_files, "data.train_files")
    if pixel_bounds_set(cfg.data):
        raise ConfigError(
            "data.min_pixels / data.max_pixels are set, but distill reads text rows only (no images): leave them "
            "unset (null)"
        )
    d = cfg.distill
    if not d.teacher_path:
        raise ConfigError("distill.teacher_path is required: the teacher's model directory")
    check_model_dir(d.teacher_path)
    check_same_tokenizer(cfg.model.path, d.teacher_path, key="teacher (distill.teacher_path)")
    if not 0.0 <= d.beta <= 1.0:
        raise ConfigError(f"distill.beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {d.beta}")
    if not 0.0 <= d.lmbda <= 1.0:
        raise ConfigError(
            f"distill.lmbda must be in [0, 1] (the share of student-generated batches), got {d.lmbda}"
        )
    if d.lmbda > 0 and cfg.data.train_on == "everything":
        raise ConfigError(
            f"distill.lmbda={d.lmbda} samples answers from the student, which needs each row's prompt, but "
            "data.train_on=everything makes every token a loss token (no prompt is left): use last_assistant or "
            "all_assistant, or distill.lmbda=0"
        )
    if not (math.isfinite(d.temperature) and d.temperature > 0):
        raise ConfigError(f"distill.temperature must be > 0, got {d.temperature}")
    if cfg.model.remove_padding:
        raise ConfigError(
            "model.remove_padding=true: distill compares full-vocabulary logits at every position of right-padded "
            "rows; set model.remove_padding=false"
        )
    if cfg.model.share_prompt:
        raise ConfigError(
            "model.share_prompt=true is for RL (n samples of a prompt); set model.share_prompt=false"
        )
    if getattr(cfg.model, "sequence_parallel_size", 1) != 1:
        raise ConfigError("model.sequence_parallel_size must be 1 for distill (rows are not packed)")
    if cfg.optim.max_token_len_per_worker:
        raise ConfigError(
            "optim.max_token_len_per_worker must be 0 for distill: micro-batches are cut by optim.micro_batch_size"
        )
    if cfg.trainer.stop_at_val_nll:
        raise ConfigError("trainer.stop_at_val_nll is an SFT setting; distill reports val/jsd (leave it 0)")
    if cfg.optim.batch_size % cfg.trainer.world_size:
        raise ConfigError(
            f"optim.batch_size={cfg.optim.batch_size} must be divisible by the {cfg.trainer.world_size} workers"
        )
    check_worker_settings(cfg.trainer)
    check_offline_settings_in_effect(cfg, "distill")


def check_rows_have_prompts(rows: SFTDataset, lmbda: float) -> None:
    """With lmbda > 0 the student answers each row's prompt (the tokens before its first loss token): a row
    trained from its first token (a `text` row) has none. Refused at the start, not at the first
    student-sampled step."""
    for i in range(len(rows)):
        if rows[i][keys.LOSS_MASK][0]:
            raise DataError(
                f"distill.lmbda={lmbda}: training row {i} has no prompt before its first loss token (a 'text' row), "
                "so the student has nothing to answer: use prompt + response or chat rows, or distill.lmbda=0"
            )


def prompt_batch(batch: Batch, pad_id: int) -> Batch:
    """Left-padded prompts of SFT rows: each row's tokens before its first loss token."""
    prompts = []
    for i, (ids, mask) in enumerate(zip(batch[keys.INPUT_IDS], batch[keys.LOSS_MASK], strict=True)):
        first = int(mask.nonzero()[0]) if bool(mask.any()) else 0
        if first == 0:
            raise DataError(
                f"distill.lmbda > 0: row {batch[keys.INDEX][i]} has no prompt before its first loss token, so the "
                "student has nothing to answer (use prompt + response or chat rows)"
            )
        prompts.append(ids[:first])
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        input_ids[r, width - len(p) :] = p
        attention[r, width - len(p) :] = 1
    return Batch.from_dict(
        {
            keys.INPUT_IDS: input_ids,
            keys.ATTENTION_MASK: attention,
            keys.POSITION_IDS: position_ids_from_mask(attention),
        }
    )


def on_policy_rows(sampled: Batch) -> Batch:
    """[prompt | student response] rows with loss on the generated tokens."""
    prompt_width = sampled[keys.PROMPTS].shape[1]
    mask = torch.cat(
        [torch.zeros(len(sampled), prompt_width), sampled[keys.RESPONSE_MASK].to(torch.float32)], dim=1
    )
    return Batch.from_dict(
        {
            keys.INPUT_IDS: sampled[keys.INPUT_IDS],
            keys.ATTENTION_MASK: sampled[keys.ATTENTION_MASK],
            keys.POSITION_IDS: sampled[keys.POSITION_IDS],
            keys.LOSS_MASK: mask,
        }
    )


class DistillTrainer(StepTrainer[DistillGroup]):
    run_name = "distill"
    progress_keys = ("distill/jsd", "val/jsd")

    def __init__(self, cfg: DistillConfig) -> None:
        check_distill_config(cfg)
        self.cfg = cfg
        seed_everything(cfg.trainer.seed)
        self.tokenizer = with_template_kwargs(
            load_tokenizer(cfg.model.path), cfg.data.apply_chat_template_kwargs, cfg.model.path
        )
        self.pad_id = int(self.tokenizer.pad_token_id)
        make = partial(
            SFTDataset,
            tokenizer=self.tokenizer,
            max_length=cfg.data.max_prompt_length + cfg.data.max_response_length,
            response_key=cfg.data.response_key,
            overlong=cfg.data.overlong_prompts,
            train_on=cfg.data.train_on,
        )
        self.train_set = make(cfg.data.train_files)
        self.val_set = make(cfg.data.val_files) if cfg.data.val_files else None
        if cfg.distill.lmbda > 0:
            check_rows_have_prompts(self.train_set, cfg.distill.lmbda)
        if self.val_set is not None:
            val_rows = min(len(self.val_set), cfg.data.val_max_prompts or len(self.val_set))
            if val_rows < cfg.trainer.world_size:
                raise ConfigError(
                    f"data.val_files: {val_rows} held-out rows for {cfg.trainer.world_size} workers; validation "
                    "gives each worker as many rows (at least one): give more rows, or leave data.val_files empty"
                )
        self.loader = PromptDataLoader(
            self.train_set,
            cfg.optim.batch_size,
            partial(collate_sft, pad_token_id=self.pad_id),
            shuffle=cfg.data.shuffle,
            seed=cfg.trainer.seed,
        )
        self.coin = random.Random(cfg.trainer.seed)  # which steps sample from the student (lmbda)
        self.sampling = SamplingParams(
            max_tokens=cfg.data.max_response_length, temperature=cfg.distill.temperature
        )

    def driver_states(self) -> dict[str, DriverState]:
        """Also the coin of which steps sample from the student (a resume draws on where it stopped)."""
        return {**super().driver_states(), "coin": _CoinState(self.coin)}

    def start(self) -> tuple[DistillGroup, dict[str, ResourcePool]]:
        cfg = self.cfg
        spec = ActorRolloutRefSpec(
            engine=engine_config(
                cfg.model,
                optim=optim_only(cfg.optim),
                total_steps=cfg.trainer.total_steps,
                micro_batch_size=cfg.optim.micro_batch_size,
                max_token_len=0,
                config_section="optim",
                token_budget_key=False,
            ),
            with_rollout=cfg.distill.lmbda > 0,
            teacher=engine_config(
                cfg.model,
                path=cfg.distill.teacher_path,
                trainable=False,
                lora=LoraConfig(),
                micro_batch_size=cfg.optim.micro_batch_size,
                max_token_len=0,
            ),
            rollout_max_batch_size=max(1, cfg.optim.batch_size // cfg.trainer.world_size),
            seed=cfg.trainer.seed,
            threads=threads_per_worker(cfg.trainer),
        )
        request = RoleRequest("actor_rollout_ref", DistillWorker, spec)
        started, pools = start_role_groups(cfg.trainer, cfg.ray, [request])
        return DistillGroup(started[request.role]), pools

    def step_batch(self, group: DistillGroup) -> tuple[Batch, bool]:
        """The next rows: the data's responses, or (with probability lmbda) the student's own."""
        batch = self.loader.next_batch()
        on_policy = self.coin.random() < self.cfg.distill.lmbda
        if on_policy:
            batch = on_policy_rows(group.sample(prompt_batch(batch, self.pad_id), self.sampling))
        batch = batch.select(LOSS_COLUMNS, [])
        batch.meta[keys.GLOBAL_TOKENS] = float(batch[keys.LOSS_MASK][:, 1:].sum())
        return batch, on_policy

    def train_step(self, group: DistillGroup, progress: RunProgress) -> StepResult:
        d = self.cfg.distill
        with progress.stage("batch"):
            batch, on_policy = self.step_batch(group)
        with progress.stage("update"):
            metrics = group.gkd(batch, beta=d.beta, temperature=d.temperature)
            metrics.update(group.optim_step())
        if d.lmbda > 0:
            with progress.stage("sync"):
                group.sync_sampler()
        metrics["distill/on_policy"] = float(on_policy)
        metrics["distill/loss_tokens"] = float(batch.meta[keys.GLOBAL_TOKENS])
        return StepResult(metrics, float(batch[keys.ATTENTION_MASK].sum()))

    def validate(self, group: DistillGroup) -> dict[str, float]:
        """`val/jsd` and `val/kl_to_teacher` per loss token on held-out rows (their responses), no update."""
        assert self.val_set is not None
        rows = min(len(self.val_set), self.cfg.data.val_max_prompts or len(self.val_set))
        rows -= rows % group.world_size  # at least one per worker (checked at the start)
        batch = collate_sft([self.val_set[i] for i in range(rows)], self.pad_id).select(LOSS_COLUMNS, [])
        d = self.cfg.distill
        out = group.gkd(batch, beta=d.beta, temperature=d.temperature, backward=False)
        return {f"val/{k.split('/', 1)[1]}": v for k, v in out.items()}


class _CoinState:
    """A `random.Random` as a checkpoint part."""

    def __init__(self, coin: random.Random) -> None:
        self.coin = coin

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.coin.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "state" in state:  # a checkpoint of a run without one keeps the fresh coin
            self.coin.setstate(state["state"])
