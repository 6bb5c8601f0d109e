"""The training loop on (fake) SGLang servers: every update is saved, loaded by every
server and tagged, so each step trains on tokens of the version it just synced."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from train_fixtures import read_jsonl, tiny_config, tiny_setup

from fakes.sglang_server import fake_servers
from tailcut.config import RemoteEngineConfig
from tailcut.engine.sglang import SGLangEngine
from tailcut.train.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_training_on_sglang_servers_syncs_and_tags_every_version(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    run_dir = tmp_path / "run"

    async def main() -> list[Any]:
        async with fake_servers(2, vocab=len(chat_tokenizer), step_s=0.001) as servers:
            cfg = tiny_config(
                run_dir, "engine.kind=sglang", f"engine.urls=[{servers[0].url},{servers[1].url}]",
                "trainer.steps=2", "trainer.val_every=0", "data.val_size=2", "sync.keep=1",
                "agent.max_new_tokens=24", "cutoff.policy=target-count", "cutoff.abort_ratio=0.25",
            )  # fmt: skip
            engine = SGLangEngine(
                cfg.engine.urls, RemoteEngineConfig(ready_timeout_s=5.0, reabort_interval_s=0.05)
            )
            setup = dataclasses.replace(tiny_setup(cfg, chat_tokenizer), engine=engine)
            async with engine:
                await Trainer(cfg, setup, console=Console(quiet=True)).run()
            return servers

    servers = asyncio.run(main())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0]
    assert [r["sync/version"] for r in steps] == [1.0, 2.0]
    assert all(r["sync/bytes"] > 0 and r["sync/load_s"] >= 0 for r in steps)
    # tokens of step k were sampled by version k - 1: the servers' tags reached the batch
    assert all(r["train/version_lag_max"] == 0.0 for r in steps)
    # a request the fake server steps a moment late may be aborted rather than surplus
    assert all(r["rollout/cut_time_s"] > 0 for r in steps)
    assert all(r["batch/surplus"] + r["rollout/aborted"] == 4 for r in steps)
    weights = run_dir / "weights"
    for server in servers:
        assert [b["weight_version"] for b in server.update_log] == ["0", "1", "2"]
        assert server.update_log[-1]["model_path"] == str(weights / "v000002")
        assert not server.running and not server.waiting
    assert servers[0].weights == servers[1].weights != ""
    assert sorted(p.name for p in weights.iterdir()) == ["v000002"]
