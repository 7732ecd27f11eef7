"""The reward model's engine: a Hugging Face sequence classifier (one score per sequence) under FSDP2.

The model is the `...ForSequenceClassification` of the policy's family with one label (Qwen2's for a Qwen2
directory), built from a causal LM's directory (a new `score` head) or restored from a saved reward model. Its
score is the head's output at the sequence's last token, as Hugging Face defines it: the rightmost token that
is not `config.pad_token_id`. Rows are padded with the tokenizer's pad id, which a config may name otherwise:
the padding is rewritten to the config's id before the forward, so a short row is never scored on padding
(its score would depend on what it was batched with). The score is read from the model's own output (under
FSDP2 the head's parameters are gathered for the backward by hooks on that output). `export_hf` writes the
tokenizer's pad id into the config, so `from_pretrained` with the tokenizer's padding scores alike.

Batches are right-padded rows (`input_ids`, `attention_mask`, `position_ids`), never packed. Everything but
construction, the forward pass and export is `TrainEngine`'s: micro-batching, AdamW and its schedule, gradient
clipping, sharded checkpoints; the loss receives (B,) scores where a causal LM's loss receives log-probs.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PreTrainedModel

from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.distributed import DistInfo, init_distributed, same_head_on_every_rank
from posttrain.engine.engine_config import DTYPES, EngineConfig, check_device_support
from posttrain.engine.fsdp import apply_fsdp
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError, ModelError

REWARD_HEAD = "reward"  # EngineConfig.head of a reward model


def load_reward_model(
    path: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
) -> PreTrainedModel:
    """The one-label sequence classifier of a local directory: a causal LM's (new head) or a reward model's.

    Its config names the pad token (the tokenizer's), which is how the model finds each row's last token.
    """
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from posttrain.models import load_config, load_tokenizer

    config = load_config(path)
    pad_id = getattr(config, "pad_token_id", None)
    if pad_id is None:
        pad_id = load_tokenizer(path).pad_token_id
    labels = getattr(config, "num_labels", 1) if _is_classifier(config) else 1
    if labels != 1:
        raise ModelError(f"{path} holds a classifier with {labels} labels; a reward model has one score")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the missing `score` head is expected from a policy's directory
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            path,
            num_labels=1,
            pad_token_id=pad_id,
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
        )
    except ValueError as exc:
        raise ModelError(
            f"cannot build a sequence classifier (reward model) from {path} ({config.model_type}): "
            f"{str(exc).splitlines()[0]}"
        ) from exc
    except (OSError, KeyError, ImportError) as exc:
        raise ModelError(f"cannot load a reward model from {path}: {exc}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.eval()


def _is_classifier(config: object) -> bool:
    return any(
        name.endswith("ForSequenceClassification") for name in getattr(config, "architectures", None) or []
    )


class RewardEngine(TrainEngine):
    """A sequence classifier + AdamW under FSDP2: `forward_backward(batch, loss_fn)` hands the loss (B,)
    scores, `compute_scores(batch)` returns them without gradients, `export_hf` writes the classifier."""

    def __init__(self, config: EngineConfig, dist_info: DistInfo | None = None) -> None:
        # TrainEngine.__init__ builds a causal LM or a value head; the attributes its other methods use are set
        # here for a sequence classifier instead
        dist_info = dist_info or DistInfo()
        if config.head != REWARD_HEAD:
            raise ConfigError(f"RewardEngine needs head='{REWARD_HEAD}', got '{config.head}'")
        if config.dtype not in DTYPES or (config.compute_dtype and config.compute_dtype not in DTYPES):
            raise ConfigError(f"model.dtype / compute_dtype must be one of {', '.join(DTYPES)}")
        if config.remove_padding or config.share_prompt:
            raise ConfigError(
                "the reward model runs right-padded rows: remove_padding and share_prompt must be off"
            )
        if config.lora.rank > 0:
            raise ConfigError("LoRA is not supported for the reward model (model.lora.rank must be 0)")
        if getattr(config, "sequence_parallel_size", 1) != 1:
            raise ConfigError("sequence parallelism is not supported for the reward model (rows are short)")
        self.config = config
        self.mesh, self.device = init_distributed(dist_info)
        check_device_support(config, self.device)
        self.world_size = self.dp_size = self.mesh.size()
        self.rank = dist.get_rank()
        model = load_reward_model(config.model_path, DTYPES[config.dtype], config.attn_implementation)
        self.pad_token_id = int(model.config.pad_token_id)
        model.to(self.device)
        same_head_on_every_rank(model)  # a fresh score head is drawn per rank (as the critic's)
        if config.trainable:
            model.train()
            for module in model.modules():  # scores of a pair must come from the same function
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
            if config.gradient_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.requires_grad_(False)
        # TrainEngine's class defaults hold for the rest: no LoRA, sequence parallelism, images or MoE
        # auxiliary loss (a reward model trains on the Bradley-Terry loss alone)
        compute_dtype = DTYPES[config.compute_dtype] if config.compute_dtype else None
        self.model = apply_fsdp(model, self.mesh, compute_dtype=compute_dtype, offload=config.offload)
        self._build_optimizer()

    def _log_probs(
        self, mb: Batch, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B,) scores of right-padded rows: the head at each row's last token (float32 at least)."""
        ids, mask = mb[keys.INPUT_IDS], mb[keys.ATTENTION_MASK]
        lengths = mask.sum(-1)
        if bool((lengths == 0).any()):
            raise ModelError("a reward model row has no tokens (an empty attention mask)")
        width = int(lengths.max())  # columns past the longest row are padding in every row
        ids, mask = ids[:, :width], mask[:, :width]
        # the model pools at the last token that is not its config's pad id: padding must be that id
        ids = ids.masked_fill(mask == 0, self.pad_token_id)
        scores = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=mb[keys.POSITION_IDS][:, :width],
            use_cache=False,
        ).logits[:, 0]
        return (scores if scores.dtype == torch.float64 else scores.float()), None

    def compute_scores(self, batch: Batch) -> torch.Tensor:
        """(B,) scores in the batch's row order, without gradients (eval mode)."""
        return self._outputs_no_grad(batch, 1.0, False)[0]

    def compute_log_prob(
        self, batch: Batch, temperature: float = 1.0, disable_adapter: bool = False
    ) -> torch.Tensor:
        raise ConfigError("a reward model has no log-probs; use compute_scores")

    def export_hf(self, out_dir: str | Path, merged: bool = True) -> None:
        """The classifier as a Hugging Face directory (config with num_labels=1 and the pad token, weights,
        the tokenizer) that `AutoModelForSequenceClassification.from_pretrained` loads; written by rank 0."""
        from transformers import AutoModelForSequenceClassification

        from posttrain.models import load_tokenizer, save_tokenizer_as_is

        full = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank == 0:
            config = self.model.config
            model = AutoModelForSequenceClassification.from_config(config, dtype=DTYPES[self.config.dtype])
            missing, unexpected = model.load_state_dict(full, strict=False)
            if missing or unexpected:
                raise RuntimeError(
                    f"export_hf: state dict mismatch: missing {missing}, unexpected {unexpected}"
                )
            tokenizer_pad = load_tokenizer(self.config.model_path).pad_token_id
            if tokenizer_pad is not None:  # Hugging Face pools at the last token that is not this id
                model.config.pad_token_id = int(tokenizer_pad)
            model.save_pretrained(out_dir)
            save_tokenizer_as_is(self.config.model_path, out_dir)
        dist.barrier()
