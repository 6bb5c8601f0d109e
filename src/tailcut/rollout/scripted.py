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
import math
import secrets
from array import array

from tailcut.engine.base import Engine
from tailcut.trace.events import EventKind, Tracer
from tailcut.types import (
    REQUEST_ID_LEN,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    Sample,
    SamplingParams,
    Turn,
    extend_array,
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
_NO_LOGPROB, _MISSING_LOGPROB, _NO_VERSION, _TOOL_ID = (
    logprob_array([0.0]),
    logprob_array([math.nan]),
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
        self._version_runs: dict[int, array[int]] = {}

    def _sampling(self, n: int) -> SamplingParams:
        params = self._params.get(n)
        if params is None:
            params = SamplingParams(temperature=self.temperature, max_new_tokens=n, ignore_eos=True)
            self._params[n] = params
        return params

    def _versions(self, version: int) -> array[int]:
        """A one-element array of ``version`` (repeated into a run per turn)."""
        run = self._version_runs.get(version)
        if run is None:
            run = self._version_runs[version] = token_array([version])
        return run

    async def __call__(self, sample: Sample, engine: Engine, tracer: Tracer) -> None:
        trajectory = sample.data.get("trajectory")
        turns = getattr(trajectory, "turns", None)
        if not turns:
            raise ValueError(
                f"sample {sample.index}: data['trajectory'] must be a workload Trajectory "
                f"with at least one turn, got {trajectory!r}"
            )
        # One coroutine per trajectory: the engine call and the tool wait are awaited here
        # and the bookkeeping around them is plain calls (a nested coroutine per turn would
        # cost a frame on every resume).
        clock = asyncio.get_running_loop().time
        workid = sample.workid
        emit = tracer.emit
        for k, spec in enumerate(turns):
            t_turn = clock()
            emit(_TURN_START, workid, turn=k)
            request, turn = self._request(sample, k, spec.output_tokens)
            sample.active_request_id = request.request_id
            t_engine = clock()
            try:
                result = await engine.generate(request)
            finally:
                sample.active_request_id = None
                turn.engine_s = clock() - t_engine
            self._record(sample, workid, tracer, turn, result)
            if result.finish_reason is _ABORT:
                sample.finish_reason = _ABORT
                emit(_TURN_END, workid, clock() - t_turn, turn=k)
                return
            if spec.tool_s > 0 or spec.tool_tokens > 0:
                turn.tool_calls += 1
                t_tool = clock()
                try:
                    await asyncio.sleep(spec.tool_s)
                except asyncio.CancelledError:
                    turn.tool_s = clock() - t_tool
                    emit(
                        _TOOL_CALL, workid, turn.tool_s, turn=k, name=TOOL_NAME, status="cancelled"
                    )
                    raise
                turn.tool_s = clock() - t_tool
                self._tool_answer(sample, spec.tool_tokens)
                emit(_TOOL_CALL, workid, turn.tool_s, turn=k, name=TOOL_NAME, status="ok")
            emit(_TURN_END, workid, clock() - t_turn, turn=k)
        sample.finish_reason = _STOP

    def _request(self, sample: Sample, k: int, n: int) -> tuple[GenerateRequest, Turn]:
        """The next turn's request (prompt + everything so far) and its turn record."""
        rid = self._id_format(next(self._ids))
        prompt = sample.prompt_ids + sample.response_ids  # arrays: one memcpy
        turn = Turn(k, rid, len(prompt))
        sample.turns.append(turn)
        return GenerateRequest(rid, prompt, self._sampling(n)), turn

    def _record(
        self, sample: Sample, workid: str, tracer: Tracer, turn: Turn, result: GenerateResult
    ) -> None:
        """Append the sampled tokens (mask 1) and trace the engine call."""
        out = len(result.output_ids)
        reason = turn.finish_reason = result.finish_reason
        version = turn.weight_version = result.weight_version
        turn.output_tokens = out
        # One memcpy for an array of the same kind (the simulated engine's results),
        # element by element for anything else.
        extend_array(sample.response_ids, result.output_ids)
        sample.loss_mask += _SAMPLED * out
        logprobs = result.logprobs
        if logprobs is None:
            sample.logprobs += _MISSING_LOGPROB * out
        else:
            extend_array(sample.logprobs, logprobs)
        sample.versions += self._versions(version) * out
        tracer.emit(
            _ENGINE_CALL,
            workid,
            turn.engine_s,
            turn=turn.index,
            engine_request_id=turn.request_id,
            prompt_tokens=turn.prompt_tokens,
            output_tokens=out,
            finish_reason=reason,  # a StrEnum: traced as its value
        )

    @staticmethod
    def _tool_answer(sample: Sample, n: int) -> None:
        """The tool's answer: ``n`` context tokens the policy did not sample (mask 0)."""
        sample.response_ids += _TOOL_ID * n
        sample.loss_mask += _FORCED * n
        sample.logprobs += _NO_LOGPROB * n
        sample.versions += _NO_VERSION * n
