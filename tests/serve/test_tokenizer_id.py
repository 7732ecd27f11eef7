"""What `get_info` tells the tinker SDK to load its tokenizer from: the served directory by default (clients on
this machine), `posttrain serve --tokenizer-id` when given (a hub id, for clients elsewhere)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import tinker

from posttrain.cli import build_parser
from posttrain.errors import ConfigError
from posttrain.models import load_tokenizer
from posttrain.serve.server import build_state
from posttrain.serve.tenants import ApiKeys

from .conftest import KEYS, Running

ALICE = next(iter(KEYS))


def test_the_sdk_loads_the_tokenizer_the_server_names(server: Running, tmp_path: Path) -> None:
    state = server.state
    service = tinker.ServiceClient(base_url=server.url, api_key=ALICE)
    training = service.create_lora_training_client(base_model="tiny", rank=2).result()
    served_dir = state.served["tiny"]  # type: ignore[attr-defined]
    assert training.get_info().model_data.tokenizer_id == served_dir  # the default

    elsewhere = tmp_path / "tokenizer-copy"  # stands for a hub id: another place holding the same tokenizer
    elsewhere.mkdir()
    for name in Path(served_dir).iterdir():
        if "token" in name.name or name.name == "special_tokens_map.json":
            shutil.copy(name, elsewhere / name.name)
    state.tokenizer_ids["tiny"] = str(elsewhere)  # type: ignore[attr-defined]
    try:
        fresh = service.create_lora_training_client(base_model="tiny", rank=2).result()
        assert fresh.get_info().model_data.tokenizer_id == str(elsewhere)
        tokenizer = fresh.get_tokenizer()  # AutoTokenizer.from_pretrained(tokenizer_id), inside the SDK
        assert tokenizer.name_or_path == str(elsewhere)
        assert tokenizer.encode("12+34=46") == load_tokenizer(served_dir).encode("12+34=46")
    finally:
        del state.tokenizer_ids["tiny"]  # type: ignore[attr-defined]


def test_the_flag_reaches_the_state(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--model", "m", "--tokenizer-id", "Qwen/Qwen2.5-0.5B"])
    assert args.tokenizer_id == "Qwen/Qwen2.5-0.5B"
    state = build_state(
        str(tiny_model_dir), "tiny", ApiKeys(KEYS), str(tmp_path / "a"), tokenizer_id="Qwen/Qwen2.5-0.5B"
    )
    try:
        assert state.tokenizer_id("tiny", state.served["tiny"]) == "Qwen/Qwen2.5-0.5B"
    finally:
        state.service.close()
    with pytest.raises(ConfigError, match="--tokenizer-id is empty"):
        build_state(str(tiny_model_dir), "tiny", ApiKeys(KEYS), str(tmp_path / "b"), tokenizer_id=" ")
