"""The wire side of the `http` backend: one connection to `posttrain serve` (or any server speaking tinker's
protocol), with retries, long polling of results and a session kept alive by heartbeats.

All requests run on one asyncio event loop in a daemon thread of its own (`Connection.submit` hands it a
coroutine and returns a concurrent future), so a caller's thread never blocks unless it asks for a result,
and many results can be long-polled at once over one pool of keep-alive connections.

The HTTP itself is a `Transport`: by default `AiohttpTransport` (aiohttp, whose parser is compiled). On the
2-core test machine it spends 0.48 ms of CPU per small request against httpx's 1.7 ms with its async client,
and an RL step's requests are small: a served `forward_backward` of one short sequence, which is two requests
(submit, then the long poll), cost the client 3.9 ms of CPU with aiohttp against 8.7 ms with httpx, on the
same cores as the server's compute (`bench/service.py`'s overhead probe). Tests and proxies pass their own
`Transport` (one that wraps the default to lose answers, say).

Retries follow tinker's SDK: 408, 409, 429, every 5xx and connection errors (refused, reset, timed out) are
tried again, up to `RetryPolicy.max_attempts` in all, after an exponentially growing delay with jitter (a
429's `Retry-After` is honoured when longer). A retried training request carries the seq_id of its first
attempt, so the server applies it once. Any other 4xx is an `ApiStatusError` naming the endpoint and the
server's `detail`; a 401 is an `AuthenticationError`. A request the server accepted and then failed is a
`RequestFailed` (a `UserRequestFailed`, also a ValueError, when the server blames the request).

`ModelSequence` numbers one training model's requests: it sends them one at a time in call order, each with
the model's next seq_id (from 1, as the server's Sequencer expects).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.metadata
import json
import logging
import random
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import aiohttp

log = logging.getLogger("posttrain.client.http")
T = TypeVar("T")
PROTO = "application/x-protobuf"


@dataclass(frozen=True)
class Reply:
    """A server's answer, read whole: status, headers (looked up case-insensitively) and body."""

    status: int
    headers: Mapping[str, str]
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


class TransportError(OSError):
    """No answer from the server: the connection was refused, reset or timed out (retryable; the request
    may or may not have arrived)."""


class Transport(Protocol):
    """How a `Connection` sends one HTTP request: `send` returns the whole answer, or raises
    `TransportError` when there is none."""

    async def send(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str], timeout_s: float
    ) -> Reply: ...

    async def aclose(self) -> None: ...


class AiohttpTransport:
    """The default `Transport`: one aiohttp session (made on the connection's loop at the first request),
    up to `max_connections` at once, the idle ones kept alive for the next request."""

    def __init__(self, max_connections: int = 256, connect_timeout_s: float = 10.0) -> None:
        self._max_connections = max_connections
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def send(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str], timeout_s: float
    ) -> Reply:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=True)
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(timeout_s, self._connect_timeout_s))
        try:
            async with self._session.request(
                method, url, data=body, headers=dict(headers), timeout=timeout
            ) as response:
                return Reply(response.status, response.headers, await response.read())
        except (aiohttp.ClientError, TimeoutError) as exc:  # refused, reset, timed out, cut short
            raise TransportError(f"{type(exc).__name__}: {exc or 'no response'}") from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class HttpApiError(RuntimeError):
    """A request to the server that did not give a result; `endpoint`, `status` (0: no HTTP answer)."""

    def __init__(self, message: str, endpoint: str, status: int = 0, detail: str = "") -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.status = status
        self.detail = detail


class ApiStatusError(HttpApiError, ValueError):
    """A 4xx that retrying cannot fix: the request is wrong (a ValueError, as the local backends raise)."""


class AuthenticationError(ApiStatusError):
    """401: the API key is missing or not one the server knows."""


class RetriesExhausted(HttpApiError):
    """Every attempt failed with a retryable status or a connection error."""


class RequestFailed(HttpApiError):
    """The server accepted the request, then its work failed (`category` "server", "user" or "unknown")."""

    def __init__(self, message: str, endpoint: str, request_id: str, category: str) -> None:
        super().__init__(message, endpoint)
        self.request_id = request_id
        self.category = category


class UserRequestFailed(RequestFailed, ValueError):
    """A request the server found invalid once it ran it (a ValueError, as the local backends raise)."""


@dataclass(frozen=True)
class RetryPolicy:
    """How retryable failures are retried: at most `max_attempts` tries of one request (the first
    included); before try n+1 a pause drawn uniformly from [d/2, d], d = min(max_delay_s, base_delay_s * 2^n)."""

    max_attempts: int = 6
    base_delay_s: float = 0.5
    max_delay_s: float = 10.0
    statuses: frozenset[int] = frozenset({408, 409, 429})  # and every 5xx

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")

    def retryable(self, status: int) -> bool:
        """408, 409, 429 and 5xx, except 501: an endpoint the server does not implement stays so."""
        return status in self.statuses or (status >= 500 and status != 501)

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        ceiling = min(self.max_delay_s, self.base_delay_s * 2**attempt)
        pause = random.uniform(ceiling / 2, ceiling)
        if retry_after is not None:
            pause = max(pause, min(retry_after, self.max_delay_s))
        return pause


def _detail(response: Reply) -> str:
    """The server's explanation: FastAPI's `{"detail": ...}`, else the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return response.text[:500]


def _retry_after(response: Reply) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


class Connection:
    """One server, one API key, one session; requests with retries and results by long polling."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout_s: float = 60.0,
        retry: RetryPolicy | None = None,
        heartbeat_s: float = 10.0,
        transport: Transport | None = None,
    ) -> None:
        """Opens the session at once, so a wrong address or key is an error here. `timeout_s` bounds
        each HTTP request and must exceed the server's long-poll time (posttrain serve: 20 s)."""
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.timeout_s = timeout_s
        self._transport: Transport = transport or AiohttpTransport()
        self._headers = {"X-API-Key": api_key, "User-Agent": "posttrain-http-client"}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="posttrain-http", daemon=True)
        self._thread.start()
        self._heartbeat: asyncio.Task[None] | None = None
        self.session_id = ""
        try:
            self.session_id = self.run(self._open_session(heartbeat_s))
        except BaseException:
            self.close()
            raise

    # ---- running on the loop -------------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coro` on the connection's loop; its future at once."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the connection's loop and wait for it (never from the loop's own thread)."""
        return self.submit(coro).result()

    # ---- requests ------------------------------------------------------------------------------
    async def request(
        self,
        method: str,
        endpoint: str,
        *,
        json_body: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        done_on_conflict: bool = False,
    ) -> Reply | None:
        """One request (a JSON body, or raw bytes as `content`), retried as `RetryPolicy` says. With
        `done_on_conflict`, a 409 after an attempt whose answer was lost means that attempt got through:
        None is returned (the caller checks)."""
        sent = {**self._headers, **(headers or {})}
        if json_body is not None:
            content = json.dumps(json_body).encode()
            sent["Content-Type"] = "application/json"
        url = self.base_url + endpoint
        last, lost = "", False
        for attempt in range(self.retry.max_attempts):
            retry_after = None
            try:
                response = await self._transport.send(method, url, content, sent, self.timeout_s)
            except TransportError as exc:  # refused, reset, timed out: no answer to go by
                last, lost = str(exc), True
            else:
                status = response.status
                if status < 400:
                    return response
                detail = _detail(response)
                if status == 409 and done_on_conflict and lost:
                    return None
                if not self.retry.retryable(status):
                    raise self._status_error(method, endpoint, status, detail)
                last, retry_after = f"HTTP {status}: {detail}", _retry_after(response)
                lost = lost or status >= 500  # a 5xx may come after the work was done
            if attempt + 1 < self.retry.max_attempts:
                pause = self.retry.delay(attempt, retry_after)
                log.warning("%s %s failed (%s); retrying in %.2fs", method, endpoint, last, pause)
                await asyncio.sleep(pause)
        raise RetriesExhausted(
            f"{method} {endpoint}: gave up after {self.retry.max_attempts} attempts; last: {last}",
            endpoint,
        )

    def _status_error(self, method: str, endpoint: str, status: int, detail: str) -> ApiStatusError:
        where = f"{method} {self.base_url}{endpoint}"
        if status == 401:
            return AuthenticationError(
                f"{where} answered 401: {detail}. Check the API key (api_key=, or TINKER_API_KEY / "
                "POSTTRAIN_API_KEY): the server does not know it",
                endpoint, status, detail,
            )  # fmt: skip
        return ApiStatusError(f"{where} answered {status}: {detail}", endpoint, status, detail)

    async def post(
        self, endpoint: str, body: Any, *, done_on_conflict: bool = False
    ) -> dict[str, Any] | None:
        """POST a JSON body (or protobuf bytes); the JSON answer."""
        if isinstance(body, bytes):
            response = await self.request(
                "POST",
                endpoint,
                content=body,
                headers={"Content-Type": PROTO},
                done_on_conflict=done_on_conflict,
            )
        else:
            response = await self.request("POST", endpoint, json_body=body, done_on_conflict=done_on_conflict)
        return None if response is None else response.json()

    async def get(self, endpoint: str) -> dict[str, Any]:
        response = await self.request("GET", endpoint)
        assert response is not None
        return dict(response.json())

    async def result(self, request_id: str, kind: str, proto: bool = False) -> Any:
        """The result of an accepted request, long-polled from `retrieve_future`: protobuf bytes for the
        two protobuf results (`proto`), else the JSON dict; a failure is raised as `RequestFailed`."""
        body = {"request_id": request_id, "allow_metadata_only": False}
        headers = {"Accept": PROTO} if proto else None
        while True:
            response = await self.request("POST", "/api/v1/retrieve_future", json_body=body, headers=headers)
            assert response is not None
            if PROTO in response.headers.get("content-type", ""):
                return response.content
            answer = response.json()
            if isinstance(answer, dict) and answer.get("type") == "try_again":
                continue  # the long poll ended before the work did
            if isinstance(answer, dict) and "error" in answer:
                category = str(answer.get("category") or "unknown").lower()
                error = UserRequestFailed if category == "user" else RequestFailed
                raise error(
                    f"{kind} (request {request_id}) failed on the server: {answer['error']}",
                    f"/api/v1/{kind}", request_id, category,
                )  # fmt: skip
            if proto:
                raise HttpApiError(f"{kind}: expected a protobuf result, got JSON {str(answer)[:200]}", kind)
            return answer

    # ---- session -------------------------------------------------------------------------------
    async def _open_session(self, heartbeat_s: float) -> str:
        try:
            version = importlib.metadata.version("posttrain")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        body = {
            "tags": [],
            "user_metadata": {},
            "sdk_version": f"posttrain-{version}",
            "type": "create_session",
        }
        answer = await self.post("/api/v1/create_session", body)
        assert answer is not None
        session_id = str(answer["session_id"])
        if heartbeat_s > 0:
            self._heartbeat = asyncio.create_task(self._beat(session_id, heartbeat_s))
        return session_id

    async def _beat(self, session_id: str, period_s: float) -> None:
        """Tell the server every `period_s` that the session's client is alive; failures are logged only."""
        body = {"session_id": session_id, "type": "session_heartbeat"}
        while True:
            await asyncio.sleep(period_s)
            try:
                await self.post("/api/v1/session_heartbeat", body)
            except HttpApiError as exc:
                if exc.status == 410:  # the session finished (expired while this process slept, say)
                    log.warning("session %s finished on the server: %s; heartbeats stop", session_id, exc)
                    return
                log.warning("session %s: heartbeat failed: %s", session_id, exc)
            except Exception as exc:  # noqa: BLE001 - a missed beat is not the caller's error
                log.warning("session %s: heartbeat failed: %s", session_id, exc)

    def close(self) -> None:
        """End the session (best effort), close the HTTP client and stop the loop."""
        if not self._thread.is_alive():
            return

        async def shut() -> None:
            if self._heartbeat is not None:
                self._heartbeat.cancel()
            if self.session_id:
                with contextlib.suppress(TransportError):
                    url = f"{self.base_url}/api/v1/sessions/{self.session_id}/finish"
                    headers = {**self._headers, "Content-Type": "application/json"}
                    await self._transport.send("POST", url, b"{}", headers, 5.0)
            await self._transport.aclose()

        with contextlib.suppress(Exception):
            self.run(shut())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


class Sender:
    """What a turn of a `ModelSequence` sends with: `await send(endpoint, body_of_seq_id)` -> request id;
    `send.release()` lets the model's next call send (after this turn's last request)."""

    def __init__(self, sequence: ModelSequence, done: concurrent.futures.Future[None]) -> None:
        self._sequence = sequence
        self._done = done

    async def __call__(self, endpoint: str, body: Callable[[int], Any]) -> str:
        return await self._sequence.send(endpoint, body)

    def release(self) -> None:
        if not self._done.done():
            self._done.set_result(None)


class ModelSequence:
    """One training model's requests, sent one at a time in call order, each with the next seq_id.

    The server starts a model's requests in seq_id order and waits for a missing one. As tinker's SDK does,
    a seq_id is spent once its request was answered, whatever the answer: the server consumes the seq_id of
    a request it refused with a 4xx that is not retried, and skips one missing for longer than its
    `seq_gap_seconds` (a 429 retried until the client gave up). A request that got no answer after every
    retry may or may not have arrived, so the sequence stops there with an error naming it rather than hang
    or apply something twice."""

    def __init__(self, conn: Connection, model_id: str) -> None:
        self._conn = conn
        self.model_id = model_id
        self._lock = threading.Lock()
        self._tail: concurrent.futures.Future[None] | None = None
        self._next_seq = 1
        self._broken: str | None = None

    def turn(self, run: Callable[[Sender], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Run `run(send)` on the loop once every earlier turn has released; its future at once."""
        with self._lock:
            mine: concurrent.futures.Future[None] = concurrent.futures.Future()
            previous, self._tail = self._tail, mine
        sender = Sender(self, mine)

        async def go() -> T:
            try:
                if previous is not None:
                    await asyncio.wrap_future(previous)
                return await run(sender)
            finally:
                sender.release()

        return self._conn.submit(go())

    async def send(self, endpoint: str, body: Callable[[int], Any]) -> str:
        if self._broken is not None:
            raise HttpApiError(self._broken, endpoint)
        seq_id = self._next_seq
        try:
            answer = await self._conn.post(endpoint, body(seq_id))
        except ApiStatusError:
            self._next_seq = seq_id + 1  # answered (refused): spent, as the SDK spends it
            raise
        except HttpApiError as exc:
            self._broken = (
                f"model {self.model_id}: request seq_id {seq_id} ({endpoint}) got no answer ({exc}); the "
                "server may or may not have it and runs a model's requests in seq_id order, so this client "
                "cannot go on: make a new one (e.g. create_training_client_from_state of a saved state)"
            )
            raise
        assert answer is not None
        self._next_seq = seq_id + 1
        return str(answer["request_id"])
