"""Observations after an assistant turn: the template's exact suffix, tokenised alone (the newline after
<|im_end|> included), and the two-turn masks that follow from them."""

from __future__ import annotations

from pathlib import Path

from posttrain.agents.chat_render import ChatRenderer
from posttrain.agents.training_data import trajectory_sequences
from posttrain.agents.types import Completion, Trajectory, Transition
from posttrain.models import load_tokenizer

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]  # fmt: skip


def test_a_two_turn_tool_conversation_renders_and_masks_exactly(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    renderer = ChatRenderer(tok, TOOLS)
    user = [{"role": "user", "content": "What is 12*34?"}]
    first = renderer.initial(user)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    action1 = tok.encode(call, add_special_tokens=False) + [renderer.end_of_turn_id]
    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}]}  # fmt: skip
    tool = [{"role": "tool", "content": "408"}]
    observation = renderer.after_assistant([*user, assistant], tool)
    assert tok.decode(observation) == (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )  # the newline after the sampled <|im_end|> is the observation's first token, not lost
    action2 = tok.encode("408", add_special_tokens=False) + [renderer.end_of_turn_id]
    second = first + action1 + observation
    trajectory = Trajectory(
        [
            Transition(first, Completion(action1, [-1.0] * len(action1), "stop"), 0.0),
            Transition(second, Completion(action2, [-1.0] * len(action2), "stop"), 1.0),
        ],
        "completed",
    )
    (seq,) = trajectory_sequences(trajectory)
    # the sequence is exactly the whole rendered conversation ...
    full = [*user, assistant, *tool, {"role": "assistant", "content": "408"}]
    assert tok.decode(seq.tokens) == renderer.render(full, generation_prompt=False).rstrip("\n")
    # ... and only the model's own tokens are trained: both actions, each with its end-of-turn token
    trained = [t for t, m in zip(seq.tokens, seq.mask, strict=True) if m]
    assert trained == action1 + action2
    assert tok.decode(trained).count("<|im_end|>") == 2 and "tool_response" not in tok.decode(trained)
