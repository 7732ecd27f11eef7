"""Per-tenant limits and counters of `posttrain serve`.

Every limit, when hit, is answered with a 4xx whose message names it (`limit <name>=<value>`): LoRA rank
(400), adapters per tenant and adapter slots in total (403), tokens per request (413), queued requests and
requests per second (429, which the SDK retries with backoff). Counters per tenant (requests by endpoint
and status, tokens, seconds) are served at `/metrics` in Prometheus' text format.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from fastapi import HTTPException


@dataclass(frozen=True)
class Limits:
    max_lora_rank: int = 64
    adapters_per_tenant: int = 4
    adapters_total: int = 16
    tokens_per_request: int = 262_144
    queued_requests: int = 64  # a tenant's submitted requests not yet finished
    requests_per_second: float = 0.0  # 0 = unlimited; a bucket of one second's worth

    def check_rank(self, rank: int) -> None:
        if rank > self.max_lora_rank:
            raise HTTPException(400, f"LoRA rank {rank} is over the limit max_lora_rank={self.max_lora_rank}")

    def check_adapters(self, tenant_count: int, total: int) -> None:
        if tenant_count >= self.adapters_per_tenant:
            raise HTTPException(403, f"limit adapters_per_tenant={self.adapters_per_tenant} reached")
        if total >= self.adapters_total:
            raise HTTPException(403, f"limit adapters_total={self.adapters_total} reached (all slots in use)")

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
    tokens: float
    stamp: float


@dataclass
class Meter:
    """Request rate buckets and counters, per tenant."""

    limits: Limits
    requests: dict[tuple[str, str, int], int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _buckets: dict[str, _Bucket] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, tenant: str) -> None:
        rate = self.limits.requests_per_second
        if rate <= 0:
            return
        now = time.monotonic()
        with self._lock:
            bucket = self._buckets.setdefault(tenant, _Bucket(rate, now))
            bucket.tokens = min(rate, bucket.tokens + (now - bucket.stamp) * rate)
            bucket.stamp = now
            if bucket.tokens < 1:
                raise HTTPException(429, f"limit requests_per_second={rate:g} reached")
            bucket.tokens -= 1

    def record(self, tenant: str, endpoint: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(tenant, endpoint, status)] += 1
            self.seconds[tenant] += seconds

    def count_tokens(self, tenant: str, tokens: int) -> None:
        with self._lock:
            self.tokens[tenant] += tokens

    def prometheus(self) -> str:
        lines = [
            "# HELP posttrain_requests_total Requests by tenant, endpoint and HTTP status.",
            "# TYPE posttrain_requests_total counter",
        ]
        with self._lock:
            for (tenant, endpoint, status), n in sorted(self.requests.items()):
                lines.append(
                    f'posttrain_requests_total{{tenant="{tenant}",endpoint="{endpoint}",status="{status}"}} {n}'
                )
            lines += [
                "# HELP posttrain_request_seconds_total Time spent answering requests, by tenant.",
                "# TYPE posttrain_request_seconds_total counter",
            ]
            lines += [
                f'posttrain_request_seconds_total{{tenant="{t}"}} {s:.6f}'
                for t, s in sorted(self.seconds.items())
            ]
            lines += [
                "# HELP posttrain_tokens_total Tokens in training and sampling requests, by tenant.",
                "# TYPE posttrain_tokens_total counter",
            ]
            lines += [f'posttrain_tokens_total{{tenant="{t}"}} {n}' for t, n in sorted(self.tokens.items())]
        return "\n".join(lines) + "\n"
