"""Shortest-predicted-first: which trajectories of an over-sampled step may use the engine.

A pure, synchronous object, fed events by the step (``rollout/admission.py``) and asked
who may enter. With ``K`` usable samples wanted and ``D`` usable done, the trajectories
allowed in the engine are the ``K − D + M`` not yet finished ones with the least predicted
remaining work (and any that ties with the last of them) (:class:`tailcut.rollout.predict.LengthPredictor`); ``M``, the margin, is
``margin`` times the over-sample (``n_launch − K``), at least 1. The others — the likely
stragglers — wait at their next engine call, outside the engine, until the cut or until
a better prediction or a finished trajectory lets them in. ``margin = 1`` allows every
launched trajectory (plain target-count).

Why this never costs a kept sample: the cut-off policy keeps the first ``K`` usable
samples to finish, whoever they are. A wrong prediction only changes which ones those
are and when the ``K``-th finishes; and the allowed set always holds at least ``K − D``
live trajectories, so the step can always reach its target (a failed one frees its place
for the next best). Once this worker's own share is done (``D ≥ K``) every trajectory is
allowed, so a global cut over many workers is never held up by a worker that waits.

``priority(index)`` is the trajectory's predicted remaining tokens (lower first): the value
engines with priority scheduling get (vLLM, SGLang, the simulated engine).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Protocol

from tailcut.rollout.predict import LengthPredictor
from tailcut.types import Sample

_MAX_PRIORITY = 2**31 - 1


class RemainingWork(Protocol):
    """What the schedule asks of a predictor (:class:`LengthPredictor`)."""

    def start_step(self, samples: Sequence[Sample]) -> None: ...

    def remaining(self, index: int, tokens_so_far: int = 0, turns_done: int = 0) -> float: ...

    def sibling_done(self, index: int, tokens: int) -> list[int]: ...

    def end_step(self, samples: Iterable[Sample]) -> None: ...


class ShortestPredictedFirst:
    """Admission by predicted remaining work (see the module docstring)."""

    name = "spf"

    def __init__(
        self,
        predictor: RemainingWork | None = None,
        margin: float = 0.5,
        need_ratio: float = 0.0,
    ) -> None:
        if not 0.0 <= margin <= 1.0:
            raise ValueError(f"spf: margin must be in [0, 1], got {margin}")
        if need_ratio < 0.0:
            raise ValueError(f"spf: need_ratio must be >= 0, got {need_ratio}")
        self.predictor: RemainingWork = predictor or LengthPredictor()
        self.margin = margin
        self.need_ratio = need_ratio
        self._pred: dict[int, float] = {}
        self._tokens: dict[int, int] = {}
        self._turns: dict[int, int] = {}
        self._live: set[int] = set()
        self._sorted: list[float] = []
        """Predictions of the live trajectories, ascending."""
        self._need = 0
        self._extra = 1
        self.first_prediction: dict[int, float] = {}
        """Each trajectory's prediction at launch (for the accuracy figures)."""
        self._held: dict[int, int] = {}
        """Trajectories held at the gate → when they were held (an increasing count)."""
        self._held_heap: list[tuple[float, int, int]] = []
        """(prediction, when held, index) of the held ones, least first; an entry whose
        prediction changed since or whose trajectory left is dropped when it comes up."""
        self._hold_count = itertools.count()

    # ------------------------------------------------------------------ the step

    def start(self, samples: Sequence[Sample], n_keep: int) -> None:
        """A step launches ``samples`` and wants ``n_keep`` usable ones."""
        self.predictor.start_step(samples)
        n = len(samples)
        self._need = min(n_keep, n)
        self._extra = max(1, math.ceil(self.margin * (n - self._need) - 1e-9))
        self._tokens = {s.index: s.generated_tokens for s in samples}
        self._turns = {s.index: len(s.turns) for s in samples}
        self._pred = {
            s.index: self.predictor.remaining(s.index, self._tokens[s.index], len(s.turns))
            for s in samples
        }
        self.first_prediction = dict(self._pred)
        self._live = set(self._pred)
        self._sorted = sorted(self._pred.values())
        self._held, self._held_heap = {}, []

    def _set(self, index: int, pred: float) -> None:
        old = self._pred[index]
        if old != pred:
            del self._sorted[bisect.bisect_left(self._sorted, old)]
            bisect.insort(self._sorted, pred)
            self._pred[index] = pred
            if index in self._held:
                heapq.heappush(self._held_heap, (pred, self._held[index], index))

    def on_turn_end(self, index: int, tokens_so_far: int, turns_done: int = 1) -> None:
        """Trajectory ``index`` has generated ``tokens_so_far`` tokens in ``turns_done``
        turns."""
        if index in self._live:
            self._tokens[index] = tokens_so_far
            self._turns[index] = turns_done
            self._set(index, self.predictor.remaining(index, tokens_so_far, turns_done))

    def on_done(self, index: int, usable: bool, tokens: int) -> None:
        """Trajectory ``index`` reached its terminal state (``usable``: it counts)."""
        if index not in self._live:
            return
        self._live.discard(index)
        self._held.pop(index, None)
        del self._sorted[bisect.bisect_left(self._sorted, self._pred[index])]
        if usable:
            self._need -= 1
            for sib in self.predictor.sibling_done(index, tokens):
                if sib in self._live:
                    tokens, turns = self._tokens.get(sib, 0), self._turns.get(sib, 0)
                    self._set(sib, self.predictor.remaining(sib, tokens, turns))

    def relaunch(self, index: int) -> None:
        """Trajectory ``index`` runs again (a failed attempt retried within the step)."""
        if index in self._pred and index not in self._live:
            self._live.add(index)
            self._tokens[index] = self._turns[index] = 0
            self._pred[index] = self.predictor.remaining(index, 0)
            bisect.insort(self._sorted, self._pred[index])

    # ------------------------------------------------------------------ questions

    @property
    def cap(self) -> int:
        """How many live trajectories are allowed in the engine now."""
        if self._need <= 0:
            return len(self._live)
        return self._need + max(self._extra, math.ceil(self.need_ratio * self._need - 1e-9))

    @property
    def threshold(self) -> float:
        """The most predicted remaining work a trajectory may have and be allowed in: the
        ``cap``-th least among live ones (ties all allowed: equal predictions say nothing
        about who is the straggler, so none is held for them)."""
        cap = self.cap
        return math.inf if cap >= len(self._sorted) else self._sorted[cap - 1]

    def may_enter(self, index: int) -> bool:
        """May trajectory ``index`` send its next engine call now?"""
        if index not in self._live:
            return True  # not ours to hold (finished, or never launched in this step)
        return self._pred[index] <= self.threshold

    def hold(self, index: int) -> None:
        """Trajectory ``index`` (live, not allowed in) waits for :meth:`release`."""
        when = self._held[index] = next(self._hold_count)
        heapq.heappush(self._held_heap, (self._pred[index], when, index))

    def unhold(self, index: int) -> None:
        """Trajectory ``index`` stopped waiting without a release (it was cut)."""
        self._held.pop(index, None)

    def release(self) -> list[int]:
        """The held trajectories that :meth:`may_enter` now, in the order they were held;
        they are held no more. Only those up to the threshold are looked at."""
        heap, held, pred = self._held_heap, self._held, self._pred
        threshold = self.threshold
        out = []
        while heap and heap[0][0] <= threshold:
            p, when, index = heapq.heappop(heap)
            if held.get(index) == when and pred[index] == p:
                del held[index]
                out.append((when, index))
        out.sort()
        return [index for _, index in out]

    def priority(self, index: int) -> int:
        """Predicted remaining tokens of ``index``, rounded: lower runs first."""
        pred = self._pred.get(index, math.inf)
        return _MAX_PRIORITY if not math.isfinite(pred) else min(_MAX_PRIORITY, round(pred))

    def predicted_remaining(self, index: int) -> float:
        return self._pred.get(index, math.nan)

    def end(self, samples: Sequence[Sample]) -> None:
        """Learn from the finished step."""
        self.predictor.end_step(samples)
