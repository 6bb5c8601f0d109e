"""A hand-written timed engine for scheduler tests: each request decodes one token every
``token_s`` seconds of loop time until ``max_new_tokens``; abort resolves it at once with
the tokens so far. Records every abort. Can lose aborts, hang, or die."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tailcut.engine.base import BaseEngine, EngineDied
from tailcut.types import FinishReason, GenerateRequest, GenerateResult


class TimedEngine(BaseEngine):
    name = "timed-fake"

    def __init__(self, token_s: float = 0.01, lose_aborts: int = 0, hang: set[int] | None = None):
        self.token_s = token_s
        self.lose_aborts = lose_aborts
        self.hang = hang or set()  # max_new_tokens values that never finish
        self.running: dict[str, tuple[float, asyncio.Future[None]]] = {}
        self.aborts: list[list[str]] = []
        self.aborted_tokens: dict[str, int] = {}
        self.dead = False

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        if self.dead:
            raise EngineDied("timed-fake is dead")
        loop = asyncio.get_running_loop()
        n = request.sampling.max_new_tokens
        stop = loop.create_future()
        self.running[request.request_id] = (loop.time(), stop)
        try:
            wait = None if n in self.hang else n * self.token_s
            try:
                async with asyncio.timeout(wait):
                    await stop
            except TimeoutError:
                return GenerateResult(request.request_id, [1] * n, FinishReason.LENGTH, [0.0] * n)
            if self.dead:
                raise EngineDied("timed-fake died mid-request")
            started = self.running[request.request_id][0]
            k = int((loop.time() - started) / self.token_s + 1e-9)
            self.aborted_tokens[request.request_id] = k
            return GenerateResult(request.request_id, [1] * k, FinishReason.ABORT, [0.0] * k)
        finally:
            self.running.pop(request.request_id, None)

    async def abort(self, request_ids: Sequence[str]) -> None:
        self.aborts.append(list(request_ids))
        if self.lose_aborts > 0:
            self.lose_aborts -= 1
            return
        for rid in request_ids:
            entry = self.running.get(rid)
            if entry is not None and not entry[1].done():
                entry[1].set_result(None)

    async def in_flight(self) -> list[str]:
        return [rid for rid, (_, fut) in self.running.items() if not fut.done()]

    def die(self) -> None:
        self.dead = True
        for _, fut in self.running.values():
            if not fut.done():
                fut.set_result(None)
