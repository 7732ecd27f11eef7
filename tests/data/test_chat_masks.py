"""Conversation loss masks per `train_on`, on the Qwen-style template (`<|im_end|>` then a newline)."""

from __future__ import annotations

import pytest

from posttrain.data.chat_masks import conversation_tokens, text_tokens
from posttrain.data.sft_dataset import SFTDataset
from posttrain.errors import DataError
from posttrain.models.tokenizer import CHAT_TEMPLATE, train_tokenizer

from .conftest import write_rows

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4+4?"},
    {"role": "assistant", "content": "8"},
]
TOOL_CHAT = [
    {"role": "user", "content": "Add 2 and 3"},
    {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
]


@pytest.fixture(scope="module")
def qwen_tok():
    texts = [f"What is {a}+{b}? {a + b}" for a in range(20) for b in range(20)]
    return train_tokenizer(texts + ["Be brief. And It is add tool_call arguments"], vocab_size=400)


def spans(tok, ids: list[int], mask: list[int]) -> list[str]:
    """The masked tokens as decoded contiguous spans."""
    out, current = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            current.append(t)
        elif current:
            out.append(tok.decode(current))
            current = []
    if current:
        out.append(tok.decode(current))
    return out


@pytest.mark.parametrize(
    ("train_on", "expected"),
    [
        ("last_assistant", ["8<|im_end|>"]),
        ("all_assistant", ["5<|im_end|>", "8<|im_end|>"]),
        (
            "all_messages",
            [
                "Be brief.<|im_end|>",
                "What is 2+3?<|im_end|>",
                "5<|im_end|>",
                "And 4+4?<|im_end|>",
                "8<|im_end|>",
            ],
        ),
    ],
)
def test_masks_per_mode_multi_turn(qwen_tok, train_on: str, expected: list[str]) -> None:
    ids, mask = conversation_tokens(qwen_tok, CHAT, train_on, "row 0")
    assert qwen_tok.decode(ids) == qwen_tok.apply_chat_template(CHAT, tokenize=False)
    assert spans(qwen_tok, ids, mask) == expected


def test_end_of_turn_has_loss_newline_and_next_header_do_not(qwen_tok) -> None:
    ids, mask = conversation_tokens(qwen_tok, CHAT, "all_assistant", "row 0")
    im_end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    ends = [i for i, t in enumerate(ids) if t == im_end]
    assistant_ends = [ends[2], ends[4]]  # system, user, ASSISTANT, user, ASSISTANT
    for i in assistant_ends:
        assert mask[i] == 1
        assert qwen_tok.decode(ids[i + 1 : i + 2]) == "\n" and mask[i + 1] == 0
    assert mask[ends[2] + 2] == 0  # <|im_start|> of the next user turn
    header = qwen_tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    first = next(i for i in range(len(ids)) if ids[i : i + len(header)] == header)
    assert mask[first : first + len(header)] == [0] * len(header)


def test_everything_is_every_token(qwen_tok) -> None:
    ids, mask = conversation_tokens(qwen_tok, CHAT, "everything", "row 0")
    assert mask == [1] * len(ids)


def test_tool_calls_and_tool_responses(qwen_tok) -> None:
    ids, mask = conversation_tokens(qwen_tok, TOOL_CHAT, "all_assistant", "row 0")
    got = spans(qwen_tok, ids, mask)
    assert got == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        "It is 5.<|im_end|>",
    ]
    ids, mask = conversation_tokens(qwen_tok, TOOL_CHAT, "all_messages", "row 0")
    assert "5\n</tool_response><|im_end|>" in spans(qwen_tok, ids, mask)


def test_generation_markers_are_used_as_the_template_marks(qwen_tok) -> None:
    """A template with {% generation %} decides the mask itself: here it ends the block after the newline,
    and the mask follows it (while the turn-by-turn rendering of the same text would stop before)."""
    marked = CHAT_TEMPLATE.replace(
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}",
        "{%- if message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{% generation %}"
        "{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
        "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}",
    )
    assert marked != CHAT_TEMPLATE
    original = qwen_tok.chat_template
    qwen_tok.chat_template = marked
    try:
        ids, mask = conversation_tokens(qwen_tok, CHAT, "all_assistant", "row 0")
        assert spans(qwen_tok, ids, mask) == ["5<|im_end|>\n", "8<|im_end|>\n"]
        ids, mask = conversation_tokens(qwen_tok, CHAT, "last_assistant", "row 0")
        assert spans(qwen_tok, ids, mask) == ["8<|im_end|>\n"]
    finally:
        qwen_tok.chat_template = original


def test_a_template_that_rewrites_earlier_turns_is_an_error(qwen_tok) -> None:
    original = qwen_tok.chat_template
    # the last message is rendered differently from the same message followed by more turns
    qwen_tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if loop.last %} (final){% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    try:
        with pytest.raises(DataError, match=r"row 7: .*not a token prefix"):
            conversation_tokens(qwen_tok, CHAT, "all_assistant", "row 7")
    finally:
        qwen_tok.chat_template = original


def test_text_rows_end_with_eos(qwen_tok) -> None:
    ids = text_tokens(qwen_tok, "What is 2+3? 5", "<|im_end|>")
    assert qwen_tok.decode(ids) == "What is 2+3? 5<|im_end|>"
    assert text_tokens(qwen_tok, "5<|im_end|>", "<|im_end|>") == qwen_tok.encode("5<|im_end|>")


def test_dataset_mixes_row_kinds(tmp_path, qwen_tok) -> None:
    rows = [
        {"messages": CHAT},
        {"text": "What is 2+3? 5"},
        {"prompt": [{"role": "user", "content": "What is 1+1?"}], "extra_info": {"answer": "2"}},
    ]
    ds = SFTDataset(write_rows(tmp_path / "t.jsonl", rows), qwen_tok, 256, train_on="last_assistant")
    assert spans(qwen_tok, ds[0]["input_ids"], ds[0]["loss_mask"]) == ["8<|im_end|>"]
    assert ds[1]["loss_mask"] == [1] * len(ds[1]["input_ids"])
    assert spans(qwen_tok, ds[2]["input_ids"], ds[2]["loss_mask"]) == ["2<|im_end|>"]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"messages": []}, r"row 1: field 'messages' must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"row 1: messages\[0\] has unknown role 'robot'"),
        ({"messages": [{"role": "user"}]}, r"row 1: messages\[0\] \(user\) needs a string 'content'"),
        (
            {"messages": [{"role": "user", "content": "x"}]},
            r"row 1: train_on=all_assistant but .* no assistant",
        ),
        ({"other": 1}, r"row 1: a row needs 'messages', 'text' or 'prompt'"),
        ({"prompt": [{"role": "user", "content": "x"}]}, r"row 1: missing field 'extra_info.answer'"),
    ],
)
def test_bad_rows_name_the_row_and_reason(tmp_path, qwen_tok, bad: dict, reason: str) -> None:
    path = write_rows(tmp_path / "t.jsonl", [{"messages": CHAT}, bad])
    with pytest.raises(DataError, match=reason):
        SFTDataset(path, qwen_tok, 256)


def test_unknown_train_on_names_the_valid_ones(tmp_path, qwen_tok) -> None:
    path = write_rows(tmp_path / "t.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match=r"train_on='assistant' is not one of \['last_assistant'"):
        SFTDataset(path, qwen_tok, 256, train_on="assistant")
