"""verl's data.apply_chat_template_kwargs: the chat template's own arguments, wherever it renders; a name the
template never reads is refused (a template silently ignores it)."""

from __future__ import annotations

import copy
import pickle

import pytest

from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig
from posttrain.data.dataset import PromptDataset
from posttrain.data.template_options import with_template_kwargs
from posttrain.errors import ConfigError

from .test_dataset import make_row, write_rows

THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_the_templates_own_argument_reaches_every_render(tmp_path, tokenizer) -> None:
    qwen3 = copy.copy(tokenizer)
    qwen3.chat_template = THINKING
    path = write_rows(tmp_path / "rows.jsonl", [make_row(0)])
    plain = PromptDataset(path, qwen3, max_prompt_length=64)[0]
    quiet = with_template_kwargs(qwen3, {"enable_thinking": False}, "qwen3")
    rendered = PromptDataset(path, quiet, max_prompt_length=64)[0]
    assert "<think>" not in plain["raw_prompt"] and rendered["raw_prompt"].endswith("<think>\n\n</think>\n\n")
    assert quiet.pad_token_id == qwen3.pad_token_id  # everything else is the tokenizer's
    messages = [{"role": "user", "content": "hi"}]
    assert quiet.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=True
    ) == (
        qwen3.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )  # a call's own argument wins
    again = pickle.loads(pickle.dumps(quiet))  # it travels to workers as the tokenizer does
    assert again.apply_chat_template(messages, add_generation_prompt=True, tokenize=False).endswith(
        "</think>\n\n"
    )
    assert with_template_kwargs(qwen3, {}) is qwen3


def test_a_name_the_template_never_reads_is_refused(tokenizer) -> None:
    with pytest.raises(ConfigError, match=r"apply_chat_template_kwargs.enable_thinking: .* never reads"):
        with_template_kwargs(tokenizer, {"enable_thinking": False}, "models/tiny")


def test_the_config_key_takes_a_mapping() -> None:
    cfg = load_config(RLConfig, "rl", ["+data.apply_chat_template_kwargs.enable_thinking=false"])
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(RLConfig, "rl", ["data.apply_chat_template_kwargs=3"])
