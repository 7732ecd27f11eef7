"""A byte-level BPE tokenizer trained locally, shaped like Qwen2's, for tiny models built from scratch.

Digits are split one per token (as in Qwen2) so that arithmetic tasks see numbers digit by digit.
No normalizer is applied, so decode(encode(text)) == text for any string.
Must not import anything from posttrain except errors.
"""

from collections.abc import Iterable, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from posttrain.errors import ConfigError

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
# Qwen2-VL's vision tokens: an image is `<|vision_start|>` + one `<|image_pad|>` per merged patch + `<|vision_end|>`
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"  # unused by posttrain, but Qwen2-VL's config and processor expect its id
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# Qwen2.5's chat format without its default system prompt: a system message is used only when given.
# With `tools`, a system block lists their JSON schemas inside <tools></tools>; an assistant's tool calls are
# `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Hermes format) after its content; tool
# messages in a row form one user turn of `<tool_response>` blocks. Every turn ends with <|im_end|> and a
# newline (the model samples <|im_end|>; the newline belongs to what follows).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall a tool as <tool_call>\\n{"name": <name>, "arguments": <object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set call = call['function'] if call.get('function') else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}{%- else %}{{- call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


# The same format for vision-language models: a message's content may also be a list of parts, {"type": "text",
# "text": ...} or {"type": "image"} (rendered as Qwen2-VL renders it, one <|image_pad|> the processor expands).
_VL_CONTENT_MACRO = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)
_GENERIC_TURN = "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
assert _GENERIC_TURN in CHAT_TEMPLATE
VL_CHAT_TEMPLATE = _VL_CONTENT_MACRO + CHAT_TEMPLATE.replace(
    _GENERIC_TURN,
    "{{- '<|im_start|>' + message['role'] + '\\n' }}{{- render_content(message['content']) }}"
    "{{- '<|im_end|>' + '\\n' }}",
)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, extra_special_tokens: Sequence[str] = ()
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts` with at most `vocab_size` tokens (specials included).

    The 256 byte symbols are always in the vocabulary, so any text encodes; a small corpus may yield
    fewer than `vocab_size` tokens, which is fine because the model's embedding can be larger.
    `extra_special_tokens` (e.g. VISION_TOKENS) get ids right after the three chat tokens.
    """
    specials = (*SPECIAL_TOKENS, *extra_special_tokens)
    min_size = 256 + len(specials)
    if vocab_size < min_size:
        raise ConfigError(
            f"vocab_size must be at least {min_size} (256 bytes + special tokens), got {vocab_size}"
        )

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START, *extra_special_tokens],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
