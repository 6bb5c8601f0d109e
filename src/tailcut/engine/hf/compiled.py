"""Decoder layers compiled for decode passes, the cache write and attention left eager.

A decode pass of a small model is a long row of small kernels: per layer the model's own
code launches its norms, rotary embeddings, activations and residual adds one elementwise
kernel at a time (about 30 beside the GEMMs and attention), and each costs its launch on
the GPU whether the batch holds 1 row or 256. ``engine.hf.compile_layers`` compiles each
decoder layer's own ``forward`` (``torch.compile``, inductor, dynamic batch) so that those
run as a few fused kernels — and so the two modules a pass runs once around the layers,
the rotary embedding and the final norm (:func:`around_layers`) — and leaves eager the
two places the engine owns:

* the slot cache's store (an in-place write at each row's column: compiled, inductor
  turns it into a copy of the layer's whole cache), and
* the attention function (``hf/attention.py``: it reads the pass's masks from its thread).

Both are ``torch.compiler.disable``-d, so the compiled layer stops before them and resumes
after — the piecewise split serving engines make at attention. The stop is made inside the
cache's own ``update`` (dynamo's nested graph breaks, where the torch has them): the new
keys and values are stacked in the kernel that computes the keys' rotary embedding, and
one eager indexed store writes both (``hf/cache.py``). Prefill passes (variable
prompt widths, eager) run the layer's uncompiled ``forward``; decode passes — replayed
from CUDA graphs, whose capture records the compiled kernels as any others — run the
compiled one. The layers' code, and so every family's arithmetic, stays the model's own;
only the fusion differs (float rounding within a fused kernel). With
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


def around_layers(model: Any, layers: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The text model's own modules a decode pass runs once around its ``layers`` (its
    :func:`decoder_layers`): the rotary embedding (``*RotaryEmbedding``: positions to
    cos/sin, ~8 eager kernels) and the final norm (``norm``: ~6) — children of the module
    that holds the layers."""
    for owner in model.modules():
        children = dict(owner.named_children())
        if any(isinstance(c, torch.nn.ModuleList) and list(c) == layers for c in children.values()):
            return [
                c
                for name, c in children.items()
                if type(c).__name__.endswith("RotaryEmbedding")
                or (name == "norm" and type(c).__name__.endswith("Norm"))
            ]
    return []


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
    device has it), with a value of a type the setting takes (an int for a float). Returns
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


class CompiledLayers:
    """Gives each decoder layer of ``model`` a compiled ``forward`` that runs within
    :meth:`decoding` blocks on the thread that opened them (any other call — a prefill,
    the model's own ``generate`` — runs the layer's own); :meth:`close` undoes it.
    ``pdl``: the kernels are compiled with programmatic dependent launch
    (``engine.hf.pdl``); ``inductor``: settings of inductor's config they are compiled with
    (``engine.hf.inductor`` as :func:`inductor_options` returns it: checked, dotted)."""

    def __init__(
        self, model: Any, *, pdl: bool = False, inductor: Mapping[str, Any] | None = None
    ) -> None:
        self.layers = decoder_layers(model)
        self._inductor = dict(inductor or {})
        self._pdl = pdl
        self._local = threading.local()
        # Each layer's attention passes its own index to the (eager) cache write, a
        # constant dynamo guards on: one entry per layer and shape class (batch 1 or more)
        # of the same code. Let them all compile rather than fall back to eager after 8
        # (dynamo's limits are per thread: set for each pass, on the thread running it).
        self._limits = {
            "recompile_limit": 4 * len(self.layers),
            "accumulated_recompile_limit": 32 * len(self.layers),
        }
        self.modules = self.layers + around_layers(model, self.layers)
        for module in self.modules:
            eager = module.forward
            compiled = torch.compile(eager, dynamic=True)
            module.forward = self._switch(eager, compiled)

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        dynamo = torch._dynamo.config
        limits = {k: max(v, getattr(dynamo, k)) for k, v in self._limits.items()}
        if hasattr(dynamo, "nested_graph_breaks"):
            # the break at the cache write resumes inside the attention function, so the
            # layer's first graph runs up to the write itself (``hf/cache.py``)
            limits["nested_graph_breaks"] = True
        self._local.on = True
        try:
            with dynamo.patch(**limits), self._launches():
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
        for module in self.modules:
            if "forward" in vars(module):
                del module.forward
