"""Many rollout workers behind one object, with a per-worker or a global cut.

A :class:`RolloutWorker` owns one engine client and one rollout fn (built from a
picklable :class:`WorkerRecipe`) and runs the steps of its share of the samples. The
trainer talks to a :class:`Workers` object — :class:`LocalWorkers` (same process, same
event loop) or ``RayWorkers`` (one Ray actor per worker, ``rollout/ray_workers.py``) — and
gets back one merged :class:`StepResult` in global launch order.

Cut scope (``CutoffConfig.scope``):

* ``worker``: every worker runs its own policy on its share (``n_target / W``) and stops
  at its own target (each worker's step ends when it is done).
* ``global``: workers never cut by themselves (each runs a ``GlobalShare`` of the step);
  each completion goes to the :class:`Coordinator`, which runs the configured policy over
  the whole step and tells every worker to cut at once. Group-quota works across workers:
  a group lives on one worker. Each worker's trace records the coordinator's target
  (``global_target`` and ``global_launched`` on its monitoring event).

Samples are split in contiguous blocks of whole groups, so worker ``r`` holds global
indices ``offsets[r] .. offsets[r+1]-1``. Samples are numbered once, by the caller, in
launch order over the whole step: a worker's samples keep their global indices (and the
seeds the caller gave them), so its results merge back without renumbering.

A caller that owns its policy (the trainer: learned state in checkpoints, uncut audit
steps, resumed partial trajectories) plans with :func:`plan_for_policy`: that one policy
decides the cut over the whole step, so N workers keep the same samples a single worker
would. A worker's length predictor (``StepOptions.schedule``) stays in the worker; its state
comes back with every step (``StepResult.predictor_states``) for the caller's checkpoints,
and a resumed run's workers start from it (``StepOptions.predictor_states``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from tailcut.config import CutoffConfig
from tailcut.engine.base import Engine, EngineStats
from tailcut.rollout.admission import Admission, make_admission
from tailcut.rollout.cutoff import CutoffPolicy, StepFeedback
from tailcut.rollout.predict import LengthPredictor
from tailcut.rollout.scheduler import CutHandle, run_step
from tailcut.rollout.step import (
    DEFAULT_STEP_OPTIONS,
    RolloutFn,
    StepFailed,
    StepOptions,
    StepResult,
)
from tailcut.rollout.worker_plan import WorkerPlan as WorkerPlan
from tailcut.rollout.worker_plan import plan_for_policy as plan_for_policy
from tailcut.rollout.worker_plan import plan_step as plan_step
from tailcut.rollout.worker_plan import split_at_groups as split_at_groups
from tailcut.rollout.worker_plan import split_offsets as split_offsets
from tailcut.trace.events import Tracer
from tailcut.types import FinishReason, Sample, Status


class WorkerRecipe(Protocol):
    """Builds a worker's engine and rollout fn inside the worker (picklable). A recipe with
    ``owns_engine = False`` hands out an engine someone else closes (the worker leaves it
    open); any other recipe's engine is the worker's to close."""

    async def build(self, rank: int) -> tuple[Engine, RolloutFn]: ...


@dataclass(frozen=True)
class SharedRecipe:
    """Every worker drives the same in-process engine (which its owner closes, not the
    workers) with the same rollout fn. For workers on the caller's event loop only (not
    picklable)."""

    engine: Engine
    rollout: RolloutFn
    owns_engine = False

    async def build(self, rank: int) -> tuple[Engine, RolloutFn]:
        return self.engine, self.rollout


CutFn = Callable[[str], object]


class Coordinator:
    """Runs the global policy over completion events from every worker; cuts them all.

    Pure bookkeeping plus a deadline watcher; it owns no worker. ``cut_fns[r]`` tells
    worker ``r`` to cut (a direct call locally, a Ray actor call on Ray).
    """

    def __init__(self, policy: CutoffPolicy, offsets: Sequence[int], cut_fns: Sequence[CutFn]):
        self.policy = policy
        self.offsets = list(offsets)
        self.cut_fns = list(cut_fns)
        self.reported: set[int] = set()
        self.decided_at: float | None = None
        self.reason: str | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        self.policy.start(asyncio.get_running_loop().time())
        self.reported.clear()
        self.decided_at = None
        self.reason = None

    def report(self, index: int, group: int, status: Status, reward: float | None = None) -> None:
        """Sample ``index`` (its index in the whole step) reached ``status``."""
        if index in self.reported:
            return
        self.reported.add(index)
        now = asyncio.get_running_loop().time()
        if self.reason is None and self.policy.on_done(index, group, status, now, reward):
            self._cut("target")
        self._wake.set()

    def worker_lost(self, rank: int) -> None:
        """Count a dead worker's unreported samples as FAILED (tolerated worker loss)."""
        for index in range(self.offsets[rank], self.offsets[rank + 1]):
            if index not in self.reported:
                self.report(index, -1, Status.FAILED)

    def _cut(self, reason: str) -> None:
        self.reason = reason
        self.decided_at = time.monotonic()
        for cut in self.cut_fns:
            cut(reason)

    async def watch(self) -> None:
        """Wake at the policy's deadline until the step is cut or every sample reported."""
        total = self.offsets[-1]
        while self.reason is None and len(self.reported) < total:
            try:
                async with asyncio.timeout_at(self.policy.deadline()):
                    await self._wake.wait()
            except TimeoutError:
                if self.policy.on_deadline(asyncio.get_running_loop().time()):
                    self._cut("deadline")
            self._wake.clear()

    def select(self, samples: Sequence[Sample]) -> list[int]:
        return self.policy.select(samples)


@dataclass(slots=True)
class WorkerResult:
    """What a worker returns for one step (picklable)."""

    rank: int
    result: StepResult
    cut_received_at: float | None
    """``time.monotonic()`` when the worker got the cut (None: cut locally or not at all)."""
    policy_state: dict[str, object]
    """The worker policy's learned state after the step (shipped back from remote workers)."""
    predictor_state: dict[str, Any] | None = None
    """The worker's length predictor after the step (None: no length-aware schedule)."""


class RolloutWorker:
    """One worker: an engine client, a rollout fn, its own trace file per step."""

    def __init__(self, rank: int, recipe: WorkerRecipe, run_dir: Path | None = None) -> None:
        self.rank = rank
        self.recipe = recipe
        self.run_dir = run_dir
        self.engine: Engine | None = None
        self.rollout: RolloutFn | None = None
        self.control: CutHandle | None = None
        self.owns_engine = bool(getattr(recipe, "owns_engine", True))
        self.cut_received_at: float | None = None
        self.admission: Admission | None = None
        """This worker's length-aware gate (``StepOptions.schedule``), kept across steps: its
        predictor learns each prompt's lengths from the steps before."""
        self.predictor: LengthPredictor | None = None
        """The gate's predictor, built with it at the first step (a resumed run's from its
        saved state, ``StepOptions.predictor_states``)."""
        self._run: object = None
        """The token of the step running now (None: none, or one started without one)."""
        self._early: tuple[object, str, float] | None = None
        """A cut (token, reason, when) that arrived before its step's handle existed."""
        self._traced: tuple[int, int] = (-1, 0)
        """(last step traced, rounds of it so far): a step run again (another launch
        round of the trainer, ``algo.filter_groups``) traces to ``worker_R.roundN.jsonl``."""

    async def start(self) -> None:
        self.engine, self.rollout = await self.recipe.build(self.rank)

    def cut(self, reason: str = "global", run: object = None) -> None:
        """Cut the step ``run`` (the token its :meth:`run_step` was given). A cut that
        arrives before that step has its handle — the worker still building its engine,
        or a remote call served before the step's own — is kept and applied as the step
        starts; one for a step that is over is dropped."""
        if run is not None and run != self._run:
            self._early = (run, reason, time.monotonic())
            return
        self.cut_received_at = time.monotonic()
        if self.control is not None:
            self.control.cut(reason)
        elif run is not None:
            self._early = (run, reason, self.cut_received_at)

    async def run_step(
        self,
        step: int,
        samples: list[Sample],
        policy: CutoffPolicy,
        report: Callable[[int, int, Status, float | None], object] | None = None,
        options: StepOptions = DEFAULT_STEP_OPTIONS,
        run: object = None,
    ) -> WorkerResult:
        """One step over this worker's ``samples``. ``run``: a token unique to this step
        (and launch round) that a global cut names (:meth:`cut`)."""
        self._run = run
        try:
            return await self._run_step(step, samples, policy, report, options, run)
        finally:
            self._run = None
            self.control = None

    async def _run_step(
        self,
        step: int,
        samples: list[Sample],
        policy: CutoffPolicy,
        report: Callable[[int, int, Status, float | None], object] | None,
        options: StepOptions,
        run: object,
    ) -> WorkerResult:
        if self.predictor is None and options.schedule is not None:
            self.predictor = _predictor(options.predictor_states, self.rank)
            self.admission = make_admission(options.schedule, self.predictor)
        if not samples:
            empty = StepResult([], [], 0.0, None, engine_stats=None)
            return WorkerResult(self.rank, empty, None, policy.state_dict(), self._learned())
        if self.engine is None or self.rollout is None:
            await self.start()
        assert self.engine is not None and self.rollout is not None

        def done(sample: Sample) -> None:
            if report is not None:
                report(sample.index, sample.group, sample.status, sample.reward)

        self.cut_received_at = None
        self.control = CutHandle(done)
        early, self._early = self._early, None
        if early is not None and run is not None and early[0] == run:
            self.cut_received_at = early[2]
            self.control.cut(early[1])  # applied as the step starts
        loop = asyncio.get_running_loop()
        with self._tracer(step, loop.time) as tracer:
            result = await run_step(
                self.engine,
                samples,
                self.rollout,
                policy,
                tracer,
                abort_deadline_s=options.abort_deadline_s,
                timeout_s=options.timeout_s,
                control=self.control,
                gc_pause=options.gc_pause,
                max_retries=options.max_retries,
                admission=self.admission,
            )
        return WorkerResult(
            self.rank, result, self.cut_received_at, policy.state_dict(), self._learned()
        )

    def _learned(self) -> dict[str, Any] | None:
        return self.predictor.state_dict() if self.predictor is not None else None

    def _tracer(self, step: int, clock: Callable[[], float]) -> Tracer:
        rounds = self._traced[1] + 1 if self._traced[0] == step else 0
        self._traced = (step, rounds)
        if rounds == 0 or self.run_dir is None:
            return Tracer.for_step(self.run_dir, step, self.rank, clock=clock)
        path = Path(self.run_dir) / f"step_{step}" / f"worker_{self.rank}.round{rounds}.jsonl"
        return Tracer(path, step=step, clock=clock, rank=self.rank)

    async def aclose(self) -> None:
        if self.engine is not None and self.owns_engine:
            await self.engine.aclose()


def _predictor(states: Sequence[Mapping[str, Any] | None], rank: int) -> LengthPredictor:
    """Worker ``rank``'s length predictor: from its saved state if there is one."""
    predictor = LengthPredictor()
    state = states[rank] if rank < len(states) else None
    if state is not None:
        predictor.load_state_dict(state)
    return predictor


def merge(
    plan: WorkerPlan,
    steps: Sequence[WorkerResult | BaseException],
    coordinator: Coordinator | None,
) -> StepResult:
    """One StepResult in global launch order from the workers' results."""
    samples: list[Sample] = []
    kept: list[int] = []
    counts: dict[Status, int] = {}
    times, cuts, idles, settles = [0.0], [], [], []
    done = [ws.result for ws in steps if not isinstance(ws, BaseException)]
    for r, ws in enumerate(steps):
        lo, hi = plan.offsets[r], plan.offsets[r + 1]
        if isinstance(ws, BaseException):
            part = [_lost(i, ws) for i in range(lo, hi)]
        else:
            part = ws.result.samples
            kept += ws.result.kept
            times.append(ws.result.step_time_s)
            if ws.result.cut_time_s is not None:
                cuts.append(ws.result.cut_time_s)
            idles.append(_idle_at(ws))
            if ws.result.cut_to_settled_s is not None:
                settles.append(ws.result.cut_to_settled_s)
        for s in part:
            samples.append(s)
            counts[s.status] = counts.get(s.status, 0) + 1
    for r, ws in enumerate(steps):
        if not isinstance(ws, BaseException):
            plan.policies[r].load_state_dict(ws.policy_state)
    if coordinator is not None:
        kept = coordinator.select(samples)
        cut_time = min(cuts) if cuts else None
        coordinator.policy.end(
            StepFeedback(
                step_time_s=cut_time if cut_time is not None else max(times),
                cut=cut_time is not None,
                usable=len(kept),
                launched=len(samples),
            )
        )
    reasons = [r.cut_reason for r in done if r.cut_reason is not None]
    reason = coordinator.reason if coordinator else (reasons[0] if reasons else None)
    return StepResult(
        samples=samples,
        kept=sorted(kept),
        step_time_s=max(times),
        cut_time_s=min(cuts) if cuts else None,
        cut_reason=reason,
        abort_to_idle_s=_propagation(coordinator, idles, done),
        cut_to_settled_s=max(settles) if settles else None,
        abort_rounds=max((r.abort_rounds for r in done), default=0),
        target_completion=sum(p.target_completion for p in plan.policies)
        if plan.coordinator_policy is None
        else plan.coordinator_policy.target_completion,
        engine_stats=done[0].engine_stats if len(steps) == 1 and done else EngineStats(),
        counts=counts,
        retries=sum(r.retries for r in done),
        recovered=sum(r.recovered for r in done),
        predictor_states=[
            None if isinstance(ws, BaseException) else ws.predictor_state for ws in steps
        ],
    )


def _propagation(
    coordinator: Coordinator | None, idles: Sequence[float | None], done: Sequence[StepResult]
) -> float | None:
    """Global cut: from the coordinator's decision to the last worker's engine idle. Cut by
    each worker itself: the slowest worker's own cut-to-idle time."""
    if coordinator is None:
        idle = [r.abort_to_idle_s for r in done if r.abort_to_idle_s is not None]
        return max(idle) if idle else None
    at = [t for t in idles if t is not None]
    return max(at) - coordinator.decided_at if coordinator.decided_at is not None and at else None


def _idle_at(ws: WorkerResult) -> float | None:
    if ws.cut_received_at is None or ws.result.abort_to_idle_s is None:
        return None
    return ws.cut_received_at + ws.result.abort_to_idle_s


def _lost(index: int, exc: BaseException) -> Sample:
    s = Sample(index=index, status=Status.FAILED, finish_reason=FinishReason.FAILED)
    s.error = f"worker lost: {type(exc).__name__}: {exc}"
    return s


class Workers(ABC):
    """What the trainer drives: one step over all workers, merged."""

    def __init__(
        self, cfg: CutoffConfig, n_workers: int, options: StepOptions = DEFAULT_STEP_OPTIONS
    ) -> None:
        self.cfg = cfg
        self.n_workers = n_workers
        self.options = options
        """How every worker runs its step (abort deadline, step timeout, GC pause)."""
        self.policy_state: dict[str, object] = {}
        self._runs = 0

    def _next_run(self, step: int) -> str:
        """A token for one launch of a step (a step may be launched again: another round
        of ``algo.filter_groups``), which the step's global cuts name."""
        self._runs += 1
        return f"{step}.{self._runs}"

    def plan(self, n_target: int, group_size: int = 1) -> WorkerPlan:
        return plan_step(self.cfg, n_target, group_size, self.n_workers, self.policy_state)

    @abstractmethod
    async def run_step(self, step: int, plan: WorkerPlan, samples: list[Sample]) -> StepResult: ...

    @abstractmethod
    async def aclose(self) -> None: ...

    def _split(self, plan: WorkerPlan, samples: list[Sample]) -> list[list[Sample]]:
        """Each worker's block of (copies of) the samples, which keep their indices."""
        if len(samples) != plan.n_launch:
            raise ValueError(f"plan launches {plan.n_launch} samples, got {len(samples)}")
        return [
            [replace(s) for s in samples[plan.offsets[r] : plan.offsets[r + 1]]]
            for r in range(self.n_workers)
        ]

    def _fail_or_tolerate(self, steps: Sequence[WorkerResult | BaseException]) -> None:
        errors = [(r, e) for r, e in enumerate(steps) if isinstance(e, BaseException)]
        if errors and not self.cfg.tolerate_worker_loss:
            r, exc = errors[0]
            raise StepFailed(f"rollout worker {r} failed: {type(exc).__name__}: {exc}") from exc


class LocalWorkers(Workers):
    """Workers in this process, on this event loop (tests, one machine, no Ray)."""

    def __init__(
        self,
        cfg: CutoffConfig,
        recipe: WorkerRecipe,
        n_workers: int,
        run_dir: Path | None = None,
        *,
        options: StepOptions = DEFAULT_STEP_OPTIONS,
    ) -> None:
        super().__init__(cfg, n_workers, options)
        self.workers = [RolloutWorker(r, recipe, run_dir) for r in range(n_workers)]

    async def run_step(self, step: int, plan: WorkerPlan, samples: list[Sample]) -> StepResult:
        shares = self._split(plan, samples)
        run = self._next_run(step)
        coord = None
        if plan.coordinator_policy is not None:
            coord = Coordinator(
                plan.coordinator_policy, plan.offsets,
                [functools.partial(w.cut, run=run) for w in self.workers],
            )  # fmt: skip
            coord.start()
        report = coord.report if coord else None

        async def one(r: int) -> WorkerResult:
            return await self.workers[r].run_step(
                step, shares[r], plan.policies[r], report, self.options, run
            )

        tasks = [asyncio.create_task(one(r)) for r in range(self.n_workers)]
        watch = asyncio.create_task(coord.watch()) if coord else None
        try:
            steps = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            if watch is not None:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
        for s in steps:  # cancellation, interrupts and exits are not a worker's failure
            if isinstance(s, BaseException) and not isinstance(s, Exception):
                raise s
        self._fail_or_tolerate(steps)
        return merge(plan, steps, coord)

    async def aclose(self) -> None:
        for w in self.workers:
            await w.aclose()
