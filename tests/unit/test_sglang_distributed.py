"""Weights in memory on (fake) SGLang servers: the trainer hosts a weight-update group, the
servers' TP workers join it (gloo, in threads) and receive the broadcast tensors; errors
name the server and nothing hangs."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import torch

from fakes.sglang_server import FakeSGLangServer, tensors_checksum
from fakes.tiny_policy import sync_actor, train_a_step
from tailcut.config import RemoteEngineConfig
from tailcut.engine.base import EngineError
from tailcut.engine.sglang import GroupOptions, SGLangEngine
from tailcut.engine.update_group import UpdateGroup
from tailcut.types import GenerateRequest, SamplingParams, new_request_id

pytestmark = pytest.mark.timeout(90)

OPTIONS = GroupOptions(backend="gloo", master_address="127.0.0.1", timeout_s=20.0)


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8, generator=g).bfloat16(),
        "model.norm.weight": torch.randn(8, generator=g),
        "lm_head.weight": torch.randn(16, 8, generator=g),
    }


async def buckets(state: dict[str, torch.Tensor], per: int) -> AsyncIterator[Any]:
    items = list(state.items())
    for i in range(0, len(items), per):
        yield items[i : i + per]


def engine_for(servers: list[FakeSGLangServer]) -> SGLangEngine:
    cfg = RemoteEngineConfig(ready_timeout_s=5.0, reabort_interval_s=0.05)
    return SGLangEngine([s.url for s in servers], cfg, abort_deadline_s=2.0)


def run(body: Callable[..., Awaitable[None]], *tps: int, **kw: Any) -> None:
    async def main() -> None:
        kw.setdefault("group_timeout_s", 20.0)
        servers = [FakeSGLangServer(tp_size=tp, vocab=64, **kw) for tp in tps]
        try:
            for s in servers:
                await s.start()
            await body(*servers)
        finally:
            for s in servers:
                await s.stop()

    asyncio.run(main())


def test_every_server_and_tp_worker_receives_exactly_the_tensors_and_tags_outputs() -> None:
    async def body(a: FakeSGLangServer, b: FakeSGLangServer) -> None:
        async with engine_for([a, b]) as engine:
            first = weights(0)
            done = await engine.update_weights_from_distributed(buckets(first, 3), 1, OPTIONS)
            assert done.init_s > 0.0
            assert done.bytes == sum(t.numel() * t.element_size() for t in first.values())
            for server in (a, b):
                assert set(server.received) == set(first)
                assert all(torch.equal(server.received[n], t) for n, t in first.items())
                assert server.received["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
            # one group: the trainer is rank 0, a's worker rank 1, b's two workers 2 and 3
            assert [(i["rank_offset"], i["world_size"]) for s in (a, b) for i in s.init_log] == [
                (1, 4),
                (2, 4),
            ]
            assert a.init_log[0]["group_name"] == b.init_log[0]["group_name"]
            assert a.init_log[0]["backend"] == "gloo"
            # two buckets: only the last carries the version and flushes the cache
            assert [(d["weight_version"], d["flush_cache"]) for d in a.dist_log] == [
                (None, False),
                ("1", True),
            ]
            assert a.dist_log[1]["names"] == ["lm_head.weight"]
            assert a.dist_log[0]["dtypes"] == ["float32", "bfloat16", "float32"]
            assert a.cache_flushes == 1 and a.weight_version == "1"
            out = await engine.generate(
                GenerateRequest(new_request_id(), [1, 2], SamplingParams(max_new_tokens=3))
            )
            assert out.weight_version == 1
            # the next update reuses the group, and the servers end up with the new weights
            second = weights(1)
            done = await engine.update_weights_from_distributed(buckets(second, 4), 2, OPTIONS)
            assert done.init_s == 0.0
            assert len(a.init_log) == len(b.init_log) == 1
            assert tensors_checksum(a.received) == tensors_checksum(b.received)
            assert tensors_checksum(a.received) == tensors_checksum(second)
            assert a.weight_version == b.weight_version == "2"
            group = a.init_log[0]["group_name"]
        assert group not in a.groups and group not in b.groups  # dropped on close

    run(body, 1, 2)


def test_a_server_refusing_to_join_names_it_and_the_next_update_forms_a_new_group() -> None:
    async def body(a: FakeSGLangServer, b: FakeSGLangServer) -> None:
        b.faults.init_errors.append("address already in use")
        async with engine_for([a, b]) as engine:
            opts = GroupOptions("gloo", "127.0.0.1", timeout_s=3.0)
            with pytest.raises(EngineError, match=rf"{b.url}.*address already in use"):
                await engine.update_weights_from_distributed(buckets(weights(0), 2), 1, opts)
            assert engine.weight_version == 0 and a.weight_version == "default"
            done = await engine.update_weights_from_distributed(buckets(weights(0), 2), 1, opts)
            assert done.bytes > 0 and len(b.init_log) == 2
            assert a.init_log[0]["group_name"] != a.init_log[1]["group_name"]
            assert tensors_checksum(b.received) == tensors_checksum(weights(0))

    run(body, 1, 1, group_timeout_s=3.0)


def test_a_group_that_does_not_form_times_out_naming_the_silent_server() -> None:
    async def body(a: FakeSGLangServer, b: FakeSGLangServer) -> None:
        b.faults.join_hangs = True
        async with engine_for([a, b]) as engine:
            opts = GroupOptions("gloo", "127.0.0.1", timeout_s=2.0)
            with pytest.raises(
                EngineError, match=rf"update group .* failed: .*timeout.*no answer from .*{b.url}"
            ):
                await engine.update_weights_from_distributed(buckets(weights(0), 2), 1, opts)
            assert engine.update_group is None or engine.update_group.broken
            out = await engine.generate(  # requests are not held by the failed update
                GenerateRequest(new_request_id(), [1], SamplingParams(max_new_tokens=2))
            )
            assert out.weight_version == 0

    run(body, 1, 1, group_timeout_s=3.0)


def test_a_failed_receive_names_the_server_and_the_group_is_made_again() -> None:
    async def body(a: FakeSGLangServer) -> None:
        a.faults.distributed_errors.append("CUDA out of memory")
        async with engine_for([a]) as engine:
            opts = GroupOptions("gloo", "127.0.0.1", timeout_s=3.0)
            with pytest.raises(EngineError, match=rf"{a.url}.*CUDA out of memory"):
                await engine.update_weights_from_distributed(buckets(weights(0), 2), 1, opts)
            await engine.update_weights_from_distributed(buckets(weights(1), 2), 1, opts)
            assert len(a.init_log) == 2 and a.weight_version == "1"
            assert tensors_checksum(a.received) == tensors_checksum(weights(1))

    run(body, 1, group_timeout_s=3.0)


def test_an_update_waits_for_running_requests_and_new_ones_wait_for_it() -> None:
    async def body(a: FakeSGLangServer) -> None:
        async with engine_for([a]) as engine:
            long = asyncio.create_task(
                engine.generate(
                    GenerateRequest(new_request_id(), [1], SamplingParams(max_new_tokens=40))
                )
            )
            await a.until(lambda: len(a.running) == 1)
            update = asyncio.create_task(
                engine.update_weights_from_distributed(buckets(weights(0), 4), 3, OPTIONS)
            )
            await a.until(lambda: a.update_waiting)
            assert not a.received  # nothing applied while a request still runs
            result = await long
            await update
            assert result.weight_version == 0 and len(result.output_ids) == 40
            assert a.weight_version == "3"

    run(body, 1, step_s=0.01)


SGLANG_RECIPE = textwrap.dedent(
    """
    import datetime, os, sys, torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        PrefixStore, _new_process_group_helper, _world, rendezvous)
    addr, port, rank, world, name = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    timeout = datetime.timedelta(seconds=30)
    store, rank, world = next(rendezvous(f"tcp://{addr}:{port}", rank, world, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world, rank, [], "gloo", PrefixStore(name, store), group_name=name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    t = torch.empty(3, 5, dtype=torch.bfloat16)
    dist.broadcast(t, src=0, group=pg)
    print(repr(t.float().sum().item()), flush=True)
    os._exit(0)  # no C++ teardown: gloo's threads may abort() it ("terminate called ...")
    """
)


def test_our_group_interoperates_with_one_built_the_way_sglang_builds_it() -> None:
    """The receiving side here is torch's own process-group helper over a TCP rendezvous
    and a group-name prefix (SGLang's ``init_custom_process_group``), in another process."""
    group = UpdateGroup("tailcut-interop", "gloo", "127.0.0.1", 0, 2, timeout_s=30.0)
    port = group.host()
    cmd = [sys.executable, "-c", SGLANG_RECIPE, "127.0.0.1", str(port), "1", "2", group.name]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        group.join()
        tensor = torch.arange(15, dtype=torch.float32).reshape(3, 5).bfloat16()
        group.broadcast([tensor])
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        group.close()
    assert proc.returncode == 0, err
    assert float(out.strip()) == float(tensor.float().sum())


# -- the trainer's side: sync.method=distributed ------------------------------------------


def test_distributed_sync_is_refused_where_the_engine_has_no_in_memory_path() -> None:
    from pydantic import ValidationError

    from tailcut.config import EngineConfig
    from tailcut.train.config import SyncConfig, TrainConfig

    sync = SyncConfig(method="distributed")
    with pytest.raises(ValidationError, match="through disk only"):
        TrainConfig(engine=EngineConfig(kind="vllm", urls=["http://127.0.0.1:1"]), sync=sync)
    with pytest.raises(ValidationError, match="in process already"):
        TrainConfig(engine=EngineConfig(kind="hf"), sync=sync)
    assert TrainConfig(engine=EngineConfig(kind="sglang", urls=["http://127.0.0.1:1"]), sync=sync)
    assert SyncConfig().method == "disk"


def test_weight_sync_broadcasts_the_actor_and_names_the_step_and_server_on_failure(
    tmp_path: Any,
) -> None:
    from tailcut.engine.vllm import VLLMEngine
    from tailcut.train.config import SyncConfig
    from tailcut.train.weight_sync import WeightSync, tied_aliases

    async def body(a: FakeSGLangServer) -> None:
        act = sync_actor()
        cfg = SyncConfig(method="distributed", master_address="127.0.0.1", timeout_s=3.0)
        sync = WeightSync(cfg, tmp_path)
        async with engine_for([a]) as engine:
            first = await sync(engine, act)
            assert first["sync/version"] == 0.0 and first["sync/init_s"] > 0.0
            train_a_step(act)
            metrics = await sync(engine, act)
            assert metrics["sync/version"] == 1.0 and metrics["sync/init_s"] == 0.0
            assert tied_aliases(act.model) == {"lm_head.weight"}  # tied: sent once
            sent = {n: t for n, t in act.full_params() if n != "lm_head.weight"}
            assert metrics["sync/bytes"] == sum(t.numel() * t.element_size() for t in sent.values())
            assert tensors_checksum(a.received) == tensors_checksum(sent)
            assert a.weight_version == "1" and engine.weight_version == 1
            a.faults.distributed_errors.append("out of memory")
            train_a_step(act)
            with pytest.raises(EngineError, match=rf"step 2 .*{a.url}.*out of memory"):
                await sync(engine, act)
        with pytest.raises(EngineError, match="no in-memory path"):
            await WeightSync(cfg, tmp_path)(VLLMEngine(["http://127.0.0.1:1"]), act)

    run(body, 1, group_timeout_s=3.0)
