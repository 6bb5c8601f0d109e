"""The decode-attention kernel (``engine.hf.decode_kernel``, ``hf/decode_attention.py``) on the
CPU, under Triton's interpreter: the same kernel source the GPU compiles, run program by
program. Against a reference written from the definition (each row's own columns, its
window, soft-capping, grouped heads, columns split over programs), against the masked eager
path, and end to end: every family's greedy tokens equal ``model.generate``'s and its
sampled log-probs a full forward pass's with the kernel on. (The interpreter multiplies
bfloat16 wrongly, so half precision is checked in float16 here, bfloat16 in the GPU tests.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fakes.hf_runs import (  # noqa: E402
    decode_call,
    fixed_request,
    full_forward_logits,
    hf_greedy,
    made_up_prompt,
    run_engine,
)
from hf_families import FAMILIES, WINDOW, tiny_model  # noqa: E402
from tailcut.engine.hf import HFEngine  # noqa: E402
from tailcut.engine.hf import decode_attention as kernel_module  # noqa: E402
from tailcut.engine.hf.attention import (  # noqa: E402
    SlotMasks,
    attending,
    slot_attention,
)
from tailcut.engine.hf.decode_attention import decode_attention  # noqa: E402
from tailcut.engine.hf.sampling import nucleus_logprobs  # noqa: E402
from tailcut.engine.hf.triton_runs import kernel_for, pdl_for  # noqa: E402
from tailcut.types import GenerateResult  # noqa: E402

VOCAB = 256
pytestmark = pytest.mark.timeout(300)


def reference(q, k, v, ends, scale, window=None, softcap=None):  # type: ignore[no-untyped-def]
    """Row by row from the definition, in float64."""
    rows, heads, _, dim = q.shape
    groups = heads // k.shape[1]
    out = torch.empty(rows, 1, heads, dim, dtype=torch.float64)
    for r in range(rows):
        end = int(ends[r])
        lo = max(0, end - window + 1) if window else 0
        keys = k[r, :, lo : end + 1].double().repeat_interleave(groups, 0)
        values = v[r, :, lo : end + 1].double().repeat_interleave(groups, 0)
        scores = q[r].double() @ keys.transpose(1, 2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out[r, 0] = (torch.softmax(scores, -1) @ values)[:, 0]
    return out


CASES = [
    # rows, heads, kv_heads, head_dim, width, window, softcap, splits
    (5, 14, 2, 64, 200, None, None, 1),  # Qwen2-0.5B's heads: 7 queries a key/value head
    (3, 8, 8, 32, 70, 16, None, 1),  # no grouping, a window
    (4, 12, 2, 80, 300, None, 30.0, 3),  # head size not a power of two, soft-capped, split
    (2, 4, 1, 64, 600, 100, None, 4),  # a window inside a split row
    (6, 6, 3, 16, 130, None, None, 2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("rows", "heads", "kv", "dim", "width", "window", "softcap", "splits"), CASES
)
def test_the_kernel_attends_each_row_over_its_own_columns(  # type: ignore[no-untyped-def]
    dtype, rows, heads, kv, dim, width, window, softcap, splits
) -> None:
    gen = torch.Generator().manual_seed(rows * heads + dim)
    # the cache's layout: [k|v, slots, kv_heads, capacity, dim], read as strided views
    cache = torch.randn(2, rows + 2, kv, width + 13, dim, generator=gen).to(dtype)
    key, value = cache[0, :rows, :, :width], cache[1, :rows, :, :width]
    query = torch.randn(rows, heads, 1, dim, generator=gen).to(dtype)
    ends = torch.randint(0, width, (rows,), generator=gen)
    ends[0], ends[-1] = width - 1, 0  # the widest row, and a row of one column
    got = decode_attention(
        query, key, value, ends, scale=dim**-0.5, window=window, softcap=softcap, splits=splits
    )
    assert got.shape == (rows, 1, heads, dim) and got.dtype == dtype and got.is_contiguous()
    want = reference(query, key, value, ends, dim**-0.5, window, softcap)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_splitting_a_row_changes_nothing_but_rounding() -> None:
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(2, 3, 2, 900, 32, generator=gen)
    query = torch.randn(3, 4, 1, 32, generator=gen)
    ends = torch.tensor([899, 450, 64])
    one = decode_attention(query, key, value, ends, scale=0.2, splits=1)
    for splits in (2, 5, 16):  # 16 splits: some are empty for the shorter rows
        torch.testing.assert_close(
            decode_attention(query, key, value, ends, scale=0.2, splits=splits), one
        )


@pytest.mark.parametrize(("splits", "window"), [(1, None), (3, None), (4, 100), (16, None)])
def test_the_kernel_stores_the_new_keys_and_values_as_it_reads_them(
    splits: int, window: int | None
) -> None:
    """``new``: each row's newest key and value land in the cache at its column (and
    nowhere else), and the output equals attending over the cache with them stored first;
    with the row's columns split, the one program that holds the column stores it."""
    gen = torch.Generator().manual_seed(splits)
    rows, kv, heads, dim, width = 4, 2, 6, 32, 700
    cache = torch.randn(2, rows + 1, kv, width + 5, dim, generator=gen)
    before = cache.clone()
    key, value = cache[0, :rows, :, :width], cache[1, :rows, :, :width]
    query = torch.randn(rows, heads, 1, dim, generator=gen)
    ends = torch.tensor([699, 0, 64, 333])
    new = torch.randn(2, rows, kv, dim, generator=gen)
    got = decode_attention(
        query, key, value, ends, scale=0.3, window=window, splits=splits, new=new
    )  # fmt: skip
    want_cache = before.clone()
    for r, end in enumerate(ends.tolist()):
        want_cache[:, r, :, end] = new[:, r]
    assert torch.equal(cache, want_cache)
    want = reference(query, want_cache[0, :rows], want_cache[1, :rows], ends, 0.3, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="new keys/values"):
        decode_attention(query, key, value, ends, scale=0.3, new=new[:, :2])


def test_a_decode_call_the_kernel_cannot_take_stores_before_the_masked_path() -> None:
    """With the kernel on, a layer it cannot take (here a head size over its limit) runs
    the indexed store and the masked path, which reads the new column."""
    dim = kernel_module.MAX_HEAD_DIM + 16
    keys, values = torch.zeros(2, 2, 1, 4, dim)
    new = torch.ones(2, 2, 1, dim)
    query = torch.ones(2, 2, 1, dim)
    out, masks, cache = decode_call(keys, values, query, new, torch.tensor([1, 2]), kernel=True)
    assert out.shape == (2, 1, 2, dim) and masks.calls == 1
    assert torch.equal(cache.buf[0, :, 0, :, 1], new[:, 0]) and torch.equal(
        cache.buf[0, :, 1, :, 2], new[:, 1]
    )  # the store ran
    assert float(out[1].sum()) > 0  # and the masked path read it (the rest is zeros)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, 4.0)])
def test_a_decode_call_runs_the_kernel_and_matches_the_masked_path(
    window: int | None, softcap: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        ran.append(1)
        return decode_attention(*args, **kwargs)

    monkeypatch.setattr(kernel_module, "decode_attention", counted)
    gen = torch.Generator().manual_seed(2)
    rows, columns, dim = 5, 40, 16
    keys, values = torch.randn(2, rows, 2, columns, dim, generator=gen)
    query = torch.randn(rows, 6, 1, dim, generator=gen)
    new = torch.randn(2, rows, 2, dim, generator=gen)
    ends = torch.tensor([3, 23, 0, 11, 17])
    kw = {"sliding_window": window, "softcap": softcap}
    eager, _, stored = decode_call(keys, values, query, new, ends, **kw)
    assert ran == []
    kernel, masks, cache = decode_call(keys, values, query, new, ends, kernel=True, **kw)
    assert ran == [1]
    assert masks.ends is not None and masks.ends.dtype == torch.int32  # cast once a pass
    torch.testing.assert_close(kernel, eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.buf, stored.buf)  # the kernel stored what the indexed store did
    # a prefill pass has no per-row ends: the kernel flag leaves it on the masked path
    pre = SlotMasks.prefill(torch.tensor([4, 2]), 4, torch.float32)
    with attending(pre, kernel=True):
        q4 = torch.randn(2, 6, 4, dim, generator=gen)
        k4, v4 = keys[:2, :, :4], values[:2, :, :4]
        out, _ = slot_attention(torch.nn.Identity(), q4, k4, v4, None)
    assert out.shape == (2, 4, 6, dim) and pre.calls == 1


def test_the_setting_resolves_per_device() -> None:
    cpu = torch.device("cpu")
    assert kernel_for("decode_kernel", None, cpu, default=True) is False  # default: CUDA only
    assert kernel_for("decode_kernel", False, cpu, default=True) is False
    assert kernel_for("decode_kernel", True, cpu, default=True) is True  # the interpreter


def test_programmatic_dependent_launch_is_for_hopper_cuda_only() -> None:
    """``engine.hf.pdl``: off by default, and asked for off CUDA an error naming it (the
    launches themselves are the GPU tests')."""
    cpu = torch.device("cpu")
    assert pdl_for(None, cpu, default=True) is False
    assert pdl_for(False, cpu, default=True) is False
    with pytest.raises(ValueError, match=r"engine\.hf\.pdl=true needs a CUDA device of compute"):
        pdl_for(True, cpu, default=False)
    with pytest.raises(ValueError, match=r"engine\.hf\.pdl"):
        run_engine(tiny_model("llama", VOCAB), _greedy_run([[5, 6]], [2]), slots=1, pdl=True)


def test_asking_for_the_kernel_where_it_cannot_run_names_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"engine\.hf\.decode_kernel=true needs Triton on a CUDA"):
        kernel_for("decode_kernel", True, torch.device("cpu"), default=True)
    with pytest.raises(ValueError, match="decode_kernel"):
        run_engine(
            tiny_model("llama", VOCAB), _greedy_run([[5, 6]], [2]), slots=1, decode_kernel=True
        )


def _greedy_run(prompts: list[list[int]], budgets: list[int]):  # type: ignore[no-untyped-def]
    async def body(engine: HFEngine) -> list[GenerateResult]:
        first = [
            asyncio.create_task(engine.generate(fixed_request(p, n, "dk", temperature=0.0)))
            for p, n in zip(prompts[:3], budgets[:3], strict=True)
        ]
        await first[1]  # the rest join a running batch (slots reused, rows moved)
        later = [
            asyncio.create_task(engine.generate(fixed_request(p, n, "dk", temperature=0.0)))
            for p, n in zip(prompts[3:], budgets[3:], strict=True)
        ]
        return list(await asyncio.gather(*first, *later))

    return body


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_decodes_exactly_with_the_kernel(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ragged prompts across the window, generations past it; greedy tokens equal
    ``model.generate``'s, then sampled log-probs equal a full forward pass's."""
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return decode_attention(*args, **kwargs)

    monkeypatch.setattr(kernel_module, "decode_attention", counted)
    model = tiny_model(family, VOCAB, initializer_range=0.5)
    prompts = [made_up_prompt(i, n, VOCAB, 37, 11) for i, n in enumerate((3, 11, 5, 20, 2))]
    budgets = [16, 5, 19, 12, 14]
    assert max(budgets) > 2 * WINDOW
    results = run_engine(
        model, _greedy_run(prompts, budgets), slots=3, timeout_s=240, max_seq_len=128,
        decode_kernel=True,
    )  # fmt: skip
    assert len(calls) >= sum(budgets) // 3  # decode passes x layers ran it
    for p, n, r in zip(prompts, budgets, results, strict=True):
        assert r.output_ids == hf_greedy(model, p, n)

    async def sampled(engine: HFEngine) -> GenerateResult:
        return await engine.generate(
            fixed_request(prompts[3], 14, "dk", temperature=0.8, top_p=0.9, seed=4)
        )

    r = run_engine(model, sampled, slots=2, timeout_s=240, max_seq_len=128, decode_kernel=True)
    logits = full_forward_logits(model, prompts[3], r.output_ids)
    want = nucleus_logprobs(logits, 0.8, 0.9).gather(1, torch.tensor(r.output_ids)[:, None])
    torch.testing.assert_close(torch.tensor(r.logprobs), want.squeeze(1), atol=2e-4, rtol=1e-4)
