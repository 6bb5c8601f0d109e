"""The over-sampled rollout step: one TaskGroup, event-driven, cut by a pure policy.

::

    launch n_launch samples ──► each runs the rollout fn ──► terminal record (once)
               │                          │ on_done(...)
               ▼                          ▼
        wait for: cut decided | all done | policy deadline  (no polling)
               │ cut
               ▼
      1. one batched engine.abort(ids in flight)      (free the engine first)
      2. cancel the tasks that are not inside generate (tool calls, between turns)
         - tasks inside generate resolve with finish reason ABORT and their partial tokens
         - a result that lands after the cut cancels its task at its next await
      3. verify engine.in_flight() has none of ours; re-abort with back-off until the
         deadline, then raise AbortNotConfirmed naming the ids
      4. wait for every task to settle (bounded); stragglers are cancelled

Every launched sample ends exactly once with a status; results keep launch order. A real
error becomes a FAILED record with its message, never padding; an ``EngineDied`` fails the
whole step with a clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tailcut.engine.base import (
    AbortNotConfirmed,
    Engine,
    EngineDied,
    EngineError,
    EngineStats,
    EngineView,
)
from tailcut.rollout.cutoff import CutoffPolicy, GlobalShare, StepFeedback
from tailcut.rollout.gc_pause import gc_paused
from tailcut.rollout.refill import Refill
from tailcut.rollout.state import is_terminal, transition
from tailcut.rollout.step import RolloutFn, StepFailed, StepResult
from tailcut.trace.events import EventKind, Tracer
from tailcut.types import FinishReason, GenerateRequest, GenerateResult, Sample, Status

if TYPE_CHECKING:
    from tailcut.rollout.admission import Admission


class CutHandle:
    """A handle for a driver outside the step (a global cut coordinator).

    ``on_sample_done`` is called once per sample as it reaches its terminal state;
    ``cut(reason)`` cuts the step now (or as soon as it starts, if called before). Both run
    on the step's event loop.
    """

    def __init__(self, on_sample_done: Callable[[Sample], None] | None = None) -> None:
        self.on_sample_done = on_sample_done
        self._step: _StepRun | None = None
        self._pending_cut: str | None = None

    def cut(self, reason: str = "external") -> None:
        if self._step is None:
            self._pending_cut = self._pending_cut or reason
        elif self._step.cut_reason is None and self._step.pending:
            self._step._decide_cut(reason)

    def _attach(self, step: _StepRun) -> None:
        self._step = step
        if self._pending_cut is not None:
            self.cut(self._pending_cut)


class _TrackedEngine(EngineView):
    """The engine as the rollout fns of one step see it: tracks requests in flight and
    refuses new ones after the cut (they resolve at once with ``abort``)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.active: dict[str, asyncio.Task[object]] = {}
        self.submitted: set[str] = set()
        self.cut = False

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        task = asyncio.current_task()
        assert task is not None
        if self.cut:
            task.cancel()  # the step is over: stop this trajectory at its next await
            return GenerateResult(request.request_id, [], FinishReason.ABORT, logprobs=[])
        self.active[request.request_id] = task
        self.submitted.add(request.request_id)
        try:
            result = await self.engine.generate(request)
        finally:
            del self.active[request.request_id]
        if self.cut:
            task.cancel()  # a result that raced the cut: keep its tokens, stop after
        return result


# Enum members the per-sample paths use, bound once: on Python 3.11 an Enum class
# attribute goes through ``EnumType.__getattr__`` (~5× a plain attribute).
_STOP, _ABORT, _FAILED_REASON = FinishReason.STOP, FinishReason.ABORT, FinishReason.FAILED
_TRUNCATING = (FinishReason.LENGTH, FinishReason.MAX_TURNS)
_RUNNING, _COMPLETED, _TRUNCATED = Status.RUNNING, Status.COMPLETED, Status.TRUNCATED
_ABORTED, _FAILED = Status.ABORTED, Status.FAILED
_START, _DONE = EventKind.REQUEST_START, EventKind.REQUEST_COMPLETE
_ABORTED_EVENT, _FAILED_EVENT = EventKind.REQUEST_ABORTED, EventKind.REQUEST_FAILED


def _status_for(reason: FinishReason | None) -> Status:
    if reason is _STOP:
        return _COMPLETED
    if reason in _TRUNCATING:
        return _TRUNCATED
    if reason is _ABORT:
        return _ABORTED
    raise ValueError(f"rollout returned without a valid finish reason ({reason!r})")


class _StepRun:
    admission: Admission | None = None
    """Length-aware admission of the step's engine calls (None: every call goes in)."""

    def __init__(
        self,
        engine: Engine,
        samples: list[Sample],
        rollout: RolloutFn,
        policy: CutoffPolicy,
        tracer: Tracer,
        abort_deadline_s: float,
        timeout_s: float | None,
        control: CutHandle | None,
        max_retries: int = 0,
    ) -> None:
        self.control = control
        self.max_retries = max_retries
        self.retries = 0
        self.recovered = 0
        self.engine = _TrackedEngine(engine)
        self.samples = samples
        self.rollout = rollout
        self.policy = policy
        self.tracer = tracer
        self.abort_deadline_s = abort_deadline_s
        self.timeout_s = timeout_s
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.wake = asyncio.Event()
        self.cut_reason: str | None = None
        self.cut_at: float | None = None
        self.cut_perf: float | None = None
        self.pending = len(samples)
        self.fatal: BaseException | None = None

    # -- one sample -------------------------------------------------------------------
    async def run_one(self, sample: Sample) -> None:
        sample.launched_at = self.loop.time()
        transition(sample, _RUNNING)
        workid = sample.workid
        self.tracer.emit(_START, workid, index=sample.index, group=sample.group)
        refill = Refill(sample, self.max_retries) if self.max_retries else None
        try:
            await self._attempts(sample, refill)
        except asyncio.CancelledError:
            self._finish(sample, workid, _ABORTED)
            raise
        except EngineDied as exc:
            self._finish(sample, workid, _FAILED, exc)
            if self.fatal is None:
                self.fatal = exc
            self.wake.set()
        except Exception as exc:
            self._finish(sample, workid, _FAILED, exc)
        else:
            try:
                status = _status_for(sample.finish_reason)
            except ValueError as exc:
                self._finish(sample, workid, _FAILED, exc)
            else:
                self._finish(sample, workid, status)
        finally:
            if refill is not None and refill.attempts and sample.status is not _FAILED:
                self.recovered += 1

    async def _attempts(self, sample: Sample, refill: Refill | None) -> None:
        """The rollout fn, relaunched on a failure while ``refill`` allows and the step is
        not cut (``rollout/refill.py``); the last failure propagates."""
        while True:
            try:
                await self.rollout(sample, self.engine, self.tracer)
                return
            except (asyncio.CancelledError, EngineDied):
                raise
            except Exception as exc:
                if refill is None or self.cut_reason is not None or not refill.again(exc):
                    raise
                self.retries += 1

    def _finish(
        self, sample: Sample, workid: str, status: Status, exc: BaseException | None = None
    ) -> None:
        now = self.loop.time()
        sample.ended_at = now
        sample.active_request_id = None
        transition(sample, status)
        if status is _ABORTED:
            sample.finish_reason = _ABORT
            self.tracer.emit(
                _ABORTED_EVENT,
                workid,
                duration_sec=now - self.t0,
                engine_request_id=sample.turns[-1].request_id if sample.turns else "",
                output_tokens=sample.generated_tokens,
                turns=len(sample.turns),
                turn_tokens=[t.output_tokens for t in sample.turns],
            )
        elif status is _FAILED:
            sample.finish_reason = _FAILED_REASON
            sample.error = f"{type(exc).__name__}: {exc}" if exc else "failed"
            self.tracer.emit(
                _FAILED_EVENT,
                workid,
                duration_sec=now - (sample.launched_at or self.t0),
                error=sample.error,
                output_tokens=sample.generated_tokens,
            )
        else:
            self.tracer.emit(
                _DONE,
                workid,
                duration_sec=now - (sample.launched_at or self.t0),
                status=status,  # StrEnums: traced as their values
                turns=len(sample.turns),
                output_tokens=sample.generated_tokens,
                finish_reason=sample.finish_reason,
            )
        self.pending -= 1
        if self.admission is not None:
            self.admission.done(sample)
        if self.control is not None and self.control.on_sample_done is not None:
            self.control.on_sample_done(sample)
        if self.cut_reason is None and self.policy.on_done(
            sample.index, sample.group, status, now, sample.reward
        ):
            self._decide_cut("target")
        if self.pending == 0:
            self.wake.set()

    # -- the step ---------------------------------------------------------------------
    def _decide_cut(self, reason: str) -> None:
        self.cut_reason = reason
        self.cut_at = self.loop.time()
        self.cut_perf = time.perf_counter()
        self.engine.cut = True
        self.wake.set()

    async def wait_for_cut(self) -> None:
        """Return when the step is cut, all samples are done, or the engine died."""
        hard = None if self.timeout_s is None else self.t0 + self.timeout_s
        while self.pending and self.cut_reason is None and self.fatal is None:
            soft = self.policy.deadline()
            deadline = min((d for d in (soft, hard) if d is not None), default=None)
            try:
                async with asyncio.timeout_at(deadline):
                    await self.wake.wait()
            except TimeoutError:
                now = self.loop.time()
                if hard is not None and now >= hard:
                    self._decide_cut("step_timeout")
                elif self.policy.on_deadline(now):
                    self._decide_cut("deadline")
            self.wake.clear()


async def run_step(
    engine: Engine,
    samples: Sequence[Sample],
    rollout: RolloutFn,
    policy: CutoffPolicy,
    tracer: Tracer,
    *,
    abort_deadline_s: float = 5.0,
    timeout_s: float | None = None,
    control: CutHandle | None = None,
    gc_pause: bool = True,
    max_retries: int = 0,
    admission: Admission | None = None,
) -> StepResult:
    """Run one over-sampled step over ``samples`` (launch ``policy.n_launch`` of them).

    Raises ``StepFailed`` if the engine died or aborts could not be confirmed; every
    sample is terminal and traced before it raises. ``timeout_s`` is a hard cap on the
    step (the clock of the running loop): past it the step is cut whatever the policy says.
    ``control`` lets an outside driver watch completions and cut the step (global cut
    across workers). ``gc_pause`` pauses Python's cyclic garbage collector while the step
    runs and collects the young generations once at its end (see ``rollout/gc_pause.py``;
    False: the interpreter's default). ``max_retries`` relaunches a FAILED sample within
    the step up to that many times (``rollout/refill.py``). ``admission`` holds engine
    calls by a length-aware schedule (``rollout/admission.py``; None: none held).
    """
    samples = list(samples)
    if len(samples) != policy.n_launch:
        raise ValueError(
            f"{policy.name} launches {policy.n_launch} samples but {len(samples)} were given"
        )
    first = samples[0].index if samples else 0
    if [s.index for s in samples] != list(range(first, first + len(samples))):
        raise ValueError("samples must be indexed consecutively in launch order")
    if admission is not None:
        admission.start(samples, policy.target_completion)
        rollout = admission.wrap(rollout)
    with gc_paused(gc_pause):
        step = _StepRun(
            engine, samples, rollout, policy, tracer, abort_deadline_s, timeout_s, control,
            max_retries,
        )  # fmt: skip
        step.admission = admission
        result = await _run_step(step)
    if admission is not None:
        admission.end(result.samples)
    return result


async def _run_step(step: _StepRun) -> StepResult:
    policy, control = step.policy, step.control
    policy.start(step.t0)
    tasks: list[asyncio.Task[None]] = []
    unconfirmed: list[str] = []
    abort_to_idle: float | None = None
    rounds = 0
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(step.run_one(s)) for s in step.samples]
        if control is not None:
            # every trajectory starts (RUNNING, traced) before a cut that came early can
            # cancel it: a task cancelled before its first step never records its end
            await asyncio.sleep(0)
            control._attach(step)
        await step.wait_for_cut()
        if step.fatal is not None:
            # The engine is gone: nothing to abort there; stop every trajectory.
            step._decide_cut("engine_died")
            _trace_cut(step)
            for task in tasks:
                task.cancel()
        elif step.cut_reason is not None:
            _trace_cut(step)
            rounds, unconfirmed = await _abort_in_flight(step, tasks)
            if step.cut_perf is not None:
                abort_to_idle = time.perf_counter() - step.cut_perf
            await _settle(step, tasks)
    return _result(step, rounds, unconfirmed, abort_to_idle, await step.engine.stats())


def _trace_cut(step: _StepRun) -> None:
    step.tracer.emit(
        EventKind.CUTOFF,
        None,
        duration_sec=(step.cut_at or step.t0) - step.t0,
        reason=step.cut_reason,
        done=len(step.samples) - step.pending,
        launched=len(step.samples),
    )


async def _abort_in_flight(
    step: _StepRun, tasks: list[asyncio.Task[None]]
) -> tuple[int, list[str]]:
    """Abort every request we have in the engine; cancel tasks outside the engine; verify.

    Returns (abort rounds, ids still running at the deadline)."""
    engine = step.engine.engine
    ids = list(step.engine.active)
    rounds = 0
    if ids:
        await _send_abort(engine, ids)
        rounds = 1
    inside = set(step.engine.active.values())
    for task in tasks:
        if not task.done() and task not in inside:
            task.cancel()
    ours = step.engine.submitted
    deadline = step.loop.time() + step.abort_deadline_s
    delay = 0.01
    while True:
        try:
            left = [rid for rid in await engine.in_flight() if rid in ours]
        except EngineDied as exc:  # nothing left to abort: end the step as failed
            step.fatal = step.fatal or exc
            for task in tasks:
                task.cancel()
            return rounds, []
        except EngineError:  # not answered this round: ours still tracked in flight
            left = list(step.engine.active)
        if not left:
            return rounds, []
        remaining = deadline - step.loop.time()
        if remaining <= 0:
            return rounds, left
        # Back off on the tasks themselves (a confirmed abort resolves them), then retry.
        waiting = [t for t in tasks if not t.done()]
        if waiting:
            await asyncio.wait(waiting, timeout=min(delay, remaining))
        else:
            await asyncio.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.5)
        await _send_abort(engine, left)
        rounds += 1


async def _send_abort(engine: Engine, ids: list[str]) -> None:
    """An abort that fails to send is not fatal by itself: the verification loop retries
    and reports the ids that would not stop."""
    with contextlib.suppress(EngineError):
        await engine.abort(ids)


async def _settle(step: _StepRun, tasks: list[asyncio.Task[None]]) -> None:
    """Wait (bounded) for every sample to reach its terminal record (aborted generate
    calls return, cancelled tool calls unwind), then cancel the stragglers. Waits on the
    step's wake event, which the last sample to finish sets: no callback per task."""
    try:
        async with asyncio.timeout(step.abort_deadline_s):
            while step.pending:
                step.wake.clear()
                await step.wake.wait()
    except TimeoutError:
        for task in tasks:
            if not task.done():
                task.cancel()


def _global_target(policy: CutoffPolicy) -> dict[str, int]:
    """What the coordinator of a step cut over all workers aimed for (traced on each
    worker's monitoring event); nothing for a step this worker's own policy cuts."""
    if not isinstance(policy, GlobalShare):
        return {}
    return {"global_target": policy.global_target, "global_launched": policy.global_launched}


def _result(
    step: _StepRun,
    rounds: int,
    unconfirmed: list[str],
    abort_to_idle: float | None,
    stats: EngineStats,
) -> StepResult:
    loop_now = step.loop.time()
    counts: dict[Status, int] = {}
    for s in step.samples:
        if not is_terminal(s.status):  # pragma: no cover - guarded by the TaskGroup
            raise AssertionError(f"sample {s.index} left in state {s.status}")
        counts[s.status] = counts.get(s.status, 0) + 1
    cut_time = None if step.cut_at is None else step.cut_at - step.t0
    settled = None if step.cut_perf is None else time.perf_counter() - step.cut_perf
    step.tracer.emit(
        EventKind.STEP_MONITORING,
        None,
        duration_sec=(step.cut_at or loop_now) - step.t0,
        total_requests=len(step.samples),
        target_completion=step.policy.target_completion,
        completed_count=counts.get(Status.COMPLETED, 0) + counts.get(Status.TRUNCATED, 0),
        **_global_target(step.policy),
    )
    step.tracer.emit(EventKind.STEP_TOTAL, None, duration_sec=loop_now - step.t0)
    step.tracer.flush()
    if step.fatal is not None:
        raise StepFailed(f"rollout step failed: engine died: {step.fatal}") from step.fatal
    if unconfirmed:
        raise StepFailed(str(AbortNotConfirmed(unconfirmed, step.engine.name)))
    usable = counts.get(Status.COMPLETED, 0) + counts.get(Status.TRUNCATED, 0)
    step.policy.end(
        StepFeedback(
            step_time_s=cut_time if cut_time is not None else loop_now - step.t0,
            cut=cut_time is not None,
            usable=usable,
            launched=len(step.samples),
        )
    )
    return StepResult(
        samples=step.samples,
        kept=step.policy.select(step.samples),
        step_time_s=loop_now - step.t0,
        cut_time_s=cut_time,
        cut_reason=step.cut_reason,
        abort_to_idle_s=abort_to_idle,
        cut_to_settled_s=settled,
        abort_rounds=rounds,
        target_completion=step.policy.target_completion,
        engine_stats=stats,
        counts=counts,
        retries=step.retries,
        recovered=step.recovered,
    )
