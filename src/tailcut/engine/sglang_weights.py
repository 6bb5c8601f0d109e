"""SGLang's in-memory weight update, the trainer's side (used by
:meth:`tailcut.engine.sglang.SGLangEngine.update_weights_from_distributed`; the flow is
drawn in ``engine/sglang.py``). The field names and answers follow SGLang's
``http_server.py`` / ``io_struct.py`` (``InitWeightsUpdateGroupReqInput``,
``UpdateWeightsFromDistributedReqInput``); the group itself is ``engine/update_group.py``.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tailcut.engine.base import EngineError
from tailcut.engine.http import ServerClient, ServerHTTPError, fan_out

if TYPE_CHECKING:
    import torch

    from tailcut.engine.update_group import UpdateGroup


@dataclass(frozen=True, slots=True)
class GroupOptions:
    """How the weight-update group is made (``sync.*``)."""

    backend: str = "gloo"
    """gloo (CPU tensors) or nccl (CUDA tensors)."""
    master_address: str | None = None
    """Our address as the servers reach it (None: the one on the route to the first)."""
    master_port: int = 0
    """The rendezvous port we host (0: a free one)."""
    timeout_s: float = 300.0
    """Bound on forming the group and on each bucket's broadcast and answers."""


@dataclass(frozen=True, slots=True)
class DistributedUpdate:
    """What one in-memory update did."""

    bytes: int
    init_s: float
    """Forming the group (0 when the last one was reused)."""
    send_s: float
    """Broadcasting, and the servers loading, every bucket."""


async def server_ranks(server: ServerClient) -> int:
    """How many ranks (TP workers) ``server`` brings to a weight-update group."""
    try:
        info = await server.get_json("/server_info", timeout_s=30.0)
    except ServerHTTPError as exc:
        if exc.status != 404:
            raise
        info = await server.get_json("/get_server_info", timeout_s=30.0)
    tp, dp, pp = (int(info.get(k) or 1) for k in ("tp_size", "dp_size", "pp_size"))
    if dp > 1 and not info.get("enable_dp_attention"):
        raise EngineError(
            f"sglang server {server.url} runs dp_size={dp}: SGLang updates weights from "
            f"distributed only with dp_size 1 (or DP attention); start one server per "
            f"replica, or use sync.method=disk"
        )
    if pp > 1:
        raise EngineError(
            f"sglang server {server.url} runs pp_size={pp}: its workers would share ranks "
            f"in a weight-update group; use sync.method=disk"
        )
    return tp


async def form_group(
    servers: list[ServerClient], options: GroupOptions, leftovers: set[asyncio.Future[Any]]
) -> UpdateGroup:
    from tailcut.engine.update_group import UpdateGroup, in_thread, local_address

    ranks = await fan_out(server_ranks(s) for s in servers)
    address = options.master_address or local_address(servers[0].url)
    name = f"tailcut-{uuid.uuid4().hex[:12]}"
    group = UpdateGroup(
        name, options.backend, address, options.master_port, 1 + sum(ranks), options.timeout_s
    )
    try:
        port = await in_thread(group.host, f"{name}-host")
    except Exception as exc:
        raise EngineError(
            f"sglang: cannot host the weight-update group at {address}:{options.master_port}"
            f" (sync.master_address / sync.master_port): {exc}"
        ) from exc
    offsets = [1 + sum(ranks[:i]) for i in range(len(servers))]

    async def init(server: ServerClient, offset: int) -> None:
        body = {
            "master_address": address,
            "master_port": port,
            "rank_offset": offset,
            "world_size": group.world_size,
            "group_name": name,
            "backend": options.backend,
        }
        # longer than our side waits: a server that does not join is named as such
        await control(server, "/init_weights_update_group", body, options.timeout_s + 10.0)

    calls = {
        asyncio.create_task(init(s, off), name=f"{name}:{s.url}"): s
        for s, off in zip(servers, offsets, strict=True)
    }
    await with_collective(
        calls, in_thread(group.join, f"{name}-join"), group,
        f"the weight-update group {name} at {address}:{port} ({group.world_size} ranks)",
        leftovers,
    )  # fmt: skip
    return group


async def send_buckets(
    group: UpdateGroup,
    servers: list[ServerClient],
    buckets: AsyncIterator[list[tuple[str, torch.Tensor]]],
    version: str,
    flush_cache: bool,
    options: GroupOptions,
    leftovers: set[asyncio.Future[Any]],
) -> int:
    """Each bucket to every server (the next one fetched first, so the last one carries
    the version and the flush). Returns the bytes broadcast."""
    from tailcut.engine.update_group import in_thread

    sent = 0
    bucket = await anext(buckets, None)
    while bucket is not None:
        after = await anext(buckets, None)
        last = after is None
        tensors = [t for _, t in bucket]
        body = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": group.name,
            "flush_cache": flush_cache and last,
            "abort_all_requests": False,
            "weight_version": version if last else None,
        }
        calls = {
            asyncio.create_task(
                control(s, "/update_weights_from_distributed", body, options.timeout_s + 10.0)
            ): s
            for s in servers
        }
        await with_collective(
            calls, in_thread(functools.partial(group.broadcast, tensors), f"{group.name}-send"),
            group, f"the broadcast of {len(tensors)} tensor(s) over group {group.name}", leftovers,
        )  # fmt: skip
        sent += sum(t.numel() * t.element_size() for t in tensors)
        bucket = after
    return sent


async def with_collective(
    calls: dict[asyncio.Task[None], ServerClient],
    collective: Any,
    group: UpdateGroup,
    what: str,
    leftovers: set[asyncio.Future[Any]],
) -> None:
    """Await the servers' ``calls`` and our side of the ``collective`` together; the
    first failure ends it (the calls cancelled, the group marked broken) as an
    ``EngineError`` that names the server or the ones that did not answer. A blocked
    collective cannot be interrupted: it ends by the group's timeout; it goes to
    ``leftovers`` to be awaited later (so no thread is left inside torch at exit)."""
    ours = asyncio.ensure_future(collective)
    try:
        done, _ = await asyncio.wait({ours, *calls}, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task is not ours and task.exception() is not None:
                exc = task.exception()
                group.broken = True
                url = calls[task].url
                raise EngineError(f"sglang server {url}: {exc}") from exc
        if ours in done and ours.exception() is not None:
            group.broken = True
            waiting = [calls[t].url for t in calls if not t.done()]
            raise EngineError(
                f"sglang: {what} failed: {ours.exception()}"
                + (f"; no answer from {', '.join(waiting)}" if waiting else "")
            ) from ours.exception()
    finally:
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        if not ours.done():  # it ends by the group's timeout: awaited at close
            leftovers.add(ours)
            ours.add_done_callback(functools.partial(_settled, leftovers))


async def control(server: ServerClient, path: str, body: dict[str, Any], timeout_s: float) -> None:
    """One weight-update call; its ``{success, message}`` answer checked."""
    try:
        answer = await server.post_json(
            path, body, timeout_s=timeout_s, retries=0, idempotent=False
        )
    except ServerHTTPError as exc:
        raise EngineError(f"{path} answered HTTP {exc.status}: {exc.message}") from exc
    if not isinstance(answer, dict) or not answer.get("success", False):
        message = answer.get("message", answer) if isinstance(answer, dict) else answer
        raise EngineError(f"{path} failed: {message}")


def _settled(leftovers: set[asyncio.Future[Any]], future: asyncio.Future[Any]) -> None:
    leftovers.discard(future)
    if not future.cancelled():
        future.exception()  # reported already, as the failure that left it behind
