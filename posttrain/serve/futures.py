"""The server's futures: every submitted request gets an id at once; its result is fetched by long polling.

tinker's protocol answers a mutating call with `{"request_id"}` and the SDK then polls `retrieve_future`
until the result is there. `FutureStore` keeps each request's future with its owner (a tenant never sees
another's). `Sequencer` runs a training model's requests in `seq_id` order: the SDK numbers them 1, 2, ...
per model and may send them concurrently (parallel chunks, retries), so the server waits for a missing id
before starting later ones, and a request it has already seen (a retry after a lost response) gets the
request id of its first delivery: it is applied once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A result's wire form: JSON-able dict, or (protobuf bytes) for the two proto results.
Encoder = Callable[[Any], "dict[str, Any] | bytes"]


@dataclass
class Request:
    request_id: str
    tenant: str
    kind: str
    future: concurrent.futures.Future[Any]
    encode: Encoder


class UnknownRequest(KeyError):
    """A request id this server never issued to this tenant (or lost in a restart)."""


class FutureStore:
    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._ids = itertools.count(1)
        self._requests: dict[str, Request] = {}
        self._lock = threading.Lock()

    def add(self, tenant: str, kind: str, future: Any, encode: Encoder) -> str:
        with self._lock:
            request_id = f"{self._prefix}-{next(self._ids)}"
            self._requests[request_id] = Request(request_id, tenant, kind, as_concurrent(future), encode)
        return request_id

    def get(self, request_id: str, tenant: str) -> Request:
        request = self._requests.get(request_id)
        if request is None or request.tenant != tenant:
            raise UnknownRequest(request_id)
        return request

    def pending(self) -> list[Request]:
        return [r for r in list(self._requests.values()) if not r.future.done()]

    @staticmethod
    async def wait(request: Request, timeout: float) -> bool:
        """Whether the request finished within `timeout` seconds (the long poll)."""
        if request.future.done():
            return True
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(request.future)), timeout)
        except TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - a failed request is finished; its error is the caller's to report
            return True
        return True


def as_concurrent(future: Any) -> concurrent.futures.Future[Any]:
    """A concurrent.futures.Future, from one or from tinker's AwaitableConcurrentFuture (its `.future()`)."""
    if isinstance(future, concurrent.futures.Future):
        return future
    return future.future()


def failed(exc: BaseException) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_exception(exc)
    return future


def in_thread(fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
    """Run a blocking call (a model's creation) on a thread of its own, off the event loop; its future."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - delivered to the poller
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


def resolved(value: Any) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(value)
    return future


@dataclass
class _ModelQueue:
    next_seq: int = 1
    parked: dict[int, tuple[Callable[[], concurrent.futures.Future[Any]], concurrent.futures.Future[Any]]] = (
        field(default_factory=dict)
    )
    seen: dict[int, str] = field(default_factory=dict)  # seq_id -> request id of its first delivery


class Sequencer:
    """Per training model: start requests in seq_id order; a repeated seq_id is the same request."""

    def __init__(self) -> None:
        self._models: dict[str, _ModelQueue] = {}
        self._lock = threading.Lock()

    def seen(self, model_id: str, seq_id: int) -> str | None:
        with self._lock:
            return self._models.setdefault(model_id, _ModelQueue()).seen.get(seq_id)

    def remember(self, model_id: str, seq_id: int, request_id: str) -> None:
        with self._lock:
            self._models.setdefault(model_id, _ModelQueue()).seen[seq_id] = request_id

    def submit(
        self, model_id: str, seq_id: int, start: Callable[[], concurrent.futures.Future[Any]]
    ) -> concurrent.futures.Future[Any]:
        """A future for `start()`'s result, started once every lower seq_id of the model has started.

        `start` submits the work (to the backend's ordered queue) and returns its future, or raises for a
        request that is invalid: that error becomes the request's result and the sequence moves on."""
        outer: concurrent.futures.Future[Any] = concurrent.futures.Future()
        ready: list[tuple[Callable[[], concurrent.futures.Future[Any]], concurrent.futures.Future[Any]]] = []
        with self._lock:
            queue = self._models.setdefault(model_id, _ModelQueue())
            if seq_id < queue.next_seq:
                outer.set_exception(ValueError(f"seq_id {seq_id} of {model_id} was already used"))
                return outer
            queue.parked[seq_id] = (start, outer)
            while queue.next_seq in queue.parked:
                ready.append(queue.parked.pop(queue.next_seq))
                queue.next_seq += 1
        for begin, future in ready:  # in order, outside the lock (starting only queues the work)
            _chain(begin, future)
        return outer


def _chain(
    start: Callable[[], concurrent.futures.Future[Any]], outer: concurrent.futures.Future[Any]
) -> None:
    try:
        inner = as_concurrent(start())
    except Exception as exc:  # noqa: BLE001 - an invalid request's error is its result
        outer.set_exception(exc)
        return

    def copy(done: concurrent.futures.Future[Any]) -> None:
        if done.exception() is not None:
            outer.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            outer.set_result(done.result())

    inner.add_done_callback(copy)
