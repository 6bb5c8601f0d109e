"""Handing the embedded engine's device memory to a colocated trainer and taking it back.

``release_memory`` (``HFEngine``) drops the KV cache (``hf/cache.py``), the CUDA graphs
that read it and the weights (``hf/graphs.py``), and optionally moves the weights to host
memory (:class:`WeightOffload`); ``resume_memory`` undoes it. Tags are SGLang's
(``tailcut.engine.base.MEMORY_TAGS``); releasing the KV cache or the weights always drops
the graphs too, since they read both at fixed addresses (captured again on first use).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from tailcut.engine.base import MEMORY_TAGS, MemoryReport
from tailcut.engine.hf.cache import SlotKVCache
from tailcut.engine.hf.graphs import DecodeStep


def normalize_tags(tags: Sequence[str] | None) -> frozenset[str]:
    """``tags`` checked against :data:`MEMORY_TAGS` (None: all); ``cuda_graph`` is added
    whenever the KV cache or the weights are named."""
    chosen = frozenset(MEMORY_TAGS if tags is None else tags)
    bad = sorted(chosen - set(MEMORY_TAGS))
    if bad:
        raise ValueError(f"unknown memory tag(s) {bad}; known: {list(MEMORY_TAGS)}")
    if chosen & {"kv_cache", "weights"}:
        chosen |= {"cuda_graph"}
    return chosen


def device_allocated(device: torch.device) -> int:
    """``torch.cuda.memory_allocated`` on a CUDA device (after the queued work), else -1."""
    if device.type != "cuda":
        return -1
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


class WeightOffload:
    """Moves a model's parameters to host memory and back, in place (``.data``).

    Tensors that share one storage — tied parameters, the fused projections' views and
    their fused tensor (``hf/fused.py``, passed as ``shared``) — move as that one storage
    and stay views of it on either side. Host copies are kept between steps (page-locked
    on CUDA, allocated on the first offload), so later offloads are one device-to-host
    copy per storage. Buffers (rotary frequencies) stay on the device. A weight update
    while offloaded writes into the host copies, which :meth:`restore` brings back; either
    order of sync and resume is correct.
    """

    def __init__(self, model: Any, shared: Sequence[torch.Tensor] = ()) -> None:
        self._params = list(model.parameters())  # tied parameters once
        self._device = self._params[0].device
        groups: dict[int, list[torch.Tensor]] = {}
        for t in [*self._params, *shared]:
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
        self._groups = list(groups.values())
        self._host: list[torch.Tensor] = []
        self.offloaded = False

    @property
    def bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._params)

    def offload(self) -> int:
        """Move every parameter to host memory; returns the bytes moved."""
        if self.offloaded:
            return 0
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, not inference ones
            self._offload()
        self.offloaded = True
        return self.bytes

    def _offload(self) -> None:
        pin = self._device.type == "cuda"
        flats = [_flat(g[0]) for g in self._groups]
        if not self._host:
            self._host = [torch.empty(f.numel(), dtype=f.dtype, pin_memory=pin) for f in flats]
        for flat, host in zip(flats, self._host, strict=True):
            host.copy_(flat, non_blocking=pin)
        if pin:
            torch.cuda.synchronize(self._device)
        for group, host in zip(self._groups, self._host, strict=True):
            _repoint(group, host)  # the device storage goes with its last reference

    def restore(self) -> int:
        """Copy every parameter back to its device; returns the bytes moved."""
        if not self.offloaded:
            return 0
        pin = self._device.type == "cuda"
        with torch.inference_mode(False), torch.no_grad():
            for group, host in zip(self._groups, self._host, strict=True):
                # on the CPU, a fresh tensor: the host copy stays the offload's own buffer
                _repoint(group, host.to(self._device, non_blocking=pin, copy=True))
        if pin:
            torch.cuda.synchronize(self._device)
        self.offloaded = False
        return self.bytes


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as one flat byte tensor."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _repoint(group: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Make each tensor of ``group`` the same view of ``flat`` (a copy of their storage's
    bytes) that it was of its storage."""
    views = [flat.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset()) for t in group]
    for t, view in zip(group, views, strict=True):
        t.data = view


class EngineMemory:
    """The releasable parts of one engine: its KV cache, decode graphs and weights (called
    on the worker thread, between passes, while no request runs)."""

    def __init__(
        self,
        model: Any,
        cache: SlotKVCache,
        decoder: DecodeStep,
        shared: Sequence[torch.Tensor] = (),
    ) -> None:
        self._cache = cache
        self._decoder = decoder
        self._weights = WeightOffload(model, shared)
        self._device = cache.shape.device
        self.released: frozenset[str] = frozenset()

    def release(self, tags: Sequence[str] | None) -> MemoryReport:
        chosen = normalize_tags(tags)
        start = time.perf_counter()
        before = device_allocated(self._device)
        graphs = self._decoder.release() if "cuda_graph" in chosen else 0
        kv = self._cache.release() if "kv_cache" in chosen else 0
        weights = self._weights.offload() if "weights" in chosen else 0
        if self._device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver
        self.released |= chosen
        return MemoryReport(
            tuple(sorted(chosen)), time.perf_counter() - start, kv, weights, graphs,
            before, device_allocated(self._device),
        )  # fmt: skip

    def resume(self, tags: Sequence[str] | None) -> MemoryReport:
        chosen = normalize_tags(tags)
        start = time.perf_counter()
        before = device_allocated(self._device)
        weights = self._weights.restore() if "weights" in chosen else 0
        kv = 0
        if "kv_cache" in chosen and self._cache.released:
            kv = self._cache.resume()
        if "cuda_graph" in chosen:
            self._decoder.resume()
        self.released -= chosen
        return MemoryReport(
            tuple(sorted(chosen)), time.perf_counter() - start, kv, weights, 0,
            before, device_allocated(self._device),
        )  # fmt: skip
