"""``code_interpreter`` on Sandbox Fusion with the local sandbox as the fallback: the fake
Fusion server answers while it is up; when it fails the real local sandbox runs the
program, the server is left alone for the retry window, then used again."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from fakes.fusion_server import FakeFusionServer, finished, free_port
from tailcut.tools.code_fallback import FallbackBackend, FallbackCodeInterpreterTool
from tailcut.tools.code_interpreter import CodeInterpreterTool
from tailcut.tools.registry import TOOLS, build_toolset, load_tool_config, tools_by_name

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
FAST = {"retries": 1, "backoff_s": 0.01, "backoff_max_s": 0.02}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _tool(url: str, **extra: Any) -> FallbackCodeInterpreterTool:
    return FallbackCodeInterpreterTool.from_config(
        {"backend": "fusion", "fusion": {"url": url, **FAST}, **extra}, None
    )


def test_server_answers_while_it_is_up_and_the_local_sandbox_takes_over_when_it_fails():
    async def main() -> None:
        async with FakeFusionServer(lambda req: finished(stdout="from fusion\n")) as server:
            tool = _tool(server.url, fallback_retry_s=60)
            backend = tool.backend
            assert isinstance(backend, FallbackBackend)
            clock = Clock()
            backend.clock = clock
            up = await tool.execute("i", {"code": "print(6 * 7)"})
            assert up.text == "from fusion" and backend.fallback_runs == 0
            server.faults.extend([500])  # HTTP 500: the server cannot run it
            down = await tool.execute("i", {"code": "print(6 * 7)"})
            assert (down.text, down.status) == ("42", "ok") and backend.fallback_runs == 1
            asked = len(server.requests)
            clock.t = 30.0  # inside the retry window: the server is not asked
            local = await tool.execute("i", {"code": "print(1 + 1)"})
            assert local.text == "2" and len(server.requests) == asked
            clock.t = 61.0  # the window is over: back to the server
            again = await tool.execute("i", {"code": "print(1 + 1)"})
            assert again.text == "from fusion" and backend.fallback_runs == 2
            await tool.aclose()

    asyncio.run(main())


def test_an_unreachable_server_falls_back_and_program_errors_do_not():
    async def main() -> None:
        tool = _tool(f"http://127.0.0.1:{free_port()}")
        crashed = await tool.execute("i", {"code": "print(undefined_name)"})
        assert crashed.status == "code_error" and "NameError" in crashed.text
        assert getattr(tool.backend, "fallback_runs", None) == 1
        await tool.aclose()

    asyncio.run(main())


def test_a_server_reply_about_the_program_is_the_answer_not_a_fallback():
    async def main() -> None:
        reply = finished(stderr="Traceback: ZeroDivisionError\n", return_code=1)
        async with FakeFusionServer(lambda req: reply) as server:
            tool = _tool(server.url)
            result = await tool.execute("i", {"code": "print(1 / 0)"})
            assert result.status == "code_error" and "ZeroDivisionError" in result.text
            assert getattr(tool.backend, "fallback_runs", None) == 0
            await tool.aclose()

    asyncio.run(main())


def test_verl_keys_and_the_fallback_switch_in_a_tool_config():
    raw = {
        "tools": [
            {
                "class_name": "tailcut.tools.code_fallback.FallbackCodeInterpreterTool",
                "config": {"type": "native", "sandbox_fusion_url": "http://h:8080/run_code",
                           "default_timeout": 12, "rate_limit": 4, "fallback": "none"},
            }
        ]
    }  # fmt: skip
    tool = build_toolset(raw).tools["code_interpreter"]
    assert isinstance(tool, FallbackCodeInterpreterTool)
    assert not isinstance(tool.backend, FallbackBackend)  # fallback: none
    assert tool.config.fusion is not None and tool.config.fusion.max_concurrency == 4
    raw["tools"][0]["config"]["fallback"] = "remote"
    with pytest.raises(ValueError, match="fallback must be 'local' or 'none'"):
        build_toolset(raw)


def test_the_shipped_tool_config_and_the_registry_name():
    toolset = load_tool_config(ROOT / "configs" / "tools" / "sandbox_fusion.yaml")
    tool = toolset.tools["code_interpreter"]
    assert isinstance(getattr(tool, "backend", None), FallbackBackend)
    assert toolset.limits["code_interpreter"].timeout_s == 60
    assert TOOLS["code_interpreter"].endswith("CodeInterpreterTool")
    local = tools_by_name(["code_interpreter"]).tools["code_interpreter"]
    assert type(local) is CodeInterpreterTool and local.config.backend == "local"


def test_a_broken_answer_falls_back_too():
    """The server answers 200 with a body shorter than its Content-Length (aiohttp's
    ClientPayloadError, not a connection error): the local sandbox runs the program."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"status\": ")  # fmt: skip
        await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        tool = _tool(f"http://127.0.0.1:{port}")
        try:
            out = await tool.execute("i", {"code": "print(6 * 7)"})
            assert (out.text, out.status) == ("42", "ok")
            assert getattr(tool.backend, "fallback_runs", None) == 1
        finally:
            await tool.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(main())
