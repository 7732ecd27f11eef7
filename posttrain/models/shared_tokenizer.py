"""Two model directories must share one tokenizer (a distillation teacher and its student): same vocabulary,
same special tokens. Must not import posttrain.data or anything above models/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.errors import ConfigError
from posttrain.models.loading import load_tokenizer

SPECIAL_ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")


def _specials(tokenizer: Any) -> dict[str, str | None]:
    """The named special tokens and every other special token of `tokenizer`, by role."""
    out: dict[str, str | None] = {role: getattr(tokenizer, role, None) for role in SPECIAL_ROLES}
    for token in getattr(tokenizer, "all_special_tokens", []):
        out.setdefault(f"special {token!r}", str(token))
    return out


def tokenizer_difference(
    student: Any, teacher: Any, names: tuple[str, str] = ("student", "teacher")
) -> str | None:
    """The first difference between two tokenizers (vocabulary by token id, then special tokens), or None."""
    first, second = names
    a, b = student.get_vocab(), teacher.get_vocab()
    if a != b:
        a_by_id = {i: t for t, i in a.items()}
        b_by_id = {i: t for t, i in b.items()}
        for token_id in sorted(set(a_by_id) | set(b_by_id)):
            ta, tb = a_by_id.get(token_id), b_by_id.get(token_id)
            if ta != tb:
                return f"token id {token_id} is {ta!r} in the {first} and {tb!r} in the {second}"
        for token in sorted(set(a) ^ set(b)):  # unreachable unless a vocabulary maps two tokens to one id
            return f"token {token!r} is in only one of them"
    sa, sb = _specials(student), _specials(teacher)
    for role in sorted(set(sa) | set(sb)):
        if sa.get(role) != sb.get(role):
            return f"{role} is {sa.get(role)!r} in the {first} and {sb.get(role)!r} in the {second}"
    return None


def check_same_tokenizer(student_path: str | Path, teacher_path: str | Path, key: str = "teacher") -> None:
    """ConfigError naming both directories and their first differing token unless they share a tokenizer."""
    difference = tokenizer_difference(
        load_tokenizer(student_path), load_tokenizer(teacher_path), ("student", key)
    )
    if difference is not None:
        raise ConfigError(
            f"the {key} must share the student's tokenizer: {student_path} (student) and {teacher_path} "
            f"({key}) differ: {difference}; build models of different sizes on one tokenizer with "
            "`posttrain make-model --tokenizer-from DIR`"
        )
