"""One rollout step on the simulated engine, and the real-time costs of the code under test.

Each step runs on a fresh :class:`SimEngine` and a fresh virtual-time loop, so its step
times are exact and independent of the machine. The real-time figures are
``perf_counter`` time of the scheduler, rollout fns, engine and tracer:

* :func:`overhead_us_per_request` — a full traced step against :class:`ZeroLatencyEngine`
  (every request answered on the loop's next turn, tool calls instant), per launched
  request: the cost of tailcut's own code, not of simulating an engine;
* :func:`scale_cut` — a step cut early, with every request still in flight, to time the
  abort (``abort_to_idle``) and the settling of every task (``cut_to_settled``).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tailcut.bench.vloop import run_virtual_result
from tailcut.bench.workloads import Trajectory, TurnSpec, make_samples
from tailcut.config import SimEngineConfig
from tailcut.engine.base import BaseEngine
from tailcut.engine.sim import SimEngine, placeholder_result
from tailcut.rollout.admission import Admission
from tailcut.rollout.cutoff import CutoffPolicy, Deadline
from tailcut.rollout.scheduler import run_step
from tailcut.rollout.scripted import ScriptedRollout
from tailcut.rollout.step import StepResult
from tailcut.trace.events import NULL_TRACER, Tracer
from tailcut.types import FinishReason, GenerateRequest, GenerateResult


class ZeroLatencyEngine(BaseEngine):
    """An engine that costs nothing: each request is answered on the loop's next turn with
    ``max_new_tokens`` placeholder tokens and log-probs (what :class:`SimEngine` returns),
    so a step's real time is the scheduler's, the rollout fn's and the tracer's. The
    caller is suspended once per request, as on a real engine; ``abort`` resolves
    requests not yet answered with finish reason ``abort`` and no tokens. Answers of one
    length share their token and log-prob arrays (made once: the engine's own work is
    not what is measured; callers copy from results, never into them)."""

    name = "zero-latency"

    def __init__(self) -> None:
        self._pending: dict[str, asyncio.Future[GenerateResult]] = {}
        self._answers: dict[int, GenerateResult] = {}

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        loop = asyncio.get_running_loop()
        fut = self._pending[request.request_id] = loop.create_future()
        loop.call_soon(self._answer, request, fut)
        return await fut

    def _answer(self, request: GenerateRequest, fut: asyncio.Future[GenerateResult]) -> None:
        if self._pending.pop(request.request_id, None) is not None and not fut.done():
            n = request.sampling.max_new_tokens
            made = self._answers.get(n)
            if made is None:
                made = self._answers[n] = placeholder_result(request, n, FinishReason.LENGTH, 0)
            fut.set_result(
                GenerateResult(
                    request.request_id,
                    made.output_ids,
                    made.finish_reason,
                    made.logprobs,
                    0,
                    len(request.prompt_ids),
                )
            )

    async def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            fut = self._pending.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(GenerateResult(rid, [], FinishReason.ABORT, logprobs=[]))

    async def in_flight(self) -> list[str]:
        return list(self._pending)


@dataclass
class ScaleCut:
    """A step cut early, with (nearly) every request still running."""

    launched: int
    aborted: int
    """Trajectories cut (in the engine or in a tool call)."""
    engine_aborted: int
    """Requests the engine stopped (the batched abort's size)."""
    abort_to_idle_ms: float | None
    cut_to_settled_ms: float | None
    engine_idle: bool


async def _step_async(
    policy: CutoffPolicy,
    trajectories: Sequence[Trajectory],
    engine_cfg: SimEngineConfig,
    run_dir: Path | None,
    step: int,
    abort_deadline_s: float,
    admission: Admission | None = None,
) -> tuple[StepResult, int, int]:
    loop = asyncio.get_running_loop()
    engine = SimEngine(engine_cfg)
    tracer = NULL_TRACER if run_dir is None else Tracer.for_step(run_dir, step, 0, loop.time)
    try:
        result = await run_step(
            engine,
            make_samples(trajectories),
            ScriptedRollout(),
            policy,
            tracer,
            abort_deadline_s=abort_deadline_s,
            admission=admission,
        )
    finally:
        if tracer is not NULL_TRACER:
            tracer.close()
    await engine.aclose()
    return result, engine.wasted_tokens, engine.tokens_after_abort


def run_policy_step(
    policy: CutoffPolicy,
    trajectories: Sequence[Trajectory],
    engine_cfg: SimEngineConfig,
    *,
    run_dir: Path | None = None,
    step: int = 0,
    abort_deadline_s: float = 5.0,
    admission: Admission | None = None,
) -> tuple[StepResult, int, int]:
    """One step of ``policy`` on a fresh engine and virtual loop:
    (result, engine-counted wasted tokens, tokens generated after an abort). With
    ``admission``, engine calls are held by its schedule (``rollout/admission.py``)."""
    return run_virtual_result(
        _step_async(policy, trajectories, engine_cfg, run_dir, step, abort_deadline_s, admission)
    )


def zero_latency(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """The same trajectories with every tool call taking no time."""
    return [
        replace(t, turns=tuple(TurnSpec(u.output_tokens, 0.0, u.tool_tokens) for u in t.turns))
        for t in trajectories
    ]


def overhead_us_per_request(
    policy: CutoffPolicy, trajectories: Sequence[Trajectory], step: int = 0
) -> float:
    """Real µs per launched request of a full traced step against :class:`ZeroLatencyEngine`."""
    samples = make_samples(zero_latency(trajectories[: policy.n_launch]))
    with tempfile.TemporaryDirectory(prefix="tailcut-overhead-") as tmp:

        async def go() -> float:
            loop = asyncio.get_running_loop()
            engine = ZeroLatencyEngine()
            t0 = time.perf_counter()
            with Tracer.for_step(Path(tmp), step, 0, loop.time) as tracer:
                await run_step(engine, samples, ScriptedRollout(), policy, tracer)
            return time.perf_counter() - t0

        elapsed = run_virtual_result(go())
    return elapsed / len(samples) * 1e6


def scale_cut(
    trajectories: Sequence[Trajectory],
    engine_cfg: SimEngineConfig,
    *,
    group_size: int = 1,
    cut_at_s: float = 2.0,
    abort_deadline_s: float = 5.0,
) -> ScaleCut:
    """Cut a step of all ``trajectories`` at ``cut_at_s`` (virtual), whatever is done."""
    n = len(trajectories)
    policy = Deadline(n, group_size, deadline_s=cut_at_s, min_fraction=0.0)
    res, _, _ = run_policy_step(policy, trajectories, engine_cfg, abort_deadline_s=abort_deadline_s)
    stats = res.engine_stats
    return ScaleCut(
        launched=len(res.samples),
        aborted=res.aborted,
        engine_aborted=-1 if stats is None else stats.aborted,
        abort_to_idle_ms=None if res.abort_to_idle_s is None else res.abort_to_idle_s * 1e3,
        cut_to_settled_ms=None if res.cut_to_settled_s is None else res.cut_to_settled_s * 1e3,
        engine_idle=stats is not None and stats.running == 0 and stats.waiting == 0,
    )
