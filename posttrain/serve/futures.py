"""The server's futures: every submitted request gets an id at once; its result is fetched by long polling.

tinker's protocol answers a mutating call with `{"request_id"}` and the SDK then polls `retrieve_future`
until the result is there. `FutureStore` keeps each request with its owner (a tenant never sees another's)
and, once it finishes, its answer in wire form (a JSON body or protobuf bytes), which is written to the
journal before a poller can see it. Memory stays bounded: a finished request leaves memory once it has been
retrieved, or `future_ttl_seconds` after it finished; a later poll is answered from the journal, which
keeps answers for `journal_keep_seconds`.

`Sequencer` runs a training model's requests in `seq_id` order: the SDK numbers them 1, 2, ... per model
and may send them concurrently (parallel chunks, retries), so the server waits for a missing id before
starting later ones, and a request it has already seen (a retry after a lost response) gets the request id
of its first delivery: it is applied once. The ids seen are journaled, so this holds across a restart.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.errors import ConfigError
from posttrain.serve.journal import SEQS_KEPT, Answer, Journal

# A result's wire form: JSON-able dict, or (protobuf bytes) for the two proto results.
Encoder = Callable[[Any], Answer]
USER_ERRORS = (ValueError, TypeError, KeyError, ConfigError)


@dataclass
class Request:
    request_id: str
    tenant: str
    kind: str
    model_id: str | None
    submitted: float = field(default_factory=time.monotonic)
    answer: concurrent.futures.Future[Answer] = field(default_factory=concurrent.futures.Future)
    finished: float | None = None


class UnknownRequest(KeyError):
    """A request id this server never issued to this tenant (or one forgotten since)."""


def error_answer(exc: BaseException) -> dict[str, str]:
    """A failed request's answer: tinker's `{"error", "category"}` (user: the request was wrong)."""
    category = "user" if isinstance(exc, USER_ERRORS) else "server"
    return {"error": f"{type(exc).__name__}: {exc}", "category": category}


class FutureStore:
    def __init__(
        self,
        prefix: str,
        journal: Journal | None = None,
        on_finish: Callable[[Request, float], None] | None = None,
    ) -> None:
        """`on_finish(request, queue_seconds)` is told of each finished request (for the metrics)."""
        self._prefix = prefix
        self._ids = itertools.count(1)
        self._requests: dict[str, Request] = {}
        self._lock = threading.Lock()
        self._journal = journal
        self._on_finish = on_finish
        self._last_done = 0.0
        self.accepted: collections.Counter[str] = collections.Counter()  # requests taken on, by kind
        self._unfinished: collections.Counter[str] = collections.Counter()  # per tenant, kept as they change

    def add(self, tenant: str, kind: str, future: Any, encode: Encoder, model_id: str | None = None) -> str:
        """Take on a request whose work is `future` (already started); its request id."""
        request = self.open(tenant, kind, model_id)
        self.attach(request, future, encode)
        return request.request_id

    def open(self, tenant: str, kind: str, model_id: str | None = None) -> Request:
        """A request id, journaled as pending, before its work starts (`attach` gives it the work). Journaled
        first because the journal's write releases the GIL and takes it back: done beside a request that
        has started, it waits for that request's Python (~0.7 ms a write on 2 cores, measured)."""
        with self._lock:
            request = Request(f"{self._prefix}-{next(self._ids)}", tenant, kind, model_id)
            self._requests[request.request_id] = request
            self.accepted[kind] += 1
            self._unfinished[tenant] += 1
        if self._journal is not None:
            self._journal.submitted(request.request_id, tenant, kind, model_id)
        return request

    def attach(self, request: Request, future: Any, encode: Encoder) -> None:
        """`request`'s work: when `future` finishes, its encoded result (or error) is the answer."""
        inner = as_concurrent(future)
        ran = not inner.done()  # one answered at once never waited in a queue
        inner.add_done_callback(lambda done: self._finish(request, done, encode, ran))

    def _finish(
        self, request: Request, done: concurrent.futures.Future[Any], encode: Encoder, ran: bool
    ) -> None:
        exc = done.exception()
        try:
            answer = error_answer(exc) if exc is not None else encode(done.result())
        except Exception as failure:  # noqa: BLE001 - an unencodable result is the request's error
            answer = error_answer(RuntimeError(f"the result could not be encoded: {failure}"))
        self.resolve(request, answer, ran)

    def resolve(self, request: Request, answer: Answer, ran: bool = False) -> None:
        """Journal the answer, then let pollers see it (so an answer once seen survives a crash). The
        first answer wins (a request failed at shutdown may still finish after)."""
        now = time.monotonic()
        with self._lock:
            if request.finished is not None:
                return
            request.finished = now
            self._unfinished[request.tenant] -= 1
            if not self._unfinished[request.tenant]:
                del self._unfinished[request.tenant]
            # the backend runs one call at a time: this one started when the one before it finished
            queued = max(0.0, self._last_done - request.submitted) if ran else 0.0
            if ran:
                self._last_done = now
        if self._journal is not None:
            self._journal.finished(request.request_id, answer)
        request.answer.set_result(answer)
        if self._on_finish is not None:
            self._on_finish(request, queued)

    def get(self, request_id: str, tenant: str) -> Request:
        """The request in memory, else its journaled answer; UnknownRequest for another tenant's."""
        request = self._requests.get(request_id)
        if request is None and self._journal is not None:
            row = self._journal.future(request_id)
            if row is not None and row.status == "done" and row.answer is not None:
                request = Request(row.request_id, row.tenant, row.kind, row.model_id)
                request.answer.set_result(row.answer)
        if request is None or request.tenant != tenant:
            raise UnknownRequest(request_id)
        return request

    def retrieved(self, request: Request) -> None:
        """Its answer was handed out: memory lets it go (a poll again is answered from the journal)."""
        if self._journal is not None:
            with self._lock:
                self._requests.pop(request.request_id, None)

    def unfinished(self, tenant: str) -> int:
        """The tenant's requests taken on and not finished (a counter: no scan of the requests in memory)."""
        with self._lock:
            return self._unfinished[tenant]

    def pending(self) -> list[Request]:
        return [r for r in list(self._requests.values()) if not r.answer.done()]

    def in_memory(self) -> int:
        return len(self._requests)

    def evict(self, ttl_seconds: float) -> int:
        """Drop finished requests older than `ttl_seconds` from memory (the journal still has them)."""
        if self._journal is None:
            return 0  # nowhere else to answer from
        horizon = time.monotonic() - ttl_seconds
        with self._lock:
            old = [k for k, r in self._requests.items() if r.answer.done() and (r.finished or 0.0) < horizon]
            for key in old:
                del self._requests[key]
        return len(old)

    def fail_pending(self, message: str) -> list[Request]:
        """Answer every unfinished request with a server error (`message`); those requests."""
        failing = self.pending()
        for request in failing:
            self.resolve(request, {"error": message, "category": "server"})
        return failing

    @staticmethod
    async def wait(request: Request, timeout: float, stop: asyncio.Event | None = None) -> bool:
        """Whether the request finished within `timeout` seconds (the long poll; `stop` ends it early)."""
        if request.answer.done():
            return True
        # shielded: cancelling the wait must not cancel the answer
        waiters: set[asyncio.Future[Any]] = {
            asyncio.ensure_future(asyncio.shield(asyncio.wrap_future(request.answer)))
        }
        if stop is not None:
            waiters.add(asyncio.ensure_future(stop.wait()))
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        return request.answer.done()

    def wait_all(self, timeout: float) -> None:
        """Block until every request in memory has finished, or `timeout` seconds have passed."""
        pending = [r.answer for r in self.pending()]
        concurrent.futures.wait(pending, timeout=timeout)


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


def chain(start: Callable[[], Any], outer: concurrent.futures.Future[Any]) -> None:
    """Call `start()` (it submits work and returns a future) and copy its outcome into `outer`; an
    exception from `start` itself (an invalid request) becomes `outer`'s."""
    try:
        inner = as_concurrent(start())
    except Exception as exc:  # noqa: BLE001 - an invalid request's error is its result
        outer.set_exception(exc)
        return

    def copy(done: concurrent.futures.Future[Any]) -> None:
        if done.exception() is not None:
            outer.set_exception(done.exception())
        else:
            outer.set_result(done.result())

    inner.add_done_callback(copy)


Start = Callable[[], Any]


@dataclass
class _ModelQueue:
    next_seq: int = 1
    parked: dict[int, tuple[Start, concurrent.futures.Future[Any]]] = field(default_factory=dict)
    seen: dict[int, str] = field(default_factory=dict)  # seq_id -> request id of its first delivery
    waiting_since: float | None = None  # monotonic time the first parked request began to wait for next_seq


def _take_ready(queue: _ModelQueue) -> list[tuple[Start, concurrent.futures.Future[Any]]]:
    """The parked requests that can start now (from next_seq on, without a gap); the clock of the wait for
    the next missing one starts when one is parked behind it (the caller holds the lock)."""
    ready = []
    while queue.next_seq in queue.parked:
        ready.append(queue.parked.pop(queue.next_seq))
        queue.next_seq += 1
    if not queue.parked:
        queue.waiting_since = None
    elif ready or queue.waiting_since is None:
        queue.waiting_since = time.monotonic()
    return ready


class Sequencer:
    """Per training model: start requests in seq_id order; a repeated seq_id is the same request. A sampling
    session's seq_ids are remembered here too (`seen`/`remember`, never `submit`: samples run in any order),
    so that a retried `asample` gets the first one's request id."""

    def __init__(self, journal: Journal | None = None) -> None:
        self._models: dict[str, _ModelQueue] = {}
        self._lock = threading.Lock()
        self._journal = journal

    def restore(self, model_id: str, seen: dict[int, str]) -> None:
        """After a restart: the ids seen before it; the sequence goes on after the highest."""
        with self._lock:
            self._models[model_id] = _ModelQueue(max(seen, default=0) + 1, {}, dict(seen))

    def seen(self, model_id: str, seq_id: int) -> str | None:
        with self._lock:
            return self._models.setdefault(model_id, _ModelQueue()).seen.get(seq_id)

    def is_next(self, model_id: str, seq_id: int) -> bool:
        """Whether `seq_id` is the one the model waits for: it starts at once (with any parked after it)."""
        with self._lock:
            return self._models.setdefault(model_id, _ModelQueue()).next_seq == seq_id

    def remember(self, model_id: str, seq_id: int, request_id: str) -> None:
        with self._lock:
            seen = self._models.setdefault(model_id, _ModelQueue()).seen
            seen[seq_id] = request_id
            if len(seen) > 2 * SEQS_KEPT:  # a retry comes soon after its first delivery: keep the latest
                for old in sorted(seen)[:-SEQS_KEPT]:
                    del seen[old]
        if self._journal is not None:
            self._journal.seq(model_id, seq_id, request_id)

    def forget(self, key: str) -> None:
        """Forget what a sampling session's seq_ids were (it was released)."""
        with self._lock:
            self._models.pop(key, None)
        if self._journal is not None:
            self._journal.forget_seqs(key)

    def submit(self, model_id: str, seq_id: int, start: Start) -> concurrent.futures.Future[Any]:
        """A future for `start()`'s result, started once every lower seq_id of the model has started.

        `start` submits the work (to the backend's ordered queue) and returns its future, or raises for a
        request that is invalid: that error becomes the request's result and the sequence moves on."""
        outer: concurrent.futures.Future[Any] = concurrent.futures.Future()
        ready: list[tuple[Start, concurrent.futures.Future[Any]]] = []
        with self._lock:
            queue = self._models.setdefault(model_id, _ModelQueue())
            if seq_id < queue.next_seq:
                outer.set_exception(ValueError(f"seq_id {seq_id} of {model_id} was already used"))
                return outer
            queue.parked[seq_id] = (start, outer)
            ready = _take_ready(queue)
        for begin, future in ready:  # in order, outside the lock (starting only queues the work)
            chain(begin, future)
        return outer

    def skip_gaps(self, older_than_s: float) -> list[tuple[str, int]]:
        """Give up on seq_ids that requests have waited for longer than `older_than_s`: the SDK spends a
        seq_id before sending, and after a 429 it retried for its whole window (300 s) it never sends it
        again, so its model's later requests would wait forever. The sequence moves on to the lowest parked
        seq_id; the missing one, should it come after all, is refused as already used. Returns the (model,
        first skipped seq_id) pairs."""
        now, skipped, ready = time.monotonic(), [], []
        with self._lock:
            for model_id, queue in self._models.items():
                if (
                    not queue.parked
                    or queue.waiting_since is None
                    or now - queue.waiting_since < older_than_s
                ):
                    continue
                skipped.append((model_id, queue.next_seq))
                queue.next_seq = min(queue.parked)
                ready += _take_ready(queue)
        for begin, future in ready:
            chain(begin, future)
        return skipped

    def fail_parked(self, exc: BaseException) -> int:
        """Fail every request waiting for a lower seq_id (at shutdown: the missing one will not come)."""
        with self._lock:
            parked = [future for queue in self._models.values() for _, future in queue.parked.values()]
            for queue in self._models.values():
                queue.parked.clear()
        for future in parked:
            future.set_exception(exc)
        return len(parked)
