"""HTTP plumbing shared by the SGLang and vLLM clients.

One :class:`ServerClient` per server: an ``aiohttp`` session with its own connection pool,
bounded retries of calls that never reached the server (or got 502/503/504), and errors
that carry the server's own message (``{"error": {"message": ...}}``, FastAPI's
``{"detail": ...}`` or plain text). :func:`wait_ready` waits, bounded, for a server's
health check and says which server is not up and what it last answered.

(aiohttp rather than httpx: a call costs it about a third of the CPU, which is what an
abort fanned out to many servers is made of.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp

from tailcut.engine.base import EngineDied, EngineError

RETRY_STATUSES = frozenset({502, 503, 504})
"""Statuses a proxy or a starting server answers: worth another try."""

_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 1.0
_MESSAGE_LIMIT = 2000
_MAX_EVENT_BYTES = 256 * 1024 * 1024
_NOT_CONNECTED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
"""The call never reached the server (refused, no route, or the connect timed out): another
try is safe for any call."""
"""One streamed event may carry a whole output (SGLang streams cumulatively by default)."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Answer:
    """A server's whole answer to one call."""

    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body.strip() else None

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class ServerHTTPError(EngineError):
    """A server answered with an error status; ``message`` is what it said."""

    def __init__(self, url: str, path: str, status: int, message: str) -> None:
        self.url = url
        self.path = path
        self.status = status
        self.message = message
        super().__init__(f"{url}{path} answered HTTP {status}: {message}")


class ServerUnreachable(EngineDied):
    """A server could not be reached (refused, reset, or gone mid-answer)."""


def server_message(body: bytes | str) -> str:
    """The human part of an error body: the JSON ``message``/``detail`` if any, else text."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:_MESSAGE_LIMIT] or "(empty body)"
    found = _find_message(data)
    return (found if found is not None else text.strip())[:_MESSAGE_LIMIT]


def _find_message(data: Any) -> str | None:
    if isinstance(data, str):
        return data
    if isinstance(data, list):
        parts = [m for m in (_find_message(x) for x in data) if m]
        return "; ".join(parts) if parts else None
    if isinstance(data, dict):
        for key in ("error", "detail", "message", "msg"):
            if key in data and (found := _find_message(data[key])):
                return found
    return None


def check_url(url: str) -> str:
    """``url`` without a trailing slash; a ValueError naming it if it is not http(s)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"server URL {url!r} must look like http://HOST:PORT (engine.urls lists them)"
        )
    return url.rstrip("/")


def _backoff(attempt: int) -> float:
    return min(_BACKOFF_FIRST_S * 2**attempt, _BACKOFF_MAX_S)


class ServerClient:
    """Calls to one server. ``label`` names the engine kind in error messages."""

    def __init__(
        self,
        url: str,
        *,
        label: str,
        connect_timeout_s: float = 10.0,
        retries: int = 3,
        max_connections: int = 1024,
        api_key: str | None = None,
    ) -> None:
        self.url = check_url(url)
        self.label = label
        self.retries = retries
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"ServerClient({self.url!r})"

    @property
    def session(self) -> aiohttp.ClientSession:
        """Made on first use, inside the running event loop."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0),
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
            )
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Any = None,
        timeout_s: float | None = None,
        retries: int | None = None,
        idempotent: bool = True,
    ) -> Answer:
        """Send one call and return its answer; raise ``ServerHTTPError`` for a status of
        400 or more (after retrying 502/503/504), ``ServerUnreachable`` when the server
        cannot be reached after the retries, ``EngineError`` on a timeout.

        A call that is not ``idempotent`` is retried only when it never reached the server.
        """
        attempts = 1 + (self.retries if retries is None else retries)
        limit = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
        for attempt in range(attempts):
            last = attempt + 1 == attempts
            try:
                async with self.session.request(
                    method, self.url + path, json=json, params=params, timeout=limit
                ) as resp:
                    answer = Answer(resp.status, await resp.read())
            except _NOT_CONNECTED as exc:  # before TimeoutError: a connect timeout is one
                if last:
                    raise self._unreachable(path, exc, attempts) from exc
            except TimeoutError as exc:
                raise EngineError(
                    f"{self.label} server {self.url}{path} did not answer within {timeout_s} s"
                ) from exc
            except aiohttp.ClientError as exc:
                if last or not idempotent:
                    raise self._unreachable(path, exc, attempt + 1) from exc
            else:
                if answer.status in RETRY_STATUSES and idempotent and not last:
                    pass
                elif answer.status >= 400:
                    raise ServerHTTPError(
                        self.url, path, answer.status, server_message(answer.body)
                    )
                else:
                    return answer
            await asyncio.sleep(_backoff(attempt))  # bounded retry of a remote call
        raise AssertionError("unreachable")  # pragma: no cover

    async def get_json(self, path: str, **kw: Any) -> Any:
        return (await self.request("GET", path, **kw)).json()

    async def post_json(self, path: str, body: Any = None, **kw: Any) -> Any:
        return (await self.request("POST", path, json=body, **kw)).json()

    @asynccontextmanager
    async def stream(self, path: str, body: Any) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST ``body`` and stream the answer. Retried only while it cannot connect; an
        error status raises ``ServerHTTPError`` with the server's message, a connection
        that fails at any point ``ServerUnreachable``. Leaving early closes the connection
        (servers abort a request whose client went away)."""
        for attempt in range(1 + self.retries):
            try:
                resp = await self.session.post(self.url + path, json=body)
            except _NOT_CONNECTED as exc:
                if attempt == self.retries:
                    raise self._unreachable(path, exc, attempt + 1) from exc
                await asyncio.sleep(_backoff(attempt))  # bounded retry of a remote call
                continue
            except aiohttp.ClientError as exc:  # reached it, no answer: never sent twice
                raise self._unreachable(path, exc, attempt + 1) from exc
            try:
                if resp.status >= 400:
                    raw = await resp.read()
                    raise ServerHTTPError(self.url, path, resp.status, server_message(raw))
                yield resp
            except aiohttp.ClientError as exc:
                raise self._unreachable(path, exc, 1) from exc
            finally:
                resp.close()
            return

    def _unreachable(self, path: str, exc: Exception, attempts: int) -> ServerUnreachable:
        detail = str(exc) or type(exc).__name__
        return ServerUnreachable(
            f"{self.label} server {self.url} unreachable ({path}, {attempts} attempt(s)): {detail}"
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a ``data: {...}`` event stream, up to ``data: [DONE]``."""
    while raw := await resp.content.readline(max_line_length=_MAX_EVENT_BYTES):
        if not raw.startswith(b"data:"):
            continue
        payload = raw[5:].strip()
        if payload == b"[DONE]":
            return
        if payload:
            yield json.loads(payload)


async def wait_ready(server: ServerClient, path: str, timeout_s: float) -> None:
    """Wait until ``GET path`` answers 200, at most ``timeout_s`` seconds.

    There is nothing to subscribe to on a remote server, so this asks again with a growing
    back-off (50 ms to 1 s); the error names the server and its last answer.
    """
    last = "no answer yet"
    attempt = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    await server.request("GET", path, retries=0, timeout_s=_BACKOFF_MAX_S * 5)
                    return
                except ServerHTTPError as exc:
                    last = f"HTTP {exc.status}: {exc.message}"
                except EngineError as exc:
                    last = str(exc)
                await asyncio.sleep(_backoff(attempt))
                attempt += 1
    except TimeoutError:
        raise EngineError(
            f"{server.label} server {server.url} not ready after {timeout_s:g} s "
            f"(GET {path}; last: {last}). Is it started, and is the URL right? "
            f"Raise engine.remote.ready_timeout_s if it loads slowly."
        ) from None


async def fan_out(coros: Iterable[Awaitable[T]]) -> list[T]:
    """Run ``coros`` concurrently in a TaskGroup; on failure raise the first error itself
    (not an ExceptionGroup), the others cancelled."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(_as_coro(c)) for c in coros]
    except* Exception as group:
        raise group.exceptions[0] from None
    return [t.result() for t in tasks]


async def _as_coro(aw: Awaitable[T]) -> T:
    return await aw


def prometheus_sum(text: str, name: str) -> float | None:
    """Sum of every sample of metric ``name`` (all label sets) in Prometheus text format;
    None when the metric is absent."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name) :]
        if not rest or rest[0] not in "{ ":
            continue
        try:
            total += float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        found = True
    return total if found else None
