"""Preference pairs from a model's own samples: for each prompt, an answer the scorer accepts (chosen) and one
the model actually gave that it rejects (rejected), in TRL's columns for `posttrain dpo` / `posttrain rm`.

Pairs whose rejected side is the policy's own output are on-policy: DPO then lowers the probability of the
mistakes the model makes, not of mistakes it would never make (hand-written slips usually sit far below the
model's own answers already, so pushing them further down changes little of what it generates). This is the
data step of iterative or online DPO (Xu et al. 2023, "Some things are more CRINGE than others"; Guo et al.
2024, "Direct language model alignment from online AI feedback").

Input: `samples.jsonl` of `posttrain eval --n N` (one row per sample: `index`, `messages`, `response`,
`ground_truth`, `correct`). Per prompt: rejected = the most frequent wrong response (ties: the first seen);
chosen = the most frequent correct response, else the ground truth (`chosen_fallback="ground_truth"`), else the
prompt is skipped. Prompts the model always answers correctly give no pair. Must not import engine, rollout,
worker, Ray or model code.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.errors import DataError

REQUIRED = ("index", "messages", "response", "ground_truth", "correct")
FALLBACKS = ("ground_truth", "skip")


def read_samples(path: str | Path) -> dict[int, list[dict[str, Any]]]:
    """The samples of `posttrain eval` grouped by prompt index; a row missing a field is an error naming it."""
    groups: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{line_no}: not JSON ({exc.msg})") from exc
            missing = [k for k in REQUIRED if k not in row]
            if missing:
                raise DataError(
                    f"{path}:{line_no}: missing {missing}; expected the samples.jsonl that `posttrain eval` "
                    "writes"
                )
            groups[int(row["index"])].append(row)
    return groups


def most_common(responses: list[str]) -> str:
    """The most frequent response; ties go to the first seen."""
    counts = collections.Counter(responses)
    return max(responses, key=lambda r: (counts[r], -responses.index(r)))


def pair_for_prompt(samples: list[dict[str, Any]], chosen_fallback: str) -> dict[str, Any] | None:
    """A TRL pair row from one prompt's samples, or None when there is nothing to prefer."""
    wrong = [s["response"].strip() for s in samples if not s["correct"] and s["response"].strip()]
    if not wrong:
        return None
    right = [s["response"].strip() for s in samples if s["correct"]]
    if right:
        chosen = most_common(right)
    elif chosen_fallback == "ground_truth":
        chosen = str(samples[0]["ground_truth"])
    else:
        return None
    rejected = most_common(wrong)
    if rejected == chosen:  # a response scored both ways (a non-deterministic scorer): no preference
        return None
    return {
        "prompt": samples[0]["messages"],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
        "data_source": samples[0].get("data_source", ""),
        "extra_info": {"index": int(samples[0]["index"]), "chosen_sampled": bool(right)},
    }


def write_sampled_pairs(
    samples_path: str | Path, out_file: str | Path, chosen_fallback: str = "ground_truth"
) -> dict[str, int]:
    """Write the pairs of `samples_path` to the parquet file `out_file`; counts of prompts and pairs."""
    if chosen_fallback not in FALLBACKS:
        raise DataError(f"chosen_fallback must be one of {FALLBACKS}, got {chosen_fallback!r}")
    groups = read_samples(samples_path)
    pairs = [p for i in sorted(groups) if (p := pair_for_prompt(groups[i], chosen_fallback)) is not None]
    if not pairs:
        raise DataError(f"{samples_path}: no prompt has both a wrong sample and a chosen answer: no pairs")
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(pairs), out)
    return {
        "prompts": len(groups),
        "pairs": len(pairs),
        "chosen_sampled": sum(p["extra_info"]["chosen_sampled"] for p in pairs),
    }
