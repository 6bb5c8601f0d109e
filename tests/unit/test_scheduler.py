"""The over-sampled step on virtual time: exact cut times, aborts, faults, traces."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fakes.timed_engine import TimedEngine
from fakes.turns_rollout import TurnsRollout
from tailcut.config import SimEngineConfig
from tailcut.engine.sim import SimEngine
from tailcut.engine.sim_faults import Select, SimFaults
from tailcut.rollout.cutoff import Deadline, TargetCount, WaitAll
from tailcut.rollout.scheduler import CutHandle, run_step
from tailcut.rollout.step import StepFailed, StepResult
from tailcut.trace.events import NULL_TRACER, TERMINAL_EVENTS, Tracer, read_trace
from tailcut.types import (
    FinishReason,
    Sample,
    Status,
)
from tailcut.vtime import run_virtual

TOKEN_S = 0.01


def _samples(n: int, group_size: int = 1) -> list[Sample]:
    return [Sample(index=i, group=i // group_size, prompt_ids=[1, 2, 3]) for i in range(n)]


def _run(engine, scripts, policy, tmp_path: Path | None = None, **kw) -> StepResult:
    async def main() -> StepResult:
        loop = asyncio.get_running_loop()
        tracer = Tracer.for_step(tmp_path, 0, 0, clock=loop.time)
        try:
            return await run_step(
                engine,
                _samples(len(scripts)),
                TurnsRollout(scripts, kw.pop("fail", None)),
                policy,
                tracer,
                **kw,
            )
        finally:
            tracer.close()

    return run_virtual(main())


def test_wait_all_runs_to_the_longest_request(tmp_path):
    scripts = [[(n, 0.0)] for n in (5, 1, 9, 3)]
    res = _run(TimedEngine(TOKEN_S), scripts, WaitAll(4), tmp_path)
    assert res.step_time_s == pytest.approx(9 * TOKEN_S)
    assert res.cut_time_s is None
    assert res.completed == 4 and res.kept == [0, 1, 2, 3]
    assert [s.generated_tokens for s in res.samples] == [5, 1, 9, 3]
    events = read_trace(tmp_path / "step_0" / "worker_0.jsonl")
    terminal = [e["extra"]["request_id"] for e in events if e["event"] in TERMINAL_EVENTS]
    assert sorted(terminal) == sorted(s.workid for s in res.samples)


def test_target_count_cuts_at_kth_completion_and_aborts_rest(tmp_path):
    lengths = [10, 1, 9, 2, 8, 3, 7, 4, 6, 5]
    engine = TimedEngine(TOKEN_S)
    res = _run(engine, [[(n, 0.0)] for n in lengths], TargetCount(10, abort_ratio=0.3), tmp_path)
    assert res.cut_time_s == pytest.approx(7 * TOKEN_S)
    assert res.completed == 7 and res.aborted == 3
    assert res.kept == [i for i, n in enumerate(lengths) if n <= 7]
    aborted = [s for s in res.samples if s.status is Status.ABORTED]
    assert sorted(s.generated_tokens for s in aborted) == [7, 7, 7]
    assert res.wasted_tokens == 21 == sum(engine.aborted_tokens.values())
    assert len(engine.aborts) == 1 and len(engine.aborts[0]) == 3
    assert engine.running == {}
    assert [s.index for s in res.samples] == list(range(10))
    assert res.abort_rounds == 1
    cut = [
        e
        for e in read_trace(tmp_path / "step_0" / "worker_0.jsonl")
        if e["event"] == "cutoff_decision"
    ]
    assert len(cut) == 1 and cut[0]["extra"]["done"] == 7


def test_cut_during_tool_call_cancels_and_keeps_partial_turns():
    scripts = [[(1, 0.0)], [(3, 0.0)], [(2, 5.0), (3, 0.0)]]  # sample 2 is in its tool at the cut
    res = _run(TimedEngine(TOKEN_S), scripts, TargetCount(3, abort_ratio=0.3))
    s = res.samples[2]
    assert s.status is Status.ABORTED and s.finish_reason is FinishReason.ABORT
    assert len(s.turns) == 1 and s.generated_tokens == 2
    assert res.step_time_s == pytest.approx(3 * TOKEN_S)  # the tool did not delay the step


def test_lost_abort_is_retried_until_confirmed():
    engine = TimedEngine(TOKEN_S, lose_aborts=2)
    res = _run(engine, [[(1, 0.0)], [(100, 0.0)]], TargetCount(2, abort_ratio=0.5))
    assert res.aborted == 1 and res.abort_rounds == 3
    assert engine.running == {}


def test_abort_never_confirmed_fails_the_step_naming_ids():
    engine = TimedEngine(TOKEN_S, lose_aborts=10**6)
    with pytest.raises(StepFailed, match="still running after abort: tc-"):
        _run(
            engine,
            [[(1, 0.0)], [(10**6, 0.0)]],
            TargetCount(2, abort_ratio=0.5),
            abort_deadline_s=1.0,
        )


def test_hung_request_is_cut():
    engine = TimedEngine(TOKEN_S, hang={7})
    res = _run(engine, [[(1, 0.0)], [(2, 0.0)], [(7, 0.0)]], TargetCount(3, abort_ratio=0.3))
    assert [s.status for s in res.samples] == [Status.COMPLETED, Status.COMPLETED, Status.ABORTED]


def test_step_timeout_cuts_even_wait_all():
    engine = TimedEngine(TOKEN_S, hang={7})
    res = _run(engine, [[(1, 0.0)], [(7, 0.0)]], WaitAll(2), timeout_s=3.0)
    assert res.cut_reason == "step_timeout" and res.cut_time_s == pytest.approx(3.0)
    assert res.samples[1].status is Status.ABORTED


def test_engine_death_fails_the_step_without_hanging():
    engine = TimedEngine(TOKEN_S)

    class Killer(TurnsRollout):
        async def __call__(self, sample, eng, tracer):
            if sample.index == 0:
                await asyncio.sleep(0.05)
                engine.die()
                return await super().__call__(sample, eng, tracer)
            return await super().__call__(sample, eng, tracer)

    async def main():
        tracer = Tracer(None, step=0)
        return await run_step(
            engine, _samples(3), Killer([[(1, 0.0)], [(50, 0.0)], [(60, 0.0)]]), WaitAll(3), tracer
        )

    with pytest.raises(StepFailed, match="engine died"):
        run_virtual(main())


def test_a_rollout_slow_to_unwind_is_cancelled_at_the_abort_deadline():
    class SlowCleanup(TurnsRollout):
        """Cut in its tool call, it spends 60 s in shielded cleanup before re-raising."""

        async def __call__(self, sample, eng, tracer):
            try:
                return await super().__call__(sample, eng, tracer)
            except asyncio.CancelledError:
                await asyncio.shield(asyncio.sleep(60.0))
                raise

    async def main():
        return await run_step(
            TimedEngine(TOKEN_S),
            _samples(3),
            SlowCleanup([[(1, 0.0)], [(3, 0.0)], [(2, 50.0), (1, 0.0)]]),
            TargetCount(3, abort_ratio=0.3),
            Tracer(None, step=0),
            abort_deadline_s=2.0,
        )

    res = run_virtual(main())
    assert res.cut_time_s == pytest.approx(3 * TOKEN_S)
    assert res.step_time_s == pytest.approx(3 * TOKEN_S + 2.0)  # the deadline, not 60 s
    assert [s.status for s in res.samples] == [Status.COMPLETED, Status.COMPLETED, Status.ABORTED]


def test_real_error_becomes_failed_record_never_padding():
    res = _run(TimedEngine(TOKEN_S), [[(1, 0.0)], [(2, 0.0)], [(3, 0.0)]], WaitAll(3), fail={1})
    s = res.samples[1]
    assert s.status is Status.FAILED and "reward exploded for 1" in (s.error or "")
    assert res.kept == [0, 2] and res.failed == 1


def test_deadline_policy_cuts_at_its_deadline():
    res = _run(
        TimedEngine(TOKEN_S),
        [[(n, 0.0)] for n in (10, 20, 30, 400)],
        Deadline(4, deadline_s=1.0, min_fraction=0.5),
    )
    assert res.cut_reason == "deadline" and res.cut_time_s == pytest.approx(1.0)
    assert res.kept == [0, 1, 2] and res.samples[3].generated_tokens == 100


def test_cut_disabled_equals_wait_all():
    scripts = [[(n, 0.5), (n + 1, 0.0)] for n in (4, 8, 2, 6)]
    a = _run(TimedEngine(TOKEN_S), scripts, WaitAll(4))
    b = _run(TimedEngine(TOKEN_S), scripts, TargetCount(4, abort_ratio=0.0))
    assert [(s.status, s.generated_tokens, s.ended_at) for s in a.samples] == [
        (s.status, s.generated_tokens, s.ended_at) for s in b.samples
    ]
    assert a.kept == b.kept and a.step_time_s == b.step_time_s


def test_launch_count_must_match_policy():
    with pytest.raises(ValueError, match="launches 5 samples but 4"):
        _run(TimedEngine(TOKEN_S), [[(1, 0.0)]] * 4, WaitAll(5))


def test_a_cut_made_before_the_step_starts_aborts_every_sample_at_once(tmp_path):
    """``CutHandle.cut`` before ``run_step``: each trajectory starts, is traced and ends
    aborted at once (never left pending)."""

    async def main() -> StepResult:
        handle = CutHandle()
        handle.cut("global")
        tracer = Tracer.for_step(tmp_path, 0, 0, clock=asyncio.get_running_loop().time)
        try:
            return await run_step(
                TimedEngine(TOKEN_S), _samples(4), TurnsRollout([[(5, 0.0)]] * 4), WaitAll(4),
                tracer, control=handle,
            )  # fmt: skip
        finally:
            tracer.close()

    res = run_virtual(main())
    assert res.cut_reason == "global" and res.step_time_s < TOKEN_S
    assert [s.status for s in res.samples] == [Status.ABORTED] * 4
    events = read_trace(tmp_path / "step_0" / "worker_0.jsonl")
    assert sorted(e["extra"]["request_id"] for e in events if e["event"] in TERMINAL_EVENTS) == (
        sorted(s.workid for s in res.samples)
    )


def test_an_engine_that_dies_while_the_cut_is_verified_fails_the_step():
    """The abort of the long request is lost, and the engine dies while the scheduler asks
    it what still runs: the step ends as ``StepFailed`` (not a raw exception group), every
    sample terminal."""
    engine = SimEngine(
        SimEngineConfig(decode_a_s=0.01, decode_c_s=0.0, prefill_s_per_token=0.0),
        SimFaults(lose_aborts=Select(ordinals=[1]), die_at_s=0.2),
    )
    samples = _samples(2)

    async def main() -> StepResult:
        return await run_step(
            engine, samples, TurnsRollout([[(10, 0.0)], [(1000, 0.0)]]), TargetCount(2, 1, 0.5),
            NULL_TRACER,
        )  # fmt: skip

    with pytest.raises(StepFailed, match="engine died"):
        run_virtual(main())
    assert [s.status for s in samples] == [Status.COMPLETED, Status.FAILED]
