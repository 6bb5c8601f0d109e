"""The HTTP plumbing of the remote engines (``engine/http.py``) on real loopback sockets, where
a connection fails before an answer: a server that takes the call and hangs up, and one that
never accepts the connection (its backlog full, so the connect times out). Each is a
``ServerUnreachable`` (an ``EngineDied``: the client marks the server dead) that names the
server, never a raw ``aiohttp`` error or a time-out said to be the server's answer."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from tailcut.engine.base import EngineDied
from tailcut.engine.http import ServerClient, ServerUnreachable

pytestmark = pytest.mark.timeout(30)


@asynccontextmanager
async def hanging_up() -> AsyncIterator[tuple[str, list[int]]]:
    """A server that reads each call's head and closes the connection unanswered."""
    calls: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        calls.append(1)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", calls
    finally:
        server.close()
        await server.wait_closed()


@asynccontextmanager
async def never_accepting() -> AsyncIterator[str]:
    """A listening socket that accepts nothing, its one-slot backlog already taken: a
    connect to it gets no answer at all."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fill = []
    for _ in range(3):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))  # in progress, or queued: neither is accepted
        fill.append(sock)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for sock in [*fill, srv]:
            sock.close()


def test_a_stream_the_server_hangs_up_on_is_unreachable_and_not_sent_again() -> None:
    async def main() -> None:
        async with hanging_up() as (url, calls):
            client = ServerClient(url, label="vllm", retries=3)
            try:
                with pytest.raises(ServerUnreachable, match=rf"vllm server {url} unreachable"):
                    async with client.stream("/v1/completions", {"prompt": [1]}):
                        pass
            finally:
                await client.aclose()
            assert len(calls) == 1  # it reached the server: a generation is never sent twice

    asyncio.run(main())


@pytest.mark.parametrize("how", ["stream", "request"])
def test_a_connect_that_times_out_is_unreachable_after_the_retries(how: str) -> None:
    async def main() -> None:
        async with never_accepting() as url:
            client = ServerClient(url, label="sglang", connect_timeout_s=0.2, retries=1)
            try:
                with pytest.raises(EngineDied) as err:
                    if how == "stream":
                        async with client.stream("/generate", {}):
                            pass
                    else:
                        await client.request("POST", "/generate", json={}, timeout_s=30)
            finally:
                await client.aclose()
            msg = str(err.value)
            assert isinstance(err.value, ServerUnreachable), msg
            assert f"{url} unreachable (/generate, 2 attempt(s))" in msg, msg
            assert "did not answer" not in msg

    asyncio.run(main())
