"""Admission control for one step: hold a trajectory's engine call until the schedule
lets it in, and stamp its priority on every request it sends.

It works with every engine: a held request is never sent, so it takes no batch slot and
no KV cache (what a paused request that pays its re-prefill costs on a real engine is its
next turn's prefill, which every turn pays here anyway). Engines with priority scheduling
also get the schedule's priority in ``SamplingParams.priority``.

::

    run_step(..., admission=Admission(ShortestPredictedFirst(...)))
        start(samples, K)    ─► schedule.start
        each sample's rollout fn sees a per-sample engine view:
            generate(req) ─► wait until schedule.may_enter(i) ─► engine.generate(req')
                             (req' = req with priority)          └► schedule.on_turn_end
        each terminal sample ─► schedule.on_done ─► wake the held ones now allowed
        end(samples)          ─► schedule.end (the predictor learns)

A held call waits outside the engine, so a cut cancels it like a tool call; a result
never waits here. The schedule owns no task: this module only parks and wakes futures.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from tailcut.config import ScheduleConfig
from tailcut.engine.base import Engine, EngineView
from tailcut.rollout.predict import LengthPredictor
from tailcut.rollout.spf import ShortestPredictedFirst
from tailcut.rollout.step import RolloutFn
from tailcut.trace.events import Tracer
from tailcut.types import (
    FINISHED,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    Sample,
)


class Admission:
    """The asyncio side of a schedule (see the module docstring)."""

    def __init__(self, schedule: ShortestPredictedFirst, *, stamp_priority: bool = True) -> None:
        self.schedule = schedule
        self.stamp_priority = stamp_priority
        self._held: dict[int, asyncio.Future[None]] = {}
        """Engine calls waiting at the gate, in arrival order (a released one leaves it)."""
        self.held_calls = 0
        """Engine calls that had to wait in this step."""

    # ------------------------------------------------------------------ the step

    def start(self, samples: Sequence[Sample], n_keep: int) -> None:
        self._held = {}
        self.held_calls = 0
        self.schedule.start(samples, n_keep)

    def wrap(self, rollout: RolloutFn) -> RolloutFn:
        """``rollout`` with each sample's engine calls going through this gate."""
        return _GatedRollout(self, rollout)

    def done(self, sample: Sample) -> None:
        """``sample`` reached its terminal state."""
        usable = sample.status in FINISHED
        self.schedule.on_done(sample.index, usable, sample.generated_tokens)
        # Aborted too: by a cut, a released call meets the cut engine and ends at once; by
        # anything else (an engine that aborts on its own), a held call must not wait on
        # for a release that no other event may bring.
        self._release()

    def end(self, samples: Sequence[Sample]) -> None:
        self.schedule.end(samples)

    # ------------------------------------------------------------------ the gate

    async def enter(self, sample: Sample, request: GenerateRequest) -> GenerateRequest:
        """Wait until ``sample`` may use the engine; the request to send."""
        index = sample.index
        if not self.schedule.may_enter(index):
            self.held_calls += 1
            fut = asyncio.get_running_loop().create_future()
            self._held[index] = fut
            self.schedule.hold(index)
            try:
                await fut
            finally:
                if self._held.pop(index, None) is not None:  # cut while held
                    self.schedule.unhold(index)
        if not self.stamp_priority:
            return request
        sampling = dataclasses.replace(request.sampling, priority=self.schedule.priority(index))
        return dataclasses.replace(request, sampling=sampling)

    def left(self, sample: Sample, result: GenerateResult) -> None:
        """An engine call of ``sample`` returned ``result``."""
        if result.finish_reason is FinishReason.ABORT:
            return  # cut: nothing left to schedule for it
        recorded = sum(t.output_tokens for t in sample.turns)
        turns = max(len(sample.turns), 1)  # the turn being recorded is already listed
        self.schedule.on_turn_end(sample.index, recorded + len(result.output_ids), turns)
        self._release()

    def _release(self) -> None:
        if not self._held:
            return
        for index in self.schedule.release():
            self._held.pop(index).set_result(None)


class _GatedEngine(EngineView):
    """One sample's view of the engine: every call waits at the gate first."""

    def __init__(self, engine: Engine, gate: Admission, sample: Sample) -> None:
        super().__init__(engine)
        self.gate = gate
        self.sample = sample

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        request = await self.gate.enter(self.sample, request)
        result = await self.engine.generate(request)
        self.gate.left(self.sample, result)
        return result


class _GatedRollout:
    def __init__(self, gate: Admission, rollout: RolloutFn) -> None:
        self.gate = gate
        self.rollout = rollout

    async def __call__(self, sample: Sample, engine: Engine, tracer: Tracer) -> None:
        self.gate.schedule.relaunch(sample.index)  # a no-op unless a failed try is retried
        await self.rollout(sample, _GatedEngine(engine, self.gate, sample), tracer)


def make_admission(
    cfg: ScheduleConfig, predictor: LengthPredictor | None = None
) -> Admission | None:
    """The admission a schedule config asks for (None: fifo, nothing held), predicting
    with ``predictor`` (None: a fresh one)."""
    if cfg.kind == "fifo":
        return None
    schedule = ShortestPredictedFirst(predictor, margin=cfg.margin, need_ratio=cfg.need_ratio)
    return Admission(schedule)
