"""Weight sync: the policy saved atomically as a Hugging Face directory and loaded by
(fake) SGLang servers, results tagged with the version; the in-process path."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fakes.sglang_server import FakeSGLangServer, fake_servers, fake_token
from fakes.tiny_policy import sync_actor, tiny_policy, train_a_step
from tailcut.config import RemoteEngineConfig
from tailcut.engine.base import EngineError
from tailcut.engine.sglang import SGLangEngine
from tailcut.train.config import SyncConfig
from tailcut.train.weight_sync import WeightSync, prune, save_policy, version_dir
from tailcut.types import FinishReason, GenerateRequest, SamplingParams, new_request_id

pytestmark = pytest.mark.timeout(60)

VOCAB = 64
RID = "weights-probe-0000000000"  # fixed: same id, same weights => same fake tokens


def _engine(servers: list[FakeSGLangServer]) -> SGLangEngine:
    cfg = RemoteEngineConfig(ready_timeout_s=5.0, reabort_interval_s=0.05)
    return SGLangEngine([s.url for s in servers], cfg, abort_deadline_s=2.0)


def _req(n: int, rid: str | None = None) -> GenerateRequest:
    return GenerateRequest(rid or new_request_id(), [1, 2, 3], SamplingParams(max_new_tokens=n))


def run(n: int, body: Callable[..., Awaitable[None]], **server_kw: Any) -> None:
    async def main() -> None:
        async with fake_servers(n, vocab=VOCAB, **server_kw) as servers:
            await body(*servers)

    asyncio.run(main())


# -- saving ------------------------------------------------------------------------------


def test_save_policy_writes_a_loadable_directory_with_the_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    source = tmp_path / "source"
    source.mkdir()
    (source / "tokenizer.json").write_text('{"fake": true}')
    (source / "tokenizer_config.json").write_text("{}")
    model = tiny_policy(VOCAB)
    path = save_policy(model, tmp_path / "weights", 3, source=source)
    assert path == version_dir(tmp_path / "weights", 3) and path.name == "v000003"
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v000003"]  # no temp left
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in path.iterdir()
    }
    assert (path / "tokenizer.json").read_text() == '{"fake": true}'
    back = AutoModelForCausalLM.from_pretrained(path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_save_policy_in_bfloat16_keeps_tied_weights_once(tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = tiny_policy(VOCAB)
    full = save_policy(model, tmp_path / "a", 1)
    half = save_policy(model, tmp_path / "b", 1, dtype="bfloat16")
    size = (half / "model.safetensors").stat().st_size
    assert size < 0.6 * (full / "model.safetensors").stat().st_size
    with safe_open(str(half / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # tied: stored once
    assert json.loads((half / "config.json").read_text()).get("dtype") == "bfloat16"
    back = AutoModelForCausalLM.from_pretrained(half, dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor.to(torch.bfloat16).float()), name


def test_saving_again_replaces_the_version_and_a_failed_save_leaves_nothing(
    tmp_path: Path,
) -> None:
    root = tmp_path / "weights"
    save_policy(tiny_policy(VOCAB, 0), root, 2)
    first = (root / "v000002" / "model.safetensors").read_bytes()
    save_policy(tiny_policy(VOCAB, 1), root, 2)
    assert (root / "v000002" / "model.safetensors").read_bytes() != first

    class Broken:
        def state_dict(self) -> dict[str, Any]:
            return {}

        def save_pretrained(self, out: Path, **kw: Any) -> None:
            Path(out).mkdir(parents=True)
            (Path(out) / "model.safetensors").write_bytes(b"half")
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_policy(Broken(), root, 3)
    assert sorted(p.name for p in root.iterdir()) == ["v000002"]


def test_prune_removes_only_old_versions_and_temp_dirs(tmp_path: Path) -> None:
    for name in ("v000001", "v000002", "v000003", ".v000004.tmp-99", "notes", "v1"):
        (tmp_path / name).mkdir()
    removed = prune(tmp_path, [tmp_path / "v000003", tmp_path / "v000001"])
    assert sorted(p.name for p in removed) == [".v000004.tmp-99", "v000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "v000001", "v000003", "v1"]


# -- through disk: fake SGLang servers ---------------------------------------------------------


def test_sync_loads_each_version_on_every_server_and_tags_results(tmp_path: Path) -> None:
    async def body(*servers: FakeSGLangServer) -> None:
        a = sync_actor()
        sync = WeightSync(SyncConfig(keep=1), tmp_path / "run")
        async with _engine(list(servers)) as engine:
            before = await engine.generate(_req(6, RID))
            metrics = await sync(engine, a)  # before the first rollout: version 0
            assert metrics["sync/version"] == 0.0 and metrics["sync/bytes"] > 0
            v0 = await engine.generate(_req(6, RID))
            train_a_step(a)
            await sync(engine, a)
            v1 = await engine.generate(_req(6, RID))
        root = tmp_path / "run" / "weights"
        for server in servers:
            assert [b["weight_version"] for b in server.update_log] == ["0", "1"]
            assert [b["model_path"] for b in server.update_log] == [
                str(root / "v000000"),
                str(root / "v000001"),
            ]
            assert server.weight_version == "1" and server.cache_flushes == 2
        assert (before.weight_version, v0.weight_version, v1.weight_version) == (0, 0, 1)
        # the outputs follow the weights the servers hold
        assert before.output_ids != v0.output_ids != v1.output_ids
        assert v1.output_ids == [fake_token(RID, i, VOCAB, servers[0].weights) for i in range(6)]
        assert sorted(p.name for p in root.iterdir()) == ["v000001"]  # keep=1

    run(2, body)


def test_same_weights_give_the_same_outputs_again(tmp_path: Path) -> None:
    async def body(server: FakeSGLangServer) -> None:
        a = sync_actor()
        sync = WeightSync(SyncConfig(), tmp_path)
        async with _engine([server]) as engine:
            await sync(engine, a)
            first = await engine.generate(_req(5, RID))
            a.version += 1  # a step that changed nothing
            await sync(engine, a)
            second = await engine.generate(_req(5, RID))
        assert first.output_ids == second.output_ids
        assert (first.weight_version, second.weight_version) == (0, 1)

    run(1, body)


def test_an_update_waits_for_running_requests_and_holds_new_ones(tmp_path: Path) -> None:
    async def body(server: FakeSGLangServer) -> None:
        path = save_policy(tiny_policy(VOCAB), tmp_path, 1)
        async with _engine([server]) as engine:
            await engine.update_weights_from_disk(str(path), 0)
            running = asyncio.create_task(engine.generate(_req(40)))
            await server.until(lambda: bool(server.running))
            update = asyncio.create_task(engine.update_weights_from_disk(str(path), 1))
            await server.until(lambda: server.update_waiting)
            later = asyncio.create_task(engine.generate(_req(3)))
            old = await running
            await update
            new = await later
        assert old.finish_reason is FinishReason.LENGTH and len(old.output_ids) == 40
        assert old.weight_version == 0 and new.weight_version == 1
        assert server.generate_log[-1] == new.request_id

    run(1, body, step_s=0.005)


def test_stragglers_are_aborted_before_loading(tmp_path: Path) -> None:
    async def body(server: FakeSGLangServer) -> None:
        a = sync_actor()
        sync = WeightSync(SyncConfig(abort_in_flight=True), tmp_path)
        async with _engine([server]) as engine:
            straggler = asyncio.create_task(engine.generate(_req(100_000)))
            await server.until(lambda: bool(server.running))
            await sync(engine, a)
            result = await straggler
            assert await engine.in_flight() == []
        assert result.finish_reason is FinishReason.ABORT
        assert server.weight_version == "0"
        assert [e["rid"] for e in server.abort_log] == [result.request_id]

    run(1, body)


def test_a_failed_load_names_the_server_and_keeps_the_version(tmp_path: Path) -> None:
    async def body(good: FakeSGLangServer, bad: FakeSGLangServer) -> None:
        bad.faults.update_errors.append("size mismatch for model.norm.weight")
        a = sync_actor()
        sync = WeightSync(SyncConfig(), tmp_path)
        async with _engine([good, bad]) as engine:
            with pytest.raises(EngineError) as err:
                await sync(engine, a)
            message = str(err.value)
            assert "did not load version 0" in message and bad.url in message
            assert "size mismatch for model.norm.weight" in message
            assert f"loaded on {good.url}" in message
            assert engine.weight_version == 0
            assert (good.weight_version, bad.weight_version) == ("0", "default")
            await sync(engine, a)  # the next sync puts both on the same weights
            assert good.weights == bad.weights and bad.weight_version == "0"

    run(2, body)


def test_without_at_start_a_fresh_run_skips_the_first_load_but_a_resumed_one_does_not(
    tmp_path: Path,
) -> None:
    async def body(server: FakeSGLangServer) -> None:
        async with _engine([server]) as engine:
            fresh = sync_actor()
            assert await WeightSync(SyncConfig(at_start=False), tmp_path / "a")(engine, fresh) == {}
            assert server.update_log == []
            resumed = sync_actor()
            resumed.version = 4
            await WeightSync(SyncConfig(at_start=False), tmp_path / "b")(engine, resumed)
            assert [b["weight_version"] for b in server.update_log] == ["4"]

    run(1, body)


# -- in process --------------------------------------------------------------------------------


class InProcessEngine:
    """Takes tensors in place, like the embedded HF engine; records what it got."""

    def __init__(self) -> None:
        self.calls: list[tuple[set[str], int]] = []

    async def update_weights(self, state_dict: Any, version: int) -> None:
        self.calls.append((set(state_dict), version))


def test_an_in_process_engine_gets_the_state_dict_and_nothing_is_written(tmp_path: Path) -> None:
    a = sync_actor()
    engine = InProcessEngine()
    sync = WeightSync(SyncConfig(), tmp_path)
    metrics = asyncio.run(sync(engine, a))
    train_a_step(a)
    asyncio.run(sync(engine, a))
    assert [v for _, v in engine.calls] == [0, 1]
    assert engine.calls[0][0] == set(a.model.state_dict())
    assert metrics["sync/version"] == 0.0
    assert not (tmp_path / "weights").exists()


def test_an_engine_without_weight_loading_is_left_alone(tmp_path: Path) -> None:
    class Plain:
        pass

    assert asyncio.run(WeightSync(SyncConfig(), tmp_path)(Plain(), sync_actor())) == {}
