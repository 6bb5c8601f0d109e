"""Long rounds (``cutoff.long_rounds``): cut samples are not lost, their groups come back.

A cut keeps the step short, but what it cuts is not a random subset: the long samples, and
the prompts that make them. Trained on what is left, the policy sees a length distribution
shorter than the data's (``bias/length``). With long rounds::

    short step:  launch, cut ─► groups with every member finished are trained
                              └► a group with a cut member is withheld: none of its rows
                                 trained now; its finished members are kept and its cut
                                 members (their tokens so far) wait with its prompt
                 (partial: trajectories resume as usual; one past cutoff.max_staleness
                  queues its prompt instead of being dropped)
    long round:  once cutoff.long_round_prompts prompts are queued — or sooner, at the
                 last step a withheld group can wait (its members would expire) — the
                 next step runs them uncut (wait-all), with the resumed partial
                 trajectories: the tail
                 batched with the tail. A withheld group's cut members resume from where
                 they were cut and finish; its kept finished members join the batch, so
                 the group is trained whole — the very draws a wait-all step would have
                 made, each at its full length. A group waited longer than
                 cutoff.max_staleness steps (or a prompt queued without members, partial)
                 runs a fresh whole group instead.

Why resume the cut members rather than draw new ones for the missing places: the finished
members are the group's short draws (they finished before the cut); a fresh draw in place
of a cut one is an unconditional draw, short as often as any, so the completed group would
hold more short samples than a real group (bias toward short). Resuming continues the very
draws that were long, so the group and its statistics are those of the real group.

Staleness: a kept member and a resumed member's tokens were sampled by the policy of their
short step; a group is kept only while ``long round step − short step ≤ max_staleness``
(the bound of ``partial``'s resumed trajectories), else it is let go and re-run whole and
fresh (``long/expired_rows``). Every token keeps its weight version and behaviour log-prob;
π_old is recomputed by the actor (or taken from the engine) per token, so the ratio is
corrected as for ``partial``, and the version lag is in ``train/version_lag*``.

The queue (prompts, kept and cut members) is part of the trainer's checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tailcut.algo.batch import RowPlan
from tailcut.rollout.partial import resume_copy
from tailcut.types import FINISHED, Sample, Status


@dataclass(slots=True)
class QueuedPrompt:
    data: dict[str, Any]
    """The prompt row (as the dataset gave it)."""
    queued_step: int
    finished: list[Sample] = field(default_factory=list)
    """A withheld group's finished members (with their rewards), trained in the long round."""
    cut: list[Sample] = field(default_factory=list)
    """A withheld group's cut (ABORTED) members, resumed uncut in the long round."""

    @property
    def members(self) -> int:
        return len(self.finished) + len(self.cut)


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
        """Prompts without members (a fresh whole group each in the long round)."""
        return self.push_entries(QueuedPrompt(dict(data), step) for data in prompts)

    def push_entries(self, entries: Iterable[QueuedPrompt]) -> int:
        n = 0
        for e in entries:
            self.entries.append(e)
            n += 1
        self.queued_total += n
        return n

    def ready(self, size: int) -> bool:
        """A long round is due: at least ``size`` prompts are queued."""
        return len(self.entries) >= size

    def expiring(self, step: int, max_staleness: int) -> bool:
        """A withheld group with cut members (one :func:`open_long_round` would complete)
        is at its last step within ``max_staleness``: a long round at ``step`` still
        completes it, one later would let its members go."""
        return max_staleness > 0 and any(
            e.cut and step - e.queued_step == max_staleness for e in self.entries
        )

    def take(self, size: int) -> list[QueuedPrompt]:
        """The oldest ``size`` prompts, out of the queue."""
        out, self.entries = self.entries[:size], self.entries[size:]
        self.run_total += len(out)
        self.rounds_total += 1
        return out

    def state_dict(self) -> dict[str, object]:
        return {
            "entries": [(e.data, e.queued_step, e.finished, e.cut) for e in self.entries],
            "queued_total": self.queued_total,
            "run_total": self.run_total,
            "rounds_total": self.rounds_total,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Also reads a queue saved before members were kept (``(data, step)`` entries)."""
        self.entries = []
        for entry in state.get("entries", []):
            data, step, *members = entry
            finished, cut = (list(members[0]), list(members[1])) if members else ([], [])
            self.entries.append(QueuedPrompt(dict(data), int(step), finished, cut))
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
    """Groups with a cut member, in launch order: withheld, to queue."""
    rows: int
    """Rows of those groups taken out of the plan (finished members and masked rows)."""
    entries: list[QueuedPrompt] = field(default_factory=list)
    """One queue entry per withheld group: its prompt, finished and cut members."""

    @property
    def kept(self) -> int:
        return sum(len(e.finished) for e in self.entries)

    @property
    def cut(self) -> int:
        return sum(len(e.cut) for e in self.entries)


def withhold_cut_groups(plan: RowPlan, samples: Sequence[Sample], step: int = 0) -> Withheld:
    """``plan`` without any row of a group that has an ABORTED member in ``samples``; each
    such group's finished members (those with a reward) and cut members go in its entry
    (a FAILED member stays failed: the group is one short, as in any step)."""
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
    by_group: dict[int, QueuedPrompt] = {}
    for g, data in zip(cut, prompts_of_groups(samples, cut), strict=True):
        by_group[g] = QueuedPrompt(data, step)
    for s in samples:
        e = by_group.get(s.group)
        if e is None:
            continue
        if s.status in FINISHED and s.reward is not None:
            e.finished.append(s)
        elif s.status is Status.ABORTED:
            e.cut.append(s)
    out = RowPlan(rows, valid, plan.deferred, counts, plan.surplus)
    return Withheld(out, cut, len(plan.samples) - len(rows), list(by_group.values()))


@dataclass(slots=True)
class LongRound:
    """What a long round launches and trains, from the queue entries it took."""

    prompts: list[dict[str, Any]] = field(default_factory=list)
    """Prompts run as a fresh whole group (queued without members, or expired)."""
    resumed: list[Sample] = field(default_factory=list)
    """PENDING copies of kept groups' cut members, to launch (``resumed_from_step`` set)."""
    kept: list[Sample] = field(default_factory=list)
    """Kept groups' finished members: rows of the long round, with the resumed members."""
    kept_groups: int = 0
    expired_rows: int = 0
    """Finished members let go: their group waited past ``max_staleness``."""
    lag_max: int = 0
    """Steps between the oldest kept group's short step and the long round."""


def open_long_round(entries: Sequence[QueuedPrompt], step: int, max_staleness: int) -> LongRound:
    """Split the entries of a long round at ``step``: a group with members waited at most
    ``max_staleness`` steps is completed (cut members resumed, finished ones kept); the
    others run a fresh whole group."""
    out = LongRound()
    for e in entries:
        age = step - e.queued_step
        if e.cut and age <= max_staleness:
            out.resumed.extend(resume_copy(s, e.queued_step) for s in e.cut)
            out.kept.extend(e.finished)
            out.kept_groups += 1
            out.lag_max = max(out.lag_max, age)
        else:
            out.prompts.append(dict(e.data))
            out.expired_rows += len(e.finished)
    return out


def join_kept(plan: RowPlan, kept: Sequence[Sample]) -> RowPlan:
    """``plan`` with the kept finished members as real rows, first (their groups complete
    with the resumed members among the plan's rows)."""
    if not kept:
        return plan
    counts = replace(plan.counts, real=plan.counts.real + len(kept))
    return RowPlan(
        [*kept, *plan.samples], [True] * len(kept) + plan.valid, plan.deferred, counts,
        plan.surplus,
    )  # fmt: skip
