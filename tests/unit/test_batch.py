"""Batch assembly: which samples become rows under drop / mask / partial, and the padding."""

from __future__ import annotations

import pytest

from tailcut.algo.batch import BatchError, assemble, plan_rows
from tailcut.types import Sample, Status

PAD = 0


def sample(
    index: int,
    group: int,
    status: Status,
    n_prompt: int = 3,
    n_resp: int = 4,
    reward: float | None = 1.0,
) -> Sample:
    mask = [1 if t % 3 != 2 else 0 for t in range(n_resp)]
    return Sample(
        index=index,
        group=group,
        prompt_ids=[100 + index] * n_prompt,
        status=status,
        response_ids=[200 + index] * n_resp,
        loss_mask=mask,
        logprobs=[-0.5 if m else 0.0 for m in mask],
        versions=[7 if m else -1 for m in mask],
        reward=reward if status in (Status.COMPLETED, Status.TRUNCATED) else None,
    )


def step_samples() -> list[Sample]:
    return [
        sample(0, 0, Status.COMPLETED, 2, 5),
        sample(1, 0, Status.ABORTED, 4, 2),
        sample(2, 1, Status.TRUNCATED, 3, 6, reward=0.0),
        sample(3, 1, Status.FAILED),
        sample(4, 1, Status.COMPLETED, 1, 1),
        sample(5, 2, Status.COMPLETED),  # surplus: not kept
    ]


KEPT = [0, 2, 4]


def test_drop_removes_aborted_and_failed_and_surplus() -> None:
    plan = plan_rows(step_samples(), KEPT, "drop")
    assert [s.index for s in plan.samples] == [0, 2, 4]
    assert plan.valid == [True, True, True]
    c = plan.counts
    assert (c.real, c.dropped_aborted, c.failed, c.surplus, c.masked) == (3, 1, 1, 1, 0)
    assert plan.deferred == []


def test_mask_keeps_aborted_row_with_zero_mask_and_reward() -> None:
    plan = plan_rows(step_samples(), KEPT, "mask")
    assert [s.index for s in plan.samples] == [0, 1, 2, 4]
    assert plan.valid == [True, False, True, True]
    assert plan.rewards == [1.0, 0.0, 0.0, 1.0]
    batch = assemble(plan, [0.5, 9.0, -0.5, 0.1], pad_id=PAD)
    assert batch.row_valid == [1, 0, 1, 1]
    assert batch.row("loss_mask", 1) == [0] * batch.response_width
    assert batch.row("engine_logprobs", 1) == [0.0] * batch.response_width
    assert batch.advantages[1] == 0.0  # masked rows never carry an advantage
    assert batch.counts.masked == 1


def test_partial_defers_aborted() -> None:
    plan = plan_rows(step_samples(), KEPT, "partial")
    assert [s.index for s in plan.samples] == [0, 2, 4]
    assert [s.index for s in plan.deferred] == [1]
    assert plan.counts.deferred_partial == 1


def test_padding_layout_left_prompt_right_response() -> None:
    plan = plan_rows(step_samples(), KEPT, "drop")
    batch = assemble(plan, [1.0, 2.0, 3.0], pad_id=PAD, pad_multiple=4, pad_rows_to=4)
    assert batch.prompt_width == 4 and batch.response_width == 8  # 3→4, 6→8
    assert batch.size == 4 and batch.counts.pad_rows == 1
    row0 = batch.row("input_ids", 0)
    assert row0[:4] == [PAD, PAD, 100, 100]  # prompt of 2, left-padded
    assert row0[4:9] == [200] * 5 and row0[9:] == [PAD] * 3
    assert batch.row("loss_mask", 0) == [1, 1, 0, 1, 1, 0, 0, 0]
    assert batch.row("versions", 0) == [7, 7, -1, 7, 7, -1, -1, -1]
    assert batch.row("engine_logprobs", 0)[:5] == [-0.5, -0.5, 0.0, -0.5, -0.5]
    assert batch.prompt_lens == [2, 3, 1, 0] and batch.response_lens == [5, 6, 1, 0]
    pad_row = batch.row("input_ids", 3)
    assert (
        pad_row == [PAD] * 12 and batch.row("loss_mask", 3) == [0] * 8 and batch.row_valid[3] == 0
    )
    assert batch.sample_index == [0, 2, 4, -1] and batch.groups[3] == -1
    assert all(len(r) == 12 for r in batch.input_ids) and all(len(r) == 8 for r in batch.versions)
    assert batch.n_real == 3 and batch.n_loss_tokens == 4 + 4 + 1


def test_assemble_does_not_alias_sample_lists() -> None:
    plan = plan_rows(step_samples(), KEPT, "drop")
    batch = assemble(plan, [0.0] * 3, pad_id=PAD)
    batch.loss_mask[0][0] = 99
    assert plan.samples[0].loss_mask[0] == 1


def test_fixed_response_width_and_overflow_names_sample() -> None:
    plan = plan_rows(step_samples(), KEPT, "drop")
    assert assemble(plan, [0.0] * 3, pad_id=PAD, response_width=10).response_width == 10
    with pytest.raises(BatchError, match="sample 2 has 6 response tokens"):
        assemble(plan, [0.0] * 3, pad_id=PAD, response_width=5)


def test_empty_step_gives_all_pad_batch() -> None:
    plan = plan_rows([sample(0, 0, Status.ABORTED)], [], "drop")
    batch = assemble(plan, [], pad_id=PAD, pad_rows_to=2)
    assert batch.size == 2 and batch.n_real == 0 and batch.n_loss_tokens == 0


def test_errors_name_the_sample() -> None:
    bad = sample(3, 1, Status.COMPLETED)
    bad.loss_mask.pop()
    plan = plan_rows([bad], None, "drop")
    with pytest.raises(BatchError, match=r"sample 3 \(group 1\).*loss_mask 3"):
        assemble(plan, [0.0], pad_id=PAD)
    with pytest.raises(BatchError, match="no reward"):
        plan_rows([sample(4, 0, Status.COMPLETED, reward=None)], None, "drop")
    with pytest.raises(BatchError, match="must all be terminal"):
        plan_rows([sample(5, 0, Status.RUNNING)], None, "drop")
    with pytest.raises(BatchError, match=r"cutoff\.aborted"):
        plan_rows([], None, "keep")  # type: ignore[arg-type]


def test_drop_rows_removes_small_group_members_only() -> None:
    from tailcut.algo.batch import drop_rows

    plan = plan_rows(step_samples(), KEPT, "mask")  # rows 0, 1 (masked), 2, 4
    out = drop_rows(plan, [False, False, True, True])
    assert [s.index for s in out.samples] == [1, 2, 4]
    assert out.valid == [False, True, True]
    assert out.counts.dropped_small_group == 1 and out.counts.real == 2
