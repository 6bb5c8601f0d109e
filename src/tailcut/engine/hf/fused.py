"""Projections of one input fused into one GEMM in the engine's passes.

Most families compute an attention layer's queries, keys and values with three ``Linear``
layers of the same hidden states, and a gated MLP's gate and up projections with two: in
a decode pass at batch 64 each is a skinny GEMM whose cost is mostly its launch and its
walk over a small weight (the key and value projections of a GQA model are a sixth of the
query's). :class:`FusedProjections` lays each such group's weights (and biases) end to end
in one tensor at load, the layers' own parameters becoming views of its rows — names,
shapes, in-place weight updates (``update_weights`` writes through the views) and
``parameters()`` are unchanged. In the engine's passes the first member a layer calls
computes the whole group's GEMM once and keeps it; each other member takes its columns of
it when it is called on the same input tensor (the identity is checked: any other input
computes its own), and the last one drops it. Inside the compiled decode forward
(``hf/compiled.py``) the same code traces to one GEMM and the slices, which inductor fuses
into the next elementwise kernel (the MLP's ``act(gate) * up``).

Outside the engine's passes (the caller's own ``generate`` on the same model, another
thread) each layer runs its own ``forward``. :meth:`FusedProjections.close` gives every
weight its own storage back, so the model leaves the engine laid out as it came.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from tailcut.engine.hf import skinny_linear

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Attribute names of the ``Linear`` layers of one module that read one input."""

SKINNY = (("q_proj", "k_proj", "v_proj"), ("o_proj",))
"""The groups whose GEMM the skinny kernel runs where it is on (``hf/skinny_linear.py``):
the attention's projections, its output projection a group of its own; the MLP's stay
cuBLAS's."""


def _fusable(linears: list[Any]) -> bool:
    """Plain ``Linear`` layers of one input width, dtype and device, all with a bias (of
    one dtype) or none, no ``forward`` of their own on the instance (another library's
    hook), each weight owning its whole storage (nothing tied to or viewing it)."""
    if not all(type(x) is torch.nn.Linear and "forward" not in vars(x) for x in linears):
        return False
    first, bias = linears[0].weight, linears[0].bias
    for lin in linears:
        w, b = lin.weight, lin.bias
        if (w.shape[1], w.dtype, w.device) != (first.shape[1], first.dtype, first.device):
            return False
        if (b is None) != (bias is None) or not w.is_contiguous():
            return False
        if b is not None and bias is not None and b.dtype != bias.dtype:
            return False
        for t in (w,) if b is None else (w, b):
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                return False
    return True


class _Group:
    """One fused group: its weight (and bias) tensor, the members' row ranges, and the
    output of the group's latest GEMM until every member has taken its columns."""

    def __init__(self, linears: list[torch.nn.Linear], *, skinny: bool = False) -> None:
        self.linears = linears
        self.gemm = skinny_linear.linear if skinny else F.linear
        self.bounds: list[tuple[int, int]] = []
        lo = 0
        for lin in linears:
            self.bounds.append((lo, lo + lin.out_features))
            lo += lin.out_features
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, not inference ones
            self.weight = torch.cat([x.weight.detach() for x in linears])
            self.bias: torch.Tensor | None = None
            if linears[0].bias is not None:
                self.bias = torch.cat([x.bias.detach() for x in linears if x.bias is not None])
            for lin, (a, b) in zip(linears, self.bounds, strict=True):
                lin.weight.data = self.weight[a:b]
                if self.bias is not None:
                    lin.bias.data = self.bias[a:b]
        self.input: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.left = 0

    def columns(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Member ``index``'s output for ``x``: its columns of the group's GEMM over ``x``
        (computed by the first member called on ``x``, dropped after the last)."""
        if self.left == 0 or self.input is not x:
            self.output = self.gemm(x, self.weight, self.bias)
            self.input = x
            self.left = len(self.linears)
        out = self.output
        assert out is not None
        self.left -= 1
        if self.left == 0:
            self.input = self.output = None
        lo, hi = self.bounds[index]
        return out[..., lo:hi]

    def unfuse(self) -> None:
        """Give each member's weight (and bias) its own storage again, and free the fused
        ones (whoever still holds the fused tensors holds empty ones)."""
        with torch.inference_mode(False), torch.no_grad():
            for lin in self.linears:
                lin.weight.data = lin.weight.data.clone()
                if lin.bias is not None:
                    lin.bias.data = lin.bias.data.clone()
            for fused in (self.weight, self.bias):
                if fused is not None:
                    fused.data = fused.data.new_empty(0)
        self.input = self.output = None
        self.left = 0


class FusedProjections:
    """Fuses every :data:`GROUPS` group of ``model`` that :func:`_fusable` allows (with
    ``skinny``, also the output projections, and the :data:`SKINNY` groups' GEMM is
    :func:`~tailcut.engine.hf.skinny_linear.linear`); the
    fused GEMMs run within :meth:`active` blocks on the thread that opened them (compiled
    decoder layers too: they run only there). :meth:`close` undoes it."""

    def __init__(self, model: Any, *, skinny: bool = False) -> None:
        self._local = threading.local()
        self.groups: list[_Group] = []
        try:
            for module in model.modules():
                for names in dict.fromkeys(GROUPS + (SKINNY if skinny else ())):
                    linears: list[Any] = [getattr(module, n, None) for n in names]
                    if all(x is not None for x in linears) and _fusable(linears):
                        self._install(_Group(linears, skinny=skinny and names in SKINNY))
        except BaseException:  # out of memory half-way: leave the model as it came
            self.close()
            raise

    def _install(self, group: _Group) -> None:
        self.groups.append(group)
        for index, lin in enumerate(group.linears):
            # an instance attribute over the class's method, deleted again at close
            setattr(lin, "forward", self._switch(lin.forward, group, index))  # noqa: B010

    def _switch(
        self, own: Callable[[torch.Tensor], torch.Tensor], group: _Group, index: int
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        local = self._local

        def forward(x: torch.Tensor) -> torch.Tensor:
            # a thread-local flag, which dynamo guards on: a caller's own compiled or eager
            # run of the model, on any thread, runs the layer's own forward
            if getattr(local, "on", False):
                return group.columns(x, index)
            return own(x)

        return forward

    @property
    def shared(self) -> list[torch.Tensor]:
        """The fused tensors (the members' parameters are views of them): what must move
        with those parameters when the weights leave the device (``hf/memory.py``)."""
        out: list[torch.Tensor] = []
        for g in self.groups:
            out.append(g.weight)
            if g.bias is not None:
                out.append(g.bias)
        return out

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        outer = getattr(self._local, "on", False)
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = outer

    def close(self) -> None:
        for group in self.groups:
            for lin in group.linears:
                if "forward" in vars(lin):
                    del lin.forward
            group.unfuse()
        self.groups.clear()
