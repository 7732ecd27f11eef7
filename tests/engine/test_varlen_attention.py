"""Per-segment packed attention (`posttrain_varlen`): the same numbers as the masked path, no L x L tensor."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from posttrain.config.schema import OptimConfig
from posttrain.data import keys
from posttrain.engine import varlen_attention
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.packing import PackingOptions, pack, packed_model_output, packed_response_log_probs
from posttrain.engine.shared_prompt import pack_shared_prompts
from posttrain.engine.train_engine import TrainEngine
from posttrain.engine.varlen_attention import (
    SEGMENTS_KWARG,
    VARLEN,
    Run,
    Segments,
    check_varlen_support,
    padded_length,
    segments_from_position_ids,
    uses_varlen,
)
from posttrain.errors import ConfigError
from posttrain.models import build_tiny_model, load_causal_lm

from .helpers import grouped_rl_batch, synthetic_rl_batch


@pytest.fixture(params=["grouped", "dense"])
def attention_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a plan attends, forced: per group of runs, or one call over the rows with their mask."""
    if request.param == "grouped":
        monkeypatch.setattr(varlen_attention, "DENSE_MAX_CELLS", 0)
    else:
        monkeypatch.setattr(varlen_attention, "GROUP_PRICE_CELLS", 1 << 40)
    return request.param


def assert_plan_path(segments: Segments, width: int, path: str) -> None:
    plan = segments.plan(width, torch.device("cpu"), 4 * 32)  # the tiny preset: 4 heads of 32
    assert (plan.dense_mask is not None) == (path == "dense")


def models(dtype: torch.dtype = torch.float64) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tiny preset (4 query heads over 2 key/value heads: grouped-query attention) under sdpa and
    under posttrain_varlen, with the same weights."""
    masked = build_tiny_model("tiny", seed=1).to(dtype)
    varlen = copy.deepcopy(masked)
    varlen.set_attn_implementation(VARLEN)
    assert masked.config.num_key_value_heads < masked.config.num_attention_heads
    assert uses_varlen(varlen) and not uses_varlen(masked)
    return masked, varlen


def outputs_and_grads(
    model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logits = packed_model_output(model, ids, pos, **kwargs)
    (torch.log_softmax(logits, -1) * weights).sum().backward()
    return logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def assert_shared_layout_equals_its_mask(masked: torch.nn.Module, varlen: torch.nn.Module, shared) -> None:
    """A shared-prompt layout through posttrain_varlen has the masked path's logits and gradients (float64)."""
    weights = torch.randn((shared.input_ids.numel(), masked.config.vocab_size), dtype=torch.float64)
    ids, pos = shared.input_ids, shared.position_ids
    ref, ref_grads = outputs_and_grads(masked, ids, pos, weights, attention_mask=shared.attention_mask)
    out, grads = outputs_and_grads(varlen, ids, pos, weights, segments=shared.segments)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(grads, ref_grads, atol=1e-10, rtol=1e-9)


def test_segments_from_position_ids_restart_at_every_sequence() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]])
    segments = segments_from_position_ids(pos)
    assert segments.rows == ((Run(0, 3), Run(3, 4), Run(4, 6)), (Run(0, 6),))
    assert segments.lengths == [3, 1, 2, 6]
    assert segments.cu_seqlens(6).tolist() == [0, 3, 4, 6, 12]
    mask = segments.attention_mask(6)[0, 0]
    assert mask[5].tolist() == [False, False, False, False, True, True]
    assert mask[2].tolist() == [True, True, True, False, False, False]


def test_packed_logits_and_gradients_equal_the_masked_path_in_float64(attention_path: str) -> None:
    masked, varlen = models(torch.float64)
    batch = synthetic_rl_batch(rows=14, prompt_width=9, response_width=7, vocab=1000, seed=11)
    layout = pack(batch[keys.INPUT_IDS], batch[keys.ATTENTION_MASK], row_tokens=48)
    assert layout.input_ids.shape[0] > 1  # several packed rows of several sequences each
    segments = segments_from_position_ids(layout.position_ids)
    assert_plan_path(segments, layout.input_ids.shape[1], attention_path)
    weights = torch.randn((layout.input_ids.numel(), masked.config.vocab_size), dtype=torch.float64)
    ref, ref_grads = outputs_and_grads(masked, layout.input_ids, layout.position_ids, weights)
    out, grads = outputs_and_grads(varlen, layout.input_ids, layout.position_ids, weights)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(grads, ref_grads, atol=1e-10, rtol=1e-9)


def test_shared_prompt_layout_equals_its_explicit_mask_in_float64(attention_path: str) -> None:
    masked, varlen = models(torch.float64)
    batch = grouped_rl_batch(prompts=3, n=4, seed=7)
    shared = pack_shared_prompts(batch[keys.INPUT_IDS], batch[keys.ATTENTION_MASK], 7, row_tokens=40)
    assert any(run.context_end > run.context_start for runs in shared.segments.rows for run in runs)
    assert_plan_path(shared.segments, shared.input_ids.shape[1], attention_path)
    assert_shared_layout_equals_its_mask(masked, varlen, shared)


def test_segments_pass_through_fsdp_input_casting_with_their_plans() -> None:
    """FSDP2's mixed precision rebuilds every dataclass among a layer's kwargs (dataclasses.replace): a
    Segments must pass through as itself, or its plan would be recomputed at every layer."""
    from torch.distributed.utils import _apply_to_tensors

    segments = Segments(((Run(0, 3), Run(3, 5, 0, 3)),))
    plan = segments.plan(5, torch.device("cpu"))
    cast = _apply_to_tensors(lambda t: t.to(torch.bfloat16), {SEGMENTS_KWARG: segments, "x": torch.ones(2)})
    assert cast[SEGMENTS_KWARG] is segments and cast["x"].dtype == torch.bfloat16
    assert segments.plan(5, torch.device("cpu")) is plan
    assert segments == Segments(((Run(0, 3), Run(3, 5, 0, 3)),))


def test_short_rows_take_one_dense_call_and_long_rows_their_groups() -> None:
    """The default choice (no path forced): rows of 8-token responses behind shared prompts, as in RL on
    short answers, cost less as one masked call; rows of long sequences keep their groups and no L x L mask.
    Each equals the masked path either way (the tests above force each path)."""
    short = Segments(
        tuple(
            (Run(0, 26), *(Run(26 + 5 * i, 31 + 5 * i, 0, 26) for i in range(8)), Run(66, 128))
            for _ in range(3)
        )
    )
    plan = short.plan(128, torch.device("cpu"), 128)
    assert plan.dense_mask is not None and plan.dense_mask.shape == (3, 1, 128, 128)
    assert torch.equal(plan.dense_mask, short.attention_mask(128))
    long = Segments(((Run(0, 512), Run(512, 1024)),))
    assert long.plan(1024, torch.device("cpu"), 128).dense_mask is None  # 1M cells against 2 x 262k
    assert short.plan(128, torch.device("meta"), 128).dense_mask is None  # not measured off the CPU
    big_heads = short.plan(128, torch.device("cpu"), 14 * 64)  # a cell's work grows with the heads
    assert big_heads.dense_mask is None


def test_padded_length_buckets() -> None:
    assert [padded_length(n) for n in (1, 8, 9, 10, 15, 16, 17, 33, 70, 100, 128)] == [
        1, 8, 10, 10, 16, 16, 20, 40, 80, 112, 128
    ]  # fmt: skip
    assert all(n <= padded_length(n) < 1.25 * n + 1 for n in range(1, 600))


def test_runs_of_scattered_lengths_share_calls_and_equal_the_masked_path_in_float64(
    attention_path: str,
) -> None:
    """Long responses of many lengths (and shared prompts of several lengths, so contexts are padded
    too): attended in a few padded SDPA calls, with the masked path's logits and gradients."""
    masked, varlen = models(torch.float64)
    batch = grouped_rl_batch(prompts=4, n=6, prompt_width=30, response_width=60, seed=3)
    shared = pack_shared_prompts(batch[keys.INPUT_IDS], batch[keys.ATTENTION_MASK], 60, row_tokens=400)
    runs = [run for row in shared.segments.rows for run in row]
    lengths = {run.end - run.start for run in runs}
    contexts = {run.context_end - run.context_start for run in runs} - {0}
    plan = shared.segments.plan(shared.input_ids.shape[1], torch.device("cpu"))
    assert len(lengths) >= 15 and len(contexts) >= 2
    assert len(plan.groups) < len(lengths)  # padded into shared calls
    assert any(group.keep is not None for group in plan.groups)
    assert any(group.mask is not None and group.mask.dim() == 4 for group in plan.groups)  # padded context
    assert_plan_path(shared.segments, shared.input_ids.shape[1], attention_path)
    assert_shared_layout_equals_its_mask(masked, varlen, shared)


@pytest.mark.parametrize("share_prompt", [False, True])
def test_float32_log_probs_and_entropy_equal_the_masked_path(
    tiny_model_dir: Path, share_prompt: bool
) -> None:
    masked = load_causal_lm(tiny_model_dir, attn_implementation="sdpa")
    varlen = load_causal_lm(tiny_model_dir, attn_implementation=VARLEN)
    batch = grouped_rl_batch(prompts=3, n=4, seed=9)
    ids, mask = batch[keys.INPUT_IDS], batch[keys.ATTENTION_MASK]
    options = PackingOptions(64, share_prompt)
    ref, ref_ent = packed_response_log_probs(masked, ids, mask, 7, options, 0.7, with_entropy=True)
    out, ent = packed_response_log_probs(varlen, ids, mask, 7, options, 0.7, with_entropy=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)


class ShapeRecorder(TorchDispatchMode):
    """Every tensor an op creates: its shape (the L x L mask would be one)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_no_tensor_grows_with_the_row_squared() -> None:
    masked, varlen = models(torch.float32)
    width, seq = 512, 64  # one row of 8 sequences of 64 tokens
    ids = torch.randint(3, 1000, (1, width), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(seq).repeat(width // seq)[None]
    keep = torch.tensor([width - 1])

    def squared(model: torch.nn.Module) -> list[tuple[int, ...]]:
        with ShapeRecorder() as recorder:
            packed_model_output(model, ids, pos, keep=keep).sum().backward()
        return [s for s in recorder.shapes if sum(d >= width for d in s) >= 2]

    assert squared(masked)  # the block-diagonal mask (and sdpa's copy of it)
    assert squared(varlen) == []


def test_errors_instead_of_a_silent_fallback() -> None:
    _, varlen = models(torch.float32)
    ids, pos = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[0, 1, 0, 1]])
    with pytest.raises(RuntimeError, match="needs the segments of the packed rows"):
        varlen(input_ids=ids, position_ids=pos, use_cache=False)
    with pytest.raises(RuntimeError, match="do not tile"):
        varlen(
            input_ids=ids, position_ids=pos, use_cache=False, **{SEGMENTS_KWARG: Segments(((Run(0, 3),),))}
        )
    with pytest.raises(ValueError, match="not as a mask"):
        packed_model_output(varlen, ids, pos, attention_mask=torch.ones((1, 1, 4, 4), dtype=torch.bool))

    class OwnAttention(type(varlen)):
        _supports_attention_backend = False

    with pytest.raises(ConfigError, match="not through transformers' AttentionInterface"):
        check_varlen_support(OwnAttention(varlen.config))
    sliding = copy.deepcopy(varlen.config)
    sliding.use_sliding_window, sliding.sliding_window = True, 64
    sliding.layer_types = ["sliding_attention"] * sliding.num_hidden_layers
    with pytest.raises(ConfigError, match="sliding window of 64 tokens.*model.remove_padding=false"):
        check_varlen_support(type(varlen)(sliding))


def test_the_engine_attends_per_segment_under_sdpa_only(tiny_model_dir: Path) -> None:
    config = EngineConfig(model_path=str(tiny_model_dir), optim=OptimConfig(lr=1e-3))
    assert TrainEngine(config).model.config._attn_implementation == VARLEN
    eager = TrainEngine(replace(config, attn_implementation="eager"))
    assert eager.model.config._attn_implementation == "eager"
    padded = TrainEngine(replace(config, remove_padding=False, share_prompt=False))
    assert padded.model.config._attn_implementation == "sdpa"


@pytest.mark.slow
def test_a_32k_packed_row_equals_its_sequences_run_alone() -> None:
    """The long-context preset's full window: a 32768-token packed row of 11 sequences attends per segment
    and gives each sequence's own logits and gradients, without a 32k x 32k mask."""
    masked = build_tiny_model("tiny-32k", seed=0)
    varlen = copy.deepcopy(masked)
    varlen.set_attn_implementation(VARLEN)
    lengths = [4096] * 7 + [2048, 1024, 512, 512]
    ids = torch.randint(3, 1000, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    weights = torch.randn((1, sum(lengths)), generator=torch.Generator().manual_seed(1))

    def loss(logits: torch.Tensor, targets: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0] * w).sum()

    targets = ids.roll(-1, 1)[0]
    with ShapeRecorder() as recorder:
        logits = packed_model_output(varlen, ids, pos)
        loss(logits, targets, weights[0]).backward()
    assert not [s for s in recorder.shapes if sum(d >= 8192 for d in s) >= 2]
    grads = torch.cat([p.grad.flatten() for p in varlen.parameters()])
    start, ref_logits = 0, []
    for n in lengths:  # each sequence alone: plain causal attention, no packing, no mask
        piece = slice(start, start + n)
        out = masked(input_ids=ids[:, piece], use_cache=False).logits[0]
        loss(out, targets[piece], weights[0, piece]).backward()
        ref_logits.append(out.detach())
        start += n
    ref_grads = torch.cat([p.grad.flatten() for p in masked.parameters()])
    torch.testing.assert_close(logits.detach(), torch.cat(ref_logits), atol=1e-4, rtol=0)
    torch.testing.assert_close(grads, ref_grads, atol=1e-4, rtol=1e-3)
