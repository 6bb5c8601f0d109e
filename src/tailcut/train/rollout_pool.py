"""The trainer's rollout workers (``rollout.workers``, ``rollout.backend``).

``local``: N workers on the trainer's event loop, all driving the setup's engine (the
engine the trainer syncs weights into) with the setup's rollout fn.
``ray``: one Ray actor per worker, each building its engine and rollout fn from the
setup's picklable :class:`~tailcut.rollout.workers.WorkerRecipe` (``app/train_setup.py``
gives one for SGLang / vLLM servers, which the trainer syncs directly; the embedded engine
lives in this process and cannot be shared with actors). Ray is started when it is not
yet (``ray.init``: the cluster at ``RAY_ADDRESS``, else a local one).

Either way the trainer plans each step with one cut-off policy over all workers
(:func:`~tailcut.rollout.workers.plan_for_policy`), so a step keeps the samples one
worker would keep, and the trainer seeds each sample by its position in the whole step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tailcut.engine.base import Engine
from tailcut.rollout.step import RolloutFn, StepOptions
from tailcut.rollout.workers import LocalWorkers, SharedRecipe, WorkerRecipe, Workers
from tailcut.train.config import TrainConfig
from tailcut.train.distributed import Ranks


async def make_workers(
    cfg: TrainConfig,
    engine: Engine,
    rollout: RolloutFn,
    recipe: WorkerRecipe | None,
    run_dir: Path,
    ranks: Ranks | None = None,
    predictors: Sequence[Mapping[str, Any] | None] = (),
) -> Workers:
    """Started workers for ``cfg.rollout``; the caller closes them (``aclose``). ``recipe``
    (Ray only) builds each worker's engine client and rollout fn in its actor. In a job of
    several ranks, one worker per rank on the rank's own engine, cut globally
    (``train/rank_workers.py``). ``predictors``: each worker's length predictor to start
    from (a resumed run's, ``StepOptions.predictor_states``)."""
    r = cfg.rollout
    trace_dir = run_dir / "traces" if cfg.trainer.trace else None
    options = StepOptions(
        cfg.engine.abort_deadline_s, cfg.trainer.step_timeout_s, r.gc_pause, r.max_retries,
        r.schedule if r.schedule.kind != "fifo" else None, tuple(predictors),
    )  # fmt: skip
    if ranks is not None and ranks.distributed:
        from tailcut.train.rank_workers import RankWorkers

        return RankWorkers(
            cfg.cutoff, SharedRecipe(engine, rollout), ranks, trace_dir, options=options
        )
    if r.backend == "local":
        shared = SharedRecipe(engine, rollout)
        return LocalWorkers(cfg.cutoff, shared, r.workers, trace_dir, options=options)
    if recipe is None:
        raise ValueError(
            "rollout.backend: 'ray' needs a worker recipe that builds each worker's engine "
            "client in its actor; this setup's engine lives in the trainer process, use "
            "rollout.backend=local"
        )
    import ray

    from tailcut.rollout.ray_workers import RayWorkers

    if not ray.is_initialized():  # the cluster at RAY_ADDRESS, else a local one
        ray.init(ignore_reinit_error=True)
    pool = RayWorkers(
        cfg.cutoff, recipe, r.workers, trace_dir, options=options,
        num_cpus_per_worker=r.num_cpus_per_worker,
    )  # fmt: skip
    await pool.start()
    return pool
