"""HFEngine on CUDA (opt-in: ``pytest -m gpu tests/gpu``).

A float32 tiny Qwen2 checks exactness against ``model.generate`` and a full forward pass;
the ~0.5B random-init Qwen2 in bf16 checks aborts, slots and memory at a realistic size.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tailcut.config import HFEngineConfig  # noqa: E402
from tailcut.engine.hf import HFEngine  # noqa: E402
from tailcut.engine.hf_load import random_qwen2  # noqa: E402
from tailcut.types import (  # noqa: E402
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    new_request_id,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def req(prompt: list[int], n: int, **sp: Any) -> GenerateRequest:
    return GenerateRequest(new_request_id("gp"), prompt, SamplingParams(max_new_tokens=n, **sp))


def prompts(count: int, vocab: int) -> list[list[int]]:
    return [
        [3 + (i * 131 + j * 17) % (vocab - 3) for j in range(5 + 9 * (i % 7))] for i in range(count)
    ]


def test_tiny_fp32_on_cuda_matches_generate_and_full_forward() -> None:
    model = random_qwen2("random-tiny", device="cuda", dtype="float32")
    ps = prompts(12, 512)

    async def main() -> list[GenerateResult]:
        engine = HFEngine(model, HFEngineConfig(max_seq_len=512), max_batch_size=8)
        try:
            jobs = [
                engine.generate(req(p, 10 + 3 * i, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(ps)
            ]
            return list(await asyncio.gather(*jobs))
        finally:
            await engine.aclose()

    results = asyncio.run(main())
    for i, (p, r) in enumerate(zip(ps, results, strict=True)):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([p], device="cuda"), max_new_tokens=10 + 3 * i, min_new_tokens=10 + 3 * i,
                do_sample=False, pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        assert r.output_ids == ref[0, len(p) :].tolist()


def test_half_billion_bf16_logprobs_aborts_and_slots() -> None:
    model = random_qwen2("random-0.5b", device="cuda", dtype="bfloat16")
    ps = prompts(64, model.config.vocab_size)

    async def main() -> None:
        engine = HFEngine(
            model, HFEngineConfig(max_seq_len=2048, logprobs="raw"), max_batch_size=64
        )
        try:
            done = await engine.generate(req(ps[0], 32, seed=1, ignore_eos=True))
            ids = torch.tensor([ps[0] + done.output_ids], device="cuda")
            with torch.no_grad():
                logits = model(ids).logits[0, len(ps[0]) - 1 : -1].float()
            expected = torch.log_softmax(logits, -1).gather(
                1, torch.tensor(done.output_ids, device="cuda")[:, None]
            )
            torch.testing.assert_close(
                torch.tensor(done.logprobs), expected.squeeze(1).cpu(), atol=0.15, rtol=0.05
            )

            tasks = [
                asyncio.create_task(engine.generate(req(p, 1500, ignore_eos=True))) for p in ps[1:]
            ]
            await engine.generate(req(ps[0], 16, ignore_eos=True))  # the others are decoding now
            await engine.abort(await engine.in_flight())
            stats = await engine.stats()
            assert stats.running == stats.kv_blocks_in_use == stats.tokens_after_abort == 0
            results = await asyncio.gather(*tasks)
            assert all(
                r.finish_reason is FinishReason.ABORT and len(r.output_ids) > 0 for r in results
            )
        finally:
            await engine.aclose()

    asyncio.run(main())


def test_bench_gpu_variant_runs_and_reports_memory() -> None:
    from tailcut.bench.hf_bench import run_hf_bench

    figures = run_hf_bench(
        "random-0.5b",
        requests=128,
        max_new_tokens=256,
        json_out=True,
        device="cuda",
        abort_trials=2,
    )
    assert figures["engine"]["tokens"] == figures["generate"]["tokens"]
    assert figures["abort"]["tokens_after_abort"] == 0
    assert figures["abort"]["kv_blocks_in_use_after"] == 0
    assert figures["memory"]["cuda_max_allocated_bytes"] > 0
