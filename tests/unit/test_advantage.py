"""GRPO-family advantages over a group's real members only."""

from __future__ import annotations

import math

import pytest

from tailcut.algo.advantage import ESTIMATORS, compute_advantages


def test_grpo_matches_hand_computation() -> None:
    res = compute_advantages([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], [True] * 4)
    std = math.sqrt(((0.5**2) * 4) / 3)
    a = 0.5 / (std + 1e-6)
    assert res.advantages == pytest.approx([a, -a, -a, a])
    assert res.n_groups == 1 and res.keep == [True] * 4


def test_invalid_rows_do_not_enter_statistics() -> None:
    rewards = [1.0, 0.0, 123.0, 0.5]
    valid = [True, True, False, True]
    with_pad = compute_advantages(rewards, [0, 0, 0, 0], valid, estimator="drgrpo")
    without = compute_advantages([1.0, 0.0, 0.5], [0, 0, 0], [True] * 3, estimator="drgrpo")
    assert with_pad.advantages[2] == 0.0
    assert [with_pad.advantages[i] for i in (0, 1, 3)] == pytest.approx(without.advantages)
    assert with_pad.keep[2] is False


def test_drgrpo_and_rloo() -> None:
    r = [3.0, 1.0, 2.0]
    assert compute_advantages(
        r, [5] * 3, [True] * 3, estimator="drgrpo"
    ).advantages == pytest.approx([1.0, -1.0, 0.0])
    assert compute_advantages(r, [5] * 3, [True] * 3, estimator="rloo").advantages == pytest.approx(
        [1.5, -1.5, 0.0]
    )


def test_small_group_rules() -> None:
    zero = compute_advantages([1.0, 0.0, 1.0], [0, 1, 1], [True] * 3, small_group="zero")
    assert zero.advantages[0] == 0.0 and zero.keep == [True, True, True]
    assert zero.n_small_groups == 1
    drop = compute_advantages([1.0, 0.0, 1.0], [0, 1, 1], [True] * 3, small_group="drop")
    assert drop.keep == [False, True, True]
    assert drop.advantages[1] != 0.0


def test_zero_std_group_is_exactly_zero() -> None:
    res = compute_advantages([0.1] * 3 + [0.0, 0.0], [0, 0, 0, 1, 1], [True] * 5)
    assert res.advantages == [0.0] * 5 and res.n_zero_std_groups == 2


def test_baseline_rewards_complete_a_resumed_group() -> None:
    # One resumed member; its group's other members (trained earlier) scored 0 and 0.
    res = compute_advantages(
        [1.0], [9], [True], estimator="drgrpo", baseline_rewards={9: [0.0, 0.0]}
    )
    assert res.advantages == pytest.approx([2.0 / 3.0])
    assert res.n_small_groups == 0 and res.mean_group_size == 3.0


def test_all_invalid_or_empty_gives_no_nan() -> None:
    for est in ESTIMATORS:
        assert compute_advantages([], [], [], estimator=est).advantages == []
        res = compute_advantages([1.0, 2.0], [0, 0], [False, False], estimator=est)
        assert res.advantages == [0.0, 0.0] and res.n_groups == 0


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match=r"algo\.estimator must be one of"):
        compute_advantages([1.0], [0], [True], estimator="ppo")
    with pytest.raises(ValueError, match=r"row 1 \(group 4\) has a non-finite reward"):
        compute_advantages([1.0, float("nan")], [4, 4], [True, True])
