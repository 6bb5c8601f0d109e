"""A rank whose rollout raises (``train/rank_workers.py``): it still joins the step's gather,
so no rank waits for it; the step fails on every rank alike, or, under
``cutoff.tolerate_worker_loss``, its samples become FAILED records on every rank. Ranks are
threads here (``fakes/thread_ranks.py``), each with its own simulated engine, in real time."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from fakes.thread_ranks import ThreadJob
from tailcut.bench.workloads import Trajectory, TurnSpec, make_samples
from tailcut.config import CutoffConfig, SimEngineConfig
from tailcut.engine.sim import SimFaults
from tailcut.rollout.recipes import SimRecipe
from tailcut.rollout.step import StepFailed
from tailcut.train.rank_workers import RankWorkers
from tailcut.types import Status

ENGINE = SimEngineConfig(decode_a_s=0.002, decode_c_s=0.0, prefill_s_per_token=0.0)


def _step(cfg: CutoffConfig, recipe: SimRecipe, n_target: int = 8) -> list[Any]:
    """Both ranks' outcomes of one step: the merged StepResult, or what the rank raised."""
    job = ThreadJob(2)
    out: list[Any] = [None, None]

    def rank(ranks: Any) -> None:
        async def main() -> Any:
            pool = RankWorkers(cfg, recipe, ranks)
            plan = pool.plan(n_target, 2)
            trajs = [Trajectory((TurnSpec(20 + 5 * (i % 3)),), group=i // 2, prompt_tokens=4)
                     for i in range(plan.n_launch)]  # fmt: skip
            try:
                return await pool.run_step(1, plan, make_samples(trajs))
            finally:
                await pool.aclose()

        try:
            out[ranks.rank] = asyncio.run(main())
        except BaseException as exc:  # the outcome under test
            out[ranks.rank] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in job.ranks()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank still waits"
    return out


def test_a_rank_whose_rollout_raises_fails_the_step_on_every_rank() -> None:
    recipe = SimRecipe(ENGINE, faults={1: SimFaults(die_at_s=0.01)})
    out = _step(CutoffConfig(policy="wait-all", scope="global"), recipe)
    for got in out:
        assert isinstance(got, StepFailed), repr(got)
        assert "rollout worker 1 failed" in str(got) and "rank 1" in str(got)


def test_a_lost_rank_is_tolerated_alike_on_every_rank() -> None:
    recipe = SimRecipe(ENGINE, faults={1: SimFaults(die_at_s=0.01)})
    cfg = CutoffConfig(policy="wait-all", scope="global", tolerate_worker_loss=True)
    a, b = _step(cfg, recipe)
    for res in (a, b):
        assert not isinstance(res, BaseException), repr(res)
        assert [s.status for s in res.samples] == [Status.COMPLETED] * 4 + [Status.FAILED] * 4
        assert all("worker lost" in (s.error or "") for s in res.samples[4:])
        assert res.kept == [0, 1, 2, 3]
    assert [s.index for s in a.samples] == [s.index for s in b.samples]


def test_without_faults_both_ranks_merge_the_same_step() -> None:
    a, b = _step(CutoffConfig(policy="target-count", abort_ratio=0.25, scope="global"),
                 SimRecipe(ENGINE))  # fmt: skip
    assert not isinstance(a, BaseException) and not isinstance(b, BaseException), (a, b)
    assert len(a.kept) == 6 and a.kept == b.kept  # int(8 · (1 − 0.25)) over both ranks
    assert a.cut_reason == b.cut_reason is not None


@pytest.mark.parametrize("die", [0, 1])
def test_either_rank_raising_ends_the_step_on_both(die: int) -> None:
    recipe = SimRecipe(ENGINE, faults={die: SimFaults(die_at_s=0.01)})
    out = _step(CutoffConfig(policy="target-count", abort_ratio=0.25, scope="global"), recipe)
    assert all(isinstance(got, StepFailed) for got in out), out
