"""`posttrain config show` (the resolved config of a command line) and `config reference` (every key, from the
schema: type, default, meaning from the field's comment)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.commands.reference import COMMANDS, iter_keys, markdown
from posttrain.config.load import to_dict

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config_reference.md"


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out |= flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_show_prints_the_resolved_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "train", "actor.optim.lr=0.5", "rollout.n=3", "--format", "json"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["actor"]["optim"]["lr"] == 0.5 and cfg["rollout"]["n"] == 3
    assert cfg["data"]["max_prompt_length"] == 64  # a default, resolved
    assert main(["config", "show", "sft"]) == 0
    assert "lr: 0.001" in capsys.readouterr().out  # SFT's own default, as YAML


def test_show_refuses_unknown_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "train", "actor.optim.lrr=1"]) == 2
    assert "did you mean 'actor.optim.lr'" in capsys.readouterr().err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_reference_lists_every_key_with_its_real_default(command: str) -> None:
    schema, _ = COMMANDS[command]
    docs = {d.key: d for d in iter_keys(schema)}
    expected = {k for k in flat(to_dict(schema())) if not k.startswith("resources.pools")}
    assert expected <= set(docs), expected - set(docs)
    assert all(d.type and d.default for d in docs.values())


def test_reference_meanings_come_from_the_schema_comments(capsys: pytest.CaptureFixture[str]) -> None:
    docs = {d.key: d for d in iter_keys(COMMANDS["train"][0])}
    assert docs["actor.mini_batch_size"].meaning.startswith("samples per optimizer step")
    assert docs["model.compute_dtype"].meaning.startswith('"" = dtype')  # a comment inside a wrapped field
    assert docs["actor.clip_ratio_low"].meaning.startswith("Options of particular policy losses")  # above
    assert docs["trainer.loggers"].type == "list[str]" and docs["trainer.loggers"].default.startswith(
        "[console"
    )
    assert docs["algorithm.kl_ctrl_type"].type == "fixed | adaptive"
    assert docs["resources.pools.<name>.nnodes"].type == "int"
    sft = {d.key: d for d in iter_keys(COMMANDS["sft"][0])}
    assert sft["optim.lr"].default == "0.001" and sft["optim.batch_size"].meaning.startswith("samples per")
    assert main(["config", "reference", "--command", "dpo", "--format", "json"]) == 0
    assert {d["key"] for d in json.loads(capsys.readouterr().out)["dpo"]} >= {"dpo.beta", "optim.lr"}


def test_docs_reference_is_generated_from_the_schema() -> None:
    assert DOCS.read_text() == markdown(list(COMMANDS)), (
        "docs/config_reference.md is stale: posttrain config reference > docs/config_reference.md"
    )
