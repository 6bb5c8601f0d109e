"""Hypothesis: with group refill, whatever fails how often under whichever cut, every sample
ends exactly once in the trace, a relaunch never outlives its budget, a sample FAILED at the
end failed every attempt it had, and the refill counts add up."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from fakes.timed_engine import TimedEngine
from fakes.turns_rollout import TurnsRollout
from tailcut.config import CutoffConfig
from tailcut.engine.base import Engine
from tailcut.rollout.cutoff import make_policy
from tailcut.rollout.scheduler import run_step
from tailcut.trace.events import TERMINAL_EVENTS, Tracer, read_trace
from tailcut.types import Sample, Status
from tailcut.vtime import run_virtual


class Failing(TurnsRollout):
    """Sample ``i`` raises on its first ``fails[i]`` attempts, after its first turn."""

    def __init__(self, scripts: list[list[tuple[int, float]]], fails: list[int]) -> None:
        super().__init__(scripts)
        self.fails = list(fails)
        self.attempts = [0] * len(scripts)

    async def __call__(self, sample: Sample, engine: Engine, tracer: Tracer) -> None:
        self.attempts[sample.index] += 1
        if self.attempts[sample.index] <= self.fails[sample.index]:
            await asyncio.sleep(0.01 * (1 + sample.index % 3))
            raise RuntimeError(f"crash {self.attempts[sample.index]}")
        await super().__call__(sample, engine, tracer)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=2, max_size=16),
    fails=st.lists(st.integers(0, 4), min_size=16, max_size=16),
    policy=st.sampled_from(["wait-all", "target-count"]),
    ratio=st.sampled_from([0.0, 0.25, 0.5]),
    retries=st.integers(0, 3),
)
def test_refill_ends_every_sample_once(tmp_path_factory, lengths, fails, policy, ratio, retries):
    n = len(lengths)
    pol = make_policy(CutoffConfig(policy=policy, abort_ratio=ratio), n, 1)
    rollout = Failing([[(k, 0.0)] for k in lengths], fails[:n])
    trace_dir = tmp_path_factory.mktemp("trace")
    samples = [Sample(index=i, group=i, prompt_ids=[1], seed=i) for i in range(n)]

    async def main():
        tracer = Tracer.for_step(trace_dir, 0, 0, clock=asyncio.get_running_loop().time)
        try:
            return await run_step(
                TimedEngine(0.01), samples, rollout, pol, tracer, max_retries=retries
            )
        finally:
            tracer.close()

    res = run_virtual(main())
    events = read_trace(trace_dir / "step_0" / "worker_0.jsonl")
    ended = sorted(e["extra"]["request_id"] for e in events if e["event"] in TERMINAL_EVENTS)
    assert ended == sorted(s.workid for s in res.samples)
    for s, tries, f in zip(res.samples, rollout.attempts, fails, strict=False):
        assert 1 <= tries <= retries + 1
        if s.status is Status.FAILED:
            assert tries <= f and s.error == f"RuntimeError: crash {tries}"
        elif s.status is not Status.ABORTED:
            assert tries == f + 1 and s.error is None
    assert res.retries == sum(t - 1 for t in rollout.attempts)
    failed_first = sum(
        1
        for s, f in zip(res.samples, fails, strict=False)
        if f > 0 and (s.status is Status.FAILED or rollout.attempts[s.index] > 1)
    )
    assert res.failed_before_refill == failed_first
