"""The text model's decode forward compiled as one graph, attention an opaque operator in it.

A decode pass of a small model is a long row of small kernels: per layer the model's own
code launches its norms, rotary embeddings, activations and residual adds one elementwise
kernel at a time (about 30 beside the GEMMs and attention), and each costs its launch on
the GPU whether the batch holds 1 row or 256. ``engine.hf.compile_layers`` compiles the
forward of the text model that holds the decoder layers (``torch.compile``, inductor,
dynamic batch): the rotary embedding, every layer and the final norm are one graph, so
inductor fuses across the ops the model's code writes one at a time — the residual add
that ends a layer with the norm that starts the next one, the rotary embedding with the
stack of the new keys and values — as a serving engine's fused add-and-norm does.

Attention is the one op of that graph the engine owns: ``torch.ops.tailcut.slot_decode``
(``hf/attention.py``), opaque to the compiler, which stores the layer's new keys and values
and attends over each row's columns, reaching the cache through the pass active on its
thread. The graph sees neither the cache nor its writes, so it neither breaks at attention
(the piecewise split serving engines make for their CUDA graphs is not needed: the engine
captures the whole pass) nor turns the in-place store into a copy of the cache. Prefill
passes (variable prompt widths, eager) run the module's uncompiled ``forward``; decode
passes — replayed from CUDA graphs, whose capture records the compiled kernels as any
others — run the compiled one. The layers' code, and so every family's arithmetic, stays
the model's own; only the fusion differs (float rounding within a fused kernel). With
``engine.hf.fuse_projections`` the q/k/v and gate/up projections inside are one GEMM each
(``hf/fused.py``).
"""

from __future__ import annotations

import contextlib
import threading
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The text model's decoder layers: the longest ``ModuleList`` of ``*DecoderLayer``
    modules (``model.model.layers`` in most families). Raises ``ValueError`` if none."""
    best: list[torch.nn.Module] = []
    for module in model.modules():
        if (
            isinstance(module, torch.nn.ModuleList)
            and len(module) > len(best)
            and all(type(m).__name__.endswith("DecoderLayer") for m in module)
        ):
            best = list(module)
    if not best:
        raise ValueError(f"{type(model).__name__} has no list of *DecoderLayer modules to compile")
    return best


def text_model(model: Any) -> torch.nn.Module:
    """The module whose children hold ``model``'s :func:`decoder_layers` (``model.model``
    in most families): its forward runs the embedding, the rotary embedding, the layers
    and the final norm."""
    layers = decoder_layers(model)
    for owner in model.modules():
        if any(isinstance(c, torch.nn.ModuleList) and list(c) == layers for c in owner.children()):
            return typing.cast(torch.nn.Module, owner)
    raise AssertionError("decoder layers without a parent module")  # found among modules()


_SCALARS = (bool, int, float, str, type(None))


def _takes(declared: Any, default: Any) -> tuple[type, ...]:
    """The value types a setting takes, of those a config file can give (bool, int, float,
    str, None): from its declared type (``int | None``) where inductor records one, else
    from its default's type (any of them for a default of None)."""
    args = (declared,) if isinstance(declared, type) else typing.get_args(declared)
    if args:
        return tuple(t for t in args if t in _SCALARS)
    return _SCALARS if default is None else (type(default),)


def _fits(value: Any, takes: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in takes
    if isinstance(value, int) and float in takes:
        return True
    return any(isinstance(value, t) and t is not bool for t in takes)


def _flat(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"triton": {"enable_pdl": true}}`` as ``{"triton.enable_pdl": true}`` (how a
    ``key.sub=value`` override of a config nests it)."""
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def inductor_options(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` (``engine.hf.inductor``, nested or dotted: ``combo_kernels``,
    ``triton.max_tiles``) checked as ``torch._inductor.config`` settings: a public key
    inductor has, other than ``triton.enable_pdl`` (``engine.hf.pdl`` sets it, where the
    device has it) and ``triton.cudagraphs`` (the engine's own graphs capture the pass),
    with a value of a type the setting takes (an int for a float). Returns
    them dotted; raises ``ValueError`` naming the first that is not."""
    import torch._inductor.config as inductor

    known = inductor.get_config_copy()
    declared = getattr(inductor, "_config", {})
    flat = _flat(settings)
    for key, value in flat.items():
        if key == "triton.enable_pdl":
            raise ValueError(
                "engine.hf.inductor.triton.enable_pdl: set engine.hf.pdl instead (it checks "
                "the device can launch them)"
            )
        if key == "triton.cudagraphs":
            raise ValueError(
                "engine.hf.inductor.triton.cudagraphs: the engine captures each decode pass "
                "in a CUDA graph of its own (engine.hf.cuda_graphs); inductor's would freeze "
                "the pass the attention operator reads at its first run"
            )
        if key not in known or key.split(".")[-1].startswith("_"):
            raise ValueError(f"engine.hf.inductor: torch._inductor.config has no {key!r}")
        takes = _takes(getattr(declared.get(key), "value_type", None), known[key])
        if not _fits(value, takes):
            wanted = " or ".join(t.__name__ for t in takes) or "a value no config file gives"
            raise ValueError(
                f"engine.hf.inductor.{key}: {value!r} is a {type(value).__name__}, inductor's "
                f"setting takes {wanted} (default {known[key]!r})"
            )
    return flat


class CompiledForward:
    """Gives ``model``'s :func:`text_model` a compiled ``forward`` that runs within
    :meth:`decoding` blocks on the thread that opened them (any other call — a prefill,
    the model's own ``generate`` — runs its own); :meth:`close` undoes it. ``pdl``: the
    kernels are compiled with programmatic dependent launch (``engine.hf.pdl``);
    ``inductor``: settings of inductor's config they are compiled with
    (``engine.hf.inductor`` as :func:`inductor_options` returns it: checked, dotted)."""

    def __init__(
        self, model: Any, *, pdl: bool = False, inductor: Mapping[str, Any] | None = None
    ) -> None:
        self.module = text_model(model)
        self._inductor = dict(inductor or {})
        self._pdl = pdl
        self._local = threading.local()
        eager = self.module.forward
        compiled = torch.compile(eager, dynamic=True)
        self.module.forward = self._switch(eager, compiled)

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        self._local.on = True
        try:
            with self._launches():
                yield
        finally:
            self._local.on = False

    def _launches(self) -> contextlib.AbstractContextManager[Any]:
        """Inductor's settings while it compiles, over the first decode passes (its patches
        hold on the patching thread only: this one): ``engine.hf.inductor``, and generated
        kernels launched as programmatic dependents (``engine.hf.pdl``; a torch without
        inductor's option compiles them as usual)."""
        import torch._inductor.config as inductor

        settings = dict(self._inductor)
        if self._pdl and hasattr(inductor.triton, "enable_pdl"):
            settings["triton.enable_pdl"] = True
        if not settings:
            return contextlib.nullcontext()
        return inductor.patch(settings)

    def _switch(
        self, eager: Callable[..., Any], compiled: Callable[..., Any]
    ) -> Callable[..., Any]:
        local = self._local

        def forward(*args: Any, **kwargs: Any) -> Any:
            return (compiled if getattr(local, "on", False) else eager)(*args, **kwargs)

        return forward

    def close(self) -> None:
        if "forward" in vars(self.module):
            del self.module.forward
