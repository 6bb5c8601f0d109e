"""SGLang servers over HTTP: one client for one or many (data-parallel) servers.

Generation is SGLang's native ``POST /generate`` with token ids in and out::

    {"input_ids": [...], "rid": "<24-char id>", "return_logprob": true, "stream": false,
     "sampling_params": {"max_new_tokens", "temperature", "top_p", "stop_token_ids",
                         "ignore_eos", "sampling_seed"}}
    -> {"output_ids": [...], "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort", ...},
        "output_token_logprobs": [[logprob, token_id, null], ...], "completion_tokens", ...}}

The log-probs are temperature-scaled, without top-p (``scaled``; ``raw`` on servers run with
``SGLANG_RETURN_ORIGINAL_LOGPROB=1``: declare it in ``engine.remote.logprobs``); an entry
without one is NaN, never dropped (the list stays aligned with the tokens).

With ``engine.remote.stream=true`` the same comes as ``data: {...}`` events (cumulative by
default; incremental when the server runs ``--incremental-streaming-output``: both are
read) closed by ``data: [DONE]``.

Aborts: ``POST /abort_request {"rid": id}`` to the server that holds the request (SGLang
matches ``rid`` as a *prefix*, which is why tailcut ids have one fixed length), or
``{"abort_all": true}``. The aborted call comes back with finish reason ``abort`` and the
tokens generated so far. Verification reads ``GET /v1/loads`` (``num_running_reqs`` +
``num_waiting_reqs`` per data-parallel rank), or ``GET /get_load`` on older servers.

For a trainer sharing the GPUs: :meth:`release_memory` / :meth:`resume_memory` (tags
``kv_cache``, ``weights``, ``cuda_graph``), :meth:`update_weights_from_disk`,
:meth:`flush_cache`.

Weights in memory (:meth:`update_weights_from_distributed`), no disk in between::

    first time: GET /server_info (tp_size: the ranks each server brings; dp_size 1)
      ─► host a TCP store at master_address:port ─► POST /init_weights_update_group
         {master_address, master_port, rank_offset, world_size, group_name, backend} to
         every server, while joining as rank 0 (each server's TP workers take ranks
         rank_offset.. ; the call answers once they joined)       [engine/update_group.py]
    each bucket of tensors: POST /update_weights_from_distributed {names, dtypes, shapes,
         group_name, flush_cache, weight_version} to every server, while broadcasting the
         tensors (src 0) in that order; each server receives, loads, answers {success,
         message}; the last bucket carries the version and the cache flush

New requests wait (client side) for the whole update, as for a load from disk; each
server's update waits for its running requests. Every step is bounded (``timeout_s``); a
server that refuses or does not join fails the update with its URL and message, and the
group is made anew at the next update (``engine/sglang_weights.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from tailcut.engine.base import AbortNotConfirmed, EngineError, MemoryReport
from tailcut.engine.http import ServerClient, ServerHTTPError, fan_out, sse_events
from tailcut.engine.remote import Flight, RemoteEngine
from tailcut.engine.sglang_weights import (
    DistributedUpdate,
    GroupOptions,
    form_group,
    send_buckets,
)
from tailcut.types import FinishReason, GenerateRequest, GenerateResult

if TYPE_CHECKING:
    import torch

    from tailcut.engine.update_group import UpdateGroup

MEMORY_TAGS = frozenset({"kv_cache", "weights", "cuda_graph"})

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def sampling_params(request: GenerateRequest) -> dict[str, Any]:
    s = request.sampling
    params: dict[str, Any] = {
        "max_new_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "ignore_eos": s.ignore_eos,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if s.stop_token_ids:
        params["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        params["sampling_seed"] = s.seed  # keyed by position: a continuation goes on as is
    return params


class SGLangEngine(RemoteEngine):
    """Generate on SGLang servers; aborts reach every server holding the request."""

    name = "sglang"
    health_path = "/health"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._load_path: dict[str, str | None] = {}
        self.update_group: UpdateGroup | None = None
        """The weight-update group with the servers (made at the first in-memory update)."""
        self._group_servers: list[ServerClient] = []
        self._leftovers: set[asyncio.Future[Any]] = set()

    # -- generate ------------------------------------------------------------------------

    async def _request(self, server: ServerClient, flight: Flight) -> GenerateResult:
        req = flight.request
        body = {
            "input_ids": list(req.prompt_ids),
            "sampling_params": sampling_params(req),
            "rid": req.request_id,
            "return_logprob": True,
            "stream": self.config.stream,
        }
        if req.sampling.priority is not None:  # with --enable-priority-scheduling
            body["priority"] = req.sampling.priority
        if not self.config.stream:
            answer = await server.request("POST", "/generate", json=body, idempotent=False)
            out = answer.json()
            self._absorb(flight, out)
            return self._result(server, flight, out)
        last: dict[str, Any] = {}
        async with server.stream("/generate", body) as resp:
            async for chunk in sse_events(resp):
                if "error" in chunk:
                    err = chunk["error"]
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    raise ServerHTTPError(server.url, "/generate", resp.status, str(msg))
                self._absorb(flight, chunk)
                last = chunk
        if not last or last.get("meta_info", {}).get("finish_reason") is None:
            raise EngineError(
                f"sglang server {server.url} ended the stream of {flight.rid} without a finish "
                f"reason after {len(flight.output_ids)} token(s)"
            )
        return self._result(server, flight, last)

    @staticmethod
    def _absorb(flight: Flight, out: dict[str, Any]) -> None:
        """Take the output ids and log-probs of one answer (whole or streamed chunk)."""
        meta = out.get("meta_info", {})
        ids = [int(t) for t in out.get("output_ids") or []]
        total = meta.get("completion_tokens")
        cumulative = total is None or len(ids) == total or not flight.output_ids
        lps = [_logprob(x) for x in meta.get("output_token_logprobs") or []]
        if cumulative:
            flight.output_ids = ids
            if lps or meta.get("output_token_logprobs") is not None:
                flight.logprobs = lps
        else:
            flight.output_ids.extend(ids)
            flight.logprobs.extend(lps)
        version = meta.get("weight_version")
        if isinstance(version, int) or (isinstance(version, str) and version.isdigit()):
            flight.weight_version = int(version)

    def _result(self, server: ServerClient, flight: Flight, out: dict[str, Any]) -> GenerateResult:
        meta = out.get("meta_info", {})
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        reason = _FINISH.get(kind or "")
        if reason is None:
            raise EngineError(
                f"sglang server {server.url} finished {flight.rid} with unknown reason {finish!r}"
            )
        if reason is FinishReason.ABORT and not flight.abort_sent:
            raise EngineError(
                f"sglang server {server.url} aborted {flight.rid} on its own: "
                f"{finish.get('message', 'no message') if isinstance(finish, dict) else finish}"
            )
        logprobs = flight.logprobs if len(flight.logprobs) == len(flight.output_ids) else None
        return GenerateResult(
            request_id=flight.rid,
            output_ids=list(flight.output_ids),
            finish_reason=reason,
            logprobs=list(logprobs) if logprobs is not None else None,
            weight_version=self.weight_version
            if flight.weight_version is None
            else flight.weight_version,
            prompt_tokens=int(meta.get("prompt_tokens", len(flight.request.prompt_ids))),
        )

    # -- abort and load ----------------------------------------------------------------

    async def _send_abort(
        self, server: ServerClient, request_ids: list[str], within_s: float
    ) -> None:
        if self.config.exclusive and self._all_ours_on(server, request_ids):
            body = {"rid": "", "abort_all": True}
            await server.request("POST", "/abort_request", json=body, timeout_s=within_s, retries=0)
            return
        await fan_out(
            server.request(
                "POST", "/abort_request", json={"rid": rid}, timeout_s=within_s, retries=0
            )
            for rid in request_ids
        )

    def _all_ours_on(self, server: ServerClient, request_ids: list[str]) -> bool:
        """Whether ``request_ids`` (more than one) cover every request of ours still open
        on ``server``."""
        index = self.servers.index(server)
        ids = set(request_ids)
        return len(ids) > 1 and all(
            f.rid in ids for f in self._flights.values() if f.server == index and f.open
        )

    async def _send_abort_all(self, server: ServerClient) -> None:
        await server.request(
            "POST", "/abort_request", json={"rid": "", "abort_all": True}, timeout_s=10.0
        )

    async def _load(self, server: ServerClient) -> tuple[int, int] | None:
        path = self._load_path.get(server.url, "/v1/loads")
        if path is None:
            return None
        try:
            if path == "/v1/loads":
                data = await server.get_json(
                    path, params={"include": "core"}, timeout_s=5.0, retries=0
                )
                ranks = data.get("loads", [])
                return (
                    sum(int(r.get("num_running_reqs", 0)) for r in ranks),
                    sum(int(r.get("num_waiting_reqs", 0)) for r in ranks),
                )
            data = await server.get_json(path, timeout_s=5.0, retries=0)
            ranks = data if isinstance(data, list) else [data]
            return (
                sum(int(r.get("num_reqs", 0)) for r in ranks),
                sum(int(r.get("num_waiting_reqs", 0)) for r in ranks),
            )
        except ServerHTTPError as exc:
            if exc.status != 404:
                raise
            self._load_path[server.url] = "/get_load" if path == "/v1/loads" else None
            return await self._load(server)

    # -- colocated trainer: memory, weights, cache -------------------------------------

    async def release_memory(self, tags: Sequence[str] | None = None) -> MemoryReport:
        """Free GPU memory on every server (``None``: all tags). Servers must be idle.
        The report has the time taken (the servers do not say how many bytes)."""
        start = time.monotonic()
        await self._each_server("POST", "/release_memory_occupation", json=_tags(tags))
        return MemoryReport(tuple(tags or sorted(MEMORY_TAGS)), time.monotonic() - start)

    async def resume_memory(self, tags: Sequence[str] | None = None) -> MemoryReport:
        """Take the released GPU memory back on every server (``None``: all tags)."""
        start = time.monotonic()
        await self._each_server("POST", "/resume_memory_occupation", json=_tags(tags))
        return MemoryReport(tuple(tags or sorted(MEMORY_TAGS)), time.monotonic() - start)

    async def flush_cache(self) -> None:
        """Drop every server's prefix cache (refused while requests run)."""
        await self._each_server("POST", "/flush_cache")

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: int | None = None,
        *,
        abort_in_flight: bool = False,
        abort_all: bool = False,
        flush_cache: bool = True,
    ) -> None:
        """Load new weights from ``model_path`` on every server (``POST
        /update_weights_from_disk``): SGLang lets running requests finish first and holds
        new ones until it has loaded (``abort_all``: it aborts every request, other
        clients' too; ``abort_in_flight``: ours only, verified). Its outputs then carry
        ``meta_info.weight_version``; ``flush_cache`` drops the prefix cache computed with
        the old weights. See :meth:`RemoteEngine.update_weights_from_disk`."""
        version = self.weight_version + 1 if weight_version is None else weight_version
        path = str(model_path)

        async def load(server: ServerClient) -> None:
            await self._load_on(server, path, version, abort_all, flush_cache)

        await self._update_weights(path, version, abort_in_flight, load)

    async def _load_weights(self, server: ServerClient, model_path: str, version: int) -> None:
        await self._load_on(server, model_path, version, False, True)

    async def _load_on(
        self, server: ServerClient, model_path: str, version: int, abort_all: bool, flush: bool
    ) -> None:
        body = {
            "model_path": model_path,
            "abort_all_requests": abort_all,
            "weight_version": str(version),
            "flush_cache": flush,
        }
        answer = await server.post_json(
            "/update_weights_from_disk", body, timeout_s=self.config.control_timeout_s
        )
        if isinstance(answer, dict) and not answer.get("success", False):
            raise EngineError(f"{server.url}: {answer.get('message', answer)}")

    # -- weights in memory: a process group with the servers ---------------------------

    async def update_weights_from_distributed(
        self,
        buckets: AsyncIterator[list[tuple[str, torch.Tensor]]],
        weight_version: int,
        options: GroupOptions,
        *,
        abort_in_flight: bool = False,
        flush_cache: bool = True,
    ) -> DistributedUpdate:
        """Broadcast the tensors of ``buckets`` (name, full tensor; in the servers' naming)
        into every live server's model, the group made first if there is none (or the last
        one broke); results of requests started afterwards carry ``weight_version``.
        Requests wait meanwhile (``abort_in_flight``: ours still running are aborted first).
        Raises ``EngineError`` naming the server and what it said, or what timed out."""
        if weight_version < 0:
            raise ValueError(f"sglang: weight version must be >= 0, got {weight_version}")
        if self._closed:
            raise EngineError("sglang engine is closed")
        await self.wait_ready()
        async with self._weights_lock:
            self._weights_idle.clear()
            try:
                if abort_in_flight and (ids := await self.in_flight()):
                    with contextlib.suppress(AbortNotConfirmed):
                        await self.abort(ids)  # each server still waits for what runs
                t0 = time.monotonic()
                servers = [self.servers[i] for i in self._alive()]
                group, init_s = self.update_group, 0.0
                if group is None or group.broken or servers != self._group_servers:
                    await self._drop_group()
                    group = await form_group(servers, options, self._leftovers)
                    self.update_group, self._group_servers = group, servers
                    init_s = time.monotonic() - t0
                t1 = time.monotonic()
                sent = await send_buckets(
                    group, servers, buckets, str(weight_version), flush_cache, options,
                    self._leftovers,
                )  # fmt: skip
                self.weight_version = weight_version
                return DistributedUpdate(sent, init_s, time.monotonic() - t1)
            finally:
                self._weights_idle.set()

    async def _drop_group(self) -> None:
        """Close our end of the group; ask the servers to drop theirs (best effort)."""
        group, self.update_group = self.update_group, None
        if group is None:
            return
        servers, self._group_servers = self._group_servers, []
        body = {"group_name": group.name}
        if not group.broken:
            with contextlib.suppress(EngineError):
                await fan_out(
                    s.post_json("/destroy_weights_update_group", body, timeout_s=10.0, retries=0)
                    for s in servers
                    if self.servers.index(s) not in self._dead
                )
        group.close()

    async def aclose(self) -> None:
        if not self._closed:
            await self._drop_group()
        await super().aclose()
        if self._leftovers:  # collectives given up on: each ends by its group's timeout
            await asyncio.wait(set(self._leftovers))

    async def model_info(self) -> list[dict[str, Any]]:
        """``GET /model_info`` of every live server."""
        return await self._each_server("GET", "/model_info", timeout_s=10.0)


def _tags(tags: Sequence[str] | None) -> dict[str, Any]:
    if tags is None:
        return {}
    bad = sorted(set(tags) - MEMORY_TAGS)
    if bad:
        raise ValueError(f"unknown SGLang memory tag(s) {bad}; known: {sorted(MEMORY_TAGS)}")
    return {"tags": list(tags)}


def _logprob(entry: Any) -> float:
    """The log-prob of one ``output_token_logprobs`` entry ``[logprob, token_id, text]``."""
    if isinstance(entry, list | tuple) and entry and entry[0] is not None:
        return float(entry[0])
    return math.nan
