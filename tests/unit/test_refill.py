"""Group refill (``rollout.max_retries``): a FAILED sample is relaunched within its step, on
virtual time; one that keeps failing stays FAILED with its error; a cut relaunches nothing."""

from __future__ import annotations

import asyncio

import pytest

from fakes.timed_engine import TimedEngine
from fakes.turns_rollout import TurnsRollout
from tailcut.engine.base import Engine, EngineDied
from tailcut.rollout.cutoff import CutoffPolicy, TargetCount, WaitAll
from tailcut.rollout.scheduler import run_step
from tailcut.rollout.step import StepFailed, StepResult
from tailcut.trace.events import Tracer
from tailcut.types import Sample, Status
from tailcut.vtime import run_virtual

TOKEN_S = 0.01


class Flaky(TurnsRollout):
    """Sample ``i`` fails its first ``failures[i]`` attempts after generating."""

    def __init__(self, scripts: list[list[tuple[int, float]]], failures: dict[int, int]):
        super().__init__(scripts)
        self.failures = dict(failures)
        self.attempts: dict[int, int] = {}
        self.seeds: dict[int, list[int | None]] = {}
        self.tokens_at_start: dict[int, list[int]] = {}
        self.fail_after_s = 5 * TOKEN_S

    async def __call__(self, sample: Sample, engine: Engine, tracer: Tracer) -> None:
        i = sample.index
        self.attempts[i] = self.attempts.get(i, 0) + 1
        self.seeds.setdefault(i, []).append(sample.seed)
        self.tokens_at_start.setdefault(i, []).append(len(sample.response_ids))
        if self.failures.get(i, 0) > 0:  # a failing attempt: one turn as scripted, then a crash
            self.failures[i] -= 1
            sample.response_ids.extend([7] * self.scripts[i][0][0])
            await asyncio.sleep(self.fail_after_s)
            raise RuntimeError(f"tool crashed for {i} (attempt {self.attempts[i]})")
        await super().__call__(sample, engine, tracer)


def _run(rollout: TurnsRollout, policy: CutoffPolicy, n: int, **kw) -> StepResult:
    samples = [Sample(index=i, group=i // 2, prompt_ids=[1, 2], seed=100 + i) for i in range(n)]

    async def main() -> StepResult:
        return await run_step(
            TimedEngine(TOKEN_S), samples, rollout, policy, Tracer(None, step=0), **kw
        )

    return run_virtual(main())


def test_a_failed_sample_is_relaunched_and_its_group_keeps_its_size() -> None:
    rollout = Flaky([[(3, 0.0)], [(5, 0.0)], [(2, 0.0)], [(4, 0.0)]], failures={1: 1})
    res = _run(rollout, WaitAll(4, 2), 4, max_retries=2)
    assert [s.status for s in res.samples] == [Status.COMPLETED] * 4
    assert res.retries == 1 and res.recovered == 1 and res.failed_before_refill == 1
    assert rollout.attempts == {0: 1, 1: 2, 2: 1, 3: 1}
    # The relaunch starts from the sample as launched (its first tokens undone) and
    # samples a stream of its own.
    assert rollout.tokens_at_start[1] == [0, 0]
    assert res.samples[1].generated_tokens == 5 and res.samples[1].error is None
    first, second = rollout.seeds[1]
    assert first == 101 and second not in (None, 101)
    # It ended after both attempts: a crash at 5 tokens' time, then 5 tokens.
    assert res.samples[1].ended_at == pytest.approx(10 * TOKEN_S)
    assert res.kept == [0, 1, 2, 3]


def test_a_sample_that_keeps_failing_stays_failed_with_its_last_error() -> None:
    rollout = Flaky([[(2, 0.0)], [(2, 0.0)]], failures={0: 5})
    rollout.fail_after_s = TOKEN_S
    res = _run(rollout, WaitAll(2, 2), 2, max_retries=2)
    s = res.samples[0]
    assert s.status is Status.FAILED and rollout.attempts[0] == 3
    assert s.error == "RuntimeError: tool crashed for 0 (attempt 3)"
    assert res.retries == 2 and res.recovered == 0 and res.failed_before_refill == 1


def test_no_retries_by_default() -> None:
    rollout = Flaky([[(2, 0.0)], [(2, 0.0)]], failures={0: 1})
    res = _run(rollout, WaitAll(2, 2), 2)
    assert res.samples[0].status is Status.FAILED and rollout.attempts[0] == 1
    assert res.retries == 0


def test_a_relaunch_in_flight_at_the_cut_is_aborted_like_any_straggler() -> None:
    # 4 samples, keep 2 (t=2 and t=3); sample 3 fails at t=1, its relaunch (1 + 6) is cut.
    rollout = Flaky([[(2, 0.0)], [(3, 0.0)], [(9, 0.0)], [(6, 0.0)]], failures={3: 1})
    rollout.fail_after_s = TOKEN_S
    res = _run(rollout, TargetCount(4, 2, abort_ratio=0.5), 4, max_retries=3)
    assert res.cut_time_s == pytest.approx(3 * TOKEN_S)
    assert rollout.attempts[3] == 2 and res.retries == 1
    assert res.samples[3].status is Status.ABORTED
    assert res.recovered == 1 and res.failed_before_refill == 1
    assert res.kept == [0, 1]


def test_engine_death_is_never_retried() -> None:
    class Dying(TurnsRollout):
        calls = 0

        async def __call__(self, sample: Sample, engine: Engine, tracer: Tracer) -> None:
            Dying.calls += 1
            await asyncio.sleep(0.01)
            raise EngineDied("gone")

    with pytest.raises(StepFailed, match="engine died"):
        _run(Dying([[(1, 0.0)]]), WaitAll(1), 1, max_retries=3)
    assert Dying.calls == 1
