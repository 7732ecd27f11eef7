"""Supervised fine-tuning: the RL actor's engine trained with cross-entropy on response tokens.

Same worker, same FSDP2 engine, same data files (the response comes from `data.response_key`); used for
the warm start before RL. The result is written as a Hugging Face directory for the next stage to load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from functools import partial

from posttrain.config.schema import OptimConfig, SFTConfig, SFTOptimConfig
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
from posttrain.data.dataloader import PromptDataLoader
from posttrain.data.mm_dataset import MULTI_MODAL_INPUTS, pixel_bounds
from posttrain.data.mm_sft_dataset import MultimodalSFTDataset, collate_multimodal_sft
from posttrain.data.sft_dataset import SFTDataset, collate_sft
from posttrain.data.template_options import with_template_kwargs
from posttrain.errors import ConfigError
from posttrain.models import check_model_dir, is_vision_language, load_tokenizer
from posttrain.tracking.progress import RunProgress
from posttrain.trainers.checks import (
    check_files,
    check_model_options,
    check_sequence_parallel_config,
    check_vision_language_model,
    data_parallel_size,
)
from posttrain.trainers.pixel_bounds import check_pixel_bounds, run_processor
from posttrain.trainers.settings_in_effect import check_offline_settings_in_effect
from posttrain.trainers.setup import engine_config
from posttrain.trainers.step_loop import StepResult, StepTrainer
from posttrain.workers.actor_rollout_ref import ActorRolloutRefSpec, ActorRolloutRefWorker
from posttrain.workers.losses import LossSpec
from posttrain.workers.process import seed_everything


def optim_only(optim: SFTOptimConfig) -> OptimConfig:
    """The optimizer part of SFT's `optim` section (its batch sizes stay with the trainer)."""
    return OptimConfig(**{f.name: getattr(optim, f.name) for f in fields(OptimConfig)})


def check_sft_config(cfg: SFTConfig) -> None:
    check_model_dir(cfg.model.path)
    check_model_options(
        cfg.model,
        cfg.data.max_prompt_length + cfg.data.max_response_length,
        {"optim.max_token_len_per_worker": cfg.optim.max_token_len_per_worker},
    )
    check_files(cfg.data.train_files, "data.train_files")
    check_pixel_bounds(cfg.data, cfg.model.path)
    if cfg.model.share_prompt:
        raise ConfigError(
            "model.share_prompt=true is for RL, where n samples share a prompt; SFT has one response per "
            "prompt: set model.share_prompt=false"
        )
    if is_vision_language(cfg.model.path):
        check_vision_language_model(cfg.model)
    check_worker_settings(cfg.trainer)
    check_sequence_parallel_config(cfg.model, cfg.trainer.world_size, cfg.trainer.backend)
    check_offline_settings_in_effect(cfg, "sft")
    dp = data_parallel_size(cfg.model, cfg.trainer.world_size)  # the ranks of an sp group share rows
    if cfg.optim.batch_size % dp:
        workers = f"{dp} data-parallel groups (workers / model.sequence_parallel_size)"
        raise ConfigError(
            f"optim.batch_size={cfg.optim.batch_size} must be divisible by the "
            f"{workers if dp < cfg.trainer.world_size else f'{dp} workers'}"
        )


class SFTTrainer(StepTrainer[ActorGroup]):
    run_name = "sft"
    progress_keys = ("loss", "val/nll")

    def __init__(self, cfg: SFTConfig) -> None:
        check_sft_config(cfg)
        self.cfg = cfg
        seed_everything(cfg.trainer.seed)
        self.tokenizer = with_template_kwargs(
            load_tokenizer(cfg.model.path), cfg.data.apply_chat_template_kwargs, cfg.model.path
        )
        max_length = cfg.data.max_prompt_length + cfg.data.max_response_length
        # a vision-language model reads verl's multimodal rows: images travel with their rows in the Batch
        self.multimodal = is_vision_language(cfg.model.path)
        processor = run_processor(cfg.model.path, cfg.data) if self.multimodal else None
        data = cfg.data

        def make(files: Sequence[str]) -> SFTDataset | MultimodalSFTDataset:
            if processor is None:
                return SFTDataset(
                    files, self.tokenizer, max_length, data.response_key, data.overlong_prompts, data.train_on
                )
            min_pixels, max_pixels = pixel_bounds(processor)  # data.min_pixels / max_pixels, or the model's
            return MultimodalSFTDataset(
                files,
                processor,
                max_length,
                data.response_key,
                data.overlong_prompts,
                data.train_on,
                min_pixels=min_pixels,
                max_pixels=max_pixels,
            )

        self.collate_fn: Callable[..., Batch] = collate_multimodal_sft if self.multimodal else collate_sft
        self.non_tensor_keys = [MULTI_MODAL_INPUTS] if self.multimodal else []
        self.train_set = make(cfg.data.train_files)
        self.val_set = make(cfg.data.val_files) if cfg.data.val_files else None
        collate = partial(self.collate_fn, pad_token_id=self.tokenizer.pad_token_id)
        self.loader = PromptDataLoader(
            self.train_set, cfg.optim.batch_size, collate, shuffle=cfg.data.shuffle, seed=cfg.trainer.seed
        )
        self.loss = LossSpec("cross_entropy")

    def start(self) -> tuple[ActorGroup, dict[str, ResourcePool]]:
        cfg = self.cfg
        spec = ActorRolloutRefSpec(
            engine=engine_config(
                cfg.model,
                optim=optim_only(cfg.optim),
                total_steps=cfg.trainer.total_steps,
                micro_batch_size=cfg.optim.micro_batch_size,
                max_token_len=cfg.optim.max_token_len_per_worker,
                config_section="optim",
            ),
            with_rollout=False,
            seed=cfg.trainer.seed,
            threads=threads_per_worker(cfg.trainer),
        )
        request = RoleRequest(
            "actor_rollout_ref",
            ActorRolloutRefWorker,
            spec,
            sequence_parallel_size=cfg.model.sequence_parallel_size,
        )
        started, pools = start_role_groups(cfg.trainer, cfg.ray, [request])
        return ActorGroup(started[request.role]), pools

    def train_step(self, group: ActorGroup, progress: RunProgress) -> StepResult:
        batch = self.loader.next_batch().select(
            [keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, keys.LOSS_MASK], self.non_tensor_keys
        )
        batch.meta[keys.GLOBAL_TOKENS] = float(batch[keys.LOSS_MASK].sum())
        batch.meta[keys.GLOBAL_SEQS] = len(batch)
        with progress.stage("update"):
            metrics = group.forward_backward(batch, self.loss)
            metrics.update(group.optim_step())
        return StepResult(metrics, float(batch[keys.ATTENTION_MASK].sum()))

    def stop_early(self, step: int, metrics: dict[str, float]) -> bool:
        """Stop once the held-out NLL reaches `trainer.stop_at_val_nll` (0 = never)."""
        target = self.cfg.trainer.stop_at_val_nll
        if metrics.get("val/nll", float("inf")) > target:
            return False
        print(
            f"sft: stopped at step {step}: val/nll {metrics['val/nll']:.3f} <= trainer.stop_at_val_nll {target}",
            flush=True,
        )
        return True

    def validate(self, group: ActorGroup) -> dict[str, float]:
        """`val/nll`: mean negative log-likelihood per response token on the validation split."""
        assert self.val_set is not None
        rows = min(len(self.val_set), self.cfg.data.val_max_prompts or len(self.val_set))
        items = [self.val_set[i] for i in range(rows)]
        # every data-parallel group gets as many rows: fillers repeat the last one and are left out after
        fillers = [items[-1]] * (-rows % group.data_parallel_size)
        batch = self.collate_fn(items + fillers, pad_token_id=self.tokenizer.pad_token_id)
        inputs = batch.select([keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS], self.non_tensor_keys)
        log_probs = group.forward(inputs, model="actor")[keys.OLD_LOG_PROBS][:rows]
        mask = batch[keys.LOSS_MASK][:rows]
        return {"val/nll": float(-(log_probs * mask).sum() / mask.sum().clamp(min=1))}
