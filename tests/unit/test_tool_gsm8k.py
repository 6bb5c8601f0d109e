"""The calc_gsm8k_reward tool: verl's observable behaviour, in a tool session."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tailcut.tools.base import ToolLimits, ToolSet
from tailcut.tools.gsm8k import Gsm8kTool, Gsm8kToolConfig


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def calls(tool: Gsm8kTool, answers: list[Any], truth: str = "72") -> tuple[list[Any], float]:
    async def main() -> tuple[list[Any], float]:
        await tool.create("i", ground_truth=truth)
        results = [await tool.execute("i", {"answer": a}) for a in answers]
        reward = await tool.calc_reward("i")
        await tool.release("i")
        return results, reward

    return run(main())


def test_reply_shows_the_parsed_answer_and_its_reward() -> None:
    (result,), reward = calls(Gsm8kTool(), ["72"])
    assert result.text == "Current parsed answer='72' reward=1.0"
    assert result.step_reward == 0.0
    assert reward == 1.0


def test_prefix_is_added_only_when_missing_and_non_strings_are_stringified() -> None:
    results, reward = calls(Gsm8kTool(), ["#### 72", 72, "The answer is 72."])
    assert [r.metrics["gsm8k_reward"] for r in results] == [1.0, 1.0, 1.0]
    assert results[1].text == "Current parsed answer='72' reward=1.0"
    assert reward == 1.0


def test_missing_or_wrong_answer_scores_zero_with_a_step_penalty() -> None:
    results, reward = calls(Gsm8kTool(), ["", "71"])
    assert [r.metrics["gsm8k_reward"] for r in results] == [0.0, 0.0]
    assert [r.step_reward for r in results] == [-0.05, -0.05]
    assert reward == 0.0


def test_best_mode_penalises_calls_that_do_not_beat_the_best_and_keeps_the_best() -> None:
    results, reward = calls(Gsm8kTool(), ["71", "72", "70", "72"])
    assert [r.step_reward for r in results] == [-0.05, 0.0, -0.05, -0.05]
    assert reward == 1.0


def test_last_mode_is_verls_compare_to_last_call_and_final_is_the_last() -> None:
    tool = Gsm8kTool(Gsm8kToolConfig(mode="last"))
    results, reward = calls(tool, ["71", "72", "70", "72"])
    assert [r.step_reward for r in results] == [-0.05, 0.0, -0.05, 0.0]
    results, reward = calls(Gsm8kTool(Gsm8kToolConfig(mode="last")), ["72", "70"])
    assert reward == 0.0


def test_thousands_separators_are_not_part_of_the_answer() -> None:
    (result,), _ = calls(Gsm8kTool(), ["1,234"], truth="1234")
    assert result.metrics["gsm8k_reward"] == 1.0


def test_instances_are_separate_and_released() -> None:
    async def main() -> None:
        tool = Gsm8kTool()
        await tool.create("a", ground_truth="1")
        await tool.create("b", ground_truth="2")
        await tool.execute("a", {"answer": "1"})
        await tool.execute("b", {"answer": "1"})
        assert (await tool.calc_reward("a"), await tool.calc_reward("b")) == (1.0, 0.0)
        await tool.release("a")
        await tool.release("b")
        assert tool.open_instances == 0

    run(main())


def test_in_a_session_with_create_kwargs_and_release_on_exit() -> None:
    async def main() -> None:
        tool = Gsm8kTool()
        toolset = ToolSet({tool.name: tool}, {tool.name: ToolLimits(timeout_s=5)})
        assert toolset.schemas()[0]["function"]["name"] == "calc_gsm8k_reward"
        async with toolset.session("s1", {"calc_gsm8k_reward": {"ground_truth": "18"}}) as s:
            result = await s.call("calc_gsm8k_reward", {"answer": "18"})
            assert result.status == "ok" and "reward=1.0" in result.text
            assert await s.rewards() == {"calc_gsm8k_reward": 1.0}
        assert tool.open_instances == 0

    run(main())


def test_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="bogus"):
        Gsm8kTool.from_config({"bogus": 1}, None)
