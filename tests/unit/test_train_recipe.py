"""The Ray rollout workers' recipe for remote engines: picklable, and it builds a client of
the configured servers plus the trainer's agent loop inside the worker."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path
from typing import Any

from tailcut.app.train_setup import TrainRecipe
from tailcut.reward.registry import RewardFn
from tailcut.rollout.resume import ResumableAgentLoop
from tailcut.train.config import load_train_config


def test_train_recipe_pickles_and_builds_a_remote_client(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    chat_tokenizer.save_pretrained(tmp_path / "model")
    cfg = load_train_config(
        None,
        [
            "engine.kind=sglang", "engine.urls=[http://127.0.0.1:9]", "rollout.workers=2",
            "rollout.backend=ray", "trainer.seed=5", "data.reward_fn=arith",
        ],
    )  # fmt: skip
    recipe = pickle.loads(pickle.dumps(TrainRecipe(cfg, str(tmp_path / "model"))))

    async def main() -> tuple[str, Any]:
        engine, rollout = await recipe.build(1)
        try:
            return type(engine).__name__, rollout
        finally:
            await engine.aclose()

    kind, rollout = asyncio.run(main())
    assert kind == "SGLangEngine"
    assert isinstance(rollout, ResumableAgentLoop)  # samples arrive seeded by the trainer
    reward = rollout.reward_fn
    assert isinstance(reward, RewardFn) and reward.kind == "answer"
