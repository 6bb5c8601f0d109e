"""What a training setup closes when the run ends: its engine, its reward functions and its
tools (a code interpreter's HTTP session to a Sandbox Fusion server), each even when one
before it fails to close."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tailcut.app.train_setup import _closer
from tailcut.tools.base import ToolResult, ToolSet


class Closes:
    def __init__(self, log: list[str], label: str, fail: bool = False) -> None:
        self.log, self.label, self.fail = log, label, fail

    async def aclose(self) -> None:
        self.log.append(self.label)
        if self.fail:
            raise RuntimeError(f"{self.label} did not close")


class SessionTool(Closes):
    """A tool holding a run-wide resource."""

    name = "held"

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "held", "parameters": {}}}

    async def create(self, instance_id: str, **kw: Any) -> None: ...

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult("ok")

    async def calc_reward(self, instance_id: str) -> float:
        return 0.0

    async def release(self, instance_id: str) -> None: ...


@pytest.mark.parametrize("engine_fails", [False, True])
def test_the_run_closes_its_engine_reward_and_tools(engine_fails: bool) -> None:
    log: list[str] = []
    tool = SessionTool(log, "tool")
    close = _closer(
        Closes(log, "engine", fail=engine_fails),
        Closes(log, "reward"),
        ToolSet({"held": tool}),  # type: ignore[arg-type]
    )
    if engine_fails:
        with pytest.raises(RuntimeError, match="engine did not close"):
            asyncio.run(close())
    else:
        asyncio.run(close())
    assert log == ["engine", "reward", "tool"]
