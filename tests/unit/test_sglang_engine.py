"""The SGLang client against fake SGLang servers on 127.0.0.1: generation, verified aborts
fanned out to the servers holding each request, faults, and the trainer-side calls."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fakes.sglang_server import FakeFaults, FakeSGLangServer, fake_logprob, fake_servers, fake_token
from fakes.turns_rollout import ContinuingTurns
from tailcut.config import EngineConfig, RemoteEngineConfig
from tailcut.engine.base import AbortNotConfirmed, EngineDied, EngineError
from tailcut.engine.factory import make_engine
from tailcut.engine.sglang import SGLangEngine
from tailcut.rollout.cutoff import TargetCount
from tailcut.rollout.scheduler import run_step
from tailcut.trace.events import Tracer
from tailcut.types import (
    FinishReason,
    GenerateRequest,
    GenerateResult,
    Sample,
    SamplingParams,
    Status,
    new_request_id,
)

pytestmark = pytest.mark.timeout(60)

LONG = 100_000


def _req(n: int = LONG, **kw: Any) -> GenerateRequest:
    return GenerateRequest(new_request_id(), [1, 2, 3], SamplingParams(max_new_tokens=n, **kw))


def _engine(servers: list[FakeSGLangServer], **kw: Any) -> SGLangEngine:
    deadline = kw.pop("abort_deadline_s", 2.0)
    cfg = RemoteEngineConfig(**{"ready_timeout_s": 5.0, "reabort_interval_s": 0.05, **kw})
    return SGLangEngine([s.url for s in servers], cfg, abort_deadline_s=deadline)


def run(n: int, body: Callable[..., Awaitable[None]], **server_kw: Any) -> None:
    async def main() -> None:
        async with fake_servers(n, **server_kw) as servers:
            await body(*servers)

    asyncio.run(main())


def _check_tokens(result: GenerateResult, server_vocab: int = 1000) -> None:
    rid = result.request_id
    n = len(result.output_ids)
    assert result.output_ids == [fake_token(rid, i, server_vocab) for i in range(n)]
    assert result.logprobs == pytest.approx([fake_logprob(rid, i) for i in range(n)])


@pytest.mark.parametrize(("stream", "incremental"), [(False, False), (True, False), (True, True)])
def test_generate_returns_the_servers_tokens_and_logprobs(stream: bool, incremental: bool) -> None:
    async def body(server: FakeSGLangServer) -> None:
        async with _engine([server], stream=stream) as engine:
            result = await engine.generate(_req(7))
        assert result.finish_reason is FinishReason.LENGTH
        assert len(result.output_ids) == 7
        assert result.prompt_tokens == 3
        _check_tokens(result)

    run(1, body, incremental=incremental)


def test_eos_ends_with_stop_and_keeps_the_stop_token() -> None:
    async def body(server: FakeSGLangServer) -> None:
        async with _engine([server]) as engine:
            result = await engine.generate(_req(50))
        assert result.finish_reason is FinishReason.STOP
        assert len(result.output_ids) == 5 and result.output_ids[-1] == server.eos_id
        assert result.logprobs is not None and len(result.logprobs) == 5

    run(1, body, eos_at=4)


@pytest.mark.parametrize("stream", [False, True])
def test_abort_resolves_with_partial_output_on_the_server_that_holds_it(stream: bool) -> None:
    async def body(*servers: FakeSGLangServer) -> None:
        async with _engine(list(servers), stream=stream) as engine:
            reqs = [_req() for _ in range(6)]
            tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
            await servers[0].until(
                lambda: all(len(s.running) == 2 for s in servers) and servers[0].tokens > 12
            )
            await engine.abort([r.request_id for r in reqs])
            results = await asyncio.gather(*tasks)
            assert await engine.in_flight() == []
            stats = await engine.stats()
        assert [r.finish_reason for r in results] == [FinishReason.ABORT] * 6
        assert all(len(r.output_ids) > 0 for r in results)
        for r in results:
            _check_tokens(r)
        for server in servers:
            assert not server.running and not server.waiting
            held = set(server.generate_log)
            sent = {a["rid"] for a in server.abort_log}
            assert sent == held  # each abort went to the server holding the request, only
        assert stats.running == 0 and stats.aborted == 6
        assert stats.wasted_tokens == sum(len(r.output_ids) for r in results)

    run(3, body)


def test_cancelling_the_caller_aborts_in_the_engine() -> None:
    async def body(server: FakeSGLangServer) -> None:
        async with _engine([server]) as engine:
            req = _req()
            task = asyncio.create_task(engine.generate(req))
            await server.until(lambda: server.tokens > 3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await engine.in_flight() == []
        assert server.finished[req.request_id]["type"] == "abort"
        assert [a["rid"] for a in server.abort_log] == [req.request_id]

    run(1, body)


def test_abort_of_unknown_ids_is_a_noop_and_abort_is_idempotent() -> None:
    async def body(server: FakeSGLangServer) -> None:
        async with _engine([server]) as engine:
            await engine.abort([new_request_id(), new_request_id()])
            assert server.abort_log == []
            req = _req()
            task = asyncio.create_task(engine.generate(req))
            await server.until(lambda: server.tokens > 0)
            await engine.abort([req.request_id])
            await engine.abort([req.request_id])
            assert (await task).finish_reason is FinishReason.ABORT

    run(1, body)


def test_abort_while_servers_start_is_not_lost() -> None:
    async def body(server: FakeSGLangServer) -> None:
        async with _engine([server]) as engine:
            req = _req()
            task = asyncio.create_task(engine.generate(req))
            await asyncio.sleep(0.05)  # the engine is waiting for the health check
            await engine.abort([req.request_id])
            server.set_ready()
            result = await task
        assert result.finish_reason is FinishReason.ABORT and result.output_ids == []
        assert server.generate_log == []  # it never left

    run(1, body, ready=False)


def test_fake_matches_abort_ids_by_prefix() -> None:
    """SGLang's scheduler aborts every rid that *starts with* the given one: the reason
    tailcut's ids all have one length."""

    async def body(server: FakeSGLangServer) -> None:
        async with aiohttp.ClientSession() as http:

            async def gen(rid: str) -> Any:
                payload = {
                    "input_ids": [1],
                    "rid": rid,
                    "sampling_params": {"max_new_tokens": LONG},
                }
                async with http.post(server.url + "/generate", json=payload) as resp:
                    return await resp.json()

            tasks = [asyncio.create_task(gen(r)) for r in ("job-1", "job-12", "other")]
            await server.until(lambda: len(server.running) == 3)
            async with http.post(server.url + "/abort_request", json={"rid": "job-1"}) as resp:
                assert resp.status == 200
            outs = await asyncio.gather(tasks[0], tasks[1])
            assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
            assert len(server.running) == 1
            async with http.post(server.url + "/abort_request", json={"abort_all": True}) as resp:
                assert resp.status == 200
            assert (await tasks[2])["meta_info"]["finish_reason"]["type"] == "abort"

    run(1, body)


@pytest.mark.parametrize("balance", ["round-robin", "least-loaded"])
def test_requests_spread_over_servers(balance: str) -> None:
    async def body(*servers: FakeSGLangServer) -> None:
        async with _engine(list(servers), balance=balance) as engine:
            reqs = [_req() for _ in range(8)]
            tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
            await servers[0].until(lambda: sum(len(s.running) for s in servers) == 8)
            assert [len(s.running) for s in servers] == [2, 2, 2, 2]
            await engine.abort_all()
            await asyncio.gather(*tasks)
        assert all(any(a["abort_all"] for a in s.abort_log) for s in servers)

    run(4, body)


def test_exclusive_servers_get_one_abort_all_when_everything_is_aborted() -> None:
    async def body(*servers: FakeSGLangServer) -> None:
        async with _engine(list(servers), exclusive=True) as engine:
            reqs = [_req() for _ in range(6)]
            tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
            await servers[0].until(lambda: all(len(s.running) == 3 for s in servers))
            await engine.abort([reqs[0].request_id])  # one of several: aborted by id
            assert (await tasks[0]).finish_reason is FinishReason.ABORT
            await engine.abort([r.request_id for r in reqs[1:]])
            results = await asyncio.gather(*tasks[1:])
        assert all(r.finish_reason is FinishReason.ABORT for r in results)
        logs = [s.abort_log for s in servers]
        assert sorted(len(log) for log in logs) == [1, 2]
        assert all(log[-1] == {"rid": "", "abort_all": True} for log in logs)

    run(2, body)


def test_lost_abort_is_sent_again() -> None:
    async def body(server: FakeSGLangServer) -> None:
        async with _engine([server]) as engine:
            req = _req()
            task = asyncio.create_task(engine.generate(req))
            await server.until(lambda: server.tokens > 0)
            await engine.abort([req.request_id])
            assert (await task).finish_reason is FinishReason.ABORT
        assert len(server.abort_log) >= 2  # the first one was dropped
        assert server.faults.lose_aborts == 0

    run(1, body, faults=FakeFaults(lose_aborts=1))


def test_abort_call_that_times_out_is_retried() -> None:
    async def body(server: FakeSGLangServer) -> None:
        async with _engine([server], reabort_interval_s=0.05) as engine:
            req = _req()
            task = asyncio.create_task(engine.generate(req))
            await server.until(lambda: server.tokens > 0)
            await engine.abort([req.request_id])
            assert (await task).finish_reason is FinishReason.ABORT
        assert len(server.abort_log) >= 2

    run(1, body, faults=FakeFaults(abort_delay_s=0.4))


def test_wedged_server_is_reported_with_ids_and_kept_in_flight() -> None:
    async def body(server: FakeSGLangServer) -> None:
        async with _engine([server], abort_deadline_s=0.3) as engine:
            reqs = [_req() for _ in range(3)]
            tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
            await server.until(lambda: len(server.running) == 3)
            ids = [r.request_id for r in reqs]
            with pytest.raises(AbortNotConfirmed) as err:
                await engine.abort(ids)
            assert sorted(err.value.request_ids) == sorted(ids)
            assert all(i in str(err.value) for i in ids)
            # The callers are not left hanging, and the engine still reports the ids.
            results = await asyncio.gather(*tasks)
            assert all(r.finish_reason is FinishReason.ABORT for r in results)
            assert sorted(await engine.in_flight()) == sorted(ids)
            assert all(r.tokens_after_abort > 0 for r in server.running)
            server.faults.wedged = False  # the scheduler recovers; a re-abort now works
            await engine.abort(ids)
            assert await engine.in_flight() == []
        assert not server.running

    run(1, body, faults=FakeFaults(wedged=True))


def test_server_dying_mid_step_fails_clearly() -> None:
    async def body(server: FakeSGLangServer) -> None:
        async with _engine([server], retries=1) as engine:
            tasks = [asyncio.create_task(engine.generate(_req())) for _ in range(3)]
            await server.until(lambda: server.tokens > 3)
            await server.kill()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(o, EngineDied) for o in outcomes)
            assert server.url in str(outcomes[0])
            assert await engine.in_flight() == []
            with pytest.raises(EngineDied, match="every server is gone"):
                await engine.generate(_req(3))

    run(1, body)


def test_slow_start_waits_bounded_with_a_message() -> None:
    async def body(server: FakeSGLangServer) -> None:
        async with _engine([server]) as engine:
            with pytest.raises(EngineError) as err:
                await engine.wait_ready(timeout_s=0.3)
            msg = str(err.value)
            assert server.url in msg and "not ready after 0.3 s" in msg and "HTTP 503" in msg
            server.set_ready()
            assert (await engine.generate(_req(2))).finish_reason is FinishReason.LENGTH

    run(1, body, ready=False)


def test_unreachable_server_is_named() -> None:
    async def main() -> None:
        async with fake_servers(1) as (server,):
            url = server.url
        engine = SGLangEngine([url], RemoteEngineConfig(ready_timeout_s=0.3, retries=0))
        with pytest.raises(EngineError, match=r"not ready after 0\.3 s.*unreachable"):
            await engine.generate(_req(2))
        await engine.aclose()

    asyncio.run(main())


def test_http_errors_carry_the_servers_message() -> None:
    async def body(server: FakeSGLangServer) -> None:
        async with _engine([server]) as engine:
            with pytest.raises(EngineError, match=r"HTTP 500: CUDA out of memory"):
                await engine.generate(_req(2))
            with pytest.raises(EngineError, match=r"HTTP 400: top_p must be in \(0, 1\]"):
                await engine.generate(_req(2, top_p=1.5))
            assert (await engine.generate(_req(2))).finish_reason is FinishReason.LENGTH

    run(1, body, faults=FakeFaults(generate_errors=[(500, "CUDA out of memory")]))


def test_memory_weights_and_cache_calls(tmp_path: Path) -> None:
    async def body(*servers: FakeSGLangServer) -> None:
        async with _engine(list(servers)) as engine:
            await engine.wait_ready()
            await engine.release_memory(["kv_cache", "weights"])
            assert all(s.released == {"kv_cache", "weights"} for s in servers)
            with pytest.raises(EngineError, match="memory released"):
                await engine.generate(_req(2))
            await engine.resume_memory()
            assert all(not s.released for s in servers)
            with pytest.raises(ValueError, match="unknown SGLang memory tag"):
                await engine.release_memory(["gpu"])
            (tmp_path / "model.safetensors").write_bytes(b"weights")
            await engine.update_weights_from_disk(str(tmp_path))
            assert [s.weight_version for s in servers] == ["1", "1"]
            assert (await engine.generate(_req(2))).weight_version == 1
            with pytest.raises(EngineError, match="repository not found"):
                await engine.update_weights_from_disk(str(tmp_path / "missing"))
            assert engine.weight_version == 1
            await engine.flush_cache()
            task = asyncio.create_task(engine.generate(_req()))
            await servers[0].until(lambda: any(s.running for s in servers))
            with pytest.raises(EngineError, match="Flush cache failed"):
                await engine.flush_cache()
            await engine.abort_all()
            await task
            infos = await engine.model_info()
            assert [i["model_path"] for i in infos] == [str(tmp_path)] * 2

    run(2, body)


def test_older_servers_load_endpoint_is_used() -> None:
    async def body(server: FakeSGLangServer) -> None:
        async with _engine([server]) as engine:
            req = _req()
            task = asyncio.create_task(engine.generate(req))
            await server.until(lambda: server.tokens > 0)
            assert (await engine.stats()).running == 1
            await engine.abort([req.request_id])
            await task
            assert (await engine.stats()).running == 0

    run(1, body, legacy_load=True)


def test_factory_builds_each_kind_and_names_missing_urls() -> None:
    from tailcut.engine.sim import SimEngine
    from tailcut.engine.vllm import VLLMEngine

    assert isinstance(make_engine(EngineConfig()), SimEngine)
    engine = make_engine(EngineConfig(kind="sglang", urls=["http://127.0.0.1:1"]))
    assert isinstance(engine, SGLangEngine)
    assert isinstance(make_engine(EngineConfig(kind="vllm", urls=["http://h:8000/"])), VLLMEngine)
    with pytest.raises(ValueError, match=r"engine.kind=vllm needs engine.urls"):
        make_engine(EngineConfig(kind="vllm"))
    with pytest.raises(ValueError, match="must look like http://HOST:PORT"):
        make_engine(EngineConfig(kind="sglang", urls=["127.0.0.1:30000"]))


def test_over_sampled_step_with_a_cut_stops_every_straggler() -> None:
    async def body(*servers: FakeSGLangServer) -> None:
        lengths = {i: (5 if i < 6 else LONG) for i in range(8)}
        async with _engine(list(servers)) as engine:
            samples = [Sample(index=i, group=i, prompt_ids=[1, 2]) for i in range(8)]
            result = await run_step(
                engine,
                samples,
                ContinuingTurns(lengths),
                TargetCount(8, abort_ratio=0.25),
                Tracer(None, step=0),
            )
            assert await engine.in_flight() == []
        assert result.completed == 6 and result.aborted == 2
        for s in result.samples:
            assert len(s.logprobs) == len(s.response_ids) == len(s.loss_mask)
        assert all(len(s.response_ids) == 15 for s in result.kept_samples())
        assert all(s.status is Status.ABORTED for s in result.samples[6:])
        assert all(not srv.running and not srv.waiting for srv in servers)

    run(2, body)
