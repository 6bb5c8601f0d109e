"""Hypothesis: a trajectory cut at any point (inside a generation, inside a tool call, between
turns; once or twice) and resumed obeys every cap an uncut one obeys — tokens per turn,
response tokens, turns — records each turn once, and with the same seed stream samples exactly
the tokens of the uncut trajectory."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from fakes.scripted_engine import ScriptCall, ScriptedEngine, ramble
from tailcut.chat.parser import format_tool_call
from tailcut.config import AgentLoopConfig
from tailcut.rollout.cutoff import WaitAll
from tailcut.rollout.partial import resume_copy
from tailcut.rollout.resume import ResumableAgentLoop
from tailcut.rollout.scheduler import run_step
from tailcut.tools.base import ToolResult, ToolSet
from tailcut.trace.events import NULL_TRACER
from tailcut.types import Sample, Status
from tailcut.vtime import run_virtual

TOKEN_S = 0.01


class SlowTool:
    """Answers after 0.05 s of virtual time, so a cut can land inside a tool call."""

    name = "slow"

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "slow", "parameters": {"type": "object"}}}

    async def create(self, instance_id: str, **kwargs: Any) -> None:
        return None

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        await asyncio.sleep(0.05)
        return ToolResult("7")

    async def calc_reward(self, instance_id: str) -> float:
        return 0.0

    async def release(self, instance_id: str) -> None:
        return None


def script(call: ScriptCall) -> str:
    """Replies are a function of the call's seed: tool calls for a few turns, then a ramble of
    seed-dependent length (some longer than a turn may sample) and an answer."""
    seed = call.request.sampling.seed or 0
    if call.turn < seed % 3:
        return f"Step {call.turn}.\n" + format_tool_call("slow", {})
    return ramble(3 + seed % 30, seed) + "\n#### 1"


def run(sample: Sample, loop: ResumableAgentLoop, tokenizer: Any, cut_at: float | None) -> None:
    engine = ScriptedEngine(tokenizer, script, token_delay_s=TOKEN_S)
    run_virtual(run_step(engine, [sample], loop, WaitAll(1), NULL_TRACER, timeout_s=cut_at))


def sampled_runs(s: Sample) -> list[int]:
    """Lengths of the runs of sampled tokens: one per assistant message."""
    runs, n = [], 0
    for m in s.loss_mask:
        if m:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return [*runs, n] if n else runs


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    max_new=st.integers(4, 40),
    max_response=st.integers(20, 160),
    max_turns=st.integers(1, 4),
    cuts=st.lists(st.floats(0.01, 0.99), min_size=1, max_size=2),
)
def test_cut_and_resumed_obeys_the_caps_and_samples_the_uncut_tokens(
    chat_tokenizer: Any, seed: int, max_new: int, max_response: int, max_turns: int,
    cuts: list[float],
) -> None:  # fmt: skip
    cfg = AgentLoopConfig(
        max_new_tokens=max_new, max_response_tokens=max_response, max_turns=max_turns
    )
    loop = ResumableAgentLoop(chat_tokenizer, cfg, toolset=ToolSet({"slow": SlowTool()}))
    prompt = [{"role": "user", "content": "Count."}]
    uncut = Sample(index=0, data={"prompt": prompt}, seed=seed)
    run(uncut, loop, chat_tokenizer, None)
    assert uncut.status in (Status.COMPLETED, Status.TRUNCATED)
    span = uncut.duration_s or 0.0

    s = Sample(index=0, data={"prompt": prompt}, seed=seed)
    for k, frac in enumerate(cuts):
        run(s, loop, chat_tokenizer, frac * span)
        if s.status is not Status.ABORTED:
            break
        s = resume_copy(s, started_step=k)
    else:
        run(s, loop, chat_tokenizer, None)

    assert s.status is uncut.status and s.finish_reason is uncut.finish_reason
    assert list(s.response_ids) == list(uncut.response_ids)
    assert list(s.loss_mask) == list(uncut.loss_mask)
    assert s.messages == uncut.messages  # the conversation the reward reads
    assert len(s.response_ids) <= max_response
    assert all(n <= max_new for n in sampled_runs(s))
    assert [t.index for t in s.turns] == list(range(len(uncut.turns)))  # each turn once
    assert [t.output_tokens for t in s.turns] == [t.output_tokens for t in uncut.turns]
    assert all(t.output_tokens <= max_new for t in s.turns)
    assert s.generated_tokens == uncut.generated_tokens
    assert len(s.turns) <= max_turns
