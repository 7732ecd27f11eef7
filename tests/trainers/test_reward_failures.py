"""Issue 11: a reward function that keeps failing stops the run with its traceback, not train on zeros.

Small GRPO runs on the 1M model in-process (`trainer.backend=local`): 4 prompts x 4 samples, 16 scores a step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.errors import ConfigError, RewardError
from posttrain.trainers.rl import RLTrainer
from tests.trainers.test_bad_input import fails_fast
from tests.trainers.test_rl_e2e import rl_config, rl_overrides

LOCAL = ["trainer.backend=local", "trainer.val_before_train=false", "trainer.val_every=0"]

ALWAYS_RAISES = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return parse(solution_str)

def parse(text):
    raise ValueError("no answer found")
"""

# The first FAILING[k] of the 16 calls of step k+1 raise (a call counter in a file: it outlives processes).
BY_STEP = """
from pathlib import Path

COUNTER = Path({counter!r})
FAILING = {failing!r}

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    n = int(COUNTER.read_text()) if COUNTER.exists() else 0
    COUNTER.write_text(str(n + 1))
    step, row = divmod(n, 16)
    if row < FAILING[step]:
        raise KeyError(f"no answer in row {{row}} of step {{step + 1}}")
    return float(len(solution_str) % 2)
"""


def write_reward(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(source)
    return path


def failing_by_step(tmp_path: Path, failing: list[int]) -> str:
    path = write_reward(tmp_path, BY_STEP.format(counter=str(tmp_path / "calls"), failing=failing))
    return f"reward.custom_function_path={path}"


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in run.glob("step_*"))


def train_rows(run: Path) -> dict[int, dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "reward/mean" in r}


def test_a_reward_that_always_raises_stops_posttrain_train_at_step_1_with_its_traceback(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's reproduction, through the CLI: exit 2, the traceback once, the resume hint last."""
    reward = write_reward(tmp_path, ALWAYS_RAISES)
    run = tmp_path / "run"
    job = [*LOCAL, f"reward.custom_function_path={reward}", "trainer.total_steps=3"]
    assert main(["train", *rl_overrides(tiny_model_dir, arithmetic_data, run, *job)]) == 2
    err = capsys.readouterr().err
    assert "posttrain train: error: every reward of step 1 failed (16 of 16 rows)" in err
    assert "The first failure, row 0 (data_source 'arithmetic'):\nTraceback (most recent call last):" in err
    assert f'File "{reward}", line 3, in compute_score' in err
    assert f'File "{reward}", line 6, in parse' in err
    assert err.count("Traceback (most recent call last)") == 1, "the traceback is shown once"
    assert err.rstrip().endswith("ValueError: no answer found\nno checkpoint to resume from")
    assert checkpoints(run) == [] and not (run / "latest").exists()
    assert train_rows(run) == {}, "step 1 stopped before its update"


def test_an_error_rate_over_the_limit_for_3_steps_stops_without_checkpoints_of_those_steps(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    job = [*LOCAL, failing_by_step(tmp_path, [0, 4, 12, 12, 12, 0]), "trainer.total_steps=6"]
    job += ["trainer.loggers=[console,jsonl]", "trainer.max_checkpoints_to_keep=10"]
    with pytest.raises(RewardError) as info:
        RLTrainer(rl_config(tiny_model_dir, arithmetic_data, run, *job)).fit()
    message = str(info.value)
    assert message.startswith(
        "the reward error rate was over reward.max_error_rate=0.5 for reward.max_error_steps=3 steps in a "
        "row (steps 3-5: 0.75, 0.75, 0.75): the run stops rather than train on zeros. The first failure of "
        "step 3, row 0 (data_source 'arithmetic'):\nTraceback"
    )
    assert "KeyError: 'no answer in row 0 of step 3'" in message
    assert message.endswith(f"the same command resumes from {run / 'step_2'}")
    assert checkpoints(run) == ["step_1", "step_2"], "none after the first failing step"
    rows = train_rows(run)
    assert sorted(rows) == [1, 2, 3, 4]
    assert [rows[s]["reward/error_rate"] for s in (1, 2, 3, 4)] == [0.0, 0.25, 0.75, 0.75]
    assert [rows[s]["reward/errors"] for s in (1, 2, 3, 4)] == [0.0, 4.0, 12.0, 12.0]
    out, err = capsys.readouterr()
    assert "| reward/error_rate 0.75 |" in out, "the error rate is on the console line"
    shown = err.split("reward: a score failed and counts as 0.0 (shown once")
    assert len(shown) == 2 and "row 0 (data_source 'arithmetic'):\nTraceback" in shown[1]


def test_an_error_rate_that_drops_under_the_limit_goes_on_and_the_window_survives_a_resume(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    reward = failing_by_step(tmp_path, [12, 4, 12, 8, 12, 12])  # over, under, over, at 0.5 (not over), over
    job = [*LOCAL, reward, "reward.max_error_steps=2", "trainer.max_checkpoints_to_keep=10"]
    trainer = RLTrainer(rl_config(tiny_model_dir, arithmetic_data, run, *job, "trainer.total_steps=5"))
    trainer.fit()
    assert trainer.step_count == 5
    # steps over the rate write no periodic checkpoint; the last step writes one whatever the rate
    assert checkpoints(run) == ["step_2", "step_4", "step_5"]
    # the resumed run goes on counting the window step 5 opened: step 6 is the second step over the rate
    with pytest.raises(RewardError, match=r"steps in a row \(steps 5-6: 0.75, 0.75\)") as info:
        RLTrainer(rl_config(tiny_model_dir, arithmetic_data, run, *job, "trainer.total_steps=8")).fit()
    assert str(info.value).endswith(f"the same command resumes from {run / 'step_5'}")


def test_a_validation_in_which_every_score_fails_stops_the_run(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    reward = write_reward(
        tmp_path,
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if extra_info['split'] == 'test':\n"
        "        raise RuntimeError('the checker has no test answers')\n"
        "    return 1.0\n",
    )
    run = tmp_path / "run"
    job = [*LOCAL[:2], f"reward.custom_function_path={reward}", "trainer.total_steps=4"]
    with pytest.raises(RewardError) as info:
        RLTrainer(rl_config(tiny_model_dir, arithmetic_data, run, *job)).fit()  # validation after step 2
    message = str(info.value)
    assert message.startswith("every reward of the validation at step 2 failed (8 of 8 rows): the run stops.")
    assert "RuntimeError: the checker has no test answers" in message
    assert message.endswith(f"the same command resumes from {run / 'step_1'}")
    assert checkpoints(run) == ["step_1"], "the step validated is not saved"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "reward.timeout_s=-1",
            r"reward.timeout_s must be >= 0 \(0 = call the reward function in the driver",
        ),
        ("reward.max_error_rate=2", r"reward.max_error_rate must be in \[0, 1\]"),
        ("reward.max_error_steps=0", "reward.max_error_steps must be >= 1"),
    ],
)
def test_bad_reward_settings_are_named_at_start(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, override: str, message: str
) -> None:
    # a reward function of one's own: without it reward.timeout_s is refused as unused before its range
    function = f"reward.custom_function_path={write_reward(tmp_path, ALWAYS_RAISES)}"
    job = [*LOCAL, function, override]
    fails_fast(rl_config(tiny_model_dir, arithmetic_data, tmp_path, *job), ConfigError, message)


def test_a_restart_stops_the_old_scoring_process(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    """After a worker failure the driver starts from a fresh reward stage: the old one's isolated process (a
    custom function's, reward.timeout_s > 0) is stopped, not left running beside the new one."""
    job = [*LOCAL, f"reward.custom_function_path={write_reward(tmp_path, ALWAYS_RAISES)}"]
    trainer = RLTrainer(rl_config(tiny_model_dir, arithmetic_data, tmp_path / "run", *job))
    old = trainer.rewards
    isolated = old.manager._compute_score
    child = isolated._child()  # type: ignore[union-attr]  # the scoring process a first score starts
    assert child.alive()
    trainer._reset_progress()
    assert trainer.rewards is not old and not child.alive()
