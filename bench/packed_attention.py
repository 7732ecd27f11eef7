"""Packed attention without an L x L mask: peak memory of a packed row's forward + backward, per-segment
SDPA (`posttrain_varlen`, the engine's attention for sdpa + remove_padding) against the masked path it
replaced (`sdpa`: transformers derives a (rows, 1, L, L) block-diagonal mask from the position ids).

One packed row of `--lengths` tokens, made of sequences of `--segment` tokens (position ids restarting at
each), through a freshly initialised model of `--preset` (float32, same weights for both), then the
log-likelihood of every next token backward. Per case and attention, alternating A B A B:

- peak_mib: the peak of live CPU allocations during forward + backward (torch profiler, profile_memory:
  every allocation and free in time order, summed; the model's weights, allocated before, not included);
- largest_tensor_mib: the largest tensor any op created (a dispatch mode over the same pass);
- seconds: the wall time of the pass (context only: the machine is shared).

Memory is deterministic for a given case, so the median over `--repeats` and its spread are reported for
form; time varies with the load of the machine.

    python bench/packed_attention.py                 # tiny preset, rows of 2048 and 8192, 512-token sequences
    python bench/packed_attention.py --long          # and 32768 (the masked path needs ~5 GiB for it)
    python bench/packed_attention.py --preset small-32k --lengths 2048 8192

Writes bench/results/packed_attention.json (BENCHMARKS.md format).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import machine_info, median_row, write_result  # noqa: E402

from posttrain.engine.packing import packed_model_output  # noqa: E402
from posttrain.engine.varlen_attention import VARLEN  # noqa: E402
from posttrain.models import build_tiny_model  # noqa: E402

MIB = 2**20
BASELINE = "sdpa_block_diagonal_mask"


class LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self.shape: tuple[int, ...] = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.nbytes:
                self.nbytes, self.shape = t.numel() * t.element_size(), tuple(t.shape)
        return out


def one_pass(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    logits = packed_model_output(model, ids, pos)
    log_probs = torch.log_softmax(logits[:-1], -1).gather(-1, ids.reshape(-1)[1:, None])
    log_probs.sum().backward()
    model.zero_grad(set_to_none=True)


def peak_mib(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> tuple[float, float]:
    """(peak live allocations in MiB, seconds) of one pass."""
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        one_pass(model, ids, pos)
    seconds = time.perf_counter() - start
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak / MIB, seconds


def timed(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> float:
    start = time.perf_counter()
    one_pass(model, ids, pos)
    return time.perf_counter() - start


def largest_tensor(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> tuple[float, tuple]:
    with LargestTensor() as recorder:
        one_pass(model, ids, pos)
    return recorder.nbytes / MIB, recorder.shape


def row(case: str, metric: str, values: list[float], baselines: list[float]) -> dict:
    return median_row(case, metric, values, baselines, BASELINE, higher=False)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--long", action="store_true", help="add a row of 32768 tokens")
    parser.add_argument("--segment", type=int, default=512, help="tokens per packed sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="packed_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [*args.lengths, 32768] if args.long else args.lengths

    masked = build_tiny_model(args.preset, seed=0)
    varlen = copy.deepcopy(masked)
    varlen.set_attn_implementation(VARLEN)
    models = {BASELINE: masked, VARLEN: varlen}
    cfg = masked.config
    print(
        f"preset {args.preset}: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} heads, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; "
        f"sequences of {args.segment} tokens per packed row"
    )
    rows = []
    header = f"{'row tokens':>10} {'attention':>26} {'peak MiB':>10} {'largest MiB':>12} {'largest shape':>24} {'s':>7}"
    print(header)
    for length in lengths:
        gen = torch.Generator().manual_seed(length)
        ids = torch.randint(3, cfg.vocab_size, (1, length), generator=gen)
        pos = torch.arange(length)[None] % args.segment
        case = f"{args.preset} row {length} ({length // args.segment} x {args.segment})"
        peaks: dict[str, list[float]] = {name: [] for name in models}
        seconds: dict[str, list[float]] = {name: [] for name in models}
        largest: dict[str, tuple[float, tuple]] = {}
        for name, model in models.items():  # warm-up: first-call allocations, and the largest tensor
            one_pass(model, ids, pos)
            largest[name] = largest_tensor(model, ids, pos)
        for _ in range(args.repeats):  # A B A B
            for name, model in models.items():
                peak, _ = peak_mib(model, ids, pos)
                peaks[name].append(peak)
                seconds[name].append(timed(model, ids, pos))
        for name in models:
            print(
                f"{length:>10} {name:>26} {statistics.median(peaks[name]):>10.1f} {largest[name][0]:>12.1f} "
                f"{str(largest[name][1]):>24} {statistics.median(seconds[name]):>7.2f}"
            )
        rows.append(row(case, "peak_mib_fwd_bwd", peaks[VARLEN], peaks[BASELINE]))
        rows.append(row(case, "largest_tensor_mib", [largest[VARLEN][0]], [largest[BASELINE][0]]))
        rows.append(row(case, "seconds_fwd_bwd", seconds[VARLEN], seconds[BASELINE]))
    command = "python bench/packed_attention.py " + " ".join(sys.argv[1:])
    path = write_result(
        args.out,
        {
            "bench": "packed_attention",
            "machine": machine_info(args.threads),
            "command": command.strip(),
            "model": {
                "preset": args.preset,
                "layers": cfg.num_hidden_layers,
                "heads": cfg.num_attention_heads,
                "kv_heads": cfg.num_key_value_heads,
                "hidden": cfg.hidden_size,
                "vocab": cfg.vocab_size,
                "dtype": "float32",
            },
            "segment_tokens": args.segment,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
