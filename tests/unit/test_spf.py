import pytest

from tailcut.rollout.spf import ShortestPredictedFirst
from tailcut.types import Sample


class Fixed:
    """A predictor with given remaining work per index (a hand-written fake)."""

    def __init__(self, work: dict[int, float], siblings: dict[int, list[int]] | None = None):
        self.work = work
        self.siblings = siblings or {}

    def start_step(self, samples):
        return None

    def remaining(self, index, tokens_so_far=0, turns_done=0):
        return max(self.work[index] - tokens_so_far, 0.0)

    def sibling_done(self, index, tokens):
        return self.siblings.get(index, [])

    def end_step(self, samples):
        return None


def _start(work, n_keep, margin=0.0, need_ratio=0.0):
    spf = ShortestPredictedFirst(Fixed(work), margin=margin, need_ratio=need_ratio)
    spf.start([Sample(index=i) for i in work], n_keep)
    return spf


def test_holds_the_longest_predicted_beyond_the_need_and_margin():
    spf = _start({i: float(10 * (i + 1)) for i in range(10)}, n_keep=6, margin=0.25)
    assert spf.cap == 7  # 6 needed + ceil(0.25 · 4)
    assert [i for i in range(10) if spf.may_enter(i)] == list(range(7))
    assert spf.priority(0) < spf.priority(9)


def test_margin_one_is_plain_target_count():
    spf = _start({i: float(i) for i in range(10)}, n_keep=6, margin=1.0)
    assert all(spf.may_enter(i) for i in range(10))


def test_equal_predictions_hold_nobody():
    spf = _start(dict.fromkeys(range(10), 5.0), n_keep=5)
    assert all(spf.may_enter(i) for i in range(10))


def test_a_finished_one_never_lowers_the_allowed_below_the_need():
    spf = _start({i: float(i) for i in range(6)}, n_keep=3)  # cap 3 + 1
    assert not spf.may_enter(4)
    spf.on_done(0, usable=False, tokens=0)  # failed: still 3 needed among the live
    assert spf.may_enter(4) and not spf.may_enter(5)
    for i in (1, 2, 3):
        spf.on_done(i, usable=True, tokens=1)
    assert spf.may_enter(5)  # own share done: everyone allowed (a global cut waits)


def test_progress_and_need_ratio_change_who_is_held():
    spf = _start({0: 10.0, 1: 20.0, 2: 30.0, 3: 40.0}, n_keep=2, need_ratio=0.0)
    assert not spf.may_enter(3)
    spf.on_turn_end(3, tokens_so_far=39)  # nearly done after all
    assert spf.may_enter(3) and not spf.may_enter(2)
    late = _start({0: 10.0, 1: 20.0, 2: 30.0, 3: 40.0}, n_keep=2, need_ratio=1.0)
    assert late.cap == 4 and all(late.may_enter(i) for i in range(4))


def test_release_lets_in_the_held_ones_now_allowed_in_the_order_they_were_held():
    spf = _start({i: float(10 * (i + 1)) for i in range(6)}, n_keep=3)  # cap 3 + 1
    spf.hold(5)
    spf.hold(4)
    assert spf.release() == []
    for i in (0, 1, 2):
        spf.on_done(i, usable=True, tokens=1)  # own share done: everyone allowed
    assert spf.release() == [5, 4]
    assert spf.release() == []


def test_a_held_one_whose_prediction_drops_is_released_and_a_cut_one_never():
    spf = _start({i: float(10 * (i + 1)) for i in range(6)}, n_keep=3)
    spf.hold(4)
    spf.hold(5)
    spf.unhold(4)  # cut while held
    spf.on_turn_end(5, tokens_so_far=55)  # 5 left: among the least now
    assert spf.release() == [5]
    for i in (0, 1, 2):
        spf.on_done(i, usable=True, tokens=1)
    assert spf.release() == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        ShortestPredictedFirst(margin=1.5)
    with pytest.raises(ValueError):
        ShortestPredictedFirst(need_ratio=-1.0)
