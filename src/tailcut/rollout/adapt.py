"""Adaptive over-sampling (``cutoff.adapt``): the cut share picked each step from the
completion times of recent steps.

A pure object, fed each step's samples and the step's other costs; it never awaits. The
*cut share* ``r`` is the share of a step's launched samples the cut aborts: target-count's
``abort_ratio`` itself, over-provision's and group-quota's ``o / (1 + o)`` (``o`` launched
extra). For each candidate ``r`` on a grid over ``[adapt_min, adapt_max]`` it predicts, from
each remembered step (launching ``n`` samples at once, their finish times from the step's
start and their lengths):

* the cut time ``t(r)``: the end of the ⌈(1 − r)·n⌉-th finisher;
* the rate: kept samples per second and per launched sample, ``(1 − r) / (t(r) + overhead)``
  (``overhead``: the step's update and weight-sync seconds, which a cut does not shorten);
* the length bias: mean length of those finishers over that of all ``n``, minus 1.

A sample the step cut is known only up to its cut (its end later, its length longer). For a
share below the one a step ran with, ``t(r)`` is extrapolated along the slope of the last
tenth of the finish times seen (a tail is steeper still, so this errs short) and the cut
samples count with the tokens they had (a lower bound); an uncut audit step
(``cutoff.audit_every``) gives both exactly. The predictions are averaged over the steps
remembered; the choice is the share of highest predicted rate whose predicted
``|bias/length|`` is within ``cutoff.max_length_bias``, moved at most
``cutoff.adapt_max_change`` from the current one (the smallest share when none qualifies).
It starts at the configured value, which must lie within the bounds.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tailcut.config import OVER_PROVISION_MAX
from tailcut.types import FINISHED, Sample, Status


@dataclass(frozen=True, slots=True)
class StepTimes:
    """One step, as the adaptive cut remembers it."""

    ends: tuple[float, ...]
    """Seconds from the step's start to each finished sample's end, sorted."""
    lengths: tuple[int, ...]
    """Response tokens of the same samples, in the same order; then those of the cut
    samples (as far as they got)."""
    launched: int
    overhead_s: float


@dataclass(frozen=True, slots=True)
class Choice:
    share: float
    rate: float
    """Predicted kept samples per second per launched sample (0: no history yet)."""
    length_bias: float
    """Predicted ``bias/length`` of the kept samples."""


def step_times(samples: Sequence[Sample], overhead_s: float) -> StepTimes | None:
    """What a finished step tells: None when nothing in it finished."""
    starts = [s.launched_at for s in samples if s.launched_at is not None]
    if not starts:
        return None
    t0 = min(starts)
    pairs = sorted(
        (s.ended_at - t0, len(s.response_ids))
        for s in samples
        if s.ended_at is not None and s.status in FINISHED
    )
    if not pairs:
        return None
    cut = [len(s.response_ids) for s in samples if s.status is Status.ABORTED]
    lengths = tuple(p[1] for p in pairs) + tuple(cut)
    return StepTimes(tuple(p[0] for p in pairs), lengths, len(samples), overhead_s)


def _end_of(ends: Sequence[float], k: int) -> float:
    """The ``k``-th finish time (1-based), extrapolated past the ones seen."""
    f = len(ends)
    if k <= f:
        return ends[k - 1]
    m = max(1, f // 10)
    slope = (ends[-1] - ends[-1 - m]) / m if f > m else 0.0
    return ends[-1] + (k - f) * slope


def predict(step: StepTimes, share: float) -> tuple[float, float]:
    """(rate, length bias) of cutting ``step`` at ``share`` (see the module docstring)."""
    n = len(step.lengths)
    if not step.ends or n == 0:
        return 0.0, 0.0
    k = min(n, max(1, math.ceil((1.0 - share) * step.launched - 1e-9)))
    t = _end_of(step.ends, k)
    rate = (1.0 - share) / (t + step.overhead_s) if t + step.overhead_s > 0 else 0.0
    all_mean = sum(step.lengths) / n
    kept_mean = sum(step.lengths[:k]) / k
    return rate, (kept_mean / all_mean - 1.0) if all_mean > 0 else 0.0


class AdaptiveCut:
    """The cut share of the next step, learned from the recent ones."""

    def __init__(
        self,
        start: float,
        low: float,
        high: float,
        *,
        max_change: float = 0.05,
        max_length_bias: float = 0.1,
        history: int = 8,
        grid: float = 0.01,
    ) -> None:
        if not 0.0 <= low < high < 1.0:
            raise ValueError(f"cutoff.adapt_min ({low}) must be below cutoff.adapt_max ({high})")
        if not low <= start <= high:
            raise ValueError(
                f"cutoff.adapt: the starting cut share {start:g} is outside "
                f"[cutoff.adapt_min={low:g}, cutoff.adapt_max={high:g}]"
            )
        self.low, self.high = low, high
        self.share = start
        self.max_change = max_change
        self.max_length_bias = max_length_bias
        self.history: deque[StepTimes] = deque(maxlen=history)
        self.grid = grid
        self.last = Choice(start, 0.0, 0.0)

    def observe(self, samples: Sequence[Sample], overhead_s: float) -> None:
        seen = step_times(samples, overhead_s)
        if seen is not None:
            self.history.append(seen)

    def candidates(self) -> list[float]:
        lo = max(self.low, self.share - self.max_change)
        hi = min(self.high, self.share + self.max_change)
        n = max(1, round((hi - lo) / self.grid))
        return [lo + (hi - lo) * i / n for i in range(n + 1)]

    def evaluate(self, share: float) -> Choice:
        preds = [predict(h, share) for h in self.history]
        rate = sum(p[0] for p in preds) / len(preds) if preds else 0.0
        bias = sum(p[1] for p in preds) / len(preds) if preds else 0.0
        return Choice(share, rate, bias)

    def choose(self) -> Choice:
        """Set and return the share for the next step (unchanged without history)."""
        if not self.history:
            self.last = Choice(self.share, 0.0, 0.0)
            return self.last
        options = [self.evaluate(s) for s in self.candidates()]
        ok = [c for c in options if abs(c.length_bias) <= self.max_length_bias]
        best = max(ok, key=lambda c: (c.rate, -c.share)) if ok else options[0]
        self.share, self.last = best.share, best
        return best

    def state_dict(self) -> dict[str, Any]:
        return {
            "share": self.share,
            "history": [(h.ends, h.lengths, h.launched, h.overhead_s) for h in self.history],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        self.share = min(self.high, max(self.low, float(state["share"])))
        self.history.clear()
        for ends, lengths, launched, overhead in state.get("history", []):
            self.history.append(
                StepTimes(tuple(ends), tuple(lengths), int(launched), float(overhead))
            )
        self.last = Choice(self.share, 0.0, 0.0)


def share_of(policy: str, abort_ratio: float, over_provision: float) -> float:
    """The cut share a configured policy starts from."""
    if policy == "target-count":
        return abort_ratio
    return over_provision / (1.0 + over_provision)


def cutoff_update(policy: str, share: float) -> dict[str, float]:
    """The ``CutoffConfig`` fields that make ``policy`` cut ``share`` of a step (an
    over-provision within its limit: 0.8 / 0.2 is 4.000000000000001 in floats)."""
    if policy == "target-count":
        return {"abort_ratio": share}
    return {"over_provision": min(share / (1.0 - share), OVER_PROVISION_MAX)}


ADAPTABLE = ("target-count", "over-provision", "group-quota")
