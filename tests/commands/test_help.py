"""Every command's `--help` lists each of its options with its default (or says it is required)."""

from __future__ import annotations

import argparse
import re

import pytest

from posttrain.cli import build_parser, main


def all_parsers(
    parser: argparse.ArgumentParser, name: str = "posttrain"
) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child_name, child in action.choices.items():
                found += all_parsers(child, f"{name} {child_name}")
    return found


PARSERS = all_parsers(build_parser())


def option_blocks(help_text: str) -> dict[str, str]:
    """Each option's help entry (its first line and the indented lines after it), by its first flag."""
    blocks: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        match = re.match(r"^  (-{1,2}[\w-]+)", line)
        if match:
            current = match.group(1)
            blocks[current] = line
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


def test_every_subcommand_is_covered() -> None:
    names = {name for name, _ in PARSERS}
    for command in (
        "train",
        "sft",
        "dpo",
        "eval",
        "data validate",
        "data gsm8k",
        "config show",
        "config reference",
        "config from-verl",
    ):
        assert f"posttrain {command}" in names, f"no `posttrain {command}`"


@pytest.mark.parametrize(("name", "parser"), PARSERS, ids=[name for name, _ in PARSERS])
def test_help_shows_every_default(
    name: str, parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = name.split()[1:] + ["--help"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    blocks = option_blocks(capsys.readouterr().out)
    options = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    for action in options:
        block = blocks.get(action.option_strings[0])
        assert block is not None, f"{name}: {action.option_strings[0]} missing from --help"
        if action.required:
            assert "(required)" in block, block
        else:
            shown = "unset" if action.default is None else action.default
            if isinstance(shown, list | tuple):
                shown = ",".join(map(str, shown)) or "none"
            assert f"(default: {shown})" in block, f"{name}: {block!r}"
