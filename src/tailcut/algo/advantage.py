"""Outcome advantages for group-sampled RL (GRPO family), over a group's real members only.

Pure and torch-free. A *group* is the set of samples that share a prompt (``Sample.group``).
Its *members* are the rows with ``valid = True`` (masked and pad rows never count) plus any
*baseline-only* rewards: rewards of group members that were trained in an earlier step,
used when a partial rollout of that group finishes later (``rollout/partial.py``).

For a group with rewards ``r_1..r_n`` (members and baseline-only together), member ``i`` gets:

* ``grpo``:   ``A_i = (r_i − mean(r)) / (std(r) + eps)``, ``std`` the unbiased (n−1) one;
* ``drgrpo``: ``A_i = r_i − mean(r)`` (Dr.GRPO: no std normalisation; pair it with the
  ``seq-mean-token-sum-norm`` loss aggregation);
* ``rloo``:   ``A_i = r_i − mean_{j≠i}(r_j)`` (leave-one-out baseline).

Rules, never NaN:

* a group with fewer than 2 rewards has no baseline: ``small_group="zero"`` gives its members
  advantage 0 (they stay in the batch and in token counts), ``small_group="drop"`` marks them
  not to keep (the trainer removes the rows);
* a group whose rewards are all equal (zero std) gives exactly 0 to every member;
* rows with ``valid = False`` get 0 and are not counted anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Estimator = Callable[[list[float], float], list[float]]
"""``(all rewards of a group, eps) -> advantage of each``; called with ≥ 2 distinct rewards."""

SmallGroupRule = Literal["zero", "drop"]


def _mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs)


def grpo(rewards: list[float], eps: float) -> list[float]:
    """Group-normalised advantage: (r − mean) / (unbiased std + eps)."""
    mean = _mean(rewards)
    var = math.fsum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)
    std = math.sqrt(var)
    return [(r - mean) / (std + eps) for r in rewards]


def drgrpo(rewards: list[float], eps: float) -> list[float]:
    """Dr.GRPO: group-centred advantage, r − mean, without std normalisation."""
    mean = _mean(rewards)
    return [r - mean for r in rewards]


def rloo(rewards: list[float], eps: float) -> list[float]:
    """Leave-one-out baseline: r_i − mean of the other members."""
    n, total = len(rewards), math.fsum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


ESTIMATORS: dict[str, Estimator] = {"grpo": grpo, "drgrpo": drgrpo, "rloo": rloo}


@dataclass(slots=True)
class AdvantageResult:
    advantages: list[float]
    """One per row; 0.0 for invalid rows, small groups and zero-std groups."""
    keep: list[bool]
    """False for rows of small groups under ``small_group="drop"`` (and for invalid rows)."""
    n_groups: int = 0
    n_small_groups: int = 0
    n_zero_std_groups: int = 0
    mean_group_size: float = 0.0


def compute_advantages(
    rewards: Sequence[float],
    groups: Sequence[int],
    valid: Sequence[bool],
    *,
    estimator: str = "grpo",
    small_group: SmallGroupRule = "zero",
    eps: float = 1e-6,
    baseline_rewards: Mapping[int, Sequence[float]] | None = None,
) -> AdvantageResult:
    """Advantages for each row (rules in the module docstring)."""
    try:
        fn = ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(
            f"algo.estimator must be one of {sorted(ESTIMATORS)}, got {estimator!r}"
        ) from None
    if small_group not in ("zero", "drop"):
        raise ValueError(f"algo.small_group must be 'zero' or 'drop', got {small_group!r}")
    n = len(rewards)
    if len(groups) != n or len(valid) != n:
        raise ValueError(f"{n} rewards, {len(groups)} groups and {len(valid)} valid flags")
    members: dict[int, list[int]] = {}
    for i in range(n):
        if valid[i]:
            r = rewards[i]
            if not math.isfinite(r):
                raise ValueError(f"row {i} (group {groups[i]}) has a non-finite reward {r!r}")
            members.setdefault(groups[i], []).append(i)
    adv = [0.0] * n
    keep = [bool(v) for v in valid]
    res = AdvantageResult(adv, keep, n_groups=len(members))
    sizes = 0
    extra_all = baseline_rewards or {}
    for g, idx in members.items():
        extra = [float(r) for r in extra_all.get(g, ())]
        vals = [float(rewards[i]) for i in idx] + extra
        sizes += len(vals)
        if len(vals) < 2:
            res.n_small_groups += 1
            if small_group == "drop":
                for i in idx:
                    keep[i] = False
            continue
        if max(vals) == min(vals):
            res.n_zero_std_groups += 1
            continue
        for i, a in zip(idx, fn(vals, eps), strict=False):
            adv[i] = a
    res.mean_group_size = sizes / len(members) if members else 0.0
    return res
