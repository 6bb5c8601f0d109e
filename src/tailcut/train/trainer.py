"""The GRPO training loop: rollout (over-sampled, cut) → rewards → advantages → batch →
policy update → weight sync → validation (never cut) → checkpoint → log.

One step ``k`` (1-based)::

    resumed partial trajectories + fresh prompts × group size ─► rollout workers
      (``rollout.workers``; one cut-off policy over all of them, train/rollout_pool.py)
      ─► plan_rows (drop | mask | partial) ─► advantages over real members
      ─► assemble ─► actor.update (in a worker thread) ─► weight sync (version k)
      ─► every val_every: validation with wait-all ─► every save_every: checkpoint

Everything a continued run needs is in the checkpoint (``train/checkpoint.py``); a run
started with ``trainer.resume=auto`` in the same directory continues where the last
checkpoint left off and gives the same next-step loss as the uninterrupted run.
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

from tailcut.algo.advantage import compute_advantages
from tailcut.algo.batch import BatchBuffers, TrainBatch, assemble, drop_rows, plan_rows
from tailcut.algo.metrics import audit_bias, estimate_rewards, rollout_metrics
from tailcut.config import dump_config
from tailcut.engine.base import Engine
from tailcut.rollout.cutoff import CutoffPolicy, Deadline, WaitAll, make_policy
from tailcut.rollout.partial import PartialBuffer
from tailcut.rollout.scheduler import RolloutFn, StepResult, run_step
from tailcut.rollout.workers import WorkerRecipe, Workers, plan_for_policy
from tailcut.trace.events import Tracer
from tailcut.train import checkpoint as ckpt
from tailcut.train.actor import Actor
from tailcut.train.config import TrainConfig
from tailcut.train.loggers import make_loggers, truncate_jsonl
from tailcut.train.prompts import PromptStream
from tailcut.train.rollout_pool import make_workers
from tailcut.train.seeding import SeededRollout
from tailcut.train.weight_sync import WeightSync
from tailcut.types import Sample, Status

FINISHED = (Status.COMPLETED, Status.TRUNCATED)


@dataclass
class TrainSetup:
    """What the loop drives; ``train/build.py`` makes it from the config, tests make their own."""

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
    """``rollout.backend=ray``: builds each worker's engine client and seeded rollout fn
    inside its actor (picklable). Local workers all drive ``engine`` with ``rollout``."""


@dataclass
class TrainSummary:
    run_dir: Path
    steps_done: int
    resumed_from: int | None
    final_val_reward: float | None
    wall_s: float
    history: list[dict[str, float]] = field(default_factory=list)


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
        self.actor = setup.actor
        self.console = console or Console()
        self.fault = fault or (lambda step, phase: None)
        self.run_dir = Path(cfg.trainer.run_dir)
        self.prompts = PromptStream(
            setup.train_prompts, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle
        )
        self.buffer = PartialBuffer(max_staleness=cfg.cutoff.max_staleness)
        self.policy_state: dict[str, Any] = {}
        self.next_group = 0
        self.step = 0
        self.train_s = 0.0
        """Seconds spent in steps so far (validation and checkpoints excluded)."""
        self.val_rollout = SeededRollout(setup.val_rollout, cfg.trainer.seed, stream=1)
        self.history: list[dict[str, float]] = []
        self.keep_history: list[int] = []
        """Usable samples kept by recent cut steps (the audit replays the cut with it)."""
        self.weight_sync = WeightSync(cfg.sync, self.run_dir)
        self.workers: Workers | None = None
        self.batch_buffers = BatchBuffers()
        """Reused by every step's batch (a step's batch is done with before the next)."""

    # -- run ------------------------------------------------------------------------------

    async def run(self, progress: Callable[[int, int], None] | None = None) -> TrainSummary:
        started = time.monotonic()
        t = self.cfg.trainer
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resumed = self._restore()
        dump_config(self.cfg, self.run_dir / "config.yaml")
        loggers = make_loggers(
            t.loggers, self.run_dir, console=self.console, config=self.cfg.model_dump(mode="json"),
            wandb_project=t.wandb_project, append=resumed is not None,
        )  # fmt: skip
        try:
            self.workers = await make_workers(
                self.cfg, self.setup.engine, self.setup.rollout, self.setup.recipe, self.run_dir
            )
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
                if self._val_enabled() and (last or (t.val_every and k % t.val_every == 0)):
                    metrics.update(await self._validate(k))
                if last or (t.save_every and k % t.save_every == 0):
                    metrics["timing/checkpoint_s"] = self._save(k)
                self.history.append(metrics)
                loggers.log(k, metrics)
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
        t0 = time.monotonic()
        reward_s0 = self.setup.reward_seconds() if self.setup.reward_seconds else 0.0
        self.fault(step, "rollout")
        result, audit, metrics = await self._rollout(step)
        t_rollout = time.monotonic()
        batch, learn_metrics = self._learn(step, result)
        metrics.update(learn_metrics)
        self.fault(step, "update")
        metrics.update(await asyncio.to_thread(self.actor.update, batch))
        t_train = time.monotonic()
        self.fault(step, "sync")
        metrics.update(await self._sync_weights())
        t_sync = time.monotonic()
        step_s = t_sync - t0
        reward_s = (self.setup.reward_seconds() if self.setup.reward_seconds else 0.0) - reward_s0
        metrics.update(
            {
                "timing/rollout_s": t_rollout - t0,
                "timing/train_s": t_train - t_rollout,
                "timing/sync_s": t_sync - t_train,
                "timing/reward_s": reward_s,
                "timing/step_s": step_s,
                "timing/share_rollout": (t_rollout - t0) / step_s,
                "timing/share_train": (t_train - t_rollout) / step_s,
                "timing/share_sync": (t_sync - t_train) / step_s,
                "timing/share_reward": reward_s / step_s,
                "train/version": float(self.actor.version),
                "rollout/audit": float(audit),
            }
        )
        return metrics

    def _make_samples(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """Resumed partial trajectories first, then ``batch_size`` fresh groups (and more
        when the policy over-provisions)."""
        g = self.cfg.algo.group_size
        resumed: list[Sample] = []
        extra: dict[str, float] = {}
        if self.cfg.cutoff.aborted == "partial":
            taken = self.buffer.take(step)
            resumed = taken.resumed
            extra = {
                "partial/resumed": float(len(resumed)),
                "partial/expired": float(taken.expired),
                "partial/expired_tokens": float(taken.expired_tokens),
            }
        policy = self._policy(len(resumed))
        n_fresh = policy.n_launch - len(resumed)
        rows = self.prompts.take(-(-n_fresh // g))
        fresh = []
        for j in range(n_fresh):
            data = dict(rows[j // g])
            fresh.append(Sample(index=0, group=self.next_group + j // g, data=data))
        self.next_group += len(rows)
        samples = resumed + fresh
        for i, s in enumerate(samples):
            s.index = i
        return samples, extra

    def _policy(self, n_resumed: int) -> CutoffPolicy:
        policy = make_policy(
            self.cfg.cutoff, self.cfg.n_target + n_resumed, self.cfg.algo.group_size
        )
        policy.load_state_dict(self.policy_state)
        return policy

    async def _rollout(self, step: int) -> tuple[StepResult, bool, dict[str, float]]:
        cut_cfg = self.cfg.cutoff
        samples, metrics = self._make_samples(step)
        audit = bool(cut_cfg.audit_every) and step % cut_cfg.audit_every == 0
        policy = self._policy(len([s for s in samples if s.resumed_from_step is not None]))
        run_policy: CutoffPolicy = (
            WaitAll(len(samples), self.cfg.algo.group_size) if audit else policy
        )
        assert self.workers is not None, "run() starts the rollout workers"
        plan = plan_for_policy(run_policy, [s.group for s in samples], self.cfg.rollout.workers)
        result = await self.workers.run_step(step, plan, samples)
        if not audit:  # the policy that ran (a Ray worker's copy comes back into the plan)
            self.policy_state = (plan.coordinator_policy or plan.policies[0]).state_dict()
            self.keep_history = ([*self.keep_history, len(result.kept)])[-16:]
        n_keep = self._audit_keep(policy, result) if audit else None
        metrics.update(rollout_metrics(result, n_keep))
        metrics.update(estimate_rewards(result.samples).as_metrics())
        if audit and n_keep is not None:
            metrics.update(audit_bias(result.samples, n_keep))
        return result, audit, metrics

    def _audit_keep(self, policy: CutoffPolicy, result: StepResult) -> int:
        """How many samples the configured policy would have kept on this uncut step."""
        if isinstance(policy, Deadline):
            budget = policy.budget_s()
            if budget is None:
                return len(result.kept)
            t0 = min(
                (s.launched_at for s in result.samples if s.launched_at is not None), default=0.0
            )
            on_time = sum(
                1 for s in result.samples
                if s.status in FINISHED and s.ended_at is not None and s.ended_at - t0 <= budget
            )  # fmt: skip
            return max(on_time, policy.min_done)
        if isinstance(policy, WaitAll):
            return len(result.kept)
        return policy.target_completion

    def _learn(self, step: int, result: StepResult) -> tuple[TrainBatch, dict[str, float]]:
        """Rows, advantages and the padded batch; cut-off samples go where the mode says."""
        a = self.cfg.algo
        mode = self.cfg.cutoff.aborted
        plan = plan_rows(result.samples, result.kept, mode)
        baselines = self.buffer.baseline_rewards(plan.groups) if mode == "partial" else None
        adv = compute_advantages(
            plan.rewards, plan.groups, plan.valid, estimator=a.estimator,
            small_group=a.small_group, eps=a.adv_eps, baseline_rewards=baselines,
        )  # fmt: skip
        advantages = adv.advantages
        if a.small_group == "drop" and not all(
            k or not v for k, v in zip(adv.keep, plan.valid, strict=True)
        ):
            kept = [k or not v for k, v in zip(adv.keep, plan.valid, strict=True)]
            advantages = [x for x, k in zip(advantages, kept, strict=True) if k]
            plan = drop_rows(plan, kept)
        if mode == "partial":
            finished: dict[int, list[float]] = {}
            for s, ok in zip(plan.samples, plan.valid, strict=True):
                if ok and s.reward is not None:
                    finished.setdefault(s.group, []).append(float(s.reward))
            self.buffer.add(plan.deferred, step, finished)
            self.buffer.release(plan.groups)
        batch = assemble(plan, advantages, pad_id=self.setup.pad_id, buffers=self.batch_buffers)
        c = batch.counts
        metrics = {
            "batch/rows": float(batch.size),
            "batch/real_rows": float(c.real),
            "batch/masked_rows": float(c.masked),
            "batch/dropped_aborted": float(c.dropped_aborted),
            "batch/deferred_partial": float(c.deferred_partial),
            "batch/failed": float(c.failed),
            "batch/surplus": float(c.surplus),
            "batch/dropped_small_group": float(c.dropped_small_group),
            "batch/loss_tokens": float(batch.n_loss_tokens),
            "adv/groups": float(adv.n_groups),
            "adv/small_groups": float(adv.n_small_groups),
            "adv/zero_std_groups": float(adv.n_zero_std_groups),
            "adv/mean_group_size": adv.mean_group_size,
        }
        if mode == "partial":
            metrics["partial/buffered"] = float(len(self.buffer))
            metrics["partial/dropped_total"] = float(self.buffer.dropped_total)
        return batch, metrics

    async def _sync_weights(self) -> dict[str, float]:
        return await self.weight_sync(self.setup.engine, self.actor)

    # -- validation -----------------------------------------------------------------------

    async def _validate(self, step: int) -> dict[str, float]:
        """One sample per validation prompt with the wait-all policy: never cut."""
        t0 = time.monotonic()
        rows = list(self.setup.val_prompts)[: self.cfg.data.val_size]
        samples = [Sample(index=i, group=i, data=dict(r)) for i, r in enumerate(rows)]
        policy = WaitAll(len(samples), 1)
        self.val_rollout.set_step(0)  # the same seeds every time: differences are the policy's
        result = await run_step(
            self.setup.engine, samples, self.val_rollout, policy, Tracer(None, step=step),
            abort_deadline_s=self.cfg.engine.abort_deadline_s, gc_pause=self.cfg.rollout.gc_pause,
        )  # fmt: skip
        rewards = [
            float(s.reward) if s.status in FINISHED and s.reward is not None else 0.0
            for s in result.samples
        ]
        return {
            "val/reward": sum(rewards) / len(rewards) if rewards else 0.0,
            "val/n": float(len(rewards)),
            "val/aborted": float(result.aborted),
            "val/failed": float(result.failed),
            "val/truncated": float(sum(s.status is Status.TRUNCATED for s in result.samples)),
            "val/cut": float(result.cut_time_s is not None),
            "timing/val_s": time.monotonic() - t0,
        }

    # -- checkpoints ----------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "prompts": self.prompts.state_dict(),
            "next_group": self.next_group,
            "policy": self.policy_state,
            "partial": self.buffer.state_dict(),
            "keep_history": self.keep_history,
            "train_s": self.train_s,
            "rng": ckpt.rng_state(),
        }

    def _save(self, step: int) -> float:
        t0 = time.monotonic()
        ckpt.save_checkpoint(
            self.run_dir,
            step,
            self.actor.state_dict(),
            self._state(),
            keep=self.cfg.trainer.keep_checkpoints,
        )
        return time.monotonic() - t0

    def _restore(self) -> int | None:
        """Load the checkpoint ``trainer.resume`` names; returns its step (None: fresh)."""
        how = self.cfg.trainer.resume
        self._seed_everything(self.cfg.trainer.seed)
        if how == "never":
            return None
        path = ckpt.latest_checkpoint(self.run_dir) if how == "auto" else Path(how)
        if path is None:
            return None
        actor_state, state = ckpt.load_checkpoint(path)
        self.actor.load_state_dict(actor_state)
        self.step = int(state["step"])
        self.prompts.load_state_dict(state["prompts"])
        self.next_group = int(state["next_group"])
        self.policy_state = dict(state["policy"])
        self.buffer.load_state_dict(state["partial"])
        self.keep_history = list(state.get("keep_history", []))
        self.train_s = float(state.get("train_s", 0.0))
        ckpt.set_rng_state(state["rng"])
        truncate_jsonl(self.run_dir / "metrics.jsonl", self.step)
        self.console.print(f"[green]resumed from {path} (step {self.step})[/green]")
        return self.step

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
