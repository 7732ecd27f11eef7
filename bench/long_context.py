"""Long context: activation memory per rank and tokens/s of Ulysses sequence parallelism, sp=2 on 2 ranks
against sp=1 on one, and sp=2 with gradient checkpointing (the two combine).

One packed row holding one sequence of `--lengths` tokens goes through the training engine
(`TrainEngine.forward_backward`, the SFT layout: the log-likelihood of every next token) on a freshly built
`--preset` model (float32, the same seeded weights everywhere). Per length, in rounds that alternate the
three setups (sp=1, sp=2, sp=2 + checkpointing; after one warm-up round at the first length):

- activation_mib_per_rank: what the forward leaves for the backward on a rank, the largest rank's
  (`posttrain.engine.saved_tensors`: distinct storages of the tensors autograd saves, parameters apart,
  checkpointed layers' inputs included). Deterministic for a given setup;
- tokens_per_s: the row's tokens over the wall time of its forward + backward (for sp=2, the slower rank's).

Each rank runs one torch thread, so sp=2 uses two cores where sp=1 uses one: its ideal tokens/s ratio is 2
(`per_rank_efficiency` = ratio / 2). sp=1 runs in this process; the sp=2 ranks are spawned once (gloo on
127.0.0.1) and wait for each pass. Achieved FLOP/s (model FLOPs, posttrain.tracking.flops) is reported per
rank as a fraction of a 2048 x 2048 fp32 matmul loop on one thread, measured here.

    python bench/long_context.py                      # small-32k, sequences of 2048 and 8192 tokens
    python bench/long_context.py --long               # and 32768
    python bench/long_context.py --lengths 2048 --repeats 3

Writes bench/results/long_context.json (BENCHMARKS.md format).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import machine_info, median_row, write_result  # noqa: E402

from posttrain.data import keys  # noqa: E402
from posttrain.data.batch import Batch  # noqa: E402
from posttrain.engine.distributed import DistInfo, free_port, shutdown_distributed  # noqa: E402
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.saved_tensors import record_saved_tensors  # noqa: E402
from posttrain.engine.train_engine import TrainEngine  # noqa: E402
from posttrain.tracking.flops import measure_matmul_flops, train_flops  # noqa: E402

SP1, SP2, SP2_CKPT = "sp1", "sp2", "sp2_checkpointing"


def one_row(length: int, vocab: int) -> Batch:
    """One sequence of `length` random tokens: one packed row of that width."""
    ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones_like(ids)
    return Batch.from_dict(
        {keys.INPUT_IDS: ids, keys.ATTENTION_MASK: mask, keys.POSITION_IDS: mask.cumsum(-1) - 1}
    )


def next_token_nll(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: Batch) -> tuple:
    count = mb[keys.ATTENTION_MASK][:, 1:].sum()
    return -log_probs.sum() / count, {}


def engines(model_dir: str, dist_info: DistInfo | None, setups: list[str], shortest: int) -> dict:
    """The engines of `setups`; a packed row is max(pack_row_tokens, longest sequence) wide, so rows of
    `shortest` tokens or more are exactly one sequence wide (no filler)."""
    made = {}
    for name in setups:
        config = EngineConfig(
            model_path=model_dir,
            micro_batch_size=1,
            pack_row_tokens=shortest,
            sequence_parallel_size=1 if name == SP1 else 2,
            gradient_checkpointing=name == SP2_CKPT,
        )
        made[name] = TrainEngine(config, dist_info)
    return made


def one_pass(engine: TrainEngine, batch: Batch) -> tuple[float, float]:
    """(activation MiB on this rank, seconds) of one forward + backward; gradients dropped after."""
    start = time.perf_counter()
    with record_saved_tensors(engine.model) as saved:
        engine.forward_backward(batch, next_token_nll)
    seconds = time.perf_counter() - start
    engine.model.zero_grad(set_to_none=True)
    return saved.activation_mib, seconds


def _rank_main(
    rank: int, port: int, model_dir: str, shortest: int, vocab: int, commands: Any, results: Any
) -> None:
    """An sp=2 rank: builds both sp=2 engines, then runs the passes rank 0 receives (setup, length) until None."""
    torch.set_num_threads(1)
    info = DistInfo(rank=rank, world_size=2, master_port=port, device="cpu")
    made = engines(model_dir, info, [SP2, SP2_CKPT], shortest)
    while True:
        command = [commands.get() if rank == 0 else None]
        dist.broadcast_object_list(command, src=0)
        if command[0] is None:
            break
        name, length = command[0]
        mib, seconds = one_pass(made[name], one_row(length, vocab))
        both: list[Any] = [None, None]
        dist.all_gather_object(both, (mib, seconds))
        if rank == 0:
            results.put(both)
    shutdown_distributed()


def row(case: str, metric: str, values: list[float], baselines: list[float], higher: bool) -> dict:
    return median_row(case, metric, values, baselines, "sp1", higher)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small-32k")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--long", action="store_true", help="add a sequence of 32768 tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="long_context.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = [*args.lengths, 32768] if args.long else args.lengths
    from posttrain.data.tasks.arithmetic import corpus
    from posttrain.models import load_config, make_tiny_model

    peak = measure_matmul_flops(seconds=2.0, threads=1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(args.preset, Path(tmp) / args.preset, corpus(3000, seed=0)))
        cfg = load_config(model_dir)
        vocab = cfg.vocab_size
        ctx = mp.get_context("spawn")
        commands, results = ctx.Queue(), ctx.Queue()
        procs = mp.start_processes(
            _rank_main,
            args=(free_port(), model_dir, min(lengths), vocab, commands, results),
            nprocs=2,
            start_method="spawn",
            join=False,
        )
        local = engines(model_dir, None, [SP1], min(lengths))[SP1]

        def run(name: str, length: int) -> tuple[float, float]:
            """(activation MiB of the largest rank, seconds of the slowest rank)."""
            if name == SP1:
                return one_pass(local, one_row(length, vocab))
            commands.put((name, length))
            both = results.get()
            return max(m for m, _ in both), max(s for _, s in both)

        print(
            f"preset {args.preset}: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads}/"
            f"{cfg.num_key_value_heads} heads, hidden {cfg.hidden_size}, vocab {vocab}; one thread per rank; "
            f"matmul reference {peak / 1e9:.1f} GFLOP/s"
        )
        setups = [SP1, SP2, SP2_CKPT]
        for name in setups:  # warm-up: first-call allocations and code paths
            run(name, lengths[0])
        rows, measured = [], {}
        print(
            f"{'tokens':>7} {'setup':>18} {'act MiB/rank':>13} {'s':>8} {'tokens/s':>9} {'FLOP/s frac':>11}"
        )
        try:
            for length in lengths:
                mib: dict[str, list[float]] = {name: [] for name in setups}
                secs: dict[str, list[float]] = {name: [] for name in setups}
                for _ in range(args.repeats):  # A B C A B C
                    for name in setups:
                        m, s = run(name, length)
                        mib[name].append(m)
                        secs[name].append(s)
                flops = train_flops(cfg.to_dict(), [length])
                for name in setups:
                    ranks = 1 if name == SP1 else 2
                    seconds = statistics.median(secs[name])
                    fraction = flops / ranks / seconds / peak
                    measured[(length, name)] = (statistics.median(mib[name]), length / seconds, fraction)
                    print(
                        f"{length:>7} {name:>18} {statistics.median(mib[name]):>13.1f} {seconds:>8.2f} "
                        f"{length / seconds:>9.1f} {fraction:>11.3f}"
                    )
                for name in (SP2, SP2_CKPT):
                    case = f"{args.preset} {length} tokens {name}"
                    rows.append(row(case, "activation_mib_per_rank", mib[name], mib[SP1], False))
                    throughput = row(
                        case,
                        "tokens_per_s",
                        [length / s for s in secs[name]],
                        [length / s for s in secs[SP1]],
                        True,
                    )
                    throughput["per_rank_efficiency"] = round(throughput["ratio"] / 2, 4)
                    throughput["flops_fraction_per_rank"] = round(measured[(length, name)][2], 4)
                    throughput["baseline_flops_fraction"] = round(measured[(length, SP1)][2], 4)
                    rows.append(throughput)
        finally:
            commands.put(None)
            procs.join()
    command = "python bench/long_context.py " + " ".join(sys.argv[1:])
    path = write_result(
        args.out,
        {
            "bench": "long_context",
            "machine": machine_info(2),
            "command": command.strip(),
            "threads_per_rank": 1,
            "matmul_reference_flops": round(peak),
            "model": {
                "preset": args.preset,
                "layers": cfg.num_hidden_layers,
                "heads": cfg.num_attention_heads,
                "kv_heads": cfg.num_key_value_heads,
                "hidden": cfg.hidden_size,
                "vocab": vocab,
                "dtype": "float32",
            },
            "layout": "one packed row holding one sequence; SFT next-token loss; forward + backward",
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
