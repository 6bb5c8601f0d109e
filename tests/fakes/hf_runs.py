"""Running the embedded engine on a small model in a test: one engine per call, closed
afterwards, bounded in time; requests and prompts made up from a few numbers; and the
references it is checked against (``model.generate``, one plain forward pass)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from tailcut.config import HFEngineConfig
from tailcut.engine.hf import HFEngine
from tailcut.types import GenerateRequest, SamplingParams, new_request_id

T = TypeVar("T")


def run_engine(
    model: Any,
    body: Callable[[HFEngine], Awaitable[T]],
    *,
    slots: int,
    buckets: bool = False,
    eos_ids: Sequence[int] = (),
    timeout_s: float = 60.0,
    **cfg: Any,
) -> T:
    """``body(engine)`` on a fresh engine over ``model`` (``max_seq_len`` 256 unless
    ``cfg`` says otherwise, no EOS unless given) within ``timeout_s``; ``buckets``: the
    padded shapes CUDA graphs are captured for, on the CPU."""

    async def main() -> T:
        engine = HFEngine(
            model,
            HFEngineConfig(**{"max_seq_len": 256, **cfg}),
            max_batch_size=slots,
            eos_ids=eos_ids,
        )
        engine._worker._runner.decoder.buckets = buckets
        try:
            async with asyncio.timeout(timeout_s):
                return await body(engine)
        finally:
            await engine.aclose()

    return asyncio.run(main())


def fixed_request(prompt: list[int], n: int, prefix: str, **sp: Any) -> GenerateRequest:
    """A request for exactly ``n`` tokens (EOS ignored)."""
    return GenerateRequest(
        new_request_id(prefix), prompt, SamplingParams(max_new_tokens=n, ignore_eos=True, **sp)
    )


def made_up_prompt(i: int, length: int, vocab: int, a: int, b: int) -> list[int]:
    """Prompt ``i`` of ``length`` ids in ``3 .. vocab-1`` (0-2: pad, bos, eos)."""
    return [3 + (i * a + j * b) % (vocab - 3) for j in range(length)]


def hf_greedy(model: Any, prompt_ids: list[int], n: int) -> list[int]:
    """Exactly ``n`` greedy tokens after ``prompt_ids`` from ``model.generate`` (no EOS)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    result: list[int] = out[0, len(prompt_ids) :].tolist()
    return result


def full_forward_logits(model: Any, prompt_ids: list[int], output_ids: list[int]) -> Any:
    """Logits predicting each output token, from one plain forward pass (no cache)."""
    import torch

    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0]
    return logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(output_ids)]


def check_greedy_then_sampled(
    model: Any,
    prompts: Sequence[list[int]],
    budgets: Sequence[int],
    results: Sequence[Any],
    sampled: tuple[list[int], float],
) -> None:
    """``results``: greedy runs of ``prompts`` (``budgets`` tokens each), then one run of
    ``sampled = (prompt, temperature)``. The greedy tokens are ``model.generate``'s; the
    sampled run's log-probs are the temperature-scaled ones of one plain forward pass."""
    import torch

    for p, n, r in zip(prompts, budgets, results, strict=False):
        assert r.output_ids == hf_greedy(model, p, n)
    prompt, temperature = sampled
    last = results[len(prompts)]
    logits = full_forward_logits(model, prompt, last.output_ids)
    picked = torch.tensor(last.output_ids)[:, None]
    want = torch.log_softmax(logits / temperature, dim=-1).gather(1, picked).squeeze(1)
    torch.testing.assert_close(torch.tensor(last.logprobs), want, atol=2e-4, rtol=1e-4)


def assert_inverse_cdf_draws(logp: Any, uniform: Any, tokens: Any, tolerance: float) -> None:
    """Each row's token is the inverse CDF of ``logp [rows, vocab]`` (log-probs, computed in
    float64 by the caller) at its uniform (clamped below 1, as the samplers clamp it): the
    uniform lies in the token's CDF interval, up to ``tolerance`` (the float32 rounding of
    the sampler's running sums), and the token has positive probability."""
    import math

    from tailcut.engine.hf.sampling import U_MAX

    cdf = logp.exp().cumsum(dim=-1).cpu()
    for row, tok in enumerate(tokens.tolist()):
        u = min(float(uniform[row]), U_MAX)
        lo = float(cdf[row, tok - 1]) if tok > 0 else 0.0
        hi = float(cdf[row, tok])
        assert lo - tolerance <= u <= hi + tolerance, (row, tok, lo, u, hi)
        assert math.isfinite(float(logp[row, tok])), (row, tok)


def decode_call(
    keys: Any, values: Any, query: Any, new: Any, ends: Any, *, kernel: bool = False, **kw: Any
) -> tuple[Any, Any, Any]:
    """One layer's attention call of a decode pass, as a model makes it, on a real slot
    cache holding ``keys``/``values [rows, kv_heads, columns, d]``: the layer hands its
    new keys and values (``new [2, rows, kv_heads, d]``) to the engine's attention, which
    stores them at each row's ``ends`` column and attends over the row's columns.
    ``kw``: the layer's ``sliding_window``/``softcap``. Returns ``(out [rows, 1, heads,
    d], the pass's masks, the cache)``."""
    import torch

    from tailcut.engine.hf.attention import SlotMasks, attending, slot_attention
    from tailcut.engine.hf.cache import KVShape, SlotKVCache

    rows, kv_heads, columns, dim = keys.shape
    shape = KVShape(1, kv_heads, dim, rows, columns, keys.dtype, keys.device)
    cache = SlotKVCache(shape, initial_columns=columns)
    cache.buf[0, 0].copy_(keys)
    cache.buf[0, 1].copy_(values)
    width = int(ends.max()) + 1
    cache.begin_decode(ends, width)
    masks = SlotMasks.decode(ends, width, keys.dtype)
    layer = torch.nn.Module()
    layer.layer_idx = 0
    with attending(masks, cache=cache, kernel=kernel):
        k, v = cache.update(new[0][:, :, None], new[1][:, :, None], 0)
        out, _ = slot_attention(layer, query, k, v, None, **kw)
    return out, masks, cache
