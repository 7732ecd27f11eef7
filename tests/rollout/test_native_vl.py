"""The built-in rollout engine on image prompts (tiny Qwen2-VL): greedy output equals HF `generate`, sampled
log-probs equal the train engine's recomputation, prompt sharing only across equal images, bad requests refused."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, ImageDraw

from posttrain.data import keys
from posttrain.data.mm_dataset import MULTI_MODAL_INPUTS, MultimodalPromptDataset, collate_multimodal_prompts
from posttrain.data.tasks.shapes import corpus
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError
from posttrain.models import load_causal_lm, load_processor, make_tiny_model
from posttrain.rollout.base import GenerationRequest, SamplingParams
from posttrain.rollout.native import NativeRolloutEngine
from posttrain.workers.sampling import results_batch, sample_batch


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
def items(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Prompts with one image (two sizes), none, two images, and the same text over a different image."""

    def row(text: str, images: list) -> dict:
        return {
            "prompt": [{"role": "user", "content": text}],
            "images": images,
            "data_source": "shapes",
            "reward_model": {"ground_truth": "1"},
        }

    rows = [
        row("<image>How many squares?", [png((56, 56), "red", (4, 4, 20, 20))]),
        row("<image>What color?", [png((112, 56), "blue", (30, 10, 60, 40))]),
        row("How many squares are in no image?", []),
        row(
            "<image> then <image> count",
            [png((56, 56), "green", (2, 2, 30, 30)), png((56, 112), "red", (0, 0, 9, 9))],
        ),
        row("<image>How many squares?", [png((56, 56), "yellow", (10, 10, 40, 40))]),
    ]
    path = tmp_path_factory.mktemp("rows") / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    dataset = MultimodalPromptDataset(
        path, load_processor(vl_dir), max_prompt_length=128, min_pixels=56 * 56, max_pixels=112 * 112
    )
    return [dataset[i] for i in range(len(dataset))]


def request(item: dict, sampling: SamplingParams) -> GenerationRequest:
    return GenerationRequest(item["input_ids"], sampling, images=item[MULTI_MODAL_INPUTS] or None)


def test_greedy_equals_hf_generate(vl_dir: Path, items: list[dict]) -> None:
    """All prompts decoded together (continuous batching, different lengths and image counts) give, token for
    token, what HF `generate` gives for each prompt alone (image placeholders suppressed in both)."""
    engine = NativeRolloutEngine(str(vl_dir))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    results = engine.generate_requests([request(it, greedy) for it in items])
    model = load_causal_lm(str(vl_dir)).eval()
    image_token = model.config.image_token_id
    for i, (item, result) in enumerate(zip(items, results, strict=True)):
        ids = torch.tensor([item["input_ids"]])
        mm = {k: v for k, v in item[MULTI_MODAL_INPUTS].items()}
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=(ids == image_token).int(),
            **mm,
            max_new_tokens=12,
            do_sample=False,
            suppress_tokens=[image_token, model.config.video_token_id],
        )
        expected = out[0, ids.shape[1] :].tolist()
        assert result.token_ids == expected[: len(result.token_ids)], f"prompt {i}"
        assert len(result.token_ids) == len(expected) or result.stop_reason == "stop", f"prompt {i}"
    assert engine.stats["prefill_tokens"] == sum(len(it["input_ids"]) for it in items)


def test_sampled_log_probs_match_train_engine(vl_dir: Path, items: list[dict]) -> None:
    """3 samples per prompt (one shared prefill each): the rollout's log-probs equal the train engine's on the
    same [prompt | response] rows with the rows' images, to the tolerance text models get (1e-4)."""
    engine = NativeRolloutEngine(str(vl_dir))
    temperature, n = 0.8, 3
    sampling = SamplingParams(max_tokens=10, temperature=temperature)
    uids = [str(i) for i in range(len(items))]
    prompts = collate_multimodal_prompts(items, engine.pad_id, uids).repeat(n)
    requests = [
        GenerationRequest(ids[m.bool()].tolist(), sampling, images=mm or None)
        for ids, m, mm in zip(
            prompts[keys.INPUT_IDS], prompts[keys.ATTENTION_MASK], prompts[MULTI_MODAL_INPUTS], strict=True
        )
    ]
    results = engine.generate_requests(requests)
    assert all(r.error is None for r in results)
    # the n samples of a prompt share one prefill; different images never do
    assert engine.stats["prefill_tokens"] == sum(len(it["input_ids"]) for it in items)
    batch = results_batch(prompts, results, engine.pad_id, 10, 0.0, temperature)
    batch.set(MULTI_MODAL_INPUTS, list(prompts[MULTI_MODAL_INPUTS]))
    trained = TrainEngine(
        EngineConfig(
            model_path=str(vl_dir),
            trainable=False,
            micro_batch_size=4,
            remove_padding=False,
            share_prompt=False,
        )
    )
    recomputed = trained.compute_log_prob(batch, temperature=temperature)
    mask = batch[keys.RESPONSE_MASK]
    diff = ((recomputed - batch[keys.ROLLOUT_LOG_PROBS]).abs() * mask).max().item()
    print(f"VL rollout vs training log-prob max abs diff: {diff:.3e}")
    assert diff < 1e-4
    image_token = engine.model.config.image_token_id
    assert not (batch[keys.RESPONSES][mask.bool()] == image_token).any()


def test_bad_image_request_refused(vl_dir: Path, items: list[dict]) -> None:
    engine = NativeRolloutEngine(str(vl_dir))
    sampling = SamplingParams(max_tokens=4, temperature=0.0)
    text_only = GenerationRequest(items[0]["input_ids"], sampling)  # image tokens, no images
    other = GenerationRequest(items[0]["input_ids"], sampling, images=items[3][MULTI_MODAL_INPUTS])
    good = request(items[0], sampling)
    results = engine.generate_requests([text_only, other, good])
    assert "image tokens but no images" in (results[0].error or "")
    assert "image tokens but its images give" in (results[1].error or "")
    assert results[2].error is None and results[2].token_ids


def test_sample_batch_carries_row_images(vl_dir: Path, items: list[dict]) -> None:
    """The workers' `sample_batch` sends each row's images with its prompt: greedy responses equal the engine's
    own on the same requests; the HF engine refuses image prompts, naming rollout.name."""
    from posttrain.rollout.hf_engine import HFRolloutEngine

    engine = NativeRolloutEngine(str(vl_dir))
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = collate_multimodal_prompts(items, engine.pad_id, [str(i) for i in range(len(items))])
    out = sample_batch(engine, prompts, greedy)
    direct = engine.generate_requests([request(it, greedy) for it in items])
    for i, result in enumerate(direct):
        assert out[keys.RESPONSES][i, : len(result.token_ids)].tolist() == result.token_ids
    with pytest.raises(ConfigError, match="rollout.name=hf"):
        sample_batch(HFRolloutEngine(str(vl_dir)), prompts, greedy)
