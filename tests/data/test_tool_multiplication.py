"""The built-in agent task: rows, disjoint splits, SFT demonstrations that load and mask, the tokenizer corpus."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from posttrain.agents.tools import HermesToolParser, build_tools
from posttrain.data.dataset import PromptDataset
from posttrain.data.sft_dataset import SFTDataset
from posttrain.data.tasks import tool_multiplication
from posttrain.errors import DataError
from posttrain.models import load_tokenizer
from posttrain.rewards import default_compute_score

TOOLS = [t.schema() for t in build_tools(["calculator"], None)]


def test_rows_splits_and_demonstrations(tmp_path: Path, tiny_model_dir: Path) -> None:
    paths = tool_multiplication.write_tool_multiplication_dataset(
        tmp_path, TOOLS, n_train=40, n_test=10, n_sft=6
    )
    train, test, sft = (pq.read_table(paths[k]).to_pylist() for k in ("train", "test", "sft"))
    assert (len(train), len(test), len(sft)) == (40, 10, 6)
    questions = [r["extra_info"]["question"] for r in train + test]
    assert len(set(questions)) == 50, "no problem in two splits"
    row = train[0]
    assert row["agent_name"] == "tool_agent" and row["data_source"] == "tool_multiplication"
    a, b = map(int, row["extra_info"]["question"].split("*"))
    assert 100 <= a < 10_000 and 100 <= b < 10_000 and row["reward_model"]["ground_truth"] == str(a * b)
    assert default_compute_score("tool_multiplication", f"The answer is {a * b}.", str(a * b)) == 1.0
    tok = load_tokenizer(tiny_model_dir)
    assert len(PromptDataset(paths["train"], tok, max_prompt_length=64)) == 40
    demos = SFTDataset(paths["sft"], tok, max_length=1000, train_on="all_assistant")
    item = demos[0]
    trained = tok.decode([t for t, m in zip(item["input_ids"], item["loss_mask"], strict=True) if m])
    assert "<tool_call>" in trained and "The answer is" in trained
    assert "<tool_response>" not in trained and "# Tools" not in trained, (
        "only the assistant turns carry loss"
    )
    # what the demonstration teaches is what the environment's parser reads
    call_text = trained.split("<|im_end|>")[0]
    (call,) = HermesToolParser().parse(call_text).calls
    assert call.name == "calculator" and "*" in call.arguments["expression"]


def test_bad_settings_and_bad_tools_column(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(DataError, match="min_digits"):
        tool_multiplication.write_tool_multiplication_dataset(tmp_path, TOOLS, min_digits=5, max_digits=4)
    import pyarrow as pa

    rows = [{"messages": tool_multiplication.demonstration(123, 456), "tools": "{not json"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="row 0.*tools.*JSON"):
        SFTDataset(tmp_path / "bad.parquet", load_tokenizer(tiny_model_dir), max_length=1000)


def test_the_corpus_teaches_the_tokenizer_the_call_format() -> None:
    texts = tool_multiplication.corpus(20, tools=TOOLS)
    assert any('"calculator"' in t for t in texts)
    assert all("<tool_call>" in t and "<tool_response>" in t for t in texts[len(TOOLS) :])
