"""One trajectory's tool session: a tool's instance is created once, before any of its
calls executes, however many of a turn's calls come at once; it is released at the end,
also when its creation failed or was still running."""

from __future__ import annotations

import asyncio
from typing import Any

from tailcut.tools.base import ToolResult, ToolSet
from tailcut.vtime import run_virtual


class SlowCreate:
    """Its instance takes 0.5 s (virtual) to create (a sandbox starting); ``fail``: the
    creation raises half-way."""

    name = "slow"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.creates = 0
        self.ready: set[str] = set()
        self.released: list[str] = []

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "parameters": {}}}

    async def create(self, instance_id: str, **kwargs: Any) -> None:
        self.creates += 1
        await asyncio.sleep(0.5)
        if self.fail:
            raise RuntimeError("sandbox did not start")
        self.ready.add(instance_id)

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult("ready" if instance_id in self.ready else "not created yet")

    async def calc_reward(self, instance_id: str) -> float:
        return 0.0

    async def release(self, instance_id: str) -> None:
        self.released.append(instance_id)
        self.ready.discard(instance_id)


def _three_calls_at_once(tool: SlowCreate) -> list[ToolResult]:
    async def main() -> list[ToolResult]:
        async with ToolSet({"slow": tool}).session("s1", {}) as session:
            return list(await asyncio.gather(*(session.call("slow", {}) for _ in range(3))))

    return run_virtual(main())


def test_concurrent_first_calls_share_one_creation_and_run_after_it() -> None:
    tool = SlowCreate()
    results = _three_calls_at_once(tool)
    assert [r.text for r in results] == ["ready"] * 3
    assert tool.creates == 1 and tool.released == ["s1"]


def test_a_failed_creation_fails_each_call_and_is_still_released() -> None:
    tool = SlowCreate(fail=True)
    results = _three_calls_at_once(tool)
    assert [r.status for r in results] == ["error"] * 3
    assert all("sandbox did not start" in r.text for r in results)
    assert tool.creates == 1 and tool.released == ["s1"]


class BadRelease(SlowCreate):
    name = "bad"

    async def release(self, instance_id: str) -> None:
        raise RuntimeError("release failed")


def test_a_release_that_raises_does_not_keep_the_others_from_theirs() -> None:
    good, bad = SlowCreate(), BadRelease()

    async def main() -> None:
        async with ToolSet({"slow": good, "bad": bad}).session("s1", {}) as session:
            await session.call("slow", {})
            await session.call("bad", {})  # created last: released first

    try:
        run_virtual(main())
    except RuntimeError as exc:
        assert str(exc) == "release failed"
    else:
        raise AssertionError("the failed release was swallowed")
    assert good.released == ["s1"]
