"""HFEngine on CUDA (opt-in: ``pytest -m gpu tests/gpu``).

A float32 tiny Qwen2 checks exactness against ``model.generate`` and a full forward pass,
with the decode pass replayed from CUDA graphs and without; the ~0.5B random-init Qwen2 in
bf16 checks log-probs, aborts, slots and memory at a realistic size (graphs on); the
sampling kernel draws over the real vocabulary's rows; the skinny projection kernel in bf16.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fakes.hf_runs import assert_inverse_cdf_draws  # noqa: E402
from tailcut.config import HFEngineConfig  # noqa: E402
from tailcut.engine.hf import HFEngine  # noqa: E402
from tailcut.engine.hf.load import random_qwen2  # noqa: E402
from tailcut.engine.hf.sample_kernel import sample_full  # noqa: E402
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


@pytest.mark.parametrize(
    ("overlap", "kernel", "sampler", "skinny", "pdl", "combo"),
    [
        (False, False, False, False, False, False), (True, False, False, False, False, False),
        (True, True, False, False, False, False), (True, True, True, False, False, False),
        (True, True, True, True, False, False), (True, True, True, False, True, False),
        (True, True, True, False, False, True),
    ],
    ids=["serial", "overlap", "overlap+kernel", "overlap+kernel+sampler", "all+skinny", "all+pdl",
         "all+combo"],
)  # fmt: skip
def test_cuda_graph_decode_matches_eager_decode_and_generate(
    overlap: bool, kernel: bool, sampler: bool, skinny: bool, pdl: bool, combo: bool
) -> None:
    """Ragged, staggered greedy requests with several rows aborted at once: the graph
    replays (padded buckets) give exactly the eager tokens, and ``generate``'s — also with
    each pass queued before the previous one's tokens are read (``engine.hf.overlap``), and
    with the compiled layers' independent kernels launched together (inductor's combo
    kernels, through ``engine.hf.inductor``)."""
    model = random_qwen2("random-tiny", device="cuda", dtype="float32")
    ps = prompts(14, 512)

    async def main(graphs: bool) -> tuple[list[GenerateResult], int, int]:
        cfg = HFEngineConfig(
            max_seq_len=512, cuda_graphs=graphs, overlap=overlap and graphs, decode_kernel=kernel,
            sample_kernel=sampler, skinny_linear=skinny, pdl=pdl and graphs,
            inductor={"combo_kernels": True} if combo and graphs else {},
        )  # fmt: skip
        engine = HFEngine(model, cfg, max_batch_size=12, eos_ids=())
        try:
            tasks = [
                asyncio.create_task(engine.generate(req(p, 40 + 7 * i, temperature=0.0)))
                for i, p in enumerate(ps[:10])
            ]
            await engine.generate(req(ps[0], 12, ignore_eos=True))
            ids = await engine.in_flight()
            await engine.abort([ids[0], ids[3], ids[4]])
            tasks += [
                asyncio.create_task(engine.generate(req(p, 30 + i, temperature=0.0)))
                for i, p in enumerate(ps[10:])
            ]
            results = list(await asyncio.gather(*tasks))
            assert (await engine.stats()).kv_blocks_in_use == 0
            return results, engine.counters.graph_passes, engine.counters.decode_passes
        finally:
            await engine.aclose()

    eager, eager_replays, _ = asyncio.run(main(False))
    graphed, replays, passes = asyncio.run(main(True))
    assert eager_replays == 0 and replays > passes // 2
    assert [r.output_ids for r in graphed] == [r.output_ids for r in eager]
    assert [r.finish_reason for r in graphed].count(FinishReason.ABORT) == 3
    budgets = [40 + 7 * i for i in range(10)] + [30 + i for i in range(4)]
    for p, n, r in zip(ps, budgets, graphed, strict=True):
        if r.finish_reason is FinishReason.LENGTH:
            with torch.no_grad():
                ref = model.generate(
                    torch.tensor([p], device="cuda"), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0, eos_token_id=None,
                )  # fmt: skip
            assert r.output_ids == ref[0, len(p) :].tolist()


@pytest.mark.parametrize(("rows", "out", "inp"), [(64, 1152, 896), (64, 896, 896), (7, 2048, 1536)])
def test_the_skinny_kernel_is_a_bf16_linear_layer(rows: int, out: int, inp: int) -> None:
    """bf16 (what the CPU interpreter cannot multiply): against float64 from the same
    inputs, within the rounding of one bf16 output and a float32 sum."""
    from tailcut.engine.hf.skinny_linear import run

    gen = torch.Generator(device="cuda").manual_seed(out)
    x = torch.randn(rows, inp, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(out, inp, device="cuda", generator=gen) * 0.05).bfloat16()
    b = torch.randn(out, device="cuda", generator=gen).bfloat16()
    want = x.double() @ w.double().T + b.double()
    got = run(x, w, b).double()
    torch.testing.assert_close(got, want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)


def test_the_sampling_kernel_draws_the_inverse_cdf_over_the_real_vocabulary() -> None:
    """bf16 logits of Qwen2's 151,936 rows at batch 64 (a view of the head's output, as
    the engine hands it over): each draw is the float64 inverse CDF at its uniform, greedy
    rows the largest logit, log-probs the float64 ones."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 64, 151_936
    logits = (torch.randn(rows, vocab + 64, generator=gen, device="cuda") * 4).bfloat16()
    logits = logits[:, :vocab]
    floats = torch.rand(rows, 3, generator=gen, device="cuda")
    temperature, uniform = floats[:, 0] * 1.5 + 0.05, floats[:, 2]
    temperature[:4] = 0.0
    tokens, pairs = sample_full(logits, temperature, uniform, "scaled")
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).double()
    logp = torch.log_softmax(logits.double() / t[:, None], dim=-1)
    assert torch.equal(tokens[:4], logits[:4].float().argmax(dim=-1))
    assert_inverse_cdf_draws(logp[4:], uniform[4:], tokens[4:], 2e-5)
    want = logp.gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(pairs[:, 1], want, atol=1e-3, rtol=1e-5)
    assert torch.equal(pairs[:, 0].long(), tokens)


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
            assert engine.counters.graph_passes > 0
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
    assert figures["graphs"]["count"] > 0
    assert figures["engine"]["graph_passes"] > figures["engine"]["decode_passes"] // 2
