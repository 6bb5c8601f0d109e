"""Run one benchmark coroutine to completion, its result handed back cheaply.

``asyncio.run`` and :func:`tailcut.vtime.run_virtual` run the coroutine as an
``asyncio.Runner``'s main task. On Python 3.11, when the runner puts back its SIGINT handler
it calls ``signal.getsignal`` / ``signal.signal``, whose enum lookup (``Handlers(handler)``)
fails and formats ``repr(handler)`` into the error: a ``functools.partial`` holding the main
task, whose repr holds the repr of its *result*. For a step result of 10,240 samples that is
the repr of every sample and its token arrays, twice: minutes of CPU and a string of
hundreds of MB per step. Here the main task returns None and the result travels outside
it, so the cost is gone whatever the coroutine returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from tailcut.vtime import run_virtual

T = TypeVar("T")


def _unboxed(run: Callable[[Coroutine[Any, Any, None]], None], coro: Coroutine[Any, Any, T]) -> T:
    box: list[T] = []

    async def main() -> None:
        box.append(await coro)

    run(main())
    return box[0]


def run_virtual_result(coro: Coroutine[Any, Any, T]) -> T:
    """:func:`~tailcut.vtime.run_virtual` of ``coro``, its result kept off the main task."""
    return _unboxed(run_virtual, coro)


def run_result(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` (real time), its result kept off the main task."""
    return _unboxed(asyncio.run, coro)
