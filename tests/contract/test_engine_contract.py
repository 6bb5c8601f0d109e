"""The Engine contract, one suite for every adapter (engines listed in ``conftest.py``).

generate -> result; abort resolves a running request with finish reason ``abort`` and its
partial tokens; cancelling the awaiting task aborts the request in the engine and
re-raises; abort is idempotent and a no-op for unknown ids; ids are matched exactly (no
prefix matching); in_flight tells the truth before and after.
"""

from __future__ import annotations

import asyncio

import pytest

from tailcut.engine.base import Engine
from tailcut.types import (
    REQUEST_ID_LEN,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    new_request_id,
)


def _request(case, max_new_tokens: int, request_id: str | None = None) -> GenerateRequest:
    return GenerateRequest(
        request_id or new_request_id("ct"),
        list(case.prompt),
        SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, temperature=1.0),
    )


async def _start_long(case, engine: Engine, request_id: str | None = None):
    req = _request(case, case.long_tokens, request_id)
    task = asyncio.create_task(engine.generate(req))
    # running on the engine first, then settle_s of it: under load a request can reach a
    # server well after it was sent, and one aborted as it arrives has no tokens yet
    await _until_in_flight(engine, [req.request_id])
    await asyncio.sleep(case.settle_s)
    assert not task.done(), f"{case.name}: a long request ended before settle_s"
    return req, task


async def _until_in_flight(engine: Engine, ids: list[str], timeout_s: float = 10.0) -> None:
    """Wait until the engine lists every id as running (an abort sent before a request reached
    the server is a no-op there, so tests that abort a batch first wait for all of it)."""
    async with asyncio.timeout(timeout_s):
        while not set(ids) <= set(await engine.in_flight()):  # noqa: ASYNC110 (in_flight is all the contract offers)
            await asyncio.sleep(0.005)


async def _idle(engine: Engine, ids: list[str]) -> bool:
    running = set(await engine.in_flight())
    return not running.intersection(ids)


def test_generate_returns_exactly_max_new_tokens_with_ignore_eos(case):
    async def body(engine: Engine) -> None:
        req = _request(case, case.short_tokens)
        result = await engine.generate(req)
        assert isinstance(result, GenerateResult)
        assert result.request_id == req.request_id
        assert result.finish_reason is FinishReason.LENGTH
        assert len(result.output_ids) == case.short_tokens
        if result.logprobs is not None:
            assert len(result.logprobs) == len(result.output_ids)
        assert await _idle(engine, [req.request_id])

    case.check(body)


def test_in_flight_lists_a_running_request_until_it_is_aborted(case):
    async def body(engine: Engine) -> None:
        req, task = await _start_long(case, engine)
        assert req.request_id in await engine.in_flight()
        await engine.abort([req.request_id])
        assert await _idle(engine, [req.request_id])
        result = await task
        assert result.finish_reason is FinishReason.ABORT

    case.check(body)


def test_abort_resolves_with_the_tokens_generated_so_far(case):
    async def body(engine: Engine) -> None:
        req, task = await _start_long(case, engine)
        await engine.abort([req.request_id])
        result = await task
        assert result.request_id == req.request_id
        assert result.finish_reason is FinishReason.ABORT
        assert len(result.output_ids) < case.long_tokens
        if case.partial_tokens:
            assert len(result.output_ids) > 0
        if result.logprobs is not None:
            assert len(result.logprobs) == len(result.output_ids)

    case.check(body)


def test_cancelling_the_caller_aborts_the_request_and_reraises(case):
    async def body(engine: Engine) -> None:
        req, task = await _start_long(case, engine)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _idle(engine, [req.request_id])
        stats = await engine.stats()
        assert stats.tokens_after_abort in (0, -1)

    case.check(body)


def test_cancelling_twice_still_leaves_the_engine_idle(case):
    async def body(engine: Engine) -> None:
        req, task = await _start_long(case, engine)
        task.cancel()
        await asyncio.sleep(0)
        task.cancel()  # a second cancellation must not interrupt the shielded abort
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(case.settle_s)
        assert await _idle(engine, [req.request_id])

    case.check(body)


def test_abort_is_idempotent_and_a_no_op_for_unknown_or_finished_ids(case):
    async def body(engine: Engine) -> None:
        await engine.abort([])
        await engine.abort([new_request_id("zz")])
        done = await engine.generate(_request(case, case.short_tokens))
        await engine.abort([done.request_id])  # already finished: nothing happens
        req, task = await _start_long(case, engine)
        await engine.abort([req.request_id])
        await engine.abort([req.request_id])  # twice
        result = await task
        assert result.finish_reason is FinishReason.ABORT
        after = await engine.generate(_request(case, case.short_tokens))
        assert after.finish_reason is FinishReason.LENGTH
        assert len(after.output_ids) == case.short_tokens

    case.check(body)


def test_abort_matches_ids_exactly_not_by_prefix(case):
    async def body(engine: Engine) -> None:
        base = new_request_id("pf")
        twin = base[:-1] + ("a" if base[-1] != "a" else "b")
        assert len(base) == len(twin) == REQUEST_ID_LEN
        _req_a, task_a = await _start_long(case, engine, base)
        _req_b, task_b = await _start_long(case, engine, twin)
        await engine.abort([base[:-1]])  # a prefix of both: an unknown id
        assert {base, twin} <= set(await engine.in_flight())
        await engine.abort([base])
        assert (await task_a).finish_reason is FinishReason.ABORT
        assert twin in await engine.in_flight()
        assert not task_b.done()
        await engine.abort([twin])
        assert (await task_b).finish_reason is FinishReason.ABORT

    case.check(body)


def test_one_batched_abort_stops_many_requests(case):
    async def body(engine: Engine) -> None:
        reqs = [_request(case, case.long_tokens) for _ in range(16)]
        tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
        ids = [r.request_id for r in reqs]
        await _until_in_flight(engine, ids)
        await engine.abort(ids)
        assert await _idle(engine, ids)
        results = await asyncio.gather(*tasks)
        assert [r.request_id for r in results] == ids
        assert all(r.finish_reason is FinishReason.ABORT for r in results)
        assert (await engine.stats()).tokens_after_abort in (0, -1)

    case.check(body)


def test_aborting_one_request_leaves_the_others_running_to_completion(case):
    async def body(engine: Engine) -> None:
        req, task = await _start_long(case, engine)
        short = asyncio.create_task(engine.generate(_request(case, case.short_tokens)))
        await engine.abort([req.request_id])
        result = await short
        assert result.finish_reason is FinishReason.LENGTH
        assert len(result.output_ids) == case.short_tokens
        assert (await task).finish_reason is FinishReason.ABORT

    case.check(body)
