"""`posttrain dpo` end to end on the ~1M preset: arithmetic pairs (right vs wrong answer); the loss falls, the
reward metrics are logged; at step 1 the policy is its reference (every reference source gives log 2, LoRA's
adapter-off reference included); settings that cannot work are refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.config.load import load_config
from posttrain.config.schema import DPOConfig
from posttrain.errors import ConfigError
from posttrain.trainers.dpo import DPOTrainer
from tests.data.conftest import write_rows


def pairs(n: int, seed: int, chat: bool) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = (i * 7 + seed) % 40, (i * 13 + seed) % 40
        prompt, good, bad = f"What is {a}+{b}?", str(a + b), str(a + b + 1 + i % 5)
        if chat:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": [{"role": "assistant", "content": good}],
                    "rejected": [{"role": "assistant", "content": bad}],
                    "ref_chosen_logps": -5.0,
                    "ref_rejected_logps": -5.0,
                }
            )
        else:
            rows.append({"prompt": prompt + " ", "chosen": good, "rejected": bad})
    return rows


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("pairs")
    return {
        "train": write_rows(out / "train.jsonl", pairs(64, 0, chat=True)),
        "test": write_rows(out / "test.jsonl", pairs(16, 1, chat=True)),
        "text": write_rows(out / "text.jsonl", pairs(32, 2, chat=False)),
    }


def run(tiny_model_dir: Path, pair_files, run_dir: Path, *overrides: str) -> list[dict]:
    code = main(
        [
            "dpo",
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{pair_files['train']}]",
            f"trainer.run_dir={run_dir}",
            "trainer.loggers=[jsonl]",
            "optim.batch_size=16",
            "optim.micro_batch_size=4",
            *overrides,
        ]
    )
    assert code == 0
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_dpo_cli_loss_falls_and_reports_rewards(tiny_model_dir: Path, pair_files, tmp_path: Path) -> None:
    rows = run(
        tiny_model_dir,
        pair_files,
        tmp_path,
        f"data.val_files=[{pair_files['test']}]",
        "trainer.total_steps=8",
        "trainer.val_every=8",
        "optim.lr=1e-3",
        "dpo.beta=0.5",
        "dpo.loss_type=[sigmoid,sft]",
        "dpo.loss_weights=[1.0,0.1]",
    )
    first, last = rows[0], rows[-1]
    assert first["dpo/loss_sigmoid"] == pytest.approx(math.log(2), abs=1e-5)  # policy = reference at step 1
    assert last["dpo/loss_sigmoid"] < first["dpo/loss_sigmoid"] - 0.05
    for key in ("dpo/rewards_accuracy", "dpo/rewards_margin", "dpo/rewards_chosen", "val/rewards_accuracy"):
        assert key in last
    assert last["dpo/rewards_margin"] > 0
    assert (tmp_path / "hf" / "config.json").exists()


@pytest.mark.parametrize(
    "overrides",
    [
        ("dpo.reference=precompute",),
        ("dpo.reference=model", "model.lora.rank=4", "model.remove_padding=false"),
        ("dpo.reference=precompute", "model.lora.rank=4"),
    ],
    ids=["precompute", "lora-adapter-off", "lora-precompute"],
)
def test_reference_is_the_initial_policy(tiny_model_dir: Path, pair_files, tmp_path: Path, overrides) -> None:
    rows = run(tiny_model_dir, pair_files, tmp_path, "trainer.total_steps=3", "optim.lr=1e-2", *overrides)
    assert rows[0]["dpo/loss_sigmoid"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[0]["dpo/rewards_margin"] == pytest.approx(0.0, abs=1e-5)
    assert rows[-1]["dpo/loss_sigmoid"] != pytest.approx(math.log(2), abs=1e-4)  # the adapter moved away


def test_reference_columns_and_reference_free_losses(
    tiny_model_dir: Path, pair_files, tmp_path: Path
) -> None:
    rows = run(
        tiny_model_dir, pair_files, tmp_path / "cols", "trainer.total_steps=1", "dpo.reference=columns"
    )
    assert rows[0]["dpo/rewards_chosen"] != pytest.approx(0.0)  # the data's -5.0, not the model's
    for loss in ("simpo", "orpo", "ipo", "hinge", "apo_zero", "robust"):
        rows = run(
            tiny_model_dir,
            {**pair_files, "train": pair_files["text"]},
            tmp_path / loss,
            "trainer.total_steps=1",
            f"dpo.loss_type=[{loss}]",
        )
        assert math.isfinite(rows[0][f"dpo/loss_{loss}"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("dpo.loss_type=[dpo]", r"unknown preference loss 'dpo'; valid: apo_zero, hinge, ipo"),
        ("optim.max_token_len_per_worker=512", r"a token budget would split a chosen/rejected pair"),
        ("trainer.stop_at_val_nll=0.5", r"trainer.stop_at_val_nll is an SFT setting"),
        ("dpo.label_smoothing=0.6", r"dpo.label_smoothing must be in \[0, 0.5\)"),
    ],
)
def test_settings_that_cannot_work_are_refused(
    tiny_model_dir: Path, pair_files, override: str, message: str
) -> None:
    cfg = load_config(
        DPOConfig,
        "dpo",
        [f"model.path={tiny_model_dir}", f"data.train_files=[{pair_files['train']}]", override],
    )
    with pytest.raises(ConfigError, match=message):
        DPOTrainer(cfg)


@pytest.mark.slow
def test_dpo_on_two_ray_workers(tiny_model_dir: Path, pair_files, tmp_path: Path, ray_cluster) -> None:
    """The preference loss is registered in the Ray worker processes (PreferenceWorker's module)."""
    rows = run(
        tiny_model_dir,
        pair_files,
        tmp_path,
        "trainer.backend=ray",
        "trainer.n_workers_per_node=2",
        "trainer.total_steps=3",
        "optim.lr=1e-3",
        "dpo.beta=0.5",
    )
    assert rows[0]["dpo/loss_sigmoid"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[-1]["dpo/loss_sigmoid"] < rows[0]["dpo/loss_sigmoid"]
