"""``engine.hf.overlap``: each decode pass queued before the tokens of the one before are
read, fed them on the device. On the CPU every pass has run by the time it is queued, so
these tests check the bookkeeping — the tokens, log-probs, aborts, admissions, compaction
and the capacity edge — against the same engine without overlap and against
``model.generate``; the device timing is the GPU sweep's."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_engine import VOCAB, tiny_qwen2  # noqa: E402

from fakes.hf_runs import hf_greedy, made_up_prompt, run_engine  # noqa: E402
from tailcut.engine.hf import HFEngine  # noqa: E402
from tailcut.types import (  # noqa: E402
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    new_request_id,
)


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_qwen2(seed=0)


def req(i: int, length: int, n: int, **sp: Any) -> GenerateRequest:
    prompt = made_up_prompt(i, length, VOCAB, 37, 11)
    return GenerateRequest(new_request_id("ov"), prompt, SamplingParams(max_new_tokens=n, **sp))


def _both(model: Any, body: Any, **cfg: Any) -> tuple[Any, Any]:
    return (
        run_engine(model, body, overlap=False, **cfg),
        run_engine(model, body, overlap=True, **cfg),
    )


def test_sampled_tokens_and_logprobs_are_the_same_with_and_without_overlap(model: Any) -> None:
    # more requests than slots: admissions join a batch decoding ahead; rows finish at
    # different passes (budgets, EOS), so the batch is compacted under a pass in flight
    budgets = [3 + (i * 7) % 19 for i in range(24)]
    stops = list(range(3, 40))  # about one token in fourteen ends a request early

    async def body(engine: HFEngine) -> list[tuple[list[int], list[float] | None, str]]:
        jobs = [
            engine.generate(
                req(i, 2 + i % 9, n, seed=i, temperature=1.0, top_p=0.9, stop_token_ids=stops)
            )
            for i, n in enumerate(budgets)
        ]
        out = await asyncio.gather(*jobs)
        stats = await engine.stats()
        assert stats.running == stats.kv_blocks_in_use == 0 and stats.tokens_after_abort == 0
        assert engine.counters.decode_passes > 0
        return [(r.output_ids, r.logprobs, r.finish_reason.value) for r in out]

    plain, ahead = _both(model, body, slots=6, max_prefill_tokens=32)
    # a row that finished runs one more (wasted) column in the pass queued ahead: batches
    # differ in size, so log-probs agree up to float rounding of the batched matmuls
    assert [(t, r) for t, _, r in ahead] == [(t, r) for t, _, r in plain]
    for (_, lp_ahead, _), (_, lp_plain, _) in zip(ahead, plain, strict=True):
        assert lp_ahead == pytest.approx(lp_plain, rel=1e-4, abs=1e-5)
    assert {reason for _, _, reason in plain} == {"stop", "length"}  # both paths ran


def test_greedy_rows_next_to_aborted_and_finished_ones_equal_model_generate(model: Any) -> None:
    async def body(engine: HFEngine) -> list[GenerateResult]:
        keep = [asyncio.create_task(engine.generate(req(i, 4 + 3 * i, 25, temperature=0.0,
                                                       ignore_eos=True))) for i in range(3)]  # fmt: skip
        victim = req(9, 6, 200, ignore_eos=True)
        doomed = asyncio.create_task(engine.generate(victim))
        short = asyncio.create_task(engine.generate(req(5, 5, 4, ignore_eos=True)))
        await short  # rows finish and the batch is compacted while a pass is in flight
        await engine.abort([victim.request_id])
        results = list(await asyncio.gather(*keep))
        aborted = await doomed
        assert aborted.finish_reason is FinishReason.ABORT
        assert (await engine.stats()).tokens_after_abort == 0
        return results

    results = run_engine(model, body, slots=5, overlap=True)
    for i, r in enumerate(results):
        prompt = made_up_prompt(i, 4 + 3 * i, VOCAB, 37, 11)
        assert r.output_ids == hf_greedy(model, prompt, 25)


def test_rows_at_the_last_column_are_read_before_another_pass(model: Any) -> None:
    # prompt 10 + 22 tokens fill the 32 columns: no pass may be queued past the last one
    async def body(engine: HFEngine) -> list[GenerateResult]:
        jobs = [engine.generate(req(i, 10, 22, temperature=0.0, ignore_eos=True)) for i in range(3)]
        return list(await asyncio.gather(*jobs))

    results = run_engine(model, body, slots=3, overlap=True, max_seq_len=32)
    for i, r in enumerate(results):
        assert r.finish_reason is FinishReason.LENGTH
        assert r.output_ids == hf_greedy(model, made_up_prompt(i, 10, VOCAB, 37, 11), 22)


def _greedy_switched(old: Any, new: Any, prompt: list[int], out: list[int], k: int) -> list[int]:
    """The greedy tokens after ``out[:k]`` when ``old`` sampled those and ``new`` the rest:
    the cache of ``prompt + out[:k-1]`` is the old weights' (an engine keeps it), the pass
    fed ``out[k-1]`` and every later one the new weights'."""
    name = "cache" if "cache" in inspect.signature(old.forward).parameters else "past_key_values"
    cache = {name: transformers.DynamicCache()}  # filled in place by each call
    with torch.no_grad():
        old(torch.tensor([prompt + out[: k - 1]]), use_cache=True, **cache)
        tok, tokens = out[k - 1], []
        for _ in range(len(out) - k):
            tok = int(new(torch.tensor([[tok]]), use_cache=True, **cache).logits[0, -1].argmax())
            tokens.append(tok)
    return tokens


@pytest.mark.parametrize("overlap", [False, True])
def test_a_weight_update_lands_between_two_passes(overlap: bool) -> None:
    # the update is queued while the request decodes (a pass in flight with overlap): the
    # tokens before it are the old weights' greedy ones, those after it the new weights'
    # continuation over the cache the old ones wrote; nothing is sampled from a mix
    n, prompt = 160, made_up_prompt(1, 6, VOCAB, 37, 11)
    model, fresh = tiny_qwen2(seed=0), tiny_qwen2(seed=1).state_dict()

    async def body(engine: HFEngine) -> GenerateResult:
        request = GenerateRequest(
            new_request_id("ov"), prompt,
            SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
        )  # fmt: skip
        long = asyncio.create_task(engine.generate(request))
        # the worker thread counts the tokens it takes; there is nothing to wait on
        while engine.counters.generated_tokens < 4:  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        await engine.update_weights(fresh, version=1)
        return await long

    r = run_engine(model, body, slots=3, overlap=overlap)
    old = tiny_qwen2(seed=0)
    reference = hf_greedy(old, prompt, n)
    out = r.output_ids
    assert len(out) == n and r.weight_version == 0  # tagged with its first token's weights
    diverged = next(
        (i for i, (a, b) in enumerate(zip(out, reference, strict=True)) if a != b), None
    )
    assert diverged is not None, "the new weights never took effect"
    # the switch lies at or before the first token unlike the old weights' greedy one
    assert any(
        out[k:] == _greedy_switched(old, model, prompt, out, k) for k in range(diverged, 3, -1)
    )
