"""SFT on multi-turn chats: packed and padded passes give the same loss and gradients under the chat mask,
and `posttrain sft` trains on `messages` rows end to end."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from posttrain.config.schema import OptimConfig
from posttrain.data import keys
from posttrain.data.sft_dataset import SFTDataset, collate_sft
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.train_engine import TrainEngine
from posttrain.models import load_tokenizer
from posttrain.workers.losses import LossSpec, build_loss
from tests.data.conftest import write_rows


def chat(i: int, turns: int) -> dict:
    messages = [{"role": "system", "content": "Add."}] if i % 2 else []
    for t in range(turns):
        a, b = (i * 7 + t * 3) % 50, (i * 3 + t) % 50
        messages += [
            {"role": "user", "content": f"What is {a}+{b}?"},
            {"role": "assistant", "content": str(a + b)},
        ]
    return {"messages": messages}


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("chats")
    return {
        "train": write_rows(out / "train.jsonl", [chat(i, 1 + i % 3) for i in range(64)]),
        "test": write_rows(out / "test.jsonl", [chat(100 + i, 1 + i % 3) for i in range(16)]),
    }


def loss_and_grads(model_dir: Path, batch, **overrides) -> tuple[float, torch.Tensor]:
    config = EngineConfig(
        model_path=str(model_dir), optim=OptimConfig(lr=1e-3), micro_batch_size=5, share_prompt=False
    )
    eng = TrainEngine(replace(config, **overrides))
    batch.meta[keys.GLOBAL_TOKENS] = float(batch[keys.LOSS_MASK].sum())
    batch.meta[keys.GLOBAL_SEQS] = len(batch)
    metrics = eng.forward_backward(batch, build_loss(LossSpec("cross_entropy"), 1))
    grads = torch.cat([p.grad.full_tensor().flatten() for p in eng.model.parameters()])
    return metrics["loss"], grads


@pytest.mark.parametrize("train_on", ["last_assistant", "all_assistant", "all_messages"])
def test_packed_equals_padded_on_multi_turn_masks(tiny_model_dir: Path, chat_files, train_on: str) -> None:
    tok = load_tokenizer(tiny_model_dir)
    ds = SFTDataset(chat_files["train"], tok, max_length=256, train_on=train_on)
    batch = collate_sft([ds[i] for i in range(12)], pad_token_id=tok.pad_token_id)
    assert batch[keys.LOSS_MASK].sum() < batch[keys.ATTENTION_MASK].sum()
    padded_loss, padded_grads = loss_and_grads(tiny_model_dir, batch, remove_padding=False)
    for overrides in ({"pack_row_tokens": 64}, {"pack_row_tokens": 256, "max_token_len": 120}):
        loss, grads = loss_and_grads(tiny_model_dir, batch, remove_padding=True, **overrides)
        assert loss == pytest.approx(padded_loss, abs=1e-5)
        torch.testing.assert_close(grads, padded_grads, atol=1e-6, rtol=1e-4)


def test_sft_cli_on_chats(tiny_model_dir: Path, chat_files, tmp_path: Path) -> None:
    from posttrain.cli import main

    code = main(
        [
            "sft",
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{chat_files['train']}]",
            f"data.val_files=[{chat_files['test']}]",
            "data.max_prompt_length=200",
            "data.train_on=last_assistant",
            f"trainer.run_dir={tmp_path}",
            "trainer.total_steps=12",
            "trainer.val_every=6",
            "optim.batch_size=16",
            "optim.warmup_steps=2",
            "optim.lr=3e-3",
            "trainer.loggers=[jsonl]",
        ]
    )
    assert code == 0
    vals = [
        json.loads(x)["val/nll"]
        for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if "val/nll" in x
    ]
    assert len(vals) == 2 and vals[1] < vals[0]
    assert (tmp_path / "hf" / "config.json").exists()
