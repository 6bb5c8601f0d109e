"""The global cut's completion queue (``train/rank_workers.py``) has one reader: a step's
last read happens in the drainer itself, so no completion is counted twice, none is lost,
and an empty queue is never popped (which raises in the store). Each completion carries its
reward (the group filter's quota counts informative groups) or none."""

from __future__ import annotations

import asyncio
import datetime

import torch.distributed as dist

from tailcut.train.rank_workers import _drain, _pusher
from tailcut.types import Status


def test_every_completion_is_read_once_including_those_pushed_last() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    got: list[tuple[int, int, Status, float | None]] = []

    class Coord:
        def report(self, index: int, group: int, status: Status, reward: float | None) -> None:
            got.append((index, group, status, reward))

    push = _pusher(store, "events")

    async def main() -> None:
        last = asyncio.Event()
        drain = asyncio.create_task(_drain(store, "events", Coord(), last))  # type: ignore[arg-type]
        for i in range(40):
            push(i, i // 4, Status.COMPLETED, i / 3)
            if i % 7 == 0:
                await asyncio.sleep(0.002)  # reads interleave with pushes
        push(40, 10, Status.FAILED, None)  # pushed just before the step's end
        last.set()
        await asyncio.wait_for(drain, 10)

    asyncio.run(main())
    want = [(i, i // 4, Status.COMPLETED, i / 3) for i in range(40)]
    assert got == [*want, (40, 10, Status.FAILED, None)]  # rewards exact (repr round-trips)
    assert store.queue_len("events") == 0
