"""The schemas of the commands built on SFT's engine and worker: `posttrain sft` (SFTConfig), `posttrain dpo`
(DPOConfig), `posttrain rm` (RMConfig) and `posttrain distill` (DistillConfig), with the sections they share
(SFTOptimConfig, SFTDataConfig, SFTTrainerConfig) and their own (the DPO, reward-model and GKD losses).

Part of the schema (posttrain/config/schema.py re-exports every name). Imports only schema_shared.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from posttrain.config.schema_shared import (
    Backend,
    DataConfig,
    Device,
    ModelConfig,
    OptimConfig,
    RayConfig,
)


@dataclass(frozen=True)
class SFTOptimConfig(OptimConfig):
    """The optimizer (OptimConfig's fields; SFT's defaults are set in SFTConfig) and SFT's batch sizes."""

    batch_size: int = 64  # samples per optimizer step (over all workers)
    micro_batch_size: int = 64  # samples per forward/backward on one worker
    max_token_len_per_worker: int = 0  # token budget per micro-batch; 0 = by micro_batch_size


@dataclass(frozen=True)
class SFTDataConfig(DataConfig):
    """SFT's data: rows with `messages` (chats), `text` (continued pre-training) or verl's prompt + response
    (posttrain/data/sft_dataset.py), and which tokens of a chat carry loss (posttrain/data/chat_masks.py)."""

    train_on: Literal["last_assistant", "all_assistant", "all_messages", "everything"] = "all_assistant"


@dataclass(frozen=True)
class SFTTrainerConfig:
    run_dir: str = "runs/sft"
    total_steps: int = 200
    nnodes: int = 1
    n_workers_per_node: int = 1
    backend: Backend = "local"
    device: Device = "auto"
    cpus_per_worker: float = 1.0  # Ray CPUs reserved per worker
    gpus_per_worker: float = 1.0  # Ray GPUs per worker when the device is cuda
    collective_timeout_s: float = 1800.0  # torch.distributed timeout and the driver's wait on a worker call
    seed: int = 0
    val_every: int = 0  # steps; 0 = only at the end
    # any of console, jsonl, tensorboard, wandb (offline, in <run_dir>/wandb), mlflow (<run_dir>/mlflow.db)
    loggers: tuple[str, ...] = ("console", "jsonl")
    plots: bool = True  # PNG figures of metrics.jsonl in <run_dir>/plots when the run ends (needs jsonl)
    threads_per_worker: int = 0
    save_hf_dir: str = ""  # where the trained model is written as a HF directory; empty = <run_dir>/hf
    # checkpoints in <run_dir>/step_<N> (weights, optimizer, data position, RNG) every save_every steps
    # (0: none periodically; a SIGINT/SIGTERM stop still saves one), resumed from on the next start
    save_every: int = 0
    max_checkpoints_to_keep: int = 2
    resume: bool = True  # resume from <run_dir>/latest when present
    resume_from: str = ""  # resume from this checkpoint instead (step_N of run_dir, or a checkpoint's path)
    stop_at_val_nll: float = 0.0  # early stop: end (and export) once a validation's NLL is at most this

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_workers_per_node


@dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning: the same engine, cross-entropy on response tokens."""

    model: ModelConfig = field(
        default_factory=lambda: ModelConfig(share_prompt=False)
    )  # one response per prompt
    data: SFTDataConfig = field(default_factory=lambda: SFTDataConfig(max_response_length=32))
    optim: SFTOptimConfig = field(
        default_factory=lambda: SFTOptimConfig(lr=1e-3, betas=(0.9, 0.95), warmup_steps=10)
    )
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
    ray: RayConfig = field(default_factory=RayConfig)


@dataclass(frozen=True)
class DPODataConfig:
    """Preference pairs in TRL's columns (posttrain/data/preference_dataset.py)."""

    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    max_length: int = 256  # tokens of prompt + completion, the longer of chosen and rejected
    overlong: Literal["filter", "error"] = "filter"
    shuffle: bool = True
    val_max_pairs: int = 1024  # pairs of the validation split used per validation (0 = all)


@dataclass(frozen=True)
class DPOLossConfig:
    """The preference loss (posttrain/algorithms/preference_losses.py has each formula and paper); TRL's names."""

    # sigmoid | ipo | hinge | robust | apo_zero | sft | simpo | orpo; several are summed with loss_weights
    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] = ()  # one per loss_type; empty = all 1
    beta: float = 0.1  # the KL strength (DPO's beta); orpo: the odds-ratio weight lambda (TRL's ORPO beta)
    label_smoothing: float = 0.0  # sigmoid / robust / simpo: the assumed rate of flipped labels
    simpo_gamma: float = 0.5  # simpo: the target reward margin
    # model: the frozen initial weights, run each step (with LoRA: the adapter off, no second copy);
    # precompute: the initial weights' log-probs of every pair, computed once before training (no second copy);
    # columns: the data's ref_chosen_logps / ref_rejected_logps. Reference-free losses (simpo, orpo, sft) use none.
    reference: Literal["model", "precompute", "columns"] = "model"


@dataclass(frozen=True)
class DPOConfig:
    """Preference optimisation (`posttrain dpo`): SFT's engine, packing and worker, a pairwise loss.
    `optim.batch_size` and `optim.micro_batch_size` count pairs (two sequences each)."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(share_prompt=False))
    data: DPODataConfig = field(default_factory=DPODataConfig)
    dpo: DPOLossConfig = field(default_factory=DPOLossConfig)
    optim: SFTOptimConfig = field(
        default_factory=lambda: SFTOptimConfig(lr=1e-6, batch_size=32, micro_batch_size=8)
    )
    trainer: SFTTrainerConfig = field(
        default_factory=lambda: SFTTrainerConfig(run_dir="runs/dpo", total_steps=100)
    )
    ray: RayConfig = field(default_factory=RayConfig)


@dataclass(frozen=True)
class RMDataConfig(DPODataConfig):
    """Preference pairs as for dpo (posttrain/data/preference_dataset.py), with an optional margin per pair."""

    # per-pair margins (TRL's column): the loss asks r_chosen - r_rejected to exceed it; read when the data
    # has the column (every row or none); empty = never read
    margin_column: str = "margin"


@dataclass(frozen=True)
class RMLossConfig:
    """The Bradley-Terry loss (posttrain/algorithms/reward_model_loss.py)."""

    # Eisenstein et al.'s centering: + coef * (r_chosen + r_rejected)^2 per pair (TRL's name); 0 = off
    center_rewards_coefficient: float = 0.0


@dataclass(frozen=True)
class RMConfig:
    """Reward-model training (`posttrain rm`): the policy family's sequence classifier (one score) trained with
    the Bradley-Terry loss on preference pairs; `optim.batch_size` and `optim.micro_batch_size` count pairs."""

    # rows run right-padded (no packing); the score is the head's output at a row's last token
    model: ModelConfig = field(default_factory=lambda: ModelConfig(remove_padding=False, share_prompt=False))
    data: RMDataConfig = field(default_factory=RMDataConfig)
    rm: RMLossConfig = field(default_factory=RMLossConfig)
    optim: SFTOptimConfig = field(
        default_factory=lambda: SFTOptimConfig(lr=1e-5, batch_size=32, micro_batch_size=8)
    )
    trainer: SFTTrainerConfig = field(
        default_factory=lambda: SFTTrainerConfig(run_dir="runs/rm", total_steps=100)
    )
    ray: RayConfig = field(default_factory=RayConfig)


@dataclass(frozen=True)
class GKDConfig:
    """GKD (Agarwal et al. 2024; posttrain/algorithms/distillation.py): the generalised Jensen-Shannon divergence
    between a frozen teacher's and the student's next-token distributions over the whole vocabulary."""

    teacher_path: str = ""  # a causal LM directory with the student's tokenizer (required)
    beta: float = 0.5  # TRL's: 0 = forward KL(teacher || student), 1 = reverse KL(student || teacher)
    # share of steps whose batch is the student's own samples of the batch's prompts (else the data's responses)
    lmbda: float = 0.0
    temperature: float = 1.0  # of both distributions in the divergence, and of the student's sampling


@dataclass(frozen=True)
class DistillConfig:
    """Distillation (`posttrain distill`): SFT's data, engine and worker with GKD's loss against a teacher;
    `optim.batch_size` and `optim.micro_batch_size` count sequences."""

    # rows run right-padded (no packing): the loss needs each position's full-vocabulary logits
    model: ModelConfig = field(default_factory=lambda: ModelConfig(remove_padding=False, share_prompt=False))
    data: SFTDataConfig = field(default_factory=lambda: SFTDataConfig(max_response_length=32))
    distill: GKDConfig = field(default_factory=GKDConfig)
    optim: SFTOptimConfig = field(
        default_factory=lambda: SFTOptimConfig(lr=1e-4, batch_size=32, micro_batch_size=16)
    )
    trainer: SFTTrainerConfig = field(
        default_factory=lambda: SFTTrainerConfig(run_dir="runs/distill", total_steps=100)
    )
    ray: RayConfig = field(default_factory=RayConfig)
