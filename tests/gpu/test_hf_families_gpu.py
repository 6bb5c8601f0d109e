"""Every family on CUDA (opt-in: ``pytest -m gpu tests/gpu``): float32 tiny models
(``hf_families``: sliding windows of 8 tokens, Gemma 2's soft-capping) with the decode pass
replayed from CUDA graphs (padded row and column buckets) give ``model.generate``'s greedy
tokens and a full forward pass's log-probs (Mixtral and Qwen3-MoE in float32 decode eagerly:
their grouped expert matmuls cannot be captured); bf16 Gemma 2 and Qwen3-MoE pass the
load-time probe and their graph replays give the eager tokens (the same kernels: compiled
layers and fused projections off in both — in bf16 those round differently, and a greedy
near-tie of a random model can flip; the fp32 test above covers them)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hf_families import FAMILIES, tiny_model  # noqa: E402
from tailcut.config import HFEngineConfig  # noqa: E402
from tailcut.engine.hf import HFEngine  # noqa: E402
from tailcut.types import GenerateRequest, GenerateResult, SamplingParams, new_request_id  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
VOCAB = 256
MOE = ("mixtral", "qwen3_moe")


def req(prompt: list[int], n: int, **sp: Any) -> GenerateRequest:
    sampling = SamplingParams(max_new_tokens=n, ignore_eos=True, **sp)
    return GenerateRequest(new_request_id("gf"), prompt, sampling)


@pytest.mark.parametrize("kernel", [False, True], ids=["masked", "kernel"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_on_cuda_graphs_matches_generate_and_full_forward(family: str, kernel: bool) -> None:
    model = tiny_model(family, VOCAB, initializer_range=0.5).cuda()
    ps = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(2 + 5 * i)] for i in range(6)]
    budgets = [30 - 3 * i for i in range(6)]

    async def main() -> tuple[list[GenerateResult], list[GenerateResult], int]:
        cfg = HFEngineConfig(max_seq_len=256, decode_kernel=kernel)
        engine = HFEngine(model, cfg, max_batch_size=4, eos_ids=())
        try:
            greedy = [
                engine.generate(req(p, n, temperature=0.0))
                for p, n in zip(ps, budgets, strict=True)
            ]
            sampled = [engine.generate(req(p, 20, seed=i)) for i, p in enumerate(ps[:3])]
            results = list(await asyncio.gather(*greedy, *sampled))
            return results[: len(ps)], results[len(ps) :], engine.counters.graph_passes
        finally:
            await engine.aclose()

    greedy, sampled, replays = asyncio.run(main())
    if family not in MOE:  # fp32 grouped expert matmuls cannot be captured: decode eagerly
        assert replays > 0
    for p, n, r in zip(ps, budgets, greedy, strict=True):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([p], device="cuda"), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        assert r.output_ids == ref[0, len(p) :].tolist(), family
    for p, r in zip(ps[:3], sampled, strict=True):
        ids = torch.tensor([p + r.output_ids], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0, len(p) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(
            1, torch.tensor(r.output_ids, device="cuda")[:, None]
        )
        torch.testing.assert_close(
            torch.tensor(r.logprobs), expected.squeeze(1).cpu(), atol=1e-3, rtol=1e-3
        )


@pytest.mark.parametrize("kernel", [False, True], ids=["masked", "kernel"])
@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe"])
def test_bf16_passes_the_probe_and_graphs_give_the_eager_tokens(family: str, kernel: bool) -> None:
    model = tiny_model(family, 4096, hidden=512, num_attention_heads=8, head_dim=64)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    ps = [list(range(3 + i, 40 + 7 * i)) for i in range(5)]

    async def main(graphs: bool) -> tuple[list[list[int]], int]:
        cfg = HFEngineConfig(
            max_seq_len=512,
            cuda_graphs=graphs,
            compile_layers=False,
            fuse_projections=False,
            decode_kernel=kernel,
        )
        engine = HFEngine(model, cfg, max_batch_size=8, eos_ids=())
        try:
            jobs = [engine.generate(req(p, 48, temperature=0.0)) for p in ps]
            results = await asyncio.gather(*jobs)
            return [r.output_ids for r in results], engine.counters.graph_passes
        finally:
            await engine.aclose()

    eager, _ = asyncio.run(main(False))
    graphed, replays = asyncio.run(main(True))
    assert replays > 0, family
    assert graphed == eager
