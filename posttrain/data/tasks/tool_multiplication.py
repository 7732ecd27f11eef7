"""Built-in agent task: multiply numbers too large to do in one's head, with a calculator tool.

    user       "What is 4821*3967?"
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "4821*3967"}}</tool_call>
    tool       19124907
    assistant  "The answer is 19124907."

A tiny model cannot multiply 3-4 digit numbers by itself, so success needs the tool: copy the operands into
a well-formed call, then copy the tool's result into the answer. The rows are verl's multi-turn format
(`agent_name: tool_agent`, the product as `reward_model.ground_truth`, scored by the arithmetic scorer: the
last integer of the final answer must be the product). `write_tool_multiplication_dataset` also writes
`sft.parquet`: tool-using demonstrations as `messages` + `tools` rows (the SFT trainer's conversation
format) for a warm start, on problems disjoint from train and test.

The tool's schema comes from the caller (the tools live in posttrain/agents, above this layer), so the
demonstrations list exactly the tools the RL run renders.
Must not import engine, rollout, worker, Ray or model code.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.data.tasks.arithmetic import write_splits
from posttrain.errors import DataError

DATA_SOURCE = "tool_multiplication"
AGENT_NAME = "tool_agent"
TOOL_NAME = "calculator"


def prompt_text(a: int, b: int) -> str:
    return f"What is {a}*{b}?"


def answer_text(product: int) -> str:
    return f"The answer is {product}."


def demonstration(a: int, b: int) -> list[dict[str, Any]]:
    """The conversation of a correct episode: the call, the tool's result, the answer."""
    arguments = json.dumps({"expression": f"{a}*{b}"})
    call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": arguments}}
    return [
        {"role": "user", "content": prompt_text(a, b)},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": answer_text(a * b)},
    ]


def _problems(
    rng: np.random.Generator, count: int, min_digits: int, max_digits: int
) -> list[tuple[int, int]]:
    if not 1 <= min_digits <= max_digits:
        raise DataError(
            f"tool_multiplication: need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}"
        )
    seen: set[tuple[int, int]] = set()
    problems: list[tuple[int, int]] = []
    for _ in range(50 * count + 1000):
        if len(problems) == count:
            return problems
        a, b = (int(rng.integers(10 ** (d - 1), 10**d)) for d in rng.integers(min_digits, max_digits + 1, 2))
        if (min(a, b), max(a, b)) not in seen:
            seen.add((min(a, b), max(a, b)))
            problems.append((a, b))
    raise DataError(f"tool_multiplication: only {len(problems)} distinct problems; allow more digits")


def _row(problem: tuple[int, int], split: str, index: int) -> dict[str, Any]:
    a, b = problem
    return {
        "data_source": DATA_SOURCE,
        "agent_name": AGENT_NAME,
        "prompt": [{"role": "user", "content": prompt_text(a, b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a * b)},
        "extra_info": {"split": split, "index": index, "question": f"{a}*{b}", "answer": str(a * b)},
    }


def write_tool_multiplication_dataset(
    out_dir: str | Path,
    tools: Sequence[dict[str, Any]] | None = None,
    n_train: int = 2000,
    n_test: int = 200,
    n_sft: int = 64,
    min_digits: int = 3,
    max_digits: int = 4,
    seed: int = 0,
) -> dict[str, Path]:
    """`train.parquet` / `test.parquet` (agent rows) and, given the tools' schemas, `sft.parquet` (`n_sft`
    demonstrations, `tools` as a JSON string); no problem is in two files. Returns {split: path}."""
    rng = np.random.default_rng(seed)
    problems = _problems(rng, n_train + n_test + n_sft, min_digits, max_digits)
    paths = write_splits(out_dir, problems[: n_train + n_test], n_train, _row)
    if tools is not None and n_sft > 0:
        tools_json = json.dumps(list(tools))
        rows = [
            {"messages": demonstration(a, b), "tools": tools_json} for a, b in problems[n_train + n_test :]
        ]
        paths["sft"] = Path(out_dir) / "sft.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths["sft"])
    return paths


def corpus(n: int, seed: int = 0, tools: Sequence[dict[str, Any]] = ()) -> list[str]:
    """`n` texts of the task's conversations (the call format, the tool response, the answer), and the
    tools' schemas, for training a tokenizer that knows the tool-call pieces."""
    rng = np.random.default_rng(seed)
    texts = [json.dumps(t) for t in tools]
    for a, b in _problems(rng, n, 1, 5):
        arguments = json.dumps({"expression": f"{a}*{b}"})
        texts.append(
            f"{prompt_text(a, b)} <tool_call>\n"
            f'{{"name": "{TOOL_NAME}", "arguments": {arguments}}}\n</tool_call> '
            f"<tool_response>\n{a * b}\n</tool_response> {answer_text(a * b)}"
        )
    return texts
