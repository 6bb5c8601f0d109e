"""Ranks of one job as threads of one process, for :class:`~tailcut.train.rank_workers.RankWorkers`.

The collectives behave as the process group's: ``gather`` and ``broadcast`` block until
every rank has called them (a rank that never calls them leaves the others waiting, here up to
``timeout_s``, then ``BrokenBarrierError``), and what crosses ranks is pickled, as
``gather_object`` pickles it. The store is a real ``TCPStore`` (rank 0 its server)."""

from __future__ import annotations

import datetime
import pickle
import threading
from typing import Any

import torch.distributed as dist


class ThreadJob:
    def __init__(self, world: int, timeout_s: float = 20.0) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=timeout_s)
        self.slots: list[bytes | None] = [None] * world
        wait = datetime.timedelta(seconds=timeout_s)
        server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=wait, wait_for_workers=False)
        clients = [dist.TCPStore("127.0.0.1", server.port, world, False, timeout=wait)
                   for _ in range(world - 1)]  # fmt: skip
        self.stores = [server, *clients]

    def ranks(self) -> list[ThreadRanks]:
        return [ThreadRanks(self, r) for r in range(self.world)]


class ThreadRanks:
    """What :class:`~tailcut.train.distributed.Ranks` offers the rollout, for one thread."""

    def __init__(self, job: ThreadJob, rank: int) -> None:
        self.job, self.rank, self.world = job, rank, job.world

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def store(self) -> Any:
        return self.job.stores[self.rank]

    def gather(self, obj: Any) -> list[Any] | None:
        self.job.slots[self.rank] = pickle.dumps(obj)
        self.job.barrier.wait()
        out = [pickle.loads(b) for b in self.job.slots if b is not None] if self.is_main else None
        self.job.barrier.wait()
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.is_main:
            self.job.slots[0] = pickle.dumps(obj)
        self.job.barrier.wait()
        data = self.job.slots[0]
        self.job.barrier.wait()
        assert data is not None
        return pickle.loads(data)
