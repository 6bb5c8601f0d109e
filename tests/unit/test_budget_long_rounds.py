"""The budget's long rounds keep what a cut group finished: a withheld group's finished
members and cut members wait in the (checkpointed) queue, and the long round completes the
group with them; the metrics say what is kept, resumed, re-run and let go."""

from __future__ import annotations

import pickle

from tailcut.algo.batch import plan_rows
from tailcut.config import CutoffConfig
from tailcut.train.budget import Budget
from tailcut.types import FinishReason, Sample, Status, token_array


def _s(i: int, group: int, status: Status = Status.COMPLETED) -> Sample:
    s = Sample(index=i, group=group, status=status, data={"prompt": f"p{group}"})
    s.reward = 1.0 if status is Status.COMPLETED else None
    s.finish_reason = FinishReason.STOP if status is Status.COMPLETED else FinishReason.ABORT
    s.response_ids = token_array([1, 2, 3])
    return s


def _short_step() -> list[Sample]:
    # group 0 whole; group 1: two finished, one cut; group 2: one finished, two cut
    return [
        _s(0, 0), _s(1, 0), _s(2, 0),
        _s(3, 1), _s(4, 1), _s(5, 1, Status.ABORTED),
        _s(6, 2), _s(7, 2, Status.ABORTED), _s(8, 2, Status.ABORTED),
    ]  # fmt: skip


def _budget(max_staleness: int) -> Budget:
    cfg = CutoffConfig(long_rounds=True, long_round_prompts=2, max_staleness=max_staleness)
    return Budget(cfg, batch_size=4)


def test_withheld_members_are_kept_and_the_long_round_completes_their_groups() -> None:
    b = _budget(max_staleness=3)
    samples = _short_step()
    plan = b.withhold(plan_rows(samples, None, "drop"), samples, step=1)
    assert plan.groups == [0, 0, 0] and plan.counts.real == 3
    m = b.metrics()
    assert m["long/withheld_groups"] == 2 and m["long/withheld_rows"] == 3
    assert m["long/withheld_kept"] == 3 and m["long/withheld_cut"] == 3
    assert m["long/queued"] == 2 and b.long_round_due(step=2)

    again = _budget(max_staleness=3)  # the queue, members and all, through a checkpoint
    again.load_state_dict(pickle.loads(pickle.dumps(b.state_dict())))
    lr = again.take_long_round(step=3)
    assert [s.index for s in lr.kept] == [3, 4, 6]
    assert [(s.group, s.status) for s in lr.resumed] == [(1, Status.PENDING)] + [
        (2, Status.PENDING)
    ] * 2
    assert lr.prompts == []
    m = again.metrics()
    assert m["long/kept_groups"] == 2 and m["long/kept_rows"] == 3
    assert m["long/resumed_members"] == 3 and m["long/rerun_groups"] == 0
    assert m["long/expired_rows"] == 0 and m["long/kept_lag_max"] == 2
    assert m["long/run_total"] == 2 and m["long/queued"] == 0

    for s in lr.resumed:  # uncut: they finish
        s.status, s.reward, s.finish_reason = Status.COMPLETED, 0.0, FinishReason.STOP
    rows = Budget.join_kept(plan_rows(lr.resumed, None, "drop"), lr)
    assert sorted(rows.groups) == [1, 1, 1, 2, 2, 2] and rows.counts.real == 6
    assert Budget.join_kept(rows, None) is rows


def test_groups_past_max_staleness_are_rerun_whole_and_counted() -> None:
    b = _budget(max_staleness=1)
    samples = _short_step()
    b.withhold(plan_rows(samples, None, "mask"), samples, step=1)
    assert b.metrics()["long/withheld_rows"] == 6  # finished and masked rows alike
    lr = b.take_long_round(step=3)
    assert lr.prompts == [{"prompt": "p1"}, {"prompt": "p2"}]
    assert lr.kept == [] and lr.resumed == []
    m = b.metrics()
    assert m["long/rerun_groups"] == 2 and m["long/expired_rows"] == 3
    assert m["long/kept_rows"] == 0 and m["long/kept_lag_max"] == 0


def test_a_long_round_runs_early_at_the_last_step_a_withheld_group_can_wait() -> None:
    cfg = CutoffConfig(long_rounds=True, long_round_prompts=8, max_staleness=2)
    b = Budget(cfg, batch_size=4)
    samples = _short_step()
    b.withhold(plan_rows(samples, None, "drop"), samples, step=1)  # 2 of 8 prompts queued
    b.metrics()
    assert not b.long_round_due(step=2)  # it can still wait
    assert b.metrics()["long/early_round"] == 0.0
    assert b.long_round_due(step=3)  # a round after step 3 would let its members go
    assert b.metrics()["long/early_round"] == 1.0
    lr = b.take_long_round(step=3)
    assert lr.kept_groups == 2 and lr.expired_rows == 0 and lr.prompts == []
    never = Budget(cfg.model_copy(update={"max_staleness": 0}), batch_size=4)
    never.withhold(plan_rows(samples, None, "drop"), samples, step=1)
    assert not any(never.long_round_due(step=s) for s in (1, 2, 3))  # none can wait


def test_a_long_round_waits_for_a_queued_prompt_per_rollout_worker() -> None:
    """Whole groups are spread over the workers (ranks): one queued group cannot feed two,
    so neither an early nor a full round runs for it there; with one worker it does."""
    samples = [_s(0, 0), _s(1, 0), _s(2, 1), _s(3, 1, Status.ABORTED)]
    for size in (1, 8):
        cfg = CutoffConfig(long_rounds=True, long_round_prompts=size, max_staleness=1)
        b = Budget(cfg, batch_size=4)
        b.withhold(plan_rows(samples, None, "drop"), samples, step=1)
        assert b.metrics()["long/queued"] == 1
        assert not b.long_round_due(step=2, workers=2)
        assert b.long_round_due(step=2, workers=1)
    b.withhold(plan_rows(samples, None, "drop"), samples, step=2)  # a second prompt queued
    assert b.long_round_due(step=2, workers=2)
    assert len(b.take_long_round(step=2, workers=2).resumed) == 2  # both groups' cut members
