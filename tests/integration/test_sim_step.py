"""Rollout steps on the simulated engine: scripted multi-turn trajectories, cuts, faults."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tailcut.bench.workloads import Trajectory, TurnSpec, get_workload, make_samples
from tailcut.config import SimEngineConfig
from tailcut.engine.sim import Select, SimEngine, SimFaults
from tailcut.rollout.cutoff import CutoffPolicy, TargetCount, WaitAll
from tailcut.rollout.scheduler import run_step
from tailcut.rollout.scripted import ScriptedRollout
from tailcut.rollout.step import StepFailed, StepResult
from tailcut.trace.events import TERMINAL_EVENTS, Tracer, read_trace
from tailcut.types import FinishReason, Status
from tailcut.vtime import run_virtual

CFG = SimEngineConfig(decode_a_s=0.01, decode_c_s=0.0, prefill_s_per_token=0.0)


def traj(*turns: tuple[int, float], group: int = 0) -> Trajectory:
    return Trajectory(tuple(TurnSpec(n, s, 4 if s else 0) for n, s in turns), group, 8)


def step(
    engine: SimEngine,
    trajs: list[Trajectory],
    policy: CutoffPolicy,
    run_dir: Path | None = None,
    **kw,
) -> StepResult:
    async def main() -> StepResult:
        loop = asyncio.get_running_loop()
        tracer = Tracer.for_step(run_dir, 0, 0, clock=loop.time)
        try:
            return await run_step(
                engine, make_samples(trajs), ScriptedRollout(), policy, tracer, **kw
            )
        finally:
            tracer.close()

    return run_virtual(main())


def test_target_count_cut_aborts_stragglers_and_the_engine_agrees(tmp_path):
    trajs = [traj((10 * (i + 1), 0.05), (10, 0.0)) for i in range(10)]
    engine = SimEngine(CFG)
    res = step(engine, trajs, TargetCount(10, abort_ratio=0.3), tmp_path)
    assert res.completed == 7 and res.aborted == 3 and res.failed == 0
    assert res.kept == list(range(7))
    # the 7th trajectory: 70 tokens, a 50 ms tool, 10 tokens (prefill is free)
    assert res.cut_time_s == pytest.approx(0.7 + 0.05 + 0.1)
    # The engine counts the partial turns it aborted; the step, whole cut-off trajectories.
    aborted_turns = [
        t for s in res.samples for t in s.turns if t.finish_reason is FinishReason.ABORT
    ]
    assert engine.wasted_tokens == sum(t.output_tokens for t in aborted_turns) > 0
    assert res.wasted_tokens == sum(
        s.generated_tokens for s in res.samples if s.status is Status.ABORTED
    )
    assert res.wasted_tokens > engine.wasted_tokens
    assert engine.tokens_after_abort == 0
    assert asyncio.run(engine.in_flight()) == []
    events = read_trace(tmp_path / "step_0" / "worker_0.jsonl")
    terminal = sorted(e["extra"]["request_id"] for e in events if e["event"] in TERMINAL_EVENTS)
    assert terminal == sorted(s.workid for s in res.samples)


def test_wait_all_equals_the_uncut_simulation():
    from tailcut.bench.oracle import simulate

    trajs = get_workload("seed-gsm8k").trajectories(0, 48, 8)
    res = step(SimEngine(SimEngineConfig()), trajs, WaitAll(48))
    uncut = simulate(trajs, SimEngineConfig())
    assert res.completed == 48
    assert [s.duration_s for s in res.samples] == pytest.approx(uncut.end_s, abs=1e-9)
    assert [len(s.turns) for s in res.samples] == [len(t.turns) for t in trajs]


def test_a_hung_request_is_cut_and_recorded_as_aborted():
    trajs = [traj((20, 0.0)) for _ in range(10)]
    engine = SimEngine(CFG, SimFaults(hang=Select(ordinals={3})))
    res = step(engine, trajs, TargetCount(10, abort_ratio=0.1))
    assert res.completed == 9 and res.aborted == 1
    hung = next(s for s in res.samples if s.status is Status.ABORTED)
    assert hung.generated_tokens == 20
    assert engine.aborted == 1 and engine.tokens_after_abort == 0


def test_an_abort_lost_once_is_retried_and_the_step_succeeds():
    trajs = [traj((10 * (i + 1), 0.0)) for i in range(4)]
    engine = SimEngine(CFG, SimFaults(lose_aborts=Select(every=True), lose_abort_attempts=1))
    res = step(engine, trajs, TargetCount(4, abort_ratio=0.5), abort_deadline_s=2.0)
    assert res.completed == 2 and res.aborted == 2
    assert res.abort_rounds >= 2
    assert asyncio.run(engine.in_flight()) == []


def test_an_abort_that_is_always_lost_fails_the_step_naming_the_request():
    trajs = [traj((10, 0.0)), traj((5000, 0.0))]
    engine = SimEngine(CFG, SimFaults(lose_aborts=Select(ordinals={1})))

    async def main():
        samples = make_samples(trajs)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(StepFailed) as info:
            await run_step(
                engine,
                samples,
                ScriptedRollout(),
                TargetCount(2, abort_ratio=0.5),
                Tracer(None, step=0),
                abort_deadline_s=1.0,
            )
        return samples, info.value, loop.time() - t0

    samples, err, elapsed = run_virtual(main())
    rid = samples[1].turns[0].request_id
    assert rid in str(err) and "still running after abort" in str(err)
    assert elapsed < 5.0  # bounded by the abort deadline, not the 50 s request
    assert all(s.status in (Status.COMPLETED, Status.ABORTED) for s in samples)


def test_engine_death_fails_the_step_with_a_clear_error_and_no_hang():
    trajs = [traj((100 * (i + 1), 0.1), (50, 0.0)) for i in range(8)]
    engine = SimEngine(CFG, SimFaults(die_at_s=2.0))

    async def main():
        samples = make_samples(trajs)
        with pytest.raises(StepFailed, match="engine died") as info:
            await run_step(engine, samples, ScriptedRollout(), WaitAll(8), Tracer(None, step=0))
        return samples, info.value, asyncio.get_running_loop().time()

    samples, err, t = run_virtual(main())
    assert "died at t=2.000s" in str(err)
    assert t == pytest.approx(2.0)
    assert all(s.status in (Status.COMPLETED, Status.FAILED, Status.ABORTED) for s in samples)
    assert any(s.status is Status.FAILED for s in samples)
