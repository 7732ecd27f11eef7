"""The reward-model worker on the ~1M preset: scores of right-padded rows, the Bradley-Terry loss against the
scores it reports, identical pairs (log 2, no gradient without centering), and save -> load as a Hugging Face
classifier -> the same scores."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from posttrain.config.schema import OptimConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.preference_dataset import PAIR_CHOSEN, PAIR_MARGIN, PreferenceDataset, collate_pairs
from posttrain.data.tasks.arithmetic_pairs import write_arithmetic_pairs
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.reward_engine import REWARD_HEAD
from posttrain.errors import ConfigError, WorkerError
from posttrain.models import load_tokenizer
from posttrain.workers.losses import LossSpec
from posttrain.workers.reward_model import RM_SCORE, RewardModelSpec, RewardModelWorker


def spec(model: Path, micro_batch_size: int = 4, trainable: bool = True) -> RewardModelSpec:
    engine = EngineConfig(
        model_path=str(model),
        head=REWARD_HEAD,
        remove_padding=False,
        share_prompt=False,
        trainable=trainable,
        optim=OptimConfig(lr=1e-3),
        total_steps=10,
        micro_batch_size=micro_batch_size,
    )
    return RewardModelSpec(engine=engine, threads=1)


@pytest.fixture(scope="module")
def pairs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Batch:
    """8 arithmetic pairs (rows 2i chosen, 2i+1 rejected) with margins 0, 0.5, 1, ..."""
    out = tmp_path_factory.mktemp("rm_pairs")
    path = write_arithmetic_pairs(out, n_train=8, n_test=2)["train"]
    rows = pq.read_table(path).to_pylist()
    for i, row in enumerate(rows):
        row["margin"] = 0.5 * i
    with_margin = out / "margin.jsonl"
    with_margin.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = load_tokenizer(tiny_model_dir)
    ds = PreferenceDataset(with_margin, tok, 128, margin_column="margin")
    batch = collate_pairs([ds[i] for i in range(len(ds))], tok.pad_token_id)
    batch.meta[keys.GLOBAL_SEQS] = len(batch) // 2  # the loss is a mean over the mini-batch's pairs
    return batch


def inputs(batch: Batch) -> Batch:
    return batch.select([keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS], [])


def test_loss_is_bradley_terry_of_the_scores(tiny_model_dir: Path, pairs: Batch) -> None:
    worker = RewardModelWorker(spec(tiny_model_dir))
    scores = worker.score(inputs(pairs))[RM_SCORE].double()
    assert scores.shape == (len(pairs),)
    coef = 0.05
    metrics = worker.forward_backward(pairs, LossSpec("bradley_terry", {"center_rewards_coefficient": coef}))
    chosen, rejected, margin = scores[0::2], scores[1::2], pairs[PAIR_MARGIN][0::2]
    bt = -F.logsigmoid(chosen - rejected - margin)
    assert metrics["rm/bt_loss"] == pytest.approx(float(bt.mean()), abs=1e-5)
    assert metrics["rm/loss"] == pytest.approx(float((bt + coef * (chosen + rejected) ** 2).mean()), abs=1e-5)
    assert metrics["rm/accuracy"] == pytest.approx(float((chosen > rejected).double().mean()))
    assert worker.optim_step()["rm/grad_norm"] > 0


def test_identical_pairs_give_log2_and_no_gradient_without_centering(
    tiny_model_dir: Path, pairs: Batch
) -> None:
    worker = RewardModelWorker(spec(tiny_model_dir))
    same = pairs.index([0, 0, 2, 2, 4, 4, 6, 6])  # each pair's chosen row on both sides
    same.set(PAIR_MARGIN, torch.zeros(len(same), dtype=torch.float64))
    same.set(PAIR_CHOSEN, torch.tensor([1, 0] * 4))
    same.meta[keys.GLOBAL_SEQS] = 4
    metrics = worker.forward_backward(same, LossSpec("bradley_terry"))
    assert metrics["rm/bt_loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert metrics["rm/accuracy"] == 0.0 and metrics["rm/ties"] == 1.0
    assert worker.optim_step()["rm/grad_norm"] < 1e-6
    metrics = worker.forward_backward(same, LossSpec("bradley_terry", {"center_rewards_coefficient": 0.1}))
    assert metrics["rm/loss"] > math.log(2.0)
    assert worker.optim_step()["rm/grad_norm"] > 1e-4  # centering pulls the shared score towards 0


def test_a_pair_split_across_micro_batches_is_refused(tiny_model_dir: Path, pairs: Batch) -> None:
    worker = RewardModelWorker(spec(tiny_model_dir, micro_batch_size=3))
    with pytest.raises(ConfigError, match="whole pairs in a micro-batch"):
        worker.forward_backward(pairs, LossSpec("bradley_terry"))
    with pytest.raises(ConfigError, match="takes no option 'beta'"):
        worker.forward_backward(pairs, LossSpec("bradley_terry", {"beta": 0.1}))


def test_export_loads_as_hf_classifier_with_the_same_scores(
    tiny_model_dir: Path, pairs: Batch, tmp_path: Path
) -> None:
    from transformers import AutoModelForSequenceClassification

    worker = RewardModelWorker(spec(tiny_model_dir))
    worker.forward_backward(pairs, LossSpec("bradley_terry"))
    worker.optim_step()  # a trained head and body, not the initial weights
    scores = worker.score(inputs(pairs))[RM_SCORE]
    worker.export_hf(str(tmp_path / "rm"))

    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and len(config["id2label"]) == 1
    assert config["pad_token_id"] == load_tokenizer(tiny_model_dir).pad_token_id
    assert (tmp_path / "rm" / "tokenizer.json").exists()
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    with torch.no_grad():
        padded = model(input_ids=pairs[keys.INPUT_IDS], attention_mask=pairs[keys.ATTENTION_MASK]).logits[
            :, 0
        ]
        alone = [
            model(input_ids=ids[mask.bool()][None]).logits[0, 0]
            for ids, mask in zip(pairs[keys.INPUT_IDS], pairs[keys.ATTENTION_MASK], strict=True)
        ]
    torch.testing.assert_close(padded, scores, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.stack(alone), scores, atol=1e-5, rtol=0)  # padding changes nothing

    # the exported directory is a reward model again: frozen, scoring as before
    frozen = RewardModelWorker(spec(tmp_path / "rm", trainable=False))
    torch.testing.assert_close(frozen.score(inputs(pairs))[RM_SCORE], scores, atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="frozen engine"):
        frozen.forward_backward(pairs, LossSpec("bradley_terry"))


def test_engine_settings_that_cannot_work(tiny_model_dir: Path) -> None:
    from dataclasses import replace

    from posttrain.controller.worker_group import LocalWorkerGroup

    packed = replace(spec(tiny_model_dir), engine=replace(spec(tiny_model_dir).engine, remove_padding=True))
    with pytest.raises(WorkerError, match="right-padded rows"):
        LocalWorkerGroup(RewardModelWorker, packed, role="reward_model")
