"""HFEngine's batched pass machinery on CPU: decode buckets (the shapes CUDA graphs are
captured for), freeing several rows in one compaction, and batched admission."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fakes.hf_runs import fixed_request, hf_greedy, made_up_prompt, run_engine  # noqa: E402
from tailcut.engine.hf import HFEngine  # noqa: E402
from tailcut.engine.hf.graphs import batch_bucket, prefill_shape, width_bucket  # noqa: E402
from tailcut.engine.hf.sampling import sample_tokens  # noqa: E402
from tailcut.types import (  # noqa: E402
    FinishReason,
    GenerateRequest,
    GenerateResult,
)

T = TypeVar("T")
VOCAB = 512


@pytest.fixture(scope="module")
def model() -> Any:
    cfg = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096,
        initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(1)
    return transformers.Qwen2ForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


def run(model: Any, body: Callable[[HFEngine], Awaitable[T]], *, slots: int, **cfg: Any) -> T:
    return run_engine(model, body, slots=slots, **cfg)


def req(prompt: list[int], n: int, **sp: Any) -> GenerateRequest:
    return fixed_request(prompt, n, "bt", **sp)


def prompt(i: int, length: int) -> list[int]:
    return made_up_prompt(i, length, VOCAB, 53, 7)


def test_buckets_cover_every_size_with_little_padding() -> None:
    for slots in (1, 3, 8, 13, 64):
        buckets = {batch_bucket(n, slots) for n in range(1, slots + 1)}
        assert len(buckets) <= 3 + -(-slots // 8)
        for n in range(1, slots + 1):
            b = batch_bucket(n, slots)
            assert n <= b <= slots and b - n < max(8, n)
    for capacity in (40, 64, 300, 4096):
        for width in range(1, capacity + 1):
            w = width_bucket(width, capacity)
            assert width <= w <= capacity and (w < 2 * width or w <= 64)
        widths = {width_bucket(w, capacity) for w in range(1, capacity + 1)}
        assert len(widths) <= 8


def test_prefill_shapes_are_few_fit_the_free_slots_and_the_token_budget() -> None:
    shapes = set()
    for first in (0, 5, 30, 63):
        for rows in range(1, 65 - first):
            for width in range(1, min(8192 // rows, 999) + 1):  # what admission lets in
                r, c = prefill_shape(rows, width, first=first, slots=64, capacity=1000, budget=8192)
                assert rows <= r and first + r <= 64 and width <= c <= min(1000, 2 * width + 15)
                assert r * c <= max(8192, rows * c)
                if first == 0:
                    shapes.add((r, c))
    assert len(shapes) < 160  # of the ~70,000 (rows, width) pairs
    assert prefill_shape(3, 40, first=0, slots=64, capacity=1000, budget=8192) == (4, 64)
    assert prefill_shape(3, 40, first=62, slots=64, capacity=1000, budget=8192) == (3, 64)


@pytest.mark.parametrize("buckets", [False, True])
def test_padded_buckets_and_multi_row_frees_keep_greedy_tokens_exact(
    model: Any, buckets: bool
) -> None:
    """Eight rows decode; three are aborted at once (two from the middle/front, so two
    survivors move, one of them twice over); the rest must match plain ``generate``.
    With ``buckets`` every pass is padded as on CUDA (rows and columns)."""
    prompts = [prompt(i, 3 + 4 * i) for i in range(8)]

    async def body(engine: HFEngine) -> list[GenerateResult]:
        tasks = [asyncio.create_task(engine.generate(req(p, 40, temperature=0.0))) for p in prompts]
        await asyncio.sleep(0)
        await engine.generate(req(prompts[0], 6))  # admitted after the eight: they decode
        ids = await engine.in_flight()
        await engine.abort([ids[0], ids[1], ids[5]])
        return list(await asyncio.gather(*tasks))

    results = run(model, body, slots=9, buckets=buckets, admit_max_wait=0)
    kept = [
        (p, r)
        for p, r in zip(prompts, results, strict=True)
        if r.finish_reason is FinishReason.LENGTH
    ]
    assert [r.finish_reason for r in results].count(FinishReason.ABORT) == 3 and len(kept) == 5
    for p, r in kept:
        assert r.output_ids == hf_greedy(model, p, 40)


def test_batched_admission_prefills_less_and_keeps_tokens(model: Any) -> None:
    prompts = [prompt(i, 4 + i % 5) for i in range(24)]
    budgets = [3 + (7 * i) % 23 for i in range(24)]

    async def body(engine: HFEngine) -> tuple[list[list[int]], int]:
        gate = asyncio.Semaphore(6)  # a client that keeps 6 in flight, as the benchmark does

        async def one(p: list[int], n: int) -> GenerateResult:
            async with gate:
                return await engine.generate(req(p, n, temperature=0.0))

        results = await asyncio.gather(*map(one, prompts, budgets))
        assert (await engine.stats()).kv_blocks_in_use == 0
        return [r.output_ids for r in results], engine.counters.prefill_passes

    at_once, passes_at_once = run(model, body, slots=6, admit_min_rows=1, admit_max_wait=0)
    batched, passes_batched = run(model, body, slots=6, admit_min_rows=4, admit_max_wait=50)
    assert batched == at_once
    assert [len(x) for x in batched] == budgets
    assert passes_batched < passes_at_once


def test_a_lone_request_waits_for_a_batch_at_most_admit_max_wait_decode_passes(
    model: Any,
) -> None:
    """A request arriving while another decodes is admitted within ``admit_max_wait``
    passes (long before a 4,000-token request ends); with a wait longer than the running
    request, it is admitted only once that request has finished."""

    def body(long_tokens: int) -> Callable[[HFEngine], Awaitable[bool]]:
        async def main(engine: HFEngine) -> bool:
            long = asyncio.create_task(engine.generate(req(prompt(0, 5), long_tokens)))
            # The long request reaches the engine first (a task starts on the loop's next
            # turn: without this, the short one could be queued first and ``long`` admitted
            # later beside the second short one).
            while not await engine.in_flight():  # noqa: ASYNC110 (the engine has no event for it)
                await asyncio.sleep(0.001)
            await engine.generate(req(prompt(1, 5), 2))  # admitted with long: it decodes now
            await engine.generate(req(prompt(2, 5), 1))
            still_running = bool(await engine.in_flight())
            long.cancel()
            await asyncio.gather(long, return_exceptions=True)
            return still_running

        return main

    assert run(model, body(4000), slots=4, max_seq_len=4096, admit_min_rows=4, admit_max_wait=3)
    assert not run(model, body(40), slots=4, admit_min_rows=4, admit_max_wait=1000)


def test_sampling_with_the_nucleus_flag_given_matches_reading_it_from_top_p() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen) * 3
    temp = torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0, 0.7])
    u = torch.rand(6, generator=gen)
    for top_p in (torch.ones(6), torch.tensor([1.0, 0.9, 0.5, 1.0, 0.3, 1.0])):
        nucleus = bool((top_p < 1).any())
        a = sample_tokens(logits, temp, top_p, u, "sampled")
        b = sample_tokens(logits, temp, top_p, u, "sampled", nucleus=nucleus)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_top_p_1_row_draws_the_same_beside_a_nucleus_row() -> None:
    """A row at top-p 1 draws the same token with the same log-prob alone (the full path)
    and beside a top-p row (the nucleus path), over a real-size vocabulary whose sorted
    running sum reaches 1 in float32 before its tail."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 151_936, generator=gen) * 3
    both = logits.repeat(2, 1)
    temp = torch.tensor([1.0, 1.0])
    for u in torch.rand(300, generator=gen).tolist():
        uniform = torch.tensor([u, u])
        alone = sample_tokens(logits, temp[:1], torch.tensor([1.0]), uniform[:1], nucleus=False)
        beside = sample_tokens(both, temp, torch.tensor([1.0, 0.5]), uniform, nucleus=True)
        assert beside[0][0] == alone[0][0] and beside[1][0] == alone[1][0], u
