"""verl's `data.apply_chat_template_kwargs`: more arguments of the model's chat template wherever it renders.

A tokenizer (or a vision-language processor) is wrapped so that every `apply_chat_template` call gets them:
the datasets', the agents', the SFT masks'. A template ignores arguments it does not read, so a name the
template never mentions (a typo, or `enable_thinking` on a template without a thinking switch) is refused
here rather than silently doing nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain.errors import ConfigError

KEY = "data.apply_chat_template_kwargs"


class TemplateOptions:
    """`inner` with `kwargs` passed to each of its `apply_chat_template` calls (a call's own win); every other
    attribute is the inner object's."""

    def __init__(self, inner: Any, kwargs: Mapping[str, Any]) -> None:
        self.__dict__["_inner"] = inner
        self.__dict__["_kwargs"] = dict(kwargs)

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        return self._inner.apply_chat_template(conversation, *args, **{**self._kwargs, **kwargs})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_inner" not in self.__dict__:  # copies and unpickling
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def with_template_kwargs(tokenizer: Any, kwargs: Mapping[str, Any], model_path: str = "") -> Any:
    """`tokenizer` rendering with `kwargs` (itself when there are none); a name its template never reads is a
    ConfigError naming it."""
    if not kwargs:
        return tokenizer
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        template = getattr(getattr(tokenizer, "tokenizer", None), "chat_template", None)  # a processor's
    texts = list(template.values()) if isinstance(template, dict) else [template or ""]
    for name in kwargs:
        if not any(name in text for text in texts):
            raise ConfigError(
                f"{KEY}.{name}: the chat template of {model_path or 'the model'} never reads {name!r}, so it "
                "would do nothing; leave it out (a template's own switches are named in its chat_template)"
            )
    return TemplateOptions(tokenizer, kwargs)
