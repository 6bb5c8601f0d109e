"""vLLM CPU serving a small local model on 127.0.0.1: real generation, real aborts.

Opt-in (``-m vllm``); ``.ci/run`` runs it as its own step after creating ``.venv-vllm``.
The server is started once for the session (about a minute) and stopped at exit. The
figures (abort to idle, tokens generated after the cut) are printed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from fakes.turns_rollout import ContinuingTurns
from fakes.vllm_cpu import VLLMServer, shared_server
from tailcut.config import RemoteEngineConfig
from tailcut.engine.vllm import VLLMEngine
from tailcut.rollout.cutoff import TargetCount
from tailcut.rollout.scheduler import run_step
from tailcut.trace.events import Tracer
from tailcut.types import (
    FinishReason,
    GenerateRequest,
    Sample,
    SamplingParams,
    Status,
    new_request_id,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = [40, 41, 42, 43, 44, 45]
LONG = 900


def run(body: Callable[[VLLMEngine, VLLMServer], Awaitable[None]]) -> None:
    async def main() -> None:
        server = await shared_server()
        cfg = RemoteEngineConfig(ready_timeout_s=60.0, reabort_interval_s=0.1)
        async with VLLMEngine([server.url], cfg, abort_deadline_s=5.0) as engine:
            await engine.wait_ready()
            await body(engine, server)

    asyncio.run(main())


def _req(n: int, prompt: list[int] = PROMPT, **kw: Any) -> GenerateRequest:
    kw.setdefault("ignore_eos", True)
    return GenerateRequest(new_request_id(), list(prompt), SamplingParams(max_new_tokens=n, **kw))


async def _running(engine: VLLMEngine) -> float:
    return (await engine.counters())["running"]


async def _wait_running(engine: VLLMEngine, n: int, timeout_s: float = 60.0) -> None:
    """Poll the server's counters (a remote process: nothing to subscribe to)."""
    async with asyncio.timeout(timeout_s):
        while True:
            if await _running(engine) >= n:
                return
            await asyncio.sleep(0.05)


def test_generation_returns_token_ids_and_logprobs() -> None:
    async def body(engine: VLLMEngine, server: VLLMServer) -> None:
        result = await engine.generate(_req(16))
        assert result.finish_reason is FinishReason.LENGTH
        assert len(result.output_ids) == 16 and result.prompt_tokens == len(PROMPT)
        assert result.logprobs is not None and len(result.logprobs) == 16
        assert all(lp <= 0.0 for lp in result.logprobs)
        greedy = [(await engine.generate(_req(6, temperature=0.0))).output_ids for _ in range(2)]
        assert greedy[0] == greedy[1]
        stop = await engine.generate(
            _req(50, temperature=0.0, stop_token_ids=(greedy[0][0],), ignore_eos=False)
        )
        assert stop.finish_reason is FinishReason.STOP
        assert stop.output_ids == greedy[0][:1]  # the stop token is kept, with its log-prob
        assert stop.logprobs is not None and len(stop.logprobs) == 1

    run(body)


@pytest.mark.parametrize("endpoint", [True, False], ids=["abort-endpoint", "close-stream-only"])
def test_abort_stops_requests_in_the_server(endpoint: bool) -> None:
    async def body(engine: VLLMEngine, server: VLLMServer) -> None:
        engine.use_abort_endpoint = endpoint
        reqs = [_req(LONG) for _ in range(4)]
        tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
        await _wait_running(engine, 4)
        await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        await engine.abort([r.request_id for r in reqs])
        confirmed_s = time.perf_counter() - t0
        results = await asyncio.gather(*tasks)
        assert await _running(engine) == 0
        assert await engine.in_flight() == []
        assert all(r.finish_reason is FinishReason.ABORT for r in results)
        assert all(0 < len(r.output_ids) < LONG for r in results)
        assert all(r.logprobs is not None and len(r.logprobs) == len(r.output_ids) for r in results)
        print(
            f"\nvLLM abort ({'endpoint + close' if endpoint else 'close only'}): 4 requests "
            f"confirmed stopped by /metrics in {confirmed_s * 1e3:.0f} ms"
        )

    run(body)


def test_cancelling_the_caller_stops_the_request() -> None:
    async def body(engine: VLLMEngine, server: VLLMServer) -> None:
        task = asyncio.create_task(engine.generate(_req(LONG)))
        await _wait_running(engine, 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await engine.in_flight() == []
        assert await _running(engine) == 0

    run(body)


def _rescore(model_dir: Any, samples: list[Sample]) -> list[list[float]]:
    """Log-probs of each sample's response tokens under the model (HF, float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            n = len(s.prompt_ids)
            pos = torch.arange(n - 1, n - 1 + len(s.response_ids))
            out.append(logp[pos, torch.tensor(s.response_ids)].tolist())
    return out


def test_over_sampled_multi_turn_step_with_a_cut() -> None:
    async def body(engine: VLLMEngine, server: VLLMServer) -> None:
        lengths = {i: (8 if i < 6 else LONG // 3) for i in range(8)}
        samples = [Sample(index=i, group=i, prompt_ids=[40 + i, 41, 42, 43]) for i in range(8)]
        turns = ContinuingTurns(lengths, ignore_eos=True)
        before = await engine.counters()
        result = await run_step(
            engine, samples, turns, TargetCount(8, abort_ratio=0.25), Tracer(None, step=0)
        )
        assert await engine.in_flight() == []
        idle = await engine.counters()
        await asyncio.sleep(1.0)
        after = await engine.counters()
        assert idle["running"] == 0 and idle["waiting"] == 0

        assert result.completed == 6 and result.aborted == 2 and result.failed == 0
        assert all(s.status in (Status.COMPLETED, Status.ABORTED) for s in result.samples)
        assert [s.index for s in result.samples] == list(range(8))  # none lost
        for s in result.samples:
            assert len(s.logprobs) == len(s.response_ids) == len(s.loss_mask)
        kept = result.kept_samples()
        assert sorted(s.index for s in kept) == list(range(6))
        assert all(len(s.response_ids) == 24 for s in kept)
        assert all(0 < len(s.response_ids) < 3 * (LONG // 3) for s in result.samples[6:])

        rescored = _rescore(server.model, kept)
        worst = max(
            abs(a - b)
            for s, r in zip(kept, rescored, strict=True)
            for a, b in zip(s.logprobs, r, strict=True)
        )
        assert worst < 2e-2, f"vLLM log-probs differ from the model's by {worst}"

        received = sum(len(s.response_ids) for s in result.samples)
        generated = after["generation_tokens"] - before["generation_tokens"]
        after_cut = generated - received
        assert after["generation_tokens"] == idle["generation_tokens"]  # nothing decodes on
        assert result.abort_to_idle_s is not None and result.abort_to_idle_s < 5.0
        print(
            f"\nvLLM CPU step with a cut: cut to num_requests_running == 0 (verified by "
            f"/metrics) in {result.abort_to_idle_s * 1e3:.0f} ms; tokens generated after the "
            f"cut (vLLM generation_tokens_total minus tokens received): {after_cut:.0f}; "
            f"aborted samples kept {sum(len(s.response_ids) for s in result.samples[6:])} "
            f"partial tokens; kept log-probs match the model to {worst:.1e}"
        )

    run(body)


def test_weight_reload_and_sleep_wake() -> None:
    async def body(engine: VLLMEngine, server: VLLMServer) -> None:
        before = (await engine.generate(_req(6, temperature=0.0))).output_ids
        await engine.update_weights_from_disk(str(server.model))
        result = await engine.generate(_req(6, temperature=0.0))
        assert result.weight_version == 1 and engine.weight_version == 1
        assert result.output_ids == before  # the same weights came back
        await engine.sleep(level=1)
        assert await engine.is_sleeping() == [True]
        await engine.wake_up()
        assert await engine.is_sleeping() == [False]
        assert (await engine.generate(_req(4))).finish_reason is FinishReason.LENGTH

    run(body)


async def _restore(engine: VLLMEngine, server: VLLMServer) -> None:
    """Put the served model's own weights back (later tests compare against them)."""
    await engine.update_weights_from_disk(str(server.model), 0)


def test_weight_sync_loads_the_actors_weights_and_tags_results(tmp_path: Any) -> None:
    """The trainer's weight sync against real vLLM: the actor's weights are saved, the
    server reloads them in place, greedy outputs become the actor's own, results carry the
    version (client side and in /weight_info)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tailcut.train.actor import Actor
    from tailcut.train.config import ActorConfig, AlgoConfig, SyncConfig
    from tailcut.train.weight_sync import WeightSync

    async def body(engine: VLLMEngine, server: VLLMServer) -> None:
        model = AutoModelForCausalLM.from_pretrained(server.model, dtype=torch.float32)
        actor = Actor(model, ActorConfig(), AlgoConfig(), norm_len=16, device=torch.device("cpu"))
        sync = WeightSync(SyncConfig(keep=1), tmp_path)
        before = (await engine.generate(_req(8, temperature=0.0))).output_ids
        try:
            metrics = await sync(engine, actor)  # version 0: the served weights themselves
            same = await engine.generate(_req(8, temperature=0.0))
            assert same.output_ids == before and same.weight_version == 0
            with torch.no_grad():
                actor.model.model.norm.weight.mul_(-1)  # a change greedy decoding must show
            actor.version = 1
            metrics = await sync(engine, actor)
            after = await engine.generate(_req(8, temperature=0.0))
            assert after.weight_version == 1 and await engine.weight_versions() == ["1"]
            ids = torch.tensor([PROMPT])
            expected = actor.model.generate(ids, max_new_tokens=8, do_sample=False)
            assert after.output_ids != before
            assert after.output_ids == expected[0, len(PROMPT) :].tolist()
            assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000001"]
            print(
                f"\nvLLM weight sync: save {metrics['sync/save_s'] * 1e3:.0f} ms, "
                f"reload {metrics['sync/load_s'] * 1e3:.0f} ms, {metrics['sync/bytes'] / 1e6:.1f} MB"
            )
        finally:
            await _restore(engine, server)
        assert (await engine.generate(_req(8, temperature=0.0))).output_ids == before

    run(body)


def test_tailcut_train_on_vllm_syncs_every_step(tmp_path: Any) -> None:
    """``tailcut train engine.kind=vllm``: two GRPO steps on the served model; after each
    update the server holds the new version and the tokens trained on were tagged with the
    version that sampled them."""
    import json

    from typer.testing import CliRunner

    from tailcut.app.cli import app

    server = asyncio.run(shared_server())
    run_dir = tmp_path / "run"
    args = [
        "train", "engine.kind=vllm", f"engine.urls=[{server.url}]", f"engine.model={server.model}",
        "data.batch_size=2", "algo.group_size=2", "data.val_size=2", "data.train_size=16",
        "agent.max_turns=2", "agent.max_new_tokens=32", "agent.max_response_tokens=96",
        "cutoff.policy=target-count", "cutoff.abort_ratio=0.25", "trainer.steps=2",
        "trainer.val_every=0", "trainer.save_every=0", "trainer.loggers=[jsonl]",
        "actor.threads=1", f"trainer.run_dir={run_dir}",
    ]  # fmt: skip
    try:
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output + repr(result.exception)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if r["step"] > 0]
        assert [r["sync/version"] for r in steps] == [1.0, 2.0]
        assert all(r["train/version_lag_max"] == 0.0 for r in steps)
        assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v000001", "v000002"]

        async def versions() -> list[str]:
            async with VLLMEngine([server.url]) as engine:
                return await engine.weight_versions()

        assert asyncio.run(versions()) == ["2"]
    finally:

        async def restore() -> None:
            async with VLLMEngine([server.url]) as engine:
                await _restore(engine, server)

        asyncio.run(restore())


def test_tailcut_rollout_command_on_vllm(tmp_path: Any) -> None:
    """``tailcut rollout --engine vllm --url ...``: the agent loop with tools, one cut step."""
    import json

    from typer.testing import CliRunner

    from tailcut.app.cli import app
    from tailcut.data.arith import write_dataset

    server = asyncio.run(shared_server())
    write_dataset(tmp_path / "data", n_train=8, n_test=16, seed=0)
    args = [
        "rollout", "--engine", "vllm", "--url", server.url, "--model", str(server.model),
        "--data", str(tmp_path / "data" / "test.parquet"), "--requests", "8",
        "--policy", "target-count", "--abort-ratio", "0.25", "--max-turns", "3",
        "--max-new-tokens", "48", "--json",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{") :])
    assert summary["engine"] == "vllm" and summary["launched"] == 8
    assert summary["kept"] == 6 and summary["failed"] == 0
    assert summary["completed"] + summary["truncated"] + summary["aborted"] == 8
    assert summary["in_flight_after"] == 0
