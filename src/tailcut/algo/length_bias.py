"""``bias/length``: how much shorter the trained samples are than the data's, per mode.

Length is a sample's response tokens (sampled and tool output). On an uncut audit step
(``cutoff.audit_every``) every sample's uncut length is known; :func:`audit_length_bias`
replays the cut the policy would have made (the ``n_keep`` earliest finishers kept, cut at
the ``n_keep``-th one's end ``c``) and compares the mean length of what the mode would
eventually train of the step's fresh samples with their mean uncut length (the same
prompts; resumed partial trajectories, the previous step's tail, are left out of both)::

    bias/length = mean length(trained under the mode) / mean length(all, uncut) − 1

What each mode trains, replayed:

* ``drop`` / ``mask``: the kept samples (a masked row has no loss tokens);
* ``partial``: the kept ones, and each cut one that would finish within ``max_staleness``
  more steps — one of uncut duration ``d`` if ``d ≤ (max_staleness + 1)·c`` (resumed
  steps assumed as long as this one); the others are dropped;
* ``long_rounds``: (drop, mask) the groups whose every member was kept, and every group
  with a cut member again, whole, uncut, in a long round: every sample at its uncut length;
  (partial) the partial set, and each group that has a trajectory past the staleness
  bound again, whole (its earlier members stay trained).

In a long round a withheld group's finished members are trained as they were and its cut
members continue to their end (within ``max_staleness``; past it the prompt is drawn anew,
whole): either way every member at its uncut length, which is what the replay counts (the
audit step's uncut lengths). :class:`LengthLedger` keeps the measured
figure over the run: the mean length of every trained sample over the mean uncut length of
the audit steps' fresh samples, with the per-step replays' mean beside it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tailcut.types import FINISHED, Sample


def length(s: Sample) -> int:
    return len(s.response_ids)


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs) if xs else 0.0


def replay_trained(
    samples: Sequence[Sample], n_keep: int, mode: str, long_rounds: bool, max_staleness: int
) -> list[Sample]:
    """The samples (with repeats: trained twice) that ``mode`` would train from an uncut
    step had the policy kept its ``n_keep`` earliest finishers (rules in the docstring)."""
    ends = {s.index: s.ended_at for s in samples if s.status in FINISHED and s.ended_at is not None}
    order = sorted((s for s in samples if s.index in ends), key=lambda s: (ends[s.index], s.index))
    n_keep = max(0, min(n_keep, len(order)))
    kept, cut = order[:n_keep], order[n_keep:]
    if not cut:
        return list(order)
    t0 = min((s.launched_at for s in order if s.launched_at is not None), default=0.0)
    c = ends[kept[-1].index] - t0 if kept else 0.0
    if mode == "partial":
        late = [s for s in cut if ends[s.index] - t0 > (max_staleness + 1) * c]
        trained = kept + [s for s in cut if s not in late]
        if long_rounds:
            again = {s.group for s in late}
            trained += [s for s in order if s.group in again]
        return trained
    if long_rounds:
        return list(order)  # complete groups now, the others whole in a long round
    return kept


def fresh(s: Sample) -> bool:
    """Launched for the first time in its step (not a resumed partial trajectory)."""
    return s.resumed_from_step is None


def audit_length_bias(
    samples: Sequence[Sample], n_keep: int, mode: str, long_rounds: bool, max_staleness: int
) -> float:
    """``bias/length`` of one uncut step, the cut replayed over all of its samples and
    measured on its fresh ones (see the module docstring)."""
    base = _mean([length(s) for s in samples if s.status in FINISHED and fresh(s)])
    replayed = replay_trained(samples, n_keep, mode, long_rounds, max_staleness)
    trained = [s for s in replayed if fresh(s)]
    return _mean([length(s) for s in trained]) / base - 1.0 if base > 0 else 0.0


@dataclass
class LengthLedger:
    """Lengths over the run: trained samples (every step), audit steps' uncut samples, and
    the per-audit replayed biases. Kept in the trainer's checkpoint."""

    trained_tokens: int = 0
    trained_n: int = 0
    audit_tokens: int = 0
    audit_n: int = 0
    replay_sum: float = 0.0
    replay_n: int = 0

    def trained(self, samples: Iterable[Sample]) -> float:
        """Record the samples a step trained; returns their mean length."""
        lengths = [length(s) for s in samples]
        self.trained_tokens += sum(lengths)
        self.trained_n += len(lengths)
        return _mean(lengths)

    def audit(self, samples: Iterable[Sample], replayed: float) -> None:
        """Record an audit step: its fresh samples' uncut lengths and its replayed bias."""
        lengths = [length(s) for s in samples if s.status in FINISHED and fresh(s)]
        self.audit_tokens += sum(lengths)
        self.audit_n += len(lengths)
        self.replay_sum += replayed
        self.replay_n += 1

    def metrics(self) -> dict[str, float]:
        """``bias/length_run`` (measured: trained mean over audit mean, − 1) and
        ``bias/length_replay_mean`` (the audit replays' mean), once an audit step ran."""
        if not (self.audit_n and self.trained_n and self.audit_tokens):
            return {}
        trained = self.trained_tokens / self.trained_n
        audit = self.audit_tokens / self.audit_n
        return {
            "bias/length_run": trained / audit - 1.0,
            "bias/length_replay_mean": self.replay_sum / self.replay_n,
            "length/trained_run_mean": trained,
            "length/audit_run_mean": audit,
        }

    def state_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for k in self.__dataclass_fields__:
            if k in state:
                setattr(self, k, type(getattr(self, k))(state[k]))
