"""The embedded engine's one attention path, registered with transformers' attention interface.

Every family the engine runs (Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Gemma 2/3,
Phi-3, ...) computes its queries, keys and values, rotary embeddings and projections in its
own modeling code, then calls the function registered under its
``config._attn_implementation``. The engine switches the model to :data:`NAME` (:func:`attach`),
so that call lands in :func:`slot_attention`, which reads the keys/values the slot cache
returned and applies, per layer:

* the pass's mask (:class:`SlotMasks`): each row sees only its own cache columns, causally;
* a sliding window where the layer passes ``sliding_window`` (Mistral, Phi-3, Mixtral,
  Qwen ``sliding_attention`` layers, Gemma's local layers): the query at position ``p``
  sees keys at positions ``> p - window`` — the window of transformers' own masks;
* attention-logit soft-capping where the layer passes ``softcap`` (Gemma 2):
  ``tanh(scores / cap) * cap`` before the mask;
* grouped-query attention: in a decode pass (one query per row) the query heads that share
  a key/value head are that head's queries, so the cache is read in place; otherwise the
  key/value heads are repeated to the query heads.

In a decode pass with ``engine.hf.decode_kernel`` on, the call runs
:func:`~tailcut.engine.hf.decode_attention.decode_attention` instead: one Triton kernel
that reads each row's own columns (no mask), windows and soft-capping included, and stores
the layer's new keys and values itself (the slot cache leaves that store to the call:
:func:`defer_store`).

Masks are built from the pass's query positions (``SlotMasks.prefill`` / ``.decode``),
once per distinct window per pass, on the device (inside a CUDA graph capture too). The
4-D mask handed to the model as ``attention_mask`` only makes transformers' mask builders
return at once (a prepared 4-D mask is used as-is); the attention function takes its masks
from the pass active on its thread (:func:`attending`).

Outside a pass (the caller runs the same model through ``generate`` or a plain forward
while an engine holds it) the function is an exact eager attention: transformers builds its
masks with its eager mask builder (registered under :data:`NAME` too), windows included.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from tailcut.engine.hf import decode_attention

NAME = "tailcut_slots"
"""The attention implementation name the engine's model runs under."""

UNSUPPORTED_KWARGS = ("s_aux", "sinks")
"""Attention arguments of families this path does not implement (attention sinks)."""


class SlotMasks:
    """The additive attention masks of one forward pass over the slot cache.

    ``pos [rows, queries]`` is the cache column (= position) each query stands at; keys are
    the columns ``0 .. width-1``. Query ``(r, i)`` sees the columns ``<= pos[r, i]`` (its
    own row's, causally), and within a window ``w`` only those ``> pos[r, i] - w``. Every
    query sees at least its own column, so no row of the softmax is empty (an empty row
    would be NaN, and ``0 * NaN`` spreads through the value product)."""

    def __init__(self, pos: torch.Tensor, width: int, dtype: torch.dtype) -> None:
        self._pos = pos[:, None, :, None]
        self._cols = torch.arange(width, device=pos.device)
        self._dtype = dtype
        self._masks: dict[int | None, torch.Tensor] = {}
        self.ends: torch.Tensor | None = None
        """A decode pass: each row's query column (``[rows]``), for the decode kernel."""
        self.pending: tuple[torch.Tensor, Callable[[], None]] | None = None
        """A layer's new keys and values whose store was left to its attention call."""
        self.calls = 0
        """Attention calls that read this pass's masks (one per layer of a forward)."""

    @classmethod
    def prefill(
        cls, lengths: torch.Tensor, width: int, dtype: torch.dtype, *, start: int = 0
    ) -> SlotMasks:
        """Right-padded prompts of ``lengths`` tokens in ``width`` columns, queries at the
        columns ``start .. width-1`` (a chunk of a longer prefill: ``start > 0``): causal
        within each prompt; pad queries stand at their prompt's last column (outputs
        ignored)."""
        cols = torch.arange(start, width, device=lengths.device)
        return cls(torch.minimum(cols[None, :], (lengths - 1)[:, None]), width, dtype)

    @classmethod
    def decode(cls, ends: torch.Tensor, width: int, dtype: torch.dtype) -> SlotMasks:
        """One new token per row, at column ``ends[row]``; ``width`` key columns."""
        masks = cls(ends[:, None], width, dtype)
        masks.ends = ends.to(torch.int32)  # the kernel's dtype, cast once a pass, not a layer
        return masks

    @property
    def full(self) -> torch.Tensor:
        """``[rows, 1, queries, width]``: the mask without a window."""
        return self.mask(None)

    def mask(self, window: int | None) -> torch.Tensor:
        """The mask of a layer with sliding ``window`` (None: full attention)."""
        key = int(window) if window else None
        mask = self._masks.get(key)
        if mask is None:
            visible = self._cols <= self._pos
            if key is not None:
                visible = visible & (self._cols > self._pos - key)
            zero = torch.zeros((), dtype=self._dtype, device=visible.device)
            neg = torch.full(
                (), torch.finfo(self._dtype).min, dtype=self._dtype, device=zero.device
            )
            mask = self._masks[key] = torch.where(visible, zero, neg)
        return mask


_local = threading.local()


def defer_store(kv: torch.Tensor, store: Callable[[], None]) -> bool:
    """A decode pass's new keys and values of one layer (``kv [2, rows, kv_heads, d]``),
    about to be stored by ``store``: where the pass runs the decode kernel, the store is
    left to the layer's attention call (the kernel writes them as it reads them; a call
    the kernel cannot take runs ``store`` first). Returns whether it was left."""
    masks: SlotMasks | None = getattr(_local, "masks", None)
    if masks is None or not getattr(_local, "kernel", False):
        return False
    masks.pending = (kv, store)
    return True


@contextlib.contextmanager
def attending(masks: SlotMasks, *, kernel: bool = False, pdl: bool = False) -> Iterator[SlotMasks]:
    """Run the model's attention on ``masks`` within this block (on this thread);
    ``kernel``: a decode pass's calls run the decode kernel where it applies (``pdl``:
    launched as a programmatic dependent of the kernel before it)."""
    outer = (
        getattr(_local, "masks", None),
        getattr(_local, "kernel", False),
        getattr(_local, "pdl", False),
    )
    _local.masks, _local.kernel = masks, kernel and masks.ends is not None
    _local.pdl = pdl
    try:
        yield masks
    finally:
        _local.masks, _local.kernel, _local.pdl = outer


@torch.compiler.disable
def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query [b, heads, q, d]``, ``key``/``value [b, kv_heads, k, d]`` -> ``[b, q, heads, d]``."""
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__} passes {name!r} (attention sinks), which the embedded "
                "engine does not implement; serve this model with engine.kind=vllm or sglang"
            )
    masks: SlotMasks | None = getattr(_local, "masks", None)
    if masks is not None:
        masks.calls += 1
        pending, masks.pending = masks.pending, None
        if _local.kernel and masks.ends is not None and decode_attention.usable(query, dropout):
            out = decode_attention.decode_attention(
                query, key, value, masks.ends, scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
                window=sliding_window, softcap=softcap, new=None if pending is None else pending[0],
                pdl=_local.pdl,
            )  # fmt: skip
            return out, None
        if pending is not None:
            pending[1]()
        attention_mask = masks.mask(sliding_window)
    elif attention_mask is not None:  # transformers' eager mask (window applied already)
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    batch, heads, queries, dim = query.shape
    groups = heads // key.shape[1]
    folded = groups > 1 and queries == 1 and masks is not None
    if folded:
        # One new token per row (a decode pass; its mask is one row per batch row): the
        # query heads sharing a key/value head become that head's queries, so the keys and
        # values are read in place instead of copied once per query head.
        query = query.reshape(batch, key.shape[1], groups, dim)
    elif groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if softcap is None:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
            is_causal=attention_mask is None and queries > 1,
        )  # fmt: skip
    else:
        scale = scaling if scaling is not None else dim**-0.5
        scores = torch.matmul(query, key.transpose(2, 3)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        probs = F.dropout(probs, p=dropout, training=module.training)
        out = torch.matmul(probs, value)
    if folded:
        out = out.reshape(batch, heads, 1, dim)
    return out.transpose(1, 2).contiguous(), None


_registered = False
_lock = threading.Lock()
_holders: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
"""model -> [its attention implementation before the first attach, engines attached]."""


def register() -> None:
    """Register :func:`slot_attention` (and transformers' eager mask builder) as :data:`NAME`."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, slot_attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    _registered = True


def implementation(model: Any) -> str | None:
    """The attention implementation ``model``'s text layers dispatch to."""
    impl = getattr(model.config.get_text_config(), "_attn_implementation", None)
    return None if impl is None else str(impl)


def attach(model: Any) -> None:
    """Switch ``model`` to :data:`NAME` (counted: every :func:`attach` needs a :func:`detach`).
    Raises ``ValueError`` where transformers cannot switch it."""
    register()
    with _lock:
        held = _holders.get(model)
        if held is None:
            before = model.config._attn_implementation
            if before != NAME:
                model.set_attn_implementation(NAME)
            if implementation(model) != NAME or model.config._attn_implementation != NAME:
                if before != NAME:
                    with contextlib.suppress(Exception):
                        model.set_attn_implementation(before)
                raise ValueError(
                    f"{type(model).__name__} cannot switch its attention implementation (it does "
                    "not dispatch through transformers' attention interface)"
                )
            held = _holders[model] = [before, 0]
        held[1] += 1


def detach(model: Any) -> None:
    """Undo one :func:`attach`; the last one restores the model's own implementation."""
    with _lock:
        held = _holders.get(model)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del _holders[model]
        if held[0] != NAME:
            model.set_attn_implementation(held[0])
