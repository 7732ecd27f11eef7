"""`posttrain eval`: accuracy, mean reward and pass@k of a model on a verl-format prompt dataset.

The model is a Hugging Face directory, a trainer checkpoint (`step_N`, or a run directory: its latest) or a
LoRA adapter directory (peft's files; merged into its base for generation). Generation is the rollout engine
the trainer samples with (`posttrain/rollout`), scoring the trainer's reward manager (`posttrain/rewards`),
so an eval number and a `val/acc` of the same model and settings are the same measurement (the trainer's
validation is this command with n=1 at temperature 0). Writes `results.json` and `samples.jsonl` (one row
per sample: prompt, response, ground truth, score) to `--out`, and prints the results.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.commands.eval_metrics import CORRECT_SCORE, summarize
from posttrain.config.schema import RewardConfig, RolloutConfig
from posttrain.errors import ConfigError, ModelError

logger = logging.getLogger(__name__)
ADAPTER_CONFIG = "adapter_config.json"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="accuracy, mean reward and pass@k of a model, checkpoint or LoRA adapter")
    p.add_argument(
        "model", help="a model directory, a checkpoint (step_N or a run directory) or a LoRA adapter"
    )
    p.add_argument("--data", required=True, nargs="+", help="verl-format parquet/JSONL prompt files")
    p.add_argument("--out", default="runs/eval", help="folder for results.json and samples.jsonl")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=RolloutConfig().val_temperature, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument(
        "--k", default="", help="pass@k values, comma-separated (default: 1 and the powers of 2 <= n)"
    )
    p.add_argument(
        "--max-prompts", type=_non_negative, default=0, help="evaluate the first N prompts; 0 = all"
    )
    p.add_argument("--max-prompt-length", type=int, default=1024, help="tokens after the chat template")
    p.add_argument("--overlong-prompts", choices=("filter", "error"), default="filter")
    p.add_argument("--max-response-length", type=int, default=512, help="tokens generated per sample")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable), besides eos")
    p.add_argument(
        "--base", help="LoRA adapter: the base model directory (default: the adapter's own record)"
    )
    p.add_argument(
        "--rollout",
        choices=("native", "hf", "vllm"),
        default=RolloutConfig().name,
        help="generation engine (vllm: the vllm package, installed separately)",
    )
    p.add_argument(
        "--max-batch-size", type=int, default=RolloutConfig().max_batch_size, help="sequences at once"
    )
    p.add_argument(
        "--attn-implementation",
        choices=("sdpa", "eager"),
        default="sdpa",
        help="the model's attention as transformers loads it (eager: a model without sdpa, e.g. Gemma-2)",
    )
    p.add_argument(
        "--chat-template-kwargs",
        type=_template_kwargs,
        default=None,
        help="JSON object of the chat template's arguments, as data.apply_chat_template_kwargs (e.g. "
        "'{\"enable_thinking\": false}'); default: a checkpoint's own setting, else none",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--reward-function", default="", help="a Python file with verl's compute_score; default: built-in"
    )
    p.add_argument("--reward-function-name", default=RewardConfig().custom_function_name)
    p.add_argument("--gsm8k-method", choices=("strict", "flexible"), default=RewardConfig().gsm8k_method)
    p.set_defaults(func=run)


def _template_kwargs(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of the template's arguments, got {text}")
    return value


@dataclass(frozen=True)
class EvalModel:
    """What to generate with: a model directory, and a LoRA adapter to merge into it (or None); a checkpoint's
    chat template arguments (its run's data.apply_chat_template_kwargs), so its prompts are validation's."""

    path: Path
    kind: str  # "model" | "checkpoint" | "adapter"
    adapter: Path | None = None
    template_kwargs: dict[str, Any] | None = None


def resolve_model(arg: str, base: str | None, workdir: Path) -> EvalModel:
    """The model directory for `arg`; a checkpoint is exported (merged) into `workdir` first."""
    from posttrain.models.loading import check_model_dir

    path = Path(arg).expanduser()
    if not path.exists():
        raise ModelError(
            f"model path not found: {arg} (give a local model directory, a checkpoint step_N / run directory, "
            "or a LoRA adapter directory; nothing is downloaded)"
        )
    if (path / ADAPTER_CONFIG).is_file():
        recorded = json.loads((path / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        base_dir = base or recorded
        if not base_dir or not Path(base_dir).expanduser().is_dir():
            raise ModelError(
                f"LoRA adapter {path}: its base model {base_dir!r} is not a local directory; give --base DIR"
            )
        return EvalModel(check_model_dir(base_dir), "adapter", adapter=path)
    from posttrain.trainers.checkpoint import STATE_FILE, CheckpointManager
    from posttrain.trainers.export import export_checkpoint, resolve_checkpoint

    # a run directory holds a config.json too (the run's config), so checkpoints are recognised first
    run_dir = (path / "metrics.jsonl").exists() or (path / "run_info.json").exists()
    latest = CheckpointManager(path).latest() if run_dir else None
    has_checkpoint = (path / STATE_FILE).exists() or latest is not None
    offline = latest is not None and CheckpointManager(path).load_state(latest).get("trainer", "rl") != "rl"
    if run_dir and (offline or not has_checkpoint):  # an offline trainer's run: its model is hf/
        if (path / "hf" / "config.json").is_file():
            logger.warning("eval: %s is a run directory; evaluating its model %s", path, path / "hf")
            return EvalModel(check_model_dir(path / "hf"), "model")
        raise ModelError(f"{path} is a run directory with no checkpoint and no hf/ model yet")
    if not has_checkpoint and (path / "config.json").is_file():
        return EvalModel(check_model_dir(path), "model")
    try:
        checkpoint = resolve_checkpoint(path)
    except ConfigError:
        raise ModelError(
            f"{path} is not a model directory (no config.json), a LoRA adapter (no {ADAPTER_CONFIG}), a "
            "checkpoint (no trainer_state.pt) or a run directory with a complete checkpoint"
        ) from None
    logger.warning("eval: exporting checkpoint %s (merged) to %s", checkpoint, workdir)
    saved = CheckpointManager(checkpoint.parent).load_state(checkpoint).get("config", {})
    kwargs = saved.get("data", {}).get("apply_chat_template_kwargs") or None
    exported = export_checkpoint(checkpoint, workdir / "model")
    return EvalModel(exported, "checkpoint", template_kwargs=kwargs)


def pass_ks(spec: str, n: int) -> list[int]:
    """The k of pass@k: `spec` ("1,4,8") or by default 1 and every power of 2 up to n."""
    if spec:
        try:
            ks = sorted({int(k) for k in spec.split(",")})
        except ValueError:
            raise ConfigError(f"--k must be comma-separated integers, got {spec!r}") from None
        bad = [k for k in ks if not 1 <= k <= n]
        if bad:
            raise ConfigError(f"--k: each k must be in [1, --n={n}], got {bad}")
        return ks
    return [k for k in (2**i for i in range(n.bit_length())) if k <= n]


def run(args: argparse.Namespace) -> None:
    if args.n < 1:
        raise ConfigError(f"--n must be >= 1, got {args.n}")
    if args.n > 1 and args.temperature == 0:
        raise ConfigError("--n > 1 needs --temperature > 0: greedy samples of a prompt are all the same")
    ks = pass_ks(args.k, args.n)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="posttrain-eval-") as tmp:
        model = resolve_model(args.model, args.base, Path(tmp))
        results, samples = evaluate(model, args, ks)
    kwargs = args.chat_template_kwargs if args.chat_template_kwargs is not None else model.template_kwargs
    results["model"] = {"path": str(args.model), "kind": model.kind, "chat_template_kwargs": kwargs or {}}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    with (out / "samples.jsonl").open("w", encoding="utf-8") as f:
        for row in samples:
            f.write(json.dumps(row) + "\n")
    print(json.dumps(results, indent=1))
    print(f"wrote {out / 'results.json'} and {out / 'samples.jsonl'}")


def evaluate(model: EvalModel, args: argparse.Namespace, ks: list[int]) -> tuple[dict[str, Any], list[dict]]:
    """(results, samples): generate n samples per prompt with the rollout engine, score them with the
    reward manager, summarise."""
    from posttrain.data.dataset import PromptDataset
    from posttrain.data.template_options import with_template_kwargs
    from posttrain.engine.distributed import resolve_device
    from posttrain.models import load_tokenizer
    from posttrain.rollout import make_rollout_engine
    from posttrain.rollout.base import SamplingParams
    from posttrain.workers.sampling import untie_rollout_head

    start = time.perf_counter()
    kwargs = args.chat_template_kwargs if args.chat_template_kwargs is not None else model.template_kwargs
    if kwargs and args.chat_template_kwargs is None:
        print(f"eval: the checkpoint's chat template arguments {json.dumps(kwargs)} (--chat-template-kwargs)")
    tokenizer = with_template_kwargs(load_tokenizer(model.path), kwargs or {}, str(model.path))
    dataset = PromptDataset(args.data, tokenizer, args.max_prompt_length, args.overlong_prompts)
    count = min(args.max_prompts or len(dataset), len(dataset))
    items = [dataset[i] for i in range(count)]
    engine = make_rollout_engine(
        args.rollout, str(model.path), device=resolve_device(args.device), seed=args.seed,
        max_batch_size=args.max_batch_size, attn_implementation=args.attn_implementation,
    )  # fmt: skip
    context = int(getattr(engine, "max_context", 1 << 30))
    if args.max_prompt_length + args.max_response_length > context:
        raise ConfigError(
            f"--max-prompt-length {args.max_prompt_length} + --max-response-length {args.max_response_length} "
            f"exceed the model's context of {context} tokens: lower one of them"
        )
    if model.adapter is not None:
        weights, adapts_head = _merged_adapter_weights(model.path, model.adapter)
        if (
            adapts_head
        ):  # the merged head is the head's own: copied into a tied one, it changed the embeddings
            untie_rollout_head(engine)
        engine.load_weights(weights)
    sampling = SamplingParams(
        max_tokens=args.max_response_length, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, stop=tuple(args.stop),
    )  # fmt: skip
    sampling.validate()
    prompts = [it["input_ids"] for it in items for _ in range(args.n)]
    generated = engine.generate(prompts, sampling)
    reward = _reward_manager(args)
    try:
        scored = reward.score(
            [it["data_source"] for it in items for _ in range(args.n)],
            [g.text for g in generated],
            [it["ground_truth"] for it in items for _ in range(args.n)],
            [it["extra_info"] for it in items for _ in range(args.n)],
        )
    finally:
        reward.close()
    scores = [scored.scores[i * args.n : (i + 1) * args.n] for i in range(count)]
    results: dict[str, Any] = summarize(scores, ks, [it["data_source"] for it in items])
    results |= {
        "mean_response_tokens": sum(len(g.token_ids) for g in generated) / len(generated),
        "truncated_share": sum(g.stop_reason == "length" for g in generated) / len(generated),
        "reward_errors": scored.n_errors,
        "n_filtered_prompts": dataset.n_filtered,
        "settings": {
            "data": list(args.data), "n": args.n, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "max_prompt_length": args.max_prompt_length,
            "max_response_length": args.max_response_length, "stop": list(args.stop), "seed": args.seed,
            "rollout": args.rollout, "reward_function": args.reward_function or "built-in",
        },
        "seconds": round(time.perf_counter() - start, 3),
    }  # fmt: skip
    samples = [
        {
            "index": it["index"],
            "sample": j,
            "data_source": it["data_source"],
            "prompt": it["raw_prompt"],
            "messages": it["messages"],
            "response": generated[i * args.n + j].text,
            "ground_truth": it["ground_truth"],
            "score": scores[i][j],
            "correct": scores[i][j] >= CORRECT_SCORE,
            "response_tokens": len(generated[i * args.n + j].token_ids),
            "stop_reason": generated[i * args.n + j].stop_reason,
        }  # fmt: skip
        for i, it in enumerate(items)
        for j in range(args.n)
    ]
    return results, samples


def _merged_adapter_weights(base: Path, adapter: Path) -> tuple[list[tuple[str, Any]], bool]:
    """The base model's tensors with the LoRA adapter merged in (peft), named as the engine's model, and
    whether the adapter covers `lm_head`: then the base's head is untied first, as training and `posttrain
    export` do (merged into a head tied to the embeddings, the delta changed the input embeddings too)."""
    import json

    from peft import PeftModel

    from posttrain.engine.lora import untie_output_embeddings
    from posttrain.models import load_causal_lm

    try:
        targets = json.loads((adapter / "adapter_config.json").read_text()).get("target_modules") or []
        adapts_head = "lm_head" in (targets if isinstance(targets, list) else [targets])
        model = load_causal_lm(base)
        if adapts_head:
            untie_output_embeddings(model)
        merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelError(f"cannot apply LoRA adapter {adapter} to {base}: {exc}") from exc
    return list(merged.state_dict().items()), adapts_head


def _reward_manager(args: argparse.Namespace) -> Any:
    from posttrain.rewards.manager import RewardManager
    from posttrain.rewards.user import load_reward_function

    if args.reward_function:
        return RewardManager(load_reward_function(args.reward_function, args.reward_function_name))
    return RewardManager(None, {"openai/gsm8k": {"method": args.gsm8k_method}})


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = all), got {value}")
    return value
