"""A rollout fn that plays a workload trajectory instead of running a model and tools.

Per turn: one ``engine.generate`` of exactly the scripted number of tokens
(``ignore_eos``), then, if the turn has a tool call, ``await asyncio.sleep(tool_s)`` for the
tool and its answer appended to the context (loss mask 0). It keeps the sample's token
layout (``response_ids`` / ``loss_mask`` / ``logprobs`` / ``versions``), sets
``active_request_id`` while it waits on the engine and emits the turn events. An abort
result ends the trajectory with ``FinishReason.ABORT`` and its partial tokens; a
cancellation (the step was cut while the tool ran) is traced and re-raised.

The trajectory comes from ``sample.data["trajectory"]`` (see ``tailcut.bench.workloads``).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets

from tailcut.engine.base import Engine
from tailcut.trace.events import EventKind, Tracer
from tailcut.types import (
    REQUEST_ID_LEN,
    FinishReason,
    GenerateRequest,
    Sample,
    SamplingParams,
    Turn,
    logprob_array,
    mask_array,
    token_array,
)

# Enum members bound once: on Python 3.11 an Enum class attribute goes through
# ``EnumType.__getattr__`` (~5× a plain attribute), and these run per turn.
_ABORT, _STOP = FinishReason.ABORT, FinishReason.STOP
_TURN_START, _TURN_END = EventKind.TURN_START, EventKind.TURN_END
_ENGINE_CALL, _TOOL_CALL = EventKind.TURN_ENGINE_CALL, EventKind.TOOL_CALL

TOOL_NAME = "scripted_tool"
TOOL_TOKEN = 7
"""Placeholder id of the tokens a scripted tool answer adds to the context."""

# One-element arrays repeated (``a * n``) into runs: a memset-like copy, no Python objects.
_SAMPLED, _FORCED = mask_array([1]), mask_array([0])
_NO_LOGPROB, _NO_VERSION, _TOOL_ID = (
    logprob_array([0.0]),
    token_array([-1]),
    token_array([TOOL_TOKEN]),
)


class ScriptedRollout:
    """Plays ``sample.data["trajectory"]`` against ``engine`` (a :class:`RolloutFn`)."""

    def __init__(self, *, temperature: float = 1.0) -> None:
        self.temperature = temperature
        # Ids: a random prefix per instance and a counter (cheaper than fresh randomness),
        # fixed length like every tailcut id.
        prefix = f"sr{secrets.token_hex(3)}-"
        self._id_format = f"{prefix}{{:0{REQUEST_ID_LEN - len(prefix)}d}}".format
        self._ids = itertools.count()
        self._params: dict[int, SamplingParams] = {}

    def _request_id(self) -> str:
        return self._id_format(next(self._ids))

    def _sampling(self, n: int) -> SamplingParams:
        params = self._params.get(n)
        if params is None:
            params = SamplingParams(temperature=self.temperature, max_new_tokens=n, ignore_eos=True)
            self._params[n] = params
        return params

    async def __call__(self, sample: Sample, engine: Engine, tracer: Tracer) -> None:
        trajectory = sample.data.get("trajectory")
        turns = getattr(trajectory, "turns", None)
        if not turns:
            raise ValueError(
                f"sample {sample.index}: data['trajectory'] must be a workload Trajectory "
                f"with at least one turn, got {trajectory!r}"
            )
        loop = asyncio.get_running_loop()
        workid = sample.workid
        for k, spec in enumerate(turns):
            t_turn = loop.time()
            tracer.emit(_TURN_START, workid, turn=k)
            turn = await self._generate(sample, workid, engine, tracer, k, spec.output_tokens)
            if turn.finish_reason is _ABORT:
                sample.finish_reason = _ABORT
                tracer.emit(_TURN_END, workid, loop.time() - t_turn, turn=k)
                return
            if spec.tool_s > 0 or spec.tool_tokens > 0:
                await self._tool(sample, workid, tracer, turn, spec.tool_s, spec.tool_tokens)
            tracer.emit(_TURN_END, workid, loop.time() - t_turn, turn=k)
        sample.finish_reason = _STOP

    async def _generate(
        self, sample: Sample, workid: str, engine: Engine, tracer: Tracer, k: int, n: int
    ) -> Turn:
        loop = asyncio.get_running_loop()
        rid = self._request_id()
        prompt = sample.prompt_ids + sample.response_ids
        turn = Turn(k, rid, len(prompt))
        sample.turns.append(turn)
        request = GenerateRequest(rid, prompt, self._sampling(n))
        t0 = loop.time()
        sample.active_request_id = rid
        try:
            result = await engine.generate(request)
        finally:
            sample.active_request_id = None
            turn.engine_s = loop.time() - t0
        out = len(result.output_ids)
        reason = turn.finish_reason = result.finish_reason
        version = turn.weight_version = result.weight_version
        turn.output_tokens = out
        # ``extend`` copies an array of the same kind with one memcpy (the simulated
        # engine's results) and converts anything else element by element.
        sample.response_ids.extend(result.output_ids)
        sample.loss_mask += _SAMPLED * out
        logprobs = result.logprobs
        if logprobs is None:
            sample.logprobs += _NO_LOGPROB * out
        else:
            sample.logprobs.extend(logprobs)
        sample.versions += token_array([version]) * out
        tracer.emit(
            _ENGINE_CALL,
            workid,
            turn.engine_s,
            turn=k,
            request_id=rid,
            output_tokens=out,
            finish_reason=reason,  # a StrEnum: traced as its value
        )
        return turn

    async def _tool(
        self,
        sample: Sample,
        workid: str,
        tracer: Tracer,
        turn: Turn,
        tool_s: float,
        tool_tokens: int,
    ) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        turn.tool_calls += 1
        try:
            await asyncio.sleep(tool_s)
        except asyncio.CancelledError:
            turn.tool_s = loop.time() - t0
            tracer.emit(
                _TOOL_CALL,
                workid,
                turn.tool_s,
                turn=turn.index,
                name=TOOL_NAME,
                status="cancelled",
            )
            raise
        turn.tool_s = loop.time() - t0
        sample.response_ids += _TOOL_ID * tool_tokens
        sample.loss_mask += _FORCED * tool_tokens
        sample.logprobs += _NO_LOGPROB * tool_tokens
        sample.versions += _NO_VERSION * tool_tokens
        tracer.emit(
            _TOOL_CALL,
            workid,
            turn.tool_s,
            turn=turn.index,
            name=TOOL_NAME,
            status="ok",
        )
