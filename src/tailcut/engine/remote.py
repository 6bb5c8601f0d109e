"""Engines behind HTTP servers: request tracking, server choice, verified aborts.

Each ``generate`` runs as a *flight*: a task this engine owns, tied to the server that got
the request. The caller awaits it shielded, so a caller that gives up (a cut) does not tear
the connection down before the server has been told; ``abort`` then settles the flight.

::

    abort(ids) ─► group ids by the server holding each (a router in front does not
                  forward aborts, so each server is told directly)
       per server, concurrently:
         send the abort (server-specific) ─► wait for the generate calls to come back
            └─ not back: re-send every reabort_interval_s until the deadline,
               then close those connections (servers abort on disconnect) and report them
         ─► load counters: no more requests than ours still running there
            (re-read with back-off until the deadline)
    ids not confirmed ─► AbortNotConfirmed naming them; they stay in in_flight() until the
    server's counters show they stopped

A connection lost outside an abort raises ``EngineDied`` naming the server and request; a
server that is gone holds no requests, so aborts skip it.

Weights (:meth:`RemoteEngine.update_weights_from_disk`)::

    new requests wait (client side) ─► optionally abort ours still running (verified)
      ─► every live server loads the directory, concurrently (server-specific; each lets
         what still runs finish first) ─► all answered: results of requests started from
         now on carry the new version ─► new requests go
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import abstractmethod
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tailcut.config import RemoteEngineConfig
from tailcut.engine.base import AbortNotConfirmed, BaseEngine, EngineDied, EngineError, EngineStats
from tailcut.engine.http import ServerClient, ServerUnreachable, fan_out, wait_ready
from tailcut.types import FinishReason, GenerateRequest, GenerateResult

if TYPE_CHECKING:
    from typing import Self

    from tailcut.config import EngineConfig


@dataclass(eq=False)
class Flight:
    """One request on one server, with the output received so far."""

    request: GenerateRequest
    server: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_version: int | None = None
    abort_sent: bool = False
    closed: bool = False
    task: asyncio.Task[GenerateResult] | None = None
    scope: asyncio.Timeout | None = None

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def open(self) -> bool:
        return self.task is not None and not self.task.done()

    def close(self) -> None:
        """Stop waiting for the server: the connection closes and the call resolves as
        aborted with the tokens received so far."""
        self.closed = True
        if self.scope is not None and not self.scope.expired():
            self.scope.reschedule(asyncio.get_running_loop().time())


class RemoteEngine(BaseEngine):
    """Shared client logic; subclasses speak one server's protocol."""

    name = "remote"
    health_path = "/health"
    close_on_abort = False
    """True where closing the connection is the abort (vLLM)."""

    def __init__(
        self,
        urls: Sequence[str],
        config: RemoteEngineConfig | None = None,
        *,
        abort_deadline_s: float = 5.0,
    ) -> None:
        cfg = config or RemoteEngineConfig()
        if not urls:
            raise ValueError(
                f"{self.name}: engine.urls is empty; list the server(s), e.g. "
                f"engine.urls=[http://127.0.0.1:30000]"
            )
        self.config = cfg
        self.abort_deadline_s = abort_deadline_s
        self.servers = [
            ServerClient(
                url,
                label=self.name,
                connect_timeout_s=cfg.connect_timeout_s,
                retries=cfg.retries,
                max_connections=cfg.max_connections,
                api_key=cfg.api_key,
            )
            for url in urls
        ]
        self.weight_version = 0
        self.aborted = 0
        self.wasted_tokens = 0
        self._flights: dict[str, Flight] = {}
        self._ghosts: dict[str, int] = {}
        """Aborted ids not confirmed stopped, with their server."""
        self._tasks: set[asyncio.Task[GenerateResult]] = set()
        self._dead: dict[int, str] = {}
        self._rr = 0
        self._weights_idle = asyncio.Event()
        """Clear while a weight update runs: new requests wait for it."""
        self._weights_idle.set()
        self._weights_lock = asyncio.Lock()
        self._ready = False
        self._ready_lock = asyncio.Lock()
        self._closed = False

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> Self:
        return cls(cfg.urls, cfg.remote, abort_deadline_s=cfg.abort_deadline_s)

    # -- the server protocol (subclasses) ---------------------------------------------

    @abstractmethod
    async def _request(self, server: ServerClient, flight: Flight) -> GenerateResult:
        """Run the request on ``server``, recording partial output on ``flight``."""

    @abstractmethod
    async def _send_abort(
        self, server: ServerClient, request_ids: list[str], within_s: float
    ) -> None:
        """Tell ``server`` to abort these requests."""

    @abstractmethod
    async def _send_abort_all(self, server: ServerClient) -> None:
        """Tell ``server`` to abort everything it runs."""

    @abstractmethod
    async def _load(self, server: ServerClient) -> tuple[int, int] | None:
        """(running, waiting) requests on ``server``; None if it cannot say."""

    async def _on_ready(self) -> None:
        """Runs once, after every server passed its health check."""

    @abstractmethod
    async def _load_weights(self, server: ServerClient, model_path: str, version: int) -> None:
        """Make ``server`` load the weights in ``model_path`` and tag its outputs with
        ``version``; raise ``EngineError`` with the server's message if it could not."""

    # -- generate ------------------------------------------------------------------------

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait (bounded) until every server answers its health check."""
        if self._ready:
            return
        async with self._ready_lock:
            if self._ready:
                return
            limit = self.config.ready_timeout_s if timeout_s is None else timeout_s
            await fan_out(wait_ready(s, self.health_path, limit) for s in self.servers)
            await self._on_ready()
            self._ready = True

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        if self._closed:
            raise EngineError(f"{self.name} engine is closed")
        if request.request_id in self._flights:
            raise ValueError(f"request id {request.request_id} is already in flight")
        # Registered before the first await, so an abort that arrives while the servers
        # are still starting is not lost: the request then never leaves.
        flight = Flight(request, server=-1)
        self._flights[flight.rid] = flight
        try:
            await self.wait_ready()
            await self._weights_idle.wait()  # a request never straddles a weight update
            flight.server = self._pick()
        except BaseException:
            self._flights.pop(flight.rid, None)
            raise
        if flight.closed:
            self._flights.pop(flight.rid, None)
            return self._partial(flight)
        task = asyncio.create_task(self._run(flight), name=f"{self.name}:{request.request_id}")
        flight.task = task
        self._tasks.add(task)
        task.add_done_callback(self._forget)
        # Shielded: a caller that gives up must not drop the connection before the abort.
        return await asyncio.shield(task)

    def _forget(self, task: asyncio.Task[GenerateResult]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the caller that wanted it has it

    def _pick(self) -> int:
        alive = [i for i in range(len(self.servers)) if i not in self._dead]
        if not alive:
            raise EngineDied(
                f"{self.name}: every server is gone: " + "; ".join(self._dead.values())
            )
        start = self._rr % len(alive)
        self._rr += 1
        order = alive[start:] + alive[:start]
        if self.config.balance == "round-robin":
            return order[0]
        counts = Counter(f.server for f in self._flights.values() if f.server >= 0)
        return min(order, key=lambda i: counts[i])

    async def _run(self, flight: Flight) -> GenerateResult:
        server = self.servers[flight.server]
        try:
            async with asyncio.timeout(self.config.request_timeout_s) as scope:
                flight.scope = scope
                if flight.closed:
                    scope.reschedule(asyncio.get_running_loop().time())
                result = await self._request(server, flight)
        except TimeoutError:
            if not flight.closed:
                raise EngineError(
                    f"{self.name} server {server.url}: request {flight.rid} did not finish "
                    f"within engine.remote.request_timeout_s={self.config.request_timeout_s}"
                ) from None
            result = self._partial(flight)
        except EngineDied as exc:
            if not flight.abort_sent:
                self._dead.setdefault(flight.server, str(exc))
                raise EngineDied(
                    f"{self.name} server {server.url} lost request {flight.rid} after "
                    f"{len(flight.output_ids)} token(s): {exc}"
                ) from exc
            result = self._partial(flight)
        finally:
            flight.scope = None
            self._flights.pop(flight.rid, None)
        if result.finish_reason is FinishReason.ABORT:
            self.aborted += 1
            self.wasted_tokens += len(result.output_ids)
        return result

    def _partial(self, flight: Flight) -> GenerateResult:
        return GenerateResult(
            request_id=flight.rid,
            output_ids=list(flight.output_ids),
            finish_reason=FinishReason.ABORT,
            logprobs=list(flight.logprobs)
            if len(flight.logprobs) == len(flight.output_ids)
            else None,
            weight_version=self.weight_version
            if flight.weight_version is None
            else flight.weight_version,
            prompt_tokens=len(flight.request.prompt_ids),
        )

    # -- abort -------------------------------------------------------------------------

    async def abort(self, request_ids: Sequence[str]) -> None:
        by_server: dict[int, list[str]] = {}
        for rid in dict.fromkeys(request_ids):
            flight = self._flights.get(rid)
            if flight is not None:
                flight.abort_sent = True
                if flight.server < 0:  # not sent yet: it never will be, and is not in flight
                    flight.close()
                    self._flights.pop(rid, None)
                    continue
                server = flight.server
            elif rid in self._ghosts:
                server = self._ghosts[rid]
            else:
                continue  # unknown or already finished: nothing to do
            if server in self._dead:
                self._ghosts.pop(rid, None)
                if flight is not None:
                    flight.close()
                continue  # a server that is gone holds no requests
            by_server.setdefault(server, []).append(rid)
        if not by_server:
            return
        deadline = asyncio.get_running_loop().time() + self.abort_deadline_s
        stuck = await fan_out(self._abort_on(i, rids, deadline) for i, rids in by_server.items())
        ids = [rid for part in stuck for rid in part]
        if ids:
            raise AbortNotConfirmed(ids, self.name)

    async def abort_all(self) -> None:
        """Abort every request on every server (other clients' too), then verify ours."""
        for flight in self._flights.values():
            flight.abort_sent = True
        await fan_out(self._send_abort_all(self.servers[i]) for i in self._alive())
        await self.abort(list(self._flights))

    async def _abort_on(self, index: int, rids: list[str], deadline: float) -> list[str]:
        """Abort ``rids`` on one server; return the ids not confirmed stopped."""
        loop = asyncio.get_running_loop()
        flights = [f for rid in rids if (f := self._flights.get(rid)) is not None]
        pending = list(rids)
        while pending:
            if self.close_on_abort:  # closing is the abort itself: do it before anything
                for flight in flights:
                    flight.close()
            sent = await self._try_send_abort(index, pending, deadline - loop.time())
            if not sent and index in self._dead:
                for flight in flights:
                    flight.close()
                return []
            waiting = [f.task for f in flights if f.open and f.task is not None]
            remaining = deadline - loop.time()
            if not waiting or remaining <= 0:
                break
            # Woken as soon as every call is back; otherwise re-send after the interval.
            await asyncio.wait(waiting, timeout=min(self.config.reabort_interval_s, remaining))
            pending = [f.rid for f in flights if f.open]
        unanswered = [f for f in flights if f.open]
        for flight in unanswered:
            flight.close()  # stop waiting on it; the load check below has the last word
        settled = await self._load_settled(index, deadline) if self.config.verify_load else None
        if settled is None:  # no load counters: the answers are all we know
            settled = not unanswered
        if settled:
            for rid in rids:
                self._ghosts.pop(rid, None)
            return []
        for rid in rids:
            self._ghosts[rid] = index
        return list(rids)

    async def _try_send_abort(self, index: int, rids: list[str], remaining: float) -> bool:
        within_s = max(0.05, min(remaining, 4 * self.config.reabort_interval_s))
        try:
            await self._send_abort(self.servers[index], rids, within_s)
        except ServerUnreachable as exc:
            self._dead.setdefault(index, str(exc))
            return False
        except EngineError:
            return False  # a failed or hung abort call: sent again next round
        return True

    async def _load_settled(self, index: int, deadline: float) -> bool | None:
        """Whether the server runs no more requests than ours still open there (re-read
        with back-off until ``deadline``); None when it has no load counters."""
        loop = asyncio.get_running_loop()
        wait_s = 0.005
        while True:
            try:
                load = await self._load(self.servers[index])
            except EngineError:
                load = None
            if load is None:
                return None
            allowed = sum(
                1
                for f in self._flights.values()
                if f.server == index and f.open and not f.abort_sent
            )
            if sum(load) <= allowed:
                return True
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            await asyncio.sleep(min(wait_s, remaining))  # remote counters: nothing to await
            wait_s = min(wait_s * 2, self.config.reabort_interval_s)

    # -- weights -----------------------------------------------------------------------

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int | None = None, *, abort_in_flight: bool = False
    ) -> None:
        """Load the Hugging Face weights saved in ``model_path`` (same architecture; read by
        the servers at that path) on every server. Results of requests started afterwards
        carry ``weight_version`` (default: the current one plus one).

        New requests wait until every server has answered. With ``abort_in_flight`` our
        requests still running are aborted first; otherwise each server lets running
        requests finish under the old weights (and they keep the old version). If a server
        fails, the error names it and what it said, and the version stays unchanged.
        """
        version = self.weight_version + 1 if weight_version is None else weight_version
        path = str(model_path)
        await self._update_weights(
            path, version, abort_in_flight, lambda s: self._load_weights(s, path, version)
        )

    async def _update_weights(
        self,
        model_path: str,
        version: int,
        abort_in_flight: bool,
        load: Callable[[ServerClient], Awaitable[None]],
    ) -> None:
        if version < 0:
            raise ValueError(f"{self.name}: weight version must be >= 0, got {version}")
        if self._closed:
            raise EngineError(f"{self.name} engine is closed")
        await self.wait_ready()  # the first sync may come before any request
        async with self._weights_lock:  # one update at a time
            self._weights_idle.clear()
            try:
                if abort_in_flight and (ids := await self.in_flight()):
                    # Unconfirmed ones are no obstacle: each server waits for what still
                    # runs before it loads.
                    with contextlib.suppress(AbortNotConfirmed):
                        await self.abort(ids)
                failed = await self._on_each_server(load)
                if failed:
                    alive = [self.servers[i].url for i in self._alive()]
                    loaded = ", ".join(url for url in alive if url not in failed)
                    raise EngineError(
                        f"{self.name}: loading weights version {version} from {model_path} "
                        f"failed on " + "; ".join(f"{u}: {e}" for u, e in failed.items())
                        + (f" (loaded on {loaded}: servers differ now; sync again)" if loaded else "")
                    )  # fmt: skip
                self.weight_version = version
            finally:
                self._weights_idle.set()

    async def _on_each_server(
        self, call: Callable[[ServerClient], Awaitable[None]]
    ) -> dict[str, EngineError]:
        """Run ``call`` on every live server concurrently, none cancelling the others;
        returns the failures by server URL."""

        async def one(server: ServerClient) -> EngineError | None:
            try:
                await call(server)
            except EngineError as exc:
                return exc
            return None

        servers = [self.servers[i] for i in self._alive()]
        if not servers:
            raise EngineDied(
                f"{self.name}: every server is gone: " + "; ".join(self._dead.values())
            )
        results = await fan_out(one(s) for s in servers)
        return {s.url: exc for s, exc in zip(servers, results, strict=True) if exc is not None}

    # -- state -------------------------------------------------------------------------

    async def in_flight(self) -> list[str]:
        """Open requests, plus aborted ones their server's counters still show running."""
        ids = list(self._flights)
        if self._ghosts:
            now = asyncio.get_running_loop().time()
            for index in sorted(set(self._ghosts.values())):
                gone = index in self._dead
                if not gone and self.config.verify_load:
                    gone = await self._load_settled(index, now) is True
                if gone:
                    for rid in [r for r, i in self._ghosts.items() if i == index]:
                        del self._ghosts[rid]
            ids.extend(self._ghosts)
        return ids

    async def stats(self) -> EngineStats:
        loads = await fan_out(self._load_quietly(self.servers[i]) for i in self._alive())
        known = [x for x in loads if x is not None]
        running = sum(r for r, _ in known) if known else -1
        waiting = sum(w for _, w in known) if known else -1
        return EngineStats(
            running=running, waiting=waiting, aborted=self.aborted, wasted_tokens=self.wasted_tokens
        )

    async def _load_quietly(self, server: ServerClient) -> tuple[int, int] | None:
        try:
            return await self._load(server)
        except EngineError:
            return None

    def _alive(self) -> list[int]:
        return [i for i in range(len(self.servers)) if i not in self._dead]

    async def _each_server(self, method: str, path: str, **kw: Any) -> list[Any]:
        """The same control call on every live server, concurrently; JSON answers."""
        timeout_s = kw.pop("timeout_s", self.config.control_timeout_s)

        async def call(server: ServerClient) -> Any:
            resp = await server.request(method, path, timeout_s=timeout_s, **kw)
            return resp.json() if resp.body.strip().startswith((b"{", b"[")) else resp.text

        return await fan_out(call(self.servers[i]) for i in self._alive())

    async def aclose(self) -> None:
        """Abort what is still running (best effort), then close the connections."""
        if self._closed:
            return
        self._closed = True
        if self._flights:
            with contextlib.suppress(EngineError):
                await self.abort(list(self._flights))
        for flight in list(self._flights.values()):
            flight.close()
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks)
        for server in self.servers:
            await server.aclose()
