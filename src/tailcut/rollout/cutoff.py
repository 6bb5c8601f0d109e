"""Cut-off policies: pure, synchronous objects that decide when a rollout step stops.

A policy owns no tasks and never awaits. The scheduler feeds it events and asks it
questions; every answer depends only on what it was fed, so policies are unit-tested
without asyncio (times are plain floats, the scheduler's clock).

Life of a policy over one step::

    policy.n_launch                      # how many samples to launch
    policy.start(now)                    # the step begins
    policy.on_done(index, group, status, now, reward) -> bool   # True: cut now
    policy.deadline() -> float | None    # absolute time to wake up at, if any
    policy.on_deadline(now) -> bool      # the deadline passed: True = cut now
    policy.select(samples) -> indices    # which terminal samples to keep for training
    policy.end(stats)                    # learn from the step (learned deadline)

"Usable" samples are COMPLETED or TRUNCATED (real trajectories); FAILED and ABORTED are
finished but never count toward a target.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tailcut.algo.filter import is_informative
from tailcut.config import CutoffConfig
from tailcut.types import FINISHED, Sample, Status


@dataclass(frozen=True, slots=True)
class StepFeedback:
    """What a policy learns from a finished step."""

    step_time_s: float
    """Time from step start to the last request's end (uncut) or to the cut."""
    cut: bool
    usable: int
    launched: int


class CutoffPolicy(ABC):
    """Base: counts finished and usable samples, keeps completion order."""

    name: str = "policy"

    def __init__(self, n_target: int, group_size: int = 1) -> None:
        if n_target < 1:
            raise ValueError(f"{self.name}: n_target must be >= 1, got {n_target}")
        if group_size < 1:
            raise ValueError(f"{self.name}: group_size must be >= 1, got {group_size}")
        self.n_target = n_target
        self.group_size = group_size
        self.n_launch = n_target
        self._reset(0.0)

    def _reset(self, now: float) -> None:
        self.started_at = now
        self.finished = 0
        self.usable_order: list[int] = []
        self.cut = False

    @property
    def target_completion(self) -> int:
        """How many usable samples the step waits for (reported in the trace)."""
        return self.n_target

    def start(self, now: float) -> None:
        self._reset(now)

    def on_done(
        self, index: int, group: int, status: Status, now: float, reward: float | None = None
    ) -> bool:
        """Record one sample reaching a terminal state (with its reward, where the policy
        counts informative groups); True means cut the step now."""
        if self.cut:
            return False
        self.finished += 1
        if status in FINISHED:
            self.usable_order.append(index)
        if self.finished >= self.n_launch:
            return False  # nothing left to cut
        self.cut = self._should_cut(index, group, status, now)
        return self.cut

    @abstractmethod
    def _should_cut(self, index: int, group: int, status: Status, now: float) -> bool: ...

    def deadline(self) -> float | None:
        return None

    def on_deadline(self, now: float) -> bool:
        return False

    def select(self, samples: Sequence[Sample]) -> list[int]:
        """Indices (launch positions) of samples kept for training, in launch order."""
        return sorted(self.usable_order[: self.n_target])

    def end(self, outcome: StepFeedback) -> None:
        return None

    def would_keep(self, samples: Sequence[Sample]) -> int:
        """On an uncut (audit) step: how many samples this policy would have kept, had it
        run. Used to replay the cut on the step's true rewards (``algo/metrics.audit_bias``)."""
        return self.target_completion

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class WaitAll(CutoffPolicy):
    """Baseline: never cut; keep every usable sample."""

    name = "wait-all"

    def _should_cut(self, index: int, group: int, status: Status, now: float) -> bool:
        return False

    def select(self, samples: Sequence[Sample]) -> list[int]:
        return sorted(self.usable_order)

    def would_keep(self, samples: Sequence[Sample]) -> int:
        return sum(s.status in FINISHED for s in samples)


class GlobalShare(WaitAll):
    """One worker's share of a step that a coordinator cuts over every worker (cut-off
    scope global, ``rollout/workers.py``): it never cuts by itself and keeps every usable
    sample of its share; the coordinator's policy decides the cut and what the step keeps.

    It knows that policy's target over the whole step (``global_target``) and the step's
    launches over all workers (``global_launched``), which the worker's trace records next
    to its own never-cutting target (docs/traces.md)."""

    name = "global-share"

    def __init__(
        self, n_launch: int, global_target: int, global_launched: int, group_size: int = 1
    ) -> None:
        super().__init__(n_launch, group_size)
        self.global_target = global_target
        self.global_launched = global_launched


class TargetCount(CutoffPolicy):
    """Launch N, keep the first K = int(N·(1−r)) usable samples, abort the rest."""

    name = "target-count"

    def __init__(self, n_target: int, group_size: int = 1, abort_ratio: float = 0.1) -> None:
        if not 0.0 <= abort_ratio < 1.0:
            raise ValueError(f"target-count: abort_ratio must be in [0, 1), got {abort_ratio}")
        super().__init__(n_target, group_size)
        self.n_launch = n_target
        self.n_target = max(1, math.floor(n_target * (1.0 - abort_ratio) + 1e-9))

    def _should_cut(self, index: int, group: int, status: Status, now: float) -> bool:
        return len(self.usable_order) >= self.n_target


class OverProvision(TargetCount):
    """Launch ⌈N·(1+o)⌉ to keep the first N usable samples (true over-sampling)."""

    name = "over-provision"

    def __init__(self, n_target: int, group_size: int = 1, over_provision: float = 0.1) -> None:
        super().__init__(n_target, group_size, abort_ratio=0.0)
        self.n_launch = math.ceil(n_target * (1.0 + over_provision) - 1e-9)


class GroupQuota(CutoffPolicy):
    """Launch extra GRPO groups; keep the first complete groups; never cut a group in half.

    Samples are launched group by group: sample ``i`` belongs to group ``i // G``. A group
    is complete when all G members are usable; a group with a failed member can never be.

    ``informative=k`` (the group filter's quota, ``algo.filter_groups``): a complete group
    counts only if its rewards are not all equal (``algo/filter.is_informative``), and the
    step is cut at the k-th such group; complete groups with equal rewards are counted apart
    (``flat_groups``: the filter's share among complete groups).
    """

    name = "group-quota"

    def __init__(
        self,
        n_target: int,
        group_size: int,
        over_provision: float = 0.1,
        informative: int | None = None,
    ) -> None:
        if n_target % group_size:
            raise ValueError(
                f"group-quota: n_target ({n_target}) must be a multiple of group_size "
                f"({group_size})"
            )
        if informative is not None and informative < 1:
            raise ValueError(f"group-quota: informative must be >= 1, got {informative}")
        super().__init__(n_target, group_size)
        planned = n_target // group_size
        self.n_launch = math.ceil(planned * (1.0 + over_provision) - 1e-9) * group_size
        self.informative = informative
        self.n_groups = planned if informative is None else informative

    def _reset(self, now: float) -> None:
        super()._reset(now)
        self.group_usable: dict[int, int] = {}
        self.group_rewards: dict[int, list[float | None]] = {}
        self.complete_groups: list[int] = []
        self.flat_groups = 0

    def on_done(
        self, index: int, group: int, status: Status, now: float, reward: float | None = None
    ) -> bool:
        if not self.cut and status in FINISHED:
            count = self.group_usable.get(group, 0) + 1
            self.group_usable[group] = count
            if self.informative is not None:
                self.group_rewards.setdefault(group, []).append(reward)
            if count == self.group_size:
                if self.informative is None or _informative(self.group_rewards.pop(group)):
                    self.complete_groups.append(group)
                else:
                    self.flat_groups += 1
        return super().on_done(index, group, status, now, reward)

    def _should_cut(self, index: int, group: int, status: Status, now: float) -> bool:
        return len(self.complete_groups) >= self.n_groups

    @property
    def target_completion(self) -> int:
        return self.n_groups * self.group_size

    def select(self, samples: Sequence[Sample]) -> list[int]:
        """The first ``n_groups`` complete groups; under ``informative``, the complete groups
        with equal rewards too (the group filter drops and counts them)."""
        keep = set(self.complete_groups[: self.n_groups])
        if self.informative is not None:
            complete = {g for g, n in self.group_usable.items() if n == self.group_size}
            keep |= complete - set(self.complete_groups)
        return [s.index for s in samples if s.group in keep and s.status in FINISHED]


class Deadline(CutoffPolicy):
    """Cut at a fixed or learned deadline, never before ``min_fraction`` are finished.

    The learned deadline is ``quantile(recent step times) · (1 + slack)``: steps that run
    like the recent ones are untouched, an outlier step is cut early. With no history and
    no fixed deadline the step waits for all. A cut step is remembered at its cut time: a
    lower bound of what it would have taken, which is all a quantile below it needs.

    Why the defaults (``quantile=0.25``, ``slack=0.3``, ``min_fraction=0.7``): a step's time
    is the *longest* of its N request durations, so from one normal step to the next it is
    noisy and skewed to the right: a few steps run long, none run much shorter. On
    seed-gsm8k (N=1024, 40 normal steps over five seeds) it has a coefficient of variation
    of 14% and its longest normal step is 1.42x the median one. The lower quartile of the
    recent steps is the steadier yardstick: the long steps of that skewed spread do not
    move it, and neither do outlier steps until more than three in four of the remembered
    steps are outliers (the median moves once half are). Scaled by 1.3 it is about 1.2x
    the median step: roughly one normal step in ten reaches it and loses its last one or
    two requests, while an outlier step is cut at about 1.2x a normal step, which leaves
    room below 1.5x for a history of only a few steps. (The median with the same slack,
    the earlier default, cut an outlier step at up to 1.51x the median of the normal
    steps before it on seeds 0-4 and 1.62x on seeds 5-9.) ``min_fraction`` keeps an
    engine that is slow across the board from being cut: if fewer than 70% are done by the
    deadline, the step is not an outlier with a stuck minority; it waits until 70% are.
    """

    name = "deadline"

    def __init__(
        self,
        n_target: int,
        group_size: int = 1,
        *,
        deadline_s: float | None = None,
        min_fraction: float = 0.7,
        quantile: float = 0.25,
        slack: float = 0.3,
        history: int = 8,
    ) -> None:
        super().__init__(n_target, group_size)
        self.fixed_s = deadline_s
        self.min_fraction = min_fraction
        self.quantile = quantile
        self.slack = slack
        self.history: deque[float] = deque(maxlen=history)
        self.expired = False

    def _reset(self, now: float) -> None:
        super()._reset(now)
        self.expired = False

    @property
    def min_done(self) -> int:
        return math.ceil(self.min_fraction * self.n_launch - 1e-9)

    def budget_s(self) -> float | None:
        """The current deadline, relative to step start (None: wait for all)."""
        if self.fixed_s is not None:
            return self.fixed_s
        if not self.history:
            return None
        return quantile(sorted(self.history), self.quantile) * (1.0 + self.slack)

    def deadline(self) -> float | None:
        if self.cut or self.expired:
            return None
        budget = self.budget_s()
        return None if budget is None else self.started_at + budget

    def on_deadline(self, now: float) -> bool:
        if self.cut:
            return False
        self.expired = True
        self.cut = self.finished >= self.min_done and self.finished < self.n_launch
        return self.cut

    def _should_cut(self, index: int, group: int, status: Status, now: float) -> bool:
        return self.expired and self.finished >= self.min_done

    def select(self, samples: Sequence[Sample]) -> list[int]:
        return sorted(self.usable_order)

    def end(self, outcome: StepFeedback) -> None:
        """Remember the step's time, unless it ended uncut with fewer than ``min_done``
        usable samples (most of it failed): how fast a broken step ended says nothing of
        how long a step takes."""
        if outcome.cut or outcome.usable >= self.min_done:
            self.history.append(outcome.step_time_s)

    def would_keep(self, samples: Sequence[Sample]) -> int:
        """Those finished within the current deadline (at least ``min_done``); all finished
        ones when there is no deadline yet."""
        budget = self.budget_s()
        if budget is None:
            return sum(s.status in FINISHED for s in samples)
        t0 = min((s.launched_at for s in samples if s.launched_at is not None), default=0.0)
        on_time = sum(
            1 for s in samples
            if s.status in FINISHED and s.ended_at is not None and s.ended_at - t0 <= budget
        )  # fmt: skip
        return max(on_time, self.min_done)

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.clear()
        self.history.extend(float(x) for x in state.get("history", []))


def _informative(rewards: list[float | None]) -> bool:
    """A complete group's rewards differ; a member without a reward makes it never count."""
    known = [r for r in rewards if r is not None]
    return len(known) == len(rewards) and is_informative(known)


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of already sorted values (numpy's default method)."""
    if not sorted_values:
        raise ValueError("quantile of an empty sequence")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


PolicyFactory = Callable[[CutoffConfig, int, int], CutoffPolicy]

POLICIES: dict[str, PolicyFactory] = {
    "wait-all": lambda cfg, n, g: WaitAll(n, g),
    "target-count": lambda cfg, n, g: TargetCount(n, g, cfg.abort_ratio),
    "over-provision": lambda cfg, n, g: OverProvision(n, g, cfg.over_provision),
    "group-quota": lambda cfg, n, g: GroupQuota(n, g, cfg.over_provision),
    "deadline": lambda cfg, n, g: Deadline(
        n,
        g,
        deadline_s=cfg.deadline_s,
        min_fraction=cfg.min_fraction,
        quantile=cfg.quantile,
        slack=cfg.slack,
        history=cfg.history,
    ),
}


def make_policy(
    cfg: CutoffConfig, n_target: int, group_size: int = 1, informative: int | None = None
) -> CutoffPolicy:
    """Build the configured policy for a step that launches for ``n_target`` samples;
    ``informative=k``: group-quota cuts at the k-th complete informative group."""
    if informative is not None:
        if cfg.policy != "group-quota":
            raise ValueError(
                f"a quota of informative groups is group-quota's, not cutoff.policy={cfg.policy}"
            )
        return GroupQuota(n_target, group_size, cfg.over_provision, informative)
    return POLICIES[cfg.policy](cfg, n_target, group_size)
