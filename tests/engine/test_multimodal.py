"""Tests for posttrain/engine/multimodal.py and the train engine's image path (tiny Qwen2-VL, padded rows):
images stay with their rows through micro-batching, the SFT loss equals a per-row computation with the model
called as transformers documents it, and `vision_tower` freezes or trains the vision encoder. Packed rows equal
these padded ones: tests/engine/test_packed_images.py (which reuses this file's rows and engine)."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, ImageDraw

from posttrain.config.schema import LoraConfig, OptimConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.mm_dataset import MULTI_MODAL_INPUTS
from posttrain.data.mm_sft_dataset import MultimodalSFTDataset, collate_multimodal_sft
from posttrain.data.tasks.shapes import corpus
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.multimodal import gather_images
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError, DataError
from posttrain.models import load_causal_lm, load_processor, make_tiny_model
from posttrain.models.vl import vision_tower_trained
from posttrain.workers.losses import LossSpec, build_loss


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("tiny-vl", tmp_path_factory.mktemp("vl") / "model", corpus(500), seed=0)


def png(size: tuple[int, int], color: str, box: tuple[int, int, int, int]) -> dict:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).rectangle(box, fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


@pytest.fixture(scope="module")
def batch(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Batch:
    """Rows with one image of two sizes, no image, and two images, so image token counts differ by row."""

    def row(text: str, images: list, answer: str) -> dict:
        return {
            "prompt": [{"role": "user", "content": text}],
            "images": images,
            "extra_info": {"answer": answer},
        }

    rows = [
        row("<image>How many squares?", [png((56, 56), "red", (4, 4, 20, 20))], "1"),
        row("<image>What color?", [png((112, 56), "blue", (30, 10, 60, 40))], "blue"),
        row("How many squares are in no image?", [], "0"),
        row(
            "<image> then <image> count",
            [png((56, 56), "green", (2, 2, 30, 30)), png((56, 112), "red", (0, 0, 9, 9))],
            "2",
        ),
        row("<image>What color is the square?", [png((56, 56), "yellow", (10, 10, 40, 40))], "yellow"),
    ]
    path = tmp_path_factory.mktemp("mmdata") / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    processor = load_processor(vl_dir)
    size = processor.image_processor.size
    ds = MultimodalSFTDataset(
        path, processor, 128, min_pixels=size.shortest_edge, max_pixels=size.longest_edge
    )
    b = collate_multimodal_sft([ds[i] for i in range(len(ds))], pad_token_id=processor.tokenizer.pad_token_id)
    b.meta[keys.GLOBAL_TOKENS] = float(b[keys.LOSS_MASK].sum())
    b.meta[keys.GLOBAL_SEQS] = len(b)
    return b


def engine(path: Path, **kw) -> TrainEngine:
    config = EngineConfig(
        model_path=str(path),
        remove_padding=False,
        share_prompt=False,
        total_steps=10,
        micro_batch_size=8,
        optim=OptimConfig(lr=1e-2),
    )
    return TrainEngine(replace(config, **kw))


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def test_micro_batches_keep_images_with_their_rows(vl_dir, batch):
    eng = engine(vl_dir, micro_batch_size=5)
    real = batch[keys.ATTENTION_MASK]  # log-probs at padding are not defined: compare real tokens

    def log_probs(b: Batch) -> torch.Tensor:
        return eng.compute_log_prob(b) * b[keys.ATTENTION_MASK]

    whole = log_probs(batch)
    assert int(real.sum()) < real.numel()
    image_id = eng.image_token_id
    for size in (1, 2):
        eng.config = replace(eng.config, micro_batch_size=size)
        for mb in eng._micro_batches(batch):
            images = gather_images(list(mb[MULTI_MODAL_INPUTS]))
            n_tokens = int((mb[keys.INPUT_IDS] == image_id).sum())
            assert n_tokens == (int(images[1].prod(-1).sum()) // 4 if images else 0)
        torch.testing.assert_close(log_probs(batch), whole, atol=1e-5, rtol=1e-5)
    eng.config = replace(eng.config, micro_batch_size=8, max_token_len=60)  # token budget: rows regrouped
    assert len(eng._micro_batch_rows(batch)) > 1
    torch.testing.assert_close(log_probs(batch), whole, atol=1e-5, rtol=1e-5)
    order = [3, 0, 4, 2, 1]
    torch.testing.assert_close(log_probs(batch.index(order)), whole[order], atol=1e-5, rtol=1e-5)


def test_an_image_separated_from_its_row_is_an_error(vl_dir, batch):
    eng = engine(vl_dir)
    broken = batch.index(slice(0, 2))
    broken.set(MULTI_MODAL_INPUTS, [broken[MULTI_MODAL_INPUTS][1], broken[MULTI_MODAL_INPUTS][0]])
    with pytest.raises(DataError, match="image tokens but its images give"):
        eng.compute_log_prob(broken)


def test_image_tokens_without_their_images_are_an_error(vl_dir, batch):
    """A batch whose images column was dropped would read image tokens as text: refused, never computed."""
    eng = engine(vl_dir)
    with pytest.raises(DataError, match="image tokens but it carries no images"):
        eng.compute_log_prob(batch.select(None, []))
    text_row = batch.index([2])  # the row without images needs no column
    assert torch.isfinite(eng.compute_log_prob(text_row.select(None, []))).all()


def test_masked_loss_and_gradients_equal_a_per_row_computation(vl_dir, batch):
    """The loss, and the gradient of every parameter (the trained vision tower's included), equal those of the HF
    model called on each row alone with its own images."""
    eng = engine(vl_dir, micro_batch_size=2)
    metrics = eng.forward_backward(batch, build_loss(LossSpec("cross_entropy"), 1))
    model = load_causal_lm(vl_dir)
    image_id = model.config.image_token_id
    nll, tokens = torch.zeros(()), 0.0
    for r in range(len(batch)):
        n = int(batch[keys.ATTENTION_MASK][r].sum())
        ids = batch[keys.INPUT_IDS][r : r + 1, :n]
        mm = batch[MULTI_MODAL_INPUTS][r]
        extra = dict(mm, mm_token_type_ids=(ids == image_id).int()) if mm else {}
        logits = model(input_ids=ids, **extra).logits[0, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = batch[keys.LOSS_MASK][r, 1:n]
        nll = nll - (lp * mask).sum()
        tokens += float(mask.sum())
    (nll / tokens).backward()
    assert metrics["loss"] == pytest.approx(float(nll) / tokens, rel=1e-5)
    engine_grads = {n: full(p.grad) for n, p in eng.model.named_parameters() if p.grad is not None}
    reference = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert engine_grads.keys() == reference.keys()
    assert any(".visual." in f".{n}" for n in reference)  # make-model's from-scratch tower trains
    for name, grad in reference.items():
        torch.testing.assert_close(engine_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def visual_params(eng: TrainEngine) -> dict[str, torch.Tensor]:
    return {n: p for n, p in eng.model.named_parameters() if ".visual." in f".{n}"}


def one_step(eng: TrainEngine, batch: Batch) -> tuple[dict, dict, dict, dict]:
    vis0 = {n: full(p) for n, p in visual_params(eng).items()}
    text0 = {n: full(p) for n, p in eng.model.named_parameters() if n not in vis0}
    eng.forward_backward(batch, build_loss(LossSpec("cross_entropy"), 1))
    eng.optim_step()
    vis1 = {n: full(p) for n, p in visual_params(eng).items()}
    text1 = {n: full(p) for n, p in eng.model.named_parameters() if n not in vis0}
    return vis0, vis1, text0, text1


def changed(a: dict, b: dict) -> int:
    return sum(not torch.equal(a[n], b[n]) for n in a)


def test_frozen_vision_tower_does_not_move(vl_dir, batch):
    eng = engine(vl_dir, vision_tower="frozen")
    assert not eng.vision_tower_trained
    assert visual_params(eng) and not any(p.requires_grad for p in visual_params(eng).values())
    vis0, vis1, text0, text1 = one_step(eng, batch)
    assert changed(vis0, vis1) == 0 and changed(text0, text1) > 0


def test_trained_vision_tower_moves(vl_dir, batch):
    eng = engine(vl_dir, vision_tower="trained")
    assert eng.vision_tower_trained and all(p.requires_grad for p in visual_params(eng).values())
    vis0, vis1, _, _ = one_step(eng, batch)
    assert changed(vis0, vis1) == len(vis0)


def test_auto_trains_a_from_scratch_tower_and_freezes_a_pretrained_one(vl_dir, pretrained_vl_dir):
    assert engine(vl_dir).vision_tower_trained
    assert not engine(pretrained_vl_dir).vision_tower_trained
    with pytest.raises(ConfigError, match="model.vision_tower='sometimes' unknown"):
        vision_tower_trained("sometimes", None)


def test_lora_adapts_the_language_model_and_keeps_the_tower_frozen(vl_dir, batch):
    with pytest.raises(ConfigError, match="model.vision_tower=trained with model.lora.rank > 0"):
        engine(vl_dir, vision_tower="trained", lora=LoraConfig(rank=4))
    eng = engine(vl_dir, lora=LoraConfig(rank=4))  # auto on a from-scratch model: frozen under LoRA
    assert not eng.vision_tower_trained
    trainable = [n for n, p in eng.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "visual" not in n for n in trainable)
    before = eng.compute_log_prob(batch)
    eng.forward_backward(batch, build_loss(LossSpec("cross_entropy"), 1))
    eng.optim_step()
    assert not torch.allclose(eng.compute_log_prob(batch), before)
