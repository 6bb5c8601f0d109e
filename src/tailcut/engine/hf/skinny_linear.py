"""A decode pass's small projections as one Triton kernel each (``engine.hf.skinny_linear``).

At batch 64 a small model's attention projections are tiny GEMMs: ``[64, 896] x [896,
1152]`` (the fused q/k/v of a 0.5B model) reads 2 MB of weights, under 1 us at HBM speed,
yet cuBLAS takes 4–4.5 us in a profiled decode pass. The reading this kernel was written
on: cuBLAS's output tiles of ``64 x 64`` or wider leave a handful of SMs each walking a
long slice of the weight while the rest idle. This kernel gives each program
:data:`BLOCK_N` output columns and every row of the batch (``rows <=`` :data:`MAX_ROWS`),
so a ``[.., 896]`` output is 56 programs reading 28 KB each, the input's rows read from
L2 by all of them; the bias is added in float32 before the one rounding to the output's
dtype. Wider batches, and weights past :data:`MAX_IN` or :data:`MAX_OUT`, go to
``F.linear``. Measured on an H100 (``linear_bench``, 64 rows): 1.10–1.13x cuBLAS on a
0.5B model's q/k/v and o, 1.03–1.05x on a 1.5B's, slower on the MLP's projections
(0.65–0.88x), and no gain in a whole decode pass — both sides take 3–4 us where reading
the weight takes under 1, a replayed kernel's launch and one chain of loads.

The op is registered with torch (``tailcut::skinny_linear``), so the compiled decode forward
calls it as one opaque kernel and a CUDA graph records it as any other. Off by default.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

MAX_ROWS = 64
"""Rows (batch) up to which the kernel runs: every row is in each program's tile."""

MAX_IN = 4096
"""Input features up to which the kernel runs (a longer walk is worth cuBLAS's split-K)."""

MAX_OUT = 4096
"""Output features up to which the kernel runs (a wider output fills the GPU with cuBLAS's
own tiles: a gated MLP's gate/up projection)."""

BLOCK_N = 16
"""Output columns a program computes."""

BLOCK_K = 128
"""Input features a program reads per step of its loop."""


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` runs the kernel for this call (else ``F.linear``): shapes and
    dtypes only, so the compiled forward traces it to guards (where Triton runs is the
    setting's to check: ``triton_runs.kernel_for``)."""
    rows = x.numel() // max(1, x.shape[-1])
    return (
        0 < rows <= MAX_ROWS
        and weight.shape[1] <= MAX_IN
        and weight.shape[0] <= MAX_OUT
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.stride(1) == 1
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, by the kernel where :func:`usable`."""
    if not usable(x, weight):
        return F.linear(x, weight, bias)
    return torch.ops.tailcut.skinny_linear(x, weight, bias)


def run(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
    warps: int = 4,
    stages: int = 4,
) -> torch.Tensor:
    """The kernel itself on ``x [..., in]``, ``weight [out, in]`` (its rows any stride, its
    last dim contiguous), ``bias [out]`` or None: ``[..., out]`` in ``x``'s dtype. The
    block sizes and launch settings are the benchmark's to vary."""
    lead = x.shape[:-1]
    a = x.reshape(-1, x.shape[-1])
    if a.stride(-1) != 1:
        a = a.contiguous()
    rows, k = a.shape
    n = weight.shape[0]
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows and n:
        _kernel()[(triton_cdiv(n, block_n),)](
            a, weight, weight if bias is None else bias, out, rows, n, k,
            a.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=max(16, _pow2(rows)), BLOCK_N=block_n,
            BLOCK_K=block_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out.reshape(*lead, n)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@torch.library.custom_op("tailcut::skinny_linear", mutates_args=())
def _op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return run(x, weight, bias)


@_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def skinny(
        X, W, B, OUT, rows, n_out, k_in, sx, sw, so,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            k = k0 + kk
            a = tl.load(
                X + m[:, None] * sx + k[None, :],
                mask=(m < rows)[:, None] & (k < k_in)[None, :], other=0.0,
            )  # fmt: skip
            w = tl.load(
                W + cols[:, None] * sw + k[None, :],
                mask=(cols < n_out)[:, None] & (k < k_in)[None, :], other=0.0,
            )  # fmt: skip
            acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(B + cols, mask=cols < n_out, other=0.0).to(tl.float32)[None, :]
        tl.store(
            OUT + m[:, None] * so + cols[None, :], acc.to(OUT.dtype.element_ty),
            mask=(m < rows)[:, None] & (cols < n_out)[None, :],
        )  # fmt: skip

    return skinny
