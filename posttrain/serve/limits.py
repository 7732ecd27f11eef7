"""Per-tenant limits and counters of `posttrain serve`.

Every limit, when hit, is answered with a 4xx whose message names it (`limit <name>=<value>`): LoRA rank
(400), adapters per tenant and adapter slots in total (403; 429 when a released adapter waits for a free
slot), tokens per request (413), queued requests, requests per second and tokens per second (429, which
the SDK retries with backoff). The rates are token buckets per tenant holding one second's worth; a request
larger than that is let through when the bucket is full and leaves it in debt, so the long-run rate holds.
The lifetimes bound memory and disk: idle adapters are released after `adapter_idle_seconds` (0 = never),
sessions without a heartbeat finish after `session_idle_seconds` (releasing their sampling sessions),
finished results leave memory `future_ttl_seconds` after they finish (at once when retrieved) and the
journal after `journal_keep_seconds`; a graceful stop waits `shutdown_grace_seconds` for running requests.
Counters per tenant (requests by endpoint and status, tokens, seconds, queue time) are served at `/metrics`
in Prometheus' text format: to a tenant's key its own series (and the server's gauges), to anyone every
tenant's only with `posttrain serve --public-metrics` (a scraper on a network only operators reach).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from fastapi import HTTPException


@dataclass(frozen=True)
class Limits:
    max_lora_rank: int = 64
    # adapters loaded at once, per tenant and in all (a released model, its state saved, holds no slot; a
    # finished session's adapters are released)
    adapters_per_tenant: int = 4
    adapters_total: int = 16
    tokens_per_request: int = 262_144
    queued_requests: int = 64  # a tenant's submitted requests not yet finished
    requests_per_second: float = 0.0  # 0 = unlimited; a bucket of one second's worth
    tokens_per_second: float = 0.0  # 0 = unlimited; tokens of forward/backward and sample requests
    adapter_idle_seconds: float = 0.0  # 0 = never: an adapter unused this long is saved and unloaded
    # a tenant's sampling sessions kept (each holds a copy of the weights); a new one releases the least
    # recently used beyond this many, and a finished session releases its own
    samplers_per_tenant: int = 8
    # a session not heard from (no heartbeat, no request on its models or samplers) this long is finished, as
    # by the client's /finish: its sampling sessions and its models' adapters are released; 0 = never
    session_idle_seconds: float = 900.0
    # a training model's requests wait at most this long for a missing seq_id (one the SDK spent on a 429 it
    # retried for 300 s, then gave up on): the sequence then skips it; 0 = wait forever
    seq_gap_seconds: float = 360.0
    future_ttl_seconds: float = 600.0  # a finished, unretrieved result stays in memory this long
    journal_keep_seconds: float = 86_400.0  # and in the journal this long
    shutdown_grace_seconds: float = 30.0  # SIGTERM: how long running requests may take to finish
    # a request body's size (JSON or protobuf, images included), refused with 413 before it is read whole
    max_request_bytes: int = 256 * 2**20

    def check_body_size(self, size: int) -> None:
        if size > self.max_request_bytes:
            raise HTTPException(
                413,
                f"request body of {size} bytes or more is over the limit max_request_bytes={self.max_request_bytes}",
            )

    def check_rank(self, rank: int) -> None:
        if rank > self.max_lora_rank:
            raise HTTPException(400, f"LoRA rank {rank} is over the limit max_lora_rank={self.max_lora_rank}")

    def check_adapters(self, tenant_count: int, total: int) -> None:
        if (
            tenant_count >= self.adapters_per_tenant
        ):  # a slot frees when one is released (idle, a session ends)
            raise HTTPException(
                429 if self.adapter_idle_seconds > 0 else 403,
                f"limit adapters_per_tenant={self.adapters_per_tenant} reached (adapters loaded)",
            )
        if total >= self.adapters_total:  # released when idle: worth the SDK's backing off (429), else final
            status = 429 if self.adapter_idle_seconds > 0 else 403
            raise HTTPException(
                status, f"limit adapters_total={self.adapters_total} reached (all slots in use)"
            )

    def check_free_slot(self, total: int, model_id: str) -> None:
        """Before a released adapter is loaded again (429: the SDK retries until a slot frees up)."""
        if total >= self.adapters_total:
            raise HTTPException(
                429,
                f"limit adapters_total={self.adapters_total} reached: the adapter of {model_id}, released "
                "while idle, waits for a free slot",
            )

    def check_tokens(self, tokens: int) -> None:
        if tokens > self.tokens_per_request:
            raise HTTPException(
                413,
                f"{tokens} tokens in one request is over the limit tokens_per_request={self.tokens_per_request}",
            )

    def check_queued(self, queued: int) -> None:
        if queued >= self.queued_requests:
            raise HTTPException(
                429, f"limit queued_requests={self.queued_requests} reached: wait for results"
            )


@dataclass
class _Bucket:
    level: float
    stamp: float

    def take(self, rate: float, amount: float, now: float) -> bool:
        """Refill at `rate` per second up to one second's worth; take `amount` if the bucket is not empty
        (it may go below zero: a large request is paid for by the time after it)."""
        self.level = min(rate, self.level + (now - self.stamp) * rate)
        self.stamp = now
        if self.level < min(1.0, rate):
            return False
        self.level -= amount
        return True


@dataclass
class Meter:
    """Request and token rate buckets and counters, per tenant."""

    limits: Limits
    requests: dict[tuple[str, str, int], int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    queue_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    finished: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _buckets: dict[tuple[str, str], _Bucket] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _take(self, kind: str, tenant: str, rate: float, amount: float) -> bool:
        now = time.monotonic()
        with self._lock:
            bucket = self._buckets.setdefault((kind, tenant), _Bucket(rate, now))
            return bucket.take(rate, amount, now)

    def admit(self, tenant: str) -> None:
        rate = self.limits.requests_per_second
        if rate > 0 and not self._take("requests", tenant, rate, 1):
            raise HTTPException(429, f"limit requests_per_second={rate:g} reached")

    def admit_tokens(self, tenant: str, tokens: int) -> None:
        """Count a request's tokens against the tenant's tokens_per_second (429 when over), and in total."""
        rate = self.limits.tokens_per_second
        if rate > 0 and not self._take("tokens", tenant, rate, tokens):
            raise HTTPException(429, f"limit tokens_per_second={rate:g} reached: {tokens} tokens must wait")
        with self._lock:
            self.tokens[tenant] += tokens

    def record(self, tenant: str, endpoint: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(tenant, endpoint, status)] += 1
            self.seconds[tenant] += seconds

    def queued(self, tenant: str, seconds: float) -> None:
        """A request finished after waiting `seconds` for the backend to reach it."""
        with self._lock:
            self.queue_seconds[tenant] += seconds
            self.finished[tenant] += 1

    def prometheus(
        self, gauges: Mapping[str, tuple[str, float]] | None = None, tenant: str | None = None
    ) -> str:
        """The counters in Prometheus' text format, with `gauges` (name -> (help, value)) after them; only
        `tenant`'s series when given (what a tenant's own key may see), else every tenant's."""
        out: list[str] = []

        def mine(name: str) -> bool:
            return tenant is None or name == tenant

        def family(name: str, kind: str, text: str, rows: list[tuple[str, float]]) -> None:
            out.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}"])
            out.extend(f"{name}{labels} {value}" if isinstance(value, int) else f"{name}{labels} {value:.6f}"
                       for labels, value in rows)  # fmt: skip

        with self._lock:
            family(
                "posttrain_requests_total", "counter", "Requests by tenant, endpoint and HTTP status.",
                [(f'{{tenant="{t}",endpoint="{e}",status="{s}"}}', n) for (t, e, s), n in sorted(self.requests.items()) if mine(t)],
            )  # fmt: skip
            family(
                "posttrain_request_seconds_total", "counter", "Time spent answering requests, by tenant.",
                [(f'{{tenant="{t}"}}', s) for t, s in sorted(self.seconds.items()) if mine(t)],
            )  # fmt: skip
            family(
                "posttrain_tokens_total", "counter", "Tokens in training and sampling requests, by tenant.",
                [(f'{{tenant="{t}"}}', n) for t, n in sorted(self.tokens.items()) if mine(t)],
            )  # fmt: skip
            out.extend([
                "# HELP posttrain_queue_seconds Time submitted requests waited before the backend ran them "
                "(the backend runs one call at a time: until the call before finished), by tenant.",
                "# TYPE posttrain_queue_seconds summary",
            ])  # fmt: skip
            for name in filter(mine, sorted(self.finished)):
                out.append(f'posttrain_queue_seconds_sum{{tenant="{name}"}} {self.queue_seconds[name]:.6f}')
                out.append(f'posttrain_queue_seconds_count{{tenant="{name}"}} {self.finished[name]}')
        for name, (text, value) in (gauges or {}).items():
            family(name, "gauge", text, [("", value)])
        return "\n".join(out) + "\n"
