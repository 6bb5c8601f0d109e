"""Hypothesis: whatever the lengths, tools and policy, every request ends exactly once,
launch order is kept, nothing is left pending or in flight, and wasted tokens are the sum
of the aborted partial outputs."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from fakes.timed_engine import TimedEngine
from fakes.turns_rollout import TurnsRollout
from tailcut.config import CutoffConfig
from tailcut.rollout.cutoff import make_policy
from tailcut.rollout.scheduler import run_step
from tailcut.trace.events import TERMINAL_EVENTS, EventKind, Tracer, read_trace
from tailcut.types import Sample, Status
from tailcut.vtime import run_virtual

turn = st.tuples(st.integers(1, 60), st.sampled_from([0.0, 0.05, 0.3]))
script = st.lists(turn, min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(
    scripts=st.lists(script, min_size=2, max_size=24),
    policy=st.sampled_from(["wait-all", "target-count", "over-provision", "deadline"]),
    ratio=st.sampled_from([0.0, 0.1, 0.3, 0.5]),
    fail=st.sets(st.integers(0, 30), max_size=3),
)
def test_every_request_ends_exactly_once(tmp_path_factory, scripts, policy, ratio, fail):
    cfg = CutoffConfig(
        policy=policy, abort_ratio=ratio, over_provision=ratio, deadline_s=0.2, min_fraction=0.5
    )
    n_target = (
        len(scripts) if policy != "over-provision" else max(1, int(len(scripts) / (1 + ratio)))
    )
    pol = make_policy(cfg, n_target, 1)
    scripts = scripts[: pol.n_launch] + [scripts[0]] * (pol.n_launch - len(scripts))
    engine = TimedEngine(0.01)
    run_dir = tmp_path_factory.mktemp("trace")

    async def main():
        loop = asyncio.get_running_loop()
        with Tracer.for_step(run_dir, 0, 0, clock=loop.time) as tracer:
            samples = [Sample(index=i, prompt_ids=[1]) for i in range(pol.n_launch)]
            res = await run_step(engine, samples, TurnsRollout(scripts, fail), pol, tracer)
            current = asyncio.current_task()
            assert [t for t in asyncio.all_tasks() if t is not current] == []
            return res

    res = run_virtual(main())
    assert [s.index for s in res.samples] == list(range(pol.n_launch))
    assert all(s.status in {Status.COMPLETED, Status.ABORTED, Status.FAILED} for s in res.samples)
    assert engine.running == {}
    assert res.wasted_tokens == sum(
        s.generated_tokens for s in res.samples if s.status is Status.ABORTED
    )
    assert sum(res.counts.values()) == pol.n_launch
    assert set(res.kept) <= {s.index for s in res.samples if s.status is Status.COMPLETED}
    events = read_trace(run_dir / "step_0" / "worker_0.jsonl")
    terminal = [e["extra"]["request_id"] for e in events if e["event"] in TERMINAL_EVENTS]
    assert sorted(terminal) == sorted(s.workid for s in res.samples)
    starts = [e for e in events if e["event"] == EventKind.REQUEST_START]
    assert len(starts) == pol.n_launch
