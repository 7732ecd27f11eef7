"""Frozen dataclass schemas: the single source of truth for every configuration key.

This module is the schema's one address (`from posttrain.config.schema import RLConfig`); the dataclasses
live by command, one idea a file:
- schema_shared.py: the sections every command shares (model, LoRA, optimizer, data, Ray) and value types;
- schema_rl.py: `posttrain train` (RLConfig) and its sections (rollout, actor, critic, algorithm, reward,
  agent, async RL, trainer, resources);
- schema_sft.py: `posttrain sft`, `dpo`, `rm` and `distill` (SFTConfig, DPOConfig, RMConfig, DistillConfig).

YAML files under `config/yaml/` hold the same defaults (a test keeps them equal) and presets; `load.py`
turns Hydra's composed config into these dataclasses, rejecting unknown keys by name.
Counting convention: every batch size counts samples (prompt x response pairs) unless its name says
`prompts`.
"""

from __future__ import annotations

from posttrain.config.schema_rl import (
    ActorConfig,
    AgentConfig,
    AlgorithmConfig,
    AsyncRLConfig,
    CriticConfig,
    OnPolicyDistillConfig,
    PoolConfig,
    ResourcesConfig,
    RewardConfig,
    RewardModelConfig,
    RLConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    RouterReplayConfig,
    TrainerConfig,
    VLLMConfig,
)
from posttrain.config.schema_sft import (
    DistillConfig,
    DPOConfig,
    DPODataConfig,
    DPOLossConfig,
    GKDConfig,
    RMConfig,
    RMDataConfig,
    RMLossConfig,
    SFTConfig,
    SFTDataConfig,
    SFTOptimConfig,
    SFTTrainerConfig,
)
from posttrain.config.schema_shared import (
    Backend,
    DataConfig,
    Device,
    Dtype,
    LoraConfig,
    LrSchedule,
    ModelConfig,
    OptimConfig,
    RayConfig,
)

__all__ = [
    "ActorConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "AsyncRLConfig",
    "Backend",
    "CriticConfig",
    "DPOConfig",
    "DPODataConfig",
    "DPOLossConfig",
    "DataConfig",
    "Device",
    "DistillConfig",
    "Dtype",
    "GKDConfig",
    "LoraConfig",
    "LrSchedule",
    "ModelConfig",
    "OnPolicyDistillConfig",
    "OptimConfig",
    "PoolConfig",
    "RLConfig",
    "RMConfig",
    "RMDataConfig",
    "RMLossConfig",
    "RayConfig",
    "ResourcesConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "VLLMConfig",
    "RolloutCorrectionConfig",
    "RouterReplayConfig",
    "SFTConfig",
    "SFTDataConfig",
    "SFTOptimConfig",
    "SFTTrainerConfig",
    "TrainerConfig",
]
