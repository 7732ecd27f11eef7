"""The backend's one ordered queue of calls, where waiting forward passes of different models share a pass.

Every call of the explicit API runs on one thread, in submission order, so a client's `forward_backward`
then `optim_step` pipeline without waiting and never reorder. Many tenants, each with its LoRA adapter on
the one base model, send small requests; run one after another, each pays a whole pass over the base. So
when a shareable call (a LoRA adapter's `forward` or `forward_backward`) reaches the front, the queue also
takes the waiting calls of the same kind of *other* models, up to a token budget, and runs them as one pass
(tinker's "clock cycle"). A call only moves ahead of calls of other models, never of its own model's
earlier calls (nor of a call that names no model, a barrier), so every model still sees its calls in order,
and a model's results cannot depend on another model's calls (adapters share only the frozen base).

Fair across models: when a shareable call is at the front, the pass is led by the waiting call of that kind
whose model was served least recently (round robin; the same moves the sharing already makes: ahead of other
models' calls only, never past a barrier or its own model's earlier calls). A tenant that queued a dozen
passes each filling the token budget no longer makes another's small request wait for all of them.

If a shared pass fails, its calls are run again one by one, so only a bad call fails; the runner must leave
no partial effect of the failed pass (`ApiWorker.forward_backward_routed` restores the gradients).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

BARRIER = None  # the key of a call that may touch anything: nothing moves ahead of it


@dataclass
class SharedCall:
    """A call that may share a pass: `kind` (calls of one kind only share), its model and size."""

    kind: str
    key: str
    tokens: int
    payload: Any
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


@dataclass
class _Call:
    key: str | None
    fn: Callable[[], Any] | None = None
    shared: SharedCall | None = None
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


RunShared = Callable[[Sequence[SharedCall]], Sequence[Any]]


class CallQueue:
    def __init__(self, run_shared: RunShared, max_shared_tokens: int, name: str = "posttrain-api") -> None:
        """`run_shared(calls)` runs calls of one kind as one pass and returns their results in order;
        `max_shared_tokens`: the most tokens one shared pass takes (0: every call runs alone)."""
        self._run_shared = run_shared
        self._max_tokens = max_shared_tokens
        self._calls: collections.deque[_Call] = collections.deque()
        self._ready = threading.Condition()
        self._closed = False
        self.shared_passes: collections.Counter[int] = collections.Counter()  # calls per pass -> passes
        # when each model's shareable call last ran (a tick per pass; least recent first), the newest kept
        self._served: collections.OrderedDict[str | None, int] = collections.OrderedDict()
        self._tick = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], key: str | None = BARRIER) -> concurrent.futures.Future[Any]:
        """Run `fn` after every call submitted before it (`key`: the model it touches; None = any)."""
        return self._put(_Call(key, fn=fn))

    def submit_shared(self, call: SharedCall) -> concurrent.futures.Future[Any]:
        """Run `call`, possibly in one pass with waiting calls of the same kind of other models."""
        self._put(_Call(call.key, shared=call, future=call.future))
        return call.future

    def _put(self, call: _Call) -> concurrent.futures.Future[Any]:
        with self._ready:
            if self._closed:
                raise RuntimeError("the backend is closed")
            self._calls.append(call)
            self._ready.notify()
        return call.future

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join()

    # ---- the thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._calls and not self._closed:
                    self._ready.wait()
                if not self._calls:
                    return
                call = self._pop_next()
                group = self._take_companions(call.shared) if call.shared is not None else []
                if call.shared is not None:
                    self._mark_served([call.key, *(c.key for c in group)])
            if call.shared is None:
                _settle(call.future, call.fn)  # type: ignore[arg-type]
            else:
                self._run_group([call.shared, *group])

    def _pop_next(self) -> _Call:
        """The front call; if it may share a pass, the waiting call of its kind whose model was served least
        recently (each model's first waiting call only, none past a barrier). Called under the lock."""
        head = self._calls[0]
        if head.shared is None:
            return self._calls.popleft()
        kind, best, seen = head.shared.kind, head, set()
        for call in self._calls:
            if call.key is BARRIER:
                break
            eligible = call.shared is not None and call.shared.kind == kind and call.key not in seen
            if eligible and self._served.get(call.key, 0) < self._served.get(best.key, 0):
                best = call
            seen.add(call.key)
        self._calls.remove(best)
        return best

    def _mark_served(self, keys: list[str | None]) -> None:
        self._tick += 1
        for key in keys:
            self._served[key] = self._tick
            self._served.move_to_end(key)
        while len(self._served) > 65_536:  # forgotten models count as never served: first in line
            self._served.popitem(last=False)

    def _take_companions(self, first: SharedCall) -> list[SharedCall]:
        """Waiting calls that may join `first`'s pass, removed from the queue (called under the lock)."""
        if self._max_tokens <= 0:
            return []
        taken, blocked, tokens = [], {first.key}, first.tokens
        for call in list(self._calls):
            if call.key is BARRIER:
                break
            shared = call.shared
            joins = (
                shared is not None
                and shared.kind == first.kind
                and call.key not in blocked
                and tokens + shared.tokens <= self._max_tokens
            )
            if joins:
                assert shared is not None
                taken.append(shared)
                tokens += shared.tokens
                self._calls.remove(call)
            blocked.add(call.key)  # its model's later calls stay behind it (or behind the one taken)
        return taken

    def _run_group(self, calls: list[SharedCall]) -> None:
        self.shared_passes[len(calls)] += 1
        try:
            results = self._run_shared(calls)
        except BaseException as exc:  # noqa: BLE001 - delivered to the callers
            if len(calls) == 1:
                calls[0].future.set_exception(exc)
                return
            for call in calls:  # find the culprit: each alone, so the others still succeed
                self._run_group([call])
            return
        for call, result in zip(calls, results, strict=True):
            call.future.set_result(result)


def _settle(future: concurrent.futures.Future[Any], fn: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - delivered to the caller
        future.set_exception(exc)
