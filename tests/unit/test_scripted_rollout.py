"""ScriptedRollout: plays a trajectory turn by turn on virtual time, keeps the token layout."""

from __future__ import annotations

import asyncio

import pytest

from tailcut.bench.workloads import Trajectory, TurnSpec, make_samples
from tailcut.config import SimEngineConfig
from tailcut.engine.sim import SimEngine
from tailcut.rollout.scripted import TOOL_NAME, TOOL_TOKEN, ScriptedRollout
from tailcut.trace.events import EventKind, Tracer, read_trace
from tailcut.types import REQUEST_ID_LEN, FinishReason, Sample
from tailcut.vtime import run_virtual

CFG = SimEngineConfig(decode_a_s=0.01, decode_c_s=0.0, prefill_s_per_token=0.0)
TRAJ = Trajectory((TurnSpec(30, 0.5, 6), TurnSpec(20, 0.25, 4), TurnSpec(10)), prompt_tokens=12)


def play(sample: Sample, tmp_path, body=None):
    async def main():
        loop = asyncio.get_running_loop()
        engine = SimEngine(CFG)
        with Tracer.for_step(tmp_path, 0, 0, loop.time) as tracer:
            task = asyncio.create_task(ScriptedRollout()(sample, engine, tracer))
            if body is not None:
                await body(engine, sample, task)
            await task
        return loop.time()

    end = run_virtual(main())
    return end, read_trace(tmp_path / "step_0" / "worker_0.jsonl")


def test_plays_every_turn_and_tool_with_exact_times_and_token_layout(tmp_path):
    (sample,) = make_samples([TRAJ])
    end, events = play(sample, tmp_path)
    assert end == pytest.approx(0.30 + 0.5 + 0.20 + 0.25 + 0.10)
    assert sample.finish_reason is FinishReason.STOP
    assert [t.output_tokens for t in sample.turns] == [30, 20, 10]
    assert [t.engine_s for t in sample.turns] == pytest.approx([0.3, 0.2, 0.1])
    assert [t.tool_s for t in sample.turns] == pytest.approx([0.5, 0.25, 0.0])
    assert [t.prompt_tokens for t in sample.turns] == [12, 12 + 36, 12 + 36 + 24]
    n = 30 + 6 + 20 + 4 + 10
    assert len(sample.response_ids) == len(sample.loss_mask) == len(sample.logprobs) == n
    assert len(sample.versions) == n
    assert list(sample.loss_mask) == [1] * 30 + [0] * 6 + [1] * 20 + [0] * 4 + [1] * 10
    assert list(sample.response_ids[30:36]) == [TOOL_TOKEN] * 6
    assert all(v == -1 for v, m in zip(sample.versions, sample.loss_mask, strict=True) if m == 0)
    assert sample.generated_tokens == 60 and sample.active_request_id is None
    kinds = [e["event"] for e in events]
    assert kinds.count(EventKind.TURN_START) == kinds.count(EventKind.TURN_END) == 3
    assert kinds.count(EventKind.TURN_ENGINE_CALL) == 3 and kinds.count(EventKind.TOOL_CALL) == 2
    tools = [e for e in events if e["event"] == EventKind.TOOL_CALL]
    assert {e["extra"]["name"] for e in tools} == {TOOL_NAME}
    assert [e["duration_sec"] for e in tools] == pytest.approx([0.5, 0.25])
    assert all(e["extra"]["request_id"] == sample.workid for e in events)


def test_request_ids_are_fixed_length_and_unique():
    samples = make_samples([TRAJ] * 5)

    async def main():
        engine, rollout = SimEngine(CFG), ScriptedRollout()
        tracer = Tracer(None, step=0)
        await asyncio.gather(*(rollout(s, engine, tracer) for s in samples))

    run_virtual(main())
    ids = [t.request_id for s in samples for t in s.turns]
    assert len(set(ids)) == len(ids) == 15
    assert {len(i) for i in ids} == {REQUEST_ID_LEN}


def test_an_abort_mid_turn_ends_the_trajectory_with_its_partial_tokens(tmp_path):
    (sample,) = make_samples([TRAJ])

    async def cut(engine, sample, task):
        await asyncio.sleep(0.8 + 0.105)  # turn 0 and its tool done, 10 tokens into turn 1
        assert sample.active_request_id is not None
        await engine.abort([sample.active_request_id])

    _, events = play(sample, tmp_path, cut)
    assert sample.finish_reason is FinishReason.ABORT
    assert [t.output_tokens for t in sample.turns] == [30, 10]
    assert sample.turns[-1].finish_reason is FinishReason.ABORT
    assert len(sample.response_ids) == 30 + 6 + 10 == len(sample.loss_mask)
    assert [e["event"] for e in events][-2:] == [EventKind.TURN_ENGINE_CALL, EventKind.TURN_END]


def test_cancellation_during_a_tool_call_is_traced_and_reraised(tmp_path):
    (sample,) = make_samples([TRAJ])

    async def cancel(engine, sample, task):
        await asyncio.sleep(0.4)  # in the first tool call
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def main():
        loop = asyncio.get_running_loop()
        with Tracer.for_step(tmp_path, 0, 0, loop.time) as tracer:
            task = asyncio.create_task(ScriptedRollout()(sample, SimEngine(CFG), tracer))
            await cancel(None, sample, task)

    run_virtual(main())
    events = read_trace(tmp_path / "step_0" / "worker_0.jsonl")
    last = events[-1]
    assert last["event"] == EventKind.TOOL_CALL and last["extra"]["status"] == "cancelled"
    assert last["duration_sec"] == pytest.approx(0.1)
    assert len(sample.response_ids) == 30  # the tool's answer never arrived


def test_a_sample_without_a_trajectory_is_refused_by_name():
    sample = Sample(index=4, prompt_ids=[1])

    async def main():
        await ScriptedRollout()(sample, SimEngine(CFG), Tracer(None, step=0))

    with pytest.raises(ValueError, match=r"sample 4: data\['trajectory'\] must be"):
        run_virtual(main())
