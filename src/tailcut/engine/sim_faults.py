"""Faults the simulated engine can inject, and its record of every abort it received."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import StrEnum

from tailcut.types import GenerateRequest

RequestFilter = Callable[[GenerateRequest], bool]


@dataclass(frozen=True)
class Select:
    """Which requests a fault applies to: by id, by arrival ordinal (0 = first request the
    engine saw), or by a predicate on the request. Empty selects nothing; ``every`` all."""

    ids: Collection[str] = ()
    ordinals: Collection[int] = ()
    where: RequestFilter | None = None
    every: bool = False

    @property
    def active(self) -> bool:
        return bool(self.every or self.ids or self.ordinals or self.where is not None)

    def __call__(self, request: GenerateRequest, ordinal: int) -> bool:
        if self.every or request.request_id in self.ids or ordinal in self.ordinals:
            return True
        return self.where is not None and self.where(request)


@dataclass(frozen=True)
class SimFaults:
    """Faults to inject (all off by default)."""

    lose_aborts: Select = field(default_factory=Select)
    """Requests whose abort attempts are silently lost (the engine keeps generating)."""
    lose_abort_attempts: int = 1_000_000
    """How many abort attempts per selected request are lost before one takes effect."""
    hang: Select = field(default_factory=Select)
    """Requests that never finish: they generate ``max_new_tokens`` and then hold their
    batch slot and KV cache until aborted."""
    die_at_s: float | None = None
    """The engine dies this many seconds after its start (its first call): pending and
    later calls raise :class:`EngineDied`."""


class AbortEffect(StrEnum):
    ABORTED = "aborted"
    LOST = "lost"
    NOT_RUNNING = "not_running"
    """Unknown id, or the request had already ended (a no-op)."""


@dataclass(frozen=True, slots=True)
class AbortRecord:
    request_id: str
    time: float
    effect: AbortEffect
    tokens: int
    """Tokens the request had generated when the abort arrived."""
