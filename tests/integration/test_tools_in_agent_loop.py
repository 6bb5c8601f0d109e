"""The real tools and rewards inside the agent loop and the over-sampled step: the GSM8K
tool and reward end to end, a raising reward making the sample FAILED, and a cut landing
while the code sandbox runs (no process left, run dir gone, tool released)."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakes.procs import marked_processes
from fakes.scripted_engine import ScriptCall, ScriptedEngine
from tailcut.chat.parser import format_tool_call
from tailcut.reward.registry import (
    RewardInput,
    RewardOutput,
    RewardRegistry,
    default_registry,
    sample_reward_fn,
)
from tailcut.rollout.agent_loop import AgentLoop
from tailcut.rollout.cutoff import TargetCount, WaitAll
from tailcut.rollout.scheduler import run_step
from tailcut.rollout.step import StepResult
from tailcut.tools.base import ToolSet
from tailcut.tools.code_interpreter import CodeInterpreterConfig, CodeInterpreterTool
from tailcut.tools.gsm8k import Gsm8kTool
from tailcut.tools.sandbox import SandboxConfig
from tailcut.trace.events import NULL_TRACER
from tailcut.types import FinishReason, Sample, Status

pytestmark = pytest.mark.timeout(120)


def gsm8k_sample(index: int, question: str, truth: str) -> Sample:
    data = {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "Call calc_gsm8k_reward before answering after ####."},
            {"role": "user", "content": question},
        ],
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}}
        },
    }
    return Sample(index=index, group=index, data=data)


def gsm8k_script(call: ScriptCall) -> str:
    if call.turn == 0:
        return "48 + 24 = 72\n" + format_tool_call("calc_gsm8k_reward", {"answer": "72"})
    return "The tool agrees.\n#### 72"


def run_gsm8k(chat_tokenizer: Any, registry: RewardRegistry) -> tuple[StepResult, Gsm8kTool]:
    tool = Gsm8kTool()
    loop = AgentLoop(
        chat_tokenizer, toolset=ToolSet({tool.name: tool}), reward_fn=sample_reward_fn(registry)
    )
    samples = [gsm8k_sample(0, "Natalia sold 48 clips and then 24. How many?", "72"),
               gsm8k_sample(1, "Same question, other truth", "71")]  # fmt: skip

    async def main() -> StepResult:
        try:
            engine = ScriptedEngine(chat_tokenizer, gsm8k_script)
            return await run_step(engine, samples, loop, WaitAll(2), NULL_TRACER)
        finally:
            await registry.aclose()

    return asyncio.run(main()), tool


def test_gsm8k_tool_and_reward_end_to_end(chat_tokenizer: Any) -> None:
    result, tool = run_gsm8k(chat_tokenizer, default_registry())
    right, wrong = result.samples
    assert right.status is Status.COMPLETED and wrong.status is Status.COMPLETED
    assert right.reward == 1.0 and wrong.reward == 0.0
    assert right.reward_info["tool/calc_gsm8k_reward"] == 1.0
    assert wrong.reward_info["tool/calc_gsm8k_reward"] == 0.0
    tool_messages = [m["content"] for m in right.messages if m["role"] == "tool"]
    assert tool_messages == ["Current parsed answer='72' reward=1.0"]
    assert tool.open_instances == 0


def _boom(inp: RewardInput) -> RewardOutput:
    raise KeyError("no such field in ground truth")


def test_a_raising_reward_makes_the_sample_failed_with_the_error(chat_tokenizer: Any) -> None:
    registry = RewardRegistry()
    registry.register("boom", _boom, data_sources=("openai/gsm8k",))
    result, tool = run_gsm8k(chat_tokenizer, registry)
    for sample in result.samples:
        assert sample.status is Status.FAILED
        assert sample.reward is None
        assert sample.error is not None and "reward 'boom' failed" in sample.error
    assert result.failed == 2
    assert tool.open_instances == 0


@pytest.fixture
def runs_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tailcut-loop-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_cut_while_the_sandbox_runs_kills_it_and_releases_the_tool(
    chat_tokenizer: Any, runs_dir: Path
) -> None:
    mark = "loop-" + secrets.token_hex(4)
    cfg = CodeInterpreterConfig(sandbox=SandboxConfig(
        timeout_s=60, tmp_dir=str(runs_dir), env={"SANDBOX_TEST_MARK": mark},
        uid_base=330_000, uid_count=64))  # fmt: skip
    tool = CodeInterpreterTool(cfg)

    def script(call: ScriptCall) -> str:
        if call.turn > 0:
            return "#### 4"
        seconds = 60 if "slow" in call.prompt_text else 0.3
        code = f"import time\ntime.sleep({seconds})\nprint(4)"
        return format_tool_call("code_interpreter", {"code": code})

    samples = [Sample(index=i, group=i, data={"prompt": [{"role": "user", "content": q}]})
               for i, q in enumerate(["quick one", "slow one"])]  # fmt: skip
    loop = AgentLoop(chat_tokenizer, toolset=ToolSet({tool.name: tool}))

    async def main() -> StepResult:
        engine = ScriptedEngine(chat_tokenizer, script)
        return await run_step(engine, samples, loop, TargetCount(2, abort_ratio=0.5), NULL_TRACER)

    result = asyncio.run(main())
    quick, slow = result.samples
    assert quick.status is Status.COMPLETED
    assert slow.status is Status.ABORTED and slow.finish_reason is FinishReason.ABORT
    assert len(slow.turns) == 1  # the partial trajectory is kept
    assert tool.open_instances == 0
    assert marked_processes(mark) == []
    assert list(runs_dir.iterdir()) == []
