"""The rollout benchmark on the simulated engine: every cut-off policy, one run, one table.

For each measured step the same workload trajectories are played through
:func:`tailcut.rollout.scheduler.run_step` once per policy, each on a fresh
:class:`SimEngine` and a fresh virtual-time loop (so step times are exact and independent
of the machine), and compared with the clairvoyant schedule and the analytic bound of
:mod:`tailcut.bench.oracle`. Real-time figures (``abort_to_idle_ms``,
``cut_to_settled_ms``, ``overhead_us_per_request``) are ``perf_counter`` time of the code
under test (see :mod:`tailcut.bench.sim_step`).

A learning policy (``deadline``) first runs ``warmup_steps`` unmeasured steps of the same
workload so it has a history, as it would in a training run; a scheduled one
(``spf+...``, ``bench/scheduled.py``) plays ``warmup_steps`` earlier epochs of each
measured step's prompts first, so its predictor has their history. Scheduled runs are
measured against the same oracle as their cut-off policy.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tailcut.bench.oracle import (
    SimRun,
    bound_s,
    first_finishers,
    kept_makespan_s,
    oracle_s,
    simulate,
)
from tailcut.bench.scheduled import (
    SCHEDULED,
    base_policy,
    bias_length,
    bias_reward,
    learns,
    make_admission,
    play_history,
    prediction_spearman,
)
from tailcut.bench.sim_step import ScaleCut, overhead_us_per_request, run_policy_step, scale_cut
from tailcut.bench.workloads import REFERENCE, Trajectory, Workload
from tailcut.config import OVER_PROVISION_MAX, CutoffConfig, SimEngineConfig
from tailcut.rollout.admission import Admission
from tailcut.rollout.cutoff import POLICIES, CutoffPolicy, make_policy
from tailcut.rollout.step import StepResult
from tailcut.types import FINISHED

POLICY_NAMES = (*POLICIES, *SCHEDULED)
"""Every registered cut-off policy, in registry order, then the scheduled ones
(``bench/scheduled.py``: a cut-off policy with shortest-predicted-first admission)."""
WARMUP_STEP_BASE = 1_000_000
"""Warm-up steps draw workload steps from here on, apart from the measured ones."""


@dataclass(frozen=True)
class BenchOptions:
    requests: int = 1024
    """N: samples the step wants (target-count launches N and keeps int(N·F))."""
    target_fraction: float = 0.9
    """F: kept / launched. target-count uses r = 1 − F; over-provision and group-quota
    launch N / F (rounded up) to keep N."""
    steps: int = 1
    group_size: int = 16
    warmup_steps: int = 2
    policies: tuple[str, ...] = POLICY_NAMES
    trace_dir: Path | None = None
    overhead: bool = True
    """Measure ``overhead_us_per_request`` (one extra zero-latency step per policy)."""
    abort_deadline_s: float = 5.0
    scale_cut: int = 10_240
    """Also cut a step with this many requests in flight (0: skip)."""
    scale_cut_at_s: float = 2.0
    """When (virtual s) that step is cut: early, while every request is still running."""
    spf_margin: float = 0.05
    """Scheduled policies: trajectories allowed beyond those still needed, as a fraction
    of the over-sample (``rollout/spf.py``)."""
    spf_need_ratio: float = 1.0
    """Scheduled policies: ... and at least this many times those still needed."""


@dataclass
class StepFigures:
    policy: str
    step: int
    launched: int
    kept: int
    step_time_s: float
    cut_time_s: float | None
    kth_completion_s: float
    oracle_s: float
    bound_s: float
    completed: int
    aborted: int
    failed: int
    wasted_tokens: int
    engine_wasted_tokens: int
    tokens_after_abort: int
    abort_to_idle_ms: float | None
    cut_to_settled_ms: float | None
    abort_rounds: int
    bias_length: float = math.nan
    bias_reward: float = math.nan
    prediction_spearman: float = math.nan
    held_calls: int = 0


@dataclass
class PolicyRow:
    policy: str
    step_time_s: float
    oracle_s: float
    ratio_to_oracle: float
    kth_completion_s: float
    samples_per_s: float
    speedup_vs_wait_all: float | None
    completed: int
    aborted: int
    failed: int
    wasted_tokens: int
    abort_to_idle_ms: float | None
    cut_to_settled_ms: float | None
    overhead_us_per_request: float | None
    bound_s: float
    launched: int
    kept: int
    bias_length: float = math.nan
    """Mean true output length of kept samples over that of all launched ones."""
    bias_reward: float = math.nan
    """The audited reward bias: mean reward of kept samples minus that of all launched ones
    run uncut (the same trajectories; NaN: the workload has no rewards)."""
    prediction_spearman: float = math.nan
    """Scheduled policies: rank correlation of predictions at launch with the truth."""
    held_calls: int = 0
    """Scheduled policies: engine calls held back by the schedule."""


@dataclass
class BenchReport:
    workload: str
    options: dict[str, Any]
    engine: dict[str, Any]
    rows: list[PolicyRow]
    steps: list[StepFigures]
    calibration: dict[str, Any] = field(default_factory=dict)
    scale_cut: ScaleCut | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------ one step


def cutoff_config(policy: str, target_fraction: float) -> CutoffConfig:
    """The config keeping the share ``F`` of a step: over-provision and group-quota launch
    N/F to keep N (at most 5× N, so F ≥ 0.2), the others launch N and keep N·F."""
    if policy not in ("over-provision", "group-quota"):
        return CutoffConfig(policy=policy, abort_ratio=1.0 - target_fraction)
    over = 1.0 / target_fraction - 1.0
    if over > OVER_PROVISION_MAX:
        raise ValueError(
            f"target fraction F={target_fraction:g}: {policy} would launch "
            f"{1.0 / target_fraction:.3g}× the requests it keeps; it launches at most "
            f"{1.0 + OVER_PROVISION_MAX:g}× (F ≥ {1.0 / (1.0 + OVER_PROVISION_MAX):g}); "
            "raise --target-fraction or leave this policy out (--policy)"
        )
    return CutoffConfig(policy=policy, abort_ratio=1.0 - target_fraction, over_provision=over)


def build_policy(name: str, opts: BenchOptions) -> CutoffPolicy:
    n = opts.requests
    name = base_policy(name)
    if name == "group-quota":
        n = max(opts.group_size, n - n % opts.group_size)
    return make_policy(cutoff_config(name, opts.target_fraction), n, opts.group_size)


# ------------------------------------------------------------------ the bench


class _Pools:
    """The launched pools of one step and their uncut runs (for the oracle's ordering).

    The oracle keeps the ``k`` requests of a pool that finish first when nothing is cut.
    An uncut step of a pool is its uncut run itself. A step cut on a count (``target``:
    the k-th usable sample ended) is the uncut run up to the cut: until then nothing
    differed (the policy only counts), every request that ends by the cut instant has
    ended (those resolved at the k-th one's step boundary end as usable, the cut does not
    stop them), and the cut comes exactly when ``k`` have. Its known ends order the first
    finishers as the uncut run would, so that run is not simulated again. It is used only
    where that holds: no failure, every generation takes time (a zero-token turn or a
    zero-cost decode step could start and end at the cut instant itself, and the cut would
    refuse it), and the chosen requests all ended by the cut; anything else is simulated,
    as before."""

    def __init__(self, trajectories: Sequence[Trajectory], engine_cfg: SimEngineConfig):
        self.trajectories = trajectories
        self.engine_cfg = engine_cfg
        self._runs: dict[int, SimRun] = {}
        self._cut_runs: dict[int, SimRun] = {}
        """Pool size → its ends up to a count cut (inf for requests that had not ended)."""

    def record(self, n: int, result: StepResult) -> None:
        """Keep what an uncut step, or a step cut on a count, says about the uncut run."""
        if result.failed:
            return
        t0 = min((s.launched_at or 0.0 for s in result.samples), default=0.0)
        turns = [len(s.turns) for s in result.samples]
        if result.cut_time_s is None:
            if n not in self._runs:
                self._runs[n] = SimRun([(s.ended_at or t0) - t0 for s in result.samples], turns)
        elif result.cut_reason == "target" and n not in self._cut_runs and self._prefix_holds(n):
            cut, ends = result.cut_time_s, []
            for s in result.samples:
                end = math.inf if s.ended_at is None else s.ended_at - t0
                ends.append(end if s.status in FINISHED and end <= cut else math.inf)
            self._cut_runs[n] = SimRun(ends, turns)

    def _prefix_holds(self, n: int) -> bool:
        """Every generation takes time: none can start and end at the cut instant."""
        cfg = self.engine_cfg
        if cfg.decode_a_s + cfg.decode_c_s <= 0:
            return False
        return all(u.output_tokens > 0 for t in self.trajectories[:n] for u in t.turns)

    def uncut(self, n: int) -> SimRun:
        if n not in self._runs:
            self._runs[n] = simulate(self.trajectories[:n], self.engine_cfg)
        return self._runs[n]

    def oracle_s(self, n: int, k: int, group_size: int | None) -> float:
        """:func:`oracle_s` of keeping ``k`` of the first ``n`` trajectories."""
        pool = self.trajectories[:n]
        cut = self._cut_runs.get(n)
        if n not in self._runs and cut is not None and 0 < k < n:
            chosen = first_finishers(cut, [t.group for t in pool], k, group_size)
            if chosen and all(cut.end_s[i] < math.inf for i in chosen):
                return kept_makespan_s(pool, chosen, self.engine_cfg)
        return oracle_s(pool, k, self.engine_cfg, uncut=self.uncut(n), group_size=group_size)


def measure_step(
    name: str,
    policy: CutoffPolicy,
    pools: _Pools,
    step: int,
    opts: BenchOptions,
    admission: Admission | None = None,
) -> StepFigures:
    pool = list(pools.trajectories[: policy.n_launch])
    run_dir = None if opts.trace_dir is None else Path(opts.trace_dir) / name
    res, engine_wasted, after_abort = run_policy_step(
        policy,
        pool,
        pools.engine_cfg,
        run_dir=run_dir,
        step=step,
        abort_deadline_s=opts.abort_deadline_s,
        admission=admission,
    )
    if admission is None:  # a held request changes the run before the cut: no uncut prefix
        pools.record(len(pool), res)
    figs = _step_figures(name, step, res, engine_wasted, after_abort)
    figs.bias_length = bias_length(pool, res.kept)
    figs.bias_reward = bias_reward(pool, res.kept)
    if admission is not None:
        figs.held_calls = admission.held_calls
        figs.prediction_spearman = prediction_spearman(admission, pool)
    del res  # the step's samples and token arrays go before the oracle's simulations run
    group_size = opts.group_size if name == "group-quota" else None
    figs.oracle_s = pools.oracle_s(len(pool), figs.kept, group_size)
    figs.bound_s = bound_s(pool, figs.kept, pools.engine_cfg)
    return figs


def _step_figures(
    name: str, step: int, res: StepResult, engine_wasted: int, after_abort: int
) -> StepFigures:
    """A step's figures from its result (the yardsticks, ``oracle_s`` and ``bound_s``,
    are filled in by the caller)."""
    kept = res.kept
    t0 = min((s.launched_at for s in res.samples if s.launched_at is not None), default=0.0)
    kth = max(((res.samples[i].ended_at or t0) - t0 for i in kept), default=0.0)
    return StepFigures(
        policy=name,
        step=step,
        launched=len(res.samples),
        kept=len(kept),
        step_time_s=res.step_time_s,
        cut_time_s=res.cut_time_s,
        kth_completion_s=kth,
        oracle_s=math.nan,
        bound_s=math.nan,
        completed=res.completed,
        aborted=res.aborted,
        failed=res.failed,
        wasted_tokens=res.wasted_tokens,
        engine_wasted_tokens=engine_wasted,
        tokens_after_abort=after_abort,
        abort_to_idle_ms=None if res.abort_to_idle_s is None else res.abort_to_idle_s * 1e3,
        cut_to_settled_ms=None if res.cut_to_settled_s is None else res.cut_to_settled_s * 1e3,
        abort_rounds=res.abort_rounds,
    )


def _scale_cut(workload: Workload, engine_cfg: SimEngineConfig, opts: BenchOptions) -> ScaleCut:
    return scale_cut(
        workload.trajectories(0, opts.scale_cut, opts.group_size),
        engine_cfg,
        group_size=opts.group_size,
        cut_at_s=opts.scale_cut_at_s,
        abort_deadline_s=opts.abort_deadline_s,
    )


def _warm_up(
    policy: CutoffPolicy, workload: Workload, opts: BenchOptions, cfg: SimEngineConfig
) -> None:
    for w in range(opts.warmup_steps):
        trajs = workload.trajectories(WARMUP_STEP_BASE + w, policy.n_launch, opts.group_size)
        run_policy_step(policy, trajs, cfg, abort_deadline_s=opts.abort_deadline_s)


def _max_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def aggregate(name: str, figs: Sequence[StepFigures], overhead: float | None) -> PolicyRow:
    total = sum(f.step_time_s for f in figs)
    oracle = sum(f.oracle_s for f in figs)
    kept = sum(f.kept for f in figs)
    n = len(figs)
    return PolicyRow(
        policy=name,
        step_time_s=total / n,
        oracle_s=oracle / n,
        ratio_to_oracle=total / oracle if oracle > 0 else float("nan"),
        kth_completion_s=sum(f.kth_completion_s for f in figs) / n,
        samples_per_s=kept / total if total > 0 else float("inf"),
        speedup_vs_wait_all=None,
        completed=sum(f.completed for f in figs),
        aborted=sum(f.aborted for f in figs),
        failed=sum(f.failed for f in figs),
        wasted_tokens=sum(f.wasted_tokens for f in figs),
        abort_to_idle_ms=_max_or_none([f.abort_to_idle_ms for f in figs]),
        cut_to_settled_ms=_max_or_none([f.cut_to_settled_ms for f in figs]),
        overhead_us_per_request=overhead,
        bound_s=sum(f.bound_s for f in figs) / n,
        launched=sum(f.launched for f in figs),
        kept=kept,
        bias_length=sum(f.bias_length for f in figs) / n,
        bias_reward=sum(f.bias_reward for f in figs) / n,
        prediction_spearman=sum(f.prediction_spearman for f in figs) / n,
        held_calls=sum(f.held_calls for f in figs),
    )


def calibration(run: SimRun) -> dict[str, Any]:
    """Durations of the uncut run beside the reference figures."""
    d = np.asarray(run.end_s, dtype=float)
    turns = np.asarray(run.turns)
    ours: dict[str, Any] = {
        "mean_s": float(d.mean()),
        "p50_s": float(np.percentile(d, 50)),
        "p90_s": float(np.percentile(d, 90)),
        "p99_s": float(np.percentile(d, 99)),
        "max_s": float(d.max()),
        "two_turn_share": float((turns == 2).mean()),
        "turn_mix": {int(k): float((turns == k).mean()) for k in sorted(set(turns.tolist()))},
        "mean_s_by_turns": {
            int(k): float(d[turns == k].mean()) for k in sorted(set(turns.tolist()))
        },
    }
    return {"ours": ours, "reference": REFERENCE, "requests": len(d)}


def run_sim_bench(
    workload: Workload, engine_cfg: SimEngineConfig, opts: BenchOptions
) -> BenchReport:
    unknown = set(opts.policies) - set(POLICY_NAMES)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICY_NAMES)}")
    policies = {name: build_policy(name, opts) for name in opts.policies}
    admissions = {name: make_admission(name, opts) for name in opts.policies}
    for name, policy in policies.items():
        if name == "deadline":
            _warm_up(policy, workload, opts, engine_cfg)
    widest = max(p.n_launch for p in policies.values())
    figs: dict[str, list[StepFigures]] = {name: [] for name in policies}
    calib: dict[str, Any] = {}
    first_trajs: list[Trajectory] = []
    for step in range(opts.steps):
        trajs = workload.trajectories(step, widest, opts.group_size)
        pools = _Pools(trajs, engine_cfg)
        for name, policy in policies.items():
            admission = admissions[name]
            if admission is not None and learns(name):
                play_history(policy, admission, workload, step, opts, engine_cfg)
            figs[name].append(measure_step(name, policy, pools, step, opts, admission))
        if step == 0:
            calib = calibration(pools.uncut(opts.requests))
            first_trajs = trajs
    rows = []
    for name in policies:
        overhead = (
            overhead_us_per_request(build_policy(name, opts), first_trajs)
            if opts.overhead and name not in SCHEDULED  # measured without the admission
            else None
        )
        rows.append(aggregate(name, figs[name], overhead))
    base = next((r for r in rows if r.policy == "wait-all"), None)
    if base is not None and base.samples_per_s > 0:
        for r in rows:
            r.speedup_vs_wait_all = r.samples_per_s / base.samples_per_s
    return BenchReport(
        scale_cut=_scale_cut(workload, engine_cfg, opts) if opts.scale_cut else None,
        workload=workload.name,
        options={k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        engine=engine_cfg.model_dump(),
        rows=rows,
        steps=[f for name in policies for f in figs[name]],
        calibration=calib,
    )


def step_time_spread(figs: Sequence[StepFigures]) -> float:
    """The longest step of one policy over the median of its other steps (how much an
    outlier step costs against the normal ones)."""
    times = sorted(f.step_time_s for f in figs)
    if len(times) < 2:
        return float("nan")
    med = statistics.median(times[:-1])
    return times[-1] / med if med > 0 else float("nan")
