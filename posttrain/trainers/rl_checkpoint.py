"""The RL run's side of checkpointing: what a checkpoint of the run holds, when the loop writes one, and the
line that tells a user where a stopped or failed run resumes.

trainers/checkpoint.py writes and restores a checkpoint over any parts; this module names the RL run's parts
(the worker groups' files; the dataloader, rewards and KL controller, the driver's RNG) and its cadence, so
that trainers/rl.py only says "save" and "resume".
"""

from __future__ import annotations

import logging
from typing import Any

from posttrain.config.load import to_dict
from posttrain.config.schema import RLConfig
from posttrain.controller.roles import ActorGroup, CriticGroup, RolloutGroup, Stateful
from posttrain.data.dataloader import PromptDataLoader
from posttrain.errors import ConfigError
from posttrain.trainers.async_rollout import LoaderPosition, TrainedLoaderState
from posttrain.trainers.checkpoint import CheckpointManager, DriverState
from posttrain.trainers.compat import model_fingerprint
from posttrain.trainers.rewarding import RewardStage
from posttrain.workers.process import ProcessRNG

log = logging.getLogger(__name__)


def checkpoint_parts(
    actor: ActorGroup,
    critic: CriticGroup | None,
    rollout_pool: RolloutGroup | None,
    rewards: RewardStage,
    loader: PromptDataLoader,
    producer: LoaderPosition | None,
    settled: list[str],
) -> tuple[list[Stateful], dict[str, DriverState]]:
    """What a checkpoint holds: each worker group's files, and the driver's parts by name. Under asynchronous
    RL the dataloader's part is its position after the last trained batch (`producer`), with streaming also
    the prompts already settled after it (restored into `settled`)."""
    workers: list[Stateful] = [actor]
    if critic is not None:
        workers.append(critic)
    if rollout_pool is not None:
        workers.append(rollout_pool)
    states: dict[str, DriverState] = {
        "rewards": rewards,
        "dataloader": TrainedLoaderState(loader, producer, settled),
        "rng": ProcessRNG(),
    }
    return workers, states


def checkpoint_meta(cfg: RLConfig) -> dict[str, Any]:
    """What a resume checks against (trainers/compat.py): the world size, the model, the whole config."""
    return {
        "trainer": "rl",  # which command wrote it (the offline trainers put their own name)
        "world_size": cfg.trainer.world_size,
        "model": model_fingerprint(cfg.model.path),
        "config": to_dict(cfg),
    }


def resume_hint(checkpoints: CheckpointManager, resume: bool) -> str:
    """Where the same command resumes (`resume`: trainer.resume), or why it cannot."""
    try:
        latest = checkpoints.latest()
    except ConfigError as exc:
        return str(exc)
    if latest is None:
        return "no checkpoint to resume from"
    how = "the same command" if resume else "the same command with trainer.resume=true"
    return f"{how} resumes from {latest}"


class CheckpointCadence:
    """When the loop writes a checkpoint: every `trainer.save_every` steps (0: never periodically), after the
    last step, and when a stop was requested. A periodic checkpoint is deferred while reward failures are over
    the rate (`failing_since`: the step they started): should the run stop for them, the resume hint points
    before them; it is written as soon as a step is under the rate again. One per attempt of the loop."""

    def __init__(self, save_every: int) -> None:
        self.save_every = save_every
        self.deferred = False  # a periodic checkpoint skipped while reward failures were over the rate

    def due(self, step: int, final: bool, failing_since: int | None) -> bool:
        """Whether to save after `step`; `final`: the last step, or a stop was requested."""
        saving = self.save_every and step % self.save_every == 0
        if saving and failing_since is not None and not final:
            self.deferred = True
            log.warning("step %d: checkpoint deferred (reward errors since step %d)", step, failing_since)
            return False
        if saving or final or (self.deferred and failing_since is None):
            self.deferred = False
            return True
        return False
