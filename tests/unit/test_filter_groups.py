"""The group filter (``algo.filter_groups``): uninformative groups leave the batch, the
target keeps the first informative ones, baselines count, rounds are merged."""

from __future__ import annotations

import pytest

from tailcut.algo.batch import plan_rows
from tailcut.algo.filter import (
    FirstRound,
    concat_plans,
    filter_groups,
    groups_to_launch,
    informative_groups,
)
from tailcut.types import FinishReason, Sample, Status


def _s(i: int, group: int, reward: float | None, status: Status = Status.COMPLETED) -> Sample:
    s = Sample(index=i, group=group, status=status, reward=reward)
    s.finish_reason = FinishReason.STOP if status is Status.COMPLETED else FinishReason.ABORT
    return s


def _step() -> list[Sample]:
    return [
        _s(0, 0, 1.0), _s(1, 0, 1.0),                        # all equal: filtered
        _s(2, 1, 1.0), _s(3, 1, 0.0),                        # informative
        _s(4, 2, 0.0), _s(5, 2, None, Status.ABORTED),       # one member left
        _s(6, 3, 0.0), _s(7, 3, 1.0), _s(8, 3, 1.0),         # informative
    ]  # fmt: skip


@pytest.mark.parametrize("mode", ["drop", "mask"])
def test_zero_std_drops_uninformative_groups_with_their_masked_rows(mode: str) -> None:
    plan = plan_rows(_step(), None, mode)  # type: ignore[arg-type]
    res = filter_groups(plan, "zero-std")
    assert sorted(set(res.plan.groups)) == [1, 3]
    assert res.filtered_groups == 2 and res.informative_groups == 2 and res.surplus_groups == 0
    assert res.plan.counts.real == 5 and res.plan.counts.masked == 0
    assert res.filtered_rows == len(plan.samples) - 5
    assert all(res.plan.valid)


def test_none_keeps_everything() -> None:
    plan = plan_rows(_step(), None, "mask")
    res = filter_groups(plan, "none")
    assert res.plan is plan and res.filtered_groups == 0
    assert res.informative_groups == 2  # of 4 groups: 1 and 3 (0 all equal, 2 one member)


def test_target_keeps_the_first_informative_groups() -> None:
    res = filter_groups(plan_rows(_step(), None, "drop"), "zero-std", target=1)
    assert set(res.plan.groups) == {1} and res.surplus_groups == 1


def test_baselines_make_a_lone_member_informative() -> None:
    plan = plan_rows(_step(), None, "partial")
    assert informative_groups(plan) == [1, 3]
    assert informative_groups(plan, {2: [1.0], 0: [1.0]}) == [1, 2, 3]
    res = filter_groups(plan, "zero-std", {2: [1.0]})
    assert sorted(set(res.plan.groups)) == [1, 2, 3]
    assert len(res.plan.deferred) == 1  # the cut member still goes to the partial buffer


def test_rounds_merge_in_order_with_counts_summed() -> None:
    a = plan_rows(_step(), None, "mask")
    b = plan_rows([_s(0, 9, 1.0), _s(1, 9, 0.0)], None, "mask")
    both = concat_plans([a, b])
    assert both.groups == [*a.groups, 9, 9]
    assert both.counts.real == a.counts.real + 2 and both.counts.masked == 1
    assert informative_groups(both) == [1, 3, 9]


def test_groups_to_launch_follows_the_informative_share() -> None:
    assert groups_to_launch(0, 3, 8, cap=8) == 0
    assert groups_to_launch(2, 4, 8, cap=8) == 4  # half are informative: twice what is missing
    assert groups_to_launch(3, 1, 8, cap=8) == 8  # one in eight: capped at a step's groups
    assert groups_to_launch(2, 0, 8, cap=6) == 6  # none yet: the cap
    assert groups_to_launch(1, 8, 8, cap=8, floor=3) == 3  # one group per worker at least
    with pytest.raises(ValueError, match=r"algo\.filter_groups"):
        filter_groups(plan_rows(_step(), None, "drop"), "bogus")  # type: ignore[arg-type]


def test_first_round_launches_the_batch_over_the_lowest_recent_share() -> None:
    first = FirstRound(8, 32, window=2)
    assert first.groups() == 8  # nothing learned: the batch
    first.observe(4, 8)  # half informative
    assert first.groups() == 16
    first.observe(8, 24)  # a third: the lower one sizes the round
    assert first.groups() == 24
    first.observe(8, 8)  # the half left the window: a third and all
    assert first.groups() == 24
    first.observe(8, 8)
    assert first.groups() == 8  # every group informative: the batch, never less
    first.observe(0, 8)
    assert first.groups() == 32  # none: the cap
    first.observe(3, 0)  # a step that launched nothing teaches nothing
    assert first.groups() == 32
    again = FirstRound(8, 32, window=2)
    again.load_state_dict(first.state_dict())
    assert again.groups() == 32 and list(again.shares) == [1.0, 0.0]
    with pytest.raises(ValueError, match="batch <= cap"):
        FirstRound(8, 4)
