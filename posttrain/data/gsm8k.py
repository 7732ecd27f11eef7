"""GSM8K from its original JSONL (`question`, `answer` ending in `#### <number>`) to verl-format parquet.

Same prompt and fields as verl's gsm8k preprocessing, so rewards and results compare directly.
Must not import engine, rollout, worker, Ray or model code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.errors import DataError

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")


def extract_answer(solution: str) -> str | None:
    """The number after the last `####`, commas removed; None when there is none."""
    if "####" not in solution:
        return None
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return answer or None


def _rows(path: Path, split: str) -> list[dict]:
    rows = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}: line {line_no}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON: {e}") from e
        for field in ("question", "answer"):
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise DataError(f"{where}: missing string field {field!r}")
        ground_truth = extract_answer(record["answer"])
        if ground_truth is None:
            raise DataError(f"{where}: field 'answer' has no final answer after '####'")
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{record['question']} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": ground_truth},
                "extra_info": {
                    "split": split,
                    "index": len(rows),
                    "question": record["question"],
                    "answer": record["answer"],
                },
            }
        )
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def prepare_gsm8k(src_dir: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """Read `train.jsonl` and `test.jsonl` from `src_dir`, write `{split}.parquet` to `out_dir`."""
    src, out = Path(src_dir), Path(out_dir)
    for split in SPLITS:
        if not (src / f"{split}.jsonl").is_file():
            raise DataError(f"{src / f'{split}.jsonl'}: GSM8K file not found")
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in SPLITS:
        rows = _rows(src / f"{split}.jsonl", split)
        paths[split] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
    return paths
