"""A fake SGLang server on 127.0.0.1, following the real server's HTTP shapes.

What it mirrors (SGLang's ``http_server.py``, ``io_struct.py``, ``tokenizer_manager.py``,
``scheduler.py``):

* ``POST /generate`` with ``input_ids``, ``sampling_params``, ``rid``, ``return_logprob``,
  ``stream``. Answers ``{"text", "output_ids", "meta_info"}``; ``meta_info`` has ``id``,
  ``finish_reason`` (``{"type": "stop", "matched": id}`` / ``{"type": "length", "length": n}``
  / ``{"type": "abort", "message": "Aborted", "status_code": null, "err_type": null}``),
  ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``weight_version`` (a string,
  ``"default"`` until an update names one) and, with ``return_logprob``,
  ``output_token_logprobs`` as ``[logprob, token_id, null]`` triples. Streaming sends
  ``data: {...}`` events, cumulative by default (``incremental=True`` sends deltas, as
  ``--incremental-streaming-output`` does), then ``data: [DONE]``. A client that
  disconnects gets its request aborted. A duplicate live ``rid`` is refused.
* ``POST /abort_request {"rid", "abort_all"}``: ``rid`` matches by *prefix* over waiting
  and running requests; a waiting request ends at once, a running one at the next decode
  step (without a new token); an empty ``rid`` without ``abort_all`` is ignored; unknown
  ids are a no-op. Always answers 200 with an empty body.
* ``GET /v1/loads`` (``include``, ``dp_rank``): ``{"timestamp", "version", "accelerator",
  "num_accelerators", "loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs", ...}]}``;
  ``legacy_load=True`` serves the older ``GET /get_load`` list instead.
* ``/flush_cache`` (400 "Flush cache failed." unless idle), ``/release_memory_occupation`` and
  ``/resume_memory_occupation`` (``tags``; release only when idle), ``/health`` and
  ``/health_generate`` (503 until ready), ``/model_info``.
* ``POST /update_weights_from_disk {"model_path", "load_format", "abort_all_requests",
  "weight_version", "flush_cache", ...}``: like the real server's model-update lock, every
  ``/generate`` call holds a reader share for its whole life and the update takes the writer
  side, so it waits for running requests (aborting them all first with
  ``abort_all_requests``) while new ones wait for it. It loads the ``*.safetensors`` (else
  ``*.bin``) files of the directory: a missing directory or one without weight files fails
  with HTTP 400 ``{"success": false, "message": "Failed to get weights iterator: ..."}`` and
  the old weights stay. On success: HTTP 200 ``{"success": true, "message": "Succeeded to
  update model weights.[ Weight version updated to V.]", "num_paused_requests": 0}``; the
  prefix cache is flushed unless ``flush_cache`` is false; ``meta_info.weight_version`` of
  later outputs is ``V``. The sampled tokens depend on the loaded weights (a checksum of the
  files salts :func:`fake_token`), so loading different weights changes the outputs and
  loading the same ones gives the same outputs again.

* Weights in memory, as SGLang's ``init_custom_process_group`` / ``ModelRunner`` do it:
  ``GET /server_info`` (and the older ``/get_server_info``) with ``tp_size``, ``dp_size``,
  ``pp_size``; ``POST /init_weights_update_group {"master_address", "master_port",
  "rank_offset", "world_size", "group_name", "backend"}``: each of the ``tp_size`` "TP
  workers" joins the trainer's group (gloo only here) as rank ``rank_offset + tp_rank``, in
  a thread, and the call answers once they all joined: ``{"success": true, "message":
  "Succeeded to initialize custom process group."}``, or HTTP 400 ``{"success": false,
  "message": "Failed to initialize custom process group: ...."}``. ``POST
  /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name",
  "flush_cache", "abort_all_requests", "weight_version"}`` takes the writer side of the
  model-update lock (like a load from disk), then every TP worker allocates the tensors
  and receives them from rank 0 in that order; the received tensors replace those of the
  same name in :attr:`FakeSGLangServer.received` (compare with :func:`tensors_checksum`:
  a test can prove a server holds exactly the actor's weights) and salt the sampled
  tokens. Answers ``{"success": true, "message": "Succeeded to update parameter
  online.[ Weight version updated to V.]"}``; an unknown group or a failed receive: HTTP
  400 with ``success: false``. ``POST /destroy_weights_update_group {"group_name"}``.

Decoding is one token per ``step_s`` for every running request (at most ``max_running``);
token ids and their log-probs are a pure function of (rid, position): see
:func:`fake_token`, :func:`fake_logprob`. Faults (:class:`FakeFaults`): lost aborts, slow
aborts, a wedged scheduler that ignores aborts, generate errors with a message, a server
that is not ready yet, and :meth:`FakeSGLangServer.kill` (dies mid-step: open connections
reset, port closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

VERSION = "0.5.23-fake"
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


def fake_token(rid: str, pos: int, vocab: int, weights: str = "") -> int:
    """Token the fake samples for request ``rid`` at output position ``pos`` (never 0-2)
    under the loaded ``weights`` (their checksum; "" for the weights it started with)."""
    return 3 + zlib.crc32(f"{weights}{rid}:{pos}".encode()) % (vocab - 3)


def fake_logprob(rid: str, pos: int, weights: str = "") -> float:
    return -0.01 - (zlib.crc32(f"lp:{weights}{rid}:{pos}".encode()) % 1000) / 250.0


def weights_checksum(path: Path) -> str | None:
    """Checksum of the weight files in ``path`` (None: no such directory or no weights)."""
    if not path.is_dir():
        return None
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not files:
        return None
    crc = 0
    for f in files:
        crc = zlib.crc32(f.read_bytes(), crc)
    return f"{crc:08x}:"


@dataclass
class FakeFaults:
    lose_aborts: int = 0
    """The next N ``/abort_request`` calls answer 200 and do nothing."""
    abort_delay_s: float = 0.0
    """``/abort_request`` answers only after this long (then acts)."""
    wedged: bool = False
    """Aborts and disconnects are ignored: requests decode on (a stuck scheduler)."""
    generate_errors: list[tuple[int, str]] = field(default_factory=list)
    """The next ``/generate`` calls fail with (HTTP status, message), in order."""
    init_errors: list[str] = field(default_factory=list)
    """The next ``/init_weights_update_group`` calls fail with this error, not joining."""
    join_hangs: bool = False
    """``/init_weights_update_group`` never joins nor answers (a server stuck in it)."""
    distributed_errors: list[str] = field(default_factory=list)
    """The next ``/update_weights_from_distributed`` calls fail before receiving."""
    update_errors: list[str] = field(default_factory=list)
    """The next ``/update_weights_from_disk`` calls fail while loading, in order, with
    "Failed to update weights: <error>. Rolling back to original weights."; the old
    weights and version stay."""


@dataclass(eq=False)
class FakeReq:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    ignore_eos: bool
    return_logprob: bool
    stream: bool
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    to_abort: bool = False
    abort_requested: bool = False
    tokens_after_abort: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set on every new token (streamed requests) and at the end."""
    done: asyncio.Event = field(default_factory=asyncio.Event)
    t0: float = field(default_factory=time.monotonic)


class FakeSGLangServer:
    def __init__(
        self,
        *,
        step_s: float = 0.002,
        max_running: int = 256,
        vocab: int = 1000,
        eos_id: int = 2,
        eos_at: int | None = None,
        ready: bool = True,
        incremental: bool = False,
        legacy_load: bool = False,
        faults: FakeFaults | None = None,
        model_path: str = "fake/model",
        changed: asyncio.Condition | None = None,
        tp_size: int = 1,
        group_timeout_s: float = 30.0,
    ) -> None:
        self.step_s = step_s
        self.max_running = max_running
        self.vocab = vocab
        self.eos_id = eos_id
        self.eos_at = eos_at
        """Emit EOS at this output position (None: only length ends a request)."""
        self.incremental = incremental
        self.legacy_load = legacy_load
        self.faults = faults or FakeFaults()
        self.model_path = model_path
        self.weight_version = "default"
        self.weights = ""
        """Checksum of the loaded weights ("": the ones it started with)."""
        self.update_log: list[dict[str, Any]] = []
        """Bodies of the ``/update_weights_from_disk`` calls, in order of arrival."""
        self.tp_size = tp_size
        self.group_timeout_s = group_timeout_s
        """Bound on joining a group and on each receive (as a process group's timeout)."""
        self.groups: dict[str, list[Any]] = {}
        """Weight-update groups joined: one backend per TP worker."""
        self.init_log: list[dict[str, Any]] = []
        self.dist_log: list[dict[str, Any]] = []
        """Bodies of the ``/update_weights_from_distributed`` calls, in order of arrival."""
        self.received: dict[str, Any] = {}
        """Tensors received over a weight-update group, by name (TP worker 0's copy)."""
        self._collectives: set[asyncio.Future[Any]] = set()
        """Joins and receives under way (each ends by ``group_timeout_s``): awaited at stop,
        so no thread is left inside torch when the process exits."""
        self.cache_flushes = 0
        self.released: set[str] = set()
        self.waiting: list[FakeReq] = []
        self.running: list[FakeReq] = []
        self.abort_log: list[dict[str, Any]] = []
        self.generate_log: list[str] = []
        self.finished: dict[str, dict[str, Any]] = {}
        self.aborted = 0
        self.tokens = 0
        self.url = ""
        self._ready = asyncio.Event()
        if ready:
            self._ready.set()
        self.changed = changed or asyncio.Condition()
        """Notified after every decode step, admission and abort (see :meth:`until`)."""
        self._wake = asyncio.Event()
        self._rw = asyncio.Condition()
        self._readers = 0
        self._writers_waiting = 0
        self._writer_active = False
        self._runner: web.AppRunner | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._requests: dict[int, web.BaseRequest] = {}
        self.dead = False

    # -- life cycle --------------------------------------------------------------------

    async def start(self) -> str:
        app = web.Application()
        app.middlewares.append(self._track)
        r = app.router
        r.add_route("*", "/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_get("/v1/loads" if not self.legacy_load else "/get_load", self.loads)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_route("*", "/release_memory_occupation", self.release_memory)
        r.add_route("*", "/resume_memory_occupation", self.resume_memory)
        r.add_post("/update_weights_from_disk", self.update_weights)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/model_info", self.model_info)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.1
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self._loop_task = asyncio.create_task(self._decode_loop())
        return self.url

    async def until(self, pred: Any) -> None:
        """Wait until ``pred()`` holds (re-checked at each state change)."""
        async with self.changed:
            await self.changed.wait_for(pred)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def set_ready(self) -> None:
        self._ready.set()

    def _collective(self, fn: Any, name: str) -> asyncio.Future[Any]:
        from tailcut.engine.update_group import in_thread

        future = asyncio.ensure_future(in_thread(fn, name))
        self._collectives.add(future)

        def settled(f: asyncio.Future[Any]) -> None:
            self._collectives.discard(f)
            if not f.cancelled():
                f.exception()  # answered to the client (or nobody is left to tell)

        future.add_done_callback(settled)
        return future

    async def stop(self) -> None:
        if self._collectives:
            await asyncio.wait(set(self._collectives))
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def kill(self) -> None:
        """Die mid-step: reset every open connection and close the port."""
        self.dead = True
        for request in list(self._requests.values()):
            if request.transport is not None:
                request.transport.abort()
        await self.stop()

    @web.middleware
    async def _track(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self._requests[id(request)] = request
        try:
            return await handler(request)
        finally:
            self._requests.pop(id(request), None)

    # -- scheduler ---------------------------------------------------------------------

    async def _decode_loop(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.step_s)
            while self.waiting and len(self.running) < self.max_running:
                self.running.append(self.waiting.pop(0))
            for req in list(self.running):
                self._step(req)
            self.running = [r for r in self.running if r.finish is None]
            await self._notify()
            if not self.running and not self.waiting:
                self._wake.clear()

    def _step(self, req: FakeReq) -> None:
        if req.to_abort:
            self._finish(req, _abort_reason())
            return
        pos = len(req.output_ids)
        if self.eos_at is not None and pos == self.eos_at and not req.ignore_eos:
            tok = self.eos_id
        else:
            tok = fake_token(req.rid, pos, self.vocab, self.weights)
        req.output_ids.append(tok)
        req.logprobs.append(fake_logprob(req.rid, pos, self.weights))
        self.tokens += 1
        if req.abort_requested:
            req.tokens_after_abort += 1
        if (tok == self.eos_id and not req.ignore_eos) or tok in req.stop_ids:
            self._finish(req, {"type": "stop", "matched": tok})
        elif len(req.output_ids) >= req.max_new_tokens:
            self._finish(req, {"type": "length", "length": req.max_new_tokens})
        elif req.stream:
            req.changed.set()

    def _finish(self, req: FakeReq, reason: dict[str, Any]) -> None:
        req.finish = reason
        if reason["type"] == "abort":
            self.aborted += 1
        self.finished[req.rid] = reason
        req.changed.set()
        req.done.set()

    def _abort_matching(self, prefix: str, abort_all: bool) -> None:
        for req in [r for r in self.waiting if abort_all or r.rid.startswith(prefix)]:
            self.waiting.remove(req)
            self._finish(req, _abort_reason())
        for req in self.running:
            if req.finish is None and (abort_all or req.rid.startswith(prefix)):
                req.to_abort = True

    def _live(self, rid: str) -> FakeReq | None:
        return next((r for r in self.waiting + self.running if r.rid == rid), None)

    def _client_gone(self, req: FakeReq) -> None:
        if req.finish is None and not self.faults.wedged:
            self._abort_matching(req.rid, False)

    # -- endpoints ---------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.faults.generate_errors:
            status, message = self.faults.generate_errors.pop(0)
            return _error(message, status)
        problem = self._check_generate(body)
        if problem:
            return _error(problem)
        sp = body.get("sampling_params") or {}
        req = FakeReq(
            rid=str(body.get("rid") or uuid.uuid4().hex),
            input_ids=[int(t) for t in body["input_ids"]],
            max_new_tokens=int(sp.get("max_new_tokens", 128)),
            stop_ids=frozenset(int(t) for t in sp.get("stop_token_ids") or ()),
            ignore_eos=bool(sp.get("ignore_eos", False)),
            return_logprob=bool(body.get("return_logprob", False)),
            stream=bool(body.get("stream", False)),
        )
        async with self._reading():
            return await self._run(request, req)

    async def _run(self, request: web.Request, req: FakeReq) -> web.StreamResponse:
        if self._live(req.rid) is not None:
            return _error(f"Duplicate request ID: {req.rid}")
        self.generate_log.append(req.rid)
        self.waiting.append(req)
        self._wake.set()
        await self._notify()
        if req.stream:
            return await self._stream(request, req)
        try:
            await req.done.wait()
        except asyncio.CancelledError:
            self._client_gone(req)
            raise
        return web.json_response(self._out(req, 0))

    def _check_generate(self, body: dict[str, Any]) -> str | None:
        if self.released & {"weights", "kv_cache"}:
            return f"memory released ({sorted(self.released)}); call /resume_memory_occupation"
        ids = body.get("input_ids")
        if body.get("text") is not None or not isinstance(ids, list) or not ids:
            return "Either text or input_ids should be provided (this fake takes input_ids)."
        sp = body.get("sampling_params") or {}
        if not 0.0 < float(sp.get("top_p", 1.0)) <= 1.0:
            return f"top_p must be in (0, 1], got {sp.get('top_p')}."
        if float(sp.get("temperature", 1.0)) < 0.0:
            return f"temperature must be non-negative, got {sp.get('temperature')}."
        if int(sp.get("max_new_tokens", 128)) < 0:
            return f"max_new_tokens must be at least 0, got {sp.get('max_new_tokens')}."
        return None

    async def _stream(self, request: web.Request, req: FakeReq) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = 0
        try:
            while True:
                req.changed.clear()
                if len(req.output_ids) > sent or req.finish is not None:
                    await resp.write(_sse(self._out(req, sent if self.incremental else 0)))
                    sent = len(req.output_ids)
                if req.finish is not None:
                    break
                await req.changed.wait()
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self._client_gone(req)
            raise
        return resp

    def _out(self, req: FakeReq, start: int) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish,
            "prompt_tokens": len(req.input_ids),
            "weight_version": self.weight_version,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
        }
        if req.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [lp, tok, None]
                for lp, tok in zip(req.logprobs[start:], req.output_ids[start:], strict=True)
            ]
        if req.finish is not None:
            meta["e2e_latency"] = time.monotonic() - req.t0
        ids = req.output_ids[start:]
        return {"text": " ".join(f"t{t}" for t in ids), "output_ids": ids, "meta_info": meta}

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.json()
        rid, abort_all = str(body.get("rid") or ""), bool(body.get("abort_all", False))
        self.abort_log.append({"rid": rid, "abort_all": abort_all})
        if self.faults.abort_delay_s:
            # A slow server still acts on the abort even if the client stopped waiting.
            await asyncio.shield(self._abort_later(self.faults.abort_delay_s, rid, abort_all))
        else:
            self._apply_abort(rid, abort_all)
        await self._notify()
        return web.Response()

    async def _abort_later(self, delay_s: float, rid: str, abort_all: bool) -> None:
        await asyncio.sleep(delay_s)
        self._apply_abort(rid, abort_all)

    def _apply_abort(self, rid: str, abort_all: bool) -> None:
        if self.faults.lose_aborts > 0:
            self.faults.lose_aborts -= 1
            return
        for req in self.waiting + self.running:
            if abort_all or (rid and req.rid.startswith(rid)):
                req.abort_requested = True
        if not self.faults.wedged and (rid or abort_all):
            self._abort_matching(rid, abort_all)

    async def loads(self, request: web.Request) -> web.Response:
        core = {
            "dp_rank": 0,
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "num_used_tokens": sum(len(r.input_ids) + len(r.output_ids) for r in self.running),
            "max_total_num_tokens": 1_000_000,
            "max_running_requests": self.max_running,
            "token_usage": 0.0,
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.0,
            "utilization": 0.0,
        }
        if self.legacy_load:
            legacy = {
                "dp_rank": 0,
                "num_reqs": len(self.running),
                "num_waiting_reqs": len(self.waiting),
            }
            legacy["num_tokens"] = core["num_used_tokens"]
            return web.json_response([legacy])
        include = request.query.get("include")
        if include and not set(include.split(",")) <= {
            "core",
            "memory",
            "spec",
            "lora",
            "disagg",
            "queues",
            "all",
        }:
            return web.json_response({"detail": f"Invalid include sections: {include}"}, status=400)
        return web.json_response(
            {
                "timestamp": "2026-01-01T00:00:00+00:00",
                "version": VERSION,
                "accelerator": None,
                "num_accelerators": 1,
                "loads": [core],
            }
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.running or self.waiting:
            return web.Response(text="Flush cache failed.\n", status=400)
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )

    async def _tags(self, request: web.Request) -> tuple[list[str] | None, web.Response | None]:
        raw = await request.read()
        tags = (json.loads(raw) if raw.strip() else {}).get("tags") or list(MEMORY_TAGS)
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            return None, _error(f"unknown memory tags {bad}")
        return tags, None

    async def release_memory(self, request: web.Request) -> web.Response:
        tags, err = await self._tags(request)
        if err is not None or tags is None:
            return err or _error("no tags")
        if self.running or self.waiting:
            return _error("release_memory_occupation should be called only when server is idle.")
        self.released.update(tags)
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags, err = await self._tags(request)
        if err is not None or tags is None:
            return err or _error("no tags")
        self.released.difference_update(tags)
        return web.json_response(None)

    # -- the model-update lock: generate calls read, a weight update writes ----------------

    @contextlib.asynccontextmanager
    async def _reading(self) -> Any:
        async with self._rw:
            await self._rw.wait_for(lambda: not self._writer_active and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            async with self._rw:
                self._readers -= 1
                self._rw.notify_all()

    @contextlib.asynccontextmanager
    async def _writing(self) -> Any:
        async with self._rw:
            self._writers_waiting += 1
            try:
                await self._rw.wait_for(lambda: not self._writer_active and not self._readers)
            finally:
                self._writers_waiting -= 1
                self._rw.notify_all()
            self._writer_active = True
        try:
            yield
        finally:
            async with self._rw:
                self._writer_active = False
                self._rw.notify_all()

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.update_log.append(body)
        if body.get("abort_all_requests"):
            self._abort_matching("", True)
            self._wake.set()
        async with self._writing():
            path = str(body.get("model_path", ""))
            weights = await asyncio.to_thread(weights_checksum, Path(path))
            if weights is None:
                exists = await asyncio.to_thread(Path(path).exists)
                why = (
                    f"Cannot find any model weights with `{path}`"
                    if exists
                    else f"{path} (repository not found)"
                )
                return _update_failed(f"Failed to get weights iterator: {why}.")
            if self.faults.update_errors:
                error = self.faults.update_errors.pop(0)
                return _update_failed(
                    f"Failed to update weights: {error}.\nRolling back to original weights."
                )
            self.model_path = path
            self.weights = weights
            if body.get("flush_cache", True):
                self.cache_flushes += 1
            message = "Succeeded to update model weights."
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
                message += f" Weight version updated to {self.weight_version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    # -- weights in memory: a weight-update process group ----------------------------------

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tp_size": self.tp_size,
                "dp_size": 1,
                "pp_size": 1,
                "enable_dp_attention": False,
                "version": VERSION,
            }
        )

    async def init_group(self, request: web.Request) -> web.Response:
        from tailcut.engine.update_group import join_group

        body = await request.json()
        missing = _missing(body, ("master_address", "master_port", "rank_offset", "world_size"))
        if missing:
            return missing
        self.init_log.append(body)
        if self.faults.init_errors:
            return _group_failed(self.faults.init_errors.pop(0))
        if self.faults.join_hangs:
            await asyncio.Event().wait()  # until the client gives up (the handler is cancelled)
        name, backend = str(body.get("group_name", "weight_update_group")), body.get("backend")
        if (backend or "nccl") != "gloo":
            return _group_failed(f"this fake joins gloo groups only, not {backend}")
        address, port = str(body["master_address"]), int(body["master_port"])
        offset, world = int(body["rank_offset"]), int(body["world_size"])

        def joiner(rank: int) -> Any:
            return lambda: join_group(
                address, port, rank, world, name, "gloo", self.group_timeout_s
            )

        try:
            workers = await asyncio.gather(
                *(
                    asyncio.shield(self._collective(joiner(offset + r), "fake-join"))
                    for r in range(self.tp_size)
                )
            )
        except Exception as exc:
            return _group_failed(str(exc))
        self.groups[name] = list(workers)
        return web.json_response(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        missing = _missing(body, ("names", "dtypes", "shapes"))
        if missing:
            return missing
        self.dist_log.append(body)
        if body.get("abort_all_requests"):
            self._abort_matching("", True)
            self._wake.set()
        async with self._writing():
            name = str(body.get("group_name", "weight_update_group"))
            if name not in self.groups:
                return _update_failed(
                    f"Group {name} not in {list(self.groups)}. Please call "
                    f"`init_weights_update_group` first."
                )
            if self.faults.distributed_errors:
                return _update_failed(_partial(self.faults.distributed_errors.pop(0)))
            try:
                copies = await self._receive(self.groups[name], body)
            except Exception as exc:
                return _update_failed(_partial(str(exc)))
            self.received.update(copies[0])
            bucket = tensors_checksum(copies[0])  # chained per bucket: the sampled tokens change
            self.weights = f"{zlib.crc32(f'{self.weights}{bucket}'.encode()):08x}:"
            if body.get("flush_cache", True):
                self.cache_flushes += 1
            message = "Succeeded to update parameter online."
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
                message += f" Weight version updated to {self.weight_version}."
        return web.json_response({"success": True, "message": message})

    async def _receive(self, workers: list[Any], body: dict[str, Any]) -> list[dict[str, Any]]:
        """Every TP worker allocates the tensors and receives them from rank 0, as the
        model runner does (all broadcasts posted, then waited)."""
        import datetime

        import torch
        from torch.distributed import BroadcastOptions

        specs = list(zip(body["names"], body["dtypes"], body["shapes"], strict=True))

        def receive(pg: Any) -> dict[str, Any]:
            out, works = {}, []
            for name, dtype, shape in specs:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                opts = BroadcastOptions()
                opts.rootRank, opts.rootTensor = 0, 0
                opts.timeout = datetime.timedelta(seconds=self.group_timeout_s)
                works.append(pg.broadcast([tensor], opts))
                out[name] = tensor
            for work in works:
                work.wait()
            return out

        def worker(pg: Any) -> Any:
            return lambda: receive(pg)

        return list(
            await asyncio.gather(
                *(asyncio.shield(self._collective(worker(pg), "fake-receive")) for pg in workers)
            )
        )

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = str(body.get("group_name", "weight_update_group"))
        if self.groups.pop(name, None) is None:
            return web.json_response(
                {"success": False, "message": "The group to be destroyed does not exist."},
                status=400,
            )
        return web.json_response(
            {"success": True, "message": "Succeeded to destroy custom process group."}
        )

    @property
    def update_waiting(self) -> bool:
        """A weight update waits for running requests."""
        return self._writers_waiting > 0

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self._ready.is_set() else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
                "load_format": "auto",
                "model_type": "qwen2",
                "architectures": ["Qwen2ForCausalLM"],
            }
        )


def _abort_reason() -> dict[str, Any]:
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def tensors_checksum(tensors: dict[str, Any]) -> str:
    """Checksum of named tensors (names, dtypes, shapes and bytes, in name order)."""
    import torch

    crc = 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        crc = zlib.crc32(f"{name}:{t.dtype}:{tuple(t.shape)}".encode(), crc)
        crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    return f"{crc:08x}"


def _missing(body: dict[str, Any], keys: tuple[str, ...]) -> web.Response | None:
    """FastAPI's answer to a body without required fields (HTTP 422)."""
    absent = [k for k in keys if k not in body]
    if not absent:
        return None
    detail = [{"type": "missing", "loc": ["body", k], "msg": "Field required"} for k in absent]
    return web.json_response({"detail": detail}, status=422)


def _group_failed(error: str) -> web.Response:
    return web.json_response(
        {"success": False, "message": f"Failed to initialize custom process group: {error}."},
        status=400,
    )


def _partial(error: str) -> str:
    return (
        f"Failed to update parameter online: {error}. The full weights of the ModelRunner "
        f"are partially updated. Please discard the whole weights."
    )


def _update_failed(message: str) -> web.Response:
    return web.json_response(
        {"success": False, "message": message, "num_paused_requests": 0}, status=400
    )


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@contextlib.asynccontextmanager
async def fake_servers(n: int = 1, **kw: Any) -> Any:
    """Start ``n`` fake servers (same settings, one shared ``changed`` condition); stop them
    all on exit."""
    changed = asyncio.Condition()
    servers = [FakeSGLangServer(changed=changed, **kw) for _ in range(n)]
    try:
        for server in servers:
            await server.start()
        yield servers
    finally:
        for server in servers:
            await server.stop()


async def _serve(n: int, step_s: float, vocab: int) -> None:
    """Serve ``n`` fake servers until stdin closes; print their URLs as one JSON line, and
    at the end each server's ``update_log`` (one JSON line)."""
    async with fake_servers(n, step_s=step_s, vocab=vocab) as servers:
        print(json.dumps([s.url for s in servers]), flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, __import__("sys").stdin.read)
        print(json.dumps([s.update_log for s in servers]), flush=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Run fake SGLang servers on 127.0.0.1.")
    parser.add_argument("--n", type=int, default=1, help="how many servers")
    parser.add_argument("--step-s", type=float, default=0.002, help="seconds per decode step")
    parser.add_argument("--vocab", type=int, default=1000, help="token ids are below this")
    args = parser.parse_args()
    asyncio.run(_serve(args.n, args.step_s, args.vocab))
