"""The trainer's end of a weight-update process group: rank 0 of a group that inference
servers join, so it can broadcast tensors straight into their memory.

SGLang's servers join with ``init_custom_process_group``: a TCP rendezvous at
``master_address:master_port`` (rank 0, the trainer, hosts the store), the store prefixed
with the group name, then torch's ``_new_process_group_helper``, which prefixes it again
(``GROUP/``) and then by the first device the backend serves (gloo: ``cpu/``, one backend
for CPU and CUDA tensors; nccl: ``cuda/``), the backend's sequence number exchanged over
the store::

    TCPStore(master_address:master_port, hosted here)
      └─ PrefixStore(GROUP) ─ PrefixStore(GROUP/) ─ PrefixStore(cpu/ | cuda/)
           ─ ProcessGroupGloo | ProcessGroupNCCL (rank 0 of world_size)

This module builds the same thing with the backends constructed directly: no default
process group needed (a one-process trainer has none), nothing registered in torch's
global group table (several groups in one process, e.g. one per rank's share of the
servers, or a re-made one after a failure). Every blocking call is bounded by
``timeout_s``: joining waits for all ``world_size`` ranks, a broadcast for every receiver.
The calls block: run them off the event loop (:func:`in_thread`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import torch

T = TypeVar("T")

PREFIX = {"gloo": "cpu", "nccl": "cuda"}
"""The store prefix of each backend: the first device it serves (``Backend.backend_capability``);
torch builds one backend for all of them."""


class UpdateGroup:
    """Rank 0 of a weight-update group: host the store with :meth:`host`, then :meth:`join`
    while the servers join (concurrently: joining returns once every rank is in)."""

    def __init__(
        self, name: str, backend: str, address: str, port: int, world_size: int, timeout_s: float
    ) -> None:
        if backend not in PREFIX:
            raise ValueError(f"weight-update group backend must be gloo or nccl, got {backend!r}")
        if world_size < 2:
            raise ValueError(f"a weight-update group needs receivers; world_size={world_size}")
        self.name = name
        self.backend = backend
        self.address = address
        self.world_size = world_size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store: Any = None
        self._port = port
        self._pg: Any = None
        self.broken = False
        """A join or broadcast failed: the group is unusable (make a new one)."""

    @property
    def port(self) -> int:
        return int(self._store.port) if self._store is not None else self._port

    def host(self) -> int:
        """Start the rendezvous store on ``address:port`` (port 0: a free one); returns the
        port. Does not wait for anyone."""
        import torch.distributed as dist

        self._store = dist.TCPStore(
            self.address,
            self._port,
            self.world_size,
            True,
            timeout=self.timeout,
            wait_for_workers=False,
        )
        return self.port

    def join(self) -> None:
        """Build the group's backend as rank 0; blocks until every rank joined (bounded)."""
        if self._store is None:
            raise RuntimeError("host() the store before joining")
        try:
            self._pg = _backend(
                self._store, self.name, self.backend, 0, self.world_size, self.timeout
            )
        except BaseException:
            self.broken = True
            raise

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Send ``tensors`` (rank 0 is the source) to every rank, in order; returns when
        each was received (bounded by the group's timeout)."""
        from torch.distributed import BroadcastOptions

        try:
            if self._pg is None:
                raise RuntimeError(f"weight-update group {self.name} is not joined")
            works = []
            for tensor in tensors:
                if self.backend == "nccl" and not tensor.is_cuda:
                    raise ValueError("an nccl weight-update group sends CUDA tensors only")
                opts = BroadcastOptions()
                opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, self.timeout
                works.append(self._pg.broadcast([tensor.contiguous()], opts))
            for work in works:
                work.wait()
        except BaseException:
            self.broken = True
            raise

    def close(self) -> None:
        """Drop the backends and the store (the servers keep their end until told)."""
        if self.broken and self._pg is not None:
            with contextlib.suppress(RuntimeError):
                self._pg.abort()
        self._pg = None
        self._store = None


def join_group(
    address: str,
    port: int,
    rank: int,
    world_size: int,
    name: str,
    backend: str,
    timeout_s: float,
) -> Any:
    """The receiving end, as SGLang's ``init_custom_process_group`` builds it (a store client
    at ``address:port``): its backend, to ``broadcast`` on. Used by the fake servers."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, False, timeout=timeout)
    return _backend(store, name, backend, rank, world_size, timeout)


def _backend(
    root: Any, name: str, backend: str, rank: int, world_size: int, timeout: datetime.timedelta
) -> Any:
    """The backend of group ``name`` over the store ``root``, keyed as torch keys it."""
    from torch.distributed import PrefixStore

    store = PrefixStore(f"{PREFIX[backend]}/", PrefixStore(f"{name}/", PrefixStore(name, root)))
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        pg: Any = ProcessGroupGloo(store, rank, world_size, timeout=timeout)
    else:
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        pg = ProcessGroupNCCL(store, rank, world_size, opts)
    pg._set_sequence_number_for_group()
    return pg


def local_address(url: str) -> str:
    """This host's address on the route to the server at ``url`` (what it can reach us at);
    127.0.0.1 for a server on this host."""
    host = urlsplit(url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent: this only picks the route
        return str(probe.getsockname()[0])


async def in_thread(fn: Callable[[], T], name: str) -> T:
    """Run a blocking collective on a daemon thread and await its result. Unlike
    ``asyncio.to_thread``, a caller that gives up (a server failed, so the collective
    can only end by its own timeout) leaves nothing for the loop's shutdown to wait on."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def work() -> None:
        try:
            value = fn()
        except BaseException as exc:  # handed to the awaiting task
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle, None, exc)
            return
        if not loop.is_closed():
            loop.call_soon_threadsafe(settle, value, None)

    threading.Thread(target=work, name=name, daemon=True).start()
    return await future
