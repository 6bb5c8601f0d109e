"""Reward estimators under a cut, their audited bias, and rollout figures."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tailcut.algo.metrics import (
    audit_bias,
    carried_work,
    estimate_rewards,
    rollout_metrics,
    speedup_estimate,
)
from tailcut.rollout.partial import resume_copy
from tailcut.types import Sample, Status, Turn


def s(index: int, group: int, status: Status, reward: float | None, end: float = 1.0) -> Sample:
    return Sample(
        index=index,
        group=group,
        status=status,
        reward=reward,
        launched_at=0.0,
        ended_at=end,
        turns=[Turn(0, "r" * 24, 1, output_tokens=5, tool_calls=1, tool_errors=int(index == 0))],
    )


def test_three_estimators() -> None:
    samples = [
        s(0, 0, Status.COMPLETED, 1.0),
        s(1, 0, Status.ABORTED, None),
        s(2, 1, Status.COMPLETED, 0.0),
        s(3, 2, Status.ABORTED, None),  # its group has no finished member
        s(4, 2, Status.FAILED, None),
    ]
    est = estimate_rewards(samples)
    assert est.completed_mean == pytest.approx(0.5)
    assert est.all_zero_filled == pytest.approx(1.0 / 4)
    # imputed: sample 1 ← group 0 mean 1.0; sample 3 ← completed mean 0.5
    assert est.group_imputed == pytest.approx((1.0 + 0.0 + 1.0 + 0.5) / 4)
    assert (est.n_finished, est.n_aborted) == (2, 2)


def test_audit_bias_replays_the_cut_on_an_uncut_step() -> None:
    # Slow samples are the wrong ones: cutting them inflates completed_mean.
    samples = [
        s(i, i // 2, Status.COMPLETED, 1.0 if i < 2 else 0.0, end=float(i)) for i in range(4)
    ]
    out = audit_bias(samples, n_keep=2)
    assert out["reward/audit_mean"] == pytest.approx(0.5)
    assert out["bias/completed_mean"] == pytest.approx(0.5)
    assert out["bias/all_zero_filled"] == pytest.approx(0.0)
    assert out["bias/group_imputed"] == pytest.approx(0.5)


@dataclass
class Step:
    samples: list[Sample]
    step_time_s: float = 4.0
    cut_time_s: float | None = None


def test_rollout_metrics() -> None:
    samples = [
        s(0, 0, Status.COMPLETED, 1.0, 1.0),
        s(1, 0, Status.ABORTED, None, 2.0),
        s(2, 1, Status.COMPLETED, 0.0, 4.0),
    ]
    m = rollout_metrics(Step(samples, cut_time_s=2.0))
    assert m["rollout/aborted_ratio"] == pytest.approx(1 / 3)
    assert m["rollout/wasted_tokens"] == 5.0 and m["rollout/generated_tokens"] == 15.0
    assert m["rollout/group_complete_frac"] == pytest.approx(0.5)
    assert m["rollout/tool_errors"] == 1.0 and m["rollout/cut_time_s"] == 2.0
    assert "rollout/speedup_est" not in m
    assert "rollout/cut_time_s" not in rollout_metrics(Step(samples))
    assert speedup_estimate(samples, 1, 4.0) == pytest.approx(4.0)


def test_a_resumed_trajectory_counts_only_this_steps_work() -> None:
    """Cut at step 1 after 5 tokens and a tool call; resumed at step 2, it samples 3 more in
    its open turn and 4 in a new one, and is cut again: the step sampled 7 tokens, all
    wasted, and made one tool call."""
    first = s(0, 0, Status.ABORTED, None)
    again = resume_copy(first, started_step=1)
    fresh = s(1, 0, Status.COMPLETED, 1.0)
    carried = carried_work([again, fresh])
    assert list(carried) == [0]
    again.turns[0].output_tokens += 3
    again.turns.append(Turn(1, "q" * 24, 9, output_tokens=4, tool_calls=1, engine_s=0.5))
    again.status = Status.ABORTED
    m = rollout_metrics(Step([again, fresh]), carried=carried)
    assert m["rollout/generated_tokens"] == 7.0 + 5.0  # and the fresh one's 5
    assert m["rollout/wasted_tokens"] == 7.0
    assert m["rollout/tool_calls"] == 1.0 + 1.0 and m["rollout/tool_errors"] == 0.0
    assert m["rollout/engine_s_sum"] == 0.5
