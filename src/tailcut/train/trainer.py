"""The GRPO training loop: rollout (over-sampled, cut) → rewards → advantages → batch →
policy update → weight sync → validation (never cut) → log → checkpoint.

One step ``k`` (1-based)::

    resumed partial trajectories + fresh prompts × group size (a long round: the queued
    prompts, uncut; train/budget.py) ─► rollout workers
      (``rollout.workers``; one cut-off policy over all of them, train/rollout_pool.py)
      ─► plan_rows (drop | mask | partial; deferred samples into the partial buffer,
         group baselines out of it; long rounds: groups with a cut member withheld)
      ─► algo.filter_groups: extra launch rounds until the batch is full, then the
         uninformative groups dropped ─► advantages over real members
      ─► assemble ─► actor.update (in a worker thread) ─► weight sync (version k)
      ─► every val_every: validation with wait-all ─► the metrics row (flushed)
      ─► every save_every: checkpoint (after the row: no crash loses a step's row)

Everything a continued run needs is in the checkpoint (``train/checkpoint.py``); a run
started with ``trainer.resume=auto`` in the same directory continues where the last
checkpoint left off and gives the same next-step loss as the uninterrupted run; the run
directory is checked first (``train/run_dir.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape

from tailcut.algo.advantage import compute_advantages
from tailcut.algo.batch import RowPlan, TrainBatch, assemble, keep_rows, plan_rows
from tailcut.algo.buffers import BatchBuffers
from tailcut.algo.filter import (
    FirstRound,
    concat_plans,
    filter_groups,
    groups_to_launch,
    informative_groups,
)
from tailcut.algo.metrics import (
    batch_metrics,
    carried_work,
    failure_summary,
    filter_metrics,
    partial_metrics,
    rollout_metrics,
    timing_metrics,
    validation_metrics,
)
from tailcut.engine.base import Engine, memory_metrics, release_for_training, resume_for_rollout
from tailcut.errors import TailcutError
from tailcut.rollout.cutoff import CutoffPolicy, WaitAll, make_policy
from tailcut.rollout.long_rounds import LongRound
from tailcut.rollout.partial import PartialBuffer, TakeResult
from tailcut.rollout.scheduler import run_step
from tailcut.rollout.seeds import TRAIN_STREAM, VALIDATION_STREAM, seed_samples
from tailcut.rollout.step import RolloutFn, StepResult
from tailcut.rollout.workers import WorkerRecipe, Workers, plan_for_policy
from tailcut.trace.events import Tracer
from tailcut.train import checkpoint as ckpt
from tailcut.train.actor import Actor
from tailcut.train.budget import Budget
from tailcut.train.config import TrainConfig
from tailcut.train.distributed import Ranks
from tailcut.train.loggers import Loggers, make_loggers, truncate_jsonl
from tailcut.train.prompts import PromptStream
from tailcut.train.rollout_pool import make_workers
from tailcut.train.run_dir import check_run_dir, claim_run_dir
from tailcut.train.sample_log import FILE as SAMPLE_LOG
from tailcut.train.sample_log import SampleLog, prompt_key
from tailcut.train.weight_sync import WeightSync
from tailcut.types import Sample


@dataclass
class TrainSetup:
    """What the loop drives; ``app/train_setup.py`` makes it from the config, tests make their own."""

    actor: Actor
    engine: Engine
    rollout: RolloutFn
    val_rollout: RolloutFn
    train_prompts: Sequence[Mapping[str, Any]]
    val_prompts: Sequence[Mapping[str, Any]]
    pad_id: int
    reward_seconds: Callable[[], float] | None = None
    """Total seconds spent in reward functions so far (for the timing shares)."""
    close: Callable[[], Any] | None = None
    recipe: WorkerRecipe | None = None
    """``rollout.backend=ray``: builds each worker's engine client and rollout fn
    inside its actor (picklable). Local workers all drive ``engine`` with ``rollout``."""
    ranks: Ranks = field(default_factory=Ranks.single)
    """This process's place in a job of several ranks (``train/distributed.py``): its
    ``engine`` is its own, colocated one; the actor is sharded over the ranks."""


@dataclass
class TrainSummary:
    run_dir: Path
    steps_done: int
    resumed_from: int | None
    final_val_reward: float | None
    wall_s: float
    history: list[dict[str, float]] = field(default_factory=list)


EXTRA_ROUND_STREAM = 1000
"""Seed stream of a step's extra launch round ``r`` (``algo.filter_groups``): ``1000 + r``,
apart from the training (0) and validation (1) streams, so a round samples anew."""


class TooManyFailures(TailcutError):
    """More of a step's samples FAILED than ``trainer.max_failed_fraction`` allows."""


FaultHook = Callable[[int, str], None]
"""``fault(step, phase)`` is called at each phase of a step (tests inject crashes)."""


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        setup: TrainSetup,
        *,
        console: Console | None = None,
        fault: FaultHook | None = None,
    ) -> None:
        self.cfg = cfg
        self.setup = setup
        self.ranks = setup.ranks
        self.actor = setup.actor
        self.console = console or Console()
        self.fault = fault or (lambda step, phase: None)
        self.run_dir = Path(cfg.trainer.run_dir)
        self.prompts = PromptStream(
            setup.train_prompts, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle
        )
        self.partial = cfg.cutoff.aborted == "partial"
        self.buffer = PartialBuffer(max_staleness=cfg.cutoff.max_staleness)
        self.policy_state: dict[str, Any] = {}
        self.predictor_states: list[dict[str, Any] | None] = []
        """Each rollout worker's length predictor (``rollout.schedule``) as the last round
        left it: checkpointed, and a resumed run's workers start from it."""
        a = cfg.algo
        first_round = (
            FirstRound(cfg.data.batch_size, (1 + a.max_gen_rounds) * cfg.data.batch_size)
            if a.filter_groups != "none" and a.filter_first_round == "learned"
            else None
        )
        self.informative_quota = a.filter_groups != "none" and cfg.cutoff.policy == "group-quota"
        """The group filter under group-quota: the cut counts complete informative groups,
        and the filter's share is over the complete groups (the others were cut whole)."""
        self.budget = Budget(cfg.cutoff, cfg.data.batch_size, first_round)
        """Long rounds, the adaptive cut, the length ledger, skipped steps (checkpointed)."""
        self.next_group = 0
        self.step = 0
        self.train_s = 0.0
        """Seconds spent in steps so far (validation and checkpoints excluded)."""
        self.history: list[dict[str, float]] = []
        self.weight_sync = WeightSync(cfg.sync, self.run_dir, self.ranks)
        self.workers: Workers | None = None
        self.batch_buffers = BatchBuffers()
        """Reused by every step's batch (a step's batch is done with before the next)."""
        self.sample_log = (
            SampleLog(self.run_dir / SAMPLE_LOG)
            if cfg.trainer.sample_log and self.ranks.is_main
            else None
        )
        self.drawn: list[str] = []
        """Keys of the prompts this step drew (``trainer.sample_log``)."""

    # -- run ------------------------------------------------------------------------------

    async def run(self, progress: Callable[[int, int], None] | None = None) -> TrainSummary:
        started = time.monotonic()
        t = self.cfg.trainer
        main = self.ranks.is_main  # rank 0 alone writes the run dir's files
        plan = check_run_dir(self.cfg) if main else None  # refused before anything is written
        self.ranks.barrier()
        resumed = self._restore()
        if resumed is None and main:  # a fresh start rewrites the sample log, as the metrics
            truncate_jsonl(self.run_dir / SAMPLE_LOG, 0)
        if plan is not None:
            claim_run_dir(plan, self.cfg, self._warn)
        loggers = Loggers([])
        if main:
            loggers = make_loggers(
                t.loggers, self.run_dir, console=self.console,
                config=self.cfg.model_dump(mode="json"), wandb_project=t.wandb_project,
                append=resumed is not None,
            )  # fmt: skip
        checkpoint_s: float | None = None
        try:
            self.workers = await make_workers(
                self.cfg, self.setup.engine, self.setup.rollout, self.setup.recipe, self.run_dir,
                self.ranks, self.predictor_states,
            )  # fmt: skip
            await self._sync_weights()
            if resumed is None and self._val_enabled():
                loggers.log(0, await self._validate(0))
            while self.step < t.steps:
                k = self.step + 1
                metrics = await self._one_step(k)
                self.step = k
                self.train_s += metrics["timing/step_s"]
                metrics["timing/train_total_s"] = self.train_s
                last = k == t.steps or (t.max_train_s is not None and self.train_s >= t.max_train_s)
                last = self.ranks.broadcast(last)  # rank 0's clock decides for every rank
                if self._val_enabled() and (last or (t.val_every and k % t.val_every == 0)):
                    metrics.update(await self._validate(k))
                if checkpoint_s is not None:  # the checkpoint written after the step before
                    metrics["timing/checkpoint_s"], checkpoint_s = checkpoint_s, None
                self.history.append(metrics)
                # The step's metrics are committed before its checkpoint: a crash between
                # the two resumes from the previous checkpoint, and _restore drops the rows
                # past it, so every step's row is written exactly once by the run that kept it.
                loggers.log(k, metrics)
                self.fault(k, "logged")
                if last or (t.save_every and k % t.save_every == 0):
                    loggers.sync()
                    checkpoint_s = self._save(k)
                    self.fault(k, "saved")
                if progress is not None:
                    progress(k, t.steps)
                if last:
                    break
        finally:
            loggers.close()
            if self.workers is not None:
                await self.workers.aclose()
        final = next((h["val/reward"] for h in reversed(self.history) if "val/reward" in h), None)
        return TrainSummary(
            self.run_dir, self.step, resumed, final, time.monotonic() - started, self.history
        )

    def _val_enabled(self) -> bool:
        return self.cfg.data.val_size > 0 and len(self.setup.val_prompts) > 0

    # -- one step -------------------------------------------------------------------------

    async def _one_step(self, step: int) -> dict[str, float]:
        """rollout (and, with ``algo.filter_groups``, more rounds until the batch is full)
        → rows → group filter → advantages → batch → update → weight sync, in that order;
        each stage adds its metrics (built in ``algo/metrics``) as it ends. A long round
        (``cutoff.long_rounds``) runs the queued prompts uncut instead of fresh ones."""
        t0, reward_s0 = time.monotonic(), self._reward_s()
        self.drawn = []
        self.fault(step, "rollout")
        taken = self.buffer.take(step) if self.partial else TakeResult(resumed=[])
        assert self.workers is not None, "run() starts the rollout workers"
        workers = self.workers.n_workers
        long_round = self.budget.long_round_due(step, workers)
        audit = self.budget.audit_due(step, self.cfg.cutoff.audit_every, long_round)
        planned = self.cfg.data.batch_size if long_round else self.budget.first_round_groups()
        policy = self._policy(
            planned * self.cfg.algo.group_size + len(taken.resumed), self.cfg.data.batch_size
        )
        lr = self.budget.take_long_round(step, workers) if long_round else None
        if lr is not None:  # withheld groups' cut members resume; other prompts run whole
            again = [*taken.resumed, *lr.resumed]
            samples = self._launch(step, again, len(again), lr.prompts)
        else:
            samples = self._launch(step, taken.resumed, policy.n_launch)
        carried = carried_work(samples)  # resumed trajectories' earlier steps' work
        result = await self._rollout(step, samples, policy, uncut=audit or long_round)
        keep = policy.would_keep(result.samples) if audit else None
        metrics = rollout_metrics(result, keep, carried)
        metrics["rollout/audit"] = float(audit)
        metrics["long/round"] = float(long_round)
        if audit:
            metrics["bias/length"] = self.budget.audit(
                result.samples, policy.would_keep(result.samples), step
            )
        rows, informative, seen = await self._fill(
            step, result, planned, audit or long_round, metrics, lr
        )
        rows = self.budget.join_kept(rows, lr)
        if not long_round:  # a long round's groups are the tail's, not the step's share
            self.budget.observe_filter(informative, seen)
        t_rollout, loop_rollout = time.monotonic(), asyncio.get_running_loop().time()
        baselines = None
        if self.partial:
            baselines = self.buffer.settle(step, rows)
            lost = self.buffer.pop_lost()
            self.budget.queue_lost(lost, step)
            buffered, dropped = len(self.buffer), self.buffer.dropped_total
            metrics.update(partial_metrics(len(taken.resumed), lost, buffered, dropped))
        a = self.cfg.algo
        target = self.cfg.data.batch_size if a.filter_groups != "none" else None
        filtered = filter_groups(rows, a.filter_groups, baselines, target)
        rows = filtered.plan
        adv = compute_advantages(
            rows.rewards, rows.groups, rows.valid, estimator=a.estimator,
            small_group=a.small_group, eps=a.adv_eps, baseline_rewards=baselines,
        )  # fmt: skip
        rows, advantages = keep_rows(rows, adv.advantages, adv.keep)
        metrics.update(filter_metrics(filtered, metrics.pop("batch/gen_rounds", 0.0)))
        trained = [s for s, ok in zip(rows.samples, rows.valid, strict=True) if ok]
        metrics["length/trained_mean"] = self.budget.ledger.trained(trained, step)
        if self.sample_log is not None:
            self.sample_log.write(step, self.drawn, trained)
        skip = self.ranks.broadcast(a.filter_groups != "none" and not trained)
        phases = {"rollout": t_rollout - t0}
        if skip:  # the filter left nothing to learn from: no update, no sync
            self.budget.skipped_steps += 1
            metrics["batch/skipped"] = 1.0
            phases["train"] = phases["sync"] = 0.0
        else:
            batch = assemble(rows, advantages, pad_id=self.setup.pad_id, buffers=self.batch_buffers)
            metrics.update(batch_metrics(batch, adv))
            phases["train"], phases["sync"] = await self._update(step, batch, metrics, t_rollout)
        if not long_round:  # the update's and sync's seconds on the clock the rollout ran on
            overhead = asyncio.get_running_loop().time() - loop_rollout
            self.budget.learn(result.samples, self.ranks.broadcast(overhead))
        metrics.update(self.budget.metrics())
        metrics.update(timing_metrics(phases, self._reward_s() - reward_s0))
        metrics.update(_rates(metrics, phases["train"]))
        return metrics

    async def _update(
        self, step: int, batch: TrainBatch, metrics: dict[str, float], since: float
    ) -> tuple[float, float]:
        """The engine steps aside (``engine.release_between_steps``), the actor updates, the
        engine takes its memory back and receives the new weights; adds their metrics and
        returns the training seconds (from ``since``, the rollout's end: the batch's
        assembly included) and the sync's."""
        self.fault(step, "update")
        mode = self.cfg.engine.release_between_steps
        released = await release_for_training(self.setup.engine, mode)
        try:
            metrics.update(await asyncio.to_thread(self.actor.update, batch))
        finally:  # before the sync, so that it writes into the engine's device memory
            resumed = await resume_for_rollout(self.setup.engine, mode)
        metrics.update(memory_metrics(released, resumed))
        metrics["train/version"] = float(self.actor.version)
        t_train = time.monotonic()
        self.fault(step, "sync")
        metrics.update(await self._sync_weights())
        return t_train - since, time.monotonic() - t_train

    def _rows(self, step: int, result: StepResult) -> tuple[RowPlan, int]:
        """A round's rows (``cutoff.aborted``), its failures checked, groups with a cut member
        withheld for a long round (``cutoff.long_rounds``, drop and mask); with the number
        of groups withheld."""
        self._check_failures(step, result)
        rows = plan_rows(result.samples, result.kept, self.cfg.cutoff.aborted)
        if self.partial:
            return rows, 0
        kept = self.budget.withhold(rows, result.samples, step)
        return kept, len(set(rows.groups) - set(kept.groups))

    async def _fill(
        self,
        step: int,
        first: StepResult,
        planned: int,
        uncut: bool,
        metrics: dict[str, float],
        lr: LongRound | None = None,
    ) -> tuple[RowPlan, int, int]:
        """The rows of the step's first round (``planned`` groups asked of its policy) and,
        with ``algo.filter_groups``, of extra rounds of fresh groups (cut by the same policy;
        at most ``algo.max_gen_rounds``) while fewer than ``data.batch_size`` groups are
        informative; with the rows, the informative groups and the groups they are a share
        of (``FirstRound``): the groups planned, not the over-provisioned ones launched, less
        those withheld for a long round (their rows come later) — under the informative
        quota, the complete groups kept. Rank 0's count decides for every rank. In a long
        round (``lr``) a group counts with its kept finished members joined: the rows it
        will train with."""
        plan, withheld = self._rows(step, first)
        plans = [plan]
        a, g = self.cfg.algo, self.cfg.algo.group_size
        seen = planned - withheld
        rounds = launched = good = 0
        while a.filter_groups != "none":
            rows = self.budget.join_kept(concat_plans(plans), lr)
            base = self.buffer.baseline_rewards(rows.groups) if self.partial else None
            good = int(self.ranks.broadcast(len(informative_groups(rows, base))))
            if rounds == 0:
                metrics["batch/first_round_informative"] = float(good)
            if self.informative_quota:  # the groups that completed before the cut (kept)
                kept = {s.group for s, ok in zip(rows.samples, rows.valid, strict=True) if ok}
                seen = int(self.ranks.broadcast(len(kept)))
            missing = self.cfg.data.batch_size - good
            if missing <= 0 or rounds >= a.max_gen_rounds:
                break
            assert self.workers is not None, "run() starts the rollout workers"
            n = (
                groups_to_launch(
                    missing, good, seen, cap=self.cfg.data.batch_size, floor=self.workers.n_workers
                )
                * g
            )
            rounds += 1
            policy = self._policy(n, missing)  # over-provision, group-quota: more than n
            stream = EXTRA_ROUND_STREAM + rounds
            samples = self._launch(step, [], policy.n_launch, stream=stream)
            result = await self._rollout(step, samples, policy, uncut=uncut, learn=False)
            plan, withheld = self._rows(step, result)
            plans.append(plan)
            seen += n // g - withheld  # (informative_quota: recounted from the rows)
            launched += len(samples)
        metrics["batch/gen_rounds"] = float(rounds)
        metrics["rollout/launched_extra"] = float(launched)
        # over-provision may withhold more groups than it planned: a share is at most 1
        return (plans[0] if len(plans) == 1 else concat_plans(plans)), good, max(seen, good)

    def _check_failures(self, step: int, result: StepResult) -> None:
        """Show the step's FAILED samples by cause; past ``trainer.max_failed_fraction`` of
        the ended ones (counted before refill: a relaunched sample that recovered counts),
        stop the run with those causes."""
        failures = failure_summary(result.samples)
        if result.recovered:
            self.console.print(
                f"[yellow]step {step}: {result.recovered} failed sample(s) relaunched and "
                f"recovered ({result.retries} relaunches)[/yellow]"
            )
        if not failures.failed and not result.recovered:
            return
        limit = self.cfg.trainer.max_failed_fraction
        ended = failures.ended
        if ended and result.failed_before_refill / ended > limit:
            raise TooManyFailures(
                f"step {step}: {failures.line()} (before refill {result.failed_before_refill}/"
                f"{ended}; over trainer.max_failed_fraction={limit}; each request is in the "
                f"traces under {self.run_dir / 'traces'})"
                if result.recovered
                else f"step {step}: {failures.line()} (over trainer.max_failed_fraction="
                f"{limit}; each request is in the traces under {self.run_dir / 'traces'})"
            )
        if failures.failed:
            self.console.print(f"[yellow]step {step}: {escape(failures.line())}[/yellow]")

    def _reward_s(self) -> float:
        return self.setup.reward_seconds() if self.setup.reward_seconds else 0.0

    def _policy(self, n_target: int, informative: int | None = None) -> CutoffPolicy:
        """A cut-off policy for ``n_target`` samples (built once a round, with the state it
        has learned and this step's adaptive share); with the group filter, group-quota cuts
        at ``informative`` complete informative groups (``informative_quota``)."""
        cfg = self.budget.cutoff()
        quota = informative if self.informative_quota else None
        policy = make_policy(cfg, n_target, self.cfg.algo.group_size, quota)
        policy.load_state_dict(self.policy_state)
        return policy

    def _launch(
        self,
        step: int,
        resumed: list[Sample],
        n_launch: int,
        rows: Sequence[Mapping[str, Any]] | None = None,
        stream: int = TRAIN_STREAM,
    ) -> list[Sample]:
        """Resumed partial trajectories first, then fresh groups up to ``n_launch`` (or, for
        a long round, one whole group of each of ``rows``): numbered once, in launch order
        over the round; fresh ones seeded by that number (an extra round: its own stream)."""
        g = self.cfg.algo.group_size
        if rows is None:
            rows = self.prompts.take(-(-(n_launch - len(resumed)) // g))
            n_fresh = n_launch - len(resumed)
            if self.sample_log is not None:
                self.drawn += [prompt_key(r) for r in rows]
        else:
            n_fresh = len(rows) * g
        fresh = [
            Sample(index=0, group=self.next_group + j // g, data=dict(rows[j // g]))
            for j in range(n_fresh)
        ]
        self.next_group += len(rows)
        samples = resumed + fresh
        for i, s in enumerate(samples):
            s.index = i
        seed_samples(fresh, self.cfg.trainer.seed, stream, step)  # resumed keep theirs
        return samples

    async def _rollout(
        self,
        step: int,
        samples: list[Sample],
        policy: CutoffPolicy,
        *,
        uncut: bool,
        learn: bool = True,
    ) -> StepResult:
        """One round over every worker, cut by ``policy`` (never cut on an audit step or a
        long round); ``learn``: the policy's learned state is kept (the first round)."""
        run_policy = WaitAll(len(samples), self.cfg.algo.group_size) if uncut else policy
        assert self.workers is not None, "run() starts the rollout workers"
        plan = plan_for_policy(run_policy, [s.group for s in samples], self.workers.n_workers)
        result = await self.workers.run_step(step, plan, samples)
        self.predictor_states = latest_states(self.predictor_states, result.predictor_states)
        if learn and not uncut:  # the policy that ran (a Ray worker's copy comes back)
            self.policy_state = (plan.coordinator_policy or plan.policies[0]).state_dict()
        return result

    async def _sync_weights(self) -> dict[str, float]:
        return await self.weight_sync(self.setup.engine, self.actor)

    # -- validation -----------------------------------------------------------------------

    async def _validate(self, step: int) -> dict[str, float]:
        """One sample per validation prompt with the wait-all policy: never cut; the same
        seeds every time, so differences are the policy's. With several ranks each rank's
        engine runs every world-th prompt (seeded by its place in the whole set) and the
        metrics are of all of them, the same on every rank."""
        t0 = time.monotonic()
        rows = list(self.setup.val_prompts)[: self.cfg.data.val_size]
        samples = [Sample(index=i, group=i, data=dict(r)) for i, r in enumerate(rows)]
        seed_samples(samples, self.cfg.trainer.seed, VALIDATION_STREAM, 0)
        mine = samples[self.ranks.rank :: self.ranks.world]
        for j, x in enumerate(mine):  # the scheduler's launch order; the seed stays the set's
            x.index = x.group = j
        result = await run_step(
            self.setup.engine, mine, self.setup.val_rollout, WaitAll(len(mine), 1),
            Tracer(None, step=step), abort_deadline_s=self.cfg.engine.abort_deadline_s,
            gc_pause=self.cfg.rollout.gc_pause,
        )  # fmt: skip
        if self.ranks.distributed:
            shares = await asyncio.to_thread(self.ranks.gather, result.samples)
            merged = [x for share in shares or [] for x in share]  # rank order
            merged = await asyncio.to_thread(self.ranks.broadcast, merged)
            result = dataclasses.replace(result, samples=merged)
        return validation_metrics(result, time.monotonic() - t0)

    # -- checkpoints ----------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "prompts": self.prompts.state_dict(),
            "next_group": self.next_group,
            "policy": self.policy_state,
            "predictors": self.predictor_states,
            "partial": self.buffer.state_dict(),
            "budget": self.budget.state_dict(),
            "train_s": self.train_s,
            "rng": ckpt.rng_state(),
        }

    def _save(self, step: int) -> float:
        """The checkpoint of ``step`` (every rank takes part): the actor's full state gathered
        and written by rank 0, or every rank's shards through DCP
        (``trainer.checkpoint_format``); either resumes on any number of ranks."""
        t0 = time.monotonic()
        sharded = self.cfg.trainer.checkpoint_format == "sharded"
        ckpt.save_checkpoint(
            self.run_dir,
            step,
            self.actor.save_dcp if sharded else self.actor.state_dict(),
            self._state(),
            keep=self.cfg.trainer.keep_checkpoints,
            before_rename=lambda: self.fault(step, "checkpoint"),
            ranks=self.ranks,
        )
        return time.monotonic() - t0

    def _restore(self) -> int | None:
        """Load the checkpoint ``trainer.resume`` names (auto, force: the run directory's
        newest intact one; a damaged newer one is skipped, saying which and why); returns its
        step (None: fresh). Metrics rows past that step are dropped: the run rewrites them."""
        how = self.cfg.trainer.resume
        self._seed_everything(self.cfg.trainer.seed)
        if how == "never":
            return None
        if how in ("auto", "force"):
            found = ckpt.load_latest(self.run_dir, self._warn)
            if found is None:
                return None
            path, actor, state = found
        else:
            path = Path(how)
            actor, state = ckpt.load_checkpoint(path)
        if isinstance(actor, Path):
            self.actor.load_dcp(actor)
        else:
            self.actor.load_state_dict(actor)
        self.step = int(state["step"])
        self.prompts.load_state_dict(state["prompts"])
        self.next_group = int(state["next_group"])
        self.policy_state = dict(state["policy"])
        self.predictor_states = list(state.get("predictors") or [])
        self.buffer.load_state_dict(state["partial"])
        self.budget.load_state_dict(state.get("budget") or {})
        self.train_s = float(state.get("train_s", 0.0))
        ckpt.set_rng_state(state["rng"])
        if self.ranks.is_main:
            truncate_jsonl(self.run_dir / "metrics.jsonl", self.step)
            truncate_jsonl(self.run_dir / SAMPLE_LOG, self.step)
        self.console.print(f"[green]resumed from {path} (step {self.step})[/green]")
        return self.step

    def _warn(self, line: str) -> None:
        self.console.print(f"[yellow]{escape(line)}[/yellow]")

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)


def _rates(metrics: dict[str, float], train_s: float) -> dict[str, float]:
    """The step's peak device memory (engine + actor, this process) and the update's rates
    (``Actor._throughput``)."""
    out: dict[str, float] = {}
    if torch.cuda.is_available():
        out["memory/peak_allocated_bytes"] = float(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
    if train_s > 0:
        out["perf/train_tokens_per_s"] = metrics["perf/train_tokens"] / train_s
        out["perf/train_tflops_per_s"] = metrics["perf/train_flops"] / train_s / 1e12
    return out


def latest_states(
    previous: Sequence[dict[str, Any] | None], new: Sequence[dict[str, Any] | None]
) -> list[dict[str, Any] | None]:
    """Each worker's predictor state after a round (every round teaches them): the round's,
    or the one before where the round brought none (a worker lost under
    ``cutoff.tolerate_worker_loss``), so that a checkpoint never forgets what it learned."""
    return [
        state if state is not None else (previous[i] if i < len(previous) else None)
        for i, state in enumerate(new)
    ]
