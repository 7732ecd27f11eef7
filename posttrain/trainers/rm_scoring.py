"""Reward-model scores in RL (`reward.model.*`): each response re-rendered for the reward model, scored by its group.

The reward model may have another tokenizer and chat template than the policy, so it never sees the policy's
tokens: each row's prompt messages and decoded response are rendered as one conversation with the reward
model's own template (the user turn(s), then the response as the assistant turn, as `posttrain rm` renders a
chat pair's completion) and scored at its last token. The rows go to the `reward_model` worker group
(controller/placement.py places it on the trainer's pool or its own); `RewardStage` adds the scores to the
reward (trainers/rewarding.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from posttrain.algorithms.reward_ensemble import COMBINE_MODES, combine_ensemble_scores, ensemble_disagreement
from posttrain.config.schema import RewardModelConfig, RLConfig
from posttrain.controller.roles import RewardModelGroup
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.chat_masks import completion_tokens
from posttrain.data.sft_dataset import collate_sft
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.reward_engine import REWARD_HEAD
from posttrain.errors import ConfigError, RewardError
from posttrain.models import check_model_dir, load_config, load_tokenizer
from posttrain.workers.reward_model import RM_SCORE, RewardModelSpec

RM_INPUTS = [keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS]


def check_reward_model(cfg: RLConfig) -> None:
    """`reward.model.*` settings that cannot work, or would be ignored, are refused naming the key."""
    rm = cfg.reward.model
    if not rm.path:
        unused = [
            f"reward.model.{f.name}={getattr(rm, f.name)!r}"
            for f in dataclasses.fields(rm)
            if getattr(rm, f.name) != getattr(RewardModelConfig(), f.name)
        ]
        if unused:
            raise ConfigError(f"{', '.join(unused)} set but reward.model.path is empty (no reward model)")
        return
    for key, path in [("path", rm.path), *((f"ensemble[{i}]", p) for i, p in enumerate(rm.ensemble))]:
        check_reward_model_dir(f"reward.model.{key}", path)
    check_ensemble(rm)
    if not (math.isfinite(rm.weight) and rm.weight > 0):
        raise ConfigError(f"reward.model.weight must be a finite number > 0, got {rm.weight}")
    if rm.micro_batch_size <= 0:
        raise ConfigError(f"reward.model.micro_batch_size must be > 0, got {rm.micro_batch_size}")
    if cfg.agent.enable:
        raise ConfigError(
            "reward.model with agent.enable: agent episodes are scored by their rule reward only"
        )
    if cfg.algorithm.gdpo_reward_keys:
        raise ConfigError(
            "algorithm.gdpo_reward_keys are components of the rule reward function's results; a reward model "
            "has one score: unset reward.model.path or algorithm.gdpo_reward_keys"
        )


RM_INFO_FILE = "posttrain_rm.json"  # `posttrain rm` writes it beside the model: its training pairs' format


def check_reward_model_dir(key: str, path: str) -> None:
    """`path` (the setting `key`) holds a sequence classifier whose tokenizer has a chat template, trained
    (when `posttrain rm` says how) on chat pairs: RL renders its inputs with the chat template."""
    check_model_dir(path)
    info = Path(path) / RM_INFO_FILE
    if info.exists():
        fmt = json.loads(info.read_text()).get("input_format", "chat")
        if fmt != "chat":
            raise ConfigError(
                f"{key}={path} was trained on {fmt} pairs (prompt + completion as plain text, {info.name}); "
                "RL scores each response as the prompt's messages plus the response in the chat template, a "
                "format it never saw: train it on chat pairs (prompt, chosen, rejected as message lists)"
            )
    architectures = getattr(load_config(path), "architectures", None) or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise ConfigError(
            f"{key}={path} holds {', '.join(architectures) or 'a model'}, not a reward model (a "
            "...ForSequenceClassification with one score): train one with `posttrain rm`"
        )
    if not getattr(load_tokenizer(path), "chat_template", None):
        raise ConfigError(
            f"{key}={path}: its tokenizer has no chat template, and each response is scored as the prompt's "
            "messages + the response rendered with it; add one (tokenizer_config.json)"
        )


def check_ensemble(rm: RewardModelConfig) -> None:
    """`reward.model.ensemble`/`combine`/`uwo_coef` that cannot work or would be ignored are refused."""
    paths = [rm.path, *rm.ensemble]
    repeated = sorted({p for p in paths if paths.count(p) > 1})
    if repeated:
        raise ConfigError(f"reward.model.path/ensemble name {', '.join(repeated)} more than once")
    unused = [f"reward.model.{k}={v}" for k, v, unset in [("combine", rm.combine, "mean"), ("uwo_coef", rm.uwo_coef, 0)]
              if v != unset]  # fmt: skip
    if not rm.ensemble and unused:
        raise ConfigError(
            f"{', '.join(unused)} set but reward.model.ensemble is empty: one reward model has nothing to "
            "combine (add models to reward.model.ensemble)"
        )
    if rm.combine not in COMBINE_MODES:
        raise ConfigError(f"reward.model.combine={rm.combine!r}; valid: {', '.join(COMBINE_MODES)}")
    if rm.combine == "uwo" and not (math.isfinite(rm.uwo_coef) and rm.uwo_coef > 0):
        raise ConfigError(f"reward.model.combine=uwo needs reward.model.uwo_coef > 0, got {rm.uwo_coef}")
    if rm.combine != "uwo" and rm.uwo_coef != 0:
        raise ConfigError(
            f"reward.model.uwo_coef={rm.uwo_coef} is used by combine=uwo only (combine={rm.combine})"
        )


def input_limit(config: RewardModelConfig, path: str) -> int:
    """The longest input reward model `path` scores: reward.model.max_length, or its context window."""
    context = getattr(load_config(path), "max_position_embeddings", None)
    if config.max_length < 0:
        raise ConfigError(
            f"reward.model.max_length must be >= 0 (0 = the model's context), got {config.max_length}"
        )
    if config.max_length and context and config.max_length > context:
        raise ConfigError(
            f"reward.model.max_length={config.max_length} is over {path}'s context of {context} tokens"
        )
    return config.max_length or int(context or 2**31)


def reward_model_spec(cfg: RLConfig, threads: int) -> RewardModelSpec:
    """The reward model's frozen engine: the model section's precision and attention, right-padded rows."""
    rm, model = cfg.reward.model, cfg.model
    engine = EngineConfig(
        model_path=rm.path,
        dtype=model.dtype,
        compute_dtype=model.compute_dtype,
        attn_implementation=model.attn_implementation,
        offload=model.offload,
        head=REWARD_HEAD,
        trainable=False,
        remove_padding=False,
        share_prompt=False,
        micro_batch_size=rm.micro_batch_size,
    )
    ensemble = tuple(dataclasses.replace(engine, model_path=path) for path in rm.ensemble)
    return RewardModelSpec(engine=engine, ensemble=ensemble, seed=cfg.trainer.seed, threads=threads)


class RewardModelScorer:
    """Scores a step's responses with the reward model (or the ensemble of `reward.model.ensemble`, each model
    with its own tokenizer, their scores combined by algorithms/reward_ensemble.py): renders the rows, calls
    the group, checks the scores."""

    def __init__(self, config: RewardModelConfig) -> None:
        self.config = config
        paths = [config.path, *config.ensemble]
        self.tokenizers = [load_tokenizer(path) for path in paths]
        self.max_lengths = [input_limit(config, path) for path in paths]
        self.group: RewardModelGroup | None = None
        self._disagreement: list[float] = []  # this step's per-response spread of the ensemble's scores
        self._truncated = 0  # inputs cut to max_length (truncation=left) since the last metrics

    def attach(self, group: RewardModelGroup | None) -> None:
        """The running `reward_model` group (None while the workers are down)."""
        self.group = group

    def inputs(self, batch: Batch, model: int = 0) -> Batch:
        """Right-padded rows of reward model `model`'s tokens: prompt messages + response as the assistant
        turn, rendered with that model's chat template."""
        tokenizer = self.tokenizers[model]
        items = []
        for i, (messages, response) in enumerate(
            zip(batch[keys.PROMPT_MESSAGES], batch[keys.RESPONSE_TEXT], strict=True)
        ):
            where = f"reward model input of row {i} (prompt index {batch[keys.INDEX][i]})"
            completion = [{"role": "assistant", "content": str(response)}]
            ids, _ = completion_tokens(tokenizer, list(messages), completion, where)
            limit = self.max_lengths[model]
            if len(ids) > limit:
                if self.config.truncation == "error":
                    raise RewardError(
                        f"{where} is {len(ids)} tokens, over the {limit} the reward model "
                        f"{[self.config.path, *self.config.ensemble][model]} takes (reward.model.max_length, "
                        "default its context); reward.model.truncation=left keeps its last tokens"
                    )
                ids = ids[-limit:]
                self._truncated += 1
            items.append({"input_ids": ids, keys.LOSS_MASK: [0] * len(ids), "index": i})
        return collate_sft(items, int(tokenizer.pad_token_id)).select(RM_INPUTS, [])

    def score(self, batch: Batch) -> torch.Tensor:
        """(B,) float32 scores (an ensemble's combined); a RewardError names the rows of a non-finite score
        and the model that gave it."""
        if self.group is None:
            raise RuntimeError("the reward model's workers are not running (RewardStage.attach_model)")
        paths = [self.config.path, *self.config.ensemble]
        per_model = []
        for model, path in enumerate(paths):
            inputs = self.inputs(batch, model)
            extra = -len(inputs) % self.group.world_size  # every rank gets as many rows
            if extra:
                inputs = Batch.concat([inputs, inputs.index([len(inputs) - 1] * extra)])
            scores: torch.Tensor = self.group.score(inputs, model)[RM_SCORE][: len(batch)].to(torch.float32)
            bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
            if bad:
                raise RewardError(
                    f"the reward model {path} gave non-finite scores to rows {bad[:10]} of {len(batch)}"
                )
            per_model.append(scores)
        if len(per_model) == 1:
            return per_model[0]
        stacked = torch.stack(per_model)
        self._disagreement.extend(ensemble_disagreement(stacked).tolist())
        return combine_ensemble_scores(stacked, self.config.combine, self.config.uwo_coef)

    def ensemble_metrics(self) -> dict[str, float]:
        """`reward/model_score/ensemble_std`: the ensemble's spread per response, averaged over every response
        scored since the last call (a step's, ReMax's greedy baselines and dynamic sampling's dropped rounds
        included; none for one model); `reward/model_truncated`: the inputs cut to max_length since then."""
        out = {}
        if self.config.truncation == "left":
            out["reward/model_truncated"] = float(self._truncated)
            self._truncated = 0
        if self._disagreement:
            out["reward/model_score/ensemble_std"] = float(torch.tensor(self._disagreement).mean())
            self._disagreement = []
        return out
