"""The loop on the embedded HF engine with a tiny random model: the actor's log-probs match
the engine's behaviour log-probs (the layout, positions and masks line up), weights sync."""

from __future__ import annotations

import asyncio
import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from train_fixtures import read_jsonl, tiny_config, tiny_model, tiny_setup

from tailcut.config import HFEngineConfig
from tailcut.engine.hf import HFEngine
from tailcut.train.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def _run(trainer: Trainer, engine: HFEngine) -> None:
    try:
        await trainer.run()
    finally:
        await engine.aclose()


def test_hf_engine_loop_on_policy_ratio_and_weight_sync(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    cfg = tiny_config(
        tmp_path / "run", "cutoff.policy=wait-all", "actor.mini_batches=1", "trainer.steps=2",
        "agent.max_new_tokens=24", "agent.max_response_tokens=64", "data.batch_size=3",
        "algo.group_size=4", "trainer.val_every=0",
    )  # fmt: skip
    setup = tiny_setup(cfg, chat_tokenizer)
    model = tiny_model(len(chat_tokenizer))
    setup.actor.model.load_state_dict(model.state_dict())
    engine = HFEngine(copy.deepcopy(model), HFEngineConfig(max_seq_len=512), max_batch_size=16)
    setup.engine = engine
    trainer = Trainer(cfg, setup, console=Console(quiet=True))
    asyncio.run(_run(trainer, engine))
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 2
    for r in steps:
        assert math.isfinite(r["train/loss"]) and r["train/loss_tokens"] > 0
        # One optimizer step per rollout step: every token is on-policy, ratio ≡ 1.
        assert r["train/ratio"] == pytest.approx(1.0, abs=1e-3)
        assert r["train/approx_kl_behaviour"] < 1e-5
    assert engine.weight_version == 2
    for name, p in setup.actor.model.state_dict().items():
        assert torch.equal(p, engine.model.state_dict()[name]), name
