"""Many-worker benchmark: per-worker cut vs global cut on workers of unequal difficulty.

Worker ``r`` gets seed-gsm8k trajectories made ``d_r`` times harder (output tokens and
tool latency scaled), ``d`` spread evenly from 1 to ``max_difficulty``. Both scopes run
the same policy (target-count, or group-quota) over the same samples in one run, on
virtual time with one simulated engine per worker. For each scope the benchmark prints
kept samples per second, the multi-engine oracle for the same number of kept samples
(knowing every length, launch on each worker only the globally first finishers, wait for
them) and the ratio. With ``ray=True`` it also runs the global scope on Ray actors in real
time (scaled down) and reports the cut propagation: coordinator decision → every worker's
engine verified idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tailcut.bench.oracle import simulate
from tailcut.bench.vloop import run_result, run_virtual_result
from tailcut.bench.workloads import Trajectory, TurnSpec, get_workload, make_samples
from tailcut.config import CutoffConfig, SimEngineConfig
from tailcut.rollout.recipes import SimRecipe
from tailcut.rollout.step import StepResult
from tailcut.rollout.workers import LocalWorkers, Workers


def harder(t: Trajectory, d: float) -> Trajectory:
    turns = tuple(
        TurnSpec(max(1, round(u.output_tokens * d)), u.tool_s * d, u.tool_tokens) for u in t.turns
    )
    return Trajectory(turns, t.group, t.prompt_tokens, t.step)


def skewed_pool(
    workers: int, per_worker: int, max_difficulty: float, group_size: int, seed: int
) -> list[Trajectory]:
    base = get_workload("seed-gsm8k", seed).trajectories(0, workers * per_worker, group_size)
    out = []
    for r in range(workers):
        d = 1.0 + (max_difficulty - 1.0) * r / max(1, workers - 1)
        out += [harder(t, d) for t in base[r * per_worker : (r + 1) * per_worker]]
    return out


def multi_oracle_s(
    pool: Sequence[Trajectory],
    offsets: Sequence[int],
    k: int | Sequence[int],
    config: SimEngineConfig,
) -> float:
    """Clairvoyant makespan on independent per-worker engines, keeping ``k`` samples: the
    globally first ``k`` finishers (global cut), or ``k[r]`` on worker ``r`` (per-worker
    cut). Each worker then runs only its chosen requests; the step ends with the last."""
    ends: list[tuple[float, int]] = []
    chosen: list[int] = []
    for r in range(len(offsets) - 1):
        run = simulate(pool[offsets[r] : offsets[r + 1]], config)
        mine = [(e, offsets[r] + i) for i, e in enumerate(run.end_s)]
        if isinstance(k, int):
            ends += mine
        else:
            chosen += [i for _, i in sorted(mine)[: k[r]]]
    if isinstance(k, int):
        chosen = [i for _, i in sorted(ends)[:k]]
    chosen.sort()
    makespan = 0.0
    for r in range(len(offsets) - 1):
        subset = [pool[i] for i in chosen if offsets[r] <= i < offsets[r + 1]]
        if subset:
            makespan = max(makespan, simulate(subset, config).makespan_s)
    return makespan


@dataclass(frozen=True, slots=True)
class ScopeRow:
    scope: str
    step_time_s: float
    kept: int
    kept_per_s: float
    oracle_s: float
    ratio_to_oracle: float
    aborted: int
    wasted_tokens: int


async def _one_step(
    pool: Workers, trajectories: list[Trajectory], n_target: int, g: int
) -> StepResult:
    plan = pool.plan(n_target, g)
    if plan.n_launch != len(trajectories):
        raise ValueError(f"plan launches {plan.n_launch}, pool has {len(trajectories)}")
    try:
        return await pool.run_step(0, plan, make_samples(trajectories))
    finally:
        await pool.aclose()


def run_scopes(
    *,
    workers: int = 4,
    per_worker: int = 256,
    abort_ratio: float = 0.1,
    max_difficulty: float = 2.5,
    seed: int = 0,
    engine: SimEngineConfig | None = None,
) -> list[ScopeRow]:
    engine = engine or SimEngineConfig()
    pool = skewed_pool(workers, per_worker, max_difficulty, 1, seed)
    n = workers * per_worker
    offsets = [r * per_worker for r in range(workers + 1)]
    rows = []
    for scope in ("worker", "global"):
        cfg = CutoffConfig(policy="target-count", abort_ratio=abort_ratio, scope=scope)
        local = LocalWorkers(cfg, SimRecipe(engine), workers)
        res = run_virtual_result(_one_step(local, pool, n, 1))
        kept = len(res.kept)
        per_worker_kept = [
            sum(1 for i in res.kept if offsets[r] <= i < offsets[r + 1]) for r in range(workers)
        ]
        oracle = multi_oracle_s(
            pool, offsets, kept if scope == "global" else per_worker_kept, engine
        )
        rows.append(
            ScopeRow(
                scope=scope,
                step_time_s=res.step_time_s,
                kept=kept,
                kept_per_s=kept / res.step_time_s,
                oracle_s=oracle,
                ratio_to_oracle=res.step_time_s / oracle,
                aborted=res.aborted,
                wasted_tokens=res.wasted_tokens,
            )
        )
    return rows


def ray_propagation_ms(workers: int = 4, per_worker: int = 64, seed: int = 0) -> dict[str, Any]:
    """Global cut on Ray actors in real time; returns the measured propagation."""
    from tailcut.rollout.ray_workers import RayWorkers, init_local_ray

    scale = 0.02  # 50× faster than the reference engine: a step takes seconds
    engine = SimEngineConfig(
        decode_a_s=SimEngineConfig().decode_a_s * scale,
        decode_c_s=SimEngineConfig().decode_c_s * scale,
        prefill_s_per_token=SimEngineConfig().prefill_s_per_token * scale,
    )
    pool = [
        Trajectory(
            tuple(TurnSpec(u.output_tokens, u.tool_s * scale, u.tool_tokens) for u in t.turns),
            t.group,
            t.prompt_tokens,
        )
        for t in skewed_pool(workers, per_worker, 2.5, 1, seed)
    ]
    init_local_ray(num_cpus=max(4, workers))
    cfg = CutoffConfig(policy="target-count", abort_ratio=0.1, scope="global")

    async def main() -> StepResult:
        ray_pool = RayWorkers(cfg, SimRecipe(engine), workers)
        await ray_pool.start()
        return await _one_step(ray_pool, pool, workers * per_worker, 1)

    res = run_result(main())
    return {
        "workers": workers,
        "requests": workers * per_worker,
        "kept": len(res.kept),
        "aborted": res.aborted,
        "cut_propagation_ms": None if res.abort_to_idle_s is None else res.abort_to_idle_s * 1e3,
        "cut_to_settled_ms": None if res.cut_to_settled_s is None else res.cut_to_settled_s * 1e3,
    }
