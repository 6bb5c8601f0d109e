"""Data-parallel rollout over the ranks of a training job, with one global cut.

Every rank runs one :class:`~tailcut.rollout.workers.RolloutWorker` on its own engine (the
embedded engine colocated on its GPU, or its share of remote servers) over its block of whole
GRPO groups; the trainer on every rank plans the same step, so the blocks agree. The cut is
global, decided on rank 0 by the trainer's one policy in a
:class:`~tailcut.rollout.workers.Coordinator`:

* each completion on rank r > 0 is pushed to a queue of the process group's store
  (``queue_push``; rank 0's own go straight to the coordinator), which rank 0 drains every
  few milliseconds into ``Coordinator.report``;
* when the policy cuts (a count reached, a deadline), rank 0 sets the step's cut key; every
  rank polls it and cuts its own worker, whose scheduler aborts and verifies its own engine;
* once a rank's step has ended, its result goes to rank 0, which merges them in launch
  order (the coordinator keeps what the policy keeps) and broadcasts the merged step, and
  the policy's learned state, so the trainer state stays the same on every rank;
* a rank whose rollout raised sends its error in place of a result: the step fails on every
  rank alike, or, under ``cutoff.tolerate_worker_loss``, that rank's samples become FAILED
  records and the step goes on.

Keys are named per call (a round counter every rank advances in step), so nothing of an
earlier step is read again.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from tailcut.config import CutoffConfig
from tailcut.rollout.step import DEFAULT_STEP_OPTIONS, StepFailed, StepOptions, StepResult
from tailcut.rollout.workers import (
    Coordinator,
    RolloutWorker,
    WorkerPlan,
    WorkerRecipe,
    WorkerResult,
    Workers,
    merge,
)
from tailcut.train.distributed import RankError, Ranks
from tailcut.types import Sample, Status

POLL_S = 0.005
"""How often the store is read for completions (rank 0) and for the cut (every rank)."""


class RankWorkers(Workers):
    """One rollout worker per rank; :meth:`run_step` returns the merged step on every rank."""

    def __init__(
        self,
        cfg: CutoffConfig,
        recipe: WorkerRecipe,
        ranks: Ranks,
        run_dir: Path | None = None,
        *,
        options: StepOptions = DEFAULT_STEP_OPTIONS,
    ) -> None:
        super().__init__(cfg, ranks.world, options)
        self.ranks = ranks
        self.worker = RolloutWorker(ranks.rank, recipe, run_dir)
        self.round = 0

    async def run_step(self, step: int, plan: WorkerPlan, samples: list[Sample]) -> StepResult:
        self.round += 1
        keys = _Keys(f"tailcut/rollout/{self.round}")
        store = self.ranks.store()
        mine = self._split(plan, samples)[self.ranks.rank]
        coord = None
        if plan.coordinator_policy is not None and self.ranks.is_main:
            coord = Coordinator(
                plan.coordinator_policy, plan.offsets,
                [lambda reason: store.set(keys.cut, reason)] + [lambda reason: None] * (self.ranks.world - 1),
            )  # fmt: skip
            coord.start()
        report = coord.report if coord is not None else _pusher(store, keys.events)
        policy = plan.policies[self.ranks.rank]
        background = [asyncio.create_task(self._watch_cut(store, keys.cut, self.round))]
        drained = asyncio.Event()
        if coord is not None:
            drain = asyncio.create_task(_drain(store, keys.events, coord, drained))
            background += [asyncio.create_task(coord.watch()), drain]
        try:
            local: WorkerResult | RankError
            try:
                local = await self.worker.run_step(
                    step, mine, policy, report, self.options, run=self.round
                )
            except Exception as exc:  # every rank still reaches the gather below
                local = RankError(f"rank {self.ranks.rank}: {type(exc).__name__}: {exc}")
            gathered = await asyncio.to_thread(self.ranks.gather, local)
            if coord is not None:  # every rank pushed all it had: one last read, by the drainer
                drained.set()
                await drain
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
        merged: tuple[StepResult, dict[str, object]] | StepFailed | None = None
        if self.ranks.is_main:
            assert gathered is not None
            steps = _in_rank_order(gathered)
            try:
                self._fail_or_tolerate(steps)
                merged = (merge(plan, steps, coord), _policy_state(plan))
            except StepFailed as exc:  # every rank raises it, none waits for the others
                merged = StepFailed(str(exc))
        got = await asyncio.to_thread(self.ranks.broadcast, merged)
        if isinstance(got, StepFailed):
            raise got
        result, state = got
        if plan.coordinator_policy is not None:
            plan.coordinator_policy.load_state_dict(state)
        with contextlib.suppress(Exception):
            store.delete_key(keys.cut)
        return result

    async def _watch_cut(self, store: Any, key: str, run: int) -> None:
        """Cut this rank's worker once rank 0 has set the step's cut key."""
        while True:
            if await asyncio.to_thread(store.check, [key]):
                reason = (await asyncio.to_thread(store.get, key)).decode()
                self.worker.cut(reason, run)
                return
            await asyncio.sleep(POLL_S)

    async def aclose(self) -> None:
        await self.worker.aclose()


class _Keys:
    def __init__(self, prefix: str) -> None:
        self.cut = f"{prefix}/cut"
        self.events = f"{prefix}/events"


def _pusher(store: Any, key: str) -> Any:
    def push(index: int, group: int, status: Status, reward: float | None) -> None:
        value = "" if reward is None else repr(float(reward))  # repr: the float, exactly
        store.queue_push(key, f"{index},{group},{status.value},{value}")

    return push


async def _drain_once(store: Any, key: str, coord: Coordinator) -> None:
    n = await asyncio.to_thread(store.queue_len, key)
    for _ in range(n):
        raw = await asyncio.to_thread(store.queue_pop, key, False)
        index, group, status, reward = raw.decode().split(",")
        coord.report(int(index), int(group), Status(status), float(reward) if reward else None)


async def _drain(store: Any, key: str, coord: Coordinator, last: asyncio.Event) -> None:
    """Read the queue into the coordinator until ``last`` is set, then once more. The only
    reader of the queue: two would both count the same items and one pop an empty queue
    (and a pop cut off by a cancel loses its item)."""
    while True:
        final = last.is_set()
        await _drain_once(store, key, coord)
        if final:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(last.wait(), POLL_S)


def _in_rank_order(gathered: list[Any]) -> list[WorkerResult | BaseException]:
    out: list[WorkerResult | BaseException] = []
    for r, item in enumerate(gathered):
        if isinstance(item, RankError) or (isinstance(item, WorkerResult) and item.rank == r):
            out.append(item)
        else:
            out.append(RankError(f"rank {r} sent no rollout result"))
    return out


def _policy_state(plan: WorkerPlan) -> dict[str, object]:
    policy = plan.coordinator_policy or plan.policies[0]
    return policy.state_dict()
