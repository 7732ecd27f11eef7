"""The tiny-model factory: a real Qwen2 architecture at toy sizes, with a locally trained tokenizer.

It writes an ordinary Hugging Face directory, so tests and CPU experiments run the same loading,
training and rollout code as a real Qwen2.5 checkpoint. Nothing is downloaded.
Must not import posttrain.data or anything above models/.

True parameter counts (tied embeddings; checked by tests/models/test_tiny.py):

| preset    | hidden | mlp  | layers | heads/kv | vocab | max pos | rope theta | parameters |
|-----------|--------|------|--------|----------|-------|---------|------------|------------|
| tiny      | 128    | 448  | 4      | 4/2      | 1024  | 1024    | 10,000     | 1,017,984  |
| small     | 256    | 768  | 12     | 4/2      | 4096  | 2048    | 10,000     | 10,498,304 |
| medium    | 512    | 1536 | 15     | 8/2      | 8192  | 4096    | 10,000     | 49,441,536 |
| tiny-32k  | 128    | 448  | 4      | 4/2      | 1024  | 32768   | 1,000,000  | 1,017,984  |
| small-32k | 256    | 768  | 12     | 4/2      | 4096  | 32768   | 1,000,000  | 10,498,304 |
| tiny-moe  | 128    | 4x128+64 | 4    | 4/2      | 1024  | 1024    | 10,000     | 1,217,152  |

The `-32k` presets are the long-context ones: 32k positions and the rotary base Qwen2.5 uses at that
context, 1e6. With the default 1e4 the slowest rotary frequency of a 32-dim head turns ~5.8 rad (almost a
full cycle) over 32k positions, so far-apart positions start to look alike; with 1e6 it turns ~0.08 rad.
The rollout engines take their context limit from `max_position_embeddings`, so with these presets a
request beyond 32768 tokens is an error naming that limit. `posttrain make-model --preset small-32k`.

`tiny-moe` is a Qwen2-MoE (`Qwen2MoeForCausalLM`): every decoder layer's MLP is a sparse block of 4 experts
(intermediate 128 each, stored as fused 3-D parameters), top-2 routing, plus a shared expert (intermediate 64)
behind a sigmoid gate; the router's load-balancing coefficient is Qwen's 0.001. Its mlp column reads
experts x expert width + shared width. Same tokenizer training and token ids as `tiny`.
"""

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from posttrain.errors import ConfigError
from posttrain.models.loading import load_tokenizer
from posttrain.models.tokenizer import IM_END, PAD_TOKEN, train_tokenizer
from posttrain.models.vl import VL_PRESETS, make_tiny_vl_model


@dataclass(frozen=True)
class TinyPreset:
    """Sizes of a Qwen2 model; `vocab_size` is also the tokenizer's training target."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0  # the rotary base; long contexts want a larger one


@dataclass(frozen=True)
class MoePreset(TinyPreset):
    """Sizes of a Qwen2-MoE model: `intermediate_size` is unused (every layer is sparse)."""

    num_experts: int = 4
    num_experts_per_tok: int = 2  # top-k routing
    moe_intermediate_size: int = 128  # each routed expert's MLP width
    shared_expert_intermediate_size: int = 64  # the always-on shared expert's MLP width
    router_aux_loss_coef: float = 0.001  # the load-balancing loss weight the config carries (Qwen's)


PRESETS: dict[str, TinyPreset] = {
    "tiny": TinyPreset(
        hidden_size=128,
        intermediate_size=448,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=1024,
    ),
    "small": TinyPreset(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=2048,
    ),
    "medium": TinyPreset(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=15,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=8192,
        max_position_embeddings=4096,
    ),
}
# long context: the same sizes, 32k positions and a larger rotary base (Qwen2.5's 1e6 for 32k)
PRESETS["tiny-32k"] = dataclasses.replace(PRESETS["tiny"], max_position_embeddings=32768, rope_theta=1e6)
PRESETS["small-32k"] = dataclasses.replace(PRESETS["small"], max_position_embeddings=32768, rope_theta=1e6)
# mixture of experts: tiny's attention and vocabulary, a sparse MLP block in every layer
PRESETS["tiny-moe"] = MoePreset(
    hidden_size=128,
    intermediate_size=448,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=1024,
)


def get_preset(name: str) -> TinyPreset:
    """Look up a preset by name; an unknown name raises ConfigError with the valid names."""
    if name not in PRESETS:
        names = ", ".join([*PRESETS, *VL_PRESETS])
        raise ConfigError(f"unknown tiny-model preset {name!r}; valid presets: {names}")
    return PRESETS[name]


def make_config(preset: TinyPreset, **token_ids: int | None) -> Qwen2Config | Qwen2MoeConfig:
    """Build the config of a preset (tied embeddings, init std 0.02, float32): Qwen2, or Qwen2-MoE for a
    `MoePreset`."""
    sizes = dataclasses.asdict(preset)
    rope_theta = sizes.pop("rope_theta")
    config_class = Qwen2MoeConfig if isinstance(preset, MoePreset) else Qwen2Config
    return config_class(
        **sizes,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=True,
        initializer_range=0.02,
        dtype=torch.float32,
        **token_ids,
    )


def _model_class(config: Qwen2Config | Qwen2MoeConfig) -> type[PreTrainedModel]:
    return Qwen2MoeForCausalLM if isinstance(config, Qwen2MoeConfig) else Qwen2ForCausalLM


def build_tiny_model(preset: str, seed: int = 0, **token_ids: int | None) -> PreTrainedModel:
    """Build a randomly initialised model of a preset, reproducibly, without touching the global RNG."""
    config = make_config(get_preset(preset), **token_ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_class(config)(config)
    return model.eval()


def make_tiny_model(
    preset: str, out_dir: str | Path, corpus: Iterable[str], seed: int = 0, tokenizer_from: str | Path = ""
) -> Path:
    """Train a tokenizer on `corpus`, build a seeded Qwen2 (or Qwen2-MoE) model and save both as an HF directory.

    `tokenizer_from`: a model directory whose tokenizer is reused instead (`corpus` is then unused), so presets
    of different sizes share one (a distillation teacher and its student); the model's vocabulary width is
    that directory's (its config's `vocab_size`, else the tokenizer's length), not the preset's.

    Token ids follow Qwen2.5-Instruct: bos = pad = <|endoftext|>, eos = <|im_end|> (generation also stops
    on <|endoftext|>). Returns the directory, loadable with `load_causal_lm` / `load_tokenizer`.
    A vision-language preset (`tiny-vl`, `tiny-vl-2.5`) writes a Qwen2-VL / Qwen2.5-VL directory instead
    (`models/vl.py`).
    """
    if preset in VL_PRESETS:
        return make_tiny_vl_model(preset, out_dir, corpus, seed=seed)
    spec = get_preset(preset)
    if tokenizer_from:
        tokenizer, vocab_size = _reused_tokenizer(tokenizer_from)
        spec = dataclasses.replace(spec, vocab_size=vocab_size)
    else:
        tokenizer = train_tokenizer(corpus, spec.vocab_size)
    tokenizer.model_max_length = spec.max_position_embeddings
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)

    config = make_config(spec, bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_class(config)(config).eval()
    model.generation_config.bos_token_id = pad_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.eos_token_id = [eos_id, pad_id]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # safetensors: the only format transformers 5 writes
    tokenizer.save_pretrained(out)
    return out


def _reused_tokenizer(source: str | Path) -> tuple[PreTrainedTokenizerBase, int]:
    """The tokenizer of a model directory, and the vocabulary width a model on it needs."""
    path = Path(source)
    tokenizer = load_tokenizer(path)
    for token in (PAD_TOKEN, IM_END):
        if token not in tokenizer.get_vocab():
            raise ConfigError(
                f"--tokenizer-from {path}: its tokenizer has no {token} token (a tiny model's pad/eos)"
            )
    vocab_size = len(tokenizer)
    if (path / "config.json").is_file():
        configured = json.loads((path / "config.json").read_text()).get("vocab_size")
        vocab_size = max(vocab_size, int(configured or 0))
    return tokenizer, vocab_size
