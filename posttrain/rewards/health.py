"""When reward failures stop a run: the error budget of `reward.max_error_rate` and `reward.max_error_steps`.

A failed score counts as 0.0 (rewards/manager.py), which is right for one odd response and wrong for a
broken reward function: the run would go on training on zeros. `RewardHealth` looks at each step's count
of failed rows and raises a RewardError carrying the first failure's traceback when
* every score of a training step failed (at once: such a step has no signal at all), or
* more than `max_error_rate` of the rows failed in each of `max_error_steps` steps in a row, or
* every score of a validation failed.
A step over the rate opens a "failing window" that the next step under it closes; while one is open the
trainer writes no periodic checkpoint, so the checkpoint the stop message points to predates the failures.
Pure: no I/O. Must not import engine, rollout, workers or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.errors import ConfigError, RewardError
from posttrain.rewards.manager import RewardResult


@dataclass(frozen=True)
class StepFailures:
    """One step's (or one validation's) scoring: rows scored, rows failed, and the first failure's traceback
    headed by its row and data_source (`RewardResult.first_traceback`)."""

    rows: int
    errors: int
    first_traceback: str = ""

    def add(self, result: RewardResult) -> StepFailures:
        """These counts and one more scored batch's (the first failure stays the earliest one)."""
        return StepFailures(
            self.rows + len(result.scores),
            self.errors + result.n_errors,
            self.first_traceback or result.first_traceback,
        )

    @property
    def rate(self) -> float:
        return self.errors / self.rows if self.rows else 0.0

    @property
    def all_failed(self) -> bool:
        return self.rows > 0 and self.errors == self.rows

    def first_failure(self, of: str = "") -> str:
        return f"The first failure{of}, {self.first_traceback.rstrip()}"


class RewardHealth:
    """The stop policy, with its state: the steps of the open failing window and their error rates."""

    def __init__(self, max_error_rate: float, max_error_steps: int) -> None:
        if not 0.0 <= max_error_rate <= 1.0:
            raise ConfigError(
                f"reward.max_error_rate must be in [0, 1] (1 = only a step where every score fails stops "
                f"the run), got {max_error_rate}"
            )
        if max_error_steps < 1:
            raise ConfigError(f"reward.max_error_steps must be >= 1, got {max_error_steps}")
        self.max_error_rate = max_error_rate
        self.max_error_steps = max_error_steps
        self.window: list[tuple[int, float]] = []  # (step, error rate) of the consecutive steps over the rate
        self.window_failure = ""  # the first failure of the window's first step

    @property
    def failing_since(self) -> int | None:
        """The first step of the open failing window; None when the last step was under the rate."""
        return self.window[0][0] if self.window else None

    def observe_step(self, step: int, failures: StepFailures) -> None:
        """Account for step `step`'s scoring; RewardError when the run must stop."""
        if failures.all_failed:
            raise RewardError(
                f"every reward of step {step} failed ({failures.errors} of {failures.rows} rows): the run "
                f"stops rather than train on zeros. {failures.first_failure()}"
            )
        if failures.rows == 0 or failures.rate <= self.max_error_rate:
            self.window, self.window_failure = [], ""
            return
        if not self.window:
            self.window_failure = failures.first_failure(f" of step {step}")
        self.window.append((step, failures.rate))
        if len(self.window) >= self.max_error_steps:
            rates = ", ".join(f"{rate:.2f}" for _, rate in self.window)
            first, last = self.window[0][0], self.window[-1][0]
            steps = f"steps {first}-{last}" if first != last else f"step {first}"
            raise RewardError(
                f"the reward error rate was over reward.max_error_rate={self.max_error_rate:g} for "
                f"reward.max_error_steps={self.max_error_steps} steps in a row ({steps}: {rates}): the run "
                f"stops rather than train on zeros. {self.window_failure}"
            )

    def observe_validation(self, step: int, failures: StepFailures) -> None:
        """A validation in which every score failed stops the run (its numbers would be meaningless)."""
        if failures.all_failed:
            raise RewardError(
                f"every reward of the validation at step {step} failed ({failures.errors} of "
                f"{failures.rows} rows): the run stops. {failures.first_failure()}"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"window": [list(w) for w in self.window], "window_failure": self.window_failure}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window = [(int(step), float(rate)) for step, rate in state.get("window", [])]
        self.window_failure = state.get("window_failure", "")
