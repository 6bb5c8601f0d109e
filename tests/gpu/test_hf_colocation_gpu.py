"""HFEngine on CUDA, opt-in (``pytest -m gpu tests/gpu``): memory handed back and taken
again with CUDA graphs on, sampling masked to the first rows, chunked prefill."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tailcut.config import HFEngineConfig  # noqa: E402
from tailcut.engine.hf import HFEngine  # noqa: E402
from tailcut.engine.hf.load import random_qwen2  # noqa: E402
from tailcut.types import GenerateRequest, GenerateResult, SamplingParams, new_request_id  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def req(prompt: list[int], n: int, **sp: Any) -> GenerateRequest:
    return GenerateRequest(
        new_request_id("gc"), prompt, SamplingParams(max_new_tokens=n, ignore_eos=True, **sp)
    )


def prompts(count: int, vocab: int, base: int = 5) -> list[list[int]]:
    return [
        [3 + (i * 131 + j * 17) % (vocab - 3) for j in range(base + 9 * (i % 7))]
        for i in range(count)
    ]


async def _all(engine: HFEngine, reqs: list[GenerateRequest]) -> list[GenerateResult]:
    return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))


def test_release_resume_frees_device_memory_and_keeps_greedy_tokens_with_graphs() -> None:
    model = random_qwen2("random-tiny", device="cuda", dtype="float32")
    ps = prompts(8, 512)

    async def main() -> None:
        engine = HFEngine(model, HFEngineConfig(max_seq_len=512), max_batch_size=8, eos_ids=())
        try:
            greedy = [req(p, 24, temperature=0.0) for p in ps]
            before = await _all(engine, greedy)
            assert engine.counters.graph_passes > 0
            kv = engine.kv_cache_bytes[0]
            report = await engine.release_memory()
            assert report.kv_cache_bytes == kv and report.graphs > 0
            freed = report.device_allocated_before - report.device_allocated_after
            assert freed >= kv + report.weight_bytes
            back = await engine.resume_memory()
            assert back.device_allocated_after - back.device_allocated_before >= kv
            replays = engine.counters.graph_passes
            after = await _all(engine, [req(p, 24, temperature=0.0) for p in ps])
            assert engine.counters.graph_passes > replays  # captured again, replayed
            assert [r.output_ids for r in after] == [r.output_ids for r in before]
        finally:
            await engine.aclose()

    asyncio.run(main())


def test_masked_rows_and_chunked_prefill_on_cuda() -> None:
    model = random_qwen2("random-tiny", device="cuda", dtype="float32")
    ps = prompts(6, 512, base=40)

    async def run(**cfg: Any) -> list[GenerateResult]:
        engine = HFEngine(
            model, HFEngineConfig(max_seq_len=512, **cfg), max_batch_size=8, eos_ids=(),
            vocab_rows=100,
        )  # fmt: skip
        try:
            return await _all(engine, [req(p, 16, seed=i) for i, p in enumerate(ps)])
        finally:
            await engine.aclose()

    whole = asyncio.run(run())
    cut = asyncio.run(run(max_prefill_tokens=32))
    for a, b in zip(whole, cut, strict=True):
        assert max(a.output_ids) < 100
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
