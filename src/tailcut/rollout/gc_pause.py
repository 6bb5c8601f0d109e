"""Python's cyclic garbage collector, paused while rollout steps run.

A rollout step allocates a few objects per request and turn (tasks, futures, turn records,
engine results, trace lines) that almost all live until the step ends. The cyclic
collector, triggered every ~700 allocations, walks them again and again while they are
young, and a full collection also walks the whole heap (model, tokenizer, dataset) to
find nothing: on the simulated benchmark that is ~5-8% of the scheduler's own time per
request, more in a process with a large heap. Paused, the collector runs once when the
step ends, over the young generations only (the step's objects, walked once).

Reference counting still frees every acyclic object at once while paused; only reference
cycles (a cancelled request's traceback and frames, for instance) wait for the end of the
step. The pause is process-wide, so other threads' cycles wait too; steps running at the
same time (several workers on one loop) share it, and it ends with the last of them. A
collector the program had disabled stays disabled.

Trainers make the same trade around latency-critical phases (``gc.disable`` /
``gc.freeze`` after start-up, a collection between phases).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_depth = 0
_resume = False


@contextmanager
def gc_paused(enabled: bool = True) -> Iterator[None]:
    """Pause automatic cyclic collection inside the block (nothing when ``enabled`` is
    false); when the outermost block exits, resume it and collect the young generations."""
    global _depth, _resume
    if not enabled:
        yield
        return
    if _depth == 0:
        _resume = gc.isenabled()
        gc.disable()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _resume:
            gc.enable()
            gc.collect(1)
