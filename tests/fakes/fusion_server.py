"""A fake Sandbox Fusion server on 127.0.0.1 (random port) speaking the same JSON.

It does not execute code: a test sets ``server.respond`` (request JSON → reply JSON) or
uses the default, which "prints" the code's first line. Faults are queued per request:
``server.faults.append(500)`` answers the next request with HTTP 500 (a JSON body with a
``detail`` message), ``"drop"`` closes the connection without an answer. ``delay_s``
makes every answer slow. Every request received is kept in ``server.requests``.

    async with FakeFusionServer() as server:
        client = SandboxFusionClient(FusionConfig(url=server.url))
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

from aiohttp import web


def finished(
    stdout: str = "", stderr: str = "", return_code: int = 0, seconds: float = 0.01
) -> dict[str, Any]:
    """A reply for a program that ran to its end."""
    return {
        "status": "Success" if return_code == 0 else "Failed",
        "message": "",
        "compile_result": None,
        "run_result": {
            "status": "Finished",
            "execution_time": seconds,
            "return_code": return_code,
            "stdout": stdout,
            "stderr": stderr,
        },
        "executor_pod_name": None,
        "files": {},
    }


def time_limit(stdout: str = "") -> dict[str, Any]:
    reply = finished(stdout=stdout, return_code=-9)
    reply["status"] = "Failed"
    reply["run_result"].update(status="TimeLimitExceeded", return_code=None)
    return reply


def sandbox_error(message: str) -> dict[str, Any]:
    return {
        "status": "SandboxError",
        "message": message,
        "compile_result": None,
        "run_result": None,
    }


def _echo_first_line(request: dict[str, Any]) -> dict[str, Any]:
    first = str(request.get("code", "")).splitlines()[:1]
    return finished(stdout=(first[0] + "\n") if first else "")


def free_port() -> int:
    """A port nothing listens on (for connection-refused tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeFusionServer:
    def __init__(self, respond: Callable[[dict[str, Any]], dict[str, Any]] | None = None):
        self.respond = respond or _echo_first_line
        self.faults: deque[int | str] = deque()
        self.delay_s = 0.0
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> FakeFusionServer:
        app = web.Application()
        app.router.add_post("/run_code", self._run_code)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _run_code(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            fault = self.faults.popleft() if self.faults else None
            if fault == "drop":
                assert request.transport is not None
                request.transport.close()
                return web.Response(status=500)
            if isinstance(fault, int):
                return web.json_response({"detail": f"injected failure {fault}"}, status=fault)
            return web.json_response(self.respond(body))
        finally:
            self.in_flight -= 1
