"""SimEngine fault injection: lost aborts, requests that never finish, engine death."""

from __future__ import annotations

import asyncio

import pytest

from tailcut.config import SimEngineConfig
from tailcut.engine.base import EngineDied
from tailcut.engine.sim import AbortEffect, Select, SimEngine, SimFaults
from tailcut.types import FinishReason, GenerateRequest, SamplingParams, new_request_id
from tailcut.vtime import run_virtual

STEP = 0.01
CFG = SimEngineConfig(decode_a_s=STEP, decode_c_s=0.0, prefill_s_per_token=0.0)


def req(n: int, rid: str | None = None) -> GenerateRequest:
    return GenerateRequest(
        rid or new_request_id(), [1, 2, 3], SamplingParams(max_new_tokens=n, ignore_eos=True)
    )


def test_a_lost_abort_leaves_the_request_running_and_counts_tokens_after_abort():
    r = req(100)
    faults = SimFaults(lose_aborts=Select(ids={r.request_id}))

    async def main():
        engine = SimEngine(CFG, faults)
        task = asyncio.create_task(engine.generate(r))
        await asyncio.sleep(0.305)  # 30 tokens
        await engine.abort([r.request_id])
        still = r.request_id in await engine.in_flight()
        live_after = engine.tokens_after_abort
        result = await task
        return engine, still, live_after, result, asyncio.get_running_loop().time()

    engine, still, live_after, result, t = run_virtual(main())
    assert still and live_after == 0
    assert result.finish_reason is FinishReason.LENGTH and len(result.output_ids) == 100
    assert t == pytest.approx(100 * STEP)
    assert engine.tokens_after_abort == 70
    assert engine.aborted == 0 and engine.wasted_tokens == 0
    assert [(a.effect, a.tokens) for a in engine.abort_log] == [(AbortEffect.LOST, 30)]


def test_first_k_abort_attempts_are_lost_then_one_takes_effect():
    faults = SimFaults(lose_aborts=Select(every=True), lose_abort_attempts=2)

    async def main():
        engine = SimEngine(CFG, faults)
        r = req(1000)
        task = asyncio.create_task(engine.generate(r))
        for _ in range(3):
            await asyncio.sleep(0.1)
            await engine.abort([r.request_id])
        return engine, await task

    engine, result = run_virtual(main())
    assert [a.effect for a in engine.abort_log] == [
        AbortEffect.LOST,
        AbortEffect.LOST,
        AbortEffect.ABORTED,
    ]
    assert result.finish_reason is FinishReason.ABORT and len(result.output_ids) == 30
    assert engine.tokens_after_abort == 20  # generated between the first attempt and the third
    assert engine.wasted_tokens == 30


def test_selecting_faulty_requests_by_arrival_ordinal_or_predicate():
    hang_second = SimFaults(hang=Select(ordinals={1}))
    hang_big = SimFaults(hang=Select(where=lambda r: r.sampling.max_new_tokens > 50))

    async def main(faults: SimFaults):
        engine = SimEngine(CFG, faults)
        tasks = [asyncio.create_task(engine.generate(req(n))) for n in (10, 20, 60)]
        await asyncio.sleep(5.0)
        return [t.done() for t in tasks], engine

    done, _engine = run_virtual(main(hang_second))
    assert done == [True, False, True]
    done, _engine = run_virtual(main(hang_big))
    assert done == [True, True, False]


def test_a_hung_request_never_finishes_until_aborted():
    r = req(50)

    async def main():
        engine = SimEngine(CFG, SimFaults(hang=Select(ids={r.request_id})))
        task = asyncio.create_task(engine.generate(r))
        other = await engine.generate(req(20))
        await asyncio.sleep(3600.0)
        hung = not task.done() and r.request_id in await engine.in_flight()
        stats = await engine.stats()
        await engine.abort([r.request_id])
        return hung, stats, other, await task, await engine.in_flight()

    hung, stats, other, result, left = run_virtual(main())
    assert hung and stats.running == 1 and stats.kv_blocks_in_use > 0
    assert other.finish_reason is FinishReason.LENGTH
    assert result.finish_reason is FinishReason.ABORT and len(result.output_ids) == 50
    assert left == []


def test_engine_death_fails_pending_and_later_calls_at_the_given_time():
    async def main():
        loop = asyncio.get_running_loop()
        engine = SimEngine(CFG, SimFaults(die_at_s=2.0))
        quick = asyncio.create_task(engine.generate(req(100)))  # ends at 1.0 s
        slow = asyncio.create_task(engine.generate(req(1000)))
        first = await quick
        with pytest.raises(EngineDied, match=r"died at t=2\.000s"):
            await slow
        died_at = loop.time()
        with pytest.raises(EngineDied):
            await engine.generate(req(5))
        with pytest.raises(EngineDied):
            await engine.abort([first.request_id])
        with pytest.raises(EngineDied):
            await engine.in_flight()
        return first, died_at, engine

    first, died_at, engine = run_virtual(main())
    assert first.finish_reason is FinishReason.LENGTH
    assert died_at == pytest.approx(2.0)
    assert engine.dead


def test_kill_fails_every_waiter_at_once_without_hanging():
    async def main():
        engine = SimEngine(SimEngineConfig(kv_capacity_tokens=500), SimFaults())
        tasks = [asyncio.create_task(engine.generate(req(400))) for _ in range(3)]  # 2 queue
        await asyncio.sleep(0.5)
        engine.kill("test")
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, await engine.stats()

    results, stats = run_virtual(main())
    assert all(isinstance(r, EngineDied) for r in results)
    assert (stats.running, stats.waiting) == (0, 0)


def test_cancelling_callers_of_a_dead_engine_does_not_hang():
    async def main():
        engine = SimEngine(CFG, SimFaults(die_at_s=1.0))
        task = asyncio.create_task(engine.generate(req(1000)))
        await asyncio.sleep(2.0)
        task.cancel()
        return await asyncio.gather(task, return_exceptions=True)

    (outcome,) = run_virtual(main())
    assert isinstance(outcome, EngineDied)
