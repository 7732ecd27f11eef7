"""The config sections every command shares: the model, its LoRA adapters, the optimizer, the data files and
lengths, the Ray connection; and the value types (`Literal`s) they and the commands' schemas use.

Part of the schema (posttrain/config/schema.py re-exports every name): frozen dataclasses, one per section,
the single source of truth for each key. YAML under `config/yaml/` holds the same defaults. Imports nothing
of posttrain: the command schemas (schema_rl.py, schema_sft.py) build on this module, never the reverse.
Counting convention: every batch size counts samples (prompt x response pairs) unless its name says `prompts`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Dtype = Literal["float32", "bfloat16"]
Device = Literal["auto", "cpu", "cuda"]
Backend = Literal["ray", "local"]
LrSchedule = Literal["constant", "cosine"]


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters through peft; rank 0 = full fine-tuning."""

    rank: int = 0
    alpha: float = 16.0
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    dropout: float = 0.0  # > 0 makes recomputed log-probs differ from the sampled ones (train mode)
    # mixture of experts: the fused 3-D expert parameters that get adapters (peft's target_parameters), by name
    # or dotted suffix, e.g. [gate_up_proj, down_proj] for Qwen2-MoE / Qwen3-MoE; () = none
    target_parameters: tuple[str, ...] = ()

    @property
    def adapts_output_head(self) -> bool:
        """Whether the adapters adapt the output projection (`lm_head`): then a tied model's head must be
        untied wherever the adapter is merged or copied (the head changes, the embeddings must not)."""
        return self.rank > 0 and "lm_head" in self.target_modules


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and its learning-rate schedule: one definition for every role that trains (`actor.optim`,
    `critic.optim`, SFT's `optim`)."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping
    lr_schedule: LrSchedule = "constant"  # cosine decays to min_lr_ratio * lr over the run's optimizer steps
    warmup_steps: int = 0  # linear warm-up, in optimizer steps
    min_lr_ratio: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # a local Hugging Face directory (config.json, weights, tokenizer)
    dtype: Dtype = "float32"  # parameters, master weights and optimizer state
    compute_dtype: Literal["", "float32", "bfloat16"] = (
        ""  # "" = dtype; bfloat16 over float32 weights = mixed precision (FSDP2 policy)
    )
    attn_implementation: str = "sdpa"  # sdpa | eager | flash_attention_2 (GPU)
    remove_padding: bool = True  # pack sequences for training and log-prob passes (no compute on padding)
    pack_row_tokens: int = 256  # tokens per packed row; attention is dense within a row on sdpa/eager
    share_prompt: bool = True  # packed: the n samples of a prompt share one pass over it (sdpa/eager)
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, more compute
    offload: bool = False  # parameters, gradients and optimizer step in CPU memory (GPU machines only)
    # Ulysses sequence parallelism (sp): each packed row split across sp ranks, attention's heads exchanged
    # with all-to-all; world = dp x sp, batches split over the dp = world / sp groups. Training and log-prob
    # passes only (generation runs per rank without it); needs remove_padding and sdpa; sp divides the heads
    sequence_parallel_size: int = 1
    lora: LoraConfig = field(default_factory=LoraConfig)
    # mixture-of-experts policies: weight of the router's load-balancing loss added in the update (logged as
    # actor/router_aux_loss); null = the model config's router_aux_loss_coef, 0 = off; dense models: 0 or null
    router_aux_loss_coef: float | None = None
    # a vision-language model's vision encoder: auto = trained when make-model built the model from scratch
    # (config.json's posttrain_from_scratch), frozen for a pretrained one; LoRA keeps it frozen
    vision_tower: Literal["auto", "frozen", "trained"] = "auto"


@dataclass(frozen=True)
class DataConfig:
    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    max_prompt_length: int = 64  # tokens, after the chat template
    max_response_length: int = 16  # tokens generated per sample
    train_batch_prompts: int = 32  # prompts per RL step (each sampled rollout.n times)
    val_max_prompts: int = 256  # prompts of the validation split used per validation (0 = all)
    overlong_prompts: Literal["filter", "error"] = "filter"
    shuffle: bool = True
    response_key: str = "extra_info.answer"  # SFT only: dotted path of the target response in a row
    # vision-language models: each image is resized to an area (width * height) within these bounds, by the image
    # processor and in the image-token counts against max_prompt_length alike
    min_pixels: int | None = None  # vision-language: smallest image area in pixels; null = the model's own
    max_pixels: int | None = None  # vision-language: largest image area in pixels; null = the model's own
    # verl's: more arguments of the model's chat template wherever it renders (e.g. enable_thinking: false, a
    # Qwen3 prompt without thinking); a name the template never reads is refused, not ignored
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RayConfig:
    address: str = ""  # empty = start a local, loopback-only Ray instance
    num_cpus: int = 0  # local instance only; 0 = all cores
    tmpdir: str = ""  # local instance only; empty = <system temp>/posttrain-ray-<uid>
