"""How one step's samples and its cut are divided among rollout workers.

Samples go to workers in contiguous blocks (worker ``r`` holds launch indices
``offsets[r] .. offsets[r+1]-1``), never splitting a group where that can be avoided.
:func:`plan_step` builds policies from a :class:`CutoffConfig` (per-worker or global
scope); :func:`plan_for_policy` runs a caller's one policy over the whole step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tailcut.config import CutoffConfig
from tailcut.rollout.cutoff import CutoffPolicy, GlobalShare, make_policy


def split_offsets(n_launch: int, workers: int, group_size: int) -> list[int]:
    """Contiguous blocks of whole groups, as even as possible: ``offsets`` of length W+1."""
    if n_launch % group_size:
        raise ValueError(f"{n_launch} samples are not whole groups of {group_size}")
    groups = n_launch // group_size
    if groups < workers:
        raise ValueError(f"{groups} groups cannot be spread over {workers} workers")
    base, extra = divmod(groups, workers)
    offsets = [0]
    for r in range(workers):
        offsets.append(offsets[-1] + (base + (r < extra)) * group_size)
    return offsets


@dataclass(slots=True)
class WorkerPlan:
    n_launch: int
    offsets: list[int]
    policies: list[CutoffPolicy]
    """One per worker: its own policy (scope worker) or a never-cutting
    :class:`GlobalShare` of the coordinator's step (global)."""
    coordinator_policy: CutoffPolicy | None


def plan_step(
    cfg: CutoffConfig, n_target: int, group_size: int, workers: int, state: dict[str, object]
) -> WorkerPlan:
    """Decide launch counts and policies. ``state`` keeps learned policies across steps."""
    if cfg.scope == "global" or workers == 1:
        policy = state.get("global")
        if not isinstance(policy, CutoffPolicy):
            policy = state["global"] = make_policy(cfg, n_target, group_size)
        offsets = split_offsets(policy.n_launch, workers, group_size)
        if workers == 1:
            return WorkerPlan(policy.n_launch, offsets, [policy], None)
        return WorkerPlan(policy.n_launch, offsets, _shares(policy, offsets), policy)
    if n_target % (workers * group_size):
        raise ValueError(
            f"scope=worker: n_target {n_target} must split into whole groups of {group_size} "
            f"over {workers} workers"
        )
    per = n_target // workers
    policies = []
    for r in range(workers):
        policy = state.get(f"worker{r}")
        if not isinstance(policy, CutoffPolicy):
            policy = state[f"worker{r}"] = make_policy(cfg, per, group_size)
        policies.append(policy)
    offsets = [0]
    for p in policies:
        offsets.append(offsets[-1] + p.n_launch)
    return WorkerPlan(offsets[-1], offsets, policies, None)


def split_at_groups(groups: Sequence[int], workers: int) -> list[int]:
    """``offsets`` (length W+1) of contiguous, non-empty blocks as even as possible, cut only
    where the group id changes, so a run of one group's samples stays on one worker."""
    n = len(groups)
    bounds = [0, *(i for i in range(1, n) if groups[i] != groups[i - 1]), n]
    if len(bounds) - 1 < workers:
        raise ValueError(
            f"{n} samples in {len(bounds) - 1} runs of groups cannot be spread over "
            f"{workers} workers"
        )
    offsets, prev = [0], 0
    for r in range(1, workers):
        last = len(bounds) - 1 - (workers - r)  # leave a block for each later worker
        j = min(range(prev + 1, last + 1), key=lambda k: (abs(bounds[k] * workers - r * n), k))
        offsets.append(bounds[j])
        prev = j
    offsets.append(n)
    return offsets


def plan_for_policy(policy: CutoffPolicy, groups: Sequence[int], workers: int) -> WorkerPlan:
    """The caller's ``policy`` decides the cut over the whole step (global scope): with one
    worker it runs in that worker's scheduler, with more in the :class:`Coordinator` while
    the workers never cut by themselves. ``groups`` holds the group of each launched
    sample, in launch order (``len(groups) == policy.n_launch``)."""
    if len(groups) != policy.n_launch:
        raise ValueError(f"{policy.name} launches {policy.n_launch} samples, got {len(groups)}")
    offsets = split_at_groups(groups, workers)
    if workers == 1:
        return WorkerPlan(policy.n_launch, offsets, [policy], None)
    return WorkerPlan(policy.n_launch, offsets, _shares(policy, offsets), policy)


def _shares(policy: CutoffPolicy, offsets: Sequence[int]) -> list[CutoffPolicy]:
    """Each worker's never-cutting share of a step that ``policy`` cuts over all workers."""
    target, launched = policy.target_completion, policy.n_launch
    return [
        GlobalShare(offsets[r + 1] - offsets[r], target, launched) for r in range(len(offsets) - 1)
    ]
