"""`posttrain <command>`: train, sft, dpo, rm, distill, make-model, data, export, serve, demo, eval, config, plot.

Config-driven commands take Hydra overrides (`posttrain train model.path=DIR trainer.n_workers_per_node=2`).
Every project error is printed as one line naming the problem (a reward function that keeps failing adds its
traceback and the resume hint), with exit code 2. `train` stopped by SIGINT or SIGTERM saves a checkpoint and
exits with 128 + the signal number (130, 143); the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

from posttrain.commands import config_cmd, data_cmd, eval_cmd, plot_cmd, preflight
from posttrain.commands.help import show_defaults
from posttrain.errors import PosttrainError


def _train(args: argparse.Namespace) -> int:
    from posttrain.config.load import load_config
    from posttrain.config.schema import RLConfig
    from posttrain.trainers.rl import RLTrainer

    cfg = load_config(RLConfig, args.config_name, args.overrides)
    preflight.check_ray_address(cfg.ray.address if cfg.trainer.backend == "ray" else "")
    trainer = RLTrainer(cfg)
    history = trainer.fit()
    if trainer.stop_signal is not None:  # stopped by SIGINT/SIGTERM after a checkpoint: 128 + signal number
        return 128 + trainer.stop_signal
    if history:
        print(json.dumps({"first": history[0], "last": history[-1]}, indent=1))
    return 0


def _offline_done(trainer: Any) -> int:
    """The exit status of an offline trainer's finished command: 0, its HF directory written. (Stopped by
    SIGINT/SIGTERM after a checkpoint, `fit` raised RunStopped: `main` exits 128 + the signal's number.)"""
    print(f"wrote {trainer.hf_dir}")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from posttrain.config.load import load_config
    from posttrain.config.schema import SFTConfig
    from posttrain.trainers.sft import SFTTrainer

    cfg = load_config(SFTConfig, args.config_name, args.overrides)
    preflight.check_ray_address(cfg.ray.address if cfg.trainer.backend == "ray" else "")
    trainer = SFTTrainer(cfg)
    trainer.fit()
    return _offline_done(trainer)


def _dpo(args: argparse.Namespace) -> int:
    from posttrain.config.load import load_config
    from posttrain.config.schema import DPOConfig
    from posttrain.trainers.dpo import DPOTrainer

    cfg = load_config(DPOConfig, args.config_name, args.overrides)
    preflight.check_ray_address(cfg.ray.address if cfg.trainer.backend == "ray" else "")
    trainer = DPOTrainer(cfg)
    trainer.fit()
    return _offline_done(trainer)


def _distill(args: argparse.Namespace) -> int:
    from posttrain.config.load import load_config
    from posttrain.config.schema import DistillConfig
    from posttrain.trainers.distill import DistillTrainer

    cfg = load_config(DistillConfig, args.config_name, args.overrides)
    preflight.check_ray_address(cfg.ray.address if cfg.trainer.backend == "ray" else "")
    trainer = DistillTrainer(cfg)
    metrics = trainer.fit()
    if "val/kl_to_teacher" in metrics:
        print(f"held-out KL(student || teacher) per token {metrics['val/kl_to_teacher']:.4f}")
    return _offline_done(trainer)


def _rm(args: argparse.Namespace) -> int:
    from posttrain.config.load import load_config
    from posttrain.config.schema import RMConfig
    from posttrain.trainers.rm import RMTrainer

    cfg = load_config(RMConfig, args.config_name, args.overrides)
    preflight.check_ray_address(cfg.ray.address if cfg.trainer.backend == "ray" else "")
    trainer = RMTrainer(cfg)
    trainer.fit()
    if trainer.final_eval:
        e = trainer.final_eval
        print(f"held-out pairwise accuracy {e['val/accuracy']:.4f} over {int(e['val/pairs'])} pairs")
    else:
        print("no held-out pairs (data.val_files): no pairwise accuracy")
    return _offline_done(trainer)


def _make_model(args: argparse.Namespace) -> None:
    from posttrain.agents.tools import build_tools
    from posttrain.data.tasks import arithmetic, long_addition, tool_multiplication
    from posttrain.models import make_tiny_model

    calculator = [t.schema() for t in build_tools(["calculator"], None)]
    corpora = {
        "arithmetic": arithmetic.corpus,
        "long_addition": long_addition.corpus,
        "tool_multiplication": partial(tool_multiplication.corpus, tools=calculator),
    }
    texts: list[str] = []
    if args.tokenizer_from:  # the tokenizer is reused: no corpus to train one on
        out = make_tiny_model(
            args.preset, args.out, texts, seed=args.seed, tokenizer_from=args.tokenizer_from
        )
        print(f"wrote {out} (tokenizer of {args.tokenizer_from})")
        return
    for task in args.corpus_tasks.split(","):
        if task not in corpora:
            raise SystemExit(f"--corpus-tasks: unknown task {task!r}; known: {', '.join(corpora)}")
        texts += corpora[task](args.corpus_size, seed=args.seed)
    for path in args.corpus_file or []:
        texts.extend(Path(path).read_text().splitlines())
    out = make_tiny_model(args.preset, args.out, texts, seed=args.seed)
    print(f"wrote {out}")


def _export(args: argparse.Namespace) -> None:
    from posttrain.trainers.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, adapter_only=args.adapter)
    print(f"wrote {out}")


def _demo(args: argparse.Namespace) -> None:
    from posttrain.demo import run_demo

    run_demo(
        Path(args.out), preset=args.preset, n_workers=args.n_workers, rl_steps=args.rl_steps, fresh=args.fresh
    )


def _serve(args: argparse.Namespace) -> None:
    from posttrain.serve.server import serve

    preflight.check_port_free(args.host, args.port)  # before the model loads, not after
    serve(
        args.model, model_name=args.model_name, keys_file=args.keys, root_dir=args.state_dir,
        host=args.host, port=args.port, backend=args.backend, n_workers=args.n_workers, config=args.config,
        tokenizer_id=args.tokenizer_id, public_metrics=args.public_metrics,
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
    )
    sub = parser.add_subparsers(dest="command", required=True)

    for name, func, config in (
        ("train", _train, "rl"),
        ("sft", _sft, "sft"),
        ("dpo", _dpo, "dpo"),
        ("rm", _rm, "rm"),
        ("distill", _distill, "distill"),
    ):
        p = sub.add_parser(name, help=f"{name} with Hydra overrides (key=value ...)")
        p.add_argument("--config-name", default=config, help="a YAML under posttrain/config/yaml")
        p.add_argument("overrides", nargs="*")
        p.set_defaults(func=func)

    p = sub.add_parser("make-model", help="write a tiny Qwen2 model + locally trained tokenizer")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--corpus-size", type=int, default=20000, help="built-in task texts to train the tokenizer on"
    )
    p.add_argument(
        "--corpus-tasks",
        default="arithmetic",
        help="built-in tasks whose texts train the tokenizer, comma-separated (arithmetic, long_addition, "
        "tool_multiplication)",
    )
    p.add_argument("--corpus-file", action="append", help="extra text files (one sample per line)")
    p.add_argument(
        "--tokenizer-from",
        default="",
        metavar="DIR",
        help="reuse the tokenizer of this model directory instead of training one (presets of different "
        "sizes then share it, as distillation needs); the corpus options are then unused",
    )
    p.set_defaults(func=_make_model)

    data_cmd.add_parser(sub)
    eval_cmd.add_parser(sub)
    config_cmd.add_parser(sub)
    plot_cmd.add_parser(sub)

    p = sub.add_parser(
        "export", help="an RL checkpoint as a Hugging Face directory (full, merged or adapter)"
    )
    p.add_argument("checkpoint", help="a checkpoint folder (step_N) or a run directory (its latest)")
    p.add_argument("--out", required=True)
    p.add_argument("--adapter", action="store_true", help="LoRA runs: write the adapter alone, not merged")
    p.set_defaults(func=_export)

    p = sub.add_parser(
        "serve", help="the explicit API over HTTP, tinker's wire protocol (the tinker SDK works)"
    )
    p.add_argument("--model", required=True, help="the base model directory every tenant's adapter trains on")
    p.add_argument("--model-name", help="the name clients ask for (default: the directory's name)")
    p.add_argument(
        "--tokenizer-id",
        help="what clients' get_tokenizer loads (AutoTokenizer.from_pretrained): a hub id such as "
        "Qwen/Qwen2.5-0.5B for clients on other machines (default: the --model directory, local clients only)",
    )
    p.add_argument("--keys", help="JSON file of API key -> tenant (default: $POSTTRAIN_API_KEYS)")
    p.add_argument(
        "--state-dir",
        default="serve-state",
        help="tenants' checkpoints and the journal a restart recovers from",
    )
    p.add_argument(
        "--config", help="YAML or JSON file of limits (posttrain/serve/config.py); unknown keys fail"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", choices=["local", "ray"], default="local")
    p.add_argument("--n-workers", type=int, default=1, help="ray backend: data-parallel workers")
    p.add_argument(
        "--public-metrics",
        action="store_true",
        help="serve /metrics without a key, every tenant's series (for a scraper on a network only operators "
        "reach; by default /metrics needs a key and shows that tenant's own series)",
    )
    p.set_defaults(func=_serve)

    p = sub.add_parser(
        "demo", help="tiny model -> task data -> SFT warm start -> GRPO on Ray; before/after table"
    )
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--n-workers", type=int, default=2)
    p.add_argument("--rl-steps", type=int, default=0, help="0 = the demo's default")
    p.add_argument("--fresh", action="store_true", help="delete --out first instead of resuming")
    p.set_defaults(func=_demo)
    show_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from posttrain.workers.process import quiet_transformers

    quiet_transformers()
    from posttrain.trainers.fault import RunStopped

    try:
        return args.func(args) or 0
    except RunStopped as stopped:  # SIGINT/SIGTERM after a checkpoint (the message is printed): 128 + signal
        return 128 + stopped.signum
    except PosttrainError as exc:
        print(f"posttrain {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
