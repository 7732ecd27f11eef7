"""SFT: the same engine with cross-entropy lowers the held-out NLL and writes a loadable HF directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config.load import load_config
from posttrain.config.schema import SFTConfig
from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.trainers.sft import SFTTrainer


def sft_config(model: Path, data: dict, run: Path, *extra: str) -> SFTConfig:
    """SFT on the arithmetic task's train split, validated on its test split."""
    return load_config(
        SFTConfig,
        "sft",
        [
            f"model.path={model}",
            f"data.train_files=[{data['train']}]",
            f"data.val_files=[{data['test']}]",
            f"trainer.run_dir={run}",
            *extra,
        ],
    )


def test_sft_lowers_nll_and_exports(tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path) -> None:
    extra = (
        "trainer.total_steps=30",
        "trainer.val_every=15",
        "optim.batch_size=32",
        "optim.micro_batch_size=16",
    )
    cfg = sft_config(tiny_model_dir, arithmetic_data, tmp_path, *extra)
    trainer = SFTTrainer(cfg)
    trainer.fit()
    vals = [
        json.loads(line)["val/nll"]
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if "val/nll" in line
    ]
    assert len(vals) == 2 and vals[1] < vals[0]
    model = load_causal_lm(trainer.hf_dir)
    assert load_tokenizer(trainer.hf_dir).eos_token == "<|im_end|>"
    assert sum(p.numel() for p in model.parameters()) > 900_000


def test_sft_rejects_shared_prompts(tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path) -> None:
    import pytest

    from posttrain.errors import ConfigError

    cfg = load_config(
        SFTConfig,
        "sft",
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arithmetic_data['train']}]",
            f"trainer.run_dir={tmp_path}",
            "model.share_prompt=true",
        ],
    )
    with pytest.raises(ConfigError, match="share_prompt=true is for RL"):
        SFTTrainer(cfg)


@pytest.mark.slow  # two Ray workers (CI runs it with -m slow)
def test_validation_with_fewer_rows_than_workers_pads_them(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None
) -> None:
    """One held-out row on two data-parallel workers: the row is repeated to fill the second worker and
    counted once, so val/nll equals the one-worker run's (it used to leave no rows and crash before export)."""
    nll = {}
    for name, extra in (("one", []), ("two", ["trainer.backend=ray", "trainer.n_workers_per_node=2"])):
        run = tmp_path / name
        one_step = ("trainer.total_steps=1", "data.val_max_prompts=1", "optim.batch_size=4")
        cfg = sft_config(
            tiny_model_dir, arithmetic_data, run, *one_step, "trainer.threads_per_worker=1", *extra
        )
        trainer = SFTTrainer(cfg)
        trainer.fit()
        assert (trainer.hf_dir / "config.json").exists()
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        nll[name] = [r["val/nll"] for r in rows if "val/nll" in r][-1]
    assert nll["two"] == pytest.approx(nll["one"], rel=1e-4)
