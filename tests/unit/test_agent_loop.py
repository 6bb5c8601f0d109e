"""The multi-turn agent loop with the scripted engine, a real tokenizer and hand-written tools."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from fakes.scripted_engine import ScriptCall, ScriptedEngine, ramble
from tailcut.chat.parser import format_tool_call
from tailcut.chat.template import decode, encode, render_ids
from tailcut.config import AgentLoopConfig
from tailcut.engine.base import BaseEngine, EngineError
from tailcut.rollout.agent_loop import TRUNCATION_MARK, AgentLoop
from tailcut.rollout.cutoff import TargetCount
from tailcut.rollout.scheduler import run_step
from tailcut.rollout.seeds import TRAIN_STREAM, mix, seed_samples
from tailcut.tools.base import ToolResult, ToolSet
from tailcut.trace.events import NULL_TRACER, Tracer, read_trace
from tailcut.types import FinishReason, GenerateRequest, GenerateResult, Sample, Status
from tailcut.vtime import run_virtual

TOKEN_S = 0.01


class FakeTool:
    """Answers with ``reply(arguments)`` after ``delay_s`` (virtual time); records its life cycle."""

    def __init__(
        self,
        name: str = "echo",
        reply: Callable[[dict[str, Any]], str] = lambda a: json.dumps(a, sort_keys=True),
        delay_s: float = 0.0,
        reward: float = 0.0,
    ) -> None:
        self.name = name
        self.reply = reply
        self.delay_s = delay_s
        self.reward = reward
        self.created: dict[str, dict[str, Any]] = {}
        self.calls: list[dict[str, Any]] = []
        self.released: list[str] = []
        self.cancelled = 0

    def schema(self) -> dict[str, Any]:
        params = {"type": "object", "properties": {"text": {"type": "string"}}}
        return {"type": "function", "function": {"name": self.name, "parameters": params}}

    async def create(self, instance_id: str, **create_kwargs: Any) -> None:
        self.created[instance_id] = create_kwargs

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        self.calls.append(arguments)
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return ToolResult(self.reply(arguments))

    async def calc_reward(self, instance_id: str) -> float:
        return self.reward

    async def release(self, instance_id: str) -> None:
        self.released.append(instance_id)


def _script(replies: Sequence[str]) -> Callable[[ScriptCall], str]:
    return lambda call: replies[min(call.turn, len(replies) - 1)]


def _sample(
    index: int = 0, question: str = "How many clips did Natalia sell?", **data: Any
) -> Sample:
    prompt = [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": question},
    ]
    return Sample(index=index, data={"prompt": prompt, **data})


def _run(loop: AgentLoop, sample: Sample, engine: Any, tracer: Tracer = NULL_TRACER) -> None:
    run_virtual(loop(sample, engine, tracer))


def _assert_aligned(tok: Any, sample: Sample, replies: Sequence[str]) -> None:
    n = len(sample.response_ids)
    assert len(sample.loss_mask) == len(sample.logprobs) == len(sample.versions) == n
    sampled = [t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if m]
    assert decode(tok, sampled) == "".join(replies)
    for m, lp, v in zip(sample.loss_mask, sample.logprobs, sample.versions, strict=True):
        assert (lp == 0.0 and v == -1) if m == 0 else (lp < 0.0 and v >= 0)


def test_tool_call_then_answer_stops_with_reward_and_exact_tokens(chat_tokenizer, tmp_path):
    tok = chat_tokenizer
    tool = FakeTool(reward=0.5)
    replies = ["Let me check.\n" + format_tool_call("echo", {"text": "72"}), "It is 72.\n#### 72"]
    seen: list[tuple[FinishReason | None, dict[str, float]]] = []

    def reward_fn(sample: Sample, tool_rewards: dict[str, float]) -> float:
        seen.append((sample.finish_reason, dict(tool_rewards)))
        return 1.0

    loop = AgentLoop(tok, toolset=ToolSet({"echo": tool}), reward_fn=reward_fn)
    sample = _sample(
        extra_info={"tools_kwargs": {"echo": {"create_kwargs": {"ground_truth": "72"}}}}
    )

    async def main() -> None:
        clock = asyncio.get_running_loop().time
        with Tracer.for_step(tmp_path, 0, 0, clock=clock) as tracer:
            await loop(sample, ScriptedEngine(tok, _script(replies)), tracer)

    run_virtual(main())
    assert sample.finish_reason is FinishReason.STOP
    assert [t.finish_reason for t in sample.turns] == [FinishReason.STOP, FinishReason.STOP]
    assert tool.calls == [{"text": "72"}]
    assert list(tool.created.values()) == [{"ground_truth": "72"}]
    assert tool.released == list(tool.created)
    assert seen == [(FinishReason.STOP, {"echo": 0.5})]
    assert sample.reward == 1.0 and sample.reward_info == {"tool/echo": 0.5}
    _assert_aligned(tok, sample, [r + "<|im_end|>" for r in replies])
    # Incremental ids ≡ a full re-render of the final conversation (+ the closing newline).
    full = render_ids(tok, sample.messages, ToolSet({"echo": tool}).schemas())
    assert [*sample.prompt_ids, *sample.response_ids, *encode(tok, "\n")] == full
    assert sample.messages[3] == {"role": "tool", "name": "echo", "content": '{"text": "72"}'}
    kinds = [e["event"] for e in read_trace(tmp_path / "step_0" / "worker_0.jsonl")]
    assert kinds == [
        "turn_start", "turn_engine_call", "tool_call", "turn_end",
        "turn_start", "turn_engine_call", "turn_end",
    ]  # fmt: skip


def test_each_engine_call_gets_the_seed_of_its_sample_and_its_number(chat_tokenizer):
    tok = chat_tokenizer
    seeds: list[int | None] = []

    class Recording(ScriptedEngine):
        async def generate(self, request: GenerateRequest) -> GenerateResult:
            seeds.append(request.sampling.seed)
            return await super().generate(request)

    replies = [format_tool_call("echo", {"text": "1"}), "#### 1"]
    loop = AgentLoop(tok, toolset=ToolSet({"echo": FakeTool()}))
    seeded = _sample(index=9)
    seed_samples([seeded], 3, TRAIN_STREAM, 4)
    _run(loop, seeded, Recording(tok, _script(replies)))
    assert seeds == [mix(mix(3, 0, 4, 9), 1), mix(mix(3, 0, 4, 9), 2)]
    _run(loop, _sample(), Recording(tok, _script(replies)))  # unseeded: the engine's own
    assert seeds[2:] == [None, None]


def test_max_turns_ends_on_the_models_last_token_without_running_its_calls(chat_tokenizer):
    tool = FakeTool()
    loop = AgentLoop(chat_tokenizer, AgentLoopConfig(max_turns=3), toolset=ToolSet({"echo": tool}))
    sample = _sample()
    _run(loop, sample, ScriptedEngine(chat_tokenizer, _script([format_tool_call("echo", {})])))
    assert sample.finish_reason is FinishReason.MAX_TURNS
    assert len(sample.turns) == 3 and len(tool.calls) == 2
    assert sample.loss_mask[-1] == 1
    assert len(tool.released) == 1


def test_engine_length_ends_the_trajectory(chat_tokenizer):
    cfg = AgentLoopConfig(max_new_tokens=20)
    sample = _sample()
    engine = ScriptedEngine(chat_tokenizer, _script([ramble(200)]))
    _run(AgentLoop(chat_tokenizer, cfg), sample, engine)
    assert sample.finish_reason is FinishReason.LENGTH
    assert sample.turns[0].output_tokens == 20 == len(sample.response_ids)
    assert sum(sample.loss_mask) == 20


def test_response_budget_spans_turns_and_never_ends_on_tool_output(chat_tokenizer):
    tok = chat_tokenizer
    call = format_tool_call("echo", {})
    n_call = len(encode(tok, call)) + 1
    tool = FakeTool(reply=lambda a: "short")
    engine = ScriptedEngine(tok, _script([call, call, "done"]))
    budget = 2 * n_call + 25  # room for two calls and one tool response, not two
    loop = AgentLoop(
        tok, AgentLoopConfig(max_response_tokens=budget), toolset=ToolSet({"echo": tool})
    )
    sample = _sample()
    _run(loop, sample, engine)
    forced = len(sample.response_ids) - sum(sample.loss_mask)
    budgets = [r.sampling.max_new_tokens for r in engine.requests]
    assert budgets[0] == budget
    assert budgets[1] == budgets[0] - n_call - forced  # what is left after turn 0
    # Turn 1's tool output would not fit: the trajectory ends on the model's token.
    assert sample.finish_reason is FinishReason.LENGTH and len(sample.turns) == 2
    assert sample.loss_mask[-1] == 1 and len(tool.calls) == 2
    assert len(sample.response_ids) <= budget
    # so does the conversation: turn 1's tool answer left with its tokens (a resumed or
    # re-rendered trajectory must find the messages its tokens are)
    assert [m["role"] for m in sample.messages[2:]] == ["assistant", "tool", "assistant"]


def test_malformed_unknown_and_oversized_calls_become_tool_messages(chat_tokenizer):
    tok = chat_tokenizer
    tool = FakeTool(reply=lambda a: "x" * 5000)
    cfg = AgentLoopConfig(max_tool_call_chars=100, max_tool_response_chars=64)
    reply0 = (
        'Trying.\n<tool_call>\n{"name": "echo", "arguments": {\n</tool_call>\n'
        + format_tool_call("nope", {"a": 1})
        + format_tool_call("echo", {"text": "y" * 200})
        + format_tool_call("echo", {"text": "big"})
    )
    replies = [reply0, "Giving up: 0"]
    sample = _sample()
    _run(
        AgentLoop(tok, cfg, toolset=ToolSet({"echo": tool})),
        sample,
        ScriptedEngine(tok, _script(replies)),
    )
    assert sample.finish_reason is FinishReason.STOP
    turn = sample.turns[0]
    assert (turn.tool_calls, turn.tool_errors, turn.tool_parse_errors) == (4, 3, 2)
    tool_msgs = [m["content"] for m in sample.messages if m["role"] == "tool"]
    assert len(tool_msgs) == 4
    assert "could not parse tool call: invalid JSON" in tool_msgs[0]
    assert "unknown tool 'nope'" in tool_msgs[1]
    assert "limit is 100" in tool_msgs[2]
    assert tool_msgs[3] == "x" * 64 + TRUNCATION_MARK
    assert tool.calls == [{"text": "big"}]
    _assert_aligned(tok, sample, [r + "<|im_end|>" for r in replies])


def test_calls_over_the_per_turn_limit_are_answered_not_run(chat_tokenizer):
    tool = FakeTool()
    calls = "".join(format_tool_call("echo", {"text": str(k)}) for k in range(4))
    sample = _sample()
    loop = AgentLoop(
        chat_tokenizer, AgentLoopConfig(max_tool_calls_per_turn=2), toolset=ToolSet({"echo": tool})
    )
    _run(loop, sample, ScriptedEngine(chat_tokenizer, _script([calls, "ok"])))
    assert tool.calls == [{"text": "0"}, {"text": "1"}]
    tool_msgs = [m["content"] for m in sample.messages if m["role"] == "tool"]
    assert [("at most 2 tool calls" in m) for m in tool_msgs] == [False, False, True, True]
    assert sample.turns[0].tool_errors == 2


def test_a_turns_calls_run_concurrently(chat_tokenizer):
    tool = FakeTool(delay_s=1.0)
    calls = format_tool_call("echo", {"text": "a"}) + format_tool_call("echo", {"text": "b"})
    sample = _sample()
    loop = AgentLoop(chat_tokenizer, toolset=ToolSet({"echo": tool}))
    _run(loop, sample, ScriptedEngine(chat_tokenizer, _script([calls, "ok"])))
    assert sample.turns[0].tool_s == pytest.approx(1.0)  # not 2.0
    assert sample.finish_reason is FinishReason.STOP


def _first_turn_seconds(tok: Any, reply: str) -> float:
    return (len(encode(tok, reply)) + 1) * TOKEN_S


async def _cut_at(coro: Any, at: float) -> None:
    task = asyncio.create_task(coro)
    await asyncio.sleep(at)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_cancel_mid_generate_aborts_the_request_and_keeps_earlier_turns(chat_tokenizer):
    tok = chat_tokenizer
    tool = FakeTool(delay_s=0.5)
    reply0 = format_tool_call("echo", {"text": "a"})
    engine = ScriptedEngine(tok, _script([reply0, ramble(400)]), token_delay_s=TOKEN_S)
    rewarded: list[Sample] = []
    loop = AgentLoop(
        tok, toolset=ToolSet({"echo": tool}), reward_fn=lambda s, r: rewarded.append(s) or 1.0
    )
    sample = _sample()
    cut = _first_turn_seconds(tok, reply0) + 0.5 + 0.105
    run_virtual(_cut_at(loop(sample, engine, NULL_TRACER), cut))
    assert sample.finish_reason is FinishReason.ABORT
    assert engine.aborted == [engine.requests[1].request_id]
    assert engine.abort_requests == [engine.requests[1].request_id]  # cancel ⇒ abort
    assert sample.active_request_id is None
    assert [t.finish_reason for t in sample.turns] == [FinishReason.STOP, FinishReason.ABORT]
    assert tool.released == list(tool.created) and len(tool.released) == 1
    assert rewarded == [] and sample.reward is None
    _assert_aligned(tok, sample, [reply0 + "<|im_end|>"])  # turn 0 kept, mask intact
    assert decode(tok, sample.response_ids).endswith("<|im_start|>assistant\n")


def test_engine_abort_mid_generate_keeps_the_partial_tokens(chat_tokenizer):
    tok = chat_tokenizer
    engine = ScriptedEngine(tok, _script([ramble(400)]), token_delay_s=TOKEN_S)
    sample = _sample()

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(AgentLoop(tok)(sample, engine, NULL_TRACER))
            await asyncio.sleep(0.105)
            assert sample.active_request_id is not None
            await engine.abort([sample.active_request_id])

    run_virtual(main())
    assert sample.finish_reason is FinishReason.ABORT
    assert sample.turns[0].output_tokens == 10 == sum(sample.loss_mask) == len(sample.response_ids)
    assert decode(tok, sample.response_ids) == decode(tok, encode(tok, ramble(400))[:10])
    assert sample.reward is None


def test_cancel_mid_tool_cancels_calls_releases_and_keeps_the_turn(chat_tokenizer, tmp_path):
    tok = chat_tokenizer
    tool = FakeTool(delay_s=5.0)
    reply0 = format_tool_call("echo", {"text": "a"}) + format_tool_call("echo", {"text": "b"})
    engine = ScriptedEngine(tok, _script([reply0, "never"]), token_delay_s=TOKEN_S)
    loop = AgentLoop(tok, toolset=ToolSet({"echo": tool}))
    sample = _sample()

    async def main() -> None:
        clock = asyncio.get_running_loop().time
        with Tracer.for_step(tmp_path, 0, 0, clock=clock) as tracer:
            await _cut_at(loop(sample, engine, tracer), _first_turn_seconds(tok, reply0) + 1.0)

    run_virtual(main())
    assert tool.cancelled == 2 and len(tool.calls) == 2
    assert tool.released == list(tool.created) and len(tool.released) == 1
    assert sample.finish_reason is FinishReason.ABORT and len(sample.turns) == 1
    assert sample.turns[0].tool_s == pytest.approx(1.0) and sample.turns[0].tool_calls == 2
    assert len(engine.requests) == 1 and engine.aborted == []
    _assert_aligned(tok, sample, [reply0 + "<|im_end|>"])
    assert all(sample.loss_mask)
    events = read_trace(tmp_path / "step_0" / "worker_0.jsonl")
    assert [(e["event"], e["extra"].get("status")) for e in events] == [
        ("turn_start", None),
        ("turn_engine_call", None),
        ("tool_call", "cancelled"),
        ("tool_call", "cancelled"),
        ("turn_end", "cancelled"),
    ]
    assert events[-1]["duration_sec"] == pytest.approx(_first_turn_seconds(tok, reply0) + 1.0)


def test_a_raising_reward_fn_propagates_after_tools_are_released(chat_tokenizer):
    tool = FakeTool()

    def reward_fn(sample: Sample, tool_rewards: dict[str, float]) -> float:
        raise ValueError("ground truth 'abc' is not a number")

    loop = AgentLoop(chat_tokenizer, toolset=ToolSet({"echo": tool}), reward_fn=reward_fn)
    sample = _sample()
    engine = ScriptedEngine(chat_tokenizer, _script([format_tool_call("echo", {}), "4"]))
    with pytest.raises(ValueError, match="is not a number"):
        _run(loop, sample, engine)
    assert sample.finish_reason is FinishReason.FAILED
    assert len(tool.released) == 1 and len(sample.turns) == 2


def test_an_async_reward_fn_is_awaited(chat_tokenizer):
    async def reward_fn(sample: Sample, tool_rewards: dict[str, float]) -> float:
        await asyncio.sleep(0.1)
        return 0.25

    sample = _sample()
    _run(
        AgentLoop(chat_tokenizer, reward_fn=reward_fn),
        sample,
        ScriptedEngine(chat_tokenizer, _script(["4"])),
    )
    assert sample.reward == 0.25


class _FailingEngine(BaseEngine):
    name = "failing"

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        return GenerateResult(
            request.request_id, [], FinishReason.FAILED, logprobs=[], error="CUDA OOM"
        )

    async def abort(self, request_ids: Sequence[str]) -> None:
        return None

    async def in_flight(self) -> list[str]:
        return []


def test_an_engine_failure_raises_naming_the_request(chat_tokenizer):
    sample = _sample()
    with pytest.raises(EngineError, match=r"engine failing failed request tc-.*: CUDA OOM"):
        _run(AgentLoop(chat_tokenizer), sample, _FailingEngine())
    assert sample.finish_reason is FinishReason.FAILED


def test_bad_prompts_are_named(chat_tokenizer):
    loop = AgentLoop(chat_tokenizer)
    engine = ScriptedEngine(chat_tokenizer, _script(["4"]))
    with pytest.raises(ValueError, match="sample 5: data has no 'messages' or 'prompt'"):
        _run(loop, Sample(index=5), engine)
    with pytest.raises(ValueError, match="sample 6: prompt message 0 needs string 'role'"):
        _run(loop, Sample(index=6, data={"prompt": [{"content": "x"}]}), engine)
    with pytest.raises(ValueError, match="sample 7: 'messages' is empty"):
        _run(loop, Sample(index=7, data={"messages": []}), engine)
    done = _sample()
    _run(loop, done, engine)
    with pytest.raises(ValueError, match="already holds a response"):
        _run(loop, done, engine)


def test_a_cut_step_through_the_scheduler(chat_tokenizer):
    """Two quick answers complete; the cut aborts a rambling generate (partial tokens kept)
    and cancels a slow tool call (released)."""
    tok = chat_tokenizer
    tool = FakeTool(delay_s=30.0)
    slow_call = format_tool_call("echo", {"text": "slow"})
    quick = ramble(len(encode(tok, slow_call)) + 10) + "\n#### 4"  # done after the call started

    def script(call: ScriptCall) -> str:
        if "slow" in call.prompt_text and call.turn == 0:
            return slow_call
        return ramble(1000) if "long" in call.prompt_text else quick

    engine = ScriptedEngine(tok, script, token_delay_s=TOKEN_S)
    loop = AgentLoop(
        tok,
        AgentLoopConfig(max_new_tokens=2000, max_response_tokens=4000),
        toolset=ToolSet({"echo": tool}),
    )
    samples = [_sample(i, q) for i, q in enumerate(["quick a", "quick b", "long", "slow"])]

    async def main() -> Any:
        return await run_step(engine, samples, loop, TargetCount(4, abort_ratio=0.5), NULL_TRACER)

    result = run_virtual(main())
    assert [s.status for s in result.samples] == [
        Status.COMPLETED, Status.COMPLETED, Status.ABORTED, Status.ABORTED,
    ]  # fmt: skip
    assert result.kept == [0, 1]
    assert result.cut_time_s == pytest.approx(_first_turn_seconds(tok, quick))
    long, slow = result.samples[2], result.samples[3]
    assert long.turns[0].finish_reason is FinishReason.ABORT
    assert 0 < long.turns[0].output_tokens == sum(long.loss_mask) == len(long.response_ids)
    assert engine.aborted == [long.turns[0].request_id]
    assert tool.cancelled == 1 and len(tool.released) == 1
    assert slow.finish_reason is FinishReason.ABORT and all(slow.loss_mask)
    assert run_virtual(engine.in_flight()) == []


def test_a_validated_prompt_row_layout_is_accepted(chat_tokenizer):
    """``PromptRow.as_data()``: ``messages`` and top-level ``tools_kwargs``."""
    tool = FakeTool()
    data = {
        "messages": [{"role": "user", "content": "2+2?"}],
        "tools_kwargs": {"echo": {"create_kwargs": {"ground_truth": "4"}}},
    }
    sample = Sample(index=0, data=data)
    engine = ScriptedEngine(chat_tokenizer, _script([format_tool_call("echo", {}), "#### 4"]))
    _run(AgentLoop(chat_tokenizer, toolset=ToolSet({"echo": tool})), sample, engine)
    assert sample.finish_reason is FinishReason.STOP
    assert list(tool.created.values()) == [{"ground_truth": "4"}]
    assert sample.messages[0] == {"role": "user", "content": "2+2?"}


def test_a_cut_while_a_whole_trajectory_is_scored_keeps_it(chat_tokenizer):
    """The cut lands while a finished trajectory's (slow) reward runs: the trajectory is
    scored and kept, not aborted; a trajectory still generating is aborted."""
    tok = chat_tokenizer

    async def reward_fn(sample: Sample, tool_rewards: dict[str, float]) -> float:
        await asyncio.sleep(1.0 if "graded slowly" in sample.data["prompt"][1]["content"] else 0.0)
        return 1.0

    def script(call: ScriptCall) -> str:
        return ramble(1000) if "long" in call.prompt_text else "#### 4"

    engine = ScriptedEngine(tok, script, token_delay_s=TOKEN_S)
    loop = AgentLoop(tok, AgentLoopConfig(max_new_tokens=2000), reward_fn=reward_fn)
    questions = ["quick a", "quick b", "graded slowly", "long"]
    samples = [_sample(i, q) for i, q in enumerate(questions)]

    async def main() -> Any:
        return await run_step(engine, samples, loop, TargetCount(4, abort_ratio=0.5), NULL_TRACER)

    result = run_virtual(main())
    assert [s.status for s in result.samples] == [
        Status.COMPLETED, Status.COMPLETED, Status.COMPLETED, Status.ABORTED,
    ]  # fmt: skip
    assert result.kept == [0, 1] and result.samples[2].reward == 1.0
    assert result.cut_time_s is not None and result.cut_time_s < 1.0 < result.step_time_s
