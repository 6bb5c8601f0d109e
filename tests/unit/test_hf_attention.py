"""The embedded engine's attention path: a decode pass stores each row's new key and value
at its column, reads grouped keys/values in place and gives what repeating them to every
query head gives, with and without soft-capping."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fakes.hf_runs import decode_call  # noqa: E402
from tailcut.engine.hf.attention import SlotMasks, attending  # noqa: E402


def repeated(query, key, value, mask, softcap):  # type: ignore[no-untyped-def]
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(2, 3) * query.shape[-1] ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores + mask, dim=-1)
    return (probs @ value).transpose(1, 2)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4), (6, 1)])
def test_a_decode_pass_stores_the_new_keys_and_reads_grouped_keys_in_place(
    heads: int, kv_heads: int, softcap: float | None
) -> None:
    gen = torch.Generator().manual_seed(0)
    rows, columns, dim = 5, 40, 16
    keys, values = torch.randn(2, rows, kv_heads, columns, dim, generator=gen, dtype=torch.float64)
    query = torch.randn(rows, heads, 1, dim, generator=gen, dtype=torch.float64)
    new = torch.randn(2, rows, kv_heads, dim, generator=gen, dtype=torch.float64)
    ends = torch.tensor([3, 23, 0, 11, 17])
    out, masks, cache = decode_call(keys, values, query, new, ends, softcap=softcap)
    assert out.shape == (rows, 1, heads, dim) and out.is_contiguous()
    for r, end in enumerate(ends.tolist()):  # each row's new key and value at its column
        keys[r, :, end], values[r, :, end] = new[0, r], new[1, r]
    assert torch.equal(cache.buf[0, 0], keys) and torch.equal(cache.buf[0, 1], values)
    width = masks.full.shape[-1]
    want = repeated(query, keys[:, :, :width], values[:, :, :width], masks.full, softcap)
    tol = 1e-12 if softcap is None else 1e-6  # the soft-capped softmax runs in float32
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    assert masks.calls == 1


def test_the_decode_operator_outside_the_engine_and_in_a_prefill_pass() -> None:
    """Outside any pass (a caller's own compile of the model, one key) the operator gives
    that key's value on every head of its group, as attention over one key does; in a
    pass that is not a decode pass with a cache it is an error, never a guess."""
    gen = torch.Generator().manual_seed(1)
    query, kv = torch.randn(2, 4, 1, 8, generator=gen), torch.randn(2, 2, 2, 8, generator=gen)
    out = torch.ops.tailcut.slot_decode(query, kv, 0, 1.0, None, None, 0.0)
    want = torch.nn.functional.scaled_dot_product_attention(
        query, kv[0][:, :, None].repeat_interleave(2, 1), kv[1][:, :, None].repeat_interleave(2, 1)
    )
    torch.testing.assert_close(out, want.transpose(1, 2))
    masks = SlotMasks.decode(torch.tensor([1, 2]), 3, torch.float32)
    with attending(masks), pytest.raises(RuntimeError, match="not an embedded engine's decode"):
        torch.ops.tailcut.slot_decode(query, kv, 0, 1.0, None, None, 0.0)  # no cache
