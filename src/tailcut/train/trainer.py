"""The GRPO training loop: rollout (over-sampled, cut) → rewards → advantages → batch →
policy update → weight sync → validation (never cut) → log → checkpoint.

One step ``k`` (1-based)::

    resumed partial trajectories + fresh prompts × group size ─► rollout workers
      (``rollout.workers``; one cut-off policy over all of them, train/rollout_pool.py)
      ─► plan_rows (drop | mask | partial; deferred samples into the partial buffer,
         group baselines out of it) ─► advantages over real members
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
from tailcut.algo.batch import assemble, keep_rows, plan_rows
from tailcut.algo.buffers import BatchBuffers
from tailcut.algo.metrics import (
    batch_metrics,
    failure_summary,
    partial_metrics,
    rollout_metrics,
    timing_metrics,
    validation_metrics,
)
from tailcut.engine.base import Engine
from tailcut.errors import TailcutError
from tailcut.rollout.cutoff import CutoffPolicy, WaitAll, make_policy
from tailcut.rollout.partial import PartialBuffer, TakeResult
from tailcut.rollout.scheduler import run_step
from tailcut.rollout.seeds import TRAIN_STREAM, VALIDATION_STREAM, seed_samples
from tailcut.rollout.step import RolloutFn, StepResult
from tailcut.rollout.workers import WorkerRecipe, Workers, plan_for_policy
from tailcut.trace.events import Tracer
from tailcut.train import checkpoint as ckpt
from tailcut.train.actor import Actor
from tailcut.train.config import TrainConfig
from tailcut.train.distributed import Ranks
from tailcut.train.loggers import Loggers, make_loggers, truncate_jsonl
from tailcut.train.prompts import PromptStream
from tailcut.train.rollout_pool import make_workers
from tailcut.train.run_dir import check_run_dir, claim_run_dir
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
        self.next_group = 0
        self.step = 0
        self.train_s = 0.0
        """Seconds spent in steps so far (validation and checkpoints excluded)."""
        self.history: list[dict[str, float]] = []
        self.weight_sync = WeightSync(cfg.sync, self.run_dir)
        self.workers: Workers | None = None
        self.batch_buffers = BatchBuffers()
        """Reused by every step's batch (a step's batch is done with before the next)."""

    # -- run ------------------------------------------------------------------------------

    async def run(self, progress: Callable[[int, int], None] | None = None) -> TrainSummary:
        started = time.monotonic()
        t = self.cfg.trainer
        main = self.ranks.is_main  # rank 0 alone writes the run dir's files
        plan = check_run_dir(self.cfg) if main else None  # refused before anything is written
        self.ranks.barrier()
        resumed = self._restore()
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
                self.ranks,
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
        """rollout → rows → advantages → batch → update → weight sync, in that order; each
        stage adds its metrics (built in ``algo/metrics``) as it ends."""
        t0, reward_s0 = time.monotonic(), self._reward_s()
        self.fault(step, "rollout")
        taken = self.buffer.take(step) if self.partial else TakeResult(resumed=[])
        policy = self._policy(len(taken.resumed))
        samples = self._launch(step, taken.resumed, policy.n_launch)
        audit = bool(self.cfg.cutoff.audit_every) and step % self.cfg.cutoff.audit_every == 0
        result = await self._rollout(step, samples, policy, audit)
        self._check_failures(step, result)
        metrics = rollout_metrics(result, policy.would_keep(result.samples) if audit else None)
        metrics["rollout/audit"] = float(audit)
        t_rollout = time.monotonic()
        rows = plan_rows(result.samples, result.kept, self.cfg.cutoff.aborted)
        baselines = None
        if self.partial:
            baselines = self.buffer.settle(step, rows)
            metrics.update(partial_metrics(taken, len(self.buffer), self.buffer.dropped_total))
        a = self.cfg.algo
        adv = compute_advantages(
            rows.rewards, rows.groups, rows.valid, estimator=a.estimator,
            small_group=a.small_group, eps=a.adv_eps, baseline_rewards=baselines,
        )  # fmt: skip
        rows, advantages = keep_rows(rows, adv.advantages, adv.keep)
        batch = assemble(rows, advantages, pad_id=self.setup.pad_id, buffers=self.batch_buffers)
        metrics.update(batch_metrics(batch, adv))
        self.fault(step, "update")
        metrics.update(await asyncio.to_thread(self.actor.update, batch))
        metrics["train/version"] = float(self.actor.version)
        t_train = time.monotonic()
        self.fault(step, "sync")
        metrics.update(await self._sync_weights())
        phases = {"rollout": t_rollout - t0, "train": t_train - t_rollout}
        phases["sync"] = time.monotonic() - t_train
        metrics.update(timing_metrics(phases, self._reward_s() - reward_s0))
        return metrics

    def _check_failures(self, step: int, result: StepResult) -> None:
        """Show the step's FAILED samples by cause; past ``trainer.max_failed_fraction`` of
        the ended ones, stop the run with those causes."""
        failures = failure_summary(result.samples)
        if not failures.failed:
            return
        limit = self.cfg.trainer.max_failed_fraction
        if failures.fraction > limit:
            raise TooManyFailures(
                f"step {step}: {failures.line()} (over trainer.max_failed_fraction={limit}; "
                f"each request is in the traces under {self.run_dir / 'traces'})"
            )
        self.console.print(f"[yellow]step {step}: {escape(failures.line())}[/yellow]")

    def _reward_s(self) -> float:
        return self.setup.reward_seconds() if self.setup.reward_seconds else 0.0

    def _policy(self, n_resumed: int) -> CutoffPolicy:
        """This step's cut-off policy (built once a step, with the state it has learned)."""
        g = self.cfg.algo.group_size
        policy = make_policy(self.cfg.cutoff, self.cfg.n_target + n_resumed, g)
        policy.load_state_dict(self.policy_state)
        return policy

    def _launch(self, step: int, resumed: list[Sample], n_launch: int) -> list[Sample]:
        """Resumed partial trajectories first, then fresh groups up to ``n_launch``: numbered
        once, in launch order over the whole step; fresh ones seeded by that number."""
        g = self.cfg.algo.group_size
        n_fresh = n_launch - len(resumed)
        rows = self.prompts.take(-(-n_fresh // g))
        fresh = [
            Sample(index=0, group=self.next_group + j // g, data=dict(rows[j // g]))
            for j in range(n_fresh)
        ]
        self.next_group += len(rows)
        samples = resumed + fresh
        for i, s in enumerate(samples):
            s.index = i
        seed_samples(fresh, self.cfg.trainer.seed, TRAIN_STREAM, step)  # resumed keep theirs
        return samples

    async def _rollout(
        self, step: int, samples: list[Sample], policy: CutoffPolicy, audit: bool
    ) -> StepResult:
        """The step over every worker, cut by ``policy`` (never cut on an audit step)."""
        run_policy = WaitAll(len(samples), self.cfg.algo.group_size) if audit else policy
        assert self.workers is not None, "run() starts the rollout workers"
        plan = plan_for_policy(run_policy, [s.group for s in samples], self.workers.n_workers)
        result = await self.workers.run_step(step, plan, samples)
        if not audit:  # the policy that ran (a Ray worker's copy comes back into the plan)
            self.policy_state = (plan.coordinator_policy or plan.policies[0]).state_dict()
        return result

    async def _sync_weights(self) -> dict[str, float]:
        return await self.weight_sync(self.setup.engine, self.actor)

    # -- validation -----------------------------------------------------------------------

    async def _validate(self, step: int) -> dict[str, float]:
        """One sample per validation prompt with the wait-all policy: never cut; the same
        seeds every time, so differences are the policy's."""
        t0 = time.monotonic()
        rows = list(self.setup.val_prompts)[: self.cfg.data.val_size]
        samples = [Sample(index=i, group=i, data=dict(r)) for i, r in enumerate(rows)]
        seed_samples(samples, self.cfg.trainer.seed, VALIDATION_STREAM, 0)
        result = await run_step(
            self.setup.engine, samples, self.setup.val_rollout, WaitAll(len(samples), 1),
            Tracer(None, step=step), abort_deadline_s=self.cfg.engine.abort_deadline_s,
            gc_pause=self.cfg.rollout.gc_pause,
        )  # fmt: skip
        return validation_metrics(result, time.monotonic() - t0)

    # -- checkpoints ----------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "prompts": self.prompts.state_dict(),
            "next_group": self.next_group,
            "policy": self.policy_state,
            "partial": self.buffer.state_dict(),
            "train_s": self.train_s,
            "rng": ckpt.rng_state(),
        }

    def _save(self, step: int) -> float:
        """The checkpoint of ``step``. With several ranks the actor's full state is gathered
        (every rank takes part) and rank 0 writes it: the same files as one rank, so a run
        resumes on any number of ranks."""
        t0 = time.monotonic()
        actor_state = self.actor.state_dict()
        if self.ranks.is_main:
            ckpt.save_checkpoint(
                self.run_dir,
                step,
                actor_state,
                self._state(),
                keep=self.cfg.trainer.keep_checkpoints,
                before_rename=lambda: self.fault(step, "checkpoint"),
            )
        self.ranks.barrier()
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
            path, actor_state, state = found
        else:
            path = Path(how)
            actor_state, state = ckpt.load_checkpoint(path)
        self.actor.load_state_dict(actor_state)
        self.step = int(state["step"])
        self.prompts.load_state_dict(state["prompts"])
        self.next_group = int(state["next_group"])
        self.policy_state = dict(state["policy"])
        self.buffer.load_state_dict(state["partial"])
        self.train_s = float(state.get("train_s", 0.0))
        ckpt.set_rng_state(state["rng"])
        if self.ranks.is_main:
            truncate_jsonl(self.run_dir / "metrics.jsonl", self.step)
        self.console.print(f"[green]resumed from {path} (step {self.step})[/green]")
        return self.step

    def _warn(self, line: str) -> None:
        self.console.print(f"[yellow]{escape(line)}[/yellow]")

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
