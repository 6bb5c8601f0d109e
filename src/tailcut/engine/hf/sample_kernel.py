"""Sampling a pass's tokens as one Triton kernel (``engine.hf.sample_kernel``).

The eager sampler (``hf/sampling.py``) is a row of about 25 small kernels a pass, several
of which read and write the whole ``[rows, vocab]`` block in float32 (the cast, the
temperature, the log-softmax, its exponential, the running sum): at a vocabulary of
151,936 and 64 rows each such pass moves 39 MB, the same order as a small model's weights.
This kernel runs one program per row and reads the row's logits twice in the model's own
dtype:

1. the maximum and the softmax sum of ``logits / T`` (online, one per lane, merged at the
   end), the first index of the largest logit (greedy rows) and, for ``raw`` log-probs,
   the maximum and sum at temperature 1;
2. the inverse-CDF walk: the first token at which the running sum of ``exp(z - max)``
   exceeds ``u * sum`` (``u`` the row's uniform, clamped below 1 as the eager sampler
   does; the walk's last token where its sum rounds below that).

It writes each row's token id (``int64``: the next pass may read it on the device) and
its ``[token, log-prob]`` pair as float64 (what the host copies back in one copy). The
log-prob modes are the eager sampler's; so is the draw, up to the float rounding of the
running sums: where ``u`` falls within that rounding (about 1e-7 of the sum) of a step of
the CDF, a neighbouring token is drawn — in a long flat tail, where each token holds less
than that, a few tokens on. Rows with ``top_p < 1`` need the sorted nucleus: a batch holding one
runs the eager sampler.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tailcut.engine.hf.sampling import U_MAX, LogprobMode

BLOCK = 1024
"""Vocabulary columns a program reads per step of its loops."""

MODES: dict[str, int] = {"sampled": 0, "scaled": 1, "raw": 2}


def sample_full(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, mode: LogprobMode
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [rows, vocab]`` (a view of wider rows is fine: its last dim contiguous),
    ``temperature`` and ``uniform`` ``[rows]`` float32, any stride (``temperature <= 0``:
    greedy).
    Returns ``(tokens [rows] int64, pairs [rows, 2] float64: token id, log-prob)``."""
    if mode not in MODES:
        raise ValueError(f"logprob mode {mode!r} is not one of {', '.join(MODES)}")
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    pairs = torch.empty(rows, 2, dtype=torch.float64, device=logits.device)
    if rows == 0:
        return tokens, pairs
    block = max(16, min(BLOCK, _pow2(vocab)))
    _kernel()[(rows,)](
        logits, logits.stride(0), temperature, temperature.stride(0), uniform, uniform.stride(0),
        tokens, pairs, U_MAX, V=vocab,
        MODE=MODES[mode], BLOCK=block, NB=max(16, _pow2(-(-vocab // block))),
    )  # fmt: skip
    return tokens, pairs


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def sample(
        X, sx, TEMP, st, U, su, TOK, OUT, u_max,
        V: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        base = X + row.to(tl.int64) * sx
        t = tl.load(TEMP + row * st).to(tl.float32)
        greedy = t <= 0.0
        t = tl.where(greedy, 1.0, t)
        u = tl.minimum(tl.maximum(tl.load(U + row * su).to(tl.float32), 0.0), u_max)
        lane = tl.arange(0, BLOCK)
        ninf = float("-inf")
        # pass 1, per lane: the largest z = x / t, the first index of the largest logit
        # and (raw log-probs) the max and sum of exp at temperature 1, online
        m = tl.full([BLOCK], ninf, tl.float32)
        best = tl.full([BLOCK], ninf, tl.float32)
        at = tl.zeros([BLOCK], tl.int32)
        m1 = tl.full([BLOCK], -3.0e38, tl.float32)
        s1 = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + lane
            x = tl.load(base + cols, mask=cols < V, other=ninf).to(tl.float32)
            grow = x > best
            at = tl.where(grow, cols, at)
            best = tl.where(grow, x, best)
            m = tl.maximum(m, x / t)
            if MODE == 2:  # (m1 starts finite: no -inf - -inf to guard)
                m1_new = tl.maximum(m1, x)
                s1 = s1 * tl.exp(m1 - m1_new) + tl.exp(x - m1_new)
                m1 = m1_new
        top = tl.max(m, 0)
        largest = tl.max(best, 0)
        mode_at = tl.min(tl.where(best == largest, at, V), 0)
        # pass 2: each block's sum of exp(z - top); their running sum is the CDF at the
        # blocks' ends, its last entry the total
        nb = tl.arange(0, NB)
        sums = tl.zeros([NB], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + lane
            z = tl.load(base + cols, mask=cols < V, other=ninf).to(tl.float32) / t
            e = tl.where(z > ninf, tl.exp(z - top), 0.0)
            sums = tl.where(nb == start // BLOCK, tl.sum(e, 0), sums)
        ends = tl.cumsum(sums, 0)
        total = tl.max(ends, 0)
        target = u * total
        # pass 3, one block: the first whose running sum passes u * total, then its column
        b = tl.min(tl.where(ends > target, nb, NB - 1), 0)
        cols = b * BLOCK + lane
        z = tl.load(base + cols, mask=cols < V, other=ninf).to(tl.float32) / t
        e = tl.where(z > ninf, tl.exp(z - top), 0.0)
        c = tl.sum(tl.where(nb < b, sums, 0.0), 0) + tl.cumsum(e, 0)
        found = tl.min(tl.where((c > target) & (e > 0.0), cols, V), 0)
        # the block's own running sum rounding below u * total: its last token drawn
        last = tl.max(tl.where(e > 0.0, cols, -1), 0)
        found = tl.where(found < V, found, last)
        token = tl.where(greedy | (found < 0), mode_at, found)
        xt = tl.load(base + token).to(tl.float32)
        if MODE == 2:
            m1_top = tl.max(m1, 0)
            total1 = tl.sum(s1 * tl.exp(m1 - m1_top), 0)
            logprob = xt - m1_top - tl.log(total1)
        else:
            logprob = xt / t - top - tl.log(total)
            if MODE == 0:
                logprob = tl.where(greedy, 0.0, logprob)
        tl.store(TOK + row, token.to(tl.int64))
        tl.store(OUT + 2 * row, token.to(tl.float64))
        tl.store(OUT + 2 * row + 1, logprob.to(tl.float64))

    return sample
