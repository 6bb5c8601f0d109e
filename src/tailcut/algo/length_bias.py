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
audit step's uncut lengths). :class:`LengthLedger` keeps the measured figures over the run:

* ``bias/length_run``: the mean length of every trained sample over the mean uncut length
  of the audit steps' fresh samples, − 1. Lengths drift as the policy learns, and a short
  run has few audits, so this mixes the drift into the bias (a wait-all run, which cuts
  nothing, reads −8% to +24% over 150 s on the CPU example);
* ``bias/length_paired``: each trained sample's length over the uncut mean length at its
  own step — interpolated linearly between the audit steps before and after it — averaged
  over the trained samples of the steps within the audits' span, − 1: drift between audits
  cancels to first order (steps after the last audit count once the next audit has run);
* ``bias/length_replay_mean``: the per-step replays' mean.

Both measured figures keep the spread of lengths between steps (a few prompts a step,
heavy-tailed lengths): ±10% over a 150 s run of the CPU example, where a wait-all run reads
−4% to +26% paired. A tight figure compares the run with an uncut control on the same
prompts (``train/sample_log.py``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
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


def _between(audits: Sequence[Sequence[float]], step: float) -> float | None:
    """The uncut mean length at ``step``, linear between the sorted ``[step, mean]`` audits
    around it; None outside their span."""
    for (a, mean_a), (b, mean_b) in itertools.pairwise(audits):
        if a <= step <= b:
            return mean_a + (mean_b - mean_a) * (step - a) / (b - a) if b > a else mean_a
    if audits and audits[-1][0] == step:
        return audits[-1][1]
    return None


@dataclass
class LengthLedger:
    """Lengths over the run: trained samples (every step), audit steps' uncut samples, and
    the per-audit replayed biases; per step too, for the paired figure. Kept in the
    trainer's checkpoint."""

    trained_tokens: int = 0
    trained_n: int = 0
    audit_tokens: int = 0
    audit_n: int = 0
    replay_sum: float = 0.0
    replay_n: int = 0
    trained_steps: list[list[int]] = field(default_factory=list)
    """``[step, tokens, samples]`` of each step that trained samples."""
    audit_steps: list[list[float]] = field(default_factory=list)
    """``[step, mean uncut length]`` of each audit step."""

    def trained(self, samples: Iterable[Sample], step: int) -> float:
        """Record the samples ``step`` trained; returns their mean length."""
        lengths = [length(s) for s in samples]
        self.trained_tokens += sum(lengths)
        self.trained_n += len(lengths)
        if lengths:
            self.trained_steps.append([step, sum(lengths), len(lengths)])
        return _mean(lengths)

    def audit(self, samples: Iterable[Sample], replayed: float, step: int) -> None:
        """Record audit step ``step``: its fresh samples' uncut lengths, its replayed bias."""
        lengths = [length(s) for s in samples if s.status in FINISHED and fresh(s)]
        self.audit_tokens += sum(lengths)
        self.audit_n += len(lengths)
        self.replay_sum += replayed
        self.replay_n += 1
        if lengths and sum(lengths):
            self.audit_steps.append([float(step), _mean(lengths)])

    def paired(self) -> float | None:
        """``bias/length_paired`` (module docstring), or None before a trained step lies
        within the audit steps' span."""
        audits = sorted(self.audit_steps)
        ratio = n = 0.0
        for step, tokens, count in self.trained_steps:
            uncut = _between(audits, step)
            if uncut is not None:
                ratio += tokens / uncut
                n += count
        return ratio / n - 1.0 if n else None

    def metrics(self) -> dict[str, float]:
        """``bias/length_run``, ``bias/length_paired`` (measured) and
        ``bias/length_replay_mean`` (the audit replays' mean), once an audit step ran."""
        if not (self.audit_n and self.trained_n and self.audit_tokens):
            return {}
        trained = self.trained_tokens / self.trained_n
        audit = self.audit_tokens / self.audit_n
        out = {
            "bias/length_run": trained / audit - 1.0,
            "bias/length_replay_mean": self.replay_sum / self.replay_n,
            "length/trained_run_mean": trained,
            "length/audit_run_mean": audit,
        }
        paired = self.paired()
        if paired is not None:
            out["bias/length_paired"] = paired
        return out

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for k in self.__dataclass_fields__:
            if k in state:
                value = state[k]
                kind = type(getattr(self, k))
                setattr(self, k, [list(v) for v in value] if kind is list else kind(value))
