"""Ranks of one training job: who this process is, and the few collectives the loop needs.

A job of N ranks is N processes started by ``torchrun`` (or by ``tailcut train
trainer.nproc_per_node=N``, which starts ``torchrun`` itself): each reads ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK`` from its environment, joins one process group (gloo on CPU,
NCCL on CUDA; one rank per GPU) and runs the same training loop. Every rank holds the same
trainer state (prompt order, partial buffer, cut-off policy, step results): it is computed
from the same inputs, or broadcast from rank 0 where it is not (a step's merged rollout).
What is split is the work: each rank's rollout worker runs its block of whole GRPO groups on
its own engine, and each rank trains on its share of every mini-batch (the actor, sharded
with FSDP2).

:class:`Ranks` is that view; ``Ranks.single()`` is the one-process job, where every
collective is the identity, so the loop has one code path.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tailcut.errors import TailcutError


class RankError(TailcutError):
    """A rank could not join the job, or the job lost a rank."""


@dataclass(frozen=True, slots=True)
class Ranks:
    rank: int
    world: int
    local_rank: int
    backend: str | None
    """None: one process, no process group."""

    @classmethod
    def single(cls) -> Ranks:
        return cls(0, 1, 0, None)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    def device(self, requested: str) -> torch.device:
        """The device of this rank: ``cuda:LOCAL_RANK`` when CUDA is asked for (or ``auto``
        finds it), else the CPU."""
        if requested.startswith("cuda") or (requested == "auto" and torch.cuda.is_available()):
            if not torch.cuda.is_available():
                raise RankError(f"rank {self.rank}: device {requested!r} asked for, no CUDA here")
            if self.local_rank >= torch.cuda.device_count():
                raise RankError(
                    f"rank {self.rank}: local rank {self.local_rank} but only "
                    f"{torch.cuda.device_count()} GPU(s) here; start at most one rank per GPU"
                )
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    # -- collectives (identity on one rank) ---------------------------------------------

    def _tensor_device(self) -> torch.device:
        return (
            torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        )

    def all_sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over ranks (float64)."""
        if not self.distributed or not values:
            return [float(v) for v in values]
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.float64, device=self._tensor_device())
        dist.all_reduce(t)
        return [float(v) for v in t.cpu()]

    def all_max(self, value: float) -> float:
        if not self.distributed:
            return float(value)
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=self._tensor_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0, device=self._tensor_device())
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (in rank order); None on the others."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world if self.is_main else None
        if self.backend == "nccl":  # gather_object needs gloo-style CPU transport
            everyone: list[Any] = [None] * self.world
            dist.all_gather_object(everyone, obj)
            return everyone if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def store(self) -> Any:
        """The process group's key-value store (the global cut's channel)."""
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()


def from_env(timeout_s: float) -> Ranks:
    """This process's rank, joining the process group when started by torchrun (``RANK`` and
    ``WORLD_SIZE`` set) — also a group of one, so that ``torchrun --nproc-per-node 1`` runs
    the sharded actor (FSDP2, CPU offload) as N ranks do; one process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" not in os.environ:
        return Ranks.single()
    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    backend = (
        "nccl" if torch.cuda.is_available() and os.environ.get("TAILCUT_GLOO") != "1" else "gloo"
    )
    if backend == "nccl":
        torch.cuda.set_device(local)
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
        )
    except Exception as exc:  # a bad address or port, a rank that never came
        raise RankError(
            f"rank {rank}/{world}: could not join the process group at {where} within "
            f"{timeout_s:.0f} s ({type(exc).__name__}: {exc})"
        ) from exc
    return Ranks(rank, world, local, backend)


def close(ranks: Ranks) -> None:
    if ranks.distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
