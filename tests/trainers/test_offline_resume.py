"""The offline trainers (`posttrain sft`, `dpo`, `rm`) checkpoint and resume as `posttrain train` does: a driver
SIGKILLed right after a checkpoint resumes there and logs the steps an uninterrupted run logs, exactly;
SIGTERM finishes the step, saves, exits 128 + 15 without an export, and the next start finishes the run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.data.tasks.arithmetic_pairs import write_arithmetic_pairs
from tests.data.conftest import write_rows
from tests.trainers.test_dpo import pairs
from tests.trainers.test_fault import driver_env

TIMED = ("timing/", "throughput/")


@pytest.fixture(scope="module")
def data(arithmetic_data: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Each command's data overrides: SFT on the arithmetic task, DPO on chat pairs (reference log-probs
    precomputed: from the starting weights, also on a resume), RM on arithmetic pairs."""
    out = tmp_path_factory.mktemp("offline")
    dpo_train = write_rows(out / "dpo.jsonl", pairs(48, 0, chat=True))
    rm = write_arithmetic_pairs(out / "rm", n_train=48, n_test=8, seed=3)
    return {
        "sft": [f"data.train_files=[{arithmetic_data['train']}]", "optim.micro_batch_size=8"],
        "dpo": [f"data.train_files=[{dpo_train}]", "dpo.reference=precompute", "optim.micro_batch_size=4"],
        "rm": [f"data.train_files=[{rm['train']}]", "optim.micro_batch_size=8"],
    }


def command(name: str, model: Path, data: dict[str, list[str]], run: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "posttrain", name, f"model.path={model}", f"trainer.run_dir={run}",
        "trainer.loggers=[jsonl]", "trainer.plots=false", "optim.batch_size=16", "optim.lr=1e-3",
        *data[name], *extra,
    ]  # fmt: skip


def steps(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = lambda key: key.startswith(TIMED) or key.endswith("seconds")  # noqa: E731
    return {row["step"]: {k: v for k, v in row.items() if not timed(k)} for row in rows}


@pytest.mark.parametrize(
    "name", ["sft", pytest.param("dpo", marks=pytest.mark.slow), pytest.param("rm", marks=pytest.mark.slow)]
)
def test_a_killed_offline_run_resumes_exactly(
    name: str, tiny_model_dir: Path, data: dict[str, list[str]], tmp_path: Path
) -> None:
    args = ("trainer.total_steps=4", "trainer.save_every=2")
    straight = tmp_path / "straight"
    done = subprocess.run(command(name, tiny_model_dir, data, straight, *args), env=driver_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    killed = tmp_path / "killed"
    run = command(name, tiny_model_dir, data, killed, *args)
    first = subprocess.run(run, env=driver_env("saved:2"), capture_output=True, text=True, timeout=300)
    assert first.returncode == -signal.SIGKILL and (killed / "step_2").is_dir()
    assert not (killed / "hf").exists()
    second = subprocess.run(run, env=driver_env(), capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"resumed from {killed / 'step_2'} at step 2" in second.stdout
    assert steps(killed) == steps(straight)  # the same losses, step for step
    assert (killed / "hf" / "config.json").exists()
    if name == "sft":  # a run forked from another's checkpoint (trainer.resume_from) goes on as it did
        fork = tmp_path / "fork"
        run = command(name, tiny_model_dir, data, fork, *args, f"trainer.resume_from={killed / 'step_2'}")
        done = subprocess.run(run, env=driver_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert steps(fork) == {k: v for k, v in steps(straight).items() if k > 2}


def test_sigterm_saves_and_the_next_start_finishes(
    tiny_model_dir: Path, data: dict[str, list[str]], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    args = command("sft", tiny_model_dir, data, run, "trainer.total_steps=400")
    driver = subprocess.Popen(
        args, env=driver_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
        assert time.time() < deadline and driver.poll() is None, "no step was logged"
        time.sleep(0.2)
    driver.send_signal(signal.SIGTERM)
    out, err = driver.communicate(timeout=120)
    assert driver.returncode == 128 + signal.SIGTERM, err[-2000:]
    stopped_at = max(steps(run))
    assert f"stopped by SIGTERM after step {stopped_at}" in out
    assert (run / f"step_{stopped_at}").is_dir() and not (run / "hf").exists()
    args[args.index("trainer.total_steps=400")] = f"trainer.total_steps={stopped_at + 2}"
    done = subprocess.run(args, env=driver_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(steps(run)) == list(range(1, stopped_at + 3))
    assert (run / "hf" / "config.json").exists()


def test_what_a_run_directory_holds_is_not_taken_for_something_else(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    """The export replaced trainer.save_hf_dir as a whole: pointed at the run directory it deleted the
    checkpoints and metrics, and exited 0. A dpo run in an sft run's directory resumed the sft checkpoint.
    `posttrain export` of a reward model's checkpoint crashed in DCP (it reads a policy's actor/)."""
    import torch

    from posttrain.config.load import load_config, to_dict
    from posttrain.config.schema import SFTConfig
    from posttrain.errors import ConfigError
    from posttrain.trainers.compat import check_resumable, model_fingerprint
    from posttrain.trainers.export import export_checkpoint
    from posttrain.trainers.sft import SFTTrainer

    run = tmp_path / "run"
    base = [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{arithmetic_data['train']}]",
        f"trainer.run_dir={run}",
    ]
    for hf, message in ((run, "holds the run directory"), (tmp_path, "holds the run directory")):
        with pytest.raises(ConfigError, match=message):
            SFTTrainer(load_config(SFTConfig, "sft", [*base, f"trainer.save_hf_dir={hf}"])).fit()
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds no model: the export replaces it"):
        SFTTrainer(load_config(SFTConfig, "sft", [*base, f"trainer.save_hf_dir={other}"])).fit()
    assert (other / "todo.txt").read_text() == "mine"

    cfg = load_config(SFTConfig, "sft", base)
    state = {
        "trainer": "sft",
        "model": model_fingerprint(str(tiny_model_dir)),
        "config": to_dict(cfg),
        "world_size": 1,
    }
    check_resumable(tmp_path, state, cfg, trainer_name="sft")
    with pytest.raises(ConfigError, match=r"written by `posttrain sft`; this is `posttrain dpo`"):
        check_resumable(tmp_path, state, cfg, trainer_name="dpo")
    with pytest.raises(ConfigError, match=r"written by `posttrain sft`; this is `posttrain train`"):
        check_resumable(tmp_path, state, cfg)

    step = tmp_path / "rm_run" / "step_2"
    step.mkdir(parents=True)
    torch.save({**state, "trainer": "rm", "step": 2}, step / "trainer_state.pt")
    with pytest.raises(ConfigError, match="a reward model's checkpoint .* the trained reward model is"):
        export_checkpoint(step, tmp_path / "out")
