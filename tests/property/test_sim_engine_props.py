"""SimEngine invariants under random arrivals, aborts and cancellations (virtual time)."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from tailcut.config import SimEngineConfig
from tailcut.engine.sim import AbortEffect, SimEngine
from tailcut.types import FinishReason, GenerateRequest, SamplingParams, new_request_id
from tailcut.vtime import run_virtual

request = st.tuples(
    st.integers(0, 200),  # max_new_tokens
    st.integers(1, 300),  # prompt tokens
    st.floats(0.0, 2.0),  # arrival time
    st.one_of(st.none(), st.floats(0.0, 4.0)),  # abort time
    st.booleans(),  # abort by cancelling the caller (else engine.abort)
)
configs = st.builds(
    SimEngineConfig,
    decode_a_s=st.sampled_from([0.0, 0.004, 0.012]),
    decode_c_s=st.sampled_from([0.0, 3e-5, 1e-3]),
    prefill_s_per_token=st.sampled_from([0.0, 2e-6, 1e-4]),
    kv_capacity_tokens=st.sampled_from([600, 2_000, 4_000_000]),
)


@settings(max_examples=80, deadline=None)
@given(reqs=st.lists(request, min_size=1, max_size=25), cfg=configs)
def test_every_request_ends_once_and_the_books_balance(reqs, cfg):
    async def main():
        loop = asyncio.get_running_loop()
        engine = SimEngine(cfg)
        outcomes: dict[int, object] = {}
        ends: dict[int, float] = {}

        async def one(i: int, r: GenerateRequest, at: float) -> None:
            try:
                await asyncio.sleep(at)
                outcomes[i] = await engine.generate(r)
            except asyncio.CancelledError:
                outcomes[i] = "cancelled"
                raise
            finally:
                ends[i] = loop.time()

        made = [
            GenerateRequest(
                new_request_id(), [3] * p, SamplingParams(max_new_tokens=n, ignore_eos=True)
            )
            for n, p, *_ in reqs
        ]
        tasks = [
            asyncio.create_task(one(i, r, spec[2]))
            for i, (r, spec) in enumerate(zip(made, reqs, strict=True))
        ]

        async def stopper(i: int, at: float, cancel: bool) -> None:
            await asyncio.sleep(at)
            if cancel:
                tasks[i].cancel()
            else:
                await engine.abort([made[i].request_id])

        stoppers = [
            asyncio.create_task(stopper(i, spec[3], spec[4]))
            for i, spec in enumerate(reqs)
            if spec[3] is not None
        ]
        await asyncio.gather(*tasks, *stoppers, return_exceptions=True)
        return engine, made, outcomes, await engine.in_flight(), await engine.stats()

    engine, made, outcomes, in_flight, stats = run_virtual(main())
    assert sorted(outcomes) == list(range(len(made)))  # each caller got exactly one outcome
    assert in_flight == []
    assert (stats.running, stats.waiting, stats.kv_blocks_in_use) == (0, 0, 0)
    assert stats.tokens_after_abort == 0
    log = engine.abort_log
    aborted_tokens = {a.request_id: a.tokens for a in log if a.effect is AbortEffect.ABORTED}
    assert engine.wasted_tokens == sum(aborted_tokens.values())
    assert engine.aborted == len(aborted_tokens)
    for i, r in enumerate(made):
        out = outcomes[i]
        if out == "cancelled":
            continue
        n = r.sampling.max_new_tokens
        assert out.request_id == r.request_id
        if out.finish_reason is FinishReason.ABORT:
            assert len(out.output_ids) == aborted_tokens[r.request_id] <= n
        else:
            assert out.finish_reason is FinishReason.LENGTH
            assert len(out.output_ids) == n
