"""The vLLM client against a small fake of vLLM's OpenAI server (fast fault tests; the real
server is exercised by ``tests/integration/test_vllm_cpu.py``).

The fake streams ``/v1/completions`` as vLLM 0.32 does with ``return_token_ids`` and
``logprobs=0`` (delta ``token_ids`` and ``logprobs.token_logprobs`` per event, the request
named ``cmpl-<request_id>-0``), aborts a request whose client disconnects, offers
``/abort_requests`` only in dev mode, and reports
``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from tailcut.config import RemoteEngineConfig
from tailcut.engine.base import AbortNotConfirmed, EngineDied, EngineError
from tailcut.engine.vllm import VLLMEngine, server_request_id
from tailcut.types import FinishReason, GenerateRequest, SamplingParams, new_request_id

pytestmark = pytest.mark.timeout(60)


class FakeVLLM:
    def __init__(self, *, dev: bool = True, wedged: bool = False, step_s: float = 0.002) -> None:
        self.dev = dev
        self.wedged = wedged
        """Disconnects and aborts are ignored: the metrics keep counting the request."""
        self.step_s = step_s
        self.running: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.abort_calls: list[list[str]] = []
        self.error_after: int | None = None
        self.changed = asyncio.Condition()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", _answer(None))
        app.router.add_get("/v1/models", _answer({"data": [{"id": "fake"}]}))
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        if self.dev:
            app.router.add_post("/abort_requests", self.abort_requests)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def until(self, pred: Any) -> None:
        async with self.changed:
            await self.changed.wait_for(pred)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def metrics(self, request: web.Request) -> web.Response:
        labels = '{engine="0",model_name="fake"}'
        n = len(self.running)
        text = (
            f"vllm:num_requests_running{labels} {float(n)}\n"
            f"vllm:num_requests_waiting{labels} 0.0\n"
            f'vllm:num_requests_waiting_by_reason{{engine="0",reason="capacity"}} 7.0\n'
        )
        return web.Response(text=text)

    async def abort_requests(self, request: web.Request) -> web.Response:
        ids = (await request.json()).get("request_ids") or []
        self.abort_calls.append(ids)
        if not self.wedged:
            self.aborted.update(ids)
        return web.json_response({"status": "aborted", "aborted": len(ids)})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("model") != "fake":
            msg = f"The model `{body.get('model')}` does not exist."
            return web.json_response({"error": {"message": msg, "code": 404}}, status=404)
        rid = server_request_id(body["request_id"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.running[rid] = 0
        await self._notify()
        stop = set(body.get("stop_token_ids") or [])
        try:
            for pos in range(body["max_tokens"]):
                await asyncio.sleep(self.step_s)
                if rid in self.aborted:
                    await resp.write(_event(rid, [], "abort"))
                    break
                if self.error_after is not None and pos >= self.error_after:
                    await resp.write(b'data: {"error": {"message": "Internal server error"}}\n\n')
                    break
                tok = 10 + pos
                finish = (
                    "stop" if tok in stop else ("length" if pos + 1 == body["max_tokens"] else None)
                )
                self.running[rid] = pos + 1
                await resp.write(_event(rid, [tok], finish))
                await self._notify()
                if finish:
                    break
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            if self.wedged:
                return resp  # the request "keeps running": metrics still count it
            raise
        finally:
            if not self.wedged:
                self.running.pop(rid, None)
            await self._notify()
        return resp


def _answer(body: Any) -> Any:
    async def handler(request: web.Request) -> web.Response:
        return web.Response() if body is None else web.json_response(body)

    return handler


def _event(rid: str, ids: list[int], finish: str | None) -> bytes:
    choice = {
        "index": 0,
        "text": "",
        "logprobs": {"token_logprobs": [-0.5] * len(ids), "tokens": [""] * len(ids)},
        "finish_reason": finish,
        "token_ids": ids,
    }
    return b"data: " + json.dumps({"id": rid[:-2], "choices": [choice]}).encode() + b"\n\n"


@contextlib.asynccontextmanager
async def fake_vllm(**kw: Any) -> AsyncIterator[tuple[FakeVLLM, VLLMEngine]]:
    server = FakeVLLM(**kw)
    await server.start()
    cfg = RemoteEngineConfig(ready_timeout_s=5.0, reabort_interval_s=0.05, retries=1)
    engine = VLLMEngine([server.url], cfg, abort_deadline_s=0.5)
    try:
        yield server, engine
    finally:
        await engine.aclose()
        await server.stop()


def _req(n: int = 100_000, **kw: Any) -> GenerateRequest:
    return GenerateRequest(new_request_id(), [1, 2], SamplingParams(max_new_tokens=n, **kw))


def test_stream_gives_token_ids_logprobs_and_finish_reasons() -> None:
    async def main() -> None:
        async with fake_vllm() as (_server, engine):
            full = await engine.generate(_req(5))
            assert (
                full.output_ids == [10, 11, 12, 13, 14]
                and full.finish_reason is FinishReason.LENGTH
            )
            assert full.logprobs == [-0.5] * 5
            stop = await engine.generate(_req(50, stop_token_ids=(12,)))
            assert stop.output_ids == [10, 11, 12] and stop.finish_reason is FinishReason.STOP

    asyncio.run(main())


@pytest.mark.parametrize("dev", [True, False], ids=["abort-endpoint", "close-only"])
def test_abort_closes_the_stream_and_checks_metrics(dev: bool) -> None:
    async def main() -> None:
        async with fake_vllm(dev=dev) as (server, engine):
            reqs = [_req() for _ in range(3)]
            tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
            await server.until(
                lambda: len(server.running) == 3 and min(server.running.values()) > 2
            )
            await engine.abort([r.request_id for r in reqs])
            results = await asyncio.gather(*tasks)
            assert not server.running and await engine.in_flight() == []
            assert all(
                r.finish_reason is FinishReason.ABORT and len(r.output_ids) > 2 for r in results
            )
            assert all(
                r.logprobs is not None and len(r.logprobs) == len(r.output_ids) for r in results
            )
            probe = [server_request_id("tailcut-probe")]  # sent once, at start
            expected = [probe, [server_request_id(r.request_id) for r in reqs]] if dev else []
            assert server.abort_calls == expected

    asyncio.run(main())


def test_abort_before_a_request_was_sent_leaves_nothing_in_flight() -> None:
    """Requests still waiting for the servers' first health check are aborted at once: when
    ``abort`` returns, ``in_flight`` holds none of them, and none ever reaches the server."""

    async def main() -> None:
        async with fake_vllm() as (server, engine):
            reqs = [_req() for _ in range(3)]
            tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
            await asyncio.sleep(0)  # each registered, the first one checking health
            assert set(await engine.in_flight()) == {r.request_id for r in reqs}
            await engine.abort([r.request_id for r in reqs])
            assert await engine.in_flight() == []
            results = await asyncio.gather(*tasks)
            assert all(r.finish_reason is FinishReason.ABORT and not r.output_ids for r in results)
            probe = [server_request_id("tailcut-probe")]  # the readiness probe's, no other
            assert not server.running and server.abort_calls == [probe]

    asyncio.run(main())


def test_request_that_will_not_stop_is_reported() -> None:
    async def main() -> None:
        async with fake_vllm(wedged=True) as (server, engine):
            req = _req()
            task = asyncio.create_task(engine.generate(req))
            await server.until(lambda: server.running.get(server_request_id(req.request_id), 0) > 1)
            with pytest.raises(AbortNotConfirmed, match=req.request_id):
                await engine.abort([req.request_id])
            assert (await task).finish_reason is FinishReason.ABORT
            assert await engine.in_flight() == [req.request_id]

    asyncio.run(main())


def test_errors_carry_the_servers_message() -> None:
    async def main() -> None:
        async with fake_vllm() as (server, engine):
            server.error_after = 2
            with pytest.raises(EngineError, match="Internal server error"):
                await engine.generate(_req())
            server.error_after = None
            engine.model = "other"
            with pytest.raises(EngineError, match=r"HTTP 404: The model `other` does not exist"):
                await engine.generate(_req(3))

    asyncio.run(main())


def test_server_dying_mid_stream_fails_clearly() -> None:
    async def main() -> None:
        async with fake_vllm() as (server, engine):
            task = asyncio.create_task(engine.generate(_req()))
            await server.until(lambda: any(v > 2 for v in server.running.values()))
            await server.stop()
            with pytest.raises(EngineDied, match=r"lost request .* after \d+ token"):
                await task

    asyncio.run(main())


def test_dev_only_calls_explain_how_to_enable_them() -> None:
    async def main() -> None:
        async with fake_vllm(dev=False) as (_server, engine):
            await engine.wait_ready()
            with pytest.raises(EngineError, match="VLLM_SERVER_DEV_MODE=1"):
                await engine.sleep()
            with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
                await engine.sleep(level=3)

    asyncio.run(main())


def test_weight_reload_needs_dev_mode_and_checks_the_directory_first(tmp_path: Any) -> None:
    async def main() -> None:
        async with fake_vllm(dev=False) as (_server, engine):
            await engine.wait_ready()
            with pytest.raises(EngineError, match="no such directory") as err:
                await engine.update_weights_from_disk(str(tmp_path / "missing"))
            assert "kills vLLM's engine core" in str(err.value)
            with pytest.raises(EngineError, match=r"no config\.json"):
                await engine.update_weights_from_disk(str(tmp_path))
            (tmp_path / "config.json").write_text("{}")
            with pytest.raises(EngineError, match=r"no \*\.safetensors or \*\.bin"):
                await engine.update_weights_from_disk(str(tmp_path))
            (tmp_path / "model.safetensors").write_bytes(b"w")
            with pytest.raises(EngineError, match=r"has no /pause.*VLLM_SERVER_DEV_MODE=1"):
                await engine.update_weights_from_disk(str(tmp_path), 3)
            assert engine.weight_version == 0
            assert (await engine.generate(_req(2))).weight_version == 0  # not left waiting

    asyncio.run(main())
