"""The training loop on (fake) SGLang servers with the weights synced in memory
(``sync.method=distributed``): every update is broadcast over a process group the servers
joined, so after each step every server holds exactly the actor's weights, tagged."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from train_fixtures import read_jsonl, tiny_config, tiny_setup

from fakes.sglang_server import fake_servers, tensors_checksum
from tailcut.config import RemoteEngineConfig
from tailcut.engine.sglang import SGLangEngine
from tailcut.train.trainer import Trainer
from tailcut.train.weight_sync import tied_aliases

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_training_on_sglang_servers_broadcasts_every_version_into_memory(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    run_dir = tmp_path / "run"

    async def main() -> tuple[list[Any], str, list[str]]:
        async with fake_servers(2, vocab=len(chat_tokenizer), step_s=0.001) as servers:
            cfg = tiny_config(
                run_dir, "engine.kind=sglang", f"engine.urls=[{servers[0].url},{servers[1].url}]",
                "trainer.steps=2", "trainer.val_every=0", "data.val_size=2",
                "agent.max_new_tokens=24", "cutoff.policy=target-count", "cutoff.abort_ratio=0.25",
                "sync.method=distributed", "sync.master_address=127.0.0.1", "sync.timeout_s=30",
                "sync.bucket_mb=0.05",
            )  # fmt: skip
            engine = SGLangEngine(
                cfg.engine.urls, RemoteEngineConfig(ready_timeout_s=5.0, reabort_interval_s=0.05)
            )
            setup = dataclasses.replace(tiny_setup(cfg, chat_tokenizer), engine=engine)
            async with engine:
                trainer = Trainer(cfg, setup, console=Console(quiet=True))
                await trainer.run()
                actor, tied = trainer.actor, tied_aliases(trainer.actor.model)
                state = {n: t for n, t in actor.full_params() if n not in tied}
                names, expected = list(state), tensors_checksum(state)
        return servers, expected, names

    servers, expected, names = asyncio.run(main())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0]
    assert [r["sync/version"] for r in steps] == [1.0, 2.0]
    assert all(r["sync/bytes"] > 0 and r["sync/load_s"] >= 0 for r in steps)
    assert all(r["sync/init_s"] == 0.0 for r in steps)  # the group of the first sync is reused
    # tokens of step k were sampled by version k - 1: the servers' tags reached the batch
    assert all(r["train/version_lag_max"] == 0.0 for r in steps)
    assert not (run_dir / "weights").exists()  # nothing went through disk
    for server in servers:
        assert len(server.init_log) == 1
        assert server.init_log[0]["world_size"] == 3
        versions = [d["weight_version"] for d in server.dist_log if d["weight_version"]]
        assert versions == ["0", "1", "2"]
        assert len(server.dist_log) > 3  # several buckets per sync
        assert sorted(server.received) == sorted(names)
        assert tensors_checksum(server.received) == expected  # exactly the actor's weights
        assert server.weight_version == "2"
        assert not server.running and not server.waiting
    assert sorted(s.init_log[0]["rank_offset"] for s in servers) == [1, 2]
