"""Vision-language training on several FSDP ranks when a rank's micro-batch holds no image (engine.vision_pass):
the text-only pass runs the sharded vision tower on a blank image and adds exactly zero, so 2 Ray workers
complete mixed image/text steps (before: gloo aborted rank 0 on a collective size mismatch) and equal 1 worker,
full weights (tower trained) and LoRA; micro-batch counts that differ by rank (token budget) too."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file

from posttrain.config.schema import LoraConfig, OptimConfig
from posttrain.controller.worker_group import RayWorkerGroup
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.mm_dataset import MULTI_MODAL_INPUTS
from posttrain.data.mm_sft_dataset import MultimodalSFTDataset, collate_multimodal_sft
from posttrain.data.tasks.shapes import corpus
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.train_engine import TrainEngine
from posttrain.engine.vision_pass import VisionPass, blank_image
from posttrain.models import load_processor, make_tiny_model
from posttrain.workers.actor_rollout_ref import ActorRolloutRefSpec, ActorRolloutRefWorker
from posttrain.workers.losses import LossSpec, build_loss


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("tiny-vl", tmp_path_factory.mktemp("vl") / "model", corpus(300), seed=0)


def png(color: str, size: tuple[int, int] = (56, 56)) -> dict:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).rectangle((4, 4, 20, 20), fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def sft_batch(vl_dir: Path, folder: Path, rows: list[tuple[str, list[dict]]]) -> Batch:
    """Collated SFT rows (prompt text, images) with the global totals the loss normalises by."""
    table = [
        {"prompt": [{"role": "user", "content": text}], "images": images, "extra_info": {"answer": "1"}}
        for text, images in rows
    ]
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(table), folder / "rows.parquet")
    processor = load_processor(vl_dir)
    size = processor.image_processor.size
    ds = MultimodalSFTDataset(
        folder / "rows.parquet", processor, 256, min_pixels=size.shortest_edge, max_pixels=size.longest_edge
    )
    b = collate_multimodal_sft([ds[i] for i in range(len(ds))], pad_token_id=processor.tokenizer.pad_token_id)
    b.meta[keys.GLOBAL_TOKENS] = float(b[keys.LOSS_MASK].sum())
    b.meta[keys.GLOBAL_SEQS] = len(b)
    return b


def lengths(batch: Batch) -> list[int]:
    return [int(n) for n in batch[keys.ATTENTION_MASK].sum(1)]


@pytest.fixture(scope="module")
def mixed(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Batch:
    """Rank 0 of 2: an image row and a two-image row; rank 1: two text-only rows."""
    return sft_batch(
        vl_dir,
        tmp_path_factory.mktemp("mixed"),
        [
            ("<image>How many squares?", [png("red")]),
            ("<image> then <image> count them all" + " word" * 25, [png("green"), png("blue", (112, 56))]),
            ("no image in this row", []),
            ("text only", []),
        ],
    )


@pytest.fixture(scope="module")
def all_images(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Batch:
    """Every row with an image; rank 1's two rows are longer than rank 0's (more micro-batches by token budget)."""
    words = "word " * 30
    return sft_batch(
        vl_dir,
        tmp_path_factory.mktemp("all_images"),
        [
            ("<image>How many?", [png("red")]),
            ("<image>Color?", [png("yellow")]),
            (f"<image>{words}", [png("green")]),
            ("<image>What color is it?", [png("blue")]),
        ],
    )


def test_blank_image_is_one_merged_token(vl_dir):
    from posttrain.models import load_config

    pixels, grid = blank_image(load_config(vl_dir).vision_config, torch.device("cpu"))
    assert grid.tolist() == [[1, 2, 2]] and pixels.shape == (4, 3 * 2 * 14 * 14) and not pixels.any()


@pytest.mark.parametrize("lora", [0, 4])
def test_text_pass_with_the_tower_is_exactly_the_text_pass(vl_dir, mixed, lora):
    """One rank, text-only rows: with the blank image's zero added, log-probs, loss and every gradient are
    bit-equal to the plain text pass; a trained tower gets zero gradients (not none: FSDP reduces them)."""
    text = mixed.index([2, 3]).select(None, [])
    config = EngineConfig(
        model_path=str(vl_dir), remove_padding=False, share_prompt=False, lora=LoraConfig(rank=lora)
    )
    eng = TrainEngine(config)
    assert eng.vision_pass is None  # one rank: no collectives to pair up
    vision_pass = VisionPass(eng.model, eng.device)
    loss_fn = build_loss(LossSpec("cross_entropy"), 1)
    results = []
    for context in (None, vision_pass):
        eng.vision_pass = context
        log_probs = eng.compute_log_prob(text)
        metrics = eng.forward_backward(text, loss_fn)
        grads = {n: p.grad.detach().clone() for n, p in eng.model.named_parameters() if p.grad is not None}
        eng.optimizer.zero_grad(set_to_none=True)
        results.append((log_probs, metrics["loss"], grads))
    assert vision_pass.calls == 2  # the log-prob pass and the forward of forward_backward
    (lp0, loss0, g0), (lp1, loss1, g1) = results
    assert torch.equal(lp0, lp1) and loss0 == loss1
    visual = {n for n in g1 if ".visual." in f".{n}"}
    assert g1.keys() - visual == g0.keys()
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
    if lora:
        assert not visual  # frozen tower under LoRA: no backward through it
    else:
        assert visual and all(not g1[n].any() for n in visual)


def spec(vl_dir: Path, lora: int, max_token_len: int, remove_padding: bool = False) -> ActorRolloutRefSpec:
    engine = EngineConfig(
        model_path=str(vl_dir),
        remove_padding=remove_padding,
        share_prompt=False,
        micro_batch_size=1,
        max_token_len=max_token_len,
        optim=OptimConfig(lr=1e-3, grad_clip=1e9),
        lora=LoraConfig(rank=lora),
    )
    return ActorRolloutRefSpec(engine=engine, with_rollout=False, with_ref=True, threads=1)


def step(group: RayWorkerGroup, batch: Batch) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Metrics of one SFT step, and the actor's and reference's log-probs before it (real tokens only)."""
    mask = batch[keys.ATTENTION_MASK]
    actor = group.call("forward", batch, "actor")[keys.OLD_LOG_PROBS] * mask
    ref = group.call("forward", batch, "ref")[keys.REF_LOG_PROB] * mask
    metrics = group.call("forward_backward", batch, LossSpec("cross_entropy"))
    metrics.update(group.call("optim_step"))
    return metrics, actor, ref


@pytest.mark.slow  # padded ~45 s, packed ~90 s on 2 Ray workers: the default suite's time on 2 cores
@pytest.mark.parametrize(
    "remove_padding",
    # packed equals padded on one worker in the fast suite
    # (tests/engine/test_packed_images.py)
    [pytest.param(False, id="padded"), pytest.param(True, id="packed")],
)
def test_two_workers_with_text_only_micro_batches_equal_one_worker(
    vl_dir, mixed, all_images, tmp_path, ray_cluster, remove_padding
):
    """2 FSDP workers on Ray against 1, full weights (the from-scratch tower trains) and LoRA (tower frozen):
    mixed rows, rank 1 text only (2 micro-batches against rank 0's 2), then all-image rows where the token
    budget gives rank 0 one micro-batch and rank 1 two (split to two each). Same log-probs, loss, gradient
    norm and weights after the steps; padded rows and packed rows (engine.packed_images)."""
    budget = lengths(mixed)[1]  # rank 0: two micro-batches; rank 1's text rows fit in one
    assert sum(lengths(mixed)[2:]) <= budget < sum(lengths(mixed)[:2])
    a = lengths(all_images)
    assert a[0] + a[1] <= budget < a[2] + a[3]
    assert all(bool(r) for r in all_images[MULTI_MODAL_INPUTS])
    for lora in (0, 4):
        results = {}
        for world in (1, 2):
            group = RayWorkerGroup(
                ActorRolloutRefWorker,
                spec(vl_dir, lora, budget, remove_padding),
                world_size=world,
                role="actor",
                device="cpu",
                timeout_s=60,
            )
            try:
                steps = [step(group, mixed), step(group, all_images)]
                out = tmp_path / f"lora{lora}_w{world}"
                group.call("export_hf", str(out))
                results[world] = steps, load_file(out / "model.safetensors")
            finally:
                group.shutdown()
        (steps1, w1), (steps2, w2) = results[1], results[2]
        for (m1, actor1, ref1), (m2, actor2, ref2) in zip(steps1, steps2, strict=True):
            torch.testing.assert_close(actor2, actor1, atol=1e-5, rtol=0)
            torch.testing.assert_close(ref2, ref1, atol=1e-5, rtol=0)
            assert m2["loss"] == pytest.approx(m1["loss"], abs=1e-5), lora
            assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5), lora
            assert m1["grad_norm"] > 0
        for name, tensor in w1.items():
            torch.testing.assert_close(w2[name], tensor, atol=1e-5, rtol=0, msg=f"lora={lora} {name}")
        if not lora:  # the trained tower moved, the same on both
            before = load_file(vl_dir / "model.safetensors")
            assert any(not torch.equal(w1[n], before[n]) for n in w1 if ".visual." in f".{n}")
