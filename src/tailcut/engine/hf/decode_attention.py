"""Decode attention over the slot cache as one Triton kernel (``engine.hf.decode_kernel``).

A decode pass feeds one token per row; row ``r``'s query attends over its own cache columns
``0 .. ends[r]`` (within a sliding window: ``ends[r] - window + 1 .. ends[r]``). The eager
path (``hf/attention.py``) hands ``scaled_dot_product_attention`` an additive mask over the
pass's whole key width — every row reads as many columns as the longest row holds — and
then copies the output into the layout the model's output projection reads. This kernel:

* reads each row's own columns only: with a long tail in the batch (one row at 12k tokens,
  most at 1k) the keys and values read per pass shrink to the rows' own lengths;
* runs one program per (row, key/value head): the query heads sharing that head (grouped
  query attention) are one tile, so each key and value is read once per head group;
* splits a row's columns over several programs when the rows are few and long (the
  flash-decoding split: partial maxima, sums and outputs, merged by a second kernel);
* stores the pass's new key and value of each row (``new``) as it reads them — the eager
  path's separate indexed store per layer is gone;
* writes ``[rows, 1, heads, head_dim]`` directly, applies soft-capping (Gemma 2) and the
  sliding window, softmax in float32 — the arithmetic of the eager path, with the
  probabilities rounded to the cache's dtype before the value product, as flash attention
  does.

Used on CUDA where Triton imports (decode passes only, dropout 0, head_dim up to 256); CPU
tests run the same kernel under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tailcut.engine.hf.triton_runs import runs_on

TILE = 16384
"""Elements of the key (and value) tile a program reads per step of its loop: the step's
columns are ``TILE / head_dim``, at most the pass's key width, at least 16. A decode
program's loads are a chain, each waiting for the one before (a loop over blocks is not
pipelined): the wider the step, the fewer the waits (64 columns of 64 dims took 7 us a
layer at batch 64 and ~200 columns)."""

SPLIT_COLUMNS = 512
"""A row is split over several programs only if each would still read this many columns."""

MAX_HEAD_DIM = 256


def usable(query: torch.Tensor, dropout: float) -> bool:
    """Whether :func:`decode_attention` runs this layer's call: one query per row, no
    dropout, a supported head size and dtype, on CUDA (or the interpreter on CPU)."""
    return (
        query.shape[2] == 1
        and dropout == 0.0
        and query.shape[-1] <= MAX_HEAD_DIM
        and query.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and runs_on(query.device)
    )


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ends: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    splits: int | None = None,
    new: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``query [rows, heads, 1, d]``; ``key``/``value [rows, kv_heads, width, d]`` (views
    of the cache, any strides with the last dim contiguous); ``ends [rows]``: the column of
    each row's newest key (inclusive). Returns ``[rows, 1, heads, d]``, contiguous.
    ``splits``: programs per (row, head) (None: chosen from the rows and the widest row's
    columns, ``key.shape[2]``). ``new [2, rows, kv_heads, d]``: each row's newest key and
    value, stored here at column ``ends[row]`` of ``key``/``value`` (and attended to from
    the registers that stored them); None: they are in the cache already. ``pdl``: launched
    as a programmatic dependent of the kernel before it (CUDA, compute capability 9+): its
    blocks start while that kernel drains and wait for its writes before the first read."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} key/value heads")
    out = torch.empty(rows, 1, heads, dim, dtype=query.dtype, device=query.device)
    if rows == 0:
        return out
    groups = heads // kv_heads
    if splits is None:
        splits = _splits(rows * kv_heads, key.shape[2], query.device)
    k = _kernels()
    pad = {
        "GROUPS": groups,
        "G_PAD": max(16, _pow2(groups)),
        "D": dim,
        "D_PAD": max(16, _pow2(dim)),
        "BLOCK_N": block_columns(key.shape[2], dim),
        "WINDOW": int(window or 0),
        "SOFTCAP": float(softcap or 0.0),
        # float32 caches multiply in float32 (not TF32): the eager path's arithmetic
        "PRECISION": "ieee" if query.dtype == torch.float32 else "tf32",
        "STORE": new is not None,
        "PDL": pdl,
    }
    launch = {"launch_pdl": True} if pdl else {}
    if new is not None and new.shape != (2, rows, kv_heads, dim):
        raise ValueError(f"new keys/values {tuple(new.shape)} != {(2, rows, kv_heads, dim)}")
    fresh = key if new is None else new
    fresh_strides = (0, 0, 0) if new is None else new.stride()[:3]
    ends = ends.to(torch.int32)  # a no-op for a pass's ``SlotMasks.ends`` (int32 already)
    q = query[:, :, 0]
    strides = (*q.stride()[:2], *key.stride()[:3], *value.stride()[:3], *fresh_strides)
    if splits <= 1:
        k["attend"][(rows, kv_heads)](
            q, key, value, fresh, ends, out, None, 0, *strides, out.stride(0), out.stride(2),
            scale, 1, **pad, **launch,
        )  # fmt: skip
        return out
    part = torch.empty(rows, heads, splits, dim + 2, dtype=torch.float32, device=query.device)
    k["attend"][(rows, kv_heads, splits)](
        q, key, value, fresh, ends, out, part, part.stride(0), *strides, out.stride(0), out.stride(2),
        scale, splits, **pad, **launch,
    )  # fmt: skip
    k["merge"][(rows, heads)](
        part, out, part.stride(0), part.stride(1), out.stride(0), out.stride(2), splits,
        D=dim, D_PAD=pad["D_PAD"], S_PAD=_pow2(splits),
    )  # fmt: skip
    return out


def block_columns(width: int, dim: int) -> int:
    """Key columns a program reads per step: :data:`TILE` elements of ``dim``-wide rows, no
    more than the pass's ``width`` (a power of two, 16 at the least)."""
    return max(16, min(TILE // _pow2(max(16, dim)), _pow2(width)))


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _splits(programs: int, width: int, device: torch.device) -> int:
    """Split rows' columns when (row, head) programs alone leave most of the GPU idle."""
    if device.type != "cuda":
        return 1
    units = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= units:
        return 1
    return max(1, min(units // programs, width // SPLIT_COLUMNS, 64))


@functools.cache
def _kernels() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def attend(
        Q, K, V, NEW, ENDS, OUT, PART, sp_r,
        sq_r, sq_h, sk_r, sk_h, sk_n, sv_r, sv_h, sv_n, sn_kv, sn_r, sn_h, so_r, so_h,
        scale, splits,
        GROUPS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
        STORE: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            # every input (the queries, the new keys and values, the cache) may be the
            # previous kernel's output or its predecessors': wait for them all first
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        n = tl.arange(0, BLOCK_N)
        heads = kvh * GROUPS + g
        qmask = (g < GROUPS)[:, None] & (d < D)[None, :]
        q = tl.load(Q + row * sq_r + heads[:, None] * sq_h + d[None, :], mask=qmask, other=0.0)
        end = tl.load(ENDS + row)
        lo = 0
        if WINDOW > 0:
            lo = tl.maximum(end - WINDOW + 1, 0)
        # this program's share of the row's blocks of columns
        first = lo // BLOCK_N
        blocks = end // BLOCK_N + 1 - first
        per = tl.cdiv(blocks, splits)
        start = (first + split * per) * BLOCK_N
        stop = tl.minimum((first + (split + 1) * per) * BLOCK_N, end + 1)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        kbase = K + row * sk_r + kvh * sk_h
        vbase = V + row * sv_r + kvh * sv_h
        if STORE:
            # the row's newest key and value: read from the pass's inputs, not the cache, and
            # stored into the cache by the one program whose columns hold ``end``
            dmask = d < D
            nk = tl.load(NEW + row * sn_r + kvh * sn_h + d, mask=dmask, other=0.0)
            nv = tl.load(NEW + sn_kv + row * sn_r + kvh * sn_h + d, mask=dmask, other=0.0)
            if split == (end // BLOCK_N - first) // per:
                tl.store(kbase + end * sk_n + d, nk.to(K.dtype.element_ty), mask=dmask)
                tl.store(vbase + end * sv_n + d, nv.to(V.dtype.element_ty), mask=dmask)
        col = start
        while col < stop:  # (a while loop: Triton's interpreter takes no tensor range bounds)
            cols = col + n
            live = (cols >= lo) & (cols <= end)
            tile = live[:, None] & (d < D)[None, :]
            if STORE:
                tile = tile & (cols != end)[:, None]
            k = tl.load(kbase + cols[:, None] * sk_n + d[None, :], mask=tile, other=0.0)
            # the values are loaded before the keys are used: both reads are in flight at
            # once rather than the second waiting for the first's product
            v = tl.load(vbase + cols[:, None] * sv_n + d[None, :], mask=tile, other=0.0)
            if STORE:
                k = tl.where((cols == end)[:, None], nk[None, :].to(k.dtype), k)
                v = tl.where((cols == end)[:, None], nv[None, :].to(v.dtype), v)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if SOFTCAP > 0:
                e = tl.exp(2.0 * s / SOFTCAP)  # tanh(x) = 1 - 2 / (e^{2x} + 1)
                s = SOFTCAP * (1.0 - 2.0 / (e + 1.0))
            s = tl.where(live[None, :], s, float("-inf"))
            top = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - top[:, None])
            alpha = tl.exp(m - top)
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = top
            col += BLOCK_N
        if PART is None:
            out = acc / total[:, None]
            tl.store(
                OUT + row * so_r + heads[:, None] * so_h + d[None, :],
                out.to(OUT.dtype.element_ty), mask=qmask,
            )  # fmt: skip
        else:
            # partial result of this split: [max, sum, acc...] per head (an empty split:
            # max -inf, sum 0, acc 0 — the merge gives it weight 0)
            base = PART + row * sp_r + heads * (splits * (D + 2)) + split * (D + 2)
            gmask = g < GROUPS
            tl.store(base, m, mask=gmask)
            tl.store(base + 1, total, mask=gmask)
            tl.store(base[:, None] + 2 + d[None, :], acc, mask=qmask)

    @triton.jit
    def merge(
        PART, OUT, sp_r, sp_h, so_r, so_h, splits,
        D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        live = s < splits
        base = PART + row * sp_r + head * sp_h + s * (D + 2)
        m = tl.load(base, mask=live, other=float("-inf"))
        total = tl.load(base + 1, mask=live, other=0.0)
        acc = tl.load(
            base[:, None] + 2 + d[None, :], mask=live[:, None] & (d < D)[None, :], other=0.0
        )
        top = tl.max(m, 0)
        w = tl.where(live & (total > 0), tl.exp(m - top), 0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(total * w, 0)
        tl.store(OUT + row * so_r + head * so_h + d, out.to(OUT.dtype.element_ty), mask=d < D)

    return {"attend": attend, "merge": merge}
