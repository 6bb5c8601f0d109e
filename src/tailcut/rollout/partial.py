"""Partial-rollout buffer: cut-off trajectories resumed in a later step (``cutoff.aborted=partial``).

An ABORTED sample keeps everything it had when the step cut it: prompt, the response tokens so
far (including a half-finished turn), their loss mask, the behaviour log-prob and the weight
version of every sampled token, its turns and messages. The next step takes it back, resets
its status to PENDING and launches it again; the agent loop re-submits *prompt + tokens so far*
and carries on. Tokens keep the version and log-prob of the policy that sampled them: π_old is
the current actor's (recomputed), so the PPO ratio is 1 on them and the rollout correction
weighs them by π_old/μ (``algo.rollout_correction``, token-tis unless set otherwise).

Staleness: a trajectory first launched at step ``s0`` may be resumed at step ``s`` only while
``s − s0 ≤ max_staleness``; older ones are dropped and counted (``max_staleness = 0`` makes
``partial`` the same as ``drop``).

Group baselines: members of a trajectory's group that finished in the step where it was cut
were trained then. Their rewards are kept here (``baseline_rewards``) so that the resumed
trajectory's advantage is still measured against its own group. A finished member's reward
is kept whether or not its row was trained (``algo.small_group=drop`` may leave a lone
member out of the batch): it is still a draw of the group's reward.

The trainer meets the buffer twice a step, both times before the advantages: ``take`` when
it launches the step, ``settle`` once the step's rows are planned (the deferred samples go
in, the group baselines come out as one value).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tailcut.algo.batch import RowPlan
from tailcut.types import Sample, Status


@dataclass(slots=True)
class PartialEntry:
    sample: Sample
    started_step: int
    """The step that first launched this trajectory."""


@dataclass(slots=True)
class TakeResult:
    resumed: list[Sample]
    """Fresh PENDING copies to launch this step (``index`` set by the caller)."""


@dataclass
class PartialBuffer:
    """Aborted trajectories waiting to be resumed, oldest first."""

    max_staleness: int = 1
    entries: list[PartialEntry] = field(default_factory=list)
    baselines: dict[int, list[float]] = field(default_factory=dict)
    """group id → rewards of its members that finished in earlier steps."""
    dropped_total: int = 0
    lost: list[Sample] = field(default_factory=list)
    """Trajectories dropped for staleness since the last :meth:`pop_lost`: cut again too
    late to resume (``add``) or left waiting too long (``take``); the step's
    ``partial/expired``, and with ``cutoff.long_rounds`` their prompts go to the long-round
    queue."""

    def __len__(self) -> int:
        return len(self.entries)

    def add(
        self,
        aborted: Iterable[Sample],
        step: int,
        finished_rewards: Mapping[int, Sequence[float]] | None = None,
    ) -> int:
        """Keep the ABORTED samples of ``step``; ``finished_rewards`` are the rewards of the
        members of their groups that finished in ``step``. Returns how many were added."""
        added = 0
        finished_rewards = finished_rewards or {}
        seen_groups: set[int] = set()
        for s in aborted:
            if s.status is not Status.ABORTED:
                raise ValueError(
                    f"sample {s.index} (group {s.group}) is {s.status.value}; only aborted "
                    "samples go to the partial-rollout buffer"
                )
            started = s.resumed_from_step if s.resumed_from_step is not None else step
            if step + 1 - started > self.max_staleness:
                self._drop(s)
                continue
            self.entries.append(PartialEntry(s, started))
            base = self.baselines.setdefault(s.group, [])
            if s.group not in seen_groups:
                seen_groups.add(s.group)
                base.extend(float(r) for r in finished_rewards.get(s.group, ()))
            added += 1
        return added

    def _drop(self, s: Sample) -> None:
        self.dropped_total += 1
        self.lost.append(s)
        if not any(e.sample.group == s.group for e in self.entries):
            self.baselines.pop(s.group, None)

    def take(self, step: int, limit: int | None = None) -> TakeResult:
        """Remove up to ``limit`` trajectories (oldest first) that may still run at ``step``."""
        out = TakeResult(resumed=[])
        keep: list[PartialEntry] = []
        for e in self.entries:
            if step - e.started_step > self.max_staleness:  # left waiting (``limit``)
                self.dropped_total += 1
                self.lost.append(e.sample)
            elif limit is None or len(out.resumed) < limit:
                out.resumed.append(resume_copy(e.sample, e.started_step))
            else:
                keep.append(e)
        self.entries = keep
        live = {e.sample.group for e in keep} | {s.group for s in out.resumed}
        self.baselines = {g: r for g, r in self.baselines.items() if g in live}
        return out

    def settle(self, step: int, rows: RowPlan) -> dict[int, list[float]]:
        """The step's one exchange with the buffer, before its advantages: returns the
        baselines of the rows' groups (rewards of members that finished in earlier steps), then
        keeps the step's deferred samples with their groups' finished rewards (trained or
        surplus past the cut's quota), and forgets the groups that have nothing left in
        flight."""
        groups = rows.groups
        baselines = self.baseline_rewards(groups)
        finished: dict[int, list[float]] = {}
        real = [s for s, ok in zip(rows.samples, rows.valid, strict=True) if ok]
        for s in (*real, *rows.surplus):  # a surplus finisher is a draw of its group too
            if s.reward is not None:
                finished.setdefault(s.group, []).append(float(s.reward))
        self.add(rows.deferred, step, finished)
        self.release(groups)
        return baselines

    def pop_lost(self) -> list[Sample]:
        """The trajectories dropped for staleness since the last call (then forgotten)."""
        out, self.lost = self.lost, []
        return out

    def baseline_rewards(self, groups: Iterable[int]) -> dict[int, list[float]]:
        """Rewards of members that finished in earlier steps, for ``groups`` (the advantage's
        baseline-only rewards)."""
        return {g: list(self.baselines[g]) for g in set(groups) if g in self.baselines}

    def release(self, groups: Iterable[int]) -> None:
        """Forget the baselines of groups that have no trajectory left in flight."""
        pending = {e.sample.group for e in self.entries}
        for g in set(groups) - pending:
            self.baselines.pop(g, None)

    def state_dict(self) -> dict[str, object]:
        """Picklable state for checkpoints."""
        return {
            "max_staleness": self.max_staleness,
            "entries": [(e.sample, e.started_step) for e in self.entries],
            "baselines": {g: list(r) for g, r in self.baselines.items()},
            "dropped_total": self.dropped_total,
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        entries = state["entries"]
        baselines = state["baselines"]
        assert isinstance(entries, list) and isinstance(baselines, dict)
        self.entries = [PartialEntry(s, int(st)) for s, st in entries]
        self.baselines = {int(g): [float(x) for x in r] for g, r in baselines.items()}
        dropped = state.get("dropped_total", 0)
        self.dropped_total = int(dropped) if isinstance(dropped, int) else 0


def resume_copy(s: Sample, started_step: int) -> Sample:
    """A PENDING copy of an aborted sample that keeps every token, mask, log-prob, version,
    turn and message; ``resumed_from_step`` records the step that first launched it."""
    fresh = copy.deepcopy(s)
    fresh.status = Status.PENDING
    fresh.finish_reason = None
    fresh.reward = None
    fresh.reward_info = {}
    fresh.error = None
    fresh.active_request_id = None
    fresh.launched_at = None
    fresh.ended_at = None
    fresh.resumed_from_step = started_step
    return fresh
