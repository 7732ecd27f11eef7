"""A model with a sliding attention window (Mistral's `sliding_window`): the built-in engine attends to the
whole context, which is the same attention for requests within the window, so it takes those (greedy equals
HF generate) and refuses longer ones naming the window, instead of sampling from another model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config

from posttrain.models import load_tokenizer
from posttrain.models.attention import sliding_window
from posttrain.rollout.base import GenerationRequest, SamplingParams
from posttrain.rollout.native import NativeRolloutEngine

from .test_native import prompts
from .test_native_moe import greedy_matches_hf

WINDOW = 48


@pytest.fixture(scope="module")
def mistral_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = load_tokenizer(tiny_model_dir)
    config = MistralConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, sliding_window=WINDOW, tie_word_embeddings=False,
        bos_token_id=tokenizer.pad_token_id, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("models") / "mistral-sw"
    MistralForCausalLM(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_requests_within_the_window_equal_hf_and_longer_ones_are_refused(mistral_dir: Path) -> None:
    engine = NativeRolloutEngine(str(mistral_dir), seed=0)
    assert engine.window == WINDOW
    longest = max(len(p) for p in prompts(mistral_dir))
    assert longest + 8 <= WINDOW
    greedy_matches_hf(engine, mistral_dir, max_tokens=8)
    over = GenerationRequest(prompts(mistral_dir)[0], SamplingParams(max_tokens=WINDOW, temperature=0.0))
    (result,) = engine.generate_requests([over])
    assert result.stop_reason == "error" and f"sliding attention window of {WINDOW}" in str(result.error)


def test_which_configs_have_a_window() -> None:
    assert sliding_window(MistralConfig(sliding_window=4096)) == 4096
    assert sliding_window(MistralConfig(sliding_window=None)) is None
    assert sliding_window(Qwen2Config(sliding_window=4096)) is None  # use_sliding_window is off
    assert sliding_window(Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0)) == 64
    # Phi-3.5/Phi-4-mini: a window wider than the context is none
    assert sliding_window(MistralConfig(sliding_window=262144, max_position_embeddings=131072)) is None


def test_training_engines_keep_the_window_on_sequences_longer_than_it(
    mistral_dir: Path, tmp_path: Path
) -> None:
    """Packed rows: shared-prompt layouts and sdpa's varlen attention would attend past the window (log-probs
    off by nats, no error): refused, naming the settings that work; plain packing under eager and the
    explicit API (padded rows on such a model) equal a plain transformers forward."""
    from posttrain import client as tinker
    from posttrain.client import types
    from posttrain.config.schema import OptimConfig
    from posttrain.data import keys
    from posttrain.data.batch import Batch
    from posttrain.engine.engine_config import EngineConfig
    from posttrain.engine.train_engine import TrainEngine
    from posttrain.errors import ConfigError

    def engine(**settings: object) -> TrainEngine:
        config = EngineConfig(model_path=str(mistral_dir), optim=OptimConfig(lr=1e-3), **settings)  # type: ignore[arg-type]
        return TrainEngine(config)

    with pytest.raises(ConfigError, match="sliding window of 48 tokens.*model.share_prompt=false"):
        engine(attn_implementation="eager", remove_padding=True, share_prompt=True)
    with pytest.raises(ConfigError, match="sliding window of 48 tokens.*model.remove_padding=false"):
        engine(attn_implementation="sdpa", remove_padding=True, share_prompt=False)

    torch.manual_seed(1)
    prompt = torch.randint(5, 900, (70,)).tolist()  # longer than the window, shared by two responses
    rows = [prompt + torch.randint(5, 900, (10,)).tolist(), prompt + torch.randint(5, 900, (14,)).tolist()]
    reference = MistralForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for row in rows:
            logits = reference(torch.tensor([row])).logits[0, :-1].float()
            want.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(row[1:])[:, None])[:, 0])

    packed = engine(attn_implementation="eager", remove_padding=True, share_prompt=False)
    width = max(map(len, rows))
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    responses = 20
    batch = Batch.from_dict(
        {
            keys.INPUT_IDS: ids,
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: (mask.cumsum(1) - 1).clamp(min=0),
            keys.RESPONSES: torch.stack([ids[i, len(prompt) : len(prompt) + responses] for i in range(2)]),
            keys.RESPONSE_MASK: torch.stack(
                [mask[i, len(prompt) : len(prompt) + responses] for i in range(2)]
            ).float(),
        }
    )
    got = packed.compute_log_prob(batch)
    for i, row in enumerate(rows):
        n = len(row) - len(prompt)
        torch.testing.assert_close(got[i, :n], want[i][len(prompt) - 1 :], atol=1e-5, rtol=0)

    with tinker.ServiceClient(backend="local", root_dir=tmp_path) as service:
        tc = service.create_lora_training_client(str(mistral_dir), rank=2)
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(row[:-1]),
                loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * (len(row) - 1)},
            )
            for row in rows
        ]
        out = tc.forward(data, "cross_entropy").result()
        for i, output in enumerate(out.loss_fn_outputs):
            torch.testing.assert_close(output["logprobs"].to_torch(), want[i], atol=1e-5, rtol=0)
