"""The documentation site (docs/, mkdocs.yml): it builds in strict mode (no broken link or anchor, no page
left out of the navigation); every command line, config key, Python and YAML example it shows is accepted by
the code; and every code block of the quickstart runs (slow: the whole quickstart, step counts cut to 2)."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GENERATED = {"config_reference.md", "migration_from_verl.md"}  # written by commands, checked by their tests
SECTIONS = (
    "model",
    "data",
    "rollout",
    "actor",
    "critic",
    "algorithm",
    "reward",
    "agent",
    "trainer",
    "resources",
    "ray",
    "optim",
    "dpo",
    "async_rl",
    "rm",
    "distill",
)
KEY = re.compile(r"^\+?((?:" + "|".join(SECTIONS) + r")(?:\.[A-Za-z0-9_<>]+)+)$")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
CONFIG_COMMANDS = ("train", "sft", "dpo", "distill")  # the commands whose arguments are config overrides


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if p.name not in GENERATED)


def code_blocks(page: Path) -> list[tuple[str, str]]:
    """(language, text) of every fenced block of a page, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(page.read_text())]


def shell_lines(text: str) -> list[str]:
    """The commands of a bash block: continuation lines joined."""
    return [line for line in text.replace("\\\n", " ").splitlines() if line.strip()]


def posttrain_commands() -> list[tuple[Path, list[str]]]:
    """Every `posttrain ...` command line of the docs' bash blocks, as argv (placeholders `...` dropped)."""
    found = []
    for page in pages():
        for lang, text in code_blocks(page):
            if lang != "bash":
                continue
            for line in shell_lines(text):
                argv = shlex.split(line, comments=True)
                if argv[:1] == ["posttrain"]:
                    found.append((page, [a for a in argv[1:] if a != "..."]))
    return found


def reference_keys() -> set[str]:
    """The schema's keys, and the retired ones the docs may name because the loader refuses them by name."""
    from posttrain.commands.reference import COMMANDS, iter_keys
    from posttrain.config.load import REPLACED_KEYS

    return {doc.key for schema, _ in COMMANDS.values() for doc in iter_keys(schema)} | set(REPLACED_KEYS)


def is_known(key: str, known: set[str]) -> bool:
    if key in known:
        return True
    parts = key.split(".")
    return any(
        len(k.split(".")) == len(parts)
        and all(a == b or a == "<name>" for a, b in zip(k.split("."), parts, strict=True))
        for k in known
    )


def test_docs_build_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link or anchor, a missing page or a page left out of the nav fails."""
    start = time.perf_counter()
    command = ["mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, "-m", *command],
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    seconds = time.perf_counter() - start
    assert result.returncode == 0, (
        f"mkdocs build --strict failed (needs the docs extra: pip install -e '.[docs]'):\n{result.stderr[-4000:]}"
    )
    print(f"docs built in {seconds:.1f} s")
    assert (tmp_path / "index.html").exists()
    for page in (
        "quickstart",
        "concepts",
        "algorithms/ppo",
        "agents",
        "config_reference",
        "migration_from_verl",
    ):
        assert (tmp_path / page / "index.html").exists(), page
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    assert "config_reference.md" in str(nav) and "migration_from_verl.md" in str(nav)


def test_every_documented_config_key_exists() -> None:
    """Keys in inline code (`actor.optim.lr`, `key=value`) and in command lines are keys of the schema."""
    known = reference_keys()
    unknown = []
    for page in pages():
        text = page.read_text()
        candidates = re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
        for lang, block in code_blocks(page):
            if lang == "bash":
                candidates += [t for line in shell_lines(block) for t in shlex.split(line, comments=True)]
        for token in candidates:
            match = KEY.match(token.split("=", 1)[0].strip("'\""))
            if match and not is_known(match.group(1), known):
                unknown.append(f"{page.relative_to(DOCS)}: {match.group(1)}")
    assert not unknown, "keys the schema does not have:\n" + "\n".join(sorted(set(unknown)))


def test_every_documented_command_line_parses() -> None:
    """Each `posttrain ...` line parses with the CLI's own parser; train/sft/dpo overrides load into the schema
    (unknown keys, bad values and a recipe that does not exist all fail)."""
    from posttrain.cli import build_parser
    from posttrain.commands.reference import COMMANDS
    from posttrain.config.load import load_config

    commands = posttrain_commands()
    assert len(commands) >= 20
    for page, argv in commands:
        where = f"{page.relative_to(DOCS)}: posttrain {shlex.join(argv)}"
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"{where}: the CLI refuses it (exit {exc.code})")
        if argv[0] in CONFIG_COMMANDS:
            schema, config_name = COMMANDS[argv[0]]
            try:
                load_config(schema, config_name, args.overrides)
            except Exception as exc:  # noqa: BLE001 - the message is the point
                pytest.fail(f"{where}: {exc}")


def test_python_and_yaml_examples() -> None:
    """Python examples are valid syntax; the algorithms overview's example computes what it says; the tool
    config YAML of the agents page loads into tools."""
    for page in pages():
        for lang, text in code_blocks(page):
            if lang == "python":
                ast.parse(text, filename=str(page))
            elif lang == "yaml":
                yaml.safe_load(text)
    [example] = [t for lang, t in code_blocks(DOCS / "algorithms" / "index.md") if lang == "python"]
    scope: dict = {}
    exec(compile(example, "algorithms/index.md", "exec"), scope)  # noqa: S102 - our own docs
    advantages = scope["advantages"]
    assert advantages[0].tolist() == pytest.approx([0.7071, 0.7071], abs=1e-4)
    assert advantages[1].tolist() == pytest.approx([-0.7071, -0.7071], abs=1e-4)
    assert advantages[2:].abs().sum() == 0

    from posttrain.agents.tools.config import tools_from_config

    [tool_yaml] = [t for lang, t in code_blocks(DOCS / "agents.md") if lang == "yaml"]
    [tool] = tools_from_config(yaml.safe_load(tool_yaml))
    assert tool.name == "calc"


def test_docs_extra_is_installed_by_setup() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(r'-e "\.\[[^\]]*\bdocs\b[^\]]*\]"', setup), (
        "scripts/setup.sh must install the docs extra"
    )


QUICKSTART_STEPS = [  # tiny step counts for the test; everything else as the page says
    (re.compile(r"trainer\.total_steps=\d+"), "trainer.total_steps=2"),
    (
        re.compile(r"optim\.warmup_steps=\d+"),
        "optim.warmup_steps=1",
    ),  # a cosine schedule needs steps > warm-up
    (re.compile(r"STEPS, PROMPTS, GROUP = \d+, \d+, \d+"), "STEPS, PROMPTS, GROUP = 2, 8, 4"),
]


@pytest.mark.slow
def test_quickstart_runs(tmp_path: Path) -> None:
    """Every code block of the quickstart, in order: the install block at the repository's root, the rest in
    a fresh folder, with the step counts cut to 2."""
    blocks = code_blocks(DOCS / "quickstart.md")
    assert {lang for lang, _ in blocks} == {"bash", "python"}, "every quickstart block must be runnable"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env["POSTTRAIN_PROGRESS"] = "0"
    outputs = []
    for i, (lang, text) in enumerate(blocks):
        for pattern, replacement in QUICKSTART_STEPS:
            text = pattern.sub(replacement, text)
        cwd = ROOT if "setup.sh" in text else tmp_path
        argv = ["bash", "-euo", "pipefail", "-c", text] if lang == "bash" else [sys.executable, "-c", text]
        result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
        assert result.returncode == 0, (
            f"quickstart block {i + 1} ({lang}) failed:\n{text}\n{result.stderr[-4000:]}"
        )
        outputs.append(result.stdout)
    assert (tmp_path / "runs/sft/hf/config.json").exists()
    steps = [
        line
        for line in (tmp_path / "runs/grpo/metrics.jsonl").read_text().splitlines()
        if '"step": 2' in line
    ]
    assert steps, "the GRPO run logged no step 2"
    assert (tmp_path / "runs/eval/results.json").exists()
    assert list((tmp_path / "runs/grpo/plots").glob("*.png"))
    assert (tmp_path / "models/grpo/config.json").exists()
    assert "step 2: mean reward" in outputs[-1]
