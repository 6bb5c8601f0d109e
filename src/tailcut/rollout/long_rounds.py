"""Long rounds (``cutoff.long_rounds``): cut samples are not lost, their prompts come back.

A cut keeps the step short, but what it cuts is not a random subset: the long samples, and
the prompts that make them. Trained on what is left, the policy sees a length distribution
shorter than the data's (``bias/length``). With long rounds::

    short step:  launch, cut ─► groups with every member finished are trained
                              └► a group with a cut member is withheld (none of its rows
                                 trained), its prompt queued
                 (partial: trajectories resume as usual; one past cutoff.max_staleness
                  queues its prompt instead of being dropped)
    long round:  once cutoff.long_round_prompts prompts are queued, the next step runs them,
                 a whole fresh group each, uncut (wait-all), with the resumed partial
                 trajectories: the tail batched with the tail

so every prompt is eventually trained on full-length samples, and a short step's time is
never set by a tail. The queue is part of the trainer's checkpoint (``state_dict``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tailcut.algo.batch import RowPlan
from tailcut.types import Sample, Status


@dataclass(slots=True)
class QueuedPrompt:
    data: dict[str, Any]
    """The prompt row (as the dataset gave it)."""
    queued_step: int


@dataclass
class LongRoundQueue:
    """Prompts waiting for a long round, oldest first."""

    entries: list[QueuedPrompt] = field(default_factory=list)
    queued_total: int = 0
    run_total: int = 0
    rounds_total: int = 0

    def __len__(self) -> int:
        return len(self.entries)

    def push(self, prompts: Iterable[Mapping[str, Any]], step: int) -> int:
        n = 0
        for data in prompts:
            self.entries.append(QueuedPrompt(dict(data), step))
            n += 1
        self.queued_total += n
        return n

    def ready(self, size: int) -> bool:
        """A long round is due: at least ``size`` prompts are queued."""
        return len(self.entries) >= size

    def take(self, size: int) -> list[QueuedPrompt]:
        """The oldest ``size`` prompts, out of the queue."""
        out, self.entries = self.entries[:size], self.entries[size:]
        self.run_total += len(out)
        self.rounds_total += 1
        return out

    def state_dict(self) -> dict[str, object]:
        return {
            "entries": [(e.data, e.queued_step) for e in self.entries],
            "queued_total": self.queued_total,
            "run_total": self.run_total,
            "rounds_total": self.rounds_total,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.entries = [QueuedPrompt(dict(d), int(s)) for d, s in state.get("entries", [])]
        self.queued_total = int(state.get("queued_total", 0))
        self.run_total = int(state.get("run_total", 0))
        self.rounds_total = int(state.get("rounds_total", 0))


def prompts_of_groups(samples: Sequence[Sample], groups: Iterable[int]) -> list[dict[str, Any]]:
    """One prompt row per group of ``groups`` (the data of its first sample), in order."""
    first: dict[int, Sample] = {}
    for s in samples:
        first.setdefault(s.group, s)
    return [dict(first[g].data) for g in dict.fromkeys(groups) if g in first]


@dataclass(frozen=True, slots=True)
class Withheld:
    plan: RowPlan
    groups: list[int]
    """Groups with a cut member, in launch order: withheld, their prompts to queue."""
    rows: int
    """Rows of those groups taken out of the plan (finished members and masked rows)."""


def withhold_cut_groups(plan: RowPlan, samples: Sequence[Sample]) -> Withheld:
    """``plan`` without any row of a group that has an ABORTED member in ``samples``."""
    cut = list(dict.fromkeys(s.group for s in samples if s.status is Status.ABORTED))
    if not cut:
        return Withheld(plan, [], 0)
    gone = set(cut)
    rows, valid = [], []
    for s, ok in zip(plan.samples, plan.valid, strict=True):
        if s.group not in gone:
            rows.append(s)
            valid.append(ok)
    real = sum(valid)
    counts = replace(plan.counts, real=real, masked=len(rows) - real)
    return Withheld(RowPlan(rows, valid, plan.deferred, counts), cut, len(plan.samples) - len(rows))
