"""HFEngine on CPU: sampling masked to the tokenizer's rows, memory released and taken back
for a colocated trainer, and prompts over the prefill budget prefilled in chunks."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fakes.hf_runs import fixed_request, made_up_prompt, run_engine  # noqa: E402
from tailcut.algo.vocab import sampleable  # noqa: E402
from tailcut.config import HFEngineConfig  # noqa: E402
from tailcut.engine.base import (  # noqa: E402
    EngineError,
    EngineView,
    release_for_training,
    resume_for_rollout,
)
from tailcut.engine.hf import HFEngine  # noqa: E402
from tailcut.engine.hf.sampling import nucleus_logprobs  # noqa: E402
from tailcut.types import (  # noqa: E402
    FinishReason,
    GenerateRequest,
    GenerateResult,
)

T = TypeVar("T")
VOCAB = 512
ROWS = 100
"""The 'tokenizer' of the masked tests: ids 0..99 of a 512-row head."""


def tiny(seed: int = 0) -> Any:
    cfg = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024,
        tie_word_embeddings=True, initializer_range=0.5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny()


def run(model: Any, body: Callable[[HFEngine], Awaitable[T]], *, slots: int = 6, **cfg: Any) -> T:
    return run_engine(model, body, slots=slots, **cfg)


def req(prompt: list[int], n: int, **sp: Any) -> GenerateRequest:
    return fixed_request(prompt, n, "co", **sp)


def prompt(i: int, length: int) -> list[int]:
    return made_up_prompt(i, length, VOCAB, 41, 13)


def full_logits(model: Any, prompt_ids: list[int], output_ids: list[int]) -> Any:
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0]
    return logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(output_ids)]


def many(engine: HFEngine, reqs: list[GenerateRequest]) -> Awaitable[list[GenerateResult]]:
    return asyncio.gather(*(engine.generate(r) for r in reqs))


# ── the tokenizer's rows ────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("mode", "temperature", "top_p"),
    [("sampled", 1.0, 1.0), ("sampled", 0.8, 0.9), ("scaled", 1.3, 1.0), ("raw", 0.7, 1.0)],
)
def test_masked_rows_are_never_sampled_and_logprobs_equal_a_masked_full_forward(
    model: Any, mode: str, temperature: float, top_p: float
) -> None:
    reqs = [
        req(prompt(i, 3 + i), 24, temperature=temperature, top_p=top_p, seed=i) for i in range(6)
    ]
    results = run(model, lambda e: many(e, reqs), vocab_rows=ROWS, logprobs=mode)
    for r, q in zip(results, reqs, strict=True):
        assert max(r.output_ids) < ROWS
        logits = sampleable(full_logits(model, q.prompt_ids, r.output_ids), ROWS)
        if mode == "sampled":
            ref = nucleus_logprobs(logits, temperature, top_p)
        else:
            ref = torch.log_softmax(logits / (temperature if mode == "scaled" else 1.0), dim=-1)
        want = ref.gather(1, torch.tensor(r.output_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(r.logprobs), want, atol=2e-4, rtol=1e-4)


def test_greedy_is_the_argmax_over_the_tokenizer_rows(model: Any) -> None:
    reqs = [req(prompt(i, 4 + 2 * i), 20, temperature=0.0) for i in range(4)]
    free = run(model, lambda e: many(e, reqs))
    assert any(t >= ROWS for r in free for t in r.output_ids)  # the mask has work to do
    masked = run(model, lambda e: many(e, reqs), vocab_rows=ROWS)
    for r, q in zip(masked, reqs, strict=True):
        ids = list(q.prompt_ids)
        for tok in r.output_ids:  # the greedy chain of the masked distribution, step by step
            with torch.no_grad():
                step = model(torch.tensor([ids])).logits[0, -1, :ROWS]
            assert tok == int(step.argmax())
            ids.append(tok)


def test_the_engine_reads_the_tokenizer_rows_from_the_model_directory(
    tmp_path: Any, model: Any
) -> None:
    from tailcut.engine.hf.load import tokenizer_rows
    from tailcut.models.tokenizer import save_tokenizer, train_tokenizer

    texts = ["the cat sat on the mat 12 + 30 = 42"] * 20
    save_tokenizer(train_tokenizer(texts, 300), tmp_path)
    rows = tokenizer_rows(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert rows == len(tok) < VOCAB
    assert tokenizer_rows("random-tiny") is None

    async def body(engine: HFEngine) -> int:
        return engine.vocab_rows

    engine_rows = asyncio.run(_rows(model, rows))
    assert engine_rows == rows
    assert run(model, body) == VOCAB


async def _rows(model: Any, rows: int | None) -> int:
    engine = HFEngine(model, HFEngineConfig(max_seq_len=64), max_batch_size=2, vocab_rows=rows)
    try:
        return engine.vocab_rows
    finally:
        await engine.aclose()


# ── release and resume ──────────────────────────────────────────────────────────────


def test_release_frees_the_kv_cache_and_weights_and_resume_gives_the_same_tokens(
    model: Any,
) -> None:
    mine = tiny()
    reqs = [req(prompt(i, 5 + 3 * i), 16, temperature=0.0) for i in range(4)]
    param_bytes = sum(p.numel() * p.element_size() for p in mine.parameters())

    async def body(engine: HFEngine) -> tuple[list[GenerateResult], list[GenerateResult]]:
        before = list(await many(engine, reqs))
        kv_before = engine.kv_cache_bytes[0]
        buf = weakref.ref(engine._worker._cache.buf)
        ptr = mine.model.norm.weight.data_ptr()
        report = await engine.release_memory()
        assert report.tags == ("cuda_graph", "kv_cache", "weights")
        assert report.kv_cache_bytes == kv_before > 0 and engine.kv_cache_bytes[0] == 0
        assert buf() is None  # nothing else held the cache: its storage is gone
        assert report.weight_bytes == param_bytes and mine.model.norm.weight.data_ptr() != ptr
        assert report.seconds >= 0
        with pytest.raises(EngineError, match=r"released.*resume_memory"):
            await engine.generate(reqs[0])
        assert await engine.in_flight() == []
        back = await engine.resume_memory()
        assert back.kv_cache_bytes == kv_before and back.weight_bytes == param_bytes
        after = list(await many(engine, [req(q.prompt_ids, 16, temperature=0.0) for q in reqs]))
        return before, after

    before, after = run(mine, body)
    assert [r.output_ids for r in after] == [r.output_ids for r in before]


def test_release_is_refused_while_requests_run_and_abort_still_frees_slots(model: Any) -> None:
    async def body(engine: HFEngine) -> None:
        long = req(prompt(1, 6), 200)
        task = asyncio.create_task(engine.generate(long))
        await asyncio.sleep(0)
        await engine.generate(req(prompt(2, 4), 3))  # `long` is decoding now
        with pytest.raises(EngineError, match="idle"):
            await engine.release_memory(["kv_cache"])
        await engine.abort([long.request_id])
        assert (await task).finish_reason is FinishReason.ABORT
        report = await engine.release_memory(["kv_cache"])
        assert report.weight_bytes == 0 and report.kv_cache_bytes > 0
        with pytest.raises(ValueError, match="unknown memory tag"):
            await engine.release_memory(["gpu"])
        await engine.resume_memory(["kv_cache"])
        # slots, abort and compaction work as before on the new cache
        tasks = [asyncio.create_task(engine.generate(req(prompt(i, 5), 100))) for i in range(4)]
        await asyncio.sleep(0)
        await engine.generate(req(prompt(9, 4), 4))
        victim = (await engine.in_flight())[0]
        await engine.abort([victim])
        await engine.abort(await engine.in_flight())
        results = await asyncio.gather(*tasks)
        assert all(r.finish_reason is FinishReason.ABORT for r in results)
        stats = await engine.stats()
        assert stats.running == stats.kv_blocks_in_use == 0 and stats.tokens_after_abort == 0

    run(model, body)


def test_a_weight_sync_while_offloaded_lands_in_the_weights_resume_brings_back() -> None:
    mine, other = tiny(seed=0), tiny(seed=1)
    p = prompt(3, 7)

    async def body(engine: HFEngine) -> GenerateResult:
        assert await release_for_training(EngineView(engine), "none") is None
        report = await release_for_training(EngineView(engine), "kv+weights")
        assert report is not None and report.weight_bytes > 0
        await engine.update_weights(other.state_dict(), version=3)
        resumed = await resume_for_rollout(EngineView(engine), "kv+weights")
        assert resumed is not None and resumed.kv_cache_bytes > 0
        return await engine.generate(req(p, 12, temperature=0.0))

    after = run(mine, body)
    ref = run(other, lambda e: e.generate(req(p, 12, temperature=0.0)))
    assert after.output_ids == ref.output_ids and after.weight_version == 3


def test_engines_without_memory_release_are_left_alone() -> None:
    from tailcut.config import SimEngineConfig
    from tailcut.engine.sim import SimEngine

    async def body() -> None:
        sim = SimEngine(SimEngineConfig())
        assert await release_for_training(sim, "kv+weights") is None
        assert await resume_for_rollout(sim, "kv") is None

    asyncio.run(body())


# ── chunked prefill ─────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("buckets", [False, True])
def test_prompts_over_the_prefill_budget_are_chunked_with_the_same_tokens_and_logprobs(
    model: Any, buckets: bool
) -> None:
    reqs = [req(prompt(i, n), 12, seed=i) for i, n in enumerate((70, 37, 16, 51))]
    greedy = [req(q.prompt_ids, 12, temperature=0.0) for q in reqs]

    async def body(engine: HFEngine) -> tuple[list[GenerateResult], int, int]:
        out = list(await many(engine, reqs + greedy))
        c = engine.counters
        return out, c.prefill_passes, c.prefill_chunks

    whole, passes, chunks = run(model, body, buckets=buckets, max_prefill_tokens=8192)
    assert chunks == passes
    cut, passes, chunks = run(model, body, buckets=buckets, max_prefill_tokens=16)
    assert chunks > passes
    for a, b in zip(whole, cut, strict=True):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_memory_metrics_report_a_release_and_its_resume() -> None:
    from tailcut.engine.base import MemoryReport, memory_metrics

    assert memory_metrics(None, None) == {}
    rel = MemoryReport(("kv_cache",), 0.5, 100, 0, 2, 1000, 880)
    got = memory_metrics(rel, MemoryReport(("kv_cache",), 0.25, 100, 0, 0, 880, 1000))
    assert got == {
        "memory/release_s": 0.5, "memory/kv_freed_bytes": 100.0,
        "memory/weights_offloaded_bytes": 0.0, "memory/device_freed_bytes": 120.0,
        "memory/resume_s": 0.25,
    }  # fmt: skip
