"""Tests for posttrain/engine/packed_images.py: packed rows (`remove_padding=true`) of a vision-language model equal
padded ones (tiny Qwen2-VL): per-token log-probs, entropy, loss and every gradient (the trained vision tower's
included), for rows with one image, several images, and text-only rows mixed with image rows, in packed rows
whose order differs from the micro-batch's. The rows and the padded engine are test_multimodal's."""

from __future__ import annotations

import pytest
import torch

from posttrain.config.schema import LoraConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.mm_dataset import MULTI_MODAL_INPUTS
from posttrain.engine.packed_images import image_order, packed_image_model
from posttrain.engine.packing import pack
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError
from posttrain.workers.losses import LossSpec, build_loss
from tests.engine.test_multimodal import batch, engine, full, vl_dir  # noqa: F401  (fixtures)

# rows of test_multimodal's batch: 0, 1, 4 one image each (4 or 8 image tokens), 2 none, 3 two images
CASES = {"one_image": [0, 1, 4], "several_images": [3, 0, 3], "text_and_images": [2, 0, 3, 2, 1, 4]}
RESPONSE = 3  # RL-shaped rows: the last 3 real tokens of each row are its response


def subset(batch: Batch, rows: list[int]) -> Batch:  # noqa: F811
    b = batch.index(rows)
    b.meta[keys.GLOBAL_TOKENS] = float(b[keys.LOSS_MASK].sum())
    b.meta[keys.GLOBAL_SEQS] = len(b)
    return b


def rl_rows(sft: Batch) -> Batch:
    """The rows as the RL passes see them: [left-padded prompt | right-padded response], images in the prompt."""
    real = [ids[mask.bool()] for ids, mask in zip(sft[keys.INPUT_IDS], sft[keys.ATTENTION_MASK], strict=True)]
    width = max(len(r) for r in real) - RESPONSE
    prompts = torch.zeros((len(real), width), dtype=torch.long)
    prompt_mask = torch.zeros_like(prompts)
    for i, r in enumerate(real):
        n = len(r) - RESPONSE
        prompts[i, width - n :], prompt_mask[i, width - n :] = r[:n], 1
    responses = torch.stack([r[-RESPONSE:] for r in real])
    response_mask = torch.ones_like(responses)
    response_mask[::2, -1] = 0  # every other response one token shorter (right padding)
    responses = responses * response_mask
    mask = torch.cat([prompt_mask, response_mask], 1)
    b = Batch.from_dict(
        {
            keys.INPUT_IDS: torch.cat([prompts, responses], 1),
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: (mask.cumsum(1) - 1).clamp(min=0),
            keys.RESPONSES: responses,
            keys.RESPONSE_MASK: response_mask.float(),
        }
    )
    b.set(MULTI_MODAL_INPUTS, list(sft[MULTI_MODAL_INPUTS]))
    return b


def rl_loss(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: Batch) -> tuple[torch.Tensor, dict]:
    """A loss on the response tokens through both outputs: sum of log-probs plus a tenth of the entropy."""
    assert entropy is not None
    mask = mb[keys.RESPONSE_MASK]
    loss = -((log_probs + 0.1 * entropy) * mask).sum() / 10.0
    return loss, {}


def packed(vl_dir, **kw) -> TrainEngine:  # noqa: F811
    """The packed engine: test_multimodal's engine with `remove_padding=true`, rows of `pack_row_tokens` tokens."""
    return engine(vl_dir, remove_padding=True, **{"pack_row_tokens": 64, **kw})


def grads(eng: TrainEngine) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in eng.model.named_parameters() if p.grad is not None}


def assert_same_grads(a: TrainEngine, b: TrainEngine) -> None:
    ga, gb = grads(a), grads(b)
    assert ga.keys() == gb.keys() and any(".visual." in f".{n}" for n in ga)  # the tower trains
    for name, g in ga.items():
        torch.testing.assert_close(gb[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_sft_equals_padded(vl_dir, batch, case):  # noqa: F811
    """The SFT pass (log-probs of every next token): log-probs, loss and every gradient as padded, with several
    sequences per packed row and packed rows whose order differs from the batch's."""
    b = subset(batch, CASES[case])
    padded_engine, packed_engine = engine(vl_dir, micro_batch_size=4), packed(vl_dir, micro_batch_size=4)
    layout = pack(b[keys.INPUT_IDS][:4], b[keys.ATTENTION_MASK][:4], 64)
    if case == "text_and_images":  # several sequences share a packed row, taken out of the batch's order
        assert layout.input_ids.shape[0] < 4 and image_order(layout) != sorted(image_order(layout))
    real = b[keys.ATTENTION_MASK]
    want = padded_engine.compute_log_prob(b) * real
    got = packed_engine.compute_log_prob(b) * real
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    loss = build_loss(LossSpec("cross_entropy"), 1)
    m_padded = padded_engine.forward_backward(b, loss)
    m_packed = packed_engine.forward_backward(b, loss)
    assert m_packed["loss"] == pytest.approx(m_padded["loss"], rel=1e-5)
    assert_same_grads(padded_engine, packed_engine)


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_rl_pass_equals_padded(vl_dir, batch, case):  # noqa: F811
    """The RL passes (response log-probs and entropy of [left-padded prompt | response] rows): as padded."""
    b = rl_rows(batch.index(CASES[case]))
    padded_engine, packed_engine = engine(vl_dir, micro_batch_size=4), packed(vl_dir, micro_batch_size=4)
    valid = b[keys.RESPONSE_MASK]
    torch.testing.assert_close(
        packed_engine.compute_log_prob(b) * valid,
        padded_engine.compute_log_prob(b) * valid,
        rtol=1e-5,
        atol=1e-5,
    )
    m_padded = padded_engine.forward_backward(b, rl_loss, with_entropy=True)
    m_packed = packed_engine.forward_backward(b, rl_loss, with_entropy=True)
    assert m_packed["loss"] == pytest.approx(m_padded["loss"], rel=1e-5)
    assert_same_grads(padded_engine, packed_engine)


def test_micro_batches_and_row_width_do_not_change_packed_results(vl_dir, batch):  # noqa: F811
    """Rows are the unit of micro-batching (a row's images go with it) and any packed row width gives the same
    log-probs: one sequence per packed row, a few, or all in one; by row count or by token budget."""
    b = subset(batch, CASES["text_and_images"])
    real = b[keys.ATTENTION_MASK]
    want = engine(vl_dir).compute_log_prob(b) * real
    for kw in ({"micro_batch_size": 1}, {"micro_batch_size": 3, "pack_row_tokens": 1}, {"max_token_len": 70}):
        eng = packed(vl_dir, **kw)
        torch.testing.assert_close(eng.compute_log_prob(b) * real, want, rtol=1e-5, atol=1e-5, msg=str(kw))
    eng = packed(vl_dir, pack_row_tokens=256)
    order = [4, 1, 0, 5, 3, 2]
    torch.testing.assert_close(
        eng.compute_log_prob(b.index(order)) * real[order], want[order], rtol=1e-5, atol=1e-5
    )


def test_images_follow_the_packed_order(vl_dir, batch):  # noqa: F811
    """The packed model gets the rows' images in the order their tokens take in the packed rows, and every real
    token's M-RoPE positions: an image token's are its grid coordinates, not its column."""
    eng = packed(vl_dir)
    b = subset(batch, CASES["text_and_images"])
    model = packed_image_model(eng.model, b, eng.image_token_id, 64, eng.device)
    order = image_order(model.layout)
    rows = [b[MULTI_MODAL_INPUTS][r] for r in order if b[MULTI_MODAL_INPUTS][r]]
    assert model.images is not None
    torch.testing.assert_close(model.images[1], torch.cat([r["image_grid_thw"] for r in rows]))
    torch.testing.assert_close(model.images[0], torch.cat([r["pixel_values"] for r in rows]))
    text_rows = [i for i in range(len(b)) if not b[MULTI_MODAL_INPUTS][i]]
    lengths = b[keys.ATTENTION_MASK].sum(1).tolist()
    starts = [sum(lengths[:i]) for i in range(len(b))]
    cells = model.cell_positions
    for r in range(len(b)):
        own = cells[:, starts[r] : starts[r] + lengths[r]]
        if r in text_rows:
            assert torch.equal(own, torch.arange(lengths[r]).expand(3, -1))
        else:  # an image's tokens share a temporal position; text after it continues past its largest one
            assert not torch.equal(own[1], own[2]) and int(own.max()) < lengths[r] - 1


def test_shared_prompts_stay_refused(vl_dir, batch):  # noqa: F811
    """Shared-prompt packing lays rows out without their images' positions: refused, never approximated."""
    eng = engine(vl_dir, remove_padding=True, share_prompt=True)
    with pytest.raises(ConfigError, match="model.share_prompt=true is not supported for a vision-language"):
        eng.compute_log_prob(batch)


def test_vision_tower_attends_whole_images_under_packing(vl_dir):  # noqa: F811
    """The language model attends per packed segment; the vision tower keeps sdpa (patches attend both ways)."""
    eng = packed(vl_dir)
    config = eng.model.config
    assert config.text_config._attn_implementation == "posttrain_varlen"
    assert config.vision_config._attn_implementation == "sdpa"


def test_eager_packed_equals_padded(vl_dir, batch):  # noqa: F811
    """Under eager attention packed rows get the block-diagonal mask from the text position ids."""
    b = subset(batch, CASES["text_and_images"])
    real = b[keys.ATTENTION_MASK]
    want = engine(vl_dir, attn_implementation="eager").compute_log_prob(b) * real
    eng = packed(vl_dir, attn_implementation="eager")
    assert eng.model.config.text_config._attn_implementation == "eager"
    torch.testing.assert_close(eng.compute_log_prob(b) * real, want, rtol=1e-5, atol=1e-5)


def test_lora_packed_equals_padded(vl_dir, batch):  # noqa: F811
    """LoRA (peft-wrapped model, frozen tower): the adapters' gradients and the base model's log-probs (the
    reference pass, adapter disabled) are those of padded rows."""
    b = subset(batch, CASES["text_and_images"])
    lora = LoraConfig(rank=4)
    torch.manual_seed(0)  # each engine draws its adapters: the same draw for both
    padded_engine = engine(vl_dir, lora=lora)
    torch.manual_seed(0)
    packed_engine = packed(vl_dir, lora=lora)
    real = b[keys.ATTENTION_MASK]
    torch.testing.assert_close(
        packed_engine.compute_log_prob(b, disable_adapter=True) * real,
        padded_engine.compute_log_prob(b, disable_adapter=True) * real,
        rtol=1e-5,
        atol=1e-5,
    )
    loss = build_loss(LossSpec("cross_entropy"), 1)
    padded_engine.forward_backward(b, loss)
    packed_engine.forward_backward(b, loss)
    ga, gb = grads(padded_engine), grads(packed_engine)
    assert ga.keys() == gb.keys() and all("lora_" in n for n in ga)
    for name, g in ga.items():
        torch.testing.assert_close(gb[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_given_targets_packed_equal_padded(vl_dir, batch):  # noqa: F811
    """The explicit API's layout (a target per position) on packed rows with images: as padded."""
    b = subset(batch, CASES["text_and_images"])
    targets = torch.roll(b[keys.INPUT_IDS], -1, dims=1)
    api = Batch.from_dict(
        {
            keys.INPUT_IDS: b[keys.INPUT_IDS],
            keys.ATTENTION_MASK: b[keys.ATTENTION_MASK],
            keys.POSITION_IDS: b[keys.POSITION_IDS],
            keys.TARGET_TOKENS: targets,
        }
    )
    api.set(MULTI_MODAL_INPUTS, list(b[MULTI_MODAL_INPUTS]))
    real = b[keys.ATTENTION_MASK]
    want = engine(vl_dir).compute_log_prob(api) * real
    torch.testing.assert_close(packed(vl_dir).compute_log_prob(api) * real, want, rtol=1e-5, atol=1e-5)
