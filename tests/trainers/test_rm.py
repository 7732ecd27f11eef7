"""`posttrain rm` end to end on the ~1M preset with arithmetic pairs (right vs wrong answer): the Bradley-Terry loss
falls, held-out pairwise accuracy is reported at the end, and the written directory is a Hugging Face sequence
classifier that scores the held-out pairs to the same accuracy; settings that cannot work and bad rows are
refused naming the key or the row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.cli import main
from posttrain.config.load import load_config
from posttrain.config.schema import RMConfig
from posttrain.data import keys
from posttrain.data.preference_dataset import PreferenceDataset, collate_pairs
from posttrain.data.tasks.arithmetic_pairs import write_arithmetic_pairs
from posttrain.errors import ConfigError
from posttrain.models import load_tokenizer
from posttrain.trainers.rm import EVAL_FILE, RMTrainer
from posttrain.trainers.rm_scoring import RM_INFO_FILE, check_reward_model_dir
from tests.data.conftest import write_rows


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_arithmetic_pairs(tmp_path_factory.mktemp("rm_pairs"), n_train=32, n_test=24, seed=3)


def overrides(model: Path, files: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.path={model}",
        f"data.train_files=[{files['train']}]",
        f"trainer.run_dir={run_dir}",
        "trainer.loggers=[jsonl]",
        "trainer.plots=false",
        "optim.batch_size=16",
        "optim.micro_batch_size=8",
        *extra,
    ]


def test_rm_cli_trains_reports_accuracy_and_writes_a_classifier(
    tiny_model_dir: Path, pair_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForSequenceClassification

    run = tmp_path / "run"
    args = overrides(
        tiny_model_dir,
        pair_files,
        run,
        f"data.val_files=[{pair_files['test']}]",
        "trainer.total_steps=12",
        "optim.lr=2e-3",
        "rm.center_rewards_coefficient=0.01",
    )
    assert main(["rm", *args]) == 0
    out = capsys.readouterr().out
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["rm/bt_loss"] for r in rows]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < losses[0] - 0.02, losses  # 6 epochs over 32 pairs: the loss falls
    assert all("rm/center" in r and "rm/grad_norm" in r for r in rows)
    final = json.loads((run / EVAL_FILE).read_text())
    assert final == {k: v for k, v in rows[-1].items() if k.startswith("val/")}
    assert final["val/pairs"] == 24
    assert f"held-out pairwise accuracy {final['val/accuracy']:.4f} over 24 pairs" in out

    # the directory is a Hugging Face classifier: the same held-out accuracy through from_pretrained
    model = AutoModelForSequenceClassification.from_pretrained(run / "hf").eval()
    tok = load_tokenizer(run / "hf")
    val = PreferenceDataset(pair_files["test"], tok, 256)
    batch = collate_pairs([val[i] for i in range(len(val))], tok.pad_token_id)
    with torch.no_grad():
        scores = model(input_ids=batch[keys.INPUT_IDS], attention_mask=batch[keys.ATTENTION_MASK]).logits[
            :, 0
        ]
    accuracy = float((scores[0::2] > scores[1::2]).double().mean())
    assert accuracy == pytest.approx(final["val/accuracy"])
    margin = float((scores[0::2] - scores[1::2]).double().mean())
    assert margin == pytest.approx(final["val/margin"], abs=1e-5)
    # it says how its pairs were written: RL takes a chat-trained reward model, refuses a text-trained one
    assert json.loads((run / "hf" / RM_INFO_FILE).read_text()) == {"input_format": "chat"}
    check_reward_model_dir("reward.model.path", str(run / "hf"))
    (run / "hf" / RM_INFO_FILE).write_text(json.dumps({"input_format": "text"}))
    with pytest.raises(ConfigError, match="was trained on text pairs .* train it on chat pairs"):
        check_reward_model_dir("reward.model.path", str(run / "hf"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["model.remove_padding=true"], "model.remove_padding=true: the reward model runs right-padded rows"),
        (["model.lora.rank=4"], "model.lora.rank must be 0"),
        (["trainer.val_every=5"], "trainer.val_every=5 needs held-out pairs in data.val_files"),
        (["optim.max_token_len_per_worker=512"], "a token budget would split a chosen/rejected pair"),
        (["rm.center_rewards_coefficient=-1"], "center_rewards_coefficient must be >= 0"),
        (
            ["trainer.backend=ray", "trainer.n_workers_per_node=2", "optim.batch_size=15"],
            "optim.batch_size=15 pairs must be divisible by the 2 workers",
        ),
    ],
)
def test_settings_that_cannot_work_are_refused(
    tiny_model_dir: Path, pair_files: dict[str, Path], tmp_path: Path, extra: list[str], message: str
) -> None:
    cfg = load_config(RMConfig, "rm", overrides(tiny_model_dir, pair_files, tmp_path, *extra))
    with pytest.raises(ConfigError, match=message):
        RMTrainer(cfg)


def test_bad_rows_name_the_row(
    tiny_model_dir: Path, pair_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = {"prompt": "What is 1+1? ", "chosen": "2", "rejected": "3"}
    for name, bad, reason in (
        ("missing.jsonl", {"prompt": "What is 1+2? ", "rejected": "4"}, "row 1: missing field 'chosen'"),
        ("margin.jsonl", dict(good, margin=2.0), "row 1: has 'margin' but the rows before it have none"),
    ):
        path = write_rows(tmp_path / name, [good, bad])
        files = {"train": path}
        assert main(["rm", *overrides(tiny_model_dir, files, tmp_path / "run", "trainer.total_steps=1")]) == 2
        err = capsys.readouterr().err
        assert f"{path}: {reason}" in err, err


@pytest.mark.slow
def test_rm_on_two_ray_workers(
    tiny_model_dir: Path, pair_files: dict[str, Path], tmp_path: Path, ray_cluster: None
) -> None:
    """Pairs split over 2 FSDP ranks: the same held-out pairs scored by the exported classifier."""
    from transformers import AutoModelForSequenceClassification

    run = tmp_path / "run"
    args = overrides(
        tiny_model_dir,
        pair_files,
        run,
        f"data.val_files=[{pair_files['test']}]",
        "trainer.total_steps=2",
        "trainer.backend=ray",
        "trainer.n_workers_per_node=2",
        "optim.lr=1e-3",
    )
    trainer = RMTrainer(load_config(RMConfig, "rm", args))
    metrics = trainer.fit()
    assert metrics["rm/grad_norm"] > 0 and metrics["val/pairs"] == 24
    model = AutoModelForSequenceClassification.from_pretrained(run / "hf").eval()
    tok = load_tokenizer(run / "hf")
    val = PreferenceDataset(pair_files["test"], tok, 256)
    batch = collate_pairs([val[i] for i in range(len(val))], tok.pad_token_id)
    with torch.no_grad():
        scores = model(input_ids=batch[keys.INPUT_IDS], attention_mask=batch[keys.ATTENTION_MASK]).logits[
            :, 0
        ]
    assert float((scores[0::2] - scores[1::2]).double().mean()) == pytest.approx(
        metrics["val/margin"], abs=1e-5
    )
