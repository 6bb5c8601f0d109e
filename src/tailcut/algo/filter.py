"""Dynamic sampling (DAPO's group filter, verl's ``filter_groups``): a group whose rewards are
all equal carries no learning signal under a group baseline, so its rows leave the batch.

Pure and torch-free. A group's rewards are those of its real rows (``RowPlan.valid``) plus
its baseline-only rewards (members trained in an earlier step, ``rollout/partial.py``), the
same values its advantage is computed over (``algo/advantage.py``). Under ``zero-std`` a
group is *informative* when it has at least two rewards and they are not all equal; the
rows (real and masked) of every other group are dropped. :func:`filter_groups` keeps at
most ``target`` informative groups, the first ones in row order (launch order, round by
round): the rest are surplus of the extra launch rounds.

The trainer sizes a step's first round from the informative share of recent steps
(:class:`FirstRound`, ``algo.filter_first_round=learned``: verl's ``gen_batch_size``, learned
instead of fixed) and launches more groups while fewer than its target are informative
(:func:`groups_to_launch`), in up to ``algo.max_gen_rounds`` extra rounds; a step left with
no informative group is skipped and counted.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from tailcut.algo.batch import RowCounts, RowPlan

FilterMode = Literal["none", "zero-std"]


def group_rewards(
    plan: RowPlan, baselines: Mapping[int, Sequence[float]] | None = None
) -> dict[int, list[float]]:
    """Each group's rewards, in order of first appearance: real rows, then baselines."""
    out: dict[int, list[float]] = {}
    for s, ok, r in zip(plan.samples, plan.valid, plan.rewards, strict=True):
        values = out.setdefault(s.group, [])
        if ok:
            values.append(r)
    for g, values in out.items():
        values.extend(float(x) for x in (baselines or {}).get(g, ()))
    return out


def is_informative(rewards: Sequence[float]) -> bool:
    """At least two rewards, not all equal (a nonzero std)."""
    return len(rewards) >= 2 and max(rewards) != min(rewards)


def informative_groups(
    plan: RowPlan, baselines: Mapping[int, Sequence[float]] | None = None
) -> list[int]:
    """The informative groups of ``plan``, in order of first appearance."""
    return [g for g, r in group_rewards(plan, baselines).items() if is_informative(r)]


@dataclass(frozen=True, slots=True)
class FilterResult:
    plan: RowPlan
    informative_groups: int
    """Groups of ``plan`` whose rewards differ (with ``none``, beside those that do not)."""
    filtered_groups: int
    """Groups dropped for carrying no signal (all rewards equal, or fewer than two)."""
    surplus_groups: int
    """Informative groups past the target (from the extra launch rounds)."""
    filtered_rows: int


def filter_groups(
    plan: RowPlan,
    mode: FilterMode,
    baselines: Mapping[int, Sequence[float]] | None = None,
    target: int | None = None,
) -> FilterResult:
    """``plan`` without the rows of uninformative groups (``zero-std``) and of informative
    groups past the first ``target``; ``none`` returns it as it is."""
    if mode not in ("none", "zero-std"):
        raise ValueError(f"algo.filter_groups must be 'none' or 'zero-std', got {mode!r}")
    rewards = group_rewards(plan, baselines)
    good = [g for g, r in rewards.items() if is_informative(r)]
    if mode == "none":
        return FilterResult(plan, len(good), 0, 0, 0)
    keep = set(good if target is None else good[:target])
    rows, valid = [], []
    real = masked = 0
    for s, ok in zip(plan.samples, plan.valid, strict=True):
        if s.group in keep:
            rows.append(s)
            valid.append(ok)
            real += ok
            masked += not ok
    counts = replace(plan.counts, real=real, masked=masked)
    out = RowPlan(rows, valid, plan.deferred, counts, plan.surplus)
    return FilterResult(
        out, len(keep), len(rewards) - len(good), len(good) - len(keep),
        len(plan.samples) - len(rows),
    )  # fmt: skip


def concat_plans(plans: Sequence[RowPlan]) -> RowPlan:
    """One plan from the plans of a step's launch rounds (rows in round order; counts
    summed)."""
    counts = RowCounts()
    for p in plans:
        for f in fields(RowCounts):
            setattr(counts, f.name, getattr(counts, f.name) + getattr(p.counts, f.name))
    return RowPlan(
        [s for p in plans for s in p.samples],
        [v for p in plans for v in p.valid],
        [s for p in plans for s in p.deferred],
        counts,
        [s for p in plans for s in p.surplus],
    )


def groups_to_launch(missing: int, informative: int, seen: int, *, cap: int, floor: int = 1) -> int:
    """Groups an extra round launches for ``missing`` informative ones: ``missing`` over the
    share of informative groups so far (``informative`` of ``seen``), at most ``cap`` (the
    trainer's: one step's ``data.batch_size``, so a step costs at most ``1 +
    algo.max_gen_rounds`` rounds of a normal step's size) and at least ``floor``."""
    if missing <= 0:
        return 0
    return groups_for_share(missing, informative / seen if seen else 1.0, cap=cap, floor=floor)


def groups_for_share(missing: int, share: float, *, cap: int, floor: int) -> int:
    """Groups to launch for ``missing`` informative ones when ``share`` of launched groups
    turn out informative: ``missing / share`` (``cap`` when none do), within [floor, cap]."""
    want = math.ceil(missing / share - 1e-9) if share > 0 else cap
    return max(floor, min(cap, want))


class FirstRound:
    """The groups a step's first round launches under the filter: ``batch`` over the lowest
    informative share (informative groups per group planned, after the cut; the trainer
    counts the groups its policy was asked for, not an over-provisioned launch, and leaves
    out groups withheld for a long round) of the last
    ``window`` steps, so that an extra round — a whole rollout's wall time for a few groups —
    is the exception; at least ``batch``, at most ``cap``. Before any step it launches
    ``batch`` (nothing learned yet). Its state is the window (checkpointed)."""

    def __init__(self, batch: int, cap: int, window: int = 4) -> None:
        if not 1 <= batch <= cap:
            raise ValueError(f"FirstRound: need 1 <= batch <= cap, got batch={batch}, cap={cap}")
        self.batch, self.cap = batch, cap
        self.shares: deque[float] = deque(maxlen=window)

    def observe(self, informative: int, groups: int) -> None:
        """One step's informative groups out of the ``groups`` they are a share of (all
        rounds; a step with none teaches nothing)."""
        if groups > 0:
            self.shares.append(informative / groups)

    def groups(self) -> int:
        if not self.shares:
            return self.batch
        return groups_for_share(self.batch, min(self.shares), cap=self.cap, floor=self.batch)

    def state_dict(self) -> dict[str, Any]:
        return {"shares": list(self.shares)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.shares.clear()
        self.shares.extend(float(x) for x in state.get("shares", ()))
