"""Reproducible sampling: every engine call gets a seed that depends only on
``(run seed, step, sample index, call number)``.

An engine's own request counter depends on the order requests reach it, and starts again
from zero in a resumed process; seeds given per request do not. With them a resumed step
samples what the uninterrupted run sampled, and ``cut disabled`` samples exactly what
``wait-all`` samples (engines that honour ``SamplingParams.seed``: the embedded HF engine,
SGLang and vLLM).
"""

from __future__ import annotations

import dataclasses

from tailcut.engine.base import Engine, EngineView
from tailcut.rollout.scheduler import RolloutFn
from tailcut.trace.events import Tracer
from tailcut.types import GenerateRequest, GenerateResult, Sample

_MASK = (1 << 63) - 1


def mix(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 over the parts)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & _MASK


class _SeededEngine(EngineView):
    """The step's engine as one sample sees it: fills in a seed on every request."""

    def __init__(self, engine: Engine, seed: int) -> None:
        super().__init__(engine)
        self._seed = seed
        self._calls = 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._calls += 1
        if request.sampling.seed is None:
            sampling = dataclasses.replace(request.sampling, seed=mix(self._seed, self._calls))
            request = dataclasses.replace(request, sampling=sampling)
        return await self.engine.generate(request)


class SeededRollout:
    """Wraps a rollout fn; ``set_step(k)`` before each step. A rollout worker holding the
    samples ``offset ..`` of the step passes ``index_offset``: seeds follow the sample's
    position in the whole step, however the step is split over workers."""

    def __init__(self, inner: RolloutFn, seed: int, stream: int = 0) -> None:
        self.inner = inner
        self.seed = seed
        self.stream = stream
        self.step = 0
        self.index_offset = 0

    def set_step(self, step: int, index_offset: int = 0) -> None:
        self.step = step
        self.index_offset = index_offset

    async def __call__(self, sample: Sample, engine: Engine, tracer: Tracer) -> None:
        seed = mix(self.seed, self.stream, self.step, self.index_offset + sample.index)
        await self.inner(sample, _SeededEngine(engine, seed), tracer)
