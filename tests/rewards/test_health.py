"""The stop policy for failing rewards, with hand-made counts: when a run goes on and when it stops."""

from __future__ import annotations

import pytest

from posttrain.errors import ConfigError, RewardError
from posttrain.rewards.health import RewardHealth, StepFailures
from posttrain.rewards.manager import RewardResult

TRACEBACK = (
    "row 3 (data_source 'gsm8k'):\nTraceback (most recent call last):\n  File \"r.py\", line 7\nKeyError: 2\n"
)


def failures(errors: int, rows: int = 100, step_tag: str = "") -> StepFailures:
    return StepFailures(
        rows, errors, TRACEBACK.replace("KeyError: 2", f"KeyError: 2{step_tag}") if errors else ""
    )


def test_a_step_where_every_score_failed_stops_at_once_with_the_traceback() -> None:
    health = RewardHealth(max_error_rate=1.0, max_error_steps=5)  # even with the rate rule off
    health.observe_step(1, failures(99))
    with pytest.raises(RewardError) as info:
        health.observe_step(2, failures(100))
    message = str(info.value)
    assert message.startswith("every reward of step 2 failed (100 of 100 rows)")
    assert "The first failure, row 3 (data_source 'gsm8k'):\nTraceback (most recent call last):" in message
    assert message.endswith("KeyError: 2")


def test_the_rate_over_the_limit_for_max_error_steps_steps_stops_naming_rate_steps_and_first_failure() -> (
    None
):
    health = RewardHealth(max_error_rate=0.5, max_error_steps=3)
    health.observe_step(4, failures(10))
    assert health.failing_since is None
    health.observe_step(5, failures(62, step_tag=" (step 5)"))
    assert health.failing_since == 5
    health.observe_step(6, failures(71, step_tag=" (step 6)"))
    with pytest.raises(RewardError) as info:
        health.observe_step(7, failures(58, step_tag=" (step 7)"))
    message = str(info.value)
    assert "over reward.max_error_rate=0.5 for reward.max_error_steps=3 steps in a row" in message
    assert "(steps 5-7: 0.62, 0.71, 0.58)" in message
    assert "The first failure of step 5, row 3 (data_source 'gsm8k')" in message
    assert message.endswith("KeyError: 2 (step 5)")


def test_a_step_at_or_under_the_rate_closes_the_window() -> None:
    health = RewardHealth(max_error_rate=0.5, max_error_steps=2)
    for step in range(1, 9):  # over, at (not over), over, under, ...: never two in a row
        health.observe_step(step, failures(60 if step % 2 else (50 if step % 4 == 2 else 0)))
        assert health.failing_since == (step if step % 2 else None)
    health.observe_step(9, failures(0, rows=0))  # a step that scored nothing changes nothing
    assert health.failing_since is None


def test_max_error_steps_1_stops_at_the_first_step_over_the_rate() -> None:
    health = RewardHealth(max_error_rate=0.1, max_error_steps=1)
    health.observe_step(1, failures(10))
    with pytest.raises(RewardError, match=r"steps in a row \(step 2: 0.11\)"):
        health.observe_step(2, failures(11))


def test_a_validation_stops_only_when_every_score_failed() -> None:
    health = RewardHealth(max_error_rate=0.0, max_error_steps=1)
    health.observe_validation(4, failures(31, rows=32))
    assert health.failing_since is None, "a validation is not a training step"
    with pytest.raises(
        RewardError, match=r"every reward of the validation at step 4 failed \(32 of 32 rows\)"
    ):
        health.observe_validation(4, failures(32, rows=32))


def test_the_window_survives_a_checkpoint() -> None:
    health = RewardHealth(max_error_rate=0.5, max_error_steps=3)
    health.observe_step(1, failures(90))
    health.observe_step(2, failures(80))
    resumed = RewardHealth(max_error_rate=0.5, max_error_steps=3)
    resumed.load_state_dict(health.state_dict())
    assert resumed.failing_since == 1
    with pytest.raises(RewardError, match=r"steps 1-3: 0.90, 0.80, 0.70"):
        resumed.observe_step(3, failures(70))
    fresh = RewardHealth(0.5, 3)
    fresh.load_state_dict({})  # a checkpoint written before this state existed
    assert fresh.failing_since is None


def test_step_failures_add_up_batches_and_keep_the_earliest_traceback() -> None:
    first = RewardResult(scores=[0.0] * 4, n_errors=1, first_traceback="row 0 (a):\nfirst")
    second = RewardResult(scores=[0.0] * 12, n_errors=12, first_traceback="row 0 (a):\nsecond")
    total = StepFailures(0, 0).add(RewardResult(scores=[1.0] * 4)).add(first).add(second)
    assert (total.rows, total.errors, total.first_traceback) == (20, 13, "row 0 (a):\nfirst")
    assert total.rate == pytest.approx(0.65) and not total.all_failed


@pytest.mark.parametrize(
    ("rate", "steps", "message"),
    [
        (1.5, 3, r"reward.max_error_rate must be in \[0, 1\].*got 1.5"),
        (-0.1, 3, r"reward.max_error_rate must be in \[0, 1\]"),
        (0.5, 0, "reward.max_error_steps must be >= 1, got 0"),
    ],
)
def test_bad_settings_are_named(rate: float, steps: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RewardHealth(rate, steps)
