"""The bench's own costs: results handed back without a repr, the oracle reusing a step cut
on a count, and memory that does not grow with the steps."""

from __future__ import annotations

import tracemalloc

import pytest

from tailcut.bench.oracle import oracle_s
from tailcut.bench.sim_bench import (
    BenchOptions,
    _Pools,
    build_policy,
    measure_step,
    run_sim_bench,
)
from tailcut.bench.vloop import run_result, run_virtual_result
from tailcut.bench.workloads import Trajectory, TurnSpec, get_workload
from tailcut.config import SimEngineConfig


def test_a_result_is_handed_back_without_its_repr():
    """asyncio.Runner formats its main task (result included) when it puts SIGINT back;
    a step result's repr is every sample's token arrays."""
    calls = []

    class Big:
        def __repr__(self) -> str:
            calls.append(1)
            return "Big()"

    async def make() -> Big:
        return Big()

    assert isinstance(run_virtual_result(make()), Big)
    assert isinstance(run_result(make()), Big)
    assert calls == []


@pytest.mark.parametrize("workload", ["seed-gsm8k", "skewed", "outlier"])
@pytest.mark.parametrize("policy", ["target-count", "over-provision", "group-quota"])
def test_a_step_cut_on_a_count_gives_the_oracle_of_the_uncut_run(workload, policy):
    opts = BenchOptions(requests=96, group_size=8, target_fraction=0.8)
    cfg = SimEngineConfig()
    pol = build_policy(policy, opts)
    trajs = get_workload(workload, 3).trajectories(0, pol.n_launch, opts.group_size)
    pools = _Pools(trajs, cfg)
    figs = measure_step(policy, pol, pools, 0, opts)
    assert figs.cut_time_s is not None
    assert pools._cut_runs and not pools._runs  # the uncut run was not simulated
    group_size = opts.group_size if policy == "group-quota" else None
    assert figs.oracle_s == oracle_s(trajs, figs.kept, cfg, group_size=group_size)


def test_zero_token_turns_or_free_decode_steps_simulate_the_uncut_run():
    trajs = [
        Trajectory((TurnSpec(n % 7 * 3, 0.1, 2), TurnSpec(5 + n)), group=n // 4) for n in range(40)
    ]  # some turns generate nothing: one could start and end at the cut instant
    opts = BenchOptions(requests=40, group_size=4)
    for cfg, pool in [
        (SimEngineConfig(), trajs),
        (SimEngineConfig(decode_a_s=0.0, decode_c_s=0.0, prefill_s_per_token=1e-3), trajs),
    ]:
        pol = build_policy("target-count", opts)
        pools = _Pools(pool, cfg)
        figs = measure_step("target-count", pol, pools, 0, opts)
        assert not pools._cut_runs and pools._runs
        assert figs.oracle_s == oracle_s(pool, figs.kept, cfg)


def _peak_mib(steps: int) -> tuple[float, float]:
    """Traced memory of a bench run: (peak, left after) in MiB."""
    opts = BenchOptions(
        requests=96, group_size=8, steps=steps, warmup_steps=0, overhead=False, scale_cut=0,
        policies=("wait-all", "target-count"),
    )  # fmt: skip
    wl, cfg = get_workload("seed-gsm8k"), SimEngineConfig()
    tracemalloc.start()
    try:
        report = run_sim_bench(wl, cfg, opts)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(report.steps) == steps * len(opts.policies)
    return peak / 2**20, current / 2**20


def test_memory_is_flat_across_steps():
    """A step's samples (and their token arrays) are gone when the next step starts: the
    peak is one step's, whatever the number of steps, and what is left is the figures."""
    peak_1, left_1 = _peak_mib(1)
    peak_3, left_3 = _peak_mib(3)
    assert peak_3 < 1.25 * peak_1
    assert left_3 - left_1 < 1.0  # a few StepFigures more, no samples
