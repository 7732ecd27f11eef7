"""The loop the offline trainers share (`posttrain sft`, `dpo`, `rm`, `distill`): one place for what a run does
around its steps, so that each trainer holds only what differs (its data, its loss, its validation).

`StepTrainer.fit`: start the worker group; then per optimizer step `train_step` (the trainer's batch, loss and
update), its wall time and throughput, validation every `trainer.val_every` steps and after the last one,
one metrics row to the trackers and the progress line, and an optional early stop; finally the trained model
as a Hugging Face directory. The group, its pools, the trackers and the progress line are released on every
exit, an exception included.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from posttrain.config.load import to_dict
from posttrain.controller.resource_pool import ResourcePool
from posttrain.tracking import Tracker
from posttrain.tracking.progress import RunProgress


class TrainedGroup(Protocol):
    """What the loop needs of a worker group: write the model, and stop."""

    def export_hf(self, out_dir: Path, /) -> None: ...

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

    def after_steps(self) -> None:
        """Work once after the last step, before the export (e.g. writing the final evaluation)."""

    def _validates_at(self, step: int) -> bool:
        every, last = self.cfg.trainer.val_every, step == self.cfg.trainer.total_steps
        return self.val_set is not None and ((every and step % every == 0) or last)

    def fit(self) -> dict[str, float]:
        """Train `trainer.total_steps` optimizer steps (or until `stop_early`), write the HF directory,
        return the last step's metrics."""
        trainer = self.cfg.trainer
        self.run_dir.mkdir(parents=True, exist_ok=True)
        group, pools = self.start()
        tracker = Tracker(
            trainer.loggers,
            self.run_dir,
            run_name=self.run_name,
            config=to_dict(self.cfg),
            plots=trainer.plots,
            new_run=True,  # these trainers always start from step 0
        )
        metrics: dict[str, float] = {}
        progress = RunProgress(trainer.total_steps, desc=self.run_name, show=self.progress_keys).start()
        try:
            self.before_steps(group, progress)
            for step in range(1, trainer.total_steps + 1):
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
                if self.stop_early(step, metrics):
                    break
            self.after_steps()
            with progress.stage("export"):
                group.export_hf(self.hf_dir)
        finally:
            progress.close()
            tracker.close()
            group.shutdown()
            for pool in pools.values():
                pool.remove()
        return metrics
