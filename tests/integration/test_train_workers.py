"""``rollout.workers=N``: the trainer drives N rollout workers through the ``Workers``
facade with one cut-off policy over the whole step, so the cut, the batch and the loss are
those of one worker (virtual time, the scripted engine shared by the local workers); and
the same loop on Ray actors built from a picklable recipe (real time)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from train_fixtures import TOKEN_S, read_jsonl, script, tiny_config, tiny_setup

from fakes.scripted_engine import ScriptedEngine
from tailcut.engine.base import Engine
from tailcut.reward.registry import RewardFn
from tailcut.rollout.resume import ResumableAgentLoop
from tailcut.rollout.step import RolloutFn
from tailcut.tools.base import ToolSet
from tailcut.tools.calculator import CalculatorTool
from tailcut.train.config import AgentLoopConfig
from tailcut.train.trainer import Trainer
from tailcut.types import GenerateRequest
from tailcut.vtime import run_virtual

pytestmark = pytest.mark.slow
QUIET = Console(quiet=True)
SAME = (
    "train/loss",
    "train/grad_norm",
    "batch/rows",
    "batch/real_rows",
    "batch/masked_rows",
    "batch/loss_tokens",
    "batch/deferred_partial",
    "rollout/aborted",
    "rollout/cut_time_s",
    "reward/completed_mean",
    "partial/resumed",
)


def _train(cfg: Any, tokenizer: Any) -> list[dict[str, Any]]:
    trainer = Trainer(cfg, tiny_setup(cfg, tokenizer), console=QUIET)
    run_virtual(trainer.run())
    return read_jsonl(Path(cfg.trainer.run_dir) / "metrics.jsonl")


@pytest.mark.parametrize(
    ("mode", "workers"), [("drop", 2), ("mask", 4), ("partial", 2), ("partial", 3)]
)
def test_n_workers_cut_and_train_like_one(
    tmp_path: Path, chat_tokenizer: Any, mode: str, workers: int
) -> None:
    over = ("cutoff.policy=target-count", "cutoff.abort_ratio=0.25", f"cutoff.aborted={mode}")
    one = _train(tiny_config(tmp_path / "one", *over), chat_tokenizer)
    cfg = tiny_config(tmp_path / "many", *over, f"rollout.workers={workers}")
    assert cfg.cutoff.scope == "global"
    many = _train(cfg, chat_tokenizer)
    assert [r["step"] for r in many] == [r["step"] for r in one] == [0, 1, 2, 3]
    assert all(r["rollout/aborted"] > 0 for r in one[1:3])  # the steps really are cut
    for a, b in zip(one[1:], many[1:], strict=True):
        for k in SAME:
            assert a.get(k) == b.get(k), (a["step"], k)
    for step in (1, 2, 3):
        files = sorted(p.name for p in (tmp_path / "many" / "traces" / f"step_{step}").iterdir())
        assert files == [f"worker_{r}.jsonl" for r in range(workers)]


def test_the_informative_quota_over_workers_cuts_like_one(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    """group-quota under the group filter over two workers: the rewards reach the global
    cut with each completion, so it cuts at the same informative group as one worker."""
    over = (
        "cutoff.policy=group-quota", "cutoff.over_provision=1.0", "algo.filter_groups=zero-std",
        "algo.filter_first_round=batch",
    )  # fmt: skip
    one = _train(tiny_config(tmp_path / "one", *over), chat_tokenizer)
    many = _train(tiny_config(tmp_path / "many", *over, "rollout.workers=2"), chat_tokenizer)
    assert any(r["rollout/aborted"] > 0 for r in one[1:])  # the quota really cuts
    keys = (*SAME, "batch/informative_groups", "batch/filtered_groups", "batch/gen_rounds")
    for a, b in zip(one[1:], many[1:], strict=True):
        for k in keys:
            assert a.get(k) == b.get(k), (a["step"], k)


def test_deadline_policy_over_workers_learns_like_one(tmp_path: Path, chat_tokenizer: Any) -> None:
    over = ("cutoff.policy=deadline", "cutoff.min_fraction=0.5", "trainer.steps=3")
    one = _train(tiny_config(tmp_path / "one", *over), chat_tokenizer)
    many = _train(tiny_config(tmp_path / "many", *over, "rollout.workers=2"), chat_tokenizer)
    for a, b in zip(one[1:], many[1:], strict=True):
        for k in ("train/loss", "batch/real_rows", "rollout/aborted", "rollout/step_time_s"):
            assert a.get(k) == b.get(k), (a["step"], k)


# -- Ray ---------------------------------------------------------------------------------


class SlowRambles(ScriptedEngine):
    """The scripted engine in real time, its rambling first replies (``script``'s kind 3,
    what a cut aborts) 100 times slower a token than the rest: at least a second, so they
    are still running when the cut reaches the Ray workers however loaded the machine."""

    def token_delay(self, request: GenerateRequest) -> float:
        rambles = (request.sampling.seed or 0) % 5 == 3
        return self.token_delay_s * (100 if rambles else 1)


@dataclass(frozen=True)
class ScriptedRecipe:
    """What a Ray worker builds in its actor: the scripted engine and the agent loop (the
    trainer seeds the samples)."""

    tokenizer: Any
    agent: AgentLoopConfig
    seed: int

    async def build(self, rank: int) -> tuple[Engine, RolloutFn]:
        engine = SlowRambles(self.tokenizer, script, token_delay_s=TOKEN_S / 10)
        tools = ToolSet({"calculator": CalculatorTool()})
        loop = ResumableAgentLoop(
            self.tokenizer, self.agent, toolset=tools, reward_fn=RewardFn("answer")
        )
        return engine, loop


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_ray_workers_train(tmp_path: Path, chat_tokenizer: Any) -> None:
    ray = pytest.importorskip("ray")
    import train_fixtures

    import fakes.scripted_engine
    from tailcut.rollout.ray_workers import init_local_ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.cloudpickle.register_pickle_by_value(fakes.scripted_engine)  # not importable in Ray workers
    ray.cloudpickle.register_pickle_by_value(train_fixtures)
    ray.cloudpickle.register_pickle_by_value(__import__(__name__))
    init_local_ray(num_cpus=2, object_store_mb=80)
    try:
        cfg = tiny_config(
            tmp_path / "run", "cutoff.policy=target-count", "cutoff.abort_ratio=0.25",
            "rollout.workers=2", "rollout.backend=ray", "trainer.steps=2", "data.val_size=2",
        )  # fmt: skip
        setup = tiny_setup(cfg, chat_tokenizer)
        setup.recipe = ScriptedRecipe(chat_tokenizer, cfg.agent, cfg.trainer.seed)
        asyncio.run(Trainer(cfg, setup, console=QUIET).run())
        alive = ray.util.list_named_actors()
    finally:
        ray.shutdown()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        # Real time: a sample may finish while the cut reaches the workers (then surplus).
        assert r["rollout/launched"] == 16 and 1 <= r["rollout/aborted"] <= 4
        assert r["batch/real_rows"] == 12 and r["train/loss"] == r["train/loss"]  # not NaN
    for r in range(2):
        assert (tmp_path / "run" / "traces" / "step_1" / f"worker_{r}.jsonl").stat().st_size > 0
    assert alive == []  # the trainer closed its worker actors


def test_ray_backend_needs_a_recipe(tmp_path: Path, chat_tokenizer: Any) -> None:
    cfg = tiny_config(tmp_path / "run", "rollout.backend=ray", "trainer.steps=1")
    trainer = Trainer(cfg, tiny_setup(cfg, chat_tokenizer), console=QUIET)
    with pytest.raises(ValueError, match=r"rollout\.backend: 'ray' needs a worker recipe"):
        run_virtual(trainer.run())
