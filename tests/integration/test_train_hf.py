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
        # One optimizer step per rollout step: π_old recomputed, the ratio is exactly 1;
        # the engine's log-probs match the actor's (layout, positions and masks line up).
        assert r["train/ratio"] == 1.0
        assert r["train/mismatch_kl"] < 1e-5
        assert r["train/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
    assert engine.weight_version == 2
    for name, p in setup.actor.model.state_dict().items():
        assert torch.equal(p, engine.model.state_dict()[name]), name


@pytest.mark.parametrize(
    ("old_logprobs", "engine_logprobs", "exact"),
    [("recompute", "sampled", True), ("engine", "scaled", False)],
)
def test_on_policy_ratio_is_one_at_top_p_and_temperature(
    tmp_path: Path, chat_tokenizer: Any, old_logprobs: str, engine_logprobs: str, exact: bool
) -> None:
    """top_p 0.9, temperature 0.7: with π_old recomputed the first update's ratio is exactly
    1 (the engine's nucleus log-probs only show as a mismatch); with the engine's scaled
    log-probs, which are the actor's distribution, it is 1 up to float noise."""
    cfg = tiny_config(
        tmp_path / "run", "cutoff.policy=wait-all", "actor.mini_batches=1", "trainer.steps=1",
        "agent.max_new_tokens=24", "agent.max_response_tokens=64", "data.batch_size=3",
        "algo.group_size=4", "trainer.val_every=0", "agent.top_p=0.9", "agent.temperature=0.7",
        f"algo.old_logprobs={old_logprobs}", f"engine.hf.logprobs={engine_logprobs}",
    )  # fmt: skip
    setup = tiny_setup(cfg, chat_tokenizer)
    model = tiny_model(len(chat_tokenizer))
    setup.actor.model.load_state_dict(model.state_dict())
    engine = HFEngine(copy.deepcopy(model), cfg.engine.hf, max_batch_size=16)
    setup.engine = engine
    trainer = Trainer(cfg, setup, console=Console(quiet=True))
    asyncio.run(_run(trainer, engine))
    (r,) = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0]
    assert r["train/loss_tokens"] > 0
    if exact:
        assert r["train/ratio"] == 1.0
        assert r["train/mismatch_kl"] > 1e-4  # nucleus log-probs vs the full softmax
    else:
        assert r["train/ratio"] == pytest.approx(1.0, abs=1e-4)
        assert "train/mismatch_kl" not in r
