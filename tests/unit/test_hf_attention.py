"""The embedded engine's attention path: a decode pass reads grouped keys/values in place
and gives what repeating them to every query head gives, with and without soft-capping."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tailcut.engine.hf.attention import SlotMasks, attending, slot_attention  # noqa: E402


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
def test_a_decode_pass_reads_grouped_keys_in_place(heads: int, kv_heads: int, softcap) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(0)
    rows, width, dim = 5, 24, 16
    cache = torch.randn(rows, kv_heads, 2, 40, dim, generator=gen, dtype=torch.float64)
    key, value = cache[:, :, 0, :width], cache[:, :, 1, :width]  # strided views, as the cache's
    query = torch.randn(rows, heads, 1, dim, generator=gen, dtype=torch.float64)
    ends = torch.tensor([3, 23, 0, 11, 17])
    masks = SlotMasks.decode(ends, width, torch.float64)
    with attending(masks):
        out, _ = slot_attention(torch.nn.Identity(), query, key, value, None, softcap=softcap)
    assert out.shape == (rows, 1, heads, dim)
    want = repeated(query, key, value, masks.full, softcap)
    tol = 1e-12 if softcap is None else 1e-6  # the soft-capped softmax runs in float32
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    assert masks.calls == 1
