"""The trainer's over-sampling budget: what a step launches beyond its batch and what becomes
of it, over the run — the long-round queue (``rollout/long_rounds.py``), the adaptive cut
(``rollout/adapt.py``), the length ledger (``algo/length_bias.py``), the group filter's
first-round size and the count of steps it emptied (``algo/filter.py``). One object, so the trainer's checkpoint holds
it as one entry (``state_dict``) and the step reads as a flow.

Every decision here depends only on the merged step (the same on every rank) and on values
rank 0 broadcasts (the overhead seconds the adaptive cut learns from), so every rank of a
job launches the same samples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tailcut.algo.batch import RowPlan
from tailcut.algo.filter import FirstRound
from tailcut.algo.length_bias import LengthLedger, audit_length_bias
from tailcut.config import CutoffConfig
from tailcut.rollout.adapt import ADAPTABLE, AdaptiveCut, cutoff_update, share_of
from tailcut.rollout.long_rounds import (
    LongRound,
    LongRoundQueue,
    join_kept,
    open_long_round,
    prompts_of_groups,
    withhold_cut_groups,
)
from tailcut.types import Sample


class Budget:
    def __init__(
        self, cfg: CutoffConfig, batch_size: int, first_round: FirstRound | None = None
    ) -> None:
        self.cfg = cfg
        self.batch_size = batch_size
        self.first_round = first_round
        """``algo.filter_first_round=learned``: the first round sized for the filter."""
        self.long = LongRoundQueue() if cfg.long_rounds else None
        self.long_size = cfg.long_round_prompts or batch_size
        self.adapt: AdaptiveCut | None = None
        if cfg.adapt:
            if cfg.policy not in ADAPTABLE:
                raise ValueError(
                    f"cutoff.adapt: adapts the cut of {', '.join(ADAPTABLE)}, not "
                    f"cutoff.policy={cfg.policy}"
                )
            self.adapt = AdaptiveCut(
                share_of(cfg.policy, cfg.abort_ratio, cfg.over_provision),
                cfg.adapt_min, cfg.adapt_max, max_change=cfg.adapt_max_change,
                max_length_bias=cfg.max_length_bias, history=cfg.history,
            )  # fmt: skip
        self.ledger = LengthLedger()
        self.skipped_steps = 0
        self.audit_pending = False
        """An audit step fell on a long round (never cut anyway): the next step audits."""
        self.step_metrics: dict[str, float] = {}

    # -- before the step ------------------------------------------------------------------

    def cutoff(self) -> CutoffConfig:
        """The cut-off config of this step (the adaptive share applied)."""
        if self.adapt is None:
            return self.cfg
        return self.cfg.model_copy(update=cutoff_update(self.cfg.policy, self.adapt.share))

    def first_round_groups(self) -> int:
        """Fresh groups the step's first round launches (``data.batch_size``, or more for
        the group filter: ``batch/first_round_groups``)."""
        n = self.batch_size if self.first_round is None else self.first_round.groups()
        self.step_metrics["batch/first_round_groups"] = float(n)
        return n

    def audit_due(self, step: int, every: int, long_round: bool) -> bool:
        """Whether ``step`` runs uncut to audit (``cutoff.audit_every``); one that falls on
        a long round moves to the next short step."""
        due = self.audit_pending or (bool(every) and step % every == 0)
        self.audit_pending = due and long_round
        return due and not long_round

    def long_round_due(self, step: int, workers: int = 1) -> bool:
        """Whether ``step`` runs a long round: the queue is full, or a withheld group would
        expire after this step (``long/early_round``: 1 on a round run for that). A round
        spreads whole groups over the rollout ``workers``, so it waits for at least one
        queued prompt each (an expiring group with fewer queued runs again whole later)."""
        if self.long is None:
            return False
        full = self.long.ready(self._round_size(workers))
        early = (
            not full
            and len(self.long) >= workers
            and self.long.expiring(step, self.cfg.max_staleness)
        )
        self.step_metrics["long/early_round"] = float(early)
        return full or early

    def _round_size(self, workers: int) -> int:
        """Prompts a long round takes: ``long_round_prompts``, at least one per worker."""
        return max(self.long_size, workers)

    def take_long_round(self, step: int, workers: int = 1) -> LongRound:
        """The oldest queued prompts (``long_round_prompts``, at least one per rollout
        worker): withheld groups within ``cutoff.max_staleness`` are completed (cut members
        resumed, finished ones kept), the others run whole, fresh."""
        assert self.long is not None
        lr = open_long_round(
            self.long.take(self._round_size(workers)), step, self.cfg.max_staleness
        )
        self._add("long/kept_groups", lr.kept_groups)
        self._add("long/kept_rows", len(lr.kept))
        self._add("long/resumed_members", len(lr.resumed))
        self._add("long/rerun_groups", len(lr.prompts))
        self._add("long/expired_rows", lr.expired_rows)
        self.step_metrics["long/kept_lag_max"] = float(lr.lag_max)
        return lr

    @staticmethod
    def join_kept(plan: RowPlan, lr: LongRound | None) -> RowPlan:
        """A long round's rows with its kept finished members (their groups whole)."""
        return plan if lr is None else join_kept(plan, lr.kept)

    # -- during the step ------------------------------------------------------------------

    def withhold(self, plan: RowPlan, samples: Sequence[Sample], step: int) -> RowPlan:
        """Long rounds (drop, mask): the rows of groups with a cut member leave the plan;
        each group joins the queue with its finished members (kept, ``long/withheld_kept``)
        and its cut ones (resumed in the long round, ``long/withheld_cut``)."""
        if self.long is None:
            return plan
        w = withhold_cut_groups(plan, samples, step)
        self.long.push_entries(w.entries)
        self._add("long/withheld_groups", len(w.groups))
        self._add("long/withheld_rows", w.rows)
        self._add("long/withheld_kept", w.kept)
        self._add("long/withheld_cut", w.cut)
        return w.plan

    def queue_lost(self, lost: Sequence[Sample], step: int) -> None:
        """Long rounds (partial): the prompts of trajectories past ``max_staleness``."""
        if self.long is None or not lost:
            return
        groups = list(dict.fromkeys(s.group for s in lost))
        self._add("long/expired_groups", self.long.push(prompts_of_groups(lost, groups), step))

    def audit(self, samples: Sequence[Sample], n_keep: int, step: int) -> float:
        """``bias/length`` of an uncut step, the cut replayed under this run's mode."""
        bias = audit_length_bias(
            samples, n_keep, self.cfg.aborted, self.cfg.long_rounds, self.cfg.max_staleness
        )
        self.ledger.audit(samples, bias, step)
        return bias

    def _add(self, key: str, n: int) -> None:
        self.step_metrics[key] = self.step_metrics.get(key, 0.0) + n

    # -- after the step -------------------------------------------------------------------

    def observe_filter(self, informative: int, groups: int) -> None:
        """The group filter's share of one step: ``informative`` groups of ``groups``."""
        if self.first_round is not None:
            self.first_round.observe(informative, groups)

    def learn(self, samples: Sequence[Sample], overhead_s: float) -> None:
        """The adaptive cut learns from the step's first round (``overhead_s``: its update
        and sync seconds, as rank 0 measured them) and picks the next step's share."""
        if self.adapt is None:
            return
        used = self.adapt.share
        self.adapt.observe(samples, overhead_s)
        choice = self.adapt.choose()
        m = self.step_metrics
        m["cutoff/share"] = used
        m.update({f"cutoff/{k}": v for k, v in cutoff_update(self.cfg.policy, used).items()})
        m["cutoff/next_share"] = choice.share
        m["cutoff/predicted_rate"] = choice.rate
        m["cutoff/predicted_length_bias"] = choice.length_bias

    def metrics(self) -> dict[str, float]:
        """This step's budget figures (then reset) and the run's so far."""
        out, self.step_metrics = self.step_metrics, {}
        if self.long is not None:
            out["long/queued"] = float(len(self.long))
            out["long/queued_total"] = float(self.long.queued_total)
            out["long/run_total"] = float(self.long.run_total)
            out["long/rounds_total"] = float(self.long.rounds_total)
        out["batch/skipped_total"] = float(self.skipped_steps)
        out.update(self.ledger.metrics())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "long": self.long.state_dict() if self.long is not None else None,
            "adapt": self.adapt.state_dict() if self.adapt is not None else None,
            "ledger": self.ledger.state_dict(),
            "first_round": self.first_round.state_dict() if self.first_round else None,
            "skipped_steps": self.skipped_steps,
            "audit_pending": self.audit_pending,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.long is not None and state.get("long"):
            self.long.load_state_dict(state["long"])
        if self.adapt is not None and state.get("adapt"):
            self.adapt.load_state_dict(state["adapt"])
        self.ledger.load_state_dict(state.get("ledger") or {})
        if self.first_round is not None and state.get("first_round"):
            self.first_round.load_state_dict(state["first_round"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.audit_pending = bool(state.get("audit_pending", False))
