"""Per-step metrics: the three training-reward estimators, their audited bias, rollout figures,
the batch, the partial-rollout buffer, timing shares and validation. Every metric dictionary
the trainer logs is built here.

Pure and torch-free. Why three reward estimators: a cut step has no reward for its aborted
samples, and those are not a random subset (they are the slow, long, often hard ones).

* ``reward/completed_mean``  — mean over finished samples (COMPLETED + TRUNCATED) only;
  biased towards easy/short trajectories (usually upwards).
* ``reward/all_zero_filled`` — aborted samples counted as reward 0; biased downwards.
* ``reward/group_imputed``   — an aborted sample gets the mean reward of the finished members
  of its own group (its prompt), or ``completed_mean`` when none of its group finished.

FAILED samples are errors, not data: they are excluded from all three (and counted).
On an audit step (``cutoff.audit_every``) the step runs uncut, so its plain mean is the truth
(``reward/audit_mean``); :func:`audit_bias` replays the cut on it (the earliest finishers are
kept, the rest treated as aborted) and reports ``estimator − truth`` for each estimator.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from tailcut.algo.advantage import AdvantageResult
from tailcut.algo.batch import TrainBatch
from tailcut.algo.filter import FilterResult
from tailcut.types import FINISHED, Sample, Status


class StepLike(Protocol):
    """The parts of the scheduler's step result that metrics read."""

    @property
    def samples(self) -> list[Sample]: ...

    @property
    def step_time_s(self) -> float: ...

    @property
    def cut_time_s(self) -> float | None: ...


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs) if xs else 0.0


def _reward(s: Sample) -> float:
    return float(s.reward) if s.reward is not None else 0.0


@dataclass(frozen=True, slots=True)
class RewardEstimates:
    completed_mean: float
    all_zero_filled: float
    group_imputed: float
    n_finished: int
    n_aborted: int

    def as_metrics(self) -> dict[str, float]:
        return {
            "reward/completed_mean": self.completed_mean,
            "reward/all_zero_filled": self.all_zero_filled,
            "reward/group_imputed": self.group_imputed,
        }


def estimate_rewards(
    samples: Sequence[Sample], aborted: Sequence[bool] | None = None
) -> RewardEstimates:
    """The three estimators over one step's samples.

    ``aborted`` overrides which samples count as aborted (used to replay a cut on an uncut
    audit step); by default a sample is aborted when its status is ABORTED.
    """
    if aborted is None:
        aborted = [s.status is Status.ABORTED for s in samples]
    done: list[Sample] = []
    cut: list[Sample] = []
    for s, a in zip(samples, aborted, strict=True):
        if a:
            cut.append(s)
        elif s.status in FINISHED:
            done.append(s)
    done_r = [_reward(s) for s in done]
    completed = _mean(done_r)
    total = len(done) + len(cut)
    zero_filled = math.fsum(done_r) / total if total else 0.0
    by_group: dict[int, list[float]] = {}
    for s, r in zip(done, done_r, strict=True):
        by_group.setdefault(s.group, []).append(r)
    imputed = [_mean(by_group[s.group]) if s.group in by_group else completed for s in cut]
    group_imputed = (math.fsum(done_r) + math.fsum(imputed)) / total if total else 0.0
    return RewardEstimates(completed, zero_filled, group_imputed, len(done), len(cut))


def audit_bias(samples: Sequence[Sample], n_keep: int) -> dict[str, float]:
    """On an uncut step: the truth, and each estimator's bias had the step kept ``n_keep``.

    The counterfactual keeps the ``n_keep`` earliest finishers (by ``ended_at``) and treats
    every other finished sample as aborted.
    """
    finished = [s for s in samples if s.status in FINISHED]
    truth = _mean([_reward(s) for s in finished])
    order = sorted(finished, key=lambda s: (s.ended_at if s.ended_at is not None else 0.0, s.index))
    late = {s.index for s in order[max(0, n_keep) :]}
    est = estimate_rewards(finished, [s.index in late for s in finished])
    out = {"reward/audit_mean": truth}
    for key, value in est.as_metrics().items():
        out[f"bias/{key.removeprefix('reward/')}"] = value - truth
    return out


@dataclass(frozen=True, slots=True)
class Work:
    """What a trajectory's turns add up to: sampled tokens, tool calls and errors, engine
    and tool seconds."""

    tokens: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    engine_s: float = 0.0
    tool_s: float = 0.0

    @classmethod
    def of(cls, s: Sample) -> Work:
        return cls(
            s.generated_tokens,
            sum(t.tool_calls for t in s.turns),
            sum(t.tool_errors for t in s.turns),
            math.fsum(t.engine_s for t in s.turns),
            math.fsum(t.tool_s for t in s.turns),
        )

    def __sub__(self, other: Work) -> Work:
        return Work(
            self.tokens - other.tokens, self.tool_calls - other.tool_calls,
            self.tool_errors - other.tool_errors, self.engine_s - other.engine_s,
            self.tool_s - other.tool_s,
        )  # fmt: skip


NO_WORK = Work()


def carried_work(samples: Sequence[Sample]) -> dict[int, Work]:
    """The work resumed trajectories bring into a step (done in earlier steps), by index:
    taken at launch, so that the step's figures count only its own."""
    return {s.index: Work.of(s) for s in samples if s.resumed_from_step is not None}


def rollout_metrics(
    step: StepLike, n_keep_audit: int | None = None, carried: Mapping[int, Work] | None = None
) -> dict[str, float]:
    """Rollout figures of one step (see the trainer's metric list), its three training-reward
    estimates, and on an audit step (``n_keep_audit``: what the policy would have kept) the
    estimated speed-up and each estimator's bias. ``carried``: the work resumed trajectories
    had done before the step (:func:`carried_work`), left out of its tokens, tool calls and
    seconds; ``rollout/wasted_tokens`` is what the step sampled for the trajectories it cut
    (resumed later under ``cutoff.aborted=partial``, unless they expire:
    ``partial/expired_tokens``)."""
    samples = step.samples
    carried = carried or {}
    work = [Work.of(s) - carried.get(s.index, NO_WORK) for s in samples]
    n = len(samples)
    status_count = dict.fromkeys(Status, 0)
    for s in samples:
        status_count[s.status] += 1
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    complete_groups = sum(all(m.status in FINISHED for m in g) for g in groups.values())
    member_frac = _mean([sum(m.status in FINISHED for m in g) / len(g) for g in groups.values()])
    turns = [len(s.turns) for s in samples if s.status in FINISHED]
    engine_s = math.fsum(w.engine_s for w in work)
    tool_s = math.fsum(w.tool_s for w in work)
    wasted = sum(w.tokens for s, w in zip(samples, work, strict=True) if s.status is Status.ABORTED)
    out = {
        "rollout/launched": float(n),
        "rollout/completed": float(status_count[Status.COMPLETED]),
        "rollout/truncated": float(status_count[Status.TRUNCATED]),
        "rollout/aborted": float(status_count[Status.ABORTED]),
        "rollout/failed": float(status_count[Status.FAILED]),
        "rollout/aborted_ratio": status_count[Status.ABORTED] / n if n else 0.0,
        "rollout/wasted_tokens": float(wasted),
        "rollout/step_time_s": step.step_time_s,
        "rollout/group_complete_frac": complete_groups / len(groups) if groups else 0.0,
        "rollout/group_member_frac": member_frac,
        "rollout/turns_mean": _mean(turns),
        "rollout/tool_calls": float(sum(w.tool_calls for w in work)),
        "rollout/tool_errors": float(sum(w.tool_errors for w in work)),
        "rollout/generated_tokens": float(sum(w.tokens for w in work)),
        "rollout/engine_s_sum": engine_s,
        "rollout/tool_s_sum": tool_s,
        "rollout/generation_share": engine_s / (engine_s + tool_s) if engine_s + tool_s else 0.0,
    }
    retries, recovered = getattr(step, "retries", 0), getattr(step, "recovered", 0)
    out["rollout/retries"] = float(retries)
    out["rollout/refilled"] = float(recovered)
    out["rollout/failed_before_refill"] = float(status_count[Status.FAILED] + recovered)
    if step.cut_time_s is not None:
        out["rollout/cut_time_s"] = step.cut_time_s
    if n_keep_audit is not None:
        out["rollout/speedup_est"] = speedup_estimate(samples, n_keep_audit, step.step_time_s)
        out.update(audit_bias(samples, n_keep_audit))
    out.update(estimate_rewards(samples).as_metrics())
    out.update(reward_info_metrics(samples))
    return out


def reward_info_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """``reward/<key>_mean`` for each figure the reward functions put in ``reward_info``
    (``acc``, ``tool/<name>``, ``overlong_penalty``, ``overlong_penalized``: the fraction
    penalized): its mean over the finished samples that carry it."""
    values: dict[str, list[float]] = {}
    for s in samples:
        if s.status in FINISHED:
            for key, value in s.reward_info.items():
                values.setdefault(key, []).append(float(value))
    return {f"reward/{key}_mean": _mean(v) for key, v in sorted(values.items())}


def speedup_estimate(samples: Sequence[Sample], n_keep: int, wait_all_s: float) -> float:
    """On an uncut step: its wait-all time over the time its ``n_keep``-th finisher ended."""
    starts = [s.launched_at for s in samples if s.launched_at is not None]
    ends = sorted(s.ended_at for s in samples if s.status in FINISHED and s.ended_at is not None)
    if not ends or not starts or n_keep <= 0:
        return 1.0
    cut_at = ends[min(n_keep, len(ends)) - 1] - min(starts)
    return wait_all_s / cut_at if cut_at > 0 else 1.0


def batch_metrics(batch: TrainBatch, adv: AdvantageResult) -> dict[str, float]:
    """What became of the step's samples in the batch, and the advantages' group figures."""
    c = batch.counts
    return {
        "batch/rows": float(batch.size),
        "batch/real_rows": float(c.real),
        "batch/masked_rows": float(c.masked),
        "batch/dropped_aborted": float(c.dropped_aborted),
        "batch/deferred_partial": float(c.deferred_partial),
        "batch/failed": float(c.failed),
        "batch/surplus": float(c.surplus),
        "batch/dropped_small_group": float(c.dropped_small_group),
        "batch/loss_tokens": float(batch.n_loss_tokens),
        "batch/empty": float(batch.n_loss_tokens == 0),
        "adv/groups": float(adv.n_groups),
        "adv/small_groups": float(adv.n_small_groups),
        "adv/zero_std_groups": float(adv.n_zero_std_groups),
        "adv/mean_group_size": adv.mean_group_size,
    }


def filter_metrics(result: FilterResult, gen_rounds: float) -> dict[str, float]:
    """The group filter of one step (``algo.filter_groups``) and its extra launch rounds."""
    return {
        "batch/filtered_groups": float(result.filtered_groups),
        "batch/surplus_groups": float(result.surplus_groups),
        "batch/filtered_rows": float(result.filtered_rows),
        "batch/informative_groups": float(result.informative_groups),
        "batch/gen_rounds": float(gen_rounds),
    }


def partial_metrics(
    resumed: int, expired: Sequence[Sample], buffered: int, dropped_total: int
) -> dict[str, float]:
    """The partial-rollout buffer over one step (``cutoff.aborted=partial``): how many
    trajectories the step resumed, those it let go past ``cutoff.max_staleness``
    (``expired``: cut again too late to resume, or left waiting too long) with every token
    they had sampled, and what it holds after the step's deferred samples went in."""
    return {
        "partial/resumed": float(resumed),
        "partial/expired": float(len(expired)),
        "partial/expired_tokens": float(sum(s.generated_tokens for s in expired)),
        "partial/buffered": float(buffered),
        "partial/dropped_total": float(dropped_total),
    }


def timing_metrics(phases: Mapping[str, float], reward_s: float) -> dict[str, float]:
    """Seconds per phase of a step (``phases``, in order: rollout, train, sync), the step's
    total, the time in reward functions, and each one's share of the step."""
    step_s = math.fsum(phases.values())
    out = {f"timing/{name}_s": s for name, s in phases.items()}
    out["timing/reward_s"] = reward_s
    out["timing/step_s"] = step_s
    for name, s in [*phases.items(), ("reward", reward_s)]:
        out[f"timing/share_{name}"] = s / step_s if step_s > 0 else 0.0
    return out


def validation_metrics(step: StepLike, seconds: float) -> dict[str, float]:
    """One uncut validation step: mean reward (a sample with no reward counts 0)."""
    rewards = [
        float(s.reward) if s.status in FINISHED and s.reward is not None else 0.0
        for s in step.samples
    ]
    status = [s.status for s in step.samples]
    return {
        "val/reward": _mean(rewards),
        "val/n": float(len(rewards)),
        "val/aborted": float(status.count(Status.ABORTED)),
        "val/failed": float(status.count(Status.FAILED)),
        "val/truncated": float(status.count(Status.TRUNCATED)),
        "val/cut": float(step.cut_time_s is not None),
        "timing/val_s": seconds,
    }


_VARYING = re.compile(r"[\w.-]*\d[\w.-]*")
"""Words with a digit (numbers, request ids, paths with a step): what differs between
failures of one cause."""


@dataclass(frozen=True, slots=True)
class FailureSummary:
    """FAILED samples of one step, grouped by cause (their errors with numbers and request
    ids set aside), most common first; each cause shown by its first message."""

    failed: int
    ended: int
    """Samples that ended (FAILED or finished; cut samples did not end)."""
    causes: list[tuple[str, int]]

    @property
    def fraction(self) -> float:
        return self.failed / self.ended if self.ended else 0.0

    def line(self, most: int = 3) -> str:
        """``3/64 samples failed — EngineError: … (2); ValueError: … (1)``"""
        shown = "; ".join(f"{msg} ({n})" for msg, n in self.causes[:most])
        more = len(self.causes) - most
        tail = f"; {more} other cause(s)" if more > 0 else ""
        return f"{self.failed}/{self.ended} samples failed — {shown}{tail}"


def failure_summary(samples: Sequence[Sample]) -> FailureSummary:
    failed = [s for s in samples if s.status is Status.FAILED]
    ended = sum(1 for s in samples if s.status in FINISHED or s.status is Status.FAILED)
    counts: Counter[str] = Counter()
    first: dict[str, str] = {}
    for s in failed:
        msg = (s.error or "no error message").splitlines()[0][:300]
        key = _VARYING.sub("#", msg)
        counts[key] += 1
        first.setdefault(key, msg)
    return FailureSummary(len(failed), ended, [(first[k], n) for k, n in counts.most_common()])
