"""The yardsticks of the rollout benchmark: uncut simulation, clairvoyant schedule, bound.

* :func:`simulate` plays trajectories through a fresh :class:`SimEngine` on a fresh
  virtual-time loop, all launched at t=0, and waits for every one (no cut).
* :func:`oracle_s` is the clairvoyant schedule for keeping ``K`` samples: knowing every
  length in advance, launch only the ``K`` requests that finish first (their order in the
  uncut run of the same pool) and wait for them — simulated, not estimated. For a policy
  that keeps whole GRPO groups, the oracle keeps the groups whose last member finishes
  first.
* :func:`bound_s` is an analytic lower bound on any schedule that completes ``K`` of the
  pool: ``max(C(K), Σ_{i≤K} L(i) / Θ_peak)`` with ``C(K)`` the ``K``-th smallest critical
  path of a request alone (every decode step at ``τ_min = a + c``, its own prefill, its
  tool latency), ``L(i)`` the ``i``-th smallest total output length and
  ``Θ_peak = K / τ(K)`` the engine's best token throughput with at most ``K`` running.
  Any set of ``K`` requests contains one whose critical path is at least ``C(K)`` and
  has at least ``Σ_{i≤K} L(i)`` tokens to generate, so ``bound_s ≤ oracle_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from tailcut.bench.vloop import run_virtual_result
from tailcut.bench.workloads import Trajectory, make_samples
from tailcut.config import SimEngineConfig
from tailcut.engine.sim import SimEngine
from tailcut.rollout.gc_pause import gc_paused
from tailcut.rollout.scripted import ScriptedRollout
from tailcut.trace.events import NULL_TRACER
from tailcut.types import Sample


@dataclass(frozen=True, slots=True)
class SimRun:
    end_s: list[float]
    """Completion time of each trajectory, in input order (seconds from launch)."""
    turns: list[int]

    @property
    def makespan_s(self) -> float:
        return max(self.end_s, default=0.0)

    def order(self) -> list[int]:
        """Input positions by completion time (ties by position)."""
        return sorted(range(len(self.end_s)), key=lambda i: (self.end_s[i], i))


async def simulate_async(trajectories: Sequence[Trajectory], config: SimEngineConfig) -> SimRun:
    """Run every trajectory on a fresh engine at once and wait for all (current loop).

    Only each trajectory's end time and turn count are kept: a sample (and its token
    arrays) is dropped as soon as it ends, so memory follows the requests in flight. The
    cyclic collector is paused as in a rollout step (``rollout/gc_pause.py``)."""
    engine = SimEngine(config)
    rollout = ScriptedRollout()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    ends = [0.0] * len(trajectories)
    turns = [0] * len(trajectories)

    async def one(i: int, sample: Sample) -> None:
        await rollout(sample, engine, NULL_TRACER)
        ends[i] = loop.time() - t0
        turns[i] = len(sample.turns)

    with gc_paused():
        async with asyncio.TaskGroup() as tg:
            for i, sample in enumerate(make_samples(trajectories)):
                tg.create_task(one(i, sample))
        await engine.aclose()
    return SimRun(ends, turns)


def simulate(trajectories: Sequence[Trajectory], config: SimEngineConfig) -> SimRun:
    """:func:`simulate_async` on its own virtual-time loop."""
    return run_virtual_result(simulate_async(trajectories, config))


def first_finishers(
    uncut: SimRun, groups: Sequence[int], k: int, group_size: int | None = None
) -> list[int]:
    """Positions of the ``k`` requests (or ``k // group_size`` whole groups) that finish
    first in ``uncut``."""
    if group_size is None or group_size <= 1:
        return sorted(uncut.order()[:k])
    group_end: dict[int, float] = {}
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        group_end[g] = max(group_end.get(g, 0.0), uncut.end_s[i])
        members.setdefault(g, []).append(i)
    full = [g for g in members if len(members[g]) == group_size]
    chosen = sorted(full, key=lambda g: (group_end[g], g))[: k // group_size]
    return sorted(i for g in chosen for i in members[g])


def oracle_s(
    pool: Sequence[Trajectory],
    k: int,
    config: SimEngineConfig,
    *,
    uncut: SimRun | None = None,
    group_size: int | None = None,
) -> float:
    """Makespan of the clairvoyant schedule that keeps ``k`` samples of ``pool``."""
    if k <= 0:
        return 0.0
    uncut = uncut if uncut is not None else simulate(pool, config)
    if k >= len(pool):
        return uncut.makespan_s
    return kept_makespan_s(
        pool, first_finishers(uncut, [t.group for t in pool], k, group_size), config
    )


def kept_makespan_s(
    pool: Sequence[Trajectory], chosen: Sequence[int], config: SimEngineConfig
) -> float:
    """Makespan of launching only ``pool[i]`` for ``i`` in ``chosen`` (the clairvoyant run)."""
    return simulate([pool[i] for i in chosen], config).makespan_s


def critical_path_s(t: Trajectory, config: SimEngineConfig) -> float:
    """Seconds ``t`` needs alone: each turn's prefill and tokens at τ_min, plus its tools."""
    tau_min = config.decode_a_s + config.decode_c_s
    context = t.prompt_tokens
    total = 0.0
    for turn in t.turns:
        total += config.prefill_s_per_token * context + turn.output_tokens * tau_min
        total += turn.tool_s
        context += turn.output_tokens + turn.tool_tokens
    return total


def bound_s(pool: Sequence[Trajectory], k: int, config: SimEngineConfig) -> float:
    """Analytic lower bound on the time to complete any ``k`` requests of ``pool``."""
    if k <= 0 or not pool:
        return 0.0
    k = min(k, len(pool))
    paths = sorted(critical_path_s(t, config) for t in pool)
    lengths = sorted(t.output_tokens for t in pool)
    step_at_k = config.decode_a_s + config.decode_c_s * k
    throughput_term = sum(lengths[:k]) * step_at_k / k
    return max(paths[k - 1], throughput_term)
