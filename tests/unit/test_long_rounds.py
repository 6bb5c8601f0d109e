"""Long rounds: groups with a cut member are withheld with their finished and cut members
and their prompts queued; the queue hands them out oldest first and survives a checkpoint;
a long round completes a kept group (cut members resumed, finished ones trained) within
``max_staleness`` and re-runs it whole past it; the length bias per mode."""

from __future__ import annotations

import pickle

import pytest

from tailcut.algo.advantage import compute_advantages
from tailcut.algo.batch import plan_rows
from tailcut.algo.length_bias import LengthLedger, audit_length_bias, replay_trained
from tailcut.rollout.long_rounds import (
    LongRoundQueue,
    QueuedPrompt,
    join_kept,
    open_long_round,
    prompts_of_groups,
    withhold_cut_groups,
)
from tailcut.types import FinishReason, Sample, Status, token_array


def _s(i: int, group: int, n_tokens: int, status: Status = Status.COMPLETED) -> Sample:
    s = Sample(index=i, group=group, status=status, data={"prompt": f"p{group}"})
    s.reward = 1.0 if status is Status.COMPLETED else None
    s.finish_reason = FinishReason.STOP if status is Status.COMPLETED else FinishReason.ABORT
    s.response_ids = token_array([1] * n_tokens)
    s.launched_at, s.ended_at = 0.0, float(n_tokens)
    return s


@pytest.mark.parametrize("mode", ["drop", "mask"])
def test_groups_with_a_cut_member_are_withheld_whole(mode: str) -> None:
    samples = [_s(0, 0, 2), _s(1, 0, 3), _s(2, 1, 4), _s(3, 1, 9, Status.ABORTED)]
    w = withhold_cut_groups(plan_rows(samples, None, mode), samples)  # type: ignore[arg-type]
    assert w.groups == [1] and w.plan.groups == [0, 0]
    assert w.rows == (2 if mode == "mask" else 1)
    assert w.plan.counts.real == 2 and w.plan.counts.masked == 0
    assert prompts_of_groups(samples, w.groups) == [{"prompt": "p1"}]
    # The withheld group's members wait with its prompt: none is lost.
    assert len(w.entries) == 1 and w.kept == 1 and w.cut == 1
    (e,) = w.entries
    assert e.data == {"prompt": "p1"} and e.queued_step == 0
    assert e.finished == [samples[2]] and e.cut == [samples[3]]


def test_a_failed_member_of_a_withheld_group_is_neither_kept_nor_resumed() -> None:
    samples = [_s(0, 0, 2), _s(1, 0, 3, Status.ABORTED), _s(2, 0, 4, Status.FAILED)]
    samples[2].reward = None
    w = withhold_cut_groups(plan_rows(samples, None, "drop"), samples, step=5)
    (e,) = w.entries
    assert e.finished == [samples[0]] and e.cut == [samples[1]] and e.queued_step == 5
    assert w.plan.samples == [] and w.rows == 1


def _withheld_entry(step: int) -> QueuedPrompt:
    done = _s(0, 3, 2)
    cut = _s(1, 3, 5, Status.ABORTED)
    cut.versions = token_array([4] * 5)
    return QueuedPrompt({"prompt": "p3"}, step, [done], [cut])


def test_long_round_completes_a_kept_group_with_its_cut_members_resumed() -> None:
    e = _withheld_entry(step=4)
    lr = open_long_round([e, QueuedPrompt({"prompt": "fresh"}, 4)], step=6, max_staleness=2)
    assert lr.prompts == [{"prompt": "fresh"}]  # queued without members: a whole new group
    assert lr.kept == e.finished and lr.kept_groups == 1 and lr.expired_rows == 0
    (r,) = lr.resumed
    assert r is not e.cut[0] and r.group == 3 and r.status is Status.PENDING
    assert r.resumed_from_step == 4 and list(r.response_ids) == [1] * 5  # tokens so far
    assert list(r.versions) == [4] * 5  # the version that sampled them stays recorded
    assert lr.lag_max == 2


def test_long_round_past_max_staleness_reruns_the_group_whole() -> None:
    lr = open_long_round([_withheld_entry(step=4)], step=7, max_staleness=2)
    assert lr.prompts == [{"prompt": "p3"}] and lr.resumed == [] and lr.kept == []
    assert lr.expired_rows == 1 and lr.kept_groups == 0 and lr.lag_max == 0


def test_a_completed_group_has_its_statistics_over_all_its_real_members() -> None:
    e = _withheld_entry(step=1)
    lr = open_long_round([e], step=2, max_staleness=1)
    (r,) = lr.resumed
    r.index, r.status, r.reward = 0, Status.COMPLETED, 0.0  # the long one finishes, wrong
    r.finish_reason = FinishReason.STOP
    rows = join_kept(plan_rows([r], None, "drop"), lr.kept)
    assert rows.samples == [e.finished[0], r] and rows.valid == [True, True]
    assert rows.counts.real == 2 and rows.groups == [3, 3]
    adv = compute_advantages(rows.rewards, rows.groups, rows.valid)
    assert adv.advantages[0] > 0 > adv.advantages[1]  # reward 1 vs 0 in one group of two
    assert adv.advantages[0] == pytest.approx(-adv.advantages[1])
    assert join_kept(rows, []) is rows


def test_queue_is_oldest_first_and_checkpointed() -> None:
    q = LongRoundQueue()
    q.push([{"p": 1}, {"p": 2}], step=1)
    q.push([{"p": 3}], step=2)
    assert not q.ready(4) and q.ready(3)
    assert not q.expiring(3, max_staleness=1)  # prompts without members never expire early
    again = LongRoundQueue()
    again.load_state_dict(pickle.loads(pickle.dumps(q.state_dict())))
    assert [e.data for e in again.take(2)] == [{"p": 1}, {"p": 2}]
    assert len(again) == 1 and again.queued_total == 3 and again.run_total == 2
    assert again.rounds_total == 1


def test_queue_checkpoints_kept_members_and_reads_the_old_format() -> None:
    q = LongRoundQueue()
    q.push_entries([_withheld_entry(step=2)])
    again = LongRoundQueue()
    again.load_state_dict(pickle.loads(pickle.dumps(q.state_dict())))
    (e,) = again.entries
    assert e.queued_step == 2 and e.members == 2
    assert [s.status for s in e.finished + e.cut] == [Status.COMPLETED, Status.ABORTED]
    assert list(e.cut[0].versions) == [4] * 5 and again.queued_total == 1
    old = LongRoundQueue()
    old.load_state_dict({"entries": [({"p": 1}, 3)], "queued_total": 1})
    assert old.entries == [QueuedPrompt({"p": 1}, 3)] and old.entries[0].members == 0


def _audit_step() -> list[Sample]:
    # Two prompts of two samples; the longest (8 tokens) is the one a cut of 3 would abort.
    return [_s(0, 0, 1), _s(1, 0, 2), _s(2, 1, 3), _s(3, 1, 8)]


def test_length_bias_per_mode() -> None:
    samples = _audit_step()
    mean = (1 + 2 + 3 + 8) / 4
    drop = audit_length_bias(samples, 3, "drop", False, 1)
    assert drop == pytest.approx(2 / mean - 1)
    assert audit_length_bias(samples, 3, "mask", False, 1) == drop
    # partial: the cut one (d = 8) finishes in the next step only if 8 <= 2 * c (c = 3): no.
    assert audit_length_bias(samples, 3, "partial", False, 1) == drop
    assert audit_length_bias(samples, 3, "partial", False, 2) == pytest.approx(0.0)  # 8 <= 9
    # long rounds: the cut group runs again whole (at its uncut lengths).
    assert audit_length_bias(samples, 3, "drop", True, 1) == pytest.approx(0.0)
    trained = replay_trained(samples, 3, "partial", True, 1)
    assert sorted(len(s.response_ids) for s in trained) == [1, 2, 3, 3, 8]
    assert audit_length_bias(samples, 4, "drop", False, 1) == 0.0  # nothing cut


def test_resumed_trajectories_are_no_part_of_the_uncut_reference() -> None:
    samples = _audit_step()
    tail = _s(4, 7, 50)  # the previous step's cut one, finishing in this audit step
    tail.resumed_from_step = 3
    tail.ended_at = 0.5
    with_tail = [*samples, tail]
    assert audit_length_bias(with_tail, 4, "partial", False, 1) == pytest.approx(
        audit_length_bias(samples, 3, "partial", False, 1)
    )
    ledger = LengthLedger()
    ledger.audit(with_tail, replayed=0.0, step=0)
    assert ledger.audit_n == 4 and ledger.audit_tokens == 14


def test_ledger_measures_trained_against_audit_lengths() -> None:
    ledger = LengthLedger()
    assert ledger.metrics() == {}
    ledger.audit(_audit_step(), replayed=-0.4, step=0)
    assert ledger.trained([_s(0, 0, 2), _s(1, 0, 4)], step=0) == 3.0
    m = ledger.metrics()
    assert m["bias/length_run"] == pytest.approx(3.0 / 3.5 - 1)
    assert m["bias/length_paired"] == pytest.approx(3.0 / 3.5 - 1)
    assert m["bias/length_replay_mean"] == -0.4
    back = LengthLedger()
    back.load_state_dict(ledger.state_dict())
    assert back.metrics() == m


def _lengths_drift(cut: float) -> LengthLedger:
    """Nine steps whose uncut samples grow by 2 tokens a step (10, 12, .., 26), audited on
    steps 0, 3 and 6 (uncut: every sample trained); the other steps train samples ``cut``
    shorter than their step's uncut length."""
    ledger = LengthLedger()
    for step in range(9):
        uncut = 10 + 2 * step
        if step % 3 == 0:
            samples = [_s(i, i, uncut) for i in range(4)]
            ledger.audit(samples, replayed=0.0, step=step)
        else:
            samples = [_s(i, i, round(uncut * (1 - cut))) for i in range(4)]
        ledger.trained(samples, step)
    return ledger


def test_paired_length_bias_cancels_drift_the_run_figure_reads_as_bias() -> None:
    still = _lengths_drift(cut=0.0).metrics()
    # cutting nothing: the run figure reads the drift (mean 18 over audits' mean 16) ...
    assert still["bias/length_run"] == pytest.approx(18 / 16 - 1)
    # ... the paired one does not: steps 7 and 8 lie past the last audit and wait for the next
    assert still["bias/length_paired"] == pytest.approx(0.0, abs=1e-12)
    cut = _lengths_drift(cut=0.5).metrics()
    # steps 1, 2, 4, 5 train half-length samples, steps 0, 3, 6 full ones: (3 * 1 + 4 * 0.5) / 7
    assert cut["bias/length_paired"] == pytest.approx((3 + 4 * 0.5) / 7 - 1)


def test_paired_length_bias_waits_for_an_audit_around_the_trained_steps() -> None:
    ledger = LengthLedger()
    ledger.trained([_s(0, 0, 5)], step=1)
    ledger.audit([_s(0, 0, 10)], replayed=0.0, step=2)
    assert "bias/length_paired" not in ledger.metrics()  # step 1 lies before the first audit
    ledger.trained([_s(0, 0, 5)], step=2)
    assert ledger.metrics()["bias/length_paired"] == pytest.approx(-0.5)
