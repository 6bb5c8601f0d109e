"""The adaptive cut (``cutoff.adapt``): a pure object fed finished steps, picking the share of
most kept samples per second under the length-bias bound, within its bounds and step."""

from __future__ import annotations

import pytest

from tailcut.rollout.adapt import (
    AdaptiveCut,
    StepTimes,
    cutoff_update,
    predict,
    share_of,
    step_times,
)
from tailcut.types import FinishReason, Sample, Status, token_array


def _step(ends: list[float], cut_at: float | None = None) -> list[Sample]:
    """One sample per end time, its length = its end time in tokens; ends past ``cut_at``
    were cut there (their length as far as they got)."""
    out = []
    for i, end in enumerate(ends):
        cut = cut_at is not None and end > cut_at
        s = Sample(index=i, status=Status.ABORTED if cut else Status.COMPLETED)
        s.finish_reason = FinishReason.ABORT if cut else FinishReason.STOP
        s.launched_at = 0.0
        s.ended_at = cut_at if cut else end
        s.response_ids = token_array([1] * int(s.ended_at or 0))
        out.append(s)
    return out


TAIL = [1.0, 2, 3, 4, 5, 6, 7, 8, 9, 30]
"""Nine steady samples and one straggler three times slower than the rest."""


def test_predict_reads_cut_time_rate_and_bias() -> None:
    st = step_times(_step(TAIL), overhead_s=2.0)
    assert st is not None and st.launched == 10
    rate, bias = predict(st, 0.1)
    assert rate == pytest.approx(0.9 / (9 + 2))
    assert bias == pytest.approx(5 / 7.5 - 1)  # the nine short ones against all ten
    assert predict(st, 0.0) == pytest.approx((1 / 32, 0.0))


def test_the_fastest_share_within_the_bias_bound_is_chosen() -> None:
    loose = AdaptiveCut(0.2, 0.0, 0.4, max_change=1.0, max_length_bias=0.5)
    loose.observe(_step(TAIL), overhead_s=2.0)
    best = loose.choose()
    assert best.share == pytest.approx(0.1) and loose.share == best.share
    assert best.rate == pytest.approx(0.9 / 11)
    tight = AdaptiveCut(0.2, 0.0, 0.4, max_change=1.0, max_length_bias=0.1)
    tight.observe(_step(TAIL), overhead_s=2.0)
    assert tight.choose().share == pytest.approx(0.0)  # any cut here shortens by a third


def test_the_share_moves_at_most_max_change_a_step_and_stays_in_bounds() -> None:
    a = AdaptiveCut(0.38, 0.05, 0.4, max_change=0.05, max_length_bias=0.6, grid=0.01)
    assert a.choose().share == 0.38  # no history: the start
    assert min(a.candidates()) == pytest.approx(0.33) and max(a.candidates()) == 0.4
    a.observe(_step(TAIL), overhead_s=2.0)
    # Within [0.33, 0.4] the best is 0.4 (6 kept by t=6: 0.6/8) over 0.33 (7 by t=7: 0.67/9).
    # (With a bound of 0.5 it could not: keeping 6 of 10 here shortens the mean by 53%.)
    assert a.choose().share == pytest.approx(0.4)
    # From 0.4 the window [0.35, 0.4] holds 0.35 (0.65/9 = 0.0722 < 0.075): it stays.
    assert a.choose().share == pytest.approx(0.4)


def test_a_cut_steps_tail_is_extrapolated_not_taken_as_the_cut_time() -> None:
    st = step_times(_step(TAIL, cut_at=8.0), overhead_s=0.0)
    assert st is not None and st.ends == (1.0, 2, 3, 4, 5, 6, 7, 8)
    assert st.lengths[-2:] == (8, 8)  # the cut ones, as far as they got
    rate, _ = predict(st, 0.0)
    assert rate == pytest.approx(1.0 / 10.0)  # 8 + 2 more at the last tenth's slope (1/s)


def test_state_round_trips_and_bad_starts_are_refused() -> None:
    a = AdaptiveCut(0.1, 0.0, 0.4)
    a.observe(_step(TAIL), overhead_s=1.0)
    a.choose()
    b = AdaptiveCut(0.1, 0.0, 0.4)
    b.load_state_dict(a.state_dict())
    assert b.share == a.share and list(b.history) == list(a.history)
    assert isinstance(b.history[0], StepTimes)
    with pytest.raises(ValueError, match="outside"):
        AdaptiveCut(0.5, 0.0, 0.4)
    with pytest.raises(ValueError, match="adapt_min"):
        AdaptiveCut(0.1, 0.3, 0.2)


def test_shares_map_to_each_policys_knob() -> None:
    assert share_of("target-count", 0.2, 0.0) == 0.2
    assert share_of("over-provision", 0.0, 0.25) == pytest.approx(0.2)
    assert cutoff_update("target-count", 0.2) == {"abort_ratio": 0.2}
    assert cutoff_update("group-quota", 0.2) == pytest.approx({"over_provision": 0.25})
