"""The rollout step pauses the cyclic garbage collector and collects once at its end."""

from __future__ import annotations

import gc
import weakref

from tailcut.bench.workloads import Trajectory, TurnSpec, make_samples
from tailcut.config import SimEngineConfig
from tailcut.engine.sim import SimEngine
from tailcut.rollout.cutoff import WaitAll
from tailcut.rollout.gc_pause import gc_paused
from tailcut.rollout.scheduler import run_step
from tailcut.rollout.scripted import ScriptedRollout
from tailcut.trace.events import NULL_TRACER
from tailcut.vtime import run_virtual


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_pause_nests_and_collects_the_cycles_made_inside_when_the_last_block_ends():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            cycle = weakref.ref(_Cycle())  # garbage only the cyclic collector can free
        assert not gc.isenabled() and cycle() is not None  # the outer block still pauses
    assert gc.isenabled() and cycle() is None


def test_a_collector_the_program_disabled_stays_disabled_and_off_means_untouched():
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with gc_paused(False):
        assert gc.isenabled()


class _Watching(ScriptedRollout):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    async def __call__(self, sample, engine, tracer):  # type: ignore[no-untyped-def]
        self.seen.append(gc.isenabled())
        await super().__call__(sample, engine, tracer)


def _step(gc_pause: bool) -> list[bool]:
    rollout = _Watching()
    samples = make_samples([Trajectory((TurnSpec(5, 0.1, 2), TurnSpec(3)))] * 4)
    engine = SimEngine(SimEngineConfig(decode_a_s=0.01, decode_c_s=0.0))
    run_virtual(run_step(engine, samples, rollout, WaitAll(4), NULL_TRACER, gc_pause=gc_pause))
    return rollout.seen


def test_the_step_runs_with_the_collector_paused_unless_told_not_to():
    assert _step(gc_pause=True) == [False] * 4 and gc.isenabled()
    assert _step(gc_pause=False) == [True] * 4 and gc.isenabled()
