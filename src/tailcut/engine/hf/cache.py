"""A per-slot KV cache for the embedded engine: one fixed row of keys/values per request.

::

    buf[layer, k|v, slot, kv_head, column, head_dim]

    slot 0  | p p p p p g g g . . . . |   end=8  (prompt p, generated g, . free)
    slot 1  | p p p g . . . . . . . . |   end=4
    slot 2  | p p p p p p p g g g g . |   end=11
    ...     (slots 0..rows-1 are the running requests, always contiguous)

Running requests occupy slots ``0 .. rows-1`` without holes: when a request leaves, the
last row's keys/values move into its slot (one indexed copy for all the rows that leave
at one step boundary), so a decode step reads
``buf[..., :rows, :, :width]`` as a view — no gather, no re-padding when requests come and
go. Each row has its own ``end`` (tokens cached) and its own RoPE positions; a per-row
attention mask hides the columns a row does not own, and a layer's sliding window
(``hf/attention.py``: :class:`~tailcut.engine.hf.attention.SlotMasks`).

The model sees this object as its ``cache``: its attention layers call
:meth:`SlotKVCache.update` with the new keys/values of the current forward pass. Two kinds
of pass exist:

* **prefill**: ``n`` new requests in slots ``first .. first+n-1``, prompts right-padded to
  ``width`` columns; keys are written at columns ``0 .. width-1`` (pad columns are masked
  and later overwritten).
* **decode**: every running row feeds one token, written at column ``end[row]``; attention
  reads columns ``0 .. max(end)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    slots: int
    max_seq_len: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return (
            self.layers * 2 * self.slots * self.kv_heads * self.max_seq_len * self.head_dim * elem
        )


def kv_shape_for(model: Any, slots: int, max_seq_len: int) -> KVShape:
    """The cache geometry of a Hugging Face causal LM: every layer caches all of its columns
    (a sliding-window layer too; its window is applied by the mask, ``hf/attention.py``)."""
    cfg = model.config.get_text_config()
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    limit = int(getattr(cfg, "max_position_embeddings", max_seq_len) or max_seq_len)
    param = next(model.parameters())
    return KVShape(
        layers=int(cfg.num_hidden_layers),
        kv_heads=kv_heads,
        head_dim=head_dim,
        slots=slots,
        max_seq_len=min(max_seq_len, limit),
        dtype=param.dtype,
        device=param.device,
    )


class SlotKVCache:
    """KV storage for ``shape.slots`` requests of up to ``shape.max_seq_len`` tokens.

    Columns are allocated on demand (doubling, up to ``max_seq_len``), so a small model
    with short requests does not hold the whole capacity — or all at once
    (``initial_columns=max_seq_len``) when CUDA graphs must find the cache at a fixed
    address. Zero-filled, and a free slot only ever receives keys/values the model
    computed (padding rows), so a masked column never holds a NaN that ``0 * NaN`` would
    spread through the attention product.
    """

    def __init__(self, shape: KVShape, initial_columns: int = 256) -> None:
        self.shape = shape
        self._initial = min(initial_columns, shape.max_seq_len)
        self.buf = self._alloc(self._initial)
        self._prefill = False
        self._first = 0
        self._rows = 0
        self._width = 0
        self._start = 0
        self._targets = torch.zeros(0, dtype=torch.long, device=shape.device)
        self._heads = torch.arange(shape.slots * shape.kv_heads, device=shape.device).view(
            shape.slots, shape.kv_heads
        )

    def _alloc(self, columns: int) -> torch.Tensor:
        s = self.shape
        return torch.zeros(
            s.layers, 2, s.slots, s.kv_heads, columns, s.head_dim, dtype=s.dtype, device=s.device
        )

    @property
    def allocated_bytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

    @property
    def released(self) -> bool:
        return self.buf.numel() == 0

    def release(self) -> int:
        """Drop the whole buffer (nothing may run until :meth:`resume`); returns its bytes.
        The caller holds no other reference to it (CUDA graphs reading it are dropped
        first), so its storage is freed here."""
        freed = self.allocated_bytes
        self.buf = self._alloc(0)
        return freed

    def resume(self) -> int:
        """Allocate the buffer again at its initial size (zero-filled); returns its bytes."""
        if self.released:
            self.buf = self._alloc(self._initial)
        return self.allocated_bytes

    def _reserve(self, columns: int) -> None:
        have = self.buf.shape[4]
        if columns <= have:
            return
        grown = self._alloc(min(self.shape.max_seq_len, max(columns, 2 * have)))
        grown[:, :, :, :, :have] = self.buf
        self.buf = grown

    # -- forward-pass setup ------------------------------------------------------------
    def begin_prefill(self, first: int, rows: int, width: int, start: int = 0) -> None:
        """Next pass writes ``rows`` new requests at slots ``first..`` columns
        ``start..width-1``; with ``start > 0`` (a chunked prefill's later chunks) attention
        reads columns ``0..width-1`` of those slots, the earlier chunks' keys included."""
        if first + rows > self.shape.slots or width > self.shape.max_seq_len:
            raise ValueError(
                f"prefill of {rows} rows x {width} columns at slot {first} does not fit a cache "
                f"of {self.shape.slots} slots x {self.shape.max_seq_len} columns"
            )
        self._reserve(width)
        self._prefill, self._first, self._rows, self._width = True, first, rows, width
        self._start = start

    def begin_decode(self, ends: torch.Tensor, width: int) -> None:
        """Next pass feeds one token per running row, written at column ``ends[row]``;
        ``width`` is ``max(ends) + 1`` (passed in: reading it back would sync a GPU)."""
        self._reserve(width)
        self._prefill = False
        self._rows = int(ends.shape[0])
        # where each (row, kv head)'s new key lands in a layer's keys seen as one column
        # list: ``(slot * kv_heads + head) * capacity + column`` (the same for values)
        self._targets = (self._heads[: self._rows] * self.buf.shape[4] + ends[:, None]).view(-1)
        self._width = width

    @property
    def decoding(self) -> bool:
        """The next pass is a decode pass (one new token per running row)."""
        return not self._prefill

    @property
    def width(self) -> int:
        """Key columns the next pass attends over."""
        return self._width

    # -- the interface the model's attention layers call -------------------------------
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *_: Any,
        **__: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._prefill:
            return self._write_prefill(key_states, value_states, layer_idx)
        # A decode pass's keys and values are stored by its attention operator
        # (``hf/attention.py``, :meth:`decode_layer`): returned here as they came, so a
        # compiled decode forward neither breaks here nor writes into the cache itself.
        return key_states, value_states

    @torch.compiler.disable
    def _write_prefill(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.buf[layer_idx]
        lo, hi, start = self._first, self._first + self._rows, self._start
        end = start + key_states.shape[2]
        layer[0, lo:hi, :, start:end] = key_states
        layer[1, lo:hi, :, start:end] = value_states
        if start == 0:
            return key_states, value_states
        return layer[0, lo:hi, :, :end], layer[1, lo:hi, :, :end]

    def decode_layer(
        self, kv: torch.Tensor, layer: int, *, store: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode pass's keys and values of ``layer`` (views of its first rows' columns
        up to the pass's width), with each row's new key and value (``kv [2, rows,
        kv_heads, head_dim]``) stored at its column first where ``store`` (one
        ``index_copy_``: ``begin_decode`` made the targets; the decode kernel stores them
        itself as it reads them)."""
        buf = self.buf[layer]
        if store:
            dim = self.shape.head_dim
            buf.view(2, -1, dim).index_copy_(1, self._targets, kv.reshape(2, -1, dim))
        rows, width = self._rows, self._width
        return buf[0, :rows, :, :width], buf[1, :rows, :, :width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._width

    # -- slot bookkeeping ---------------------------------------------------------------
    def move_rows(self, moves: list[tuple[int, int]], length: int) -> None:
        """Copy the first ``length`` columns of each ``(src, dst)`` slot pair (all layers),
        in one indexed copy; sources and destinations must be disjoint."""
        if not moves or length <= 0:
            return
        if len(moves) == 1:
            src, dst = moves[0]
            self.buf[:, :, dst, :, :length] = self.buf[:, :, src, :, :length]
            return
        index = torch.tensor(moves, dtype=torch.long).T.to(self.shape.device, non_blocking=True)
        self.buf[:, :, index[1], :, :length] = self.buf[:, :, index[0], :, :length]
