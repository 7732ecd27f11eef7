"""Qwen2.5-VL (`qwen2_5_vl`) through posttrain with the tiny-vl-2.5 preset: the directory loads with transformers'
auto classes and posttrain's processor, and the tiny-vl (Qwen2-VL) checks hold for it unchanged: the built-in
rollout engine's greedy output equals HF `generate` and its log-probs equal the train engine's; the train engine's
loss and gradients equal the HF model called row by row; packed rows equal padded ones; 2 steps of `posttrain sft`
and of GRPO (local backend) on the shapes task. The checks are the tiny-vl tests' own functions, called here on a
Qwen2.5-VL directory (their fixtures resolve `vl_dir` to this module's), so the two families cannot drift apart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw
from transformers import AutoImageProcessor, AutoModelForImageTextToText, Qwen2_5_VLForConditionalGeneration

from posttrain.cli import main
from posttrain.data.batch import Batch
from posttrain.data.tasks.shapes import corpus
from posttrain.models import load_causal_lm, load_processor, make_tiny_model
from posttrain.models.loading import is_vision_language
from posttrain.models.tokenizer import VISION_TOKENS
from posttrain.models.vl import VL_PRESETS, build_tiny_vl_model
from posttrain.rollout.decoder import supports
from tests.engine import test_multimodal as padded_tests
from tests.engine import test_packed_images as packed_tests
from tests.engine.test_multimodal import batch  # noqa: F401  (fixture: SFT rows with 0, 1 and 2 images)
from tests.rollout import test_native_vl as rollout_tests
from tests.rollout.test_native_vl import items  # noqa: F401  (fixture: prompts with 0, 1 and 2 images)
from tests.trainers import test_rl_vl as rl_tests
from tests.trainers import test_sft_vl as sft_tests
from tests.trainers.test_rl_vl import rows_file  # noqa: F401  (fixture: shapes-task prompt rows)
from tests.trainers.test_sft_vl import shapes  # noqa: F401  (fixture: the shapes task's SFT parquet)

PRESET = "tiny-vl-2.5"
DOCUMENTED_PARAMETERS = 666_464  # the count in the vl.py module docstring table


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-vl-2.5 directory; the imported fixtures and test functions read it under this name."""
    return make_tiny_model(PRESET, tmp_path_factory.mktemp("vl25") / "model", corpus(2000), seed=0)


def test_preset_is_a_small_qwen25_vl_with_windowed_vision() -> None:
    ids = {t: 300 + i for i, t in enumerate(VISION_TOKENS)} | {"pad": 0, "eos": 2}
    model = build_tiny_vl_model(PRESET, ids)
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration)
    assert sum(p.numel() for p in model.parameters()) == DOCUMENTED_PARAMETERS
    vision, spec = model.config.vision_config, VL_PRESETS[PRESET]
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size) == (2, 32, spec.hidden_size)
    # one window is 2x2 merged tokens (56 px of 14-px patches, merged 2x2); the last block attends globally
    assert vision.window_size // vision.spatial_merge_size // vision.patch_size == 2
    assert list(vision.fullatt_block_indexes) == [1]
    assert model.config.text_config.hidden_size == VL_PRESETS["tiny-vl"].hidden_size
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight


def test_directory_loads_with_auto_classes_and_the_processor(vl_dir: Path) -> None:
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32)
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration) and model.config.model_type == "qwen2_5_vl"
    assert type(AutoImageProcessor.from_pretrained(vl_dir)).__name__ == "Qwen2VLImageProcessorPil"
    assert is_vision_language(vl_dir) and supports(load_causal_lm(vl_dir))
    processor = load_processor(vl_dir)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )

    def image(color: str) -> Image.Image:
        img = Image.new("RGB", (112, 112), "white")  # 4x4 merged tokens: four attention windows
        ImageDraw.Draw(img).rectangle((5, 5, 60, 60), fill=color)
        return img

    red, green = (
        processor(text=[text], images=[image("red")]),
        processor(text=[text], images=[image("green")]),
    )
    assert red["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert int((red["input_ids"] == model.config.image_token_id).sum()) == 16
    with torch.no_grad():
        last_red, last_green = model(**red).logits[0, -1], model(**green).logits[0, -1]
    assert torch.isfinite(last_red).all() and not torch.allclose(
        last_red, last_green
    )  # the tower is wired in


def test_make_model_command_writes_a_qwen25_vl_directory(tmp_path: Path) -> None:
    out = tmp_path / "m"
    assert main(["make-model", "--preset", PRESET, "--out", str(out), "--corpus-size", "300"]) == 0
    assert (out / "preprocessor_config.json").is_file()
    assert load_causal_lm(out).config.model_type == "qwen2_5_vl"


def test_rollout_greedy_equals_hf_generate(vl_dir: Path, items: list[dict]) -> None:  # noqa: F811
    """The built-in engine decodes image prompts (its own vision module and get_rope_index) as HF `generate`."""
    rollout_tests.test_greedy_equals_hf_generate(vl_dir, items)


def test_rollout_log_probs_match_train_engine(vl_dir: Path, items: list[dict]) -> None:  # noqa: F811
    """Sampled log-probs equal the train engine's recomputation within 1e-4, as for tiny-vl."""
    rollout_tests.test_sampled_log_probs_match_train_engine(vl_dir, items)


def test_train_engine_loss_and_gradients_equal_hf_row_by_row(vl_dir: Path, batch: Batch) -> None:  # noqa: F811
    """Loss and every gradient (the windowed vision tower's included) equal the HF model on each row alone."""
    padded_tests.test_masked_loss_and_gradients_equal_a_per_row_computation(vl_dir, batch)


def test_packed_rows_equal_padded(vl_dir: Path, batch: Batch) -> None:  # noqa: F811
    """Text rows and image rows sharing packed rows: log-probs, loss and gradients as padded."""
    packed_tests.test_packed_sft_equals_padded(vl_dir, batch, "text_and_images")


def test_lora_adapts_the_language_model_only(vl_dir: Path, batch: Batch) -> None:  # noqa: F811
    """LoRA adapts the language model, never the tower's gated MLP (gate/up/down_proj match the default targets)."""
    padded_tests.test_lora_adapts_the_language_model_and_keeps_the_tower_frozen(vl_dir, batch)


def test_sft_two_steps(vl_dir: Path, shapes: dict, tmp_path: Path) -> None:  # noqa: F811
    """`posttrain sft` (packed rows) on the shapes task: 2 finite steps, a vision-language HF directory out."""
    sft_tests.test_vl_sft_with_packed_rows(vl_dir, shapes, tmp_path)
    assert load_causal_lm(tmp_path / "hf").config.model_type == "qwen2_5_vl"


def test_grpo_two_steps(vl_dir: Path, rows_file: Path, tmp_path: Path) -> None:  # noqa: F811
    """`posttrain train` (GRPO, local backend, rl.yaml's defaults: packed rows, shared prompts) on shapes-task
    image prompts: 2 steps, the trainer's log-probs equal the built-in sampler's within 1e-5."""
    rl_tests.test_grpo_steps_on_packed_rows(vl_dir, rows_file, tmp_path, share_prompt=[])
