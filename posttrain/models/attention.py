"""Facts of a model's attention read from its config, for the engines that implement attention themselves."""

from __future__ import annotations

from typing import Any


def sliding_window(config: Any) -> int | None:
    """The attention window of a model that attends to its last W tokens only (Mistral's `sliding_window`,
    Qwen2's when `use_sliding_window` is on, a layer of type "sliding_attention"), else None. The decoder
    attends to the whole context, which equals a window of W for sequences of at most W tokens."""
    text = getattr(config, "text_config", None) or config
    window = getattr(text, "sliding_window", None)
    if not window:
        return None
    context = getattr(text, "max_position_embeddings", None)
    if context and int(window) >= int(context):  # Phi-3.5/Phi-4-mini: a window no sequence can outgrow
        return None
    if "sliding_attention" in (getattr(text, "layer_types", None) or []):
        return int(window)
    if getattr(text, "use_sliding_window", None) is False:  # Qwen2's switch, off: full attention everywhere
        return None
    if getattr(text, "layer_types", None):  # every layer named, none sliding
        return None
    return int(window)
