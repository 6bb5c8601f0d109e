"""HFEngine on CPU with a tiny randomly initialised Qwen2 (2 layers, vocab 512).

The model's weights are drawn with a wide init (std 0.5) so its next-token distributions are
peaked (entropy ~2 nats): greedy runs, top-p and stop tokens all do something visible.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fakes.hf_runs import full_forward_logits, hf_greedy, made_up_prompt, run_engine  # noqa: E402
from tailcut.engine.base import EngineError  # noqa: E402
from tailcut.engine.hf import HFEngine  # noqa: E402
from tailcut.engine.hf.sampling import nucleus_logprobs  # noqa: E402
from tailcut.types import (  # noqa: E402
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    new_request_id,
)

T = TypeVar("T")
VOCAB = 512


def tiny_qwen2(seed: int = 0) -> Any:
    cfg = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_qwen2()


def run(
    model: Any,
    body: Callable[[HFEngine], Awaitable[T]],
    *,
    slots: int = 8,
    timeout_s: float = 60.0,
    **cfg: Any,
) -> T:
    """Run ``body(engine)`` on a fresh engine (no EOS unless given) within ``timeout_s``."""
    return run_engine(model, body, slots=slots, timeout_s=timeout_s, **cfg)


def req(prompt: list[int], n: int = 8, **sp: Any) -> GenerateRequest:
    return GenerateRequest(new_request_id("ut"), prompt, SamplingParams(max_new_tokens=n, **sp))


def prompt(i: int, length: int) -> list[int]:
    return made_up_prompt(i, length, VOCAB, 37, 11)


async def running_with_tokens(
    engine: HFEngine, long: GenerateRequest, tokens: int
) -> asyncio.Task[GenerateResult]:
    """Start ``long`` and return once it has generated at least ``tokens`` tokens (a marker
    request admitted no earlier than ``long`` finishes ``tokens`` tokens first)."""
    task = asyncio.create_task(engine.generate(long))
    await asyncio.sleep(0)  # let it reach the engine first
    await engine.generate(req(long.prompt_ids, tokens, ignore_eos=True))
    assert not task.done()
    return task


# ── generation ──────────────────────────────────────────────────────────────────────


def test_generate_returns_tokens_logprobs_version_and_prompt_length(model: Any) -> None:
    async def body(engine: HFEngine) -> GenerateResult:
        return await engine.generate(req(prompt(0, 10), 12, ignore_eos=True))

    result = run(model, body)
    assert result.finish_reason is FinishReason.LENGTH
    assert len(result.output_ids) == 12
    assert result.logprobs is not None and len(result.logprobs) == 12
    assert all(lp <= 0.0 for lp in result.logprobs)
    assert result.weight_version == 0
    assert result.prompt_tokens == 10


def test_greedy_tokens_equal_model_generate_for_a_ragged_staggered_batch(model: Any) -> None:
    prompts = [prompt(i, 3 + 5 * i) for i in range(6)]
    budgets = [20, 5, 17, 9, 24, 13]

    async def body(engine: HFEngine) -> list[GenerateResult]:
        first = [
            asyncio.create_task(engine.generate(req(p, n, temperature=0.0)))
            for p, n in zip(prompts[:3], budgets[:3], strict=True)
        ]
        await first[1]  # the rest join a batch already decoding, into freed and new slots
        later = [
            asyncio.create_task(engine.generate(req(p, n, temperature=0.0)))
            for p, n in zip(prompts[3:], budgets[3:], strict=True)
        ]
        return list(await asyncio.gather(*first, *later))

    results = run(model, body, slots=4)
    for p, n, r in zip(prompts, budgets, results, strict=True):
        assert r.output_ids == hf_greedy(model, p, n)


def test_kv_columns_grow_on_demand_without_changing_tokens(model: Any) -> None:
    prompts = [prompt(i, 120 + 40 * i) for i in range(3)]

    async def body(engine: HFEngine) -> list[GenerateResult]:
        start, capacity = engine.kv_cache_bytes
        assert start * 400 == capacity * 256  # 256 of 400 columns to begin with
        jobs = [engine.generate(req(p, 60, temperature=0.0, ignore_eos=True)) for p in prompts]
        results = list(await asyncio.gather(*jobs))
        assert engine.kv_cache_bytes[0] == capacity  # 200 + 60 columns: grown (capped at 400)
        return results

    results = run(model, body, slots=3, max_seq_len=400)
    for p, r in zip(prompts, results, strict=True):
        assert r.output_ids == hf_greedy(model, p, 60)


@pytest.mark.parametrize(
    ("mode", "temperature", "top_p"),
    [
        ("sampled", 0.8, 0.9),
        ("sampled", 1.0, 1.0),
        ("scaled", 0.7, 0.8),
        ("raw", 1.3, 0.95),
        ("sampled", 0.0, 1.0),
    ],
)
def test_logprobs_match_a_full_forward_pass(
    model: Any, mode: str, temperature: float, top_p: float
) -> None:
    prompts = [prompt(i, 4 + 7 * i) for i in range(5)]

    async def body(engine: HFEngine) -> list[GenerateResult]:
        jobs = [
            engine.generate(
                req(p, 16, temperature=temperature, top_p=top_p, seed=i, ignore_eos=True)
            )
            for i, p in enumerate(prompts)
        ]
        return list(await asyncio.gather(*jobs))

    for p, r in zip(prompts, run(model, body, logprobs=mode), strict=True):
        logits = full_forward_logits(model, p, r.output_ids)
        if mode == "raw":
            ref = torch.log_softmax(logits, dim=-1)
        elif mode == "scaled":
            ref = torch.log_softmax(logits / temperature, dim=-1)
        elif temperature == 0.0:
            ref = torch.zeros_like(logits)  # greedy: a point mass
        else:
            ref = nucleus_logprobs(logits, temperature, top_p)
        expected = ref.gather(1, torch.tensor(r.output_ids)[:, None]).squeeze(1)
        assert torch.isfinite(expected).all(), "a token outside the top-p nucleus was sampled"
        torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=2e-4, rtol=1e-4)


def test_a_seeded_request_is_reproducible_alone_and_in_a_batch(model: Any) -> None:
    target = req(prompt(1, 9), 20, temperature=1.0, seed=1234, ignore_eos=True)

    async def alone(engine: HFEngine) -> GenerateResult:
        return await engine.generate(target)

    async def crowded(engine: HFEngine) -> GenerateResult:
        others = [  # with top-p nuclei: the batch is sampled on the nucleus path
            engine.generate(req(prompt(i, 5 + i), 30, seed=i, ignore_eos=True, top_p=0.9))
            for i in range(6)
        ]
        results = await asyncio.gather(
            engine.generate(
                req(target.prompt_ids, 20, temperature=1.0, seed=1234, ignore_eos=True)
            ),
            *others,
        )
        return results[0]

    a, b = run(model, alone), run(model, crowded)
    assert a.output_ids == b.output_ids
    other_seed = run(
        model, lambda e: e.generate(req(target.prompt_ids, 20, seed=99, ignore_eos=True))
    )
    assert other_seed.output_ids != a.output_ids


def test_a_continued_generation_goes_on_with_the_same_seed_stream(model: Any) -> None:
    """Cut after k tokens and continued with ``seed_offset=k`` (the k tokens at the end of
    the prompt): the rest is what the uncut generation sampled."""
    p = prompt(2, 7)
    full = run(model, lambda e: e.generate(req(p, 16, temperature=1.0, seed=77, ignore_eos=True)))
    for k in (1, 5, 11):
        rest = run(
            model,
            lambda e, k=k: e.generate(
                req(p + full.output_ids[:k], 16 - k, temperature=1.0, seed=77, seed_offset=k,
                    ignore_eos=True)
            ),
        )  # fmt: skip
        assert rest.output_ids == full.output_ids[k:], k
        assert rest.logprobs == pytest.approx(full.logprobs[k:], abs=1e-4)


def test_stop_token_ids_end_the_request_with_the_stop_token(model: Any) -> None:
    p = prompt(2, 8)
    free = run(model, lambda e: e.generate(req(p, 24, temperature=0.0)))
    stop_at = next(
        i for i, t in enumerate(free.output_ids) if i >= 2 and t not in free.output_ids[:i]
    )
    stop = free.output_ids[stop_at]
    stopped = run(model, lambda e: e.generate(req(p, 24, temperature=0.0, stop_token_ids=(stop,))))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.output_ids == free.output_ids[: stop_at + 1]


def test_eos_stops_a_request_unless_ignore_eos(model: Any) -> None:
    p = prompt(3, 8)
    free = run(model, lambda e: e.generate(req(p, 24, temperature=0.0)))
    eos_at = next(
        i for i, t in enumerate(free.output_ids) if i >= 1 and t not in free.output_ids[:i]
    )
    eos = free.output_ids[eos_at]
    stopped = run(model, lambda e: e.generate(req(p, 24, temperature=0.0)), eos_ids=(eos,))
    assert stopped.finish_reason is FinishReason.STOP
    assert len(stopped.output_ids) == eos_at + 1
    ignored = run(
        model, lambda e: e.generate(req(p, 24, temperature=0.0, ignore_eos=True)), eos_ids=(eos,)
    )
    assert ignored.output_ids == free.output_ids


def test_top_p_keeps_every_sampled_token_inside_the_nucleus(model: Any) -> None:
    p = prompt(4, 6)

    async def body(engine: HFEngine) -> list[GenerateResult]:
        return list(
            await asyncio.gather(
                *(engine.generate(req(p, 12, top_p=0.5, seed=s, ignore_eos=True)) for s in range(8))
            )
        )

    for r in run(model, body):
        ref = nucleus_logprobs(full_forward_logits(model, p, r.output_ids), 1.0, 0.5)
        picked = ref.gather(1, torch.tensor(r.output_ids)[:, None])
        assert torch.isfinite(picked).all()


# ── abort, cancel, slots ────────────────────────────────────────────────────────────


def test_abort_mid_generation_returns_partial_tokens_and_frees_the_slot(model: Any) -> None:
    async def body(engine: HFEngine) -> None:
        long = req(prompt(5, 12), 200, ignore_eos=True)
        task = await running_with_tokens(engine, long, 6)
        before = await engine.stats()
        assert before.running == 1 and before.kv_blocks_in_use > 0
        await engine.abort([long.request_id])
        after = await engine.stats()  # abort returned: the slot is already free
        assert after.running == 0 and after.kv_blocks_in_use == 0
        assert await engine.in_flight() == []
        result = await task
        assert result.finish_reason is FinishReason.ABORT
        assert 6 <= len(result.output_ids) < 200
        assert result.logprobs is not None and len(result.logprobs) == len(result.output_ids)
        assert after.tokens_after_abort == 0 and after.aborted == 1
        assert after.wasted_tokens == len(result.output_ids)
        nxt = await engine.generate(req(prompt(6, 5), 7, ignore_eos=True))
        assert nxt.finish_reason is FinishReason.LENGTH and len(nxt.output_ids) == 7
        assert (await engine.stats()).tokens_after_abort == 0

    run(model, body, slots=2)


def test_aborting_one_row_keeps_the_other_rows_tokens_exact(model: Any) -> None:
    """Freeing a row moves the last row's KV into its slot: the survivors must not notice."""
    prompts = [prompt(i, 4 + 3 * i) for i in range(4)]

    async def body(engine: HFEngine) -> list[GenerateResult]:
        tasks = [
            asyncio.create_task(engine.generate(req(p, 30, temperature=0.0, ignore_eos=True)))
            for p in prompts
        ]
        await asyncio.sleep(0)
        await engine.generate(req(prompts[0], 5, ignore_eos=True))
        victim = (await engine.in_flight())[0]
        await engine.abort([victim])
        return list(await asyncio.gather(*tasks))

    results = run(model, body, slots=5)
    finished = [
        (p, r)
        for p, r in zip(prompts, results, strict=True)
        if r.finish_reason is FinishReason.LENGTH
    ]
    assert len(finished) == 3
    for p, r in finished:
        assert r.output_ids == hf_greedy(model, p, 30)


def test_cancelling_the_caller_frees_the_slot_and_counts_no_tokens_after_abort(model: Any) -> None:
    async def body(engine: HFEngine) -> None:
        long = req(prompt(7, 10), 200, ignore_eos=True)
        task = await running_with_tokens(engine, long, 4)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await engine.stats()
        assert await engine.in_flight() == []
        assert stats.running == 0 and stats.kv_blocks_in_use == 0
        assert stats.aborted == 1 and stats.tokens_after_abort == 0

    run(model, body)


def test_aborting_a_waiting_request_answers_at_once_with_no_tokens(model: Any) -> None:
    async def body(engine: HFEngine) -> None:
        long = req(prompt(8, 10), 200, ignore_eos=True)
        running = await running_with_tokens(engine, long, 3)
        other = req(prompt(10, 4), 200, ignore_eos=True)
        other_task = asyncio.create_task(engine.generate(other))  # takes the free slot
        waiting_req = req(prompt(9, 6), 10)
        waiting = asyncio.create_task(engine.generate(waiting_req))
        await asyncio.sleep(0)
        assert (await engine.stats()).waiting >= 1  # FIFO: `other` takes the free slot first
        await engine.abort([waiting_req.request_id])
        result = await waiting
        assert result.finish_reason is FinishReason.ABORT and result.output_ids == []
        assert long.request_id in await engine.in_flight()
        await engine.abort(
            [long.request_id, other.request_id, long.request_id, new_request_id("zz")]
        )
        assert (await running).finish_reason is FinishReason.ABORT
        assert (await other_task).finish_reason is FinishReason.ABORT

    run(model, body, slots=2)


def test_many_concurrent_requests_all_finish_with_their_own_lengths(model: Any) -> None:
    budgets = [1 + (i * 7) % 23 for i in range(96)]

    async def body(engine: HFEngine) -> list[GenerateResult]:
        jobs = [
            engine.generate(req(prompt(i, 2 + i % 17), n, seed=i, ignore_eos=True))
            for i, n in enumerate(budgets)
        ]
        results = list(await asyncio.gather(*jobs))
        stats = await engine.stats()
        assert stats.running == stats.waiting == stats.kv_blocks_in_use == 0
        assert engine.counters.generated_tokens == sum(budgets)
        return results

    results = run(model, body, slots=16, max_prefill_tokens=64)
    assert [len(r.output_ids) for r in results] == budgets
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)


def test_aclose_aborts_what_runs_and_refuses_new_requests(model: Any) -> None:
    async def body(engine: HFEngine) -> None:
        task = await running_with_tokens(engine, req(prompt(1, 5), 200, ignore_eos=True), 2)
        await engine.aclose()
        assert (await task).finish_reason is FinishReason.ABORT
        with pytest.raises(EngineError, match="closed"):
            await engine.generate(req(prompt(1, 5), 3))

    run(model, body)


# ── weights and bad input ───────────────────────────────────────────────────────────


def test_update_weights_changes_outputs_and_tags_results_with_the_version(model: Any) -> None:
    mine = tiny_qwen2(seed=0)
    other = tiny_qwen2(seed=1).state_dict()
    p = prompt(2, 9)

    async def body(engine: HFEngine) -> tuple[GenerateResult, GenerateResult]:
        before = await engine.generate(req(p, 16, temperature=0.0, ignore_eos=True))
        await engine.update_weights(other, version=7)
        assert engine.weight_version == 7
        after = await engine.generate(req(p, 16, temperature=0.0, ignore_eos=True))
        return before, after

    before, after = run(mine, body)
    assert before.weight_version == 0 and after.weight_version == 7
    assert before.output_ids != after.output_ids
    assert after.output_ids == hf_greedy(tiny_qwen2(seed=1), p, 16)


def test_update_weights_rejects_unknown_names_and_wrong_shapes_before_copying(model: Any) -> None:
    mine = tiny_qwen2(seed=0)
    norm = mine.state_dict()["model.norm.weight"].clone()

    async def body(engine: HFEngine) -> None:
        with pytest.raises(ValueError, match="unknown tensor"):
            await engine.update_weights({"model.nope": torch.zeros(1)}, version=1)
        bad = {"model.norm.weight": torch.zeros(3), "lm_head.weight": torch.zeros(VOCAB, 64)}
        with pytest.raises(ValueError, match=r"model\.norm\.weight has shape"):
            await engine.update_weights(bad, version=1)
        assert engine.weight_version == 0

    run(mine, body)
    assert torch.equal(mine.state_dict()["model.norm.weight"], norm)
    assert not torch.equal(mine.state_dict()["lm_head.weight"], torch.zeros(VOCAB, 64))


def test_bad_requests_are_refused_naming_the_request(model: Any) -> None:
    async def body(engine: HFEngine) -> None:
        empty = req([], 4)
        with pytest.raises(EngineError, match=f"{empty.request_id}: empty prompt"):
            await engine.generate(empty)
        with pytest.raises(EngineError, match="leaves no room"):
            await engine.generate(req(prompt(0, 300), 4))
        with pytest.raises(EngineError, match="top_p"):
            await engine.generate(req(prompt(0, 3), 4, top_p=0.0))
        capped = await engine.generate(req(prompt(0, 250), 100, ignore_eos=True))
        assert capped.finish_reason is FinishReason.LENGTH and len(capped.output_ids) == 6
        assert await engine.in_flight() == []

    run(model, body)


# ── sampler and benchmark ───────────────────────────────────────────────────────────


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.0, 0.6), (1.5, 0.9)])
def test_inverse_cdf_sampler_hits_each_token_in_proportion_to_its_probability(
    temperature: float, top_p: float
) -> None:
    from tailcut.engine.hf.sampling import sample_tokens

    torch.manual_seed(3)
    logits = torch.randn(1, 12) * 2.0
    k = 4000
    u = (torch.arange(k, dtype=torch.float32) + 0.5) / k  # evenly spaced quantiles
    rows = logits.expand(k, 12)
    temp, tp = torch.full((k,), temperature), torch.full((k,), top_p)
    tokens, logprobs = sample_tokens(rows, temp, tp, u, "sampled")
    expected = nucleus_logprobs(logits, temperature, top_p)[0].exp()
    counts = torch.bincount(tokens, minlength=12).float()
    assert torch.all((counts - k * expected).abs() <= 2.0)
    torch.testing.assert_close(logprobs, expected.log()[tokens])


@pytest.mark.slow
def test_hf_bench_reports_both_runs_on_the_same_tokens_and_clean_aborts(capsys: Any) -> None:
    from tailcut.bench.hf_bench import make_workload, run_hf_bench

    wl = make_workload(512, 50, 64, seed=5)
    assert wl == make_workload(512, 50, 64, seed=5)
    assert all(1 <= b <= 64 for b in wl.budgets) and len(set(wl.budgets)) > 5
    figures = run_hf_bench(
        "random-tiny", requests=24, max_new_tokens=24, json_out=True, device="cpu",
        concurrency=8, abort_trials=1, workload="ignored-sim-option",
    )  # fmt: skip
    assert (
        figures["engine"]["tokens"] == figures["generate"]["tokens"] == figures["budget_mean"] * 24
    )
    assert figures["generate"]["computed_tokens"] >= figures["generate"]["tokens"]
    assert figures["ratio"] > 0
    for key in ("abort", "cancel"):
        assert figures[key]["tokens_after_abort"] == 0
        assert figures[key]["kv_blocks_in_use_after"] == 0
        assert figures[key]["in_flight_after"] == 0
    assert '"ratio"' in capsys.readouterr().out


def test_counters_include_the_pass_that_finished_a_request_when_it_returns(model: Any) -> None:
    async def body(engine: HFEngine) -> tuple[int, int, int]:
        await engine.generate(req(prompt(1, 5), 6, ignore_eos=True))
        c = engine.counters  # read at once: the worker may be idle or already waiting
        return c.prefill_passes, c.decode_passes, c.generated_tokens

    assert run(model, body) == (1, 5, 6)  # the first token comes from the prefill


def test_a_forward_of_the_same_model_on_another_thread_is_left_alone(model: Any) -> None:
    """The caller runs the model itself (its own scoring, ``generate``) on another thread
    while the engine prefills: the engine's switches — attention, and the LM head's pick of
    each prompt's last column — act on the engine's thread only."""
    ids = torch.tensor([prompt(9, 20)])
    with torch.no_grad():
        want = model(ids).logits
    seen = {"calls": 0, "wrong": 0}
    errors: list[BaseException] = []
    stop = threading.Event()

    def caller() -> None:
        while not stop.is_set():
            try:
                with torch.no_grad():
                    got = model(ids).logits
            except Exception as exc:  # what the engine's hook did to this thread's pass
                errors.append(exc)
                continue
            seen["calls"] += 1
            seen["wrong"] += int(got.shape != want.shape or not torch.allclose(got, want))

    async def body(engine: HFEngine) -> None:
        thread = threading.Thread(target=caller)
        thread.start()
        try:
            for k in range(12):
                reqs = [req(prompt(i + k, 120), 1, ignore_eos=True) for i in range(4)]
                await asyncio.gather(*(engine.generate(r) for r in reqs))
        finally:
            stop.set()
            thread.join()

    run(model, body, slots=4, max_seq_len=256)
    assert errors == [] and seen["wrong"] == 0 and seen["calls"] > 0


def test_a_decode_pass_writes_its_logits_where_the_graph_reads_them(model: Any) -> None:
    """A decode pass given a buffer (a CUDA graph's logits) has the LM head write into it:
    the logits returned are that buffer, equal to a pass that allocates its own."""

    async def body(engine: HFEngine) -> None:
        step = engine._worker._runner.decoder
        step._stage.longs.zero_()  # token 0 at column 0 of free slots, as a capture feeds
        cols = min(64, step.capacity)
        with torch.inference_mode():  # as the engine's passes run
            want = step._eager(4, cols).clone()
            out = torch.full_like(want, float("nan"))
            got = step._eager(4, cols, out)
        assert got.data_ptr() == out.data_ptr() and got.stride() == out.stride()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        head = engine._worker._runner._model.get_output_embeddings()
        assert "forward" in vars(head)

    run(model, body)
    head = model.get_output_embeddings()
    assert "forward" not in vars(head)  # the engine gave the model its own head back
