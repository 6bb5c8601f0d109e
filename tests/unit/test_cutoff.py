"""Cut-off policies as pure objects: fed events, asserted decisions. No asyncio."""

import pytest

from tailcut.config import CutoffConfig
from tailcut.rollout.cutoff import (
    Deadline,
    GroupQuota,
    OverProvision,
    StepFeedback,
    TargetCount,
    WaitAll,
    make_policy,
    quantile,
)
from tailcut.types import Sample, Status

C, F, A = Status.COMPLETED, Status.FAILED, Status.ABORTED


def test_wait_all_never_cuts_and_keeps_every_usable():
    p = WaitAll(4)
    p.start(0.0)
    assert [p.on_done(i, 0, s, float(i)) for i, s in enumerate([C, F, C, C])] == [False] * 4
    assert p.select([]) == [0, 2, 3]


def test_target_count_keeps_first_k_usable_in_completion_order():
    p = TargetCount(10, abort_ratio=0.3)
    assert (p.n_launch, p.n_target) == (10, 7)
    p.start(0.0)
    order = [9, 3, 1, 7, 0, 5]
    assert not any(p.on_done(i, 0, C, 1.0) for i in order)
    assert not p.on_done(2, 0, F, 1.0)  # failures never count toward the target
    assert p.on_done(4, 0, C, 2.0)
    assert p.select([]) == sorted([*order, 4])
    assert not p.on_done(8, 0, C, 3.0)  # after the cut, events are ignored


def test_target_count_reference_numbers():
    p = TargetCount(1024, abort_ratio=0.1)
    assert (p.n_launch, p.n_target) == (1024, 921)


def test_target_count_keeps_the_exact_share_where_the_float_falls_just_short():
    # 90 · 0.7 = 62.99999999999999 in floats; 720 · 0.7 = 503.99999999999994
    assert TargetCount(90, abort_ratio=0.3).n_target == 63
    assert TargetCount(720, 16, abort_ratio=0.3).n_target == 504
    assert TargetCount(100, abort_ratio=0.8).n_target == 20
    assert TargetCount(7, abort_ratio=0.5).n_target == 3  # a real fraction still rounds down


def test_over_provision_launches_more_to_keep_n():
    p = OverProvision(100, over_provision=0.1)
    assert (p.n_launch, p.n_target) == (110, 100)


def test_group_quota_never_cuts_a_group_in_half():
    p = GroupQuota(4, group_size=2, over_provision=1.0)  # 2 groups wanted, 4 launched
    assert p.n_launch == 8
    p.start(0.0)
    assert not p.on_done(0, 0, C, 1.0)
    assert not p.on_done(2, 1, C, 1.0)
    assert not p.on_done(4, 2, C, 1.0)
    assert not p.on_done(5, 2, C, 2.0)  # group 2 complete (1 of 2)
    assert not p.on_done(1, 0, F, 2.0)  # group 0 can never complete
    assert p.on_done(3, 1, C, 3.0)  # group 1 complete (2 of 2): cut
    statuses = [C, F, C, C, C, C, A, A]
    samples = [Sample(index=i, group=i // 2, status=s) for i, s in enumerate(statuses)]
    assert p.select(samples) == [2, 3, 4, 5]


def test_group_quota_with_an_informative_quota_counts_groups_whose_rewards_differ():
    # 3 groups of 2 planned for 2 informative ones; over-provision 0.5: 5 groups launched
    p = make_policy(CutoffConfig(policy="group-quota", over_provision=0.5), 6, 2, informative=2)
    assert isinstance(p, GroupQuota) and p.n_launch == 10 and p.target_completion == 4
    p.start(0.0)
    assert not p.on_done(0, 0, C, 1.0, 1.0)
    assert not p.on_done(1, 0, C, 1.0, 1.0)  # group 0 complete, rewards equal: flat
    assert not p.on_done(2, 1, C, 2.0, 0.0)
    assert not p.on_done(3, 1, C, 2.0, 1.0)  # group 1 informative (1 of 2)
    assert not p.on_done(4, 2, C, 2.5, None)
    assert not p.on_done(5, 2, C, 2.5, 1.0)  # a member without a reward: never informative
    assert p.flat_groups == 2 and p.complete_groups == [1]
    assert p.on_done(7, 3, C, 3.0, 0.5) is False
    assert p.on_done(6, 3, C, 3.0, 0.0)  # group 3 informative (2 of 2): cut
    samples = [Sample(index=i, group=i // 2, status=C if i < 8 else A) for i in range(10)]
    assert p.select(samples) == list(range(8))  # the flat groups go on to the filter
    with pytest.raises(ValueError, match="group-quota's"):
        make_policy(CutoffConfig(policy="target-count"), 6, 2, informative=2)
    with pytest.raises(ValueError, match="informative must be >= 1"):
        GroupQuota(4, group_size=2, informative=0)


def test_group_quota_rejects_ragged_target():
    with pytest.raises(ValueError, match="multiple of group_size"):
        GroupQuota(5, group_size=2)


def test_deadline_waits_for_min_fraction_then_cuts():
    p = Deadline(10, deadline_s=5.0, min_fraction=0.7)
    p.start(100.0)
    assert p.deadline() == 105.0
    for i in range(5):
        assert not p.on_done(i, 0, C, 101.0)
    assert not p.on_deadline(105.0)  # 5 of 10 done < 7
    assert p.deadline() is None
    assert not p.on_done(5, 0, C, 106.0)
    assert p.on_done(6, 0, C, 107.0)  # 7th: cut at once
    assert p.select([]) == list(range(7))


def test_deadline_cuts_at_deadline_when_enough_are_done():
    p = Deadline(10, deadline_s=5.0, min_fraction=0.5)
    p.start(0.0)
    for i in range(6):
        p.on_done(i, 0, C, 1.0)
    assert p.on_deadline(5.0)


def test_learned_deadline_untouched_normal_steps_cut_outlier():
    p = Deadline(10, quantile=0.9, slack=0.25, history=4)
    p.start(0.0)
    assert p.deadline() is None  # no history: wait for all
    for t in (80.0, 82.0, 78.0, 81.0):
        p.end(StepFeedback(step_time_s=t, cut=False, usable=10, launched=10))
    budget = p.budget_s()
    assert budget == pytest.approx(quantile([78.0, 80.0, 81.0, 82.0], 0.9) * 1.25)
    assert 82.0 < budget < 1.5 * 80.0
    state = p.state_dict()
    q = Deadline(10, quantile=0.9, slack=0.25, history=4)
    q.load_state_dict(state)
    assert q.budget_s() == budget


def test_default_learned_deadline_ignores_long_and_cut_steps_in_its_history():
    p = Deadline(10)  # the defaults: lower quartile of the recent steps x 1.3
    normal = [70.0, 63.0, 82.0, 66.0, 72.0, 101.0]  # right-skewed, like real step times
    for t in normal:
        p.end(StepFeedback(step_time_s=t, cut=False, usable=10, launched=10))
    budget = p.budget_s()
    assert budget == pytest.approx(quantile(sorted(normal), 0.25) * 1.3)
    assert 1.1 * 70.0 < budget < 1.3 * 70.0  # about 1.2x the median normal step
    for _ in range(2):  # two outlier steps, remembered at their cut time
        p.end(StepFeedback(step_time_s=budget, cut=True, usable=8, launched=10))
    assert p.budget_s() < budget * 1.05  # the quartile barely moves (the median would)
    cut_at_median = Deadline(10, quantile=0.5)
    cut_at_median.load_state_dict(p.state_dict())
    assert cut_at_median.budget_s() > 1.3 * 70.0


def test_a_step_that_mostly_failed_does_not_teach_the_deadline():
    p = Deadline(10)
    for t in (60.0, 60.0):
        p.end(StepFeedback(step_time_s=t, cut=False, usable=10, launched=10))
    budget = p.budget_s()
    p.end(StepFeedback(step_time_s=0.2, cut=False, usable=0, launched=10))  # all failed
    p.end(StepFeedback(step_time_s=1.0, cut=False, usable=6, launched=10))  # under min_done
    assert p.budget_s() == budget
    p.end(StepFeedback(step_time_s=50.0, cut=True, usable=7, launched=10))  # a cut counts
    assert p.budget_s() != budget


def test_make_policy_covers_every_configured_name():
    for name in ("wait-all", "target-count", "over-provision", "group-quota", "deadline"):
        p = make_policy(CutoffConfig(policy=name), 8, 2)
        assert p.name == name
        assert p.n_launch >= p.target_completion >= 1


def test_quantile_matches_linear_interpolation():
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert quantile([5.0], 0.9) == 5.0
    with pytest.raises(ValueError):
        quantile([], 0.5)


def _finished(index: int, ended_at: float, status: Status = Status.COMPLETED) -> Sample:
    return Sample(index=index, status=status, launched_at=0.0, ended_at=ended_at)


def test_would_keep_answers_the_audit_question_per_policy():
    """On an uncut step: how many samples the configured policy would have kept."""
    step = [_finished(i, float(i + 1)) for i in range(9)] + [_finished(9, 10.0, Status.FAILED)]
    assert WaitAll(10).would_keep(step) == 9  # every finished sample
    assert TargetCount(10, 1, abort_ratio=0.3).would_keep(step) == 7  # its target
    deadline = Deadline(10, min_fraction=0.2)
    assert deadline.would_keep(step) == 9  # no deadline learned yet: wait for all
    deadline.end(StepFeedback(step_time_s=4.0, cut=False, usable=10, launched=10))
    # budget = 4.0 · 1.3 = 5.2 s: the five that ended by then
    assert deadline.would_keep(step) == 5
    assert Deadline(10, deadline_s=1.5, min_fraction=0.4).would_keep(step) == 4  # min_done
