"""SimEngine's priority scheduling on virtual time: admission order and both preemptions."""

from __future__ import annotations

import asyncio

import pytest

from tailcut.config import SimEngineConfig
from tailcut.engine.sim import SimEngine
from tailcut.types import GenerateRequest, SamplingParams, new_request_id
from tailcut.vtime import run_virtual


def cfg(**kw) -> SimEngineConfig:
    # one-second decode steps, half a second of prefill per prompt token, one slot
    return SimEngineConfig(
        decode_a_s=1.0, decode_c_s=0.0, prefill_s_per_token=0.5, max_running=1, **kw
    )


def req(n: int, priority: int | None) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=n, ignore_eos=True, priority=priority)
    return GenerateRequest(new_request_id(), [5, 5], sp)


async def timed(engine: SimEngine, request: GenerateRequest, delay: float = 0.0):
    loop = asyncio.get_running_loop()
    await asyncio.sleep(delay)
    result = await engine.generate(request)
    return loop.time(), len(result.output_ids)


def test_waiting_requests_go_in_by_priority_then_arrival():
    async def main():
        engine = SimEngine(cfg())
        return await asyncio.gather(
            timed(engine, req(3, 5)), timed(engine, req(3, 1)), timed(engine, req(3, 5))
        )

    (t_low, _), (t_high, _), (t_low2, _) = run_virtual(main())
    assert t_high == pytest.approx(1.0 + 3.0)  # its prefill, three steps
    assert t_low == pytest.approx(t_high + 1.0 + 3.0)
    assert t_low2 == pytest.approx(t_low + 1.0 + 3.0)


@pytest.mark.parametrize(("mode", "low_ends"), [("keep", 14.0), ("recompute", 17.0)])
def test_a_better_request_preempts_and_the_paused_one_resumes(mode: str, low_ends: float):
    async def main():
        engine = SimEngine(cfg(preemption=mode))
        got = await asyncio.gather(timed(engine, req(10, 5)), timed(engine, req(2, 1), 5.0))
        return got, engine.preemptions

    ((t_low, n_low), (t_high, n_high)), preemptions = run_virtual(main())
    # low: prefill 1 s, four steps by t=5; high: prefill 1 s + 2 steps, ends at 8
    assert t_high == pytest.approx(8.0)
    # low resumes at 8 for its last 6 tokens: keep, at once; recompute, after a prefill of
    # its prompt and 4 tokens (3 s)
    assert t_low == pytest.approx(low_ends)
    assert (n_low, n_high, preemptions) == (10, 2, 1)


def test_without_priorities_nothing_is_preempted():
    async def main():
        engine = SimEngine(cfg())
        got = await asyncio.gather(timed(engine, req(10, None)), timed(engine, req(2, None), 5.0))
        return got, engine.preemptions

    ((t_first, _), (t_second, _)), preemptions = run_virtual(main())
    assert preemptions == 0
    assert t_first == pytest.approx(11.0) and t_second == pytest.approx(14.0)


def test_an_abort_of_a_paused_request_frees_its_kept_cache():
    async def main():
        engine = SimEngine(cfg(preemption="keep"))
        low = req(10, 5)
        task = asyncio.create_task(engine.generate(low))
        high = asyncio.create_task(timed(engine, req(20, 1), 5.0))
        await asyncio.sleep(6.0)
        await engine.abort([low.request_id])
        result = await task
        stats = await engine.stats()
        await high
        return len(result.output_ids), stats

    tokens, stats = run_virtual(main())
    assert tokens == 4  # what it had made before it was paused
    assert stats.kv_blocks_in_use == 2  # only the running one's 22 tokens (2 blocks) are left
