"""Many workers on one loop (virtual time): per-worker vs global cut, groups, worker loss."""

from __future__ import annotations

import pytest

from tailcut.bench.workloads import Trajectory, TurnSpec, make_samples
from tailcut.config import CutoffConfig, SimEngineConfig
from tailcut.engine.sim import SimFaults
from tailcut.rollout.recipes import SimRecipe
from tailcut.rollout.scheduler import StepFailed
from tailcut.rollout.workers import LocalWorkers, split_offsets
from tailcut.types import Status
from tailcut.vtime import run_virtual

ENGINE = SimEngineConfig(decode_a_s=0.01, decode_c_s=0.0, prefill_s_per_token=0.0)


def _skewed(n: int, workers: int, hard_worker: int, group_size: int = 1) -> list:
    """Worker ``hard_worker`` gets prompts 5× longer than the others'."""
    per = n // workers
    trajs = []
    for i in range(n):
        hard = i // per == hard_worker
        tokens = (50 + 10 * (i % 7)) * (5 if hard else 1)
        trajs.append(Trajectory((TurnSpec(tokens),), group=i // group_size, prompt_tokens=4))
    return make_samples(trajs)


def _run(cfg: CutoffConfig, workers: int, samples_fn, n_target: int, group_size=1, recipe=None):
    async def main():
        pool = LocalWorkers(cfg, recipe or SimRecipe(ENGINE), workers)
        plan = pool.plan(n_target, group_size)
        try:
            return plan, await pool.run_step(0, plan, samples_fn(plan.n_launch))
        finally:
            await pool.aclose()

    return run_virtual(main())


def test_split_offsets_keeps_groups_whole():
    assert split_offsets(12, 3, 2) == [0, 4, 8, 12]
    assert split_offsets(10, 3, 2) == [0, 4, 8, 10]
    with pytest.raises(ValueError, match="whole groups"):
        split_offsets(7, 2, 2)


def test_global_scope_cuts_all_workers_at_the_global_target():
    cfg = CutoffConfig(policy="target-count", abort_ratio=0.25, scope="global")
    plan, res = _run(cfg, 4, lambda n: _skewed(n, 4, hard_worker=3), 32)
    assert plan.n_launch == 32 and res.cut_reason == "target"
    assert len(res.kept) == 24 and res.completed >= 24
    # The hard worker's samples are the slow ones: they are the ones aborted.
    aborted = {s.index for s in res.samples if s.status is Status.ABORTED}
    assert aborted and aborted <= set(range(24, 32))
    assert [s.index for s in res.samples] == list(range(32))


def test_worker_scope_waits_for_the_hard_worker():
    g = CutoffConfig(policy="target-count", abort_ratio=0.25, scope="global")
    w = CutoffConfig(policy="target-count", abort_ratio=0.25, scope="worker")
    _, rg = _run(g, 4, lambda n: _skewed(n, 4, hard_worker=3), 32)
    _, rw = _run(w, 4, lambda n: _skewed(n, 4, hard_worker=3), 32)
    assert len(rw.kept) == len(rg.kept) == 24
    # Per-worker targets make the hard worker finish 6 of its own slow samples.
    assert rw.step_time_s > 2 * rg.step_time_s


def test_group_quota_across_workers_keeps_whole_groups():
    cfg = CutoffConfig(policy="group-quota", over_provision=0.5, scope="global")
    plan, res = _run(cfg, 2, lambda n: _skewed(n, 2, hard_worker=1, group_size=4), 16, 4)
    assert plan.n_launch == 24
    kept_groups = {res.samples[i].group for i in res.kept}
    assert len(kept_groups) == 4 and len(res.kept) == 16
    for g in kept_groups:
        members = [s for s in res.samples if s.group == g]
        assert all(s.status is Status.COMPLETED for s in members)


def test_dead_worker_fails_the_step_or_is_tolerated():
    recipe = SimRecipe(ENGINE, faults={1: SimFaults(die_at_s=0.2)})
    samples = lambda n: _skewed(n, 2, hard_worker=0)  # noqa: E731
    strict = CutoffConfig(policy="wait-all", scope="global")
    with pytest.raises(StepFailed, match="worker 1 failed"):
        _run(strict, 2, samples, 8, recipe=recipe)
    tolerant = CutoffConfig(policy="wait-all", scope="global", tolerate_worker_loss=True)
    _, res = _run(tolerant, 2, samples, 8, recipe=recipe)
    lost = res.samples[4:]
    assert all(s.status is Status.FAILED and "worker lost" in (s.error or "") for s in lost)
    assert all(s.status is Status.COMPLETED for s in res.samples[:4])
    assert res.kept == [0, 1, 2, 3]
