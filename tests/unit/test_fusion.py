"""The Sandbox Fusion client against a fake server speaking the same JSON."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fakes.fusion_server import FakeFusionServer, finished, free_port, sandbox_error, time_limit
from tailcut.tools.fusion import FusionConfig, FusionError, SandboxFusionClient, to_result

pytestmark = pytest.mark.timeout(30)

FAST = {"backoff_s": 0.01, "backoff_max_s": 0.02}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_request_carries_the_fields_and_reply_is_parsed() -> None:
    async def main() -> None:
        def respond(req: dict[str, Any]) -> dict[str, Any]:
            return finished(stdout="4\n", stderr="warn\n", seconds=0.25)

        async with FakeFusionServer(respond) as server:
            cfg = FusionConfig(url=server.url, timeout_s=7, memory_limit_mb=512)
            async with SandboxFusionClient(cfg) as client:
                result = await client.run("print(2+2)", stdin="x")
        req = server.requests[0]
        assert req["code"] == "print(2+2)"
        assert req["language"] == "python"
        assert req["run_timeout"] == 7
        assert req["memory_limit_MB"] == 512
        assert req["stdin"] == "x"
        assert (result.status, result.stdout, result.stderr) == ("ok", "4\n", "warn\n")
        assert result.exit_code == 0
        assert result.run_s == 0.25

    run(main())


def test_full_run_code_url_is_used_as_is() -> None:
    async def main() -> None:
        async with FakeFusionServer() as server:
            cfg = FusionConfig(url=server.url + "/run_code/")
            async with SandboxFusionClient(cfg) as client:
                result = await client.run("print('hi')")
        assert result.stdout == "print('hi')\n"
        assert len(server.requests) == 1

    run(main())


def test_a_call_may_ask_for_a_shorter_timeout_but_not_a_longer_one() -> None:
    async def main() -> None:
        async with (
            FakeFusionServer() as server,
            SandboxFusionClient(FusionConfig(url=server.url, timeout_s=5)) as client,
        ):
            await client.run("a", timeout_s=2)
            await client.run("b", timeout_s=60)
        assert [r["run_timeout"] for r in server.requests] == [2, 5]

    run(main())


@pytest.mark.parametrize(
    ("reply", "status", "detail"),
    [
        (time_limit(stdout="partial"), "timeout", "run_timeout"),
        (
            finished(stderr="Traceback...\nZeroDivisionError: x\n", return_code=1),
            "error",
            "exit code 1",
        ),
        (finished(stderr="Traceback...\nMemoryError\n", return_code=1), "memory", "memory"),
    ],
)
def test_run_results_map_to_sandbox_statuses(
    reply: dict[str, Any], status: str, detail: str
) -> None:
    result = to_result(reply, 0.1, 5.0, "http://x/run_code")
    assert result.status == status
    assert detail in result.detail


def test_compile_failure_is_an_error_with_the_compiler_output() -> None:
    reply = {
        "status": "Failed",
        "compile_result": {"status": "Finished", "return_code": 1, "stderr": "main.cpp:1: error"},
        "run_result": None,
    }
    result = to_result(reply, 0.1, 5.0, "http://x/run_code")
    assert result.status == "error"
    assert "main.cpp:1: error" in result.stderr


def test_sandbox_error_reply_raises_with_the_servers_message() -> None:
    async def main() -> None:
        async with (
            FakeFusionServer(lambda req: sandbox_error("executor pod crashed")) as server,
            SandboxFusionClient(FusionConfig(url=server.url, **FAST)) as client,
        ):
            with pytest.raises(FusionError, match="executor pod crashed"):
                await client.run("print(1)")
        assert len(server.requests) == 1  # not retried

    run(main())


def test_http_500_is_surfaced_with_its_message_and_not_retried() -> None:
    async def main() -> None:
        async with FakeFusionServer() as server:
            server.faults.append(500)
            async with SandboxFusionClient(FusionConfig(url=server.url, **FAST)) as client:
                with pytest.raises(FusionError, match=r"HTTP 500: injected failure 500"):
                    await client.run("print(1)")
                assert client.attempts == 1

    run(main())


def test_503_and_dropped_connections_are_retried_until_an_answer() -> None:
    async def main() -> None:
        async with FakeFusionServer() as server:
            server.faults.extend([503, "drop", 504])
            async with SandboxFusionClient(
                FusionConfig(url=server.url, retries=3, **FAST)
            ) as client:
                result = await client.run("print(1)")
                assert client.attempts == 4
        assert result.status == "ok"
        assert len(server.requests) == 4

    run(main())


def test_retries_give_up_with_the_last_error() -> None:
    async def main() -> None:
        async with FakeFusionServer() as server:
            server.faults.extend([503, 503, 503])
            async with SandboxFusionClient(
                FusionConfig(url=server.url, retries=2, **FAST)
            ) as client:
                with pytest.raises(FusionError, match=r"after 3 attempts: HTTP 503"):
                    await client.run("print(1)")

    run(main())


def test_connection_refused_is_retried_then_raised() -> None:
    async def main() -> None:
        cfg = FusionConfig(url=f"http://127.0.0.1:{free_port()}", retries=2, **FAST)
        async with SandboxFusionClient(cfg) as client:
            with pytest.raises(FusionError, match=r"after 3 attempts: connection error"):
                await client.run("print(1)")
            assert client.attempts == 3

    run(main())


def test_concurrency_limit_bounds_requests_in_flight() -> None:
    async def main() -> None:
        async with FakeFusionServer() as server:
            server.delay_s = 0.05
            cfg = FusionConfig(url=server.url, max_concurrency=3)
            async with SandboxFusionClient(cfg) as client:
                results = await asyncio.gather(*(client.run(f"print({i})") for i in range(10)))
        assert [r.stdout for r in results] == [f"print({i})\n" for i in range(10)]
        assert server.max_in_flight == 3

    run(main())


def test_slow_server_past_the_http_timeout_raises() -> None:
    async def main() -> None:
        async with FakeFusionServer() as server:
            server.delay_s = 0.6
            cfg = FusionConfig(
                url=server.url, timeout_s=0.1, compile_timeout_s=0.1, http_margin_s=0.1
            )
            async with SandboxFusionClient(cfg) as client:
                with pytest.raises(FusionError, match="no answer within"):
                    await client.run("print(1)")

    run(main())


def test_cancelling_a_request_frees_its_slot() -> None:
    async def main() -> None:
        async with FakeFusionServer() as server:
            server.delay_s = 0.3
            cfg = FusionConfig(url=server.url, max_concurrency=1)
            async with SandboxFusionClient(cfg) as client:
                task = asyncio.create_task(client.run("print('slow')"))
                await asyncio.sleep(0.05)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                server.delay_s = 0.0
                async with asyncio.timeout(5):  # the only slot is free again
                    result = await client.run("print('next')")
        assert result.stdout == "print('next')\n"

    run(main())
