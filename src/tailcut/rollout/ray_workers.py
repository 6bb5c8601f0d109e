"""Rollout workers as Ray actors, driven like :class:`tailcut.rollout.workers.LocalWorkers`.

Each worker is an async Ray actor holding a :class:`RolloutWorker` (its engine client,
rollout fn and trace file). With ``scope=global`` a coordinator actor receives every
completion (fire-and-forget actor calls) and tells all workers to cut at once; the cut
runs concurrently with the worker's step inside the actor's event loop.

A worker that dies mid-step fails the step with its rank and Ray's error, or, with
``cutoff.tolerate_worker_loss``, its samples become FAILED records and the step goes on.
``aclose`` kills every actor this object started.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from pathlib import Path
from typing import Any

import ray

from tailcut.config import CutoffConfig
from tailcut.rollout.cutoff import CutoffPolicy
from tailcut.rollout.step import DEFAULT_STEP_OPTIONS, StepOptions, StepResult
from tailcut.rollout.workers import (
    Coordinator,
    RolloutWorker,
    WorkerPlan,
    WorkerRecipe,
    WorkerResult,
    Workers,
    merge,
)
from tailcut.types import Sample, Status


class _WorkerActor:
    def __init__(self, rank: int, recipe: WorkerRecipe, run_dir: str | None) -> None:
        self.worker = RolloutWorker(rank, recipe, Path(run_dir) if run_dir else None)

    async def start(self) -> int:
        await self.worker.start()
        return self.worker.rank

    async def run_step(
        self,
        step: int,
        samples: list[Sample],
        policy: CutoffPolicy,
        coordinator: Any | None,
        options: StepOptions,
        run: str | None = None,
    ) -> WorkerResult:
        report = None
        sent: list[Any] = []
        if coordinator is not None:

            def report(index: int, group: int, status: Status, reward: float | None) -> None:
                sent.append(coordinator.report.remote(index, group, status, reward))

        result = await self.worker.run_step(step, samples, policy, report, options, run)
        # Every report has reached the coordinator before the step returns: the driver asks
        # it which samples to keep once all steps have returned, on a call Ray does not
        # order after these (another caller's).
        await asyncio.gather(*sent)
        return result

    async def cut(self, reason: str, run: str | None = None) -> None:
        self.worker.cut(reason, run)

    async def aclose(self) -> None:
        await self.worker.aclose()


class _CoordinatorActor:
    def __init__(
        self, policy: CutoffPolicy, offsets: list[int], workers: list[Any], run: str
    ) -> None:
        self.coord = Coordinator(policy, offsets, [self._cut_fn(w, run) for w in workers])
        self.done = asyncio.Event()

    @staticmethod
    def _cut_fn(handle: Any, run: str) -> Any:
        return lambda reason: handle.cut.remote(reason, run)

    async def start(self) -> None:
        self.coord.start()

    async def report(
        self, index: int, group: int, status: Status, reward: float | None = None
    ) -> None:
        self.coord.report(index, group, status, reward)

    async def worker_lost(self, rank: int) -> None:
        self.coord.worker_lost(rank)

    async def watch(self) -> None:
        await self.coord.watch()

    async def summary(self) -> tuple[float | None, str | None, CutoffPolicy]:
        return self.coord.decided_at, self.coord.reason, self.coord.policy


class RayWorkers(Workers):
    """One async Ray actor per worker; an optional coordinator actor per global step."""

    def __init__(
        self,
        cfg: CutoffConfig,
        recipe: WorkerRecipe,
        n_workers: int,
        run_dir: Path | None = None,
        *,
        options: StepOptions = DEFAULT_STEP_OPTIONS,
        num_cpus_per_worker: float = 0.5,
    ) -> None:
        super().__init__(cfg, n_workers, options)
        if not ray.is_initialized():
            raise RuntimeError(
                "RayWorkers needs ray.init() first (see tailcut.rollout.ray_workers)"
            )
        self.namespace = f"tailcut-{uuid.uuid4().hex[:8]}"
        actor = ray.remote(num_cpus=num_cpus_per_worker, max_restarts=0)(_WorkerActor)
        self.actors: list[Any] = [
            actor.options(name=f"{self.namespace}-worker-{r}").remote(
                r, recipe, str(run_dir) if run_dir else None
            )
            for r in range(n_workers)
        ]
        self._coordinators: list[Any] = []

    async def start(self) -> None:
        await asyncio.gather(*(a.start.remote() for a in self.actors))

    async def run_step(self, step: int, plan: WorkerPlan, samples: list[Sample]) -> StepResult:
        shares = self._split(plan, samples)
        run = self._next_run(step)
        coord: Any = None
        if plan.coordinator_policy is not None:
            coord_cls = ray.remote(num_cpus=0)(_CoordinatorActor)
            coord = coord_cls.options(name=f"{self.namespace}-coord-{run}").remote(
                plan.coordinator_policy, plan.offsets, self.actors, run
            )
            self._coordinators.append(coord)
            await coord.start.remote()
        refs = [
            a.run_step.remote(step, shares[r], plan.policies[r], coord, self.options, run)
            for r, a in enumerate(self.actors)
        ]
        if coord is not None:
            coord.watch.remote()

        async def one(r: int, ref: Any) -> WorkerResult | BaseException:
            try:
                step_result: WorkerResult = await ref
                return step_result
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                if coord is not None:  # its samples count as failed for the global target
                    await coord.worker_lost.remote(r)
                return exc

        steps = list(await asyncio.gather(*(one(r, ref) for r, ref in enumerate(refs))))
        local_coord = None
        if coord is not None:
            decided, reason, policy = await coord.summary.remote()
            local_coord = Coordinator(policy, plan.offsets, [])
            local_coord.decided_at, local_coord.reason = decided, reason
            plan.coordinator_policy = policy
            ray.kill(coord)
            self._coordinators.remove(coord)
        self._fail_or_tolerate(steps)
        result = merge(plan, steps, local_coord)
        if local_coord is not None:
            self.policy_state["global"] = local_coord.policy
        return result

    async def aclose(self) -> None:
        for a in self.actors:
            with contextlib.suppress(ray.exceptions.RayActorError):
                await a.aclose.remote()
            ray.kill(a)
        for c in self._coordinators:
            ray.kill(c)
        self.actors = []
        self._coordinators = []


def init_local_ray(num_cpus: int = 4, object_store_mb: int = 100, **kwargs: Any) -> None:
    """Start a small local Ray instance (tests, one machine)."""
    if ray.is_initialized():
        return
    ray.init(
        num_cpus=num_cpus,
        object_store_memory=object_store_mb * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=False,
        **kwargs,
    )
