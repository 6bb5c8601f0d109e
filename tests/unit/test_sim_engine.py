"""SimEngine's model on virtual time: exact step times, batching, KV queueing, aborts."""

from __future__ import annotations

import asyncio

import pytest

from tailcut.config import SimEngineConfig
from tailcut.engine.base import EngineError
from tailcut.engine.sim import AbortEffect, SimEngine
from tailcut.types import FinishReason, GenerateRequest, SamplingParams, new_request_id
from tailcut.vtime import run_virtual

A, C, P = 0.01, 0.001, 0.001  # a, c, prefill per token


def cfg(**kw) -> SimEngineConfig:
    base = {"decode_a_s": A, "decode_c_s": C, "prefill_s_per_token": P}
    return SimEngineConfig(**{**base, **kw})


def req(n: int, prompt: int = 10, ignore_eos: bool = True, rid: str | None = None):
    return GenerateRequest(
        rid or new_request_id(),
        [5] * prompt,
        SamplingParams(max_new_tokens=n, ignore_eos=ignore_eos),
    )


async def timed(engine: SimEngine, request: GenerateRequest, delay: float = 0.0):
    loop = asyncio.get_running_loop()
    if delay:
        await asyncio.sleep(delay)
    result = await engine.generate(request)
    return loop.time(), result


def test_one_request_takes_prefill_plus_n_decode_steps():
    async def main():
        return await timed(SimEngine(cfg()), req(100, prompt=10))

    t, result = run_virtual(main())
    assert t == pytest.approx(10 * P + 100 * (A + C), abs=1e-9)
    assert result.finish_reason is FinishReason.LENGTH
    assert len(result.output_ids) == 100 == len(result.logprobs or [])
    assert result.prompt_tokens == 10


def test_batched_requests_share_steps_of_a_plus_c_b():
    async def main():
        engine = SimEngine(cfg())
        return await asyncio.gather(timed(engine, req(10)), timed(engine, req(20)))

    (t1, r1), (t2, r2) = run_virtual(main())
    first = 20 * P + 10 * (A + 2 * C)  # both prompts prefilled in the first step
    assert t1 == pytest.approx(first, abs=1e-9)
    assert t2 == pytest.approx(first + 10 * (A + C), abs=1e-9)
    assert (len(r1.output_ids), len(r2.output_ids)) == (10, 20)


def test_a_late_arrival_joins_at_the_next_step_boundary():
    async def main():
        engine = SimEngine(cfg(prefill_s_per_token=0.0))
        return await asyncio.gather(timed(engine, req(10)), timed(engine, req(5), delay=0.015))

    (t_a, _), (t_b, _) = run_virtual(main())
    # A runs alone for two steps (boundary at 0.022); B joins there for 5 steps of τ(2).
    joined = 2 * (A + C)
    assert t_b == pytest.approx(joined + 5 * (A + 2 * C), abs=1e-9)
    assert t_a == pytest.approx(t_b + 3 * (A + C), abs=1e-9)


def test_arrivals_exactly_at_a_step_boundary_all_join_there():
    async def main():
        engine = SimEngine(cfg(decode_c_s=0.0, prefill_s_per_token=0.0))
        first = asyncio.create_task(timed(engine, req(10)))
        late = [asyncio.create_task(timed(engine, req(4), delay=3 * A)) for _ in range(3)]
        return await first, await asyncio.gather(*late)

    (t_first, _), late = run_virtual(main())
    assert t_first == pytest.approx(10 * A, abs=1e-9)
    assert [t for t, _ in late] == pytest.approx([7 * A] * 3, abs=1e-9)


def test_abort_mid_way_returns_partial_tokens_and_counts_them_as_wasted():
    async def main():
        engine = SimEngine(cfg(decode_c_s=0.0, prefill_s_per_token=0.0))
        r = req(1000)
        task = asyncio.create_task(engine.generate(r))
        await asyncio.sleep(0.055)  # 5.5 steps of 10 ms
        await engine.abort([r.request_id])
        assert r.request_id not in await engine.in_flight()
        return await task, engine, r.request_id

    result, engine, rid = run_virtual(main())
    assert result.finish_reason is FinishReason.ABORT
    assert len(result.output_ids) == 5
    assert engine.aborted == 1 and engine.wasted_tokens == 5
    assert [(a.request_id, a.effect, a.tokens) for a in engine.abort_log] == [
        (rid, AbortEffect.ABORTED, 5)
    ]
    assert engine.tokens_after_abort == 0


def test_abort_shrinks_the_batch_for_the_others():
    async def main():
        engine = SimEngine(cfg(prefill_s_per_token=0.0))
        long, other = req(1000), req(20)
        t_long = asyncio.create_task(engine.generate(long))
        t_other = asyncio.create_task(timed(engine, other))
        await asyncio.sleep(5 * (A + 2 * C))  # exactly 5 steps together
        await engine.abort([long.request_id])
        await t_long
        return await t_other

    t, result = run_virtual(main())
    assert len(result.output_ids) == 20
    assert t == pytest.approx(5 * (A + 2 * C) + 15 * (A + C), abs=1e-9)


def test_requests_queue_when_the_kv_cache_is_full_and_abort_frees_it_at_once():
    async def main():
        engine = SimEngine(cfg(kv_capacity_tokens=150, prefill_s_per_token=0.0, decode_c_s=0.0))
        first, second = req(100, prompt=10), req(50, prompt=10)
        t1 = asyncio.create_task(engine.generate(first))
        t2 = asyncio.create_task(timed(engine, second))
        await asyncio.sleep(0.5)
        stats = await engine.stats()
        assert (stats.running, stats.waiting) == (1, 1)
        assert stats.kv_blocks_in_use == -(-110 // 16)
        await engine.abort([first.request_id])  # frees 110 tokens: the second starts now
        await t1
        return await t2, engine

    (t, result), _engine = run_virtual(main())
    assert len(result.output_ids) == 50
    assert t == pytest.approx(0.5 + 50 * A, abs=1e-9)


def test_queued_request_starts_when_the_first_finishes():
    async def main():
        engine = SimEngine(cfg(kv_capacity_tokens=150, prefill_s_per_token=0.0, decode_c_s=0.0))
        return await asyncio.gather(timed(engine, req(100)), timed(engine, req(50)))

    (t1, _), (t2, _) = run_virtual(main())
    assert t1 == pytest.approx(100 * A, abs=1e-9)
    assert t2 == pytest.approx(150 * A, abs=1e-9)


def test_abort_of_a_queued_request_resolves_it_with_no_tokens():
    async def main():
        engine = SimEngine(cfg(kv_capacity_tokens=150))
        first, queued = req(100), req(100)
        t1 = asyncio.create_task(engine.generate(first))
        t2 = asyncio.create_task(engine.generate(queued))
        await asyncio.sleep(0.1)
        await engine.abort([queued.request_id])
        out = await t2
        assert (await t1).finish_reason is FinishReason.LENGTH
        return out, await engine.stats()

    out, stats = run_virtual(main())
    assert out.finish_reason is FinishReason.ABORT and list(out.output_ids) == []
    assert (stats.running, stats.waiting, stats.kv_blocks_in_use) == (0, 0, 0)


def test_stop_after_ends_a_request_with_its_stop_token():
    def stop_after(r: GenerateRequest) -> int | None:
        return 7

    async def main():
        engine = SimEngine(cfg(), stop_after=stop_after)
        r = GenerateRequest(
            new_request_id(), [1, 2], SamplingParams(max_new_tokens=50, stop_token_ids=(99,))
        )
        forced = await engine.generate(req(50))  # ignore_eos: runs to max_new_tokens
        return await engine.generate(r), forced

    stopped, forced = run_virtual(main())
    assert stopped.finish_reason is FinishReason.STOP
    assert len(stopped.output_ids) == 7 and stopped.output_ids[-1] == 99
    assert forced.finish_reason is FinishReason.LENGTH and len(forced.output_ids) == 50


def test_zero_new_tokens_returns_at_once():
    async def main():
        return await timed(SimEngine(cfg()), req(0))

    t, result = run_virtual(main())
    assert t == 0.0 and len(result.output_ids) == 0 and result.finish_reason is FinishReason.LENGTH


def test_a_request_larger_than_the_kv_cache_is_refused_with_sizes():
    async def main():
        await SimEngine(cfg(kv_capacity_tokens=100)).generate(req(95, prompt=10))

    with pytest.raises(EngineError, match=r"needs 105 KV tokens .* capacity is 100"):
        run_virtual(main())


def test_a_duplicate_id_in_flight_is_refused():
    async def main():
        engine = SimEngine(cfg())
        r = req(100)
        task = asyncio.create_task(engine.generate(r))
        await asyncio.sleep(0.01)
        try:
            await engine.generate(r)
        finally:
            await engine.abort([r.request_id])
            await task

    with pytest.raises(EngineError, match="already in flight"):
        run_virtual(main())


def test_it_is_event_driven_not_per_token():
    """10,240 concurrent requests of 64 distinct lengths: one event per distinct finish."""

    async def main():
        engine = SimEngine(SimEngineConfig(kv_capacity_tokens=20_000_000))
        reqs = [req(200 + 10 * (i % 64), prompt=100) for i in range(10_240)]
        results = await asyncio.gather(*(engine.generate(r) for r in reqs))
        return engine, reqs, results

    engine, reqs, results = run_virtual(main())
    assert [len(r.output_ids) for r in results] == [x.sampling.max_new_tokens for x in reqs]
    assert engine.decode_steps == 200 + 10 * 63
    assert engine.events <= 64 + 2


def test_stats_report_blocks_in_use_and_zero_when_idle():
    async def main():
        engine = SimEngine(cfg(kv_block_size=16))
        tasks = [asyncio.create_task(engine.generate(req(100, prompt=28))) for _ in range(3)]
        await asyncio.sleep(0.05)
        during = await engine.stats()
        await asyncio.gather(*tasks)
        return during, await engine.stats()

    during, after = run_virtual(main())
    assert (during.running, during.kv_blocks_in_use) == (3, 3 * 8)
    assert during.kv_blocks_total == SimEngineConfig().kv_capacity_tokens // 16
    assert (after.running, after.waiting, after.kv_blocks_in_use, after.aborted) == (0, 0, 0, 0)


def test_it_also_runs_on_an_ordinary_event_loop():
    async def main():
        engine = SimEngine(cfg(decode_a_s=0.001, decode_c_s=0.0, prefill_s_per_token=0.0))
        long = req(10_000)
        task = asyncio.create_task(engine.generate(long))
        done = await engine.generate(req(5))
        await engine.abort([long.request_id])
        return done, await task

    done, aborted = asyncio.run(main())
    assert done.finish_reason is FinishReason.LENGTH and len(done.output_ids) == 5
    assert aborted.finish_reason is FinishReason.ABORT
    assert 5 <= len(aborted.output_ids) < 10_000
