"""A rollout fn for scheduler tests: plays per-sample scripts of (output_tokens, tool_s)."""

from __future__ import annotations

import asyncio

from tailcut.engine.base import Engine
from tailcut.trace.events import Tracer
from tailcut.types import (
    FinishReason,
    GenerateRequest,
    Sample,
    SamplingParams,
    Turn,
    new_request_id,
)


class TurnsRollout:
    """Plays per-sample scripts: a list of (output_tokens, tool_s) turns."""

    def __init__(self, scripts: list[list[tuple[int, float]]], fail: set[int] | None = None):
        self.scripts = scripts
        self.fail = fail or set()

    async def __call__(self, sample: Sample, engine: Engine, tracer: Tracer) -> None:
        for k, (n, tool_s) in enumerate(self.scripts[sample.index]):
            rid = new_request_id()
            turn = Turn(index=k, request_id=rid, prompt_tokens=len(sample.prompt_ids))
            sample.turns.append(turn)
            sample.active_request_id = rid
            req = GenerateRequest(rid, sample.prompt_ids, SamplingParams(max_new_tokens=n))
            result = await engine.generate(req)
            sample.active_request_id = None
            turn.output_tokens = len(result.output_ids)
            turn.finish_reason = result.finish_reason
            sample.response_ids.extend(result.output_ids)
            if result.finish_reason is FinishReason.ABORT:
                sample.finish_reason = FinishReason.ABORT
                return
            if sample.index in self.fail:
                raise RuntimeError(f"reward exploded for {sample.index}")
            if tool_s:
                await asyncio.sleep(tool_s)
        sample.finish_reason = FinishReason.STOP
