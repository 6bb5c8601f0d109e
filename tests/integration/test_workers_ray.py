"""Rollout workers as Ray actors on a local Ray instance (real time, small sim steps)."""

from __future__ import annotations

import asyncio
import os

import pytest

ray = pytest.importorskip("ray")

from tailcut.bench.workloads import Trajectory, TurnSpec, make_samples  # noqa: E402
from tailcut.config import CutoffConfig, SimEngineConfig  # noqa: E402
from tailcut.engine.sim_faults import Select, SimFaults  # noqa: E402
from tailcut.rollout.recipes import SimRecipe  # noqa: E402
from tailcut.rollout.step import StepFailed  # noqa: E402
from tailcut.types import Status  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

# 2 ms per decode step: a 150-token request takes 0.3 s of real time.
ENGINE = SimEngineConfig(decode_a_s=0.002, decode_c_s=0.0, prefill_s_per_token=0.0)
# A worker whose requests never finish: only the cut (or its death) ends its step, however
# long the cut takes to reach it on a loaded machine (a test that lost it would time out).
HANGS = SimFaults(hang=Select(every=True))


@pytest.fixture(scope="module")
def ray_cluster():
    from tailcut.rollout.ray_workers import init_local_ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    init_local_ray(num_cpus=4, object_store_mb=80)
    yield
    ray.shutdown()


def _samples(n: int, workers: int, hard_worker: int):
    per = n // workers
    trajs = [
        Trajectory((TurnSpec((40 + 5 * (i % 5)) * (6 if i // per == hard_worker else 1)),), i, 4)
        for i in range(n)
    ]
    return make_samples(trajs)


async def _step(pool, n_target, hard_worker=3, group_size=1):
    plan = pool.plan(n_target, group_size)
    return await pool.run_step(0, plan, _samples(plan.n_launch, pool.n_workers, hard_worker))


def test_global_cut_reaches_every_ray_worker(ray_cluster, tmp_path):
    from tailcut.rollout.ray_workers import RayWorkers

    async def main():
        cfg = CutoffConfig(policy="target-count", abort_ratio=0.25, scope="global")
        pool = RayWorkers(cfg, SimRecipe(ENGINE, faults={3: HANGS}), 4, tmp_path)
        try:
            await pool.start()
            return await _step(pool, 32), pool.namespace
        finally:
            await pool.aclose()

    res, namespace = asyncio.run(main())
    assert res.cut_reason == "target" and len(res.kept) == 24
    aborted = {s.index for s in res.samples if s.status is Status.ABORTED}
    assert aborted == set(range(24, 32))  # worker 3's, stopped by the cut alone
    assert res.abort_to_idle_s is not None and res.abort_to_idle_s < 5.0
    for r in range(4):
        assert (tmp_path / "step_0" / f"worker_{r}.jsonl").stat().st_size > 0
    alive = [a for a in ray.util.list_named_actors() if a.startswith(namespace)]
    assert alive == []


def test_dead_ray_worker_fails_or_is_tolerated(ray_cluster):
    from tailcut.rollout.ray_workers import RayWorkers

    async def main(tolerate: bool):
        cfg = CutoffConfig(policy="wait-all", scope="global", tolerate_worker_loss=tolerate)
        pool = RayWorkers(cfg, SimRecipe(ENGINE, faults={1: HANGS}), 2)  # ends when killed
        try:
            await pool.start()
            step = asyncio.create_task(_step(pool, 8, hard_worker=1))
            await asyncio.sleep(0.3)
            ray.kill(pool.actors[1])
            return await step
        finally:
            await pool.aclose()

    with pytest.raises(StepFailed, match="rollout worker 1 failed"):
        asyncio.run(main(False))
    res = asyncio.run(main(True))
    assert all(s.status is Status.FAILED for s in res.samples[4:])
    assert all(s.status is Status.COMPLETED for s in res.samples[:4])
