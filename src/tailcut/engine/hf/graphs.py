"""The embedded engine's decode pass from fixed buffers, replayed from CUDA graphs.

A decode pass reads its inputs from one device buffer that never moves::

    inputs[:rows, 0]   cache column of each row's new token (= its RoPE position)
    inputs[:rows, 1]   that token's id

filled from a page-locked host buffer by one asynchronous copy. On CUDA with graphs on, the
pass runs through a CUDA graph captured for its **bucket**: the rows rounded up (1, 2, 4,
then multiples of 8, up to the slots) and the key columns rounded up to a power of two (at
least 64, at most the cache's capacity). Rows beyond the real ones feed token 0 at column 0
of slots that hold no request (their keys/values land in free slots, later overwritten) and
their logits are ignored; columns beyond a row's own are masked. A bucket's graph is
captured the first time it is needed, right after that pass ran eagerly (capturing records
the kernels without running them, so it never touches the cache), or all at once with
:meth:`DecodeStep.capture_all` while no request runs (on token 0 in free slots). The weights and the KV cache are read
in place, so ``update_weights`` needs no recapture.

Prefill passes (variable prompt lengths) always run eagerly; on CUDA their shapes are
padded too (:func:`prefill_shape`), and so are eager decode passes, because attention
libraries build a plan per new shape: a decode pass whose width grew by one column each
step used to pay that cost every step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tailcut.engine.hf.attention import SlotMasks
from tailcut.engine.hf.cache import SlotKVCache

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, SlotMasks, torch.Tensor | None], torch.Tensor]
"""``forward(ids [rows, cols], positions [rows, cols], masks, out) -> last logits [rows,
vocab]`` (written into ``out [rows, vocab]`` where the LM head can: a view of it)."""

MIN_WIDTH = 64


def batch_bucket(rows: int, slots: int) -> int:
    """Rows a graph is captured for: 1, 2, 4, then multiples of 8, capped at ``slots``."""
    bucket = 1 << max(0, rows - 1).bit_length() if rows <= 4 else -(-rows // 8) * 8
    return min(bucket, slots)


def width_bucket(width: int, capacity: int) -> int:
    """Key columns a graph attends over: a power of two >= ``MIN_WIDTH``, capped."""
    return min(capacity, max(MIN_WIDTH, 1 << max(0, width - 1).bit_length()))


def prefill_shape(
    rows: int, width: int, *, first: int, slots: int, capacity: int, budget: int
) -> tuple[int, int]:
    """Padded ``(rows, columns)`` of a prefill of ``rows`` prompts of up to ``width``
    tokens written from slot ``first``: columns to a power of two (>= 16) up to 256, then
    to a multiple of 256 (at most twice ``width``); rows to their decode bucket where the
    slots after ``first`` are free and the padded size stays within ``budget`` tokens.
    Few distinct shapes let the attention library reuse its per-shape plans (building one
    costs tens of ms on CUDA)."""
    cols = 1 << max(4, (width - 1).bit_length()) if width <= 256 else -(-width // 256) * 256
    cols = max(width, min(cols, capacity))
    padded = batch_bucket(rows, slots)
    if first + padded > slots or padded * cols > max(budget, rows * cols):
        padded = rows
    return padded, cols


class HostStage:
    """Page-locked (on CUDA) host buffers and their device twins for per-pass inputs:
    ``longs [slots, 2]`` (column, token id) and ``floats [slots, 3]`` (temperature,
    top-p, uniform), row-major so that the first ``rows`` rows are one contiguous block
    (one asynchronous copy), and ``out [slots, 2]`` for the sampled tokens and log-probs
    coming back. Host writes go through numpy views: no tensor per value.

    Two sets of host buffers, taken in turn (:meth:`flip`, once a pass): with a pass
    launched ahead (``engine.hf.overlap``) the host fills the next pass's inputs while the
    copies of the one before may not have run yet."""

    def __init__(self, slots: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.device = device
        self._host = [
            (
                torch.zeros(slots, 2, dtype=torch.long, pin_memory=pin),
                torch.zeros(slots, 3, dtype=torch.float32, pin_memory=pin),
                torch.zeros(slots, 2, dtype=torch.float64, pin_memory=pin),
            )
            for _ in range(2)
        ]
        self._turn = 0
        self.longs = torch.zeros(slots, 2, dtype=torch.long, device=device)
        self.floats = torch.zeros(slots, 3, dtype=torch.float32, device=device)
        self.flip()

    def flip(self) -> None:
        """Write the other set of host buffers from now on."""
        self._turn ^= 1
        self.host_longs, self.host_floats, self.host_out = self._host[self._turn]
        self.longs_np: np.ndarray[Any, Any] = self.host_longs.numpy()
        self.floats_np: np.ndarray[Any, Any] = self.host_floats.numpy()

    def upload_longs(self, rows: int) -> None:
        self.longs[:rows].copy_(self.host_longs[:rows], non_blocking=True)

    def upload_floats(self, rows: int) -> torch.Tensor:
        """Copy the first ``rows`` float rows to the device; returns that ``[rows, 3]`` view."""
        out = self.floats[:rows]
        out.copy_(self.host_floats[:rows], non_blocking=True)
        return out


class DecodeStep:
    """One decode pass over rows ``0..n-1``: eager, or replayed from a CUDA graph."""

    def __init__(
        self,
        forward: Forward,
        cache: SlotKVCache,
        stage: HostStage,
        *,
        vocab: int,
        graphs: bool,
    ) -> None:
        self._forward = forward
        self._cache = cache
        self._stage = stage
        self.slots = cache.shape.slots
        self.capacity = cache.shape.max_seq_len
        self.graphs = graphs and cache.shape.device.type == "cuda"
        self.buckets = cache.shape.device.type == "cuda"
        """Pad passes to their bucket (always on CUDA; settable for tests on CPU)."""
        self._graphs: dict[tuple[int, int], Any] = {}
        self.capture_s = 0.0
        """Seconds spent capturing graphs so far."""
        self.replays = 0
        """Decode passes replayed from a graph so far."""
        self._vocab = vocab
        if self.graphs:
            if cache.buf.shape[4] < self.capacity:
                raise ValueError("CUDA graphs need the KV cache allocated at full capacity")
            self._stream = torch.cuda.Stream(cache.shape.device)
            self._buffers()

    def _buffers(self) -> None:
        shape = self._cache.shape
        self._logits = torch.empty(self.slots, self._vocab, dtype=shape.dtype, device=shape.device)
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def graph_count(self) -> int:
        return len(self._graphs)

    def release(self) -> int:
        """Drop every captured graph, their memory pool and the logits buffer they write
        (they read the KV cache and the weights at fixed addresses, so they go whenever
        either is released). Returns the number of graphs dropped; the next passes capture
        again on first use (:meth:`resume` first)."""
        dropped = len(self._graphs)
        self._graphs.clear()
        if hasattr(self, "_pool"):
            del self._logits, self._pool
        return dropped

    def resume(self) -> None:
        """Buffers for graphs captured from now on (after :meth:`release`)."""
        if self.graphs and not hasattr(self, "_pool"):
            self._buffers()

    def run(
        self, ends: list[int], last: list[int], on_device: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``[n, vocab]`` for rows whose new tokens ``last`` go to columns ``ends``;
        with ``on_device``, ``last`` holds indices into that device tensor of token ids
        instead (the tokens a pass still running sampled: nothing waits for them)."""
        n = len(ends)
        width = max(ends) + 1
        rows, cols = n, width
        if self.buckets:
            rows, cols = batch_bucket(n, self.slots), width_bucket(width, self.capacity)
        host = self._stage.longs_np
        host[:n, 0] = ends
        host[:n, 1] = last
        host[n:rows] = 0
        self._stage.upload_longs(rows)
        if on_device is not None:
            tokens = self._stage.longs[:n, 1]
            tokens.copy_(on_device.index_select(0, tokens))
        graph = self._graphs.get((rows, cols))
        if graph is not None:
            graph.replay()
            self.replays += 1
            return self._logits[:n]
        logits = self._eager(rows, cols)
        if self.graphs:
            self._capture(rows, cols)
        return logits[:n]

    def capture_all(self, max_width: int | None = None) -> int:
        """Capture every bucket up to ``max_width`` key columns (only while the engine is
        idle: each bucket first runs once eagerly on token 0 in free slots). Returns the
        number of graphs held."""
        if not self.graphs:
            return 0
        top = width_bucket(max_width or self.capacity, self.capacity)
        widths = sorted({width_bucket(w, self.capacity) for w in _powers(MIN_WIDTH, top)})
        batches = sorted({batch_bucket(n, self.slots) for n in range(1, self.slots + 1)})
        self._stage.longs.zero_()
        for cols in reversed(widths):  # largest first: later graphs reuse the pool's blocks
            for rows in reversed(batches):
                if (rows, cols) not in self._graphs and self.graphs:
                    self._capture(rows, cols)
        return len(self._graphs)

    def _eager(self, rows: int, cols: int, out: torch.Tensor | None = None) -> torch.Tensor:
        inputs = self._stage.longs[:rows]
        ends = inputs[:, 0]
        self._cache.begin_decode(ends, cols)
        masks = SlotMasks.decode(ends, cols, self._cache.shape.dtype)
        return self._forward(inputs[:, 1:], inputs[:, :1], masks, out)

    def _capture(self, rows: int, cols: int) -> None:
        """Capture the pass for ``(rows, cols)`` on a side stream, after one eager warm-up
        pass there (libraries set up per-stream state outside the capture). The warm-up
        reads the current inputs, so it rewrites the very keys/values just written."""
        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        self._stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(self._stream):
                self._eager(rows, cols)
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    out = self._logits[:rows]
                    logits = self._eager(rows, cols, out)
                    if logits.data_ptr() != out.data_ptr() or logits.stride() != out.stride():
                        out.copy_(logits)  # a head that could not write there itself
                finally:
                    graph.capture_end()
        except Exception:
            log.exception("CUDA graph capture failed; the decode step runs eagerly from now on")
            self.graphs = False
            self._graphs.clear()
            return
        finally:
            torch.cuda.current_stream().wait_stream(self._stream)
            self.capture_s += time.perf_counter() - start
        self._graphs[(rows, cols)] = graph


def _powers(lo: int, hi: int) -> list[int]:
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return out
