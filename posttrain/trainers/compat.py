"""Whether a checkpoint can resume this RL run: the same model architecture, LoRA rank and critic.

Another world size is allowed (torch.distributed.checkpoint reshards weights and optimizer state) with a
warning, because per-rank sampler RNG states are not resharded.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from posttrain.config.load import to_dict
from posttrain.errors import ConfigError
from posttrain.models import load_config

log = logging.getLogger(__name__)


def model_fingerprint(path: str) -> dict[str, Any]:
    """The architecture facts a checkpoint must agree with (not the path, which may move)."""
    config = load_config(path).to_dict()
    fields = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size")
    return {k: config.get(k) for k in fields}


# settings the data position depends on: the loader resumes at batch k of the epoch's permutation, so
# another batch size skips or repeats rows, another seed or shuffle redraws the rest of the epoch
DATA_ORDER_KEYS = ("data.train_batch_prompts", "optim.batch_size", "trainer.seed", "data.shuffle")
# settings expected to change on a resume (a longer run, where it resumes)
RESUME_KEYS = ("trainer.total_steps", "trainer.resume", "trainer.max_restarts")


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_changed_settings(latest: Path, saved: dict[str, Any], cfg: Any) -> None:
    """Refuse a resume under settings that change the data order (DATA_ORDER_KEYS); warn, naming them, about
    every other setting changed since the checkpoint (a new learning rate is a choice, a new data file maybe
    a moved one; either way it is said)."""
    before, now = _flat(saved), _flat(to_dict(cfg))
    changed = {k: (before[k], now[k]) for k in now if k in before and _same(before[k]) != _same(now[k])}
    for key in DATA_ORDER_KEYS:
        if key in changed:
            old, new = changed[key]
            raise ConfigError(
                f"checkpoint {latest} was trained with {key}={old}; this run has {key}={new}: the data position "
                "it resumes at would skip or repeat rows. Keep the setting, or start a new run "
                "(trainer.resume=false, from an exported model)"
            )
    rest = {k: v for k, v in changed.items() if k not in RESUME_KEYS}
    if rest:
        listed = "; ".join(f"{k}: {old} -> {new}" for k, (old, new) in sorted(rest.items()))
        log.warning("resuming %s with settings changed since it was saved: %s", latest, listed)


def _same(value: Any) -> Any:
    """A config value compared as a set where it is a list of names (their order does not matter)."""
    return sorted(map(str, value)) if isinstance(value, list | tuple) else value


def check_resumable(latest: Path, state: dict[str, Any], cfg: Any, trainer_name: str = "rl") -> None:
    """Raise ConfigError naming the mismatch when checkpoint `latest` (its trainer `state`) cannot resume
    `cfg` (an RL config, or an offline trainer's: model, trainer.world_size)."""
    wrote = state.get("trainer", "rl")  # which command's checkpoint (older ones: posttrain train's)
    if wrote != trainer_name:
        raise ConfigError(
            f"checkpoint {latest} was written by `posttrain {'train' if wrote == 'rl' else wrote}`; this is "
            f"`posttrain {'train' if trainer_name == 'rl' else trainer_name}`: give it a run directory of its own "
            "(trainer.run_dir)"
        )
    fingerprint = model_fingerprint(cfg.model.path)
    if state["model"] != fingerprint:
        raise ConfigError(f"checkpoint {latest} is of another model ({state['model']}) than {fingerprint}")
    saved = state.get("config", {})
    lora = saved.get("model", {}).get("lora", {})
    now = to_dict(cfg)["model"]["lora"]
    # what the trained adapter is: its rank (the shapes), alpha (the scale of its delta) and the layers it
    # adapts (DCP loads the keys the model asks for: fewer target modules silently dropped the others')
    adapted = ("rank", "alpha", "target_modules", "target_parameters") if now["rank"] > 0 else ("rank",)
    for key in adapted:
        if key in lora and _same(lora[key]) != _same(now[key]):
            raise ConfigError(
                f"checkpoint {latest} was trained with model.lora.{key}={lora[key]}; this run has "
                f"model.lora.{key}={now[key]} (resuming would change the trained adapter)"
            )
    critic = getattr(cfg, "critic", None)  # the RL trainer's; the offline trainers have none
    if critic is not None and (latest / "critic").exists() != critic.enable:
        has = "has" if (latest / "critic").exists() else "has no"
        raise ConfigError(f"checkpoint {latest} {has} critic; this run has critic.enable={critic.enable}")
    check_changed_settings(latest, saved, cfg)
    if state["world_size"] != cfg.trainer.world_size:
        log.warning(
            "checkpoint %s was written by %d workers, this run has %d: weights and optimizer state are "
            "resharded, but per-worker sampler RNG states are not, so the run will not repeat the original "
            "one exactly",
            latest,
            state["world_size"],
            cfg.trainer.world_size,
        )
