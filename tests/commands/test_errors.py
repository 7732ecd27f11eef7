"""Errors that say what to do (issue 19 item 7): a taken port, a Ray cluster that is not there, a sequence over
the model's context. A wrong model path and dataset schema errors: tests/test_cli.py, tests/trainers/
test_bad_input.py, tests/commands/test_eval.py and test_data_cmd.py."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from posttrain.cli import main


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_on_a_taken_port_fails_at_once(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        start = time.perf_counter()
        assert main(["serve", "--model", str(tiny_model_dir), "--port", str(port)]) == 2
    assert time.perf_counter() - start < 5, "refused before the model loads"
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert f"port {port} on 127.0.0.1 is in use" in err and "pass --port" in err


def test_train_with_an_unreachable_ray_cluster(
    tiny_model_dir: Path, arithmetic_data: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()  # nothing listens there
    common = [f"model.path={tiny_model_dir}", f"data.train_files=[{arithmetic_data['train']}]"]
    assert main(["train", *common, f"ray.address=127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"no Ray cluster answers at 127.0.0.1:{port}" in err and f"ray start --head --port={port}" in err
    assert main(["train", *common, "ray.address=nohost"]) == 2
    assert "is not HOST:PORT" in capsys.readouterr().err


def test_ray_auto_without_a_cluster(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no ray_current_cluster record there
    argv = ["sft", f"model.path={tiny_model_dir}", f"data.train_files=[{arithmetic_data['train']}]"]
    assert main([*argv, "trainer.backend=ray", "ray.address=auto"]) == 2
    assert "no running Ray cluster found on this machine" in capsys.readouterr().err


def test_eval_lengths_over_the_model_context(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", str(tiny_model_dir), "--data", str(arithmetic_data["test"]), "--out", str(tmp_path)]
    assert main([*argv, "--max-response-length", "1000000"]) == 2
    err = capsys.readouterr().err
    assert "exceed the model's context" in err and "lower one of them" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--log-level", "loud", "config", "show", "train"], "invalid choice: 'LOUD'"),
        (["eval", "--model", "m", "--data", "d.parquet", "--max-prompts", "-1"], "must be >= 0"),
        (["plot", "runs/x", "--dpi", "0"], "must be >= 1"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_verl_script_names_itself(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "from-verl", "--script", str(tmp_path / "run.sh")]) == 2
    assert "--script: file not found" in capsys.readouterr().err
