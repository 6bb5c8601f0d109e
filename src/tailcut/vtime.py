"""Virtual time for asyncio: an event loop whose clock jumps to the next timer.

When nothing is ready to run and the loop would sleep until its next timer, the clock
advances to that timer instantly instead. Real I/O is still polled (without blocking) on
each turn, and when no timer is scheduled at all the loop blocks on real I/O as usual (so
``to_thread`` work is still awaited; it takes zero virtual time).

An 80 s simulated step runs in a fraction of a second and tests can assert exact times.
``time.monotonic`` / ``perf_counter`` stay real: use them to measure the real cost of the
code under test; use ``loop.time()`` for simulated time.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _SkippingSelector(selectors.DefaultSelector):
    """Polls real I/O without blocking; a would-be timed wait advances the virtual clock."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            return super().select(None)
        events = super().select(0)
        if not events and timeout > 0 and self.loop is not None:
            self.loop.advance(timeout)
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0) -> None:
        selector = _SkippingSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = start

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a fresh :class:`VirtualTimeLoop` starting at t=0."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)
