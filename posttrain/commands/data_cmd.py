"""`posttrain data`: write a built-in task (or the arithmetic task's preference pairs), prepare GSM8K, or validate
a dataset file row by row.

`data validate FILE` reports every bad row by index with its reason. It runs the dataset class the trainer
would use (`PromptDataset`, `SFTDataset`, `PreferenceDataset`) on one row at a time, so the checks are the
dataset's own, not a second copy that could drift from them.
"""

from __future__ import annotations

import argparse
import inspect
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.config.schema import DataConfig, DPODataConfig, SFTConfig, SFTDataConfig
from posttrain.errors import DataError

KINDS = ("rl", "sft", "dpo")
DEFAULT_MAX_LENGTH = {
    "rl": DataConfig().max_prompt_length,
    "sft": SFTConfig().data.max_prompt_length + SFTConfig().data.max_response_length,
    "dpo": DPODataConfig().max_length,
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser(
        "data", help="write a built-in task, prepare GSM8K (verl-format parquet), validate a file"
    )
    tasks = data.add_subparsers(
        dest="task",
        required=True,
        metavar="{arithmetic,arithmetic_pairs,sampled_pairs,long_addition,tool_multiplication,shapes,gsm8k,validate}",
    )
    for name in ("arithmetic", "arithmetic_pairs", "long_addition"):
        _add_task_parser(tasks, name)
    _add_tool_task_parser(tasks)
    _add_shapes_parser(tasks)

    p = tasks.add_parser(
        "sampled_pairs",
        help="preference pairs from a model's own samples (posttrain eval --n N's samples.jsonl)",
    )
    p.add_argument("--samples", required=True, help="samples.jsonl written by `posttrain eval`")
    p.add_argument("--out", required=True, help="the parquet file to write")
    p.add_argument(
        "--chosen-fallback",
        choices=("ground_truth", "skip"),
        default="ground_truth",
        help="a prompt with no correct sample: the ground truth is chosen, or the prompt is skipped",
    )
    p.set_defaults(func=_sampled_pairs)

    p = tasks.add_parser("gsm8k", help="GSM8K as verl-format parquet (from --src, else the Hugging Face hub)")
    p.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    p.add_argument("--src", help="a folder with GSM8K's train.jsonl and test.jsonl (default: the HF hub)")
    p.set_defaults(func=_gsm8k)

    p = tasks.add_parser("validate", help="check a dataset file; print every bad row with its reason")
    p.add_argument("file", help="a .parquet, .jsonl or .json dataset file")
    p.add_argument("--kind", choices=KINDS, default="rl", help="rl: prompt rows; sft: SFT rows; dpo: pairs")
    p.add_argument(
        "--model",
        help="a model directory whose tokenizer renders the rows (needed for lengths; sft/dpo always)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        help="token limit (rl: data.max_prompt_length; sft: prompt + response; dpo: data.max_length); "
        f"default: the config's ({', '.join(f'{k} {v}' for k, v in DEFAULT_MAX_LENGTH.items())})",
    )
    p.add_argument(
        "--response-key", default=SFTDataConfig().response_key, help="sft prompt rows: the response"
    )
    p.add_argument("--train-on", default=SFTDataConfig().train_on, help="sft: which tokens carry loss")
    p.add_argument("--show", type=int, default=50, help="bad rows printed (all are counted)")
    p.set_defaults(func=_validate)


def _add_task_parser(tasks: argparse._SubParsersAction, name: str) -> None:
    from posttrain.data.tasks import TASK_WRITERS

    defaults = {
        k: v.default
        for k, v in inspect.signature(TASK_WRITERS[name]).parameters.items()
        if v.default is not inspect.Parameter.empty
    }
    what = (
        "preference pairs of the arithmetic task (right vs wrong answer; posttrain dpo / rm)"
        if name == "arithmetic_pairs"
        else f"the built-in {name} task as verl-format parquet"
    )
    p = tasks.add_parser(name, help=what)
    p.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    p.add_argument("--n-train", type=int, default=defaults["n_train"])
    p.add_argument("--n-test", type=int, default=defaults["n_test"])
    p.add_argument("--min-digits", type=int, default=defaults["min_digits"], help="operand digits")
    p.add_argument("--max-digits", type=int, default=defaults["max_digits"], help="operand digits")
    if name == "arithmetic_pairs":
        p.add_argument(
            "--rejected-per-problem",
            type=int,
            default=defaults["rejected_per_problem"],
            help="pairs per problem, one per distinct wrong answer",
        )
        p.add_argument(
            "--near-slips",
            default="",
            help="comma-separated sizes k >= 1: also a pair per near answer (the answer + k and - k) of each "
            "problem, e.g. 1,2,3,10",
        )
    if name in ("arithmetic", "arithmetic_pairs"):
        p.add_argument("--ops", default=",".join(defaults["ops"]), help="operators, comma-separated")
    else:
        p.add_argument(
            "--tail-prob", type=float, default=defaults["tail_prob"], help="share from the long tail"
        )
        p.add_argument(
            "--tail-digits", type=int, default=defaults["tail_digits"], help="longest tail operands"
        )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_write_task)


def _add_tool_task_parser(tasks: argparse._SubParsersAction) -> None:
    from posttrain.data.tasks import write_tool_multiplication_dataset

    defaults = {
        k: v.default
        for k, v in inspect.signature(write_tool_multiplication_dataset).parameters.items()
        if v.default is not inspect.Parameter.empty
    }
    p = tasks.add_parser(
        "tool_multiplication",
        help="the built-in agent task (multiplication with the calculator tool): train/test agent rows and "
        "sft.parquet, tool-using demonstrations for a warm start",
    )
    p.add_argument("--out", required=True, help="folder for train.parquet, test.parquet and sft.parquet")
    for key in ("n_train", "n_test", "n_sft", "min_digits", "max_digits", "seed"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=defaults[key])
    p.set_defaults(func=_write_tool_task)


def _add_shapes_parser(tasks: argparse._SubParsersAction) -> None:
    from posttrain.data.tasks.shapes import KINDS, write_shapes_dataset

    defaults = {
        k: v.default
        for k, v in inspect.signature(write_shapes_dataset).parameters.items()
        if v.default is not inspect.Parameter.empty
    }
    p = tasks.add_parser(
        "shapes", help="the built-in visual task (coloured squares, Pillow) as verl multimodal parquet"
    )
    p.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    p.add_argument("--kind", choices=KINDS, default=defaults["kind"], help="count squares or name the colour")
    for key in ("n_train", "n_test", "max_squares", "size", "seed", "square_side"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=defaults[key])
    p.set_defaults(func=_write_shapes)


def _write_shapes(args: argparse.Namespace) -> None:
    from posttrain.data.tasks.shapes import write_shapes_dataset

    paths = write_shapes_dataset(
        args.out, n_train=args.n_train, n_test=args.n_test, kind=args.kind, max_squares=args.max_squares,
        size=args.size, seed=args.seed, square_side=args.square_side,
    )  # fmt: skip
    for split, path in paths.items():
        print(f"wrote {split}: {path}")


def _write_tool_task(args: argparse.Namespace) -> None:
    from posttrain.agents.tools import build_tools
    from posttrain.data.tasks import write_tool_multiplication_dataset

    tools = [t.schema() for t in build_tools(["calculator"], None)]
    options = {
        k: getattr(args, k) for k in ("n_train", "n_test", "n_sft", "min_digits", "max_digits", "seed")
    }
    _print_paths(write_tool_multiplication_dataset(args.out, tools, **options))


def _write_task(args: argparse.Namespace) -> None:
    from posttrain.data.tasks import write_task

    options: dict[str, Any] = {
        "n_train": args.n_train,
        "n_test": args.n_test,
        "min_digits": args.min_digits,
        "max_digits": args.max_digits,
        "seed": args.seed,
    }
    if args.task in ("arithmetic", "arithmetic_pairs"):
        options["ops"] = tuple(args.ops.split(","))
        if args.task == "arithmetic_pairs":
            options["rejected_per_problem"] = args.rejected_per_problem
            options["near_slips"] = tuple(int(k) for k in args.near_slips.split(",") if k.strip())
    else:
        options |= {"tail_prob": args.tail_prob, "tail_digits": args.tail_digits}
    _print_paths(write_task(args.task, args.out, **options))


def _sampled_pairs(args: argparse.Namespace) -> None:
    from posttrain.data.sampled_pairs import write_sampled_pairs

    counts = write_sampled_pairs(args.samples, args.out, args.chosen_fallback)
    print(
        f"wrote {counts['pairs']} pairs from {counts['prompts']} prompts "
        f"({counts['chosen_sampled']} with a sampled chosen answer): {args.out}"
    )


def _print_paths(paths: dict[str, Path]) -> None:
    for split, path in paths.items():
        print(f"{split}: {path}")


# --- GSM8K --------------------------------------------------------------------------------------

HUB_DATASET = "openai/gsm8k"
LOCAL_COPY_HINT = (
    "give a local copy: `posttrain data gsm8k --src DIR --out OUT`, DIR holding train.jsonl and test.jsonl "
    f"of https://huggingface.co/datasets/{HUB_DATASET} (config 'main')"
)


def _gsm8k(args: argparse.Namespace) -> None:
    from posttrain.data.gsm8k import prepare_gsm8k

    if args.src:
        _print_paths(prepare_gsm8k(args.src, args.out))
        return
    with tempfile.TemporaryDirectory(prefix="posttrain-gsm8k-") as tmp:
        download_gsm8k(Path(tmp))
        _print_paths(prepare_gsm8k(tmp, args.out))


def download_gsm8k(folder: Path) -> None:
    """GSM8K's train and test splits from the Hugging Face hub as `train.jsonl` / `test.jsonl` in `folder`;
    a DataError of one line saying how to give a local copy when `datasets` or the hub is unavailable."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"GSM8K: the `datasets` package is not installed (pip install datasets); or {LOCAL_COPY_HINT}"
        ) from None
    try:
        splits = datasets.load_dataset(HUB_DATASET, "main")
        for split in ("train", "test"):
            with (folder / f"{split}.jsonl").open("w", encoding="utf-8") as f:
                for row in splits[split]:
                    f.write(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n")
    except Exception as exc:  # offline, hub errors, a changed dataset: all end in the same advice
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(
            f"GSM8K: cannot load {HUB_DATASET} from the Hugging Face hub ({reason}); {LOCAL_COPY_HINT}"
        ) from None


# --- validate -----------------------------------------------------------------------------------


def _validate(args: argparse.Namespace) -> int:
    path = Path(args.file)
    limit = args.max_length if args.max_length is not None else DEFAULT_MAX_LENGTH[args.kind]
    build = dataset_builder(args.kind, args.model, limit, args.response_key, args.train_on)
    n_rows, bad = validate_file(path, build)
    checked = "schema and lengths" if args.model else "schema only (give --model to check lengths)"
    print(f"{path}: {n_rows} rows, {len(bad)} bad ({args.kind} rows; {checked}; max length {limit})")
    for index, reason in bad[: args.show]:
        print(f"row {index}: {reason}")
    if len(bad) > args.show:
        print(f"... and {len(bad) - args.show} more bad rows (--show N prints more)")
    return 1 if bad else 0


def dataset_builder(
    kind: str, model: str | None, max_length: int, response_key: str, train_on: str
) -> Callable[[Path], object]:
    """A function building the trainer's dataset of `kind` on one file, overlong rows as errors."""
    if kind not in KINDS:
        raise DataError(f"unknown dataset kind {kind!r}; valid: {', '.join(KINDS)}")
    if model is None:
        if kind != "rl":
            raise DataError(f"data validate --kind {kind}: give --model DIR (its tokenizer renders the rows)")
        tokenizer: Any = _SchemaOnlyTokenizer()
    else:
        from posttrain.models import load_tokenizer

        tokenizer = load_tokenizer(model)
    if kind == "rl":
        from posttrain.data.dataset import PromptDataset

        return lambda f: PromptDataset(f, tokenizer, max_length, overlong="error")
    if kind == "sft":
        from posttrain.data.sft_dataset import SFTDataset

        return lambda f: SFTDataset(
            f, tokenizer, max_length, response_key, overlong="error", train_on=train_on
        )
    from posttrain.data.preference_dataset import PreferenceDataset

    return lambda f: PreferenceDataset(f, tokenizer, max_length, overlong="error")


class _SchemaOnlyTokenizer:
    """Stands in for a tokenizer when none is given: renders nothing, so only the row schema is checked."""

    eos_token = "</s>"

    def apply_chat_template(self, conversation: list[dict[str, str]], /, **kwargs: Any) -> str:
        return ""

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return []


def validate_file(path: Path, build: Callable[[Path], object]) -> tuple[int, list[tuple[int, str]]]:
    """(number of rows, [(row index, reason)]) of `path`, each row checked alone by `build`.

    Each row is written to a one-row file of the source's format (a parquet row keeps its columns' types:
    image bytes, nested lists) beside the source, so relative image paths resolve as they do for the whole
    file (in a temporary folder when the source's is not writable). A file that cannot be read at all
    (missing, bad extension, broken JSON line) is a DataError."""
    from posttrain.data.dataset import as_paths, read_rows

    source = as_paths(path)[0]
    rows = read_rows(source)
    parquet = source.suffix == ".parquet"
    table = None
    if parquet:
        import pyarrow.parquet as pq

        table = pq.read_table(source)
    bad: list[tuple[int, str]] = []
    with tempfile.TemporaryDirectory(prefix=".posttrain-validate-", dir=_writable(source.parent)) as tmp:
        one = Path(tmp) / ("row.parquet" if parquet else "row.jsonl")
        for index, row in enumerate(rows):
            if table is not None:
                pq.write_table(table.slice(index, 1), one)
            else:
                one.write_text(json.dumps(row, default=_plain) + "\n", encoding="utf-8")
            try:
                build(one)
            except DataError as exc:
                bad.append((index, str(exc).replace(f"{one}: row 0: ", "").replace(f"{one}: ", "")))
    return len(rows), bad


def _writable(folder: Path) -> str | None:
    """`folder` if a file can be made there, else None (the system's temporary folder)."""
    import os

    return str(folder) if os.access(folder, os.W_OK) else None


def _plain(value: Any) -> Any:
    """JSON for what parquet rows hold besides plain values (numpy arrays and scalars)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
