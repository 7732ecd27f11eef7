"""The RL run's checkpoint cadence and resume hint (posttrain/trainers/rl_checkpoint.py), without workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config.load import load_config, to_dict
from posttrain.config.schema import RLConfig
from posttrain.errors import ConfigError
from posttrain.trainers.checkpoint import CheckpointManager
from posttrain.trainers.compat import check_resumable, model_fingerprint
from posttrain.trainers.rl_checkpoint import CheckpointCadence, resume_hint


def saved_steps(
    cadence: CheckpointCadence, total: int, failing: dict[int, int], stop_at: int = 0
) -> list[int]:
    """The steps after which the loop saves; `failing`: step -> the step reward failures started."""
    saved = []
    for step in range(1, total + 1):
        final = step == total or step == stop_at
        if cadence.due(step, final, failing.get(step)):
            saved.append(step)
        if step == stop_at:
            break
    return saved


def test_periodic_checkpoints_and_the_last_step() -> None:
    assert saved_steps(CheckpointCadence(save_every=2), total=5, failing={}) == [2, 4, 5]
    assert saved_steps(CheckpointCadence(save_every=0), total=5, failing={}) == [5], "0: only at the end"


def test_a_checkpoint_due_while_rewards_fail_waits_for_a_step_under_the_rate() -> None:
    # steps 2-3 over the rate: step 2's checkpoint is deferred and written after step 4, the first under it
    assert saved_steps(CheckpointCadence(save_every=2), total=6, failing={2: 2, 3: 2}) == [4, 6]
    # a deferred save is written after the first good step even when that step is not a periodic one
    assert saved_steps(CheckpointCadence(save_every=2), total=7, failing={2: 2}) == [3, 4, 6, 7]


def test_the_last_step_and_a_stop_save_whatever_the_rate() -> None:
    assert saved_steps(CheckpointCadence(save_every=2), total=4, failing={4: 3}) == [2, 4]
    assert saved_steps(CheckpointCadence(save_every=10), total=8, failing={3: 3}, stop_at=3) == [3]


def test_the_resume_hint_names_the_checkpoint_and_the_setting(tmp_path: Path) -> None:
    checkpoints = CheckpointManager(tmp_path)
    assert resume_hint(checkpoints, resume=True) == "no checkpoint to resume from"
    path = checkpoints.publish(checkpoints.begin(3), 3, {"step": 3})
    assert resume_hint(checkpoints, resume=True) == f"the same command resumes from {path}"
    assert resume_hint(checkpoints, resume=False) == (
        f"the same command with trainer.resume=true resumes from {path}"
    )
    (tmp_path / "latest").write_text("step_9")  # a pointer to nothing: the loader's message, not a crash
    assert "step_9, which is incomplete or missing" in resume_hint(checkpoints, resume=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("model.lora.alpha=64", r"model.lora.alpha=8.0; this run has model.lora.alpha=64.0"),
        ("model.lora.target_modules=[q_proj,v_proj]", r"model.lora.target_modules=\['q_proj', 'k_proj'"),
        ("model.lora.rank=8", r"model.lora.rank=4; this run has model.lora.rank=8"),
    ],
)
def test_a_changed_adapter_cannot_resume_its_checkpoint(
    tiny_model_dir: Path, tmp_path: Path, change: str, message: str
) -> None:
    """A larger alpha rescaled the trained adapter; fewer target modules dropped the others' trained weights
    (DCP loads the keys the model asks for). Both were accepted: only the rank was compared."""
    base = [f"model.path={tiny_model_dir}", "model.lora.rank=4", "model.lora.alpha=8"]
    saved = load_config(RLConfig, "rl", base)
    state = {"model": model_fingerprint(str(tiny_model_dir)), "config": to_dict(saved), "world_size": 1}
    check_resumable(tmp_path, state, load_config(RLConfig, "rl", [*base, "model.lora.target_modules=[v_proj,q_proj,k_proj,o_proj,gate_proj,up_proj,down_proj]"]))  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        check_resumable(tmp_path, state, load_config(RLConfig, "rl", [*base, change]))


def test_a_resume_under_another_data_order_is_refused_and_other_changes_are_named(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The loader resumes at batch k of the epoch's permutation: another batch size skipped 8 of 32 rows of
    the epoch, another seed repeated rows, silently; a new learning rate was logged at INFO only."""
    base = [f"model.path={tiny_model_dir}", "data.train_batch_prompts=4"]
    saved = load_config(RLConfig, "rl", base)
    state = {"model": model_fingerprint(str(tiny_model_dir)), "config": to_dict(saved), "world_size": 1}
    for change in ("data.train_batch_prompts=8", "trainer.seed=5", "data.shuffle=False"):
        key = change.split("=")[0]
        with pytest.raises(ConfigError, match=rf"trained with {key}=.*this run has {change}"):
            check_resumable(tmp_path, state, load_config(RLConfig, "rl", [*base, change]))
    with caplog.at_level("WARNING"):
        check_resumable(tmp_path, state, load_config(RLConfig, "rl", [*base, "actor.optim.lr=0.002", "trainer.total_steps=99"]))  # fmt: skip
    assert "settings changed since it was saved: actor.optim.lr: 1e-05 -> 0.002" in caplog.text
    assert "total_steps" not in caplog.text  # a longer run is what a resume is for
