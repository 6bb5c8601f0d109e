"""Length-aware scheduling in the rollout benchmark: the scheduled policies and their figures.

A scheduled policy is a cut-off policy of the registry run with shortest-predicted-first
admission (``rollout/spf.py``): ``spf+target-count`` and ``spf+over-provision`` learn
their predictions as a training run would, from the same prompts' earlier epochs (played
first, unmeasured, with the same policy: their cut-off samples teach as censored) and
from finished siblings within the step. ``spf-truth+target-count`` is a yardstick, not a
policy: the same admission told every trajectory's true remaining length, so the gap
between it and ``spf+target-count`` is what the predictor's information costs and the gap
between it and the oracle is what the mechanism itself leaves.

Figures: ``bias_length`` (mean true output length of the kept samples over that of every
launched one: below 1, the cut keeps the short ones), ``bias_reward`` (the audited reward
bias: mean reward of the kept samples minus that of every launched one, run uncut; above 0,
the cut keeps the easy ones) and ``prediction_spearman`` (rank
correlation of each trajectory's predicted remaining work at launch with its true length).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tailcut.bench.sim_step import run_policy_step
from tailcut.bench.workloads import Trajectory, Workload, WorkloadError
from tailcut.config import SimEngineConfig
from tailcut.rollout.admission import Admission
from tailcut.rollout.cutoff import CutoffPolicy
from tailcut.rollout.predict import spearman
from tailcut.rollout.spf import ShortestPredictedFirst
from tailcut.types import Sample

if TYPE_CHECKING:
    from tailcut.bench.sim_bench import BenchOptions

SCHEDULED: dict[str, tuple[str, bool]] = {
    "spf+target-count": ("target-count", False),
    "spf+over-provision": ("over-provision", False),
    "spf-truth+target-count": ("target-count", True),
}
"""Scheduled policy → (the cut-off policy it runs, told the truth)."""


def base_policy(name: str) -> str:
    """The cut-off policy a (scheduled or plain) policy name runs."""
    return SCHEDULED[name][0] if name in SCHEDULED else name


class TrueRemaining:
    """A clairvoyant predictor (the yardstick): each trajectory's true remaining output
    tokens, read from its workload trajectory."""

    def __init__(self) -> None:
        self._total: dict[int, int] = {}

    def start_step(self, samples: Sequence[Sample]) -> None:
        self._total = {}
        for s in samples:
            traj = s.data.get("trajectory")
            self._total[s.index] = traj.output_tokens if isinstance(traj, Trajectory) else 0

    def remaining(self, index: int, tokens_so_far: int = 0, turns_done: int = 0) -> float:
        return float(max(self._total.get(index, 0) - tokens_so_far, 0))

    def sibling_done(self, index: int, tokens: int) -> list[int]:
        return []

    def end_step(self, samples: Iterable[Sample]) -> None:
        return None


def make_admission(name: str, opts: BenchOptions) -> Admission | None:
    """The admission a policy name runs with (None: a plain cut-off policy)."""
    if name not in SCHEDULED:
        return None
    truth = SCHEDULED[name][1]
    if truth:  # the mechanism's ceiling: told the truth, it may hold from the start
        schedule = ShortestPredictedFirst(TrueRemaining(), margin=opts.spf_margin, need_ratio=0.0)
    else:
        schedule = ShortestPredictedFirst(margin=opts.spf_margin, need_ratio=opts.spf_need_ratio)
    return Admission(schedule)


def learns(name: str) -> bool:
    return name in SCHEDULED and not SCHEDULED[name][1]


def play_history(
    policy: CutoffPolicy,
    admission: Admission,
    workload: Workload,
    step: int,
    opts: BenchOptions,
    cfg: SimEngineConfig,
) -> int:
    """Play ``opts.warmup_steps`` earlier epochs of ``step``'s prompts (unmeasured) so the
    predictor has their history; returns how many were played (0 for a workload of one
    epoch, such as a lengths file)."""
    played = 0
    for back in range(opts.warmup_steps, 0, -1):
        try:
            trajs = workload.trajectories(step, policy.n_launch, opts.group_size, epoch=-back)
        except WorkloadError:
            return played
        run_policy_step(
            policy, trajs, cfg, abort_deadline_s=opts.abort_deadline_s, admission=admission
        )
        played += 1
    return played


def bias_length(pool: Sequence[Trajectory], kept: Iterable[int]) -> float:
    """Mean true output length of the kept samples over that of every launched one."""
    kept = list(kept)
    if not pool or not kept:
        return math.nan
    launched = sum(t.output_tokens for t in pool) / len(pool)
    mean_kept = sum(pool[i].output_tokens for i in kept) / len(kept)
    return mean_kept / launched if launched > 0 else math.nan


def bias_reward(pool: Sequence[Trajectory], kept: Iterable[int]) -> float:
    """The audited reward bias: mean reward of the kept samples minus that of every launched
    one (the same trajectories run uncut: the audit). Above 0, the cut keeps the easier
    samples; NaN where the workload carries no rewards."""
    kept = list(kept)
    if not pool or not kept or any(t.reward is None for t in pool):
        return math.nan
    launched = sum(t.reward or 0.0 for t in pool) / len(pool)
    return sum(pool[i].reward or 0.0 for i in kept) / len(kept) - launched


def prediction_spearman(admission: Admission, pool: Sequence[Trajectory]) -> float:
    """Rank correlation of the predictions at launch with the true lengths."""
    first = admission.schedule.first_prediction
    if len(first) != len(pool):
        return math.nan
    return spearman([first[i] for i in range(len(pool))], [t.output_tokens for t in pool])
