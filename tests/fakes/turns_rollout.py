"""Rollout fns for scheduler and engine tests: per-sample scripts of (output_tokens, tool_s),
or turns that each continue the sequence."""

from __future__ import annotations

import asyncio
from typing import Any

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


class ContinuingTurns:
    """Three engine calls per sample, each continuing the sequence (a multi-turn agent
    without tool output), of ``lengths[sample.index]`` tokens each: response tokens are all
    sampled, loss mask 1."""

    def __init__(self, lengths: dict[int, int], **sampling: Any) -> None:
        self.lengths = lengths
        self.sampling = sampling

    async def __call__(self, sample: Sample, engine: Engine, tracer: Tracer) -> None:
        for _ in range(3):
            n = self.lengths[sample.index]
            req = GenerateRequest(
                new_request_id(),
                sample.prompt_ids + sample.response_ids,
                SamplingParams(max_new_tokens=n, **self.sampling),
            )
            sample.active_request_id = req.request_id
            result = await engine.generate(req)
            sample.active_request_id = None
            sample.response_ids.extend(result.output_ids)
            sample.logprobs.extend(result.logprobs or [])
            sample.loss_mask.extend([1] * len(result.output_ids))
            if result.finish_reason is FinishReason.ABORT:
                sample.finish_reason = FinishReason.ABORT
                return
        sample.finish_reason = FinishReason.STOP
