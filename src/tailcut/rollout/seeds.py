"""Reproducible sampling: every engine call gets a seed that depends only on
``(run seed, stream, step, sample index, call number)``.

An engine's own request counter depends on the order requests reach it, and starts again
from zero in a resumed process; seeds given per request do not. The trainer seeds each
trajectory once, at its first launch (:func:`seed_samples`, by its index in the whole step,
however the step is split over workers; a partial trajectory resumed in a later step keeps
its seed); the agent loop gives the engine call of turn ``k`` ``call_seed(seed, k + 1)``, and
a turn continued after a cut goes on with the same stream (``SamplingParams.seed_offset``).
With them a resumed step samples what the uninterrupted run sampled, and
``cut disabled`` samples exactly what ``wait-all`` samples (engines that honour
``SamplingParams.seed``: the embedded HF engine, SGLang and vLLM).
"""

from __future__ import annotations

from collections.abc import Iterable

from tailcut.types import Sample

TRAIN_STREAM = 0
"""Seeds of training rollouts."""
VALIDATION_STREAM = 1
"""Seeds of validation rollouts (the same every validation: differences are the policy's)."""

_MASK = (1 << 63) - 1


def mix(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 over the parts)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & _MASK


def seed_samples(samples: Iterable[Sample], run_seed: int, stream: int, step: int) -> None:
    """Give each sample the seed of its launch: ``(run seed, stream, step, index)``."""
    for s in samples:
        s.seed = mix(run_seed, stream, step, s.index)


def call_seed(sample_seed: int, call: int) -> int:
    """The seed of engine call ``call`` (1-based: turn index + 1) of a trajectory seeded
    ``sample_seed``."""
    return mix(sample_seed, call)
