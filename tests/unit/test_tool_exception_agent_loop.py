"""A tool whose ``execute`` raises a generic exception (a tool bug, not bad arguments) is a
tool message to the model and the trajectory goes on: the sample ends COMPLETED, never
FAILED (issue 13: "a tool error is a tool message to the model, never a FAILED sample")."""

from __future__ import annotations

from typing import Any

import pytest
from test_agent_loop import FakeTool, _sample, _script  # tests/unit is on sys.path

from fakes.scripted_engine import ScriptedEngine
from tailcut.chat.parser import format_tool_call
from tailcut.rollout.agent_loop import AgentLoop
from tailcut.rollout.cutoff import WaitAll
from tailcut.rollout.scheduler import run_step
from tailcut.tools.base import ToolResult, ToolSet
from tailcut.trace.events import NULL_TRACER
from tailcut.types import FinishReason, Status
from tailcut.vtime import run_virtual

pytestmark = pytest.mark.timeout(60)


class BrokenTool(FakeTool):
    """Raises ``exc`` from ``execute`` (after recording the call)."""

    def __init__(self, exc: BaseException, **kw: Any) -> None:
        super().__init__(**kw)
        self.exc = exc

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        self.calls.append(arguments)
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "shown"),
    [
        (RuntimeError("sandbox crashed"), "Error: echo failed: RuntimeError: sandbox crashed"),
        (ZeroDivisionError("division by zero"), "Error: echo failed: ZeroDivisionError: "),
        (OSError(5, "Input/output error"), "Error: echo failed: OSError: "),
    ],
    ids=["RuntimeError", "ZeroDivisionError", "OSError"],
)
def test_a_raising_tool_is_a_tool_message_and_the_sample_completes(
    chat_tokenizer: Any, exc: BaseException, shown: str
) -> None:
    tok = chat_tokenizer
    tool = BrokenTool(exc)
    replies = ["Checking.\n" + format_tool_call("echo", {"text": "7"}), "No tool then.\n#### 7"]
    rewarded: list[str | None] = []

    def reward_fn(sample: Any, tool_rewards: dict[str, float]) -> float:
        rewarded.append(sample.messages[-2]["content"])  # the tool message, before the answer
        return 1.0

    loop = AgentLoop(tok, toolset=ToolSet({"echo": tool}), reward_fn=reward_fn)
    engine = ScriptedEngine(tok, _script(replies))
    samples = [_sample(0), _sample(1)]

    async def main() -> Any:
        return await run_step(engine, samples, loop, WaitAll(2), NULL_TRACER)

    result = run_virtual(main())
    assert [s.status for s in result.samples] == [Status.COMPLETED, Status.COMPLETED]
    assert result.kept == [0, 1]
    assert tool.calls == [{"text": "7"}, {"text": "7"}]
    assert len(tool.released) == 2  # released although execute raised
    for sample in result.samples:
        assert sample.error is None
        assert sample.finish_reason is FinishReason.STOP
        assert sample.reward == 1.0
        assert [t.finish_reason for t in sample.turns] == [FinishReason.STOP, FinishReason.STOP]
        turn = sample.turns[0]
        assert (turn.tool_calls, turn.tool_errors) == (1, 1)
        tool_msgs = [m for m in sample.messages if m["role"] == "tool"]
        assert len(tool_msgs) == 1 and tool_msgs[0]["name"] == "echo"
        assert tool_msgs[0]["content"].startswith(shown), tool_msgs[0]["content"]
        assert "Traceback" not in tool_msgs[0]["content"]
        assert sample.messages[-1]["role"] == "assistant"
        assert sample.messages[-1]["content"].endswith("#### 7")
    assert len(rewarded) == 2 and all(r is not None and r.startswith(shown) for r in rewarded)
