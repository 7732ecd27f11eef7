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
from posttrain.engine.packed_images import image_labels, packed_image_model
from posttrain.engine.packing import PackedLayout, pack
from posttrain.engine.train_engine import TrainEngine
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


def image_order(layout: PackedLayout) -> list[int]:
    """The micro-batch's rows in the order their first token takes in the packed rows (flattened)."""
    first = layout.flat_pos.masked_fill(layout.flat_pos < 0, layout.input_ids.numel()).min(dim=1).values
    return sorted(range(len(first)), key=lambda r: int(first[r]))


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
    model = packed_image_model(eng.model, b, eng.image_token_id)
    layout = pack(b[keys.INPUT_IDS], b[keys.ATTENTION_MASK], 64)
    model.place(layout.flat_pos[b[keys.ATTENTION_MASK].bool()])
    order = image_order(layout)
    assert order != sorted(order)
    rows = [b[MULTI_MODAL_INPUTS][r] for r in order if b[MULTI_MODAL_INPUTS][r]]
    assert model.placement is not None and model.placement.images is not None
    torch.testing.assert_close(model.placement.images[1], torch.cat([r["image_grid_thw"] for r in rows]))
    torch.testing.assert_close(model.placement.images[0], torch.cat([r["pixel_values"] for r in rows]))
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


def test_an_unplaced_call_is_an_error(vl_dir, batch):  # noqa: F811
    """Called on packed rows it was not told the layout of, the model refuses rather than guess positions."""
    eng = packed(vl_dir)
    b = subset(batch, CASES["one_image"])
    model = packed_image_model(eng.model, b, eng.image_token_id)
    layout = pack(b[keys.INPUT_IDS], b[keys.ATTENTION_MASK], 64)
    with pytest.raises(RuntimeError, match="without being told where"):
        model(input_ids=layout.input_ids, position_ids=layout.position_ids)
    model.place(layout.flat_pos[b[keys.ATTENTION_MASK].bool()])
    other = pack(b[keys.INPUT_IDS], b[keys.ATTENTION_MASK], 1)  # one sequence per packed row
    with pytest.raises(RuntimeError, match="not the one its images"):
        model(input_ids=other.input_ids, position_ids=other.position_ids)


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


def grpo_rows(sft: Batch, prompts: list[int], n: int, seed: int = 0) -> Batch:
    """GRPO-shaped rows: each of `prompts` (rows of `sft`, whole, as the prompt with its images) n times, with
    n different text responses of 1 to 4 tokens; the last group's rows take the first group's prompt tokens
    but their own row's images (same grids: the same tokens over other pixels)."""
    gen = torch.Generator().manual_seed(seed)
    real = [ids[mask.bool()] for ids, mask in zip(sft[keys.INPUT_IDS], sft[keys.ATTENTION_MASK], strict=True)]
    text = sorted({int(t) for r in real for t in r[-6:]})  # the rows' own text tokens (answers, eos)
    width = max(len(real[i]) for i in prompts)
    ids, masks, responses, response_masks, images = [], [], [], [], []
    for i in prompts:
        for _ in range(n):
            prompt = real[i]
            pad = torch.zeros(width - len(prompt), dtype=torch.long)
            ids.append(torch.cat([pad, prompt]))
            masks.append(torch.cat([pad, torch.ones_like(prompt)]))
            length = int(torch.randint(1, 5, (1,), generator=gen))
            picks = torch.randint(len(text), (length,), generator=gen)
            response = torch.zeros(4, dtype=torch.long)
            response[:length] = torch.tensor(text)[picks]
            responses.append(response)
            response_masks.append((torch.arange(4) < length).long())
            images.append(sft[MULTI_MODAL_INPUTS][i])
    prompt_ids, responses_t, response_mask = (
        torch.stack(ids),
        torch.stack(responses),
        torch.stack(response_masks),
    )
    mask = torch.cat([torch.stack(masks), response_mask], 1)
    b = Batch.from_dict(
        {
            keys.INPUT_IDS: torch.cat([prompt_ids, responses_t], 1),
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: (mask.cumsum(1) - 1).clamp(min=0),
            keys.RESPONSES: responses_t,
            keys.RESPONSE_MASK: response_mask.float(),
        }
    )
    b.set(MULTI_MODAL_INPUTS, images)
    b.meta[keys.GLOBAL_TOKENS] = float(response_mask.sum())
    b.meta[keys.GLOBAL_SEQS] = len(b)
    return b


def same_tokens_other_pixels(b: Batch, target: int, source: int, n: int) -> Batch:
    """`b` with the n rows of group `target` given group `source`'s prompt tokens (their own images kept)."""
    ids, mask = b[keys.INPUT_IDS].clone(), b[keys.ATTENTION_MASK].clone()
    width = ids.shape[1] - b[keys.RESPONSES].shape[1]
    ids[target * n : (target + 1) * n, :width] = ids[source * n, :width]
    mask[target * n : (target + 1) * n, :width] = mask[source * n, :width]
    columns = {k: b[k] for k in b.keys() if k != MULTI_MODAL_INPUTS}
    columns |= {
        keys.INPUT_IDS: ids,
        keys.ATTENTION_MASK: mask,
        keys.POSITION_IDS: (mask.cumsum(1) - 1).clamp(min=0),
    }
    out = Batch.from_dict(columns)
    out.set(MULTI_MODAL_INPUTS, list(b[MULTI_MODAL_INPUTS]))
    out.meta.update(b.meta)
    return out


def patches_encoded(eng: TrainEngine) -> list[int]:
    """A record of the image patches each vision-tower call encodes (appended on every forward)."""
    seen: list[int] = []
    visual = next(m for n, m in eng.model.named_modules() if n.endswith("visual"))
    visual.register_forward_hook(lambda module, args, out: seen.append(int(args[0].shape[0])))
    return seen


# GRPO groups over test_multimodal's rows: one image (0, 4, same grids), text only (2), two images (3), and
# group 3 = row 4's 56x56 image under row 0's prompt tokens: equal tokens, other pixels, never shared
GROUPS, N = [0, 2, 3, 4], 3


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prompts_with_images_equal_unshared(vl_dir, batch, attn):  # noqa: F811
    """`share_prompt=true` on image prompts: each group's prompt (its images encoded once, its M-RoPE
    positions) runs once and its responses continue from the prompt's positions; log-probs, entropy, loss and
    every gradient (the trained tower's included) equal the unshared packed pass and the padded one."""
    b = same_tokens_other_pixels(grpo_rows(batch, GROUPS, N), target=3, source=0, n=N)
    prompts = b[keys.INPUT_IDS][:, : -b[keys.RESPONSES].shape[1]]
    assert (
        torch.equal(prompts[0], prompts[3 * N])
        and image_labels(list(b[MULTI_MODAL_INPUTS]))[0] != image_labels(list(b[MULTI_MODAL_INPUTS]))[3 * N]
    )
    kw = {"micro_batch_size": len(b), "attn_implementation": attn}
    shared, unshared = packed(vl_dir, share_prompt=True, **kw), packed(vl_dir, share_prompt=False, **kw)
    padded = engine(vl_dir, **kw)
    encoded_shared, encoded_unshared = patches_encoded(shared), patches_encoded(unshared)
    valid = b[keys.RESPONSE_MASK]
    want = unshared.compute_log_prob(b) * valid
    torch.testing.assert_close(shared.compute_log_prob(b) * valid, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded.compute_log_prob(b) * valid, want, rtol=1e-5, atol=1e-5)
    # one vision pass per distinct prompt: groups 0, 2 and 3 (row 4's pixels) once, not N times each
    one_each = sum(
        int(r["image_grid_thw"].prod(-1).sum()) for r in (batch[MULTI_MODAL_INPUTS][i] for i in GROUPS) if r
    )
    assert encoded_shared == [one_each] and encoded_unshared == [N * one_each]
    m_unshared = unshared.forward_backward(b, rl_loss, with_entropy=True)
    m_shared = shared.forward_backward(b, rl_loss, with_entropy=True)
    assert m_shared["loss"] == pytest.approx(m_unshared["loss"], rel=1e-5)
    assert_same_grads(unshared, shared)


def test_shared_prompts_with_images_across_micro_batches(vl_dir, batch):  # noqa: F811
    """Groups split over micro-batches (by row count and by token budget) still give the unshared log-probs."""
    b = grpo_rows(batch, GROUPS, N, seed=1)
    valid = b[keys.RESPONSE_MASK]
    want = packed(vl_dir, share_prompt=False).compute_log_prob(b) * valid
    for kw in ({"micro_batch_size": 2}, {"micro_batch_size": 5, "pack_row_tokens": 1}, {"max_token_len": 70}):
        got = packed(vl_dir, share_prompt=True, **kw).compute_log_prob(b) * valid
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(kw))


def test_image_labels_tell_pixels_apart():
    """Rows with equal images share a label, rows whose pixels or grids differ do not; text rows share one."""
    a = {"pixel_values": torch.ones(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    same = {"pixel_values": torch.ones(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    other_pixels = {"pixel_values": torch.ones(4, 3) * 2, "image_grid_thw": torch.tensor([[1, 2, 2]])}
    other_grid = {"pixel_values": torch.ones(4, 3), "image_grid_thw": torch.tensor([[1, 4, 1]])}
    assert image_labels([a, {}, same, other_pixels, {}, other_grid]) == (0, 1, 0, 2, 1, 3)


def test_given_targets_with_shared_prefixes_equal_padded(vl_dir, batch):  # noqa: F811
    """The explicit API's layout with `share_prompt=true`: datums that begin alike (image prompts and their
    samples) run the common prefix once, and their log-probs equal padded rows'."""
    b = grpo_rows(batch, GROUPS, N, seed=2)
    b = same_tokens_other_pixels(b, target=3, source=0, n=N)
    api = Batch.from_dict(
        {
            keys.INPUT_IDS: b[keys.INPUT_IDS],
            keys.ATTENTION_MASK: b[keys.ATTENTION_MASK],
            keys.POSITION_IDS: b[keys.POSITION_IDS],
            keys.TARGET_TOKENS: torch.roll(b[keys.INPUT_IDS], -1, dims=1),
        }
    )
    api.set(MULTI_MODAL_INPUTS, list(b[MULTI_MODAL_INPUTS]))
    real = b[keys.ATTENTION_MASK]
    want = engine(vl_dir).compute_log_prob(api) * real
    got = packed(vl_dir, share_prompt=True, micro_batch_size=len(b)).compute_log_prob(api) * real
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def episode_rows(sft: Batch, row: int, n: int, image_token_id: int) -> Batch:
    """Agent-episode-shaped rows: row `row`'s tokens up to the end of its first image as the shared prompt,
    then responses that hold its second image (an observation's, mask 0 in training) and end in n different
    text tokens."""
    real = sft[keys.INPUT_IDS][row][sft[keys.ATTENTION_MASK][row].bool()]
    image = (real == image_token_id).nonzero().reshape(-1).tolist()
    gap = next(i for a, i in zip(image, image[1:], strict=False) if i != a + 1)  # the second image's start
    split = gap - 2  # after the first image, its end token and one text token: inside neither image
    prompt, rest = real[:split], real[split:]
    text = sorted({int(t) for t in real[-6:]})
    responses = torch.stack([torch.cat([rest, torch.tensor([text[k % len(text)]])]) for k in range(n)])
    ids = torch.cat([prompt.expand(n, -1), responses], 1)
    mask = torch.ones_like(ids)
    b = Batch.from_dict(
        {
            keys.INPUT_IDS: ids,
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: (mask.cumsum(1) - 1).clamp(min=0),
            keys.RESPONSES: responses,
            keys.RESPONSE_MASK: (responses != image_token_id).float(),
        }
    )
    b.set(MULTI_MODAL_INPUTS, [sft[MULTI_MODAL_INPUTS][row]] * n)
    b.meta[keys.GLOBAL_TOKENS] = float(b[keys.RESPONSE_MASK].sum())
    b.meta[keys.GLOBAL_SEQS] = n
    return b


def test_shared_prompt_with_an_image_in_the_responses(vl_dir, batch):  # noqa: F811
    """Responses that hold an image (agent episodes: a later observation's) after a shared image prompt: the
    prompt's image is encoded once, each response's image with it, and the results equal the unshared ones."""
    kw = {"micro_batch_size": N, "pack_row_tokens": 256}  # a prompt and its 3 responses fit one packed row
    shared, unshared = packed(vl_dir, share_prompt=True, **kw), packed(vl_dir, share_prompt=False, **kw)
    b = episode_rows(batch, 3, N, shared.image_token_id)
    encoded = patches_encoded(shared)
    valid = b[keys.RESPONSE_MASK]
    want = unshared.compute_log_prob(b) * valid
    torch.testing.assert_close(shared.compute_log_prob(b) * valid, want, rtol=1e-5, atol=1e-5)
    first, second = batch[MULTI_MODAL_INPUTS][3]["image_grid_thw"].prod(-1).tolist()
    assert encoded == [first + N * second]
    m_unshared = unshared.forward_backward(b, rl_loss, with_entropy=True)
    m_shared = shared.forward_backward(b, rl_loss, with_entropy=True)
    assert m_shared["loss"] == pytest.approx(m_unshared["loss"], rel=1e-5)
    assert_same_grads(unshared, shared)
