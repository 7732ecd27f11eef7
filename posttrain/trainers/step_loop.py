"""The loop the offline trainers share (`posttrain sft`, `dpo`, `rm`, `distill`): one place for what a run does
around its steps, so that each trainer holds only what differs (its data, its loss, its validation).

`StepTrainer.fit`: start the worker group; then per optimizer step `train_step` (the trainer's batch, loss and
update), its wall time and throughput, validation every `trainer.val_every` steps and after the last one,
one metrics row to the trackers and the progress line, and an optional early stop; finally the trained model
as a Hugging Face directory, written under a temporary name and renamed into place (a kill mid-export never
leaves a `hf/` that looks complete). The group, its pools, the trackers and the progress line are released on
every exit, an exception included.

Checkpoints, as the RL trainer's (trainers/checkpoint.py, one trainer per run directory): every
`trainer.save_every` steps the group's sharded weights and optimizer, the data position, the step and the
driver's RNG go to `<run_dir>/step_<N>`; the next start resumes from the newest (`trainer.resume`), checked
against the model and adapter it was trained with. SIGINT/SIGTERM finish the current step, save a checkpoint
and stop without the export, raising RunStopped (the command exits 128 + the signal's number; a script
calling `fit()` stops too rather than going on without the trained model).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from posttrain.config.load import to_dict
from posttrain.controller.resource_pool import ResourcePool
from posttrain.errors import ConfigError
from posttrain.tracking import Tracker
from posttrain.tracking.progress import RunProgress
from posttrain.trainers.checkpoint import STATE_FILE, CheckpointManager, DriverState, RunLock
from posttrain.trainers.compat import check_resumable
from posttrain.trainers.fault import RunStopped, StopSignals
from posttrain.trainers.rl_checkpoint import checkpoint_meta
from posttrain.workers.process import ProcessRNG

log = logging.getLogger(__name__)


class TrainedGroup(Protocol):
    """What the loop needs of a worker group: write the model, save and load its state, and stop."""

    def export_hf(self, out_dir: Path, /) -> None: ...

    def save_state(self, path: Path, /) -> None: ...

    def load_state(self, path: Path, /) -> None: ...

    def shutdown(self) -> None: ...


GroupT = TypeVar("GroupT", bound=TrainedGroup)


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: its metrics, and the tokens it ran (attention tokens; None = not reported)."""

    metrics: dict[str, float]
    tokens: float | None = None


class StepTrainer(ABC, Generic[GroupT]):
    """An offline trainer: `cfg.trainer` (run_dir, total_steps, val_every, loggers, plots, save_hf_dir) drives
    the loop; subclasses say how to start their group, take a step and validate."""

    run_name: ClassVar[str]  # the tracker's run name and the progress line's label
    progress_keys: ClassVar[tuple[str, ...]]  # metrics the progress line shows
    cfg: Any  # the command's config dataclass (has `.trainer`)
    val_set: Any  # held-out data, or None: no validation
    loader: Any  # the training data's loader (its position is checkpointed: state_dict/load_state_dict)
    stop_signal: int | None = None  # set when SIGINT/SIGTERM stopped fit() early

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.trainer.run_dir)

    @property
    def hf_dir(self) -> Path:
        return Path(self.cfg.trainer.save_hf_dir or self.run_dir / "hf")

    @abstractmethod
    def start(self) -> tuple[GroupT, dict[str, ResourcePool]]:
        """The worker group this trainer runs on, and the resource pools to release after it."""

    @abstractmethod
    def train_step(self, group: GroupT, progress: RunProgress) -> StepResult:
        """One optimizer step on the next batch."""

    @abstractmethod
    def validate(self, group: GroupT) -> dict[str, float]:
        """Held-out metrics (`val/...`), no update."""

    def before_steps(self, group: GroupT, progress: RunProgress) -> None:
        """Work once before the first step (e.g. DPO's precomputed reference log-probs)."""

    def stop_early(self, step: int, metrics: dict[str, float]) -> bool:
        """Whether to stop after `step` (its metrics, validation included) rather than run on."""
        return False

    def describe_export(self, folder: Path) -> None:
        """Files of this trainer's own beside the exported model (before it is renamed into place)."""

    def after_steps(self) -> None:
        """Work once after the last step, before the export (e.g. writing the final evaluation)."""

    def _validates_at(self, step: int) -> bool:
        every, last = self.cfg.trainer.val_every, step == self.cfg.trainer.total_steps
        return self.val_set is not None and ((every and step % every == 0) or last)

    def driver_states(self) -> dict[str, DriverState]:
        """The driver-side parts of a checkpoint: the data position and the driver's RNG."""
        return {"dataloader": self.loader, "rng": ProcessRNG()}

    def fit(self) -> dict[str, float]:
        """Train `trainer.total_steps` optimizer steps (or until `stop_early` or a stop signal), resuming from
        the newest checkpoint; write the HF directory unless stopped by a signal; the last step's metrics."""
        self.stop_signal: int | None = None
        with RunLock(self.run_dir):
            checkpoints = CheckpointManager(self.run_dir, self.cfg.trainer.max_checkpoints_to_keep)
            checkpoints.recover()
            return self._fit(checkpoints)

    def _fit(self, checkpoints: CheckpointManager) -> dict[str, float]:
        trainer = self.cfg.trainer
        if trainer.save_every < 0:
            raise ConfigError(
                f"trainer.save_every must be >= 0 (0 = no periodic checkpoint), got {trainer.save_every}"
            )
        self._check_hf_dir()
        latest = checkpoints.start_point(trainer.resume, trainer.resume_from)
        if latest is not None:  # before the workers start: a mismatch stops nothing
            check_resumable(latest, checkpoints.load_state(latest), self.cfg, trainer_name=self.run_name)
        group, pools = self.start()
        tracker = Tracker(
            trainer.loggers,
            self.run_dir,
            run_name=self.run_name,
            config=to_dict(self.cfg),
            plots=trainer.plots,
            new_run=latest is None,
        )
        metrics: dict[str, float] = {}
        step = 0
        progress = RunProgress(trainer.total_steps, desc=self.run_name, show=self.progress_keys).start()
        stop = StopSignals()
        try:
            with stop:
                # before a restore: DPO's precomputed reference log-probs are the starting weights'
                self.before_steps(group, progress)
                if latest is not None:
                    step = checkpoints.restore(latest, [group], self.driver_states())["step"]
                    progress.step = step
                    tracker.rewind(step)  # rows a stopped run logged after its checkpoint are redone
                    print(f"resumed from {latest} at step {step}", flush=True)
                    if step >= trainer.total_steps:
                        log.warning(
                            "the checkpoint is at step %d, trainer.total_steps is %d: nothing to train; "
                            "the restored model is exported (raise total_steps to continue the run)",
                            step,
                            trainer.total_steps,
                        )
                while step < trainer.total_steps:
                    step += 1
                    metrics, stopping = self._step(group, progress, tracker, step)
                    # with periodic checkpoints, the last step's too: `latest` is then the trained model
                    due = trainer.save_every and (
                        step % trainer.save_every == 0 or step == trainer.total_steps
                    )
                    if stop.requested or due or (stopping and trainer.save_every):
                        with progress.stage("checkpoint"):
                            meta = {**checkpoint_meta(self.cfg), "trainer": self.run_name}
                            checkpoints.save(step, [group], self.driver_states(), meta)
                    if stop.requested or stopping:
                        break
                if not stop.requested:
                    self.after_steps()
                    with progress.stage("export"):
                        self._export(group)
        finally:
            progress.close()
            tracker.close()
            group.shutdown()
            for pool in pools.values():
                pool.remove()
        if stop.requested:
            assert stop.signum is not None
            self.stop_signal = stop.signum
            hint = (
                "the same command resumes"
                if trainer.resume
                else "the same command with trainer.resume=true resumes"
            )
            message = f"stopped by {stop.name} after step {step}; {hint} from {checkpoints.latest()}"
            print(message, flush=True)
            raise RunStopped(stop.signum, message)
        return metrics

    def _check_hf_dir(self) -> None:
        """Before training: the export replaces `hf_dir` as a whole, so it must be a model directory of its
        own (or not exist yet): not the run directory or a folder holding it, not a folder of other files."""
        hf, run = self.hf_dir.resolve(), self.run_dir.resolve()
        if hf == run or hf in run.parents:
            raise ConfigError(
                f"trainer.save_hf_dir={self.cfg.trainer.save_hf_dir}: the export replaces that folder, which "
                f"holds the run directory {self.run_dir}; give a folder of its own (default <run_dir>/hf)"
            )
        if hf.is_dir() and any(hf.iterdir()):
            foreign = [n for n in ("latest", "metrics.jsonl", STATE_FILE) if (hf / n).exists()]
            if foreign or not (hf / "config.json").is_file():
                raise ConfigError(
                    f"{hf} exists and holds {'a run (' + ', '.join(foreign) + ')' if foreign else 'no model'}: "
                    "the export replaces it as a whole; give trainer.save_hf_dir a folder of its own"
                )

    def _step(
        self, group: GroupT, progress: RunProgress, tracker: Tracker, step: int
    ) -> tuple[dict[str, float], bool]:
        """Step `step`: train, validate when due, log; its metrics and whether to stop early."""
        start = time.perf_counter()
        result = self.train_step(group, progress)
        seconds = time.perf_counter() - start
        metrics = {**result.metrics, "timing/step": seconds}
        if result.tokens is not None:
            metrics["throughput/tokens_per_s"] = result.tokens / seconds
        if self._validates_at(step):
            with progress.stage("validate"):
                metrics.update(self.validate(group))
        tracker.log(metrics, step)
        progress.step_done(step, metrics)
        return metrics, self.stop_early(step, metrics)

    def _export(self, group: GroupT) -> None:
        """The HF directory, written beside its place and renamed into it (an older one replaced)."""
        final = self.hf_dir
        partial = final.with_name(f".{final.name}.partial")
        if partial.exists():
            shutil.rmtree(partial)
        group.export_hf(partial)
        self.describe_export(partial)
        if final.exists():
            aside = final.with_name(f".{final.name}.old")
            if aside.exists():
                shutil.rmtree(aside)
            os.replace(final, aside)
            os.replace(partial, final)
            shutil.rmtree(aside)
        else:
            os.replace(partial, final)
