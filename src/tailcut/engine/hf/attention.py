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

A decode pass (one new token per row) hands its attention to one opaque operator,
``torch.ops.tailcut.slot_decode`` (:func:`slot_decode`): the slot cache's ``update``
returns the layer's new keys and values unstored, and the operator stores them and attends
over the row's columns — with ``engine.hf.decode_kernel`` on, as one Triton kernel that
stores them as it reads them
(:func:`~tailcut.engine.hf.decode_attention.decode_attention`; windows and soft-capping
included), else as one indexed store and the masked path. The operator reaches the cache,
the masks and the switches through the pass active on its thread (:func:`attending`), as
a serving engine's attention operator reaches its KV cache through its forward context, so
a compiled decode forward (``hf/compiled.py``) sees neither the cache nor its writes:
nothing to break the graph at, and nothing inductor could turn into a copy of the cache.

Masks are built from the pass's query positions (``SlotMasks.prefill`` / ``.decode``),
once per distinct window per pass, on the device (inside a CUDA graph capture too). The
4-D mask handed to the model as ``attention_mask`` only makes transformers' mask builders
return at once (a prepared 4-D mask is used as-is); the attention function takes its masks
from the pass active on its thread (:func:`attending`).

Outside a pass (the caller runs the same model through ``generate`` or a plain forward
while an engine holds it) the function is an exact eager attention: transformers builds its
masks with its eager mask builder (registered under :data:`NAME` too), windows included.
(Compiled by the caller, a call with one query and one key is the operator's: outside a
pass it returns that key's value, which is what attention over one key gives.)
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

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


class DecodeCache(Protocol):
    """What a decode pass's operator needs of the cache (``hf/cache.py``'s slot cache)."""

    def decode_layer(
        self, kv: torch.Tensor, layer: int, *, store: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


_local = threading.local()


@contextlib.contextmanager
def attending(
    masks: SlotMasks,
    *,
    cache: DecodeCache | None = None,
    kernel: bool = False,
    pdl: bool = False,
) -> Iterator[SlotMasks]:
    """Run the model's attention on ``masks`` within this block (on this thread). A decode
    pass (``masks`` from :meth:`SlotMasks.decode`) gives the ``cache`` its operator stores
    into and reads; ``kernel``: it runs the decode kernel where it applies (``pdl``:
    launched as a programmatic dependent of the kernel before it)."""
    outer = tuple(getattr(_local, k, None) for k in ("masks", "cache", "kernel", "pdl"))
    _local.masks, _local.cache, _local.kernel, _local.pdl = masks, cache, kernel, pdl
    try:
        yield masks
    finally:
        _local.masks, _local.cache, _local.kernel, _local.pdl = outer


def _decoding() -> bool:
    masks: SlotMasks | None = getattr(_local, "masks", None)
    return masks is not None and masks.ends is not None


@torch.library.custom_op(
    "tailcut::slot_decode",
    mutates_args=(),
    schema="(Tensor query, Tensor kv, int layer, float scale, int? window, float? softcap, "
    "float dropout) -> Tensor",
)
def slot_decode(
    query: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    dropout: float,
) -> torch.Tensor:
    """A decode pass's attention for ``layer``: ``query [rows, heads, 1, d]``, ``kv [2,
    rows, kv_heads, d]`` (each row's new key and value) -> ``[rows, 1, heads, d]``. Stores
    ``kv`` at each row's column of the cache of the pass active on this thread and attends
    over the row's columns (the decode kernel, or the store and the masked path)."""
    masks: SlotMasks | None = getattr(_local, "masks", None)
    cache: DecodeCache | None = getattr(_local, "cache", None)
    if masks is None and cache is None:
        # traced outside the engine (a caller's own compile of the model), one key: the
        # softmax over one column is 1, so attention is that key's value on every head
        rows, heads, _, dim = query.shape
        groups = heads // kv.shape[2]
        return kv[1].repeat_interleave(groups, dim=1).view(rows, 1, heads, dim).clone()
    if masks is None or masks.ends is None or cache is None:
        raise RuntimeError(
            "tailcut::slot_decode ran in a pass that is not an embedded engine's decode "
            "pass (a prefill, or a pass without its cache)"
        )
    masks.calls += 1
    kernel = bool(_local.kernel) and decode_attention.usable(query, dropout)
    key, value = cache.decode_layer(kv, layer, store=not kernel)
    if kernel:
        return decode_attention.decode_attention(
            query, key, value, masks.ends, scale=scale, window=window, softcap=softcap,
            new=kv, pdl=bool(_local.pdl),
        )  # fmt: skip
    return _attend(query, key, value, masks.mask(window), dropout, scale, softcap, folded=True)


@slot_decode.register_fake
def _(query, kv, layer, scale, window, softcap, dropout):
    rows, heads, _, dim = query.shape
    return query.new_empty(rows, 1, heads, dim)


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
    """``query [b, heads, q, d]``, ``key``/``value [b, kv_heads, k, d]`` -> ``[b, q, heads, d]``.

    In a decode pass ``key``/``value`` are the layer's new ones (``[b, kv_heads, 1, d]``,
    not yet stored) and the call is :func:`slot_decode`'s. Traced (the engine compiles its
    decode forward only, ``hf/compiled.py``), that is the only path: the thread's pass is
    read by the operator when it runs, never by the traced code."""
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__} passes {name!r} (attention sinks), which the embedded "
                "engine does not implement; serve this model with engine.kind=vllm or sglang"
            )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    one = query.shape[2] == 1 and key.shape[2] == 1  # one query and one new key a row
    traced = torch.compiler.is_compiling()
    if (traced and one) or (not traced and _decoding()):
        if not one:
            raise ValueError(
                f"{type(module).__name__} hands the engine's decode pass {query.shape[2]} "
                f"queries and {key.shape[2]} key columns a row: one each is a decode pass "
                "through the slot cache (a family that attends over keys it did not cache?)"
            )
        kv = torch.stack((key[:, :, 0], value[:, :, 0]))
        # the layer's index as the module holds it: what it passes the cache's ``update``
        # in every family the engine runs (the engine's probe checks the decode passes)
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            raise ValueError(
                f"{type(module).__name__} has no integer layer_idx to find its cache by"
            )
        out = torch.ops.tailcut.slot_decode(
            query, kv, layer, scale, sliding_window, softcap, float(dropout)
        )
        return out, None
    return _outside(
        module, query, key, value, attention_mask, dropout, scale, softcap, sliding_window
    )


@torch.compiler.disable
def _outside(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
) -> tuple[torch.Tensor, None]:
    """Any pass but a decode pass: a prefill (the pass's mask for ``sliding_window``), or
    a forward outside the engine (transformers' eager mask, window applied already)."""
    masks: SlotMasks | None = getattr(_local, "masks", None)
    if masks is not None:
        masks.calls += 1
        attention_mask = masks.mask(sliding_window)
    elif attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    dropout = dropout if module.training else 0.0
    return _attend(query, key, value, attention_mask, dropout, scale, softcap), None


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scale: float,
    softcap: float | None,
    *,
    folded: bool = False,
) -> torch.Tensor:
    """Attention over ``key``/``value`` (grouped: repeated to the query heads, or with
    ``folded`` — a decode pass, one query per row — the query heads that share a
    key/value head read it in place as that head's queries) -> ``[b, q, heads, d]``."""
    batch, heads, queries, dim = query.shape
    groups = heads // key.shape[1]
    folded = folded and groups > 1 and queries == 1
    if folded:
        query = query.reshape(batch, key.shape[1], groups, dim)
    elif groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if softcap is None:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scale,
            is_causal=attention_mask is None and queries > 1,
        )  # fmt: skip
    else:
        scores = torch.matmul(query, key.transpose(2, 3)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        probs = F.dropout(probs, p=dropout)
        out = torch.matmul(probs, value)
    if folded:
        out = out.reshape(batch, heads, 1, dim)
    return out.transpose(1, 2).contiguous()


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
