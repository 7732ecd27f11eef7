"""`--help` that shows every option's default: one formatter applied to a parser and all its sub-parsers.

argparse's `ArgumentDefaultsHelpFormatter` adds "(default: X)" only to options that have help text, and
prints "None" for options without a default; here every optional argument gets its default, "unset" when
there is none, and "required" when it must be given.
"""

from __future__ import annotations

import argparse
import copy


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends `(default: X)`, `(default: unset)` or `(required)` to each optional argument's help."""

    def _format_action(self, action: argparse.Action) -> str:
        suffix = default_note(action)
        if suffix is not None:
            action = copy.copy(action)
            action.help = f"{action.help or ''} {suffix}".strip()
        return super()._format_action(action)


def default_note(action: argparse.Action) -> str | None:
    """The note for `action`, or None for arguments that have no default to show (help, positionals,
    sub-command choices)."""
    if not action.option_strings or isinstance(action, argparse._HelpAction | argparse._VersionAction):
        return None
    if action.required:
        return "(required)"
    if action.default is None:
        return "(default: unset)"
    if action.default is argparse.SUPPRESS:
        return None
    default = action.default
    if isinstance(default, list | tuple):
        default = ",".join(map(str, default)) or "none"
    return f"(default: {str(default).replace('%', '%%')})"


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Use `DefaultsHelpFormatter` on `parser` and, recursively, on every sub-parser."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                show_defaults(child)
