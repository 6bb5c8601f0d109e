"""Memory that successive batch assemblies reuse (``algo/batch.assemble``)."""

from __future__ import annotations

import numpy as np


class BatchBuffers:
    """Memory that successive :func:`~tailcut.algo.batch.assemble` calls reuse (the trainer keeps one): a batch
    built into it is a set of views, valid until the next call with the same buffers.

    Fresh arrays of a few tens of MB cost a page fault per 4 KiB page on first touch, which
    on a VM costs more than copying the tokens; reused pages are already mapped. Each
    buffer grows (with headroom) when a batch needs more, and never shrinks.
    """

    def __init__(self, headroom: float = 1.25) -> None:
        self.headroom = headroom
        self._flat: dict[str, np.ndarray] = {}

    def take(self, name: str, shape: tuple[int, int], dtype: type) -> np.ndarray:
        """An uninitialised ``shape`` array (the caller writes every cell)."""
        size = shape[0] * shape[1]
        flat = self._flat.get(name)
        if flat is None or flat.dtype != dtype or flat.size < size:
            flat = self._flat[name] = np.empty(int(size * self.headroom) + 1, dtype=dtype)
        return flat[:size].reshape(shape)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._flat.values())


class _Fresh:
    """Fresh arrays every call (no reuse)."""

    @staticmethod
    def take(name: str, shape: tuple[int, int], dtype: type) -> np.ndarray:
        return np.empty(shape, dtype=dtype)


FRESH = _Fresh()
