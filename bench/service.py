"""What serving costs and what many tenants on one base model gain: `posttrain serve` driven by the official
tinker SDK, against the same work in-process, adapter after adapter.

Each tenant (its own API key, its own LoRA adapter of rank 8 on the one served base model) runs a loop:
`forward_backward` (cross_entropy on `n` sequences of `--seq-len` tokens), `optim_step`, then
`save_weights_and_get_sampling_client` and one `sample` (8 prompt tokens, 8 new tokens): the RL-shaped loop.

- **served**: `posttrain serve` in its own process on 127.0.0.1 (a fresh one per repeat, limits raised so
  every case fits); all tenants driven from this one process, one thread each (so clients do not take the
  server's cores), free-running after a warm-up step each.
- **baseline**: the same adapters and steps in-process (`posttrain.client.ServiceClient("local")`), one
  adapter at a time, each call waited for: what one adapter at a time costs without a server.

- **overhead**: the smallest request (one sequence of 8 tokens, `forward_backward`), `--overhead-calls` times
  in turn through the SDK and the server, through posttrain's own HTTP client (`ServiceClient("http")`) and
  the server, and in-process: the median of the paired differences is what serving adds to a request, with
  next to no compute in it to add noise; each client's CPU per call is reported beside it (the client runs on
  the same 2 cores as the server). Calls are `--overhead-pause-ms` apart: after a parallel op, PyTorch's
  OpenMP worker spins on its core for ~10 ms (measured here), so a call made right after the previous one
  would share the cores with the other process's spinning thread.

The SDK's clients are used as its docs say (`create_lora_training_client(...).result()`), with
`TINKER_TELEMETRY=0` (posttrain serve answers telemetry uploads 501, so the SDK would only retry and drop them).

Reported per case (preset, tenants, `n`): train tokens/s (tenants x steps x n x seq-len over the wall
time of the measured steps), steps/s, and p50/p99 of the forward_backward round trip; the ratio is served /
baseline tokens/s. With one tenant the difference is what serving adds (protocol, HTTP, polling); with
many, the served side also shares passes over the base between adapters (client/call_queue.py) and the
baseline cannot. Median over `--repeats`, alternating served / baseline, min-max spread alongside.

    python bench/service.py                                   # tiny (~1M) and small (~10M), 1/4/16 tenants, n 8 and 64
    python bench/service.py --presets tiny --tenants 1,4 --sizes 8 --repeats 1 --out trial.json

Writes bench/results/service.json (BENCHMARKS.md format).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import machine_info, write_result

ROOT = Path(__file__).resolve().parents[1]
RANK = 8


def prepare(work: Path, preset: str) -> Path:
    from posttrain.data.tasks.arithmetic import corpus
    from posttrain.models import make_tiny_model

    model = work / f"model-{preset}"
    if not (model / "config.json").exists():
        make_tiny_model(preset, model, corpus(20000, seed=0))
    return model


def keys(count: int) -> dict[str, str]:
    return {f"tml-bench-tenant-{i:03d}-0123456789": f"tenant{i}" for i in range(count)}


# ---- the server, in a child process -------------------------------------------------------------
def serve_child(model: str, port: int, keys_file: str, state_dir: str) -> None:
    import uvicorn

    from posttrain.serve.app import make_app
    from posttrain.serve.limits import Limits
    from posttrain.serve.server import build_state
    from posttrain.serve.tenants import ApiKeys

    limits = Limits(adapters_per_tenant=64, adapters_total=1024, queued_requests=1024)
    tenants = ApiKeys(json.loads(Path(keys_file).read_text()))
    state = build_state(model, "model", tenants, state_dir, limits=limits)
    uvicorn.run(make_app(state), host="127.0.0.1", port=port, log_level="error")


def start_server(model: Path, work: Path, tenants: int) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    keys_file = work / "keys.json"
    keys_file.write_text(json.dumps(keys(tenants)))
    state = Path(tempfile.mkdtemp(dir=work, prefix="state-"))
    command = [sys.executable, __file__, "--serve-child", str(model), str(port), str(keys_file), str(state)]
    process = subprocess.Popen(command, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not start within 120 s")


# ---- one tenant's loop ----------------------------------------------------------------------------
def make_data(n: int, seq_len: int, seed: int) -> list[Any]:
    import numpy as np
    from tinker import types

    rng = np.random.default_rng(seed)
    data = []
    for _ in range(n):
        tokens = rng.integers(4, 500, seq_len + 1).tolist()
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * seq_len},
            )
        )
    return data


def tenant_step(training: Any, data: list[Any], latencies: list[float], samples: int = 1) -> None:
    from tinker import types

    start = time.perf_counter()
    fb = training.forward_backward(data, "cross_entropy")
    step = training.optim_step(types.AdamParams(learning_rate=1e-3))
    fb.result()
    latencies.append(time.perf_counter() - start)
    step.result()
    sampler = training.save_weights_and_get_sampling_client().result()
    sampler.sample(
        types.ModelInput.from_ints([5, 6, 7, 8, 9, 10, 11, 12]),
        num_samples=samples,
        sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0),
    ).result()


def run_served(url: str, tenants: int, n: int, args: argparse.Namespace) -> dict[str, Any]:
    import tinker

    with contextlib.ExitStack() as sessions:  # closed at the end, so that they stop heartbeating
        clients, datas = [], []
        for i, key in enumerate(keys(tenants)):
            service = sessions.enter_context(tinker.ServiceClient(base_url=url, api_key=key))
            clients.append(
                service.create_lora_training_client(base_model="model", rank=RANK, seed=i).result()
            )
            datas.append(make_data(n, args.seq_len, seed=i))
        return run_tenants(clients, datas, args)


def run_tenants(clients: list[Any], datas: list[list[Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Each tenant's loop on its own thread, free-running after a warm-up step each; the measured steps'
    wall time and forward_backward latencies."""
    tenants, n = len(clients), len(datas[0])
    latencies: list[list[float]] = [[] for _ in range(tenants)]
    warm = threading.Barrier(tenants + 1)
    errors: list[BaseException] = []

    def loop(i: int) -> None:
        try:
            for _ in range(args.warmup):
                tenant_step(clients[i], datas[i], [])
            warm.wait()
            for _ in range(args.steps):
                tenant_step(clients[i], datas[i], latencies[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            warm.abort()

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(tenants)]
    for t in threads:
        t.start()
    try:
        warm.wait()
    except threading.BrokenBarrierError:
        pass
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return summary(wall, tenants, n, args, [x for lat in latencies for x in lat])


def run_baseline(model: Path, tenants: int, n: int, args: argparse.Namespace) -> dict[str, Any]:
    from posttrain.client import ServiceClient

    with ServiceClient("local", root_dir=tempfile.mkdtemp(), seed=0) as service:
        clients = [service.create_lora_training_client(str(model), rank=RANK, seed=i) for i in range(tenants)]
        datas = [make_data(n, args.seq_len, seed=i) for i in range(tenants)]
        for i in range(tenants):
            for _ in range(args.warmup):
                tenant_step(clients[i], datas[i], [])
        latencies: list[float] = []
        start = time.perf_counter()
        for _ in range(args.steps):
            for i in range(tenants):
                tenant_step(clients[i], datas[i], latencies)
        wall = time.perf_counter() - start
    return summary(wall, tenants, n, args, latencies)


def run_ceiling(model: Path, tenants: int, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """The same tokens as one adapter's requests of `tenants` x `n` sequences, in-process: what any batching
    of the tenants' small requests can reach at best (the work is the same; only per-call costs go)."""
    from posttrain.client import ServiceClient

    with ServiceClient("local", root_dir=tempfile.mkdtemp(), seed=0) as service:
        client = service.create_lora_training_client(str(model), rank=RANK, seed=0)
        data = make_data(tenants * n, args.seq_len, seed=0)

        def step(latencies: list[float]) -> None:
            tenant_step(client, data, latencies, samples=tenants)

        for _ in range(args.warmup):
            step([])
        latencies: list[float] = []
        start = time.perf_counter()
        for _ in range(args.steps):
            step(latencies)
        wall = time.perf_counter() - start
    return summary(wall, tenants, n, args, latencies)


def timed_call(training: Any, data: list[Any]) -> float:
    start = time.perf_counter()
    training.forward_backward(data, "cross_entropy").result()
    return time.perf_counter() - start


def run_overhead(model: Path, url: str, calls: int, pause_s: float) -> dict[str, float]:
    """What serving adds to one request with next to no compute in it: the smallest request (one sequence of
    8 tokens, `forward_backward`) through the tinker SDK, through posttrain's own HTTP client, and in-process,
    called in turn one at a time so that all three see the same machine (its speed drifts by 10-15% over
    seconds); each overhead is the median of the paired differences. The client CPU per call (this process's
    CPU time over the calls, all threads) shows what each client itself spends on the 2 cores it shares with
    the server. Each call starts `pause_s` after the one before, once the OpenMP threads of both processes
    have gone to sleep (they spin ~10 ms after a parallel op), so no call shares the cores with them."""
    import tinker

    from posttrain.client import ServiceClient

    key = next(iter(keys(1)))
    data = make_data(1, 8, seed=0)
    # closed at the end: an SDK session left open goes on heartbeating, into the next repeat's server
    with (
        tinker.ServiceClient(base_url=url, api_key=key) as service,
        ServiceClient("http", base_url=url, api_key=key) as http,
        ServiceClient("local", root_dir=tempfile.mkdtemp(), seed=0) as local,
    ):
        sdk = service.create_lora_training_client(base_model="model", rank=RANK).result()
        ours = http.create_lora_training_client("model", rank=RANK)
        in_process_client = local.create_lora_training_client(str(model), rank=RANK)
        clients = {"sdk": sdk, "posttrain_http": ours, "in_process": in_process_client}
        for _ in range(5):  # warm-up: first-call allocations, connections
            for client in clients.values():
                timed_call(client, data)
        seconds: dict[str, list[float]] = {name: [] for name in clients}
        cpu = dict.fromkeys(clients, 0.0)
        for _ in range(calls):
            for name, client in clients.items():
                time.sleep(pause_s)
                started = time.process_time()
                seconds[name].append(timed_call(client, data))
                cpu[name] += time.process_time() - started
    out = {f"{name}_p50_ms": 1000 * statistics.median(values) for name, values in seconds.items()}
    for name in ("sdk", "posttrain_http"):
        paired = [s - p for s, p in zip(seconds[name], seconds["in_process"], strict=True)]
        out[f"{name}_overhead_ms"] = 1000 * statistics.median(paired)
    out |= {f"{name}_client_cpu_ms_per_call": 1000 * cpu[name] / calls for name in clients}
    return out


def summary(wall: float, tenants: int, n: int, args: argparse.Namespace, latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    return {
        "tokens_per_s": tenants * args.steps * n * args.seq_len / wall,
        "steps_per_s": tenants * args.steps / wall,
        "p50_ms": 1000 * statistics.median(ordered),
        # a 99th percentile of fewer than 100 latencies would be the maximum under another name
        "p99_ms": 1000 * ordered[round(0.99 * (len(ordered) - 1))] if len(ordered) >= 100 else None,
        "max_ms": 1000 * ordered[-1],
        "latencies": len(ordered),
    }


def median_spread(values: list[float]) -> tuple[float, list[float]]:
    return statistics.median(values), [min(values), max(values)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--tenants", default="1,4,16")
    parser.add_argument("--sizes", default="8,64", help="sequences per forward_backward")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per tenant")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--overhead-calls", type=int, default=50, help="1x8 calls per repeat (0: skip)")
    parser.add_argument(
        "--overhead-pause-ms",
        type=float,
        default=20.0,
        help="between the probe's calls (OpenMP spin: ~10 ms)",
    )
    parser.add_argument("--out", default="service.json")
    parser.add_argument("--serve-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_child:
        serve_child(*args.serve_child[:1], int(args.serve_child[1]), *args.serve_child[2:])
        return
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("TINKER_TELEMETRY", "0")  # the server answers the SDK's telemetry uploads 501
    tenant_counts = [int(x) for x in args.tenants.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    work = Path(tempfile.gettempdir()) / "posttrain-bench-service"
    work.mkdir(exist_ok=True)
    rows = []
    for preset in args.presets.split(","):
        model = prepare(work, preset)
        for n in sizes:
            served: dict[int, list[dict]] = {t: [] for t in tenant_counts}
            baseline: dict[int, list[dict]] = {t: [] for t in tenant_counts}
            ceiling: dict[int, list[dict]] = {t: [] for t in tenant_counts if t > 1}
            overhead: list[dict[str, float]] = []
            for repeat in range(args.repeats):
                process, url = start_server(model, work, max(tenant_counts))
                try:
                    if args.overhead_calls and n == sizes[0]:
                        overhead.append(
                            run_overhead(model, url, args.overhead_calls, args.overhead_pause_ms / 1000)
                        )
                        print(f"{preset} repeat={repeat} smallest request: {overhead[-1]}", flush=True)
                    for t in tenant_counts:  # alternating served / baseline
                        served[t].append(run_served(url, t, n, args))
                        baseline[t].append(run_baseline(model, t, n, args))
                        if t > 1:
                            ceiling[t].append(run_ceiling(model, t, n, args))
                        report(preset, n, t, repeat, served[t][-1], baseline[t][-1], ceiling.get(t))
                finally:
                    process.terminate()
                    process.wait(timeout=60)
            for t in tenant_counts:
                rows += case_rows(preset, n, t, args, served[t], baseline[t], ceiling.get(t))
            for client, name in (("sdk", "the tinker SDK"), ("posttrain_http", "posttrain's HTTP client")):
                if not overhead:
                    break
                value, spread = median_spread([o[f"{client}_overhead_ms"] for o in overhead])
                cpu, _ = median_spread([o[f"{client}_client_cpu_ms_per_call"] for o in overhead])
                rows.append(
                    {"case": f"{preset} one tenant, 1x8 forward_backward, {name}",
                     "metric": "serving_overhead_ms", "value": round(value, 2), "higher_is_better": False,
                     "repeats": len(overhead), "spread": [round(x, 2) for x in spread],
                     "client_cpu_ms_per_call": round(cpu, 2), "calls_per_repeat": args.overhead_calls,
                     "pause_ms": args.overhead_pause_ms,
                     "details": overhead}
                )  # fmt: skip
    result = {
        "bench": "service",
        "machine": machine_info(args.threads),
        "command": "python bench/service.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    print(f"wrote {write_result(args.out, result)}")


def report(
    preset: str, n: int, t: int, repeat: int, served: dict, baseline: dict, ceiling: list[dict] | None
) -> None:
    best = (
        f" | one adapter, {t}x the sequences per call {ceiling[-1]['tokens_per_s']:.0f} tok/s"
        if ceiling
        else ""
    )
    print(
        f"{preset} n={n} tenants={t} repeat={repeat}: served {served['tokens_per_s']:.0f} tok/s "
        f"(fb p50 {served['p50_ms']:.1f} ms, max {served['max_ms']:.1f} ms) | one adapter at a time "
        f"in-process {baseline['tokens_per_s']:.0f} tok/s (fb p50 {baseline['p50_ms']:.1f} ms){best} | ratio "
        f"{served['tokens_per_s'] / baseline['tokens_per_s']:.2f}",
        flush=True,
    )


def case_rows(
    preset: str,
    n: int,
    t: int,
    args: argparse.Namespace,
    served: list[dict],
    baseline: list[dict],
    ceiling: list[dict] | None,
) -> list[dict]:
    case = f"{preset} tenants={t} n={n}x{args.seq_len}"
    rows = []
    metrics: list[tuple[str, bool, Callable[[dict], float]]] = [
        ("tokens_per_s", True, lambda r: r["tokens_per_s"]),
        ("steps_per_s", True, lambda r: r["steps_per_s"]),
        ("fb_p50_ms", False, lambda r: r["p50_ms"]),
        ("fb_p99_ms", False, lambda r: r["p99_ms"]),
        ("fb_max_ms", False, lambda r: r["max_ms"]),
    ]
    for metric, higher, get in metrics:
        if any(get(r) is None for r in [*served, *baseline]):
            continue  # a p99 of too few latencies (`summary`)
        value, spread = median_spread([get(r) for r in served])
        base, _ = median_spread([get(r) for r in baseline])
        rows.append(
            {
                "case": case,
                "metric": metric,
                "value": round(value, 2),
                "baseline_name": "in-process, one adapter at a time",
                "baseline_value": round(base, 2),
                "ratio": round(value / base, 3),
                "higher_is_better": higher,
                "repeats": len(served),
                "spread": [round(x, 2) for x in spread],
            }
        )
    if t == 1:  # what serving adds to one request: the forward_backward round trip, served minus in-process
        extra = [a["p50_ms"] - b["p50_ms"] for a, b in zip(served, baseline, strict=True)]
        value, spread = median_spread(extra)
        rows.append(
            {"case": case, "metric": "serving_overhead_ms", "value": round(value, 2), "higher_is_better": False,
             "repeats": len(extra), "spread": [round(x, 2) for x in spread]}
        )  # fmt: skip
    if ceiling:  # the bound for any batching of the tenants' requests: the same tokens in one adapter's calls
        value, spread = median_spread([r["tokens_per_s"] for r in served])
        best, _ = median_spread([r["tokens_per_s"] for r in ceiling])
        rows.append(
            {"case": case, "metric": "tokens_per_s_vs_ceiling", "value": round(value, 2),
             "baseline_name": f"in-process, one adapter, {t}x the sequences per call", "baseline_value":
             round(best, 2), "ratio": round(value / best, 3), "higher_is_better": True, "repeats": len(served),
             "spread": [round(x, 2) for x in spread]}
        )  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
