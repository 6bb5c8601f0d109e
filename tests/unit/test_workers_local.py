"""Many workers on one loop (virtual time): per-worker vs global cut, groups, worker loss."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tailcut.bench.workloads import Trajectory, TurnSpec, make_samples
from tailcut.config import CutoffConfig, SimEngineConfig
from tailcut.engine.sim import SimEngine, SimFaults
from tailcut.rollout.cutoff import TargetCount, WaitAll
from tailcut.rollout.recipes import SimRecipe
from tailcut.rollout.step import StepFailed, StepOptions
from tailcut.rollout.workers import (
    LocalWorkers,
    RolloutWorker,
    SharedRecipe,
    plan_for_policy,
    split_at_groups,
    split_offsets,
)
from tailcut.trace.events import EventKind, read_trace
from tailcut.trace.load import load_run
from tailcut.trace.replay import plan_replay
from tailcut.types import FINISHED, FinishReason, Sample, Status
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


# -- one caller-owned policy over many workers (the trainer's plan) -------------------------


def test_split_at_groups_cuts_only_between_groups():
    assert split_at_groups([0, 0, 1, 1, 2, 2, 3, 3], 2) == [0, 4, 8]
    assert split_at_groups([0, 0, 1, 1, 2, 2, 3, 3], 3) == [0, 2, 6, 8]  # nearest to n·r/W
    # Resumed stragglers first (groups 7, 5), then whole fresh groups.
    assert split_at_groups([7, 5, 9, 9, 9, 9, 10, 10, 10, 10], 2) == [0, 6, 10]
    assert split_at_groups([4, 4, 4], 1) == [0, 3]
    with pytest.raises(ValueError, match="2 runs of groups cannot be spread over 3 workers"):
        split_at_groups([0, 0, 1, 1], 3)


def test_plan_for_policy_runs_one_policy_over_the_step():
    policy = TargetCount(8, 2, abort_ratio=0.25)
    one = plan_for_policy(policy, [i // 2 for i in range(8)], 1)
    assert one.policies == [policy] and one.coordinator_policy is None and one.offsets == [0, 8]
    many = plan_for_policy(policy, [i // 2 for i in range(8)], 2)
    assert many.coordinator_policy is policy and many.offsets == [0, 4, 8]
    assert all(isinstance(p, WaitAll) and p.n_launch == 4 for p in many.policies)
    with pytest.raises(ValueError, match="launches 8 samples, got 6"):
        plan_for_policy(policy, [0] * 6, 2)


class _Recorder:
    """A rollout fn that records the index, group and seed of every sample it runs."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int | None]] = []

    async def __call__(self, sample, engine, tracer):
        self.seen.append((sample.index, sample.group, sample.seed))
        sample.finish_reason = FinishReason.STOP


def test_workers_keep_the_global_indices_and_seeds_the_caller_gave():
    recorder = _Recorder()

    async def main():
        engine = SimEngine(ENGINE)
        pool = LocalWorkers(CutoffConfig(policy="wait-all"), SharedRecipe(engine, recorder), 3)
        samples = [Sample(index=i, group=i // 2, seed=100 + i) for i in range(12)]
        plan = plan_for_policy(WaitAll(12, 2), [s.group for s in samples], 3)
        try:
            return plan, await pool.run_step(5, plan, samples)
        finally:
            await pool.aclose()
            assert await engine.in_flight() == []  # closing the workers left it usable

    plan, res = run_virtual(main())
    assert plan.offsets == [0, 4, 8, 12]
    assert sorted(recorder.seen) == [(i, i // 2, 100 + i) for i in range(12)]
    assert res.kept == list(range(12)) and [s.index for s in res.samples] == list(range(12))


def test_single_worker_merge_keeps_the_cut_reason_and_stats():
    cfg = CutoffConfig(policy="target-count", abort_ratio=0.25)
    policy = TargetCount(8, 1, abort_ratio=0.25)

    async def main():
        pool = LocalWorkers(cfg, SimRecipe(ENGINE), 1)
        plan = plan_for_policy(policy, list(range(8)), 1)
        try:
            return await pool.run_step(0, plan, _skewed(8, 2, hard_worker=1))
        finally:
            await pool.aclose()

    res = run_virtual(main())
    assert res.cut_reason == "target" and res.aborted >= 1 and len(res.kept) == 6
    assert res.abort_to_idle_s is not None and res.engine_stats is not None
    assert res.engine_stats.aborted >= 1


def test_a_samples_seed_follows_its_index_in_the_whole_step():
    from tailcut.rollout.seeds import TRAIN_STREAM, mix, seed_samples

    step = [Sample(index=i) for i in range(12)]
    seed_samples(step, 3, TRAIN_STREAM, 4)
    # However the step is split over workers, sample 9 is seeded as sample 9 of the step.
    assert step[9].seed == mix(3, 0, 4, 9)
    assert len({s.seed for s in step}) == 12


class _Interrupt(BaseException):
    """Like KeyboardInterrupt, without asyncio's special handling of that one."""


def test_an_interrupt_in_a_worker_is_not_a_worker_failure():
    class Interrupting:
        async def __call__(self, sample, engine, tracer):
            raise _Interrupt

    async def main():
        cfg = CutoffConfig(policy="wait-all", tolerate_worker_loss=True)
        pool = LocalWorkers(cfg, SharedRecipe(SimEngine(ENGINE), Interrupting()), 2)
        samples = [Sample(index=i, group=i) for i in range(4)]
        return await pool.run_step(0, plan_for_policy(WaitAll(4), [0, 1, 2, 3], 2), samples)

    # Not turned into a tolerated worker loss (the step's TaskGroup groups it).
    with pytest.raises(BaseExceptionGroup) as err:
        run_virtual(main())
    assert err.group_contains(_Interrupt)


@pytest.mark.parametrize("gc_pause", [True, False])
def test_the_step_options_reach_every_worker_step(gc_pause: bool):
    """``options`` (here ``gc_pause``) is what each worker's ``run_step`` runs with: the
    collector is paused inside every rollout exactly when asked, and back on afterwards."""
    import gc

    seen: list[bool] = []

    class Watching:
        async def __call__(self, sample, engine, tracer):
            seen.append(gc.isenabled())
            sample.finish_reason = FinishReason.STOP

    async def main():
        pool = LocalWorkers(
            CutoffConfig(policy="wait-all"),
            SharedRecipe(SimEngine(ENGINE), Watching()),
            2,
            options=StepOptions(abort_deadline_s=1.0, gc_pause=gc_pause),
        )
        samples = [Sample(index=i, group=i) for i in range(4)]
        try:
            return await pool.run_step(0, plan_for_policy(WaitAll(4), [0, 1, 2, 3], 2), samples)
        finally:
            await pool.aclose()

    assert gc.isenabled()
    res = run_virtual(main())
    assert res.completed == 4 and seen == [not gc_pause] * 4
    assert gc.isenabled()


class _LateBuild(SimRecipe):
    """Worker 1 builds its engine slowly (a remote engine it connects to, a model it
    loads): the global cut comes while it is still building."""

    async def build(self, rank: int):  # type: ignore[no-untyped-def]
        if rank == 1:
            await asyncio.sleep(0.3)
        return await super().build(rank)


def test_a_global_cut_that_comes_before_a_worker_has_started_its_step_still_cuts_it():
    cfg = CutoffConfig(policy="target-count", abort_ratio=0.5, scope="global")
    short_then_long = lambda n: make_samples(  # noqa: E731
        [
            Trajectory((TurnSpec(20 if i < n // 2 else 500),), group=i, prompt_tokens=4)
            for i in range(n)
        ]
    )
    plan, res = _run(cfg, 2, short_then_long, 8, recipe=_LateBuild(ENGINE))
    assert res.cut_reason == "target" and len(res.kept) == plan.n_launch // 2 == 4
    # worker 0's short samples met the target at 0.2 s, while worker 1 was building: its
    # long ones (5 s each) are aborted as its step starts, not run to the end
    late = res.samples[plan.offsets[1] :]
    assert {s.status for s in late} == {Status.ABORTED}
    assert res.step_time_s < 0.5


def test_a_cut_for_an_earlier_launch_does_not_cut_the_next():
    """A late cut message (a launch that is over) names its own launch: the worker's next
    step is not cut by it."""

    async def main():
        worker = RolloutWorker(0, SimRecipe(ENGINE))
        samples = make_samples(
            [Trajectory((TurnSpec(30),), group=i, prompt_tokens=4) for i in range(2)]
        )
        try:
            await worker.run_step(0, samples, WaitAll(2), run="0.1")
            worker.cut("global", run="0.1")  # arrives after that step ended
            again = make_samples(
                [Trajectory((TurnSpec(30),), group=i, prompt_tokens=4) for i in range(2)]
            )
            return await worker.run_step(0, again, WaitAll(2), run="0.2")
        finally:
            await worker.aclose()

    second = run_virtual(main())
    assert second.result.cut_reason is None and second.result.completed == 2


# -- the trace of a step cut over all workers ----------------------------------------------


def _global_group_quota(run_dir: Path, launches: int = 1) -> list:
    """Step 0 under group-quota, cut over 2 workers (the hard one slow), traced to ``run_dir``;
    ``launches`` > 1 launches step 0 again (another launch round, its own round file)."""
    cfg = CutoffConfig(policy="group-quota", over_provision=0.5, scope="global")

    async def main():
        pool = LocalWorkers(cfg, SimRecipe(ENGINE), 2, run_dir)
        runs = []
        try:
            for _ in range(launches):
                plan = pool.plan(16, 4)
                samples = _skewed(plan.n_launch, 2, hard_worker=1, group_size=4)
                runs.append((plan, await pool.run_step(0, plan, samples)))
        finally:
            await pool.aclose()
        return runs

    return run_virtual(main())


def _monitoring(path: Path) -> dict:
    (extra,) = [r["extra"] for r in read_trace(path) if r["event"] == EventKind.STEP_MONITORING]
    return extra


def test_a_global_cut_records_the_coordinators_target_in_every_workers_trace(tmp_path):
    ((plan, res),) = _global_group_quota(tmp_path)
    target = plan.coordinator_policy.target_completion
    assert res.cut_reason == "target" and (target, plan.n_launch) == (16, 24)
    for r in range(2):
        share = plan.offsets[r + 1] - plan.offsets[r]
        mon = _monitoring(tmp_path / "step_0" / f"worker_{r}.jsonl")
        assert (mon["global_target"], mon["global_launched"]) == (target, plan.n_launch)
        assert mon["target_completion"] == mon["total_requests"] == share  # its own share
    # the replay takes the recorded target, not what finished (more than it: group-quota
    # keeps whole groups only, and results that raced the cut finish too)
    (step,) = load_run(tmp_path)
    finished = sum(r.status in FINISHED for r in step.requests)
    assert step.cut_time is not None and finished > target
    (replayed,) = plan_replay([step]).steps
    assert replayed.cut and replayed.target == target


def test_a_global_trace_from_before_the_recorded_target_is_replayed_at_what_it_kept(tmp_path):
    _global_group_quota(tmp_path)
    for path in (tmp_path / "step_0").glob("*.jsonl"):  # as written before the fields
        lines = []
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            rec["extra"].pop("global_target", None)
            rec["extra"].pop("global_launched", None)
            lines.append(json.dumps(rec))
        path.write_text("\n".join(lines) + "\n")
    (step,) = load_run(tmp_path)
    (replayed,) = plan_replay([step]).steps
    assert replayed.target == sum(r.status in FINISHED for r in step.requests) > 16


def test_each_launch_round_of_a_global_step_records_its_own_target(tmp_path):
    runs = _global_group_quota(tmp_path, launches=2)
    for name in (
        "worker_0.jsonl",
        "worker_1.jsonl",
        "worker_0.round1.jsonl",
        "worker_1.round1.jsonl",
    ):
        assert _monitoring(tmp_path / "step_0" / name)["global_target"] == 16
    (step,) = load_run(tmp_path)
    assert step.rounds == 2 and len(step.requests) == sum(p.n_launch for p, _ in runs) == 48
    assert plan_replay([step]).steps[0].target == 32  # 16 a round
